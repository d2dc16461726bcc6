"""TOKENS' optional prompt counts ("pt", "ct") in overlay/core/wire.py (pure): the serving
node's prompt and cached token counts on its first TOKENS frame, so an entry that stops
reading before FINAL (a stop sequence) still reports the usage. Round trips, old frames
unchanged, limits, and fuzzing of mutated frames."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import wire as w


@st.composite
def counted_tokens(draw):
    prompt = draw(st.integers(0, w.MAX_PROMPT_TOKENS))
    cached = draw(st.integers(-1, prompt)) if prompt else -1
    return w.Tokens(draw(st.text(max_size=40)),
                    tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=6))),
                    prompt_tokens=prompt, cached_tokens=cached)


def _rt(frame):
    return w.decode_body(w.encode_frame(frame)[4:])


@settings(max_examples=200, deadline=None)
@given(counted_tokens())
def test_roundtrip(frame):
    once = _rt(frame)
    assert once == frame
    assert _rt(once) == once


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(0, 2**32 - 1), max_size=6))
def test_frames_without_counts_encode_as_before(text, ids):
    """A TOKENS frame that says no counts has the old keys only (byte for byte the frame an
    older node sends), and an old frame decodes as one with no counts."""
    frame = w.Tokens(text, tuple(ids))
    body = w.encode_frame(frame)[4:]
    old = cbor2.dumps({"t": "tok", "x": text, "ids": w._pack_ids(ids)}, canonical=True)
    assert body == old
    decoded = w.decode_body(old)
    assert (decoded.prompt_tokens, decoded.cached_tokens) == (0, -1)


@settings(max_examples=200, deadline=None)
@given(counted_tokens(), st.data())
def test_mutated_frames_only_raise_wire_error(frame, data):
    body = bytearray(w.encode_frame(frame)[4:])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    try:
        decoded = w.decode_body(bytes(body))
    except w.WireError:
        return
    if isinstance(decoded, w.Tokens):  # whatever decodes keeps the counts' invariants
        assert 0 <= decoded.prompt_tokens <= w.MAX_PROMPT_TOKENS
        assert decoded.cached_tokens <= decoded.prompt_tokens
        assert decoded.prompt_tokens or decoded.cached_tokens == -1


def test_keys_present_only_when_said():
    def keys(frame):
        return set(cbor2.loads(w.encode_frame(frame)[4:]))

    assert keys(w.Tokens("a", (1,), prompt_tokens=9)) == {"t", "x", "ids", "pt"}
    assert keys(w.Tokens("a", (1,), prompt_tokens=9, cached_tokens=0)) == \
        {"t", "x", "ids", "pt", "ct"}
    assert _rt(w.Tokens("a", (1,), prompt_tokens=9, cached_tokens=0)).cached_tokens == 0


def _bad(key_values, match, error=w.InvalidField):
    obj = cbor2.loads(w.encode_frame(w.Tokens("a", (1,), prompt_tokens=9, cached_tokens=4))[4:])
    for key, value in key_values.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    with pytest.raises(error, match=match):
        w.decode_body(cbor2.dumps(obj, canonical=True))


def test_limits_and_types_are_enforced():
    _bad({"pt": None}, "comes with the prompt count")
    _bad({"pt": 0, "ct": None}, "outside", w.LimitExceeded)  # unknown: the key is omitted
    _bad({"pt": w.MAX_PROMPT_TOKENS + 1, "ct": None}, "outside", w.LimitExceeded)
    _bad({"ct": 10}, "outside", w.LimitExceeded)  # more cached than the prompt has
    _bad({"ct": -1}, "outside", w.LimitExceeded)
    _bad({"pt": 9.0}, "expected an integer")
    _bad({"ct": True}, "expected an integer")
    for frame in (w.Tokens("a", cached_tokens=3),  # a cached count alone
                  w.Tokens("a", prompt_tokens=2, cached_tokens=3),
                  w.Tokens("a", prompt_tokens=-1)):
        with pytest.raises(w.WireError):
            w.encode_frame(frame)  # the encoder validates as the decoder does
