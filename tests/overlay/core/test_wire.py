"""Frame codec and stream state machine of overlay/core/wire.py (pure; property-based)."""

from __future__ import annotations

import dataclasses
import struct

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import wire as w

ids = st.binary(min_size=0, max_size=40)
short = st.text(max_size=30)
floats = st.floats(min_value=-1.0, max_value=1e6, allow_nan=False)
nonneg = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)

hops = st.builds(
    w.Hop,
    peer=ids,
    action=st.sampled_from(["serve", "forward", "fallback"]),
    reason=short,
    next_peer=ids,
    local_matched_tokens=st.integers(0, w.MAX_PROMPT_TOKENS),
    est_local_s=floats,
    est_peer_s=floats,
    decide_ms=nonneg,
    ttft_ms=floats,
)
messages = st.builds(w.Message, role=st.sampled_from(["system", "user", "assistant"]), content=st.text(max_size=200))
token_lists = st.lists(st.integers(0, 0xFFFFFFFF), max_size=50).map(tuple)

requests = st.builds(
    w.Request,
    id=ids,
    ns=ids,
    credential=ids,
    messages=st.lists(messages, min_size=1, max_size=5).map(tuple),
    tokens=token_lists,
    sampling=st.builds(
        w.Sampling,
        max_tokens=st.integers(0, 1000),
        temperature=st.floats(0.0, 2.0),
        top_p=st.floats(0.0, 1.0),
        seed=st.integers(0, 2**32 - 1),
    ),
    deadline=st.floats(0.0, 2e9),
    hop_budget=st.integers(0, w.MAX_HOPS),
    visited=st.lists(ids, max_size=w.MAX_HOPS).map(tuple),
    trace=st.lists(hops, max_size=4).map(tuple),
    stream=st.booleans(),
    holders=st.dictionaries(ids, st.integers(1, w.MAX_PROMPT_TOKENS), max_size=5).map(
        lambda d: tuple(d.items())),
)

# raw-prompt completions for another model (issue 18): text instead of messages and tokens
raw_prompt_requests = st.builds(
    w.Request,
    id=ids,
    ns=ids,
    credential=ids,
    prompt=st.text(min_size=1, max_size=300),
    model=st.binary(min_size=1, max_size=32),
    deadline=st.floats(0.0, 2e9),
    hop_budget=st.integers(0, w.MAX_HOPS),
    visited=st.lists(ids, max_size=3).map(tuple),
    trace=st.lists(hops, max_size=2).map(tuple),
    stream=st.booleans(),
)


@st.composite
def finals(draw):
    pt = draw(st.integers(0, 5000))
    return w.Final(
        id=draw(ids),
        entry=draw(ids),
        serving=draw(ids),
        prompt_tokens=pt,
        cached_tokens=draw(st.integers(0, pt)),
        completion_tokens=draw(st.integers(0, 1000)),
        ttft_ms=draw(floats),
        total_ms=draw(floats),
        finish_reason=draw(short),
        hops=tuple(draw(st.lists(hops, max_size=4))),
    )


frames = st.one_of(
    requests,
    raw_prompt_requests,
    st.builds(w.Tokens, text=st.text(max_size=100), token_ids=token_lists),
    finals(),
    st.just(w.End()),
    st.builds(w.Error, code=st.sampled_from(sorted(w.ERROR_CODES)), message=short),
    st.builds(w.Ping, nonce=st.integers(0, 2**63 - 1)),
    st.builds(w.Pong, nonce=st.integers(0, 2**63 - 1), queue_depth=st.integers(0, 100),
              active=st.integers(0, 9), summary_hash=st.binary(max_size=32),
              n_ctx=st.one_of(st.just(0), st.integers(1, 2**31 - 1))),
    st.just(w.PeersQuery()),
)


def _normalise(frame):
    """Floats may round-trip through a shorter CBOR float; compare after one round trip."""
    return w.decode_body(w.encode_frame(frame)[4:])


@settings(max_examples=200, deadline=None)
@given(frames)
def test_roundtrip(frame):
    data = w.encode_frame(frame)
    (length,) = struct.unpack(">I", data[:4])
    assert length == len(data) - 4
    decoded = w.decode_body(data[4:])
    assert type(decoded) is type(frame)
    # encoding is canonical: re-encoding the decoded frame gives the same bytes
    assert w.encode_frame(decoded) == data
    if not isinstance(frame, w.Request | w.Final):
        assert decoded == frame


@settings(max_examples=100, deadline=None)
@given(st.lists(frames, min_size=1, max_size=6), st.data())
def test_decoder_any_chunking(frame_list, data):
    stream = b"".join(w.encode_frame(f) for f in frame_list)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    dec = w.FrameDecoder()
    out = []
    prev = 0
    for c in [*cuts, len(stream)]:
        dec.feed(stream[prev:c])
        prev = c
        out.extend(dec.frames())
    dec.eof()
    assert [w.encode_frame(f) for f in out] == [w.encode_frame(f) for f in frame_list]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_only_raise_wire_error(data):
    dec = w.FrameDecoder()
    try:
        dec.feed(data)
        list(dec.frames())
        dec.eof()
    except w.WireError:
        pass


@settings(max_examples=150, deadline=None)
@given(frames, st.data())
def test_mutated_frames_only_raise_wire_error(frame, data):
    buf = bytearray(w.encode_frame(frame))
    n_mut = data.draw(st.integers(1, 4))
    for _ in range(n_mut):
        kind = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if kind == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "insert":
            buf[pos:pos] = bytes([data.draw(st.integers(0, 255))])
        elif kind == "delete" and buf:
            del buf[pos]
        elif kind == "truncate":
            del buf[pos:]
    dec = w.FrameDecoder()
    try:
        dec.feed(bytes(buf))
        list(dec.frames())
        dec.eof()
    except w.WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
    max_leaves=20,
))
def test_arbitrary_cbor_values_only_raise_wire_error(value):
    body = cbor2.dumps(value, canonical=True)
    try:
        w.decode_body(body)
    except w.WireError:
        pass


def test_oversize_prefix_refused_before_body():
    dec = w.FrameDecoder()
    with pytest.raises(w.OversizeFrame):
        dec.feed(struct.pack(">I", w.MAX_FRAME_BYTES + 1))
    assert dec.buffered <= 4
    with pytest.raises(w.OversizeFrame):  # poisoned
        dec.feed(b"\x00")


def test_truncated_stream():
    data = w.encode_frame(w.Ping(7))
    dec = w.FrameDecoder()
    dec.feed(data[:-1])
    assert dec.next_frame() is None
    with pytest.raises(w.TruncatedFrame):
        dec.eof()


def test_non_canonical_refused():
    # map keys out of canonical order
    body = b"\xa2" + cbor2.dumps("n") + cbor2.dumps(1) + cbor2.dumps("t") + cbor2.dumps("ping")
    assert w.decode_body(body) == w.Ping(1)  # bytewise-sorted keys: canonical
    bad = b"\xa2" + cbor2.dumps("t") + cbor2.dumps("ping") + cbor2.dumps("n") + cbor2.dumps(1)
    with pytest.raises(w.NonCanonicalFrame):
        w.decode_body(bad)
    # non-shortest integer head
    bad_int = b"\xa2" + cbor2.dumps("n") + b"\x18\x01" + cbor2.dumps("t") + cbor2.dumps("ping")
    with pytest.raises(w.MalformedFrame):
        w.decode_body(bad_int)


def test_tags_indefinite_and_deep_nesting_refused():
    with pytest.raises(w.MalformedFrame):
        w.decode_body(b"\xc1\x00")  # tag 1
    with pytest.raises(w.MalformedFrame):
        w.decode_body(b"\x9f\x00\xff")  # indefinite array
    with pytest.raises(w.MalformedFrame):
        w.decode_body(b"\x81" * 50 + b"\x00")
    with pytest.raises(w.MalformedFrame):  # claims 2^32 items in a tiny frame
        w.decode_body(b"\x9a\xff\xff\xff\xff\x00")


def test_limits():
    base = w.Request(id=b"i", ns=b"n", tokens=(1,))
    too_many = w.Request(id=b"i", ns=b"n", messages=tuple(w.Message("user", "x") for _ in range(w.MAX_MESSAGES + 1)))
    with pytest.raises(w.LimitExceeded):
        w.encode_frame(too_many)
    with pytest.raises(w.LimitExceeded):
        w.encode_frame(w.Request(id=b"i", ns=b"n", tokens=(1,) * (w.MAX_PROMPT_TOKENS + 1)))
    with pytest.raises(w.LimitExceeded):
        w.encode_frame(w.Request(id=b"i", ns=b"n", tokens=(1,), visited=(b"p",) * (w.MAX_HOPS + 1)))
    with pytest.raises(w.LimitExceeded):
        w.encode_frame(w.Request(id=b"i", ns=b"n", tokens=(1,), hop_budget=w.MAX_HOPS + 1))
    with pytest.raises(w.InvalidField):
        w.encode_frame(w.Request(id=b"i", ns=b"n"))  # neither messages nor tokens
    with pytest.raises(w.InvalidField):
        w.encode_frame(w.Error(code="nope", message=""))
    assert w.decode_body(w.encode_frame(base)[4:]) == base


def test_unknown_type_and_extra_keys():
    with pytest.raises(w.UnknownFrameType):
        w.decode_body(cbor2.dumps({"t": "bogus"}, canonical=True))
    with pytest.raises(w.InvalidField):
        w.decode_body(cbor2.dumps({"t": "end", "x": 1}, canonical=True))
    with pytest.raises(w.InvalidField):
        w.decode_body(cbor2.dumps({"t": "ping"}, canonical=True))


def test_stream_state_machine():
    ok = [w.Request(id=b"i", ns=b"n", tokens=(1,)), w.Tokens("a"), w.Tokens("b"),
          w.Final(b"i", b"e", b"s", 1, 0, 2, 1.0, 2.0, "stop", ()), w.End()]
    s = w.InferStreamState()
    s.request_sent(ok[0])
    for f in ok[1:]:
        s.on_response(f)
    assert s.state == s.DONE and s.tokens_frames == 2

    s = w.InferStreamState()
    s.request_received(ok[0])
    s.response_sent(w.Tokens("a"))
    s.response_sent(w.Error("upstream_failed", "x"))
    assert s.finished and s.state == s.FAILED
    with pytest.raises(w.ProtocolViolation):
        s.response_sent(w.End())

    s = w.InferStreamState()
    with pytest.raises(w.ProtocolViolation):
        s.on_response(w.Tokens("a"))
    s = w.InferStreamState()
    s.request_sent(ok[0])
    with pytest.raises(w.ProtocolViolation):
        s.on_response(w.End())  # END before FINAL
    with pytest.raises(w.ProtocolViolation):
        s.request_sent(ok[0])


def test_peers_reply_roundtrip():
    reply = w.PeersReply(
        self_peer=b"me", model=b"fp", addrs=("/ip4/127.0.0.1/tcp/1",),
        peers=(w.PeerInfo(b"p", ("/ip4/127.0.0.1/tcp/2",), True, False, 1.5, 2, 1, 40, 0.5,
                          ("bootstrap", "gossip")),),
        stats={"rejected_BadSignature": 3},
    )
    assert w.decode_body(w.encode_frame(reply)[4:]) == reply


def test_item_cap_refuses_item_floods_and_admits_the_largest_legitimate_frames():
    # a frame of one-byte items: refused by the pre-scan's item count, before cbor2
    flood = cbor2.dumps([0] * (w.MAX_CBOR_ITEMS + 10))
    assert len(flood) <= w.MAX_FRAME_BYTES
    with pytest.raises(w.LimitExceeded, match="CBOR items"):
        w.decode_body(flood)
    # the most items legitimate frames carry: a PEERS reply as large as the frame allows
    # (long lists of short addresses and sources), and a request with the most messages
    # and hops; each decodes (or is refused for its byte size, never for its item count)
    addr = "/ip4/1.2.3.4/tcp/1"
    peers = tuple(
        w.PeerInfo(peer=bytes([i % 256]) * 38, addrs=(addr,) * w.MAX_ADDRS, connected=True,
                   up=True, rtt_ms=1.0, queue_depth=0, active=0, n_hashes=1,
                   digest_age_s=1.0, sources=("gossip", "mdns", "dht", "bootstrap"))
        for i in range(w.MAX_PEERS_LISTED)
    )
    for n in (w.MAX_PEERS_LISTED, 600, 300):
        try:
            frame = w.encode_frame(w.PeersReply(self_peer=b"s" * 38, model=b"m" * 16,
                                                addrs=(addr,) * w.MAX_ADDRS, peers=peers[:n],
                                                stats={f"s{i}": i for i in range(256)}))
        except w.OversizeFrame:
            continue
        assert isinstance(w.decode_body(frame[4:]), w.PeersReply)
        break
    else:  # pragma: no cover
        raise AssertionError("no PEERS reply fit a frame")
    hop = w.Hop(peer=b"p" * 38, action="forward", reason="r", next_peer=b"q" * 38)
    req = w.Request(id=b"i", ns=b"n", messages=tuple(w.Message("user", "x") for _ in range(w.MAX_MESSAGES)),
                    trace=(hop,) * w.MAX_HOPS, visited=tuple(bytes([i]) * 38 for i in range(w.MAX_HOPS)),
                    holders=tuple((i.to_bytes(2, "big") * 19, 1) for i in range(w.MAX_CARRIED_HOLDERS)))
    assert w.decode_body(w.encode_frame(req)[4:]) == req


def test_carried_holders_are_validated():
    req = w.Request(id=b"i", ns=b"n", tokens=(1, 2), holders=((b"p" * 38, 3),))
    obj = cbor2.loads(w.encode_frame(req)[4:])
    assert obj["ho"] == [[b"p" * 38, 3]]
    assert "ho" not in cbor2.loads(w.encode_frame(w.Request(id=b"i", ns=b"n", tokens=(1,)))[4:])

    def bad(ho, error, match):
        body = cbor2.dumps({**obj, "ho": ho}, canonical=True)
        with pytest.raises(error, match=match):
            w.decode_body(body)

    bad([], w.InvalidField, "omitting the key")
    bad([[b"p", 0]], w.LimitExceeded, "blocks")
    bad([[b"p", 1], [b"p", 2]], w.InvalidField, "listed twice")
    bad([[b"p"]], w.InvalidField, "expected \\[peer, blocks\\]")
    bad([["p", 1]], w.InvalidField, "peer")
    bad([[b"x" * (w.MAX_ID_BYTES + 1), 1]], w.LimitExceeded, "peer")
    bad([[bytes([i % 256, i // 256]), 1] for i in range(w.MAX_CARRIED_HOLDERS + 1)],
        w.LimitExceeded, "ho")


def test_pong_context_length_is_optional_and_never_zero_on_the_wire():
    import cbor2

    assert w.decode_body(w.encode_frame(w.Pong(1, n_ctx=2048))[4:]).n_ctx == 2048
    assert "c" not in cbor2.loads(w.encode_frame(w.Pong(1))[4:])  # 0: not said
    old = cbor2.dumps({"t": "pong", "n": 1, "q": 0, "a": 0}, canonical=True)  # says nothing
    assert w.decode_body(old).n_ctx == 0
    for bad in (0, -5, 2**31, "big"):
        with pytest.raises(w.WireError):
            w.decode_body(cbor2.dumps({"t": "pong", "n": 1, "q": 0, "a": 0, "c": bad},
                                      canonical=True))


def test_final_says_when_it_was_batched_and_omits_the_key_otherwise():
    base = w.Final(id=b"i" * 16, entry=b"e", serving=b"s", prompt_tokens=3, cached_tokens=1,
                      completion_tokens=2, ttft_ms=1.0, total_ms=2.0, finish_reason="stop",
                      hops=())
    assert "b" not in cbor2.loads(w.encode_frame(base)[4:])  # no "b" key when unbatched
    batched = dataclasses.replace(base, batched=True)
    dec = w.FrameDecoder()
    dec.feed(w.encode_frame(batched) + w.encode_frame(base))
    assert dec.next_frame() == batched and dec.next_frame() == base
    body = cbor2.loads(w.encode_frame(batched)[4:])
    body["b"] = False  # the canonical form omits it: False is refused
    with pytest.raises(w.InvalidField, match="final.b"):
        w.decode_body(cbor2.dumps(body, canonical=True))


@settings(max_examples=200, deadline=None)
@given(raw_prompt_requests)
def test_a_raw_prompt_round_trips_and_is_omitted_from_other_requests(req):
    body = w.encode_frame(req)[4:]
    assert cbor2.loads(body)["pr"] == req.prompt
    assert w.decode_body(body).prompt == req.prompt
    # the key is absent (not empty) elsewhere: frames made before the field are unchanged
    tokens_only = dataclasses.replace(req, prompt="", tokens=(1, 2))
    assert "pr" not in cbor2.loads(w.encode_frame(tokens_only)[4:])


def test_frames_without_a_raw_prompt_decode_as_before():
    old = {"t": "req", "id": b"i", "ns": b"n", "cr": b"", "msg": [["user", "hi"]],
           "tok": b"", "s": [8, 0.0, 1.0, 0], "dl": 1.0, "hb": 2, "v": [], "tr": [],
           "st": True, "mo": b"fp"}  # a model-relay request as older nodes send it
    req = w.decode_body(cbor2.dumps(old, canonical=True))
    assert req.prompt == "" and req.messages == (w.Message("user", "hi"),)
    assert w.encode_frame(req)[4:] == cbor2.dumps(old, canonical=True)


def test_a_raw_prompt_is_bounded_and_travels_alone():
    base = w._to_obj(w.Request(id=b"i", ns=b"n", prompt="Once upon", model=b"fp"))
    assert w.decode_body(cbor2.dumps(base, canonical=True)).prompt == "Once upon"

    def bad(change, error, match):
        with pytest.raises(error, match=match):
            w.decode_body(cbor2.dumps({**base, **change}, canonical=True))

    bad({"pr": ""}, w.InvalidField, "empty raw prompt")
    bad({"pr": b"bytes"}, w.InvalidField, "request.pr")
    bad({"pr": 7}, w.InvalidField, "request.pr")
    bad({"pr": "x" * (w.MAX_PROMPT_CHARS + 1)}, w.LimitExceeded, "request.pr")
    bad({"msg": [["user", "hi"]]}, w.InvalidField, "instead of messages and tokens")
    bad({"tok": w._pack_ids((1, 2))}, w.InvalidField, "instead of messages and tokens")
    with pytest.raises(w.InvalidField, match="instead of"):  # the encoder checks it too
        w.encode_frame(w.Request(id=b"i", ns=b"n", tokens=(1,), prompt="x"))
    # the longest raw prompt fits a frame (ASCII; the sender refuses what does not)
    longest = w.Request(id=b"i" * 16, ns=b"n" * 8, credential=b"c" * 32, model=b"f" * 32,
                        prompt="a" * w.MAX_PROMPT_CHARS)
    assert w.decode_body(w.encode_frame(longest)[4:]) == longest
