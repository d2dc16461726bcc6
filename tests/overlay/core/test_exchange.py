"""Tests of overlay/core/exchange.py: the anti-entropy exchange messages round-trip, are
canonical, and their bounded decoders refuse malformed and oversize input with typed errors.
(Bucket hashes and the state's cached encodings: test_antientropy_summary.py; random bytes:
the ``antientropy`` target of test_fuzz_decoders.py.)"""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import exchange
from prefixmesh.overlay.core.digest import MAX_UINT, DigestError
from prefixmesh.overlay.core.exchange import (
    MalformedMessage,
    OversizeMessage,
    decode_records,
    decode_reply,
    decode_summary,
    encode_records,
    encode_reply,
    encode_summary,
)
from prefixmesh.overlay.core.identity import Identity


def ident(i: int) -> Identity:
    return Identity.from_seed(i.to_bytes(32, "big"))


# --- message codecs ---------------------------------------------------------------------------

peer_ids = st.binary(min_size=32, max_size=32).map(lambda b: b"\x00\x24\x08\x01\x12\x20" + b)
summaries = st.dictionaries(
    peer_ids, st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1)), max_size=20
)


@settings(max_examples=100, deadline=None)
@given(summaries, st.lists(st.binary(max_size=50), max_size=10), st.sets(peer_ids, max_size=5))
def test_codec_round_trips(summary, raws, want):
    assert decode_summary(encode_summary(summary)) == summary
    reply = decode_reply(encode_reply(raws, summary, want))
    assert reply.records == raws and reply.summary == summary and reply.want_snapshots == want
    assert decode_records(encode_records(raws)) == raws


PID = b"\x00\x24\x08\x01\x12\x20" + b"p" * 32


@pytest.mark.parametrize(
    "decoder,data",
    [
        (decode_summary, b""),
        (decode_summary, b"\xff"),
        (decode_summary, cbor2.dumps([2, []])),  # wrong type
        (decode_summary, cbor2.dumps([1])),  # wrong arity
        (decode_summary, cbor2.dumps({"t": 1})),
        (decode_summary, cbor2.dumps([1, {}])),
        (decode_summary, cbor2.dumps([1, [[PID, 1]]])),
        (decode_summary, cbor2.dumps([1, [[b"short", 1, 2]]])),
        (decode_summary, cbor2.dumps([1, [[PID, -1, 2]]])),
        (decode_summary, cbor2.dumps([1, [[PID, 1, 2**63]]])),
        (decode_summary, cbor2.dumps([1, [[PID, 1, True]]])),
        (decode_summary, cbor2.dumps([1, [[PID, 1, 2], [PID, 1, 3]]])),  # duplicate origin
        (decode_summary, b"\x82\x01\x9f\xff"),  # indefinite array
        (decode_summary, b"\x82\x01" + b"\x81" * 10 + b"\x80"),  # too deep
        (decode_summary, b"\x82\x01\x9b" + (2**60).to_bytes(8, "big")),  # huge count
        (decode_records, cbor2.dumps([3, ["text"]])),
        (decode_records, cbor2.dumps([3, b"x"])),
        (decode_reply, cbor2.dumps([2, [], [], [b"short"]])),
        (decode_reply, cbor2.dumps([2, [], [], "x"])),
        (decode_reply, cbor2.dumps([2, [], {}, []])),
    ],
)
def test_codec_rejects_malformed(decoder, data):
    with pytest.raises(MalformedMessage):
        decoder(data)


def test_codec_limits(monkeypatch):
    with pytest.raises(OversizeMessage):
        decode_records(b"\x00" * (exchange.MAX_MESSAGE_BYTES + 1))
    monkeypatch.setattr(exchange, "MAX_RECORDS_PER_MESSAGE", 2)
    monkeypatch.setattr(exchange, "MAX_SUMMARY_ENTRIES", 1)
    with pytest.raises(OversizeMessage):
        encode_records([b"a", b"b", b"c"])
    with pytest.raises(OversizeMessage):
        decode_records(cbor2.dumps([3, [b"a", b"b", b"c"]]))
    two = {PID: (1, 1), PID[:-1] + b"q": (1, 1)}
    with pytest.raises(OversizeMessage):
        encode_summary(two)
    with pytest.raises(OversizeMessage):
        decode_summary(cbor2.dumps([1, [[o, 1, 1] for o in two]]))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_codec_fuzz_only_raises_digest_errors(data):
    for decoder in (decode_summary, decode_reply, decode_records):
        try:
            decoder(data)
        except DigestError:
            pass


@given(st.integers(0, MAX_UINT), st.integers(0, MAX_UINT))
@settings(max_examples=200)
def test_entry_encoding_is_canonical_cbor(epoch, seq):
    origin = ident(1).peer_id
    assert exchange.encode_entry(origin, (epoch, seq)) == cbor2.dumps(
        [origin, epoch, seq], canonical=True
    )


@given(st.integers(0, 2**40))
@settings(max_examples=200)
def test_array_head_is_canonical_cbor(n):
    # cbor2 writes the head of an n-element array; compare heads only
    assert exchange._cbor_head(4, n) == cbor2.dumps([None] * n, canonical=True)[: -n or None] if n < 300 \
        else exchange._cbor_head(4, n)[0] >> 5 == 4  # fmt: skip



def test_summary_hash_messages_round_trip_and_reject_garbage():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from prefixmesh.overlay.core.exchange import (
        AntiEntropyError,
        decode_summary_hash,
        encode_summary_hash,
        summary_hash,
    )

    a = summary_hash({b"\x00" * 38: (1, 2)})
    assert len(a) == 16 and a != summary_hash({b"\x00" * 38: (1, 3)})
    assert summary_hash({}) == summary_hash({})
    for value in (a, True, False):
        assert decode_summary_hash(encode_summary_hash(value)) == value

    @given(st.binary(max_size=80))
    @settings(max_examples=300)
    def fuzz(data):
        try:
            decode_summary_hash(data)
        except AntiEntropyError:
            pass

    fuzz()
    for bad in (b"", b"\x82\x00\x01", encode_summary_hash(a)[:-1], b"\x82\x01\xf5"):
        try:
            decode_summary_hash(bad)
        except AntiEntropyError:
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_peek_message_type_names_each_message_without_decoding():
    from prefixmesh.overlay.core.exchange import (
        ScopedSummary,
        encode_buckets,
        encode_scoped_summary,
        encode_summary_hash,
        peek_message_type,
    )

    summary = {ident(1).peer_id: (1, 0)}
    cases = {
        0: encode_summary_hash(True),
        1: encode_summary(summary),
        2: encode_reply([], summary),
        3: encode_records([]),
        7: encode_buckets([0, 0]),
        8: encode_scoped_summary(ScopedSummary(2, (), {})),
    }
    for kind, data in cases.items():
        assert peek_message_type(data) == kind
    for junk in (b"", b"\x01", b"\xa1\x01\x02", b"\x82\x18\x20", cbor2.dumps([b"x"])):
        assert peek_message_type(junk) is None
