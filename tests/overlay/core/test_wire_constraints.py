"""The optional constrained-output and logprobs fields of overlay/core/wire.py (pure):
REQUEST's grammar ("gr") and logprobs ("lp"), TOKENS' per-token logprobs ("lp").
Round trips, limits, omission when absent, and fuzzing of mutated frames."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import wire as w

pieces = st.binary(max_size=24)
logprobs = st.floats(min_value=-1e4, max_value=0.0, allow_nan=False)
entries = st.builds(
    w.TokenLogprob, piece=pieces, logprob=logprobs,
    top=st.lists(st.tuples(pieces, logprobs), max_size=w.MAX_TOP_LOGPROBS).map(tuple))
grammars = st.one_of(st.just(""), st.text(min_size=1, max_size=300).filter(
    lambda s: "\x00" not in s))
requests = st.builds(
    w.Request, id=st.binary(max_size=16), ns=st.binary(max_size=8),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20).map(tuple),
    grammar=grammars, logprobs=st.integers(-1, w.MAX_TOP_LOGPROBS))
tokens = st.builds(w.Tokens, text=st.text(max_size=50),
                   token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple),
                   logprobs=st.lists(entries, max_size=8).map(tuple))


def _rt(frame):
    return w.decode_body(w.encode_frame(frame)[4:])


@settings(max_examples=150, deadline=None)
@given(st.one_of(requests, tokens))
def test_roundtrip(frame):
    once = _rt(frame)
    assert _rt(once) == once
    assert type(once) is type(frame)
    if isinstance(frame, w.Request):
        assert (once.grammar, once.logprobs) == (frame.grammar, frame.logprobs)
    else:
        assert len(once.logprobs) == len(frame.logprobs)
        assert [e.piece for e in once.logprobs] == [e.piece for e in frame.logprobs]


@settings(max_examples=150, deadline=None)
@given(st.one_of(requests, tokens), st.data())
def test_mutated_frames_only_raise_wire_error(frame, data):
    body = bytearray(w.encode_frame(frame)[4:])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    try:
        w.decode_body(bytes(body))
    except w.WireError:
        pass


def test_absent_fields_are_omitted_so_old_frames_are_unchanged():
    req = w.Request(id=b"i", ns=b"n", tokens=(1, 2))
    obj = cbor2.loads(w.encode_frame(req)[4:])
    assert "gr" not in obj and "lp" not in obj
    tok = cbor2.loads(w.encode_frame(w.Tokens("x", (5,)))[4:])
    assert set(tok) == {"t", "x", "ids"}
    with_all = w.Request(id=b"i", ns=b"n", tokens=(1,), grammar='root ::= "a"', logprobs=0)
    obj = cbor2.loads(w.encode_frame(with_all)[4:])
    assert obj["gr"] == 'root ::= "a"' and obj["lp"] == 0
    assert _rt(with_all) == with_all


def _bad(frame, key, value, match):
    obj = cbor2.loads(w.encode_frame(frame)[4:])
    obj[key] = value
    with pytest.raises(w.InvalidField, match=match):
        w.decode_body(cbor2.dumps(obj, canonical=True))


def test_limits_and_types_are_enforced():
    req = w.Request(id=b"i", ns=b"n", tokens=(1,))
    _bad(req, "gr", "", "omitting the key")
    _bad(req, "gr", "x" * (w.MAX_GRAMMAR_CHARS + 1), "exceed")
    _bad(req, "gr", "root ::= \x00", "NUL")
    _bad(req, "gr", b"root", "expected text")
    _bad(req, "lp", w.MAX_TOP_LOGPROBS + 1, "outside")
    _bad(req, "lp", -1, "outside")  # -1 is sent by omitting the key
    tok = w.Tokens("a", (1,), (w.TokenLogprob(b"a", -0.5, ((b"a", -0.5),)),))
    _bad(tok, "lp", [], "omitting the key")
    _bad(tok, "lp", [[b"a", 0.5, []]], "outside")  # a probability above 1
    _bad(tok, "lp", [[b"a", float("nan"), []]], "outside")
    _bad(tok, "lp", [[b"a", -0.5]], "expected \\[piece, logprob, top\\]")
    _bad(tok, "lp", [[b"a", -0.5, [[b"b", -1.0]] * (w.MAX_TOP_LOGPROBS + 1)]], "exceed")
    _bad(tok, "lp", [[b"x" * (w.MAX_PIECE_BYTES + 1), -0.5, []]], "exceed")
    _bad(tok, "lp", [[b"a", -0.5, []]] * (w.MAX_LOGPROB_ENTRIES + 1), "exceed")
    with pytest.raises(w.WireError):
        w.encode_frame(w.Tokens("a", (), (w.TokenLogprob(b"a", 1.0),)))  # encoder validates


def test_the_largest_logprobs_frame_fits_the_item_and_byte_caps():
    top = tuple((b"\xff" * 16, -1.25) for _ in range(w.MAX_TOP_LOGPROBS))
    entry = w.TokenLogprob(b"\xff" * 16, -0.125, top)
    frame = w.Tokens("t" * 1000, tuple(range(w.MAX_LOGPROB_ENTRIES)),
                     (entry,) * w.MAX_LOGPROB_ENTRIES)
    data = w.encode_frame(frame)
    assert len(data) <= w.MAX_FRAME_BYTES
    assert w.decode_body(data[4:]) == frame
