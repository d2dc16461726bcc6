"""Tests for overlay/core/digest.py: canonical signed records and every rejection path."""

from __future__ import annotations

import math
import struct

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import digest as dg
from prefixmesh.overlay.core.digest import (
    KIND_DELTA,
    KIND_SNAPSHOT,
    MAX_ADDR_CHARS,
    MAX_ADDRS,
    MAX_HASHES_PER_RECORD,
    MAX_NAMESPACES_PER_RECORD,
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    SIGNATURE_LABEL,
    BadSignature,
    DigestError,
    DigestRecord,
    ExpiredRecord,
    FutureRecord,
    LoadFigures,
    MalformedRecord,
    NamespaceDelta,
    OversizeRecord,
    ReplayedRecord,
    SequenceRegression,
    SignerMismatch,
    UnknownVersion,
    decode_record,
    loads_bounded,
    sign_record,
)
from prefixmesh.overlay.core.identity import Identity

ME = Identity.from_seed(bytes(range(32)))
OTHER = Identity.from_seed(bytes(range(1, 33)))
NOW = 1_700_000_000.0
NS = b"N" * 8


def make_record(**changes) -> DigestRecord:
    fields = dict(
        origin=ME.peer_id,
        epoch=3,
        seq=7,
        issued_at=NOW,
        expires_at=NOW + 60.0,
        model=b"model-fp",
        kind=KIND_DELTA,
        namespaces=(NamespaceDelta(NS, (b"a" * 8, b"b" * 8), (b"c" * 8,)),),
        load=LoadFigures(2, 1, 450.5, 120.0),
        kv_capacity_bytes=1 << 30,
        kv_used_bytes=1 << 20,
        addrs=("/ip4/127.0.0.1/tcp/4001",),
    )
    fields.update(changes)
    return DigestRecord(**fields)


def body_of(record: DigestRecord) -> dict:
    return dg._body_map(dg._normalise(record))


def craft(body: object, *, signer: Identity = ME, version=1, body_bytes=None, sig=None) -> bytes:
    """An envelope around an arbitrary body, validly signed: bypasses sign_record's checks."""
    if body_bytes is None:
        body_bytes = cbor2.dumps(body, canonical=True)
    if sig is None:
        sig = signer.sign(SIGNATURE_LABEL + body_bytes)
    return cbor2.dumps([version, body_bytes, signer.public_bytes, sig], canonical=True)


def decode(raw: bytes, **kw):
    kw.setdefault("now", NOW + 1)
    return decode_record(raw, **kw)


# --- strategies ---------------------------------------------------------------------------

hashes8 = st.binary(min_size=8, max_size=8)
finite_tps = st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False)


@st.composite
def records(draw):
    kind = draw(st.sampled_from([KIND_DELTA, KIND_SNAPSHOT]))
    n_ns = draw(st.integers(0, 4))
    ns_ids = draw(st.lists(hashes8, min_size=n_ns, max_size=n_ns, unique=True))
    namespaces = []
    for ns in ns_ids:
        pool = draw(st.lists(hashes8, max_size=30, unique=True))
        split = draw(st.integers(0, len(pool)))
        added, removed = pool[:split], pool[split:]
        if kind == KIND_SNAPSHOT:
            removed = []
        namespaces.append(NamespaceDelta(ns, tuple(added), tuple(removed)))
    issued = draw(st.floats(min_value=0, max_value=1e11, allow_nan=False))
    ttl = draw(st.floats(min_value=0.001, max_value=MAX_TTL_S, allow_nan=False))
    expires = issued + ttl
    if not (expires > issued and expires - issued <= MAX_TTL_S):
        expires = issued + 1.0
    return DigestRecord(
        origin=ME.peer_id,
        epoch=draw(st.integers(0, dg.MAX_UINT)),
        seq=draw(st.integers(0, dg.MAX_UINT)),
        issued_at=issued,
        expires_at=expires,
        model=draw(st.binary(min_size=1, max_size=64)),
        kind=kind,
        namespaces=tuple(namespaces),
        load=LoadFigures(
            draw(st.integers(0, 2**32 - 1)),
            draw(st.integers(0, 2**32 - 1)),
            draw(finite_tps),
            draw(finite_tps),
        ),
        kv_capacity_bytes=draw(st.integers(0, dg.MAX_UINT)),
        kv_used_bytes=draw(st.integers(0, dg.MAX_UINT)),
        addrs=tuple(draw(st.lists(st.text(max_size=40), max_size=MAX_ADDRS))),
    )


# --- round trip and canonical form --------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_round_trip_and_canonical_stability(record):
    signed = sign_record(record, ME)
    decoded = decode_record(signed.raw, now=record.issued_at, check_expiry=False)
    assert decoded.record == signed.record
    assert decoded.raw == signed.raw
    # the normalised record equals the input up to hash order and float coercion
    assert decoded.record == dg._normalise(record)
    for got, want in zip(
        decoded.record.namespaces, sorted(record.namespaces, key=lambda d: d.ns), strict=True
    ):
        assert set(got.added) == set(want.added) and set(got.removed) == set(want.removed)
    # encode(decode(x)) == x: re-signing reproduces the bytes, and the CBOR is canonical
    assert sign_record(decoded.record, ME).raw == signed.raw
    assert cbor2.dumps(cbor2.loads(signed.raw), canonical=True) == signed.raw
    assert len(signed.raw) <= MAX_RECORD_BYTES


def test_hash_order_does_not_change_bytes():
    a = make_record(namespaces=(NamespaceDelta(NS, (b"b" * 8, b"a" * 8)),))
    b = make_record(namespaces=(NamespaceDelta(NS, (b"a" * 8, b"b" * 8)),))
    assert sign_record(a, ME).raw == sign_record(b, ME).raw


def test_times_given_as_int_are_normalised():
    signed = sign_record(make_record(issued_at=int(NOW), expires_at=int(NOW) + 60), ME)
    assert type(signed.record.issued_at) is float
    assert decode(signed.raw).record == signed.record


def test_full_size_record_fits_the_byte_limit():
    hashes = tuple(i.to_bytes(8, "big") for i in range(MAX_HASHES_PER_RECORD))
    per_ns = MAX_HASHES_PER_RECORD // MAX_NAMESPACES_PER_RECORD
    nss = tuple(
        NamespaceDelta(i.to_bytes(8, "big"), hashes[i * per_ns : (i + 1) * per_ns])
        for i in range(MAX_NAMESPACES_PER_RECORD)
    )
    rec = make_record(
        kind=KIND_SNAPSHOT,
        namespaces=nss,
        # worst case: every addr char is 4 bytes of UTF-8
        addrs=("\U0001f600" * MAX_ADDR_CHARS,) * MAX_ADDRS,
        model=b"m" * 64,
    )
    signed = sign_record(rec, ME)
    assert len(signed.raw) <= MAX_RECORD_BYTES
    assert decode(signed.raw).record.n_hashes == MAX_HASHES_PER_RECORD


# --- time checks -------------------------------------------------------------------------


def test_expired_and_future():
    raw = sign_record(make_record(), ME).raw
    with pytest.raises(ExpiredRecord):
        decode(raw, now=NOW + 60.0)
    assert decode(raw, now=NOW + 600.0, check_expiry=False).record.seq == 7
    with pytest.raises(FutureRecord):
        decode(raw, now=NOW - 31.0)
    assert decode(raw, now=NOW - 29.0).record.seq == 7
    with pytest.raises(FutureRecord):
        decode(raw, now=NOW - 10.0, max_clock_skew=5.0)


# --- signature checks --------------------------------------------------------------------


def test_bad_signature_flipped_bit():
    env = cbor2.loads(sign_record(make_record(), ME).raw)
    sig = bytearray(env[3])
    sig[5] ^= 0x40
    with pytest.raises(BadSignature):
        decode(craft(None, body_bytes=env[1], sig=bytes(sig)))


def test_bad_signature_body_changed_after_signing():
    signed = sign_record(make_record(), ME)
    env = cbor2.loads(signed.raw)
    body = cbor2.loads(env[1])
    body["s"] = 8
    with pytest.raises(BadSignature):
        decode(craft(None, body_bytes=cbor2.dumps(body, canonical=True), sig=env[3]))


def test_bad_signature_without_domain_label():
    body_bytes = cbor2.dumps(body_of(make_record()), canonical=True)
    with pytest.raises(BadSignature):
        decode(craft(None, body_bytes=body_bytes, sig=ME.sign(body_bytes)))


def test_signer_mismatch():
    # OTHER signs a record claiming ME as origin
    with pytest.raises(SignerMismatch):
        decode(craft(body_of(make_record()), signer=OTHER))
    with pytest.raises(SignerMismatch):
        sign_record(make_record(), OTHER)


def test_unknown_version():
    with pytest.raises(UnknownVersion):
        decode(craft(body_of(make_record()), version=2))


# --- oversize paths ----------------------------------------------------------------------


def test_oversize_bytes_checked_before_parsing():
    with pytest.raises(OversizeRecord):
        decode(b"\x00" * (MAX_RECORD_BYTES + 1))


def _hashes(n, start=0):
    return tuple(i.to_bytes(8, "big") for i in range(start, start + n))


@pytest.mark.parametrize(
    "changes",
    [
        dict(namespaces=(NamespaceDelta(NS, _hashes(MAX_HASHES_PER_RECORD + 1)),)),
        dict(
            namespaces=(
                NamespaceDelta(b"A" * 8, _hashes(MAX_HASHES_PER_RECORD // 2 + 1)),
                NamespaceDelta(b"B" * 8, _hashes(MAX_HASHES_PER_RECORD // 2)),
            )
        ),
        dict(
            namespaces=tuple(
                NamespaceDelta(i.to_bytes(8, "big")) for i in range(MAX_NAMESPACES_PER_RECORD + 1)
            )
        ),
        dict(addrs=("/ip4/1.2.3.4",) * (MAX_ADDRS + 1)),
        dict(addrs=("x" * (MAX_ADDR_CHARS + 1),)),
        dict(expires_at=NOW + MAX_TTL_S + 1),
    ],
    ids=["hashes", "hashes-across-ns", "namespaces", "addr-count", "addr-length", "ttl"],
)
def test_oversize_fields(changes):
    rec = make_record(**changes)
    with pytest.raises(OversizeRecord):
        sign_record(rec, ME)
    with pytest.raises(OversizeRecord):
        decode(craft(body_of(rec)))


# --- malformed: bytes level ----------------------------------------------------------------

GOOD = sign_record(make_record(), ME).raw


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff",
        GOOD[:-1],  # truncated
        GOOD + b"\x00",  # trailing bytes
        b"\x9f\x01\xff",  # indefinite-length array
        b"\x5f\x41a\xff",  # indefinite-length byte string
        b"\xc1\x1a\x00\x00\x00\x01",  # tag 1 (epoch datetime)
        b"\x5b" + (2**60).to_bytes(8, "big") + b"abc",  # declares a 2^60-byte string
        b"\x9b" + (2**60).to_bytes(8, "big") + b"\x01",  # declares a 2^60-item array
        b"\xbb" + (2**62).to_bytes(8, "big") + b"\x01\x01",  # declares a huge map
        b"\x81" * 5000 + b"\x01",  # deep nesting
        b"\xf7",  # undefined
        b"\xf8\x20",  # simple value 32
        b"\x1c",  # reserved additional info
        b"\x7f\x61a\xff",  # indefinite text
        b"\x01",  # an int, not an array
        b"\x80",  # empty array
        b"\xa0",  # a map
        cbor2.dumps([1, b"x", b"y"]),  # wrong envelope arity
        cbor2.dumps(["1", b"x", b"y", b"z"]),  # version not an int
        cbor2.dumps([1, "body", ME.public_bytes, b"s" * 64]),  # body not bytes
        cbor2.dumps([1, b"\xa0", b"k" * 31, b"s" * 64]),  # signer key length
        cbor2.dumps([1, b"\xa0", ME.public_bytes, b"s" * 63]),  # signature length
        b"\x84\x18\x01" + GOOD[2:],  # version 1 encoded non-minimally
        b"\x62\xff\xfe",  # invalid UTF-8 text
    ],
)
def test_malformed_bytes(raw):
    with pytest.raises(MalformedRecord):
        decode(raw)


def test_deep_nesting_inside_body():
    nested = b"\x81" * 100 + b"\x00"
    with pytest.raises(MalformedRecord, match="nesting"):
        decode(craft(None, body_bytes=nested))


# --- malformed: body fields ----------------------------------------------------------------


def _mut(key, value):
    def apply(body):
        body[key] = value
        return body

    return apply


def _drop(key):
    def apply(body):
        del body[key]
        return body

    return apply


def _ns(entry):
    return _mut("n", [entry])


H = [bytes([i]) * 8 for i in range(1, 6)]

BODY_MUTATIONS = {
    "body-not-map": lambda b: [1, 2],
    "missing-key": _drop("s"),
    "extra-key": _mut("z", 1),
    "int-key": lambda b: {**b, 1: 1},
    "origin-short": _mut("o", ME.peer_id[:-1]),
    "origin-sha256-id": _mut("o", b"\x12\x20" + bytes(32) + b"\x00" * 4),
    "origin-text": _mut("o", "origin"),
    "epoch-negative": _mut("e", -1),
    "epoch-too-big": _mut("e", 2**63),
    "epoch-bool": _mut("e", True),
    "epoch-float": _mut("e", 1.0),
    "seq-text": _mut("s", "7"),
    "issued-int": _mut("i", int(NOW)),
    "issued-nan": _mut("i", math.nan),
    "issued-inf": _mut("i", math.inf),
    "issued-negative": _mut("i", -1.0),
    "expires-before-issued": _mut("x", NOW - 1.0),
    "expires-equal-issued": _mut("x", NOW),
    "model-empty": _mut("m", b""),
    "model-long": _mut("m", b"m" * 65),
    "model-text": _mut("m", "model"),
    "kind-unknown": _mut("k", 2),
    "kind-text": _mut("k", "delta"),
    "namespaces-not-list": _mut("n", {}),
    "ns-entry-short": _ns([NS, b""]),
    "ns-entry-not-list": _ns(NS),
    "ns-id-short": _ns([b"N" * 7, b"", b""]),
    "ns-id-text": _ns(["N" * 8, b"", b""]),
    "hashes-not-multiple-of-8": _ns([NS, b"x" * 9, b""]),
    "hashes-text": _ns([NS, "x" * 8, b""]),
    "hashes-unsorted": _ns([NS, H[2] + H[1], b""]),
    "hashes-duplicate": _ns([NS, H[1] + H[1], b""]),
    "removed-unsorted": _ns([NS, b"", H[2] + H[1]]),
    "added-and-removed": _ns([NS, H[1], H[1]]),
    "ns-unsorted": _mut("n", [[b"B" * 8, b"", b""], [b"A" * 8, b"", b""]]),
    "ns-duplicate": _mut("n", [[b"A" * 8, b"", b""], [b"A" * 8, b"", b""]]),
    "snapshot-with-removed": lambda b: {**b, "k": 1},  # GOOD carries a removed hash
    "load-short": _mut("l", [1, 2, 3.0]),
    "load-not-list": _mut("l", 5),
    "load-negative-queue": _mut("l", [-1, 0, 1.0, 1.0]),
    "load-queue-huge": _mut("l", [2**32, 0, 1.0, 1.0]),
    "load-tps-int": _mut("l", [0, 0, 1, 1.0]),
    "load-tps-nan": _mut("l", [0, 0, math.nan, 1.0]),
    "load-tps-negative": _mut("l", [0, 0, 1.0, -1.0]),
    "load-tps-huge": _mut("l", [0, 0, 1e10, 1.0]),
    "capacity-negative": _mut("c", -5),
    "used-float": _mut("u", 5.0),
    "addrs-not-list": _mut("a", "/ip4/1.2.3.4"),
    "addr-bytes": _mut("a", [b"/ip4/1.2.3.4"]),
    "null-field": _mut("c", None),
}


@pytest.mark.parametrize("name", sorted(BODY_MUTATIONS))
def test_malformed_body(name):
    body = BODY_MUTATIONS[name](body_of(make_record()))
    with pytest.raises(MalformedRecord):
        decode(craft(body))


def test_non_canonical_body_refused():
    body = body_of(make_record())
    canonical = cbor2.dumps(body, canonical=True)
    # same map, keys in insertion (non-canonical) order
    reordered = dict(reversed(list(body.items())))
    non_canonical = cbor2.dumps(reordered)
    assert non_canonical != canonical
    with pytest.raises(MalformedRecord, match="canonical"):
        decode(craft(None, body_bytes=non_canonical))
    # a float encoded wider than needed (120.0 fits a half float)
    f16 = cbor2.dumps(120.0, canonical=True)
    f64 = b"\xfb" + struct.pack(">d", 120.0)
    assert f16 in canonical
    wide = canonical.replace(f16, f64, 1)
    with pytest.raises(MalformedRecord, match="canonical"):
        decode(craft(None, body_bytes=wide))
    # duplicate map key: cbor2 keeps the last one, the canonical check refuses
    dup = bytearray(canonical)
    assert dup[0] == 0xAC  # 12-entry map
    dup[0] = 0xAD
    dup += cbor2.dumps("s") + cbor2.dumps(8)
    with pytest.raises(MalformedRecord):
        decode(craft(None, body_bytes=bytes(dup)))


def test_non_canonical_envelope_refused():
    body_bytes = cbor2.dumps(body_of(make_record()), canonical=True)
    sig = ME.sign(SIGNATURE_LABEL + body_bytes)
    canonical = craft(None, body_bytes=body_bytes, sig=sig)
    # the signer key's length written with a 2-byte length header instead of 1
    key_hdr = b"\x58\x20" + ME.public_bytes
    wide_hdr = b"\x59\x00\x20" + ME.public_bytes
    assert key_hdr in canonical
    with pytest.raises(MalformedRecord, match="canonical"):
        decode(canonical.replace(key_hdr, wide_hdr))


def test_sign_refuses_invalid_records():
    with pytest.raises(MalformedRecord):
        sign_record(make_record(kind="full"), ME)
    with pytest.raises(MalformedRecord):
        sign_record(make_record(kind=KIND_SNAPSHOT), ME)  # carries a removed hash
    with pytest.raises(MalformedRecord):
        sign_record(make_record(load=LoadFigures(0, 0, math.nan, 0.0)), ME)
    with pytest.raises(MalformedRecord):
        sign_record(make_record(namespaces=(NamespaceDelta(NS, (b"short",)),)), ME)


def test_error_hierarchy():
    for cls in (
        MalformedRecord,
        UnknownVersion,
        OversizeRecord,
        BadSignature,
        SignerMismatch,
        ReplayedRecord,
        SequenceRegression,
        ExpiredRecord,
        FutureRecord,
    ):
        assert issubclass(cls, DigestError) and issubclass(cls, ValueError)
    assert len({MalformedRecord, UnknownVersion, OversizeRecord, BadSignature}) == 4


# --- fuzz: decode only ever raises DigestError ---------------------------------------------


def _decode_or_digest_error(raw: bytes) -> None:
    try:
        decode_record(raw, now=NOW + 1)
    except DigestError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(raw):
    _decode_or_digest_error(raw)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, len(GOOD)),
    st.binary(max_size=12),
)
def test_fuzz_mutated_record(flips, cut, insert):
    raw = bytearray(GOOD)
    for pos, value in flips:
        raw[pos] = value
    raw = bytes(raw[:cut]) + insert + bytes(raw[cut:])
    _decode_or_digest_error(raw)


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.binary(max_size=20)
        | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=5)
            | st.dictionaries(st.text(max_size=3) | st.integers(), children, max_size=5)
        ),
        max_leaves=30,
    )
)
def test_fuzz_structured_bodies(body):
    """Arbitrary CBOR values as the (validly signed) body are refused with DigestError."""
    try:
        body_bytes = cbor2.dumps(body, canonical=True)
    except Exception:
        return
    _decode_or_digest_error(craft(None, body_bytes=body_bytes))


def test_loads_bounded_limits():
    with pytest.raises(OversizeRecord):
        loads_bounded(b"\x00" * 11, max_bytes=10)
    with pytest.raises(MalformedRecord, match="nesting"):
        loads_bounded(b"\x81" * 4 + b"\x00", max_bytes=100, max_depth=3)
    assert loads_bounded(b"\x81" * 3 + b"\x00", max_bytes=100, max_depth=3) == [[[0]]]
    assert loads_bounded(cbor2.dumps({"a": [1.5, None, True]}), max_bytes=100) == {
        "a": [1.5, None, True]
    }


def test_item_count_is_bounded_before_decoding():
    # 30,000 one-byte items fit in 64 KiB; the scan stops after MAX_BODY_ITEMS
    packed = cbor2.dumps([0] * 30000)
    assert len(packed) < MAX_RECORD_BYTES
    with pytest.raises(MalformedRecord, match="items"):
        decode(craft(None, body_bytes=packed))
    with pytest.raises(MalformedRecord, match="items"):
        decode(cbor2.dumps([1, b"", b"", b"", 0, 0, 0, 0, 0]))
    with pytest.raises(MalformedRecord, match="items"):
        loads_bounded(cbor2.dumps([1, 2, 3]), max_bytes=100, max_items=3)
    assert loads_bounded(cbor2.dumps([1, 2, 3]), max_bytes=100, max_items=4) == [1, 2, 3]
