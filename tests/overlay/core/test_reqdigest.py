"""The request content digest (overlay/core/reqdigest.py): what a tenant credential binds.

Field by field, from ``dataclasses.fields(wire.Request)``: changing a relay field leaves
the digest alone, changing any other field changes it. A field added to ``Request`` later
is covered by this test without editing it, unless its type is new (then the test says
which mutation to add)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.reqdigest import (
    DIGEST_BYTES,
    RELAY_FIELDS,
    content_digest,
    strip_relay_fields,
)

PEER = b"\x00\x24\x08\x01\x12\x20" + b"\x11" * 32

requests = st.builds(
    wire.Request,
    id=st.binary(min_size=1, max_size=32),
    ns=st.binary(min_size=8, max_size=8),
    credential=st.binary(max_size=32),
    messages=st.lists(st.builds(wire.Message, st.sampled_from(["system", "user"]),
                                st.text(max_size=40)), max_size=3).map(tuple),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50).map(tuple),
    sampling=st.builds(wire.Sampling, max_tokens=st.integers(0, 4096),
                       temperature=st.floats(0, 2), top_p=st.floats(0, 1),
                       seed=st.integers(0, 2**32 - 1)),
    deadline=st.floats(0, 4e9),
    hop_budget=st.integers(0, 8),
    visited=st.lists(st.just(PEER), max_size=2).map(tuple),
    stream=st.booleans(),
    grammar=st.sampled_from(["", 'root ::= "a"']),
    logprobs=st.integers(-1, 5),
)


def _mutate(value):
    """Another value of the same type (a different digest input)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1 if value < 4 else value - 1
    if isinstance(value, float):
        return value + 0.5 if value < 1 else value - 0.25
    if isinstance(value, bytes):
        return value + b"x" if len(value) < 32 else value[:-1]
    if isinstance(value, str):
        return value + " " if value else 'root ::= "b"'
    if isinstance(value, wire.Sampling):
        return dataclasses.replace(value, max_tokens=_mutate(value.max_tokens))
    if isinstance(value, tuple) and (not value or isinstance(value[0], wire.Message)):
        return (*value, wire.Message("user", "injected"))
    if isinstance(value, tuple) and isinstance(value[0], int):
        return (*value[:-1], _mutate(value[-1]))
    raise AssertionError(f"no mutation for {type(value).__name__}: add one to _mutate")


CONTENT_FIELDS = [f.name for f in dataclasses.fields(wire.Request) if f.name not in RELAY_FIELDS]


@settings(max_examples=150, deadline=None)
@given(req=requests, data=st.data())
def test_every_content_field_is_covered(req, data):
    name = data.draw(st.sampled_from(CONTENT_FIELDS))
    changed = dataclasses.replace(req, **{name: _mutate(getattr(req, name))})
    assert content_digest(changed) != content_digest(req), name


@settings(max_examples=150, deadline=None)
@given(req=requests, hb=st.integers(0, 8), n_visited=st.integers(0, 4),
       holders=st.lists(st.tuples(st.just(PEER), st.integers(1, 100)), max_size=3))
def test_relay_fields_do_not_change_the_digest(req, hb, n_visited, holders):
    hop = wire.Hop(peer=PEER, action="forward", reason="r", next_peer=PEER)
    relayed = dataclasses.replace(req, credential=b"\x01" * 32, hop_budget=hb,
                                  visited=(PEER,) * n_visited, trace=(hop,) * n_visited,
                                  holders=tuple(holders))
    assert content_digest(relayed) == content_digest(req)
    assert content_digest(strip_relay_fields(req)) == content_digest(req)


@settings(max_examples=100, deadline=None)
@given(req=requests)
def test_digest_is_deterministic_and_canonical(req):
    d = content_digest(req)
    assert len(d) == DIGEST_BYTES and content_digest(req) == d
    # the same request through the wire (encode, decode) has the same digest
    decoded = wire.decode_body(wire.encode_frame(req)[wire.LENGTH_PREFIX_BYTES:])
    assert content_digest(decoded) == d
    # an int deadline and the equal float are one wire value
    if req.deadline == int(req.deadline):
        assert content_digest(dataclasses.replace(req, deadline=int(req.deadline))) == d


def test_relay_fields_are_request_fields_and_the_rest_is_content():
    names = {f.name for f in dataclasses.fields(wire.Request)}
    assert RELAY_FIELDS <= names
    assert {"id", "ns", "tokens", "messages", "sampling", "deadline", "stream",
            "grammar", "logprobs", "model", "prompt"} <= set(CONTENT_FIELDS)


@settings(max_examples=100, deadline=None)
@given(prompt=st.text(min_size=1, max_size=80), other=st.text(min_size=1, max_size=80),
       model=st.binary(min_size=1, max_size=32))
def test_a_raw_prompt_is_content(prompt, other, model):
    """A relay that swaps a raw prompt for another model's node (or drops it) changes
    what the credential binds."""
    req = wire.Request(id=b"i" * 16, ns=b"n" * 8, prompt=prompt, model=model, deadline=1e9)
    if other != prompt:
        assert content_digest(dataclasses.replace(req, prompt=other)) != content_digest(req)
    as_tokens = dataclasses.replace(req, prompt="", tokens=tuple(prompt.encode()))
    assert content_digest(as_tokens) != content_digest(req)


def test_a_new_type_is_reported_clearly():
    with pytest.raises(AssertionError, match="add one to _mutate"):
        _mutate(object())
