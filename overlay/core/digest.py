"""Signed cache-digest records: what one node tells the others about its prompt-prefix cache.

A :class:`DigestRecord` is one entry in an origin's record stream. Every record carries
the origin's peer id, its *epoch* (incarnation: bumped each time the node restarts, so
sequence numbers may start over) and a *sequence number* that is unique within the
epoch. A ``snapshot`` record replaces everything known about the origin (its ``added``
lists are the full advertised set per namespace); a ``delta`` record adds and removes
block hashes relative to the record before it (``removed`` entries are tombstones).
Records also carry the origin's load figures, KV capacity and use, its listen
multiaddrs (so relayed origins are dialable) and a validity window
``[issued_at, expires_at)``.

Wire format
-----------
Envelope: canonical CBOR array ``[version, body, signer_public_key, signature]``

- ``version``: unsigned int, :data:`RECORD_VERSION` (1).
- ``body``: byte string holding the canonical CBOR encoding of the body map (below).
- ``signer_public_key``: 32-byte raw Ed25519 public key.
- ``signature``: 64-byte Ed25519 signature of ``SIGNATURE_LABEL || body``; the label is
  a domain separator so a record signature can never be confused with any other
  signature the same key makes (libp2p handshakes, inference-protocol frames).

Body: canonical CBOR map with one-letter text keys, all required:

==== ============================ =====================================================
key  field                        encoding
==== ============================ =====================================================
o    origin                       bytes, Ed25519 identity-multihash peer id (38 bytes)
e    epoch                        uint < 2^63
s    seq                          uint < 2^63
i    issued_at                    float, finite, >= 0 (seconds)
x    expires_at                   float, issued_at < x <= issued_at + MAX_TTL_S
m    model fingerprint            bytes, 1..MAX_MODEL_FP_BYTES
k    kind                         uint: 0 = delta, 1 = snapshot
n    namespaces                   array of [ns (8 bytes), added, removed], sorted by ns,
                                  no duplicate ns; ``added``/``removed`` are byte
                                  strings of concatenated 8-byte block hashes, strictly
                                  ascending (sorted, unique), disjoint; a snapshot has no
                                  ``removed`` entries
l    load                         [queue_depth uint, active uint, prefill_tps float,
                                   decode_tps float]; floats finite, 0 <= tps <= 1e9
c    kv_capacity_bytes            uint < 2^63
u    kv_used_bytes                uint < 2^63
a    addrs                        array of text strings
==== ============================ =====================================================

Encoding is canonical (RFC 7049 canonical CBOR via ``cbor2.dumps(canonical=True)``,
hashes sorted); decoding *checks* it: the body and the envelope must re-encode to
exactly the received bytes, so one record has exactly one byte representation and
``raw`` can be compared byte-for-byte to detect equivocation.

Limits (module constants)
-------------------------
- :data:`MAX_RECORD_BYTES` = 64 KiB per encoded record (checked before any parsing).
- :data:`MAX_HASHES_PER_RECORD` = 4096 block hashes (added + removed, all namespaces).
- :data:`MAX_NAMESPACES_PER_RECORD` = 32.
- :data:`MAX_ADDRS` = 8 listen addrs of at most :data:`MAX_ADDR_CHARS` = 256 characters.
- :data:`MAX_TTL_S` = 3600 s between ``issued_at`` and ``expires_at``.
- :data:`MAX_MODEL_FP_BYTES` = 64.
- CBOR nesting depth at most :data:`MAX_CBOR_DEPTH` = 8; at most 8 items in the envelope
  and :data:`MAX_BODY_ITEMS` = 256 in the body (so a hostile record costs a bounded
  number of scan steps, however it is packed).

Bounded decoding
----------------
:func:`loads_bounded` checks the size, then runs the shared bounded scanner
(:mod:`.cbor`: no recursion, strict grammar, every declared length checked against the
bytes left, at most ``max_items`` items) before cbor2 parses, and maps its errors to
this module's :class:`DigestError` types.

Errors
------
Every failure is a :class:`DigestError` (a ``ValueError``) subclass:
:class:`MalformedRecord`, :class:`UnknownVersion`, :class:`OversizeRecord`,
:class:`BadSignature`, :class:`SignerMismatch`, :class:`ExpiredRecord`,
:class:`FutureRecord`, and -- raised by the anti-entropy state, which knows the last
(epoch, seq) per origin -- :class:`ReplayedRecord` (same (epoch, seq), different
content: equivocation) and :class:`SequenceRegression` (older than what is held).
:func:`decode_record` raises nothing else, whatever the input bytes.

Pure code: no trio, libp2p or llama imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cbor2

from . import cbor
from .identity import (
    ED25519_PUBLIC_KEY_BYTES,
    ED25519_SIGNATURE_BYTES,
    PEER_ID_BYTES,
    PEER_ID_PREFIX,
    Identity,
    peer_id_from_public_key,
    verify_with_public_key,
)

__all__ = [
    "RECORD_VERSION",
    "SIGNATURE_LABEL",
    "HASH_BYTES",
    "NAMESPACE_ID_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_HASHES_PER_RECORD",
    "MAX_NAMESPACES_PER_RECORD",
    "MAX_ADDRS",
    "MAX_ADDR_CHARS",
    "MAX_TTL_S",
    "MAX_MODEL_FP_BYTES",
    "MAX_CBOR_DEPTH",
    "MAX_BODY_ITEMS",
    "MAX_UINT",
    "MAX_TPS",
    "KIND_DELTA",
    "KIND_SNAPSHOT",
    "LoadFigures",
    "NamespaceDelta",
    "DigestRecord",
    "SignedRecord",
    "sign_record",
    "decode_record",
    "encode_body",
    "validate_record",
    "loads_bounded",
    "DigestError",
    "MalformedRecord",
    "UnknownVersion",
    "OversizeRecord",
    "BadSignature",
    "SignerMismatch",
    "ReplayedRecord",
    "SequenceRegression",
    "ExpiredRecord",
    "FutureRecord",
]

RECORD_VERSION = 1
SIGNATURE_LABEL = b"prefixmesh/digest-record/v1\x00"
HASH_BYTES = 8
NAMESPACE_ID_BYTES = 8

MAX_RECORD_BYTES = 64 * 1024
MAX_HASHES_PER_RECORD = 4096
MAX_NAMESPACES_PER_RECORD = 32
MAX_ADDRS = 8
MAX_ADDR_CHARS = 256
MAX_TTL_S = 3600.0
MAX_MODEL_FP_BYTES = 64
MAX_CBOR_DEPTH = 8
# a maximal body is 1 map + 24 keys/values + 32 x 4 namespace items + 5 load + 9 addr items
MAX_BODY_ITEMS = 256
MAX_UINT = 2**63 - 1
MAX_TPS = 1e9
MAX_COUNT = 2**32 - 1  # queue depth, active requests

KIND_DELTA = "delta"
KIND_SNAPSHOT = "snapshot"
_KIND_CODES = {KIND_DELTA: 0, KIND_SNAPSHOT: 1}
_KIND_NAMES = {v: k for k, v in _KIND_CODES.items()}
_BODY_KEYS = frozenset("oesixmknlcua")


# --- errors -----------------------------------------------------------------------------


class DigestError(ValueError):
    """Base class of every digest-record error."""


class MalformedRecord(DigestError):
    """Not a well-formed record: bad CBOR, wrong structure, type, length or range."""


class UnknownVersion(DigestError):
    """A record format version this code does not speak."""


class OversizeRecord(DigestError):
    """A record beyond a documented limit (bytes, hashes, namespaces, addrs, TTL)."""


class BadSignature(DigestError):
    """The signature does not verify against the signer key."""


class SignerMismatch(DigestError):
    """The signer key's peer id is not the record's origin."""


class ReplayedRecord(DigestError):
    """Same (epoch, seq) as a held record of the origin, different content (equivocation)."""


class SequenceRegression(DigestError):
    """Older (epoch, seq) than what is already held for the origin."""


class ExpiredRecord(DigestError):
    """``expires_at`` has passed."""


class FutureRecord(DigestError):
    """``issued_at`` lies further in the future than the allowed clock skew."""


# --- data -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadFigures:
    queue_depth: int = 0
    active: int = 0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0


@dataclass(frozen=True, slots=True)
class NamespaceDelta:
    ns: bytes
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class DigestRecord:
    origin: bytes
    epoch: int
    seq: int
    issued_at: float
    expires_at: float
    model: bytes
    kind: str
    namespaces: tuple[NamespaceDelta, ...]
    load: LoadFigures
    kv_capacity_bytes: int
    kv_used_bytes: int
    addrs: tuple[str, ...] = ()

    @property
    def n_hashes(self) -> int:
        return sum(len(d.added) + len(d.removed) for d in self.namespaces)


@dataclass(frozen=True, slots=True)
class SignedRecord:
    record: DigestRecord
    raw: bytes  # the exact encoded bytes; relays pass these on unchanged


# --- bounded CBOR -----------------------------------------------------------------------


def loads_bounded(
    data: bytes,
    *,
    max_bytes: int,
    max_depth: int = MAX_CBOR_DEPTH,
    max_items: int | None = None,
    error: type[DigestError] = MalformedRecord,
    oversize_error: type[DigestError] = OversizeRecord,
) -> object:
    """Decode one CBOR item from ``data`` with bounded cost, or raise ``error``.

    The size is checked first (``oversize_error``), then the strict structural scan
    (see the module docstring; at most ``max_items`` items, so scanning costs O(max_items)
    whatever the bytes), then cbor2 decodes. Any cbor2 failure becomes ``error``.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise error(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise oversize_error(f"{len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return cbor.loads(
            data, max_depth=max_depth, max_items=len(data) if max_items is None else max_items
        )
    except cbor.CborError as exc:
        raise error(str(exc)) from None


# --- encoding ---------------------------------------------------------------------------


def _normalise(record: DigestRecord) -> DigestRecord:
    """The record with hashes and namespaces in canonical (sorted) order and float times."""
    namespaces = tuple(
        sorted(
            (
                NamespaceDelta(bytes(d.ns), tuple(sorted(d.added)), tuple(sorted(d.removed)))
                for d in record.namespaces
            ),
            key=lambda d: d.ns,
        )
    )
    load = record.load
    return DigestRecord(
        origin=bytes(record.origin),
        epoch=record.epoch,
        seq=record.seq,
        issued_at=float(record.issued_at),
        expires_at=float(record.expires_at),
        model=bytes(record.model),
        kind=record.kind,
        namespaces=namespaces,
        load=LoadFigures(
            load.queue_depth, load.active, float(load.prefill_tps), float(load.decode_tps)
        ),
        kv_capacity_bytes=record.kv_capacity_bytes,
        kv_used_bytes=record.kv_used_bytes,
        addrs=tuple(record.addrs),
    )


def _body_map(record: DigestRecord) -> dict:
    load = record.load
    return {
        "o": record.origin,
        "e": record.epoch,
        "s": record.seq,
        "i": record.issued_at,
        "x": record.expires_at,
        "m": record.model,
        "k": _KIND_CODES[record.kind],
        "n": [[d.ns, b"".join(d.added), b"".join(d.removed)] for d in record.namespaces],
        "l": [load.queue_depth, load.active, load.prefill_tps, load.decode_tps],
        "c": record.kv_capacity_bytes,
        "u": record.kv_used_bytes,
        "a": list(record.addrs),
    }


def encode_body(record: DigestRecord) -> bytes:
    """Canonical CBOR body of a record (validated and normalised first)."""
    record = _normalise(record)
    validate_record(record)
    return cbor2.dumps(_body_map(record), canonical=True)


def sign_record(record: DigestRecord, identity: Identity) -> SignedRecord:
    """Validate, normalise, encode and sign ``record`` with ``identity``.

    Raises :class:`SignerMismatch` if ``record.origin`` is not ``identity.peer_id`` and
    :class:`MalformedRecord` / :class:`OversizeRecord` for a record that decoding would
    refuse. The returned ``record`` is the normalised one (sorted hashes, float times),
    equal to what :func:`decode_record` yields for ``raw``.
    """
    if record.origin != identity.peer_id:
        raise SignerMismatch("record origin is not the signing identity's peer id")
    record = _normalise(record)
    validate_record(record)
    body = cbor2.dumps(_body_map(record), canonical=True)
    signature = identity.sign(SIGNATURE_LABEL + body)
    raw = cbor2.dumps([RECORD_VERSION, body, identity.public_bytes, signature], canonical=True)
    if len(raw) > MAX_RECORD_BYTES:
        raise OversizeRecord(
            f"encoded record is {len(raw)} bytes, over the {MAX_RECORD_BYTES}-byte limit"
        )
    return SignedRecord(record, raw)


# --- validation -------------------------------------------------------------------------


def _check_uint(value: object, name: str, limit: int = MAX_UINT) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise MalformedRecord(f"{name} must be an integer in [0, {limit}], got {value!r}")
    return value


def _check_float(value: object, name: str, lo: float, hi: float) -> float:
    if type(value) is not float or not math.isfinite(value) or not lo <= value <= hi:
        raise MalformedRecord(f"{name} must be a finite float in [{lo}, {hi}], got {value!r}")
    return value


def _check_hashes(hashes: tuple[bytes, ...], what: str) -> None:
    prev = b""
    for h in hashes:
        if type(h) is not bytes or len(h) != HASH_BYTES:
            raise MalformedRecord(f"{what}: block hashes are {HASH_BYTES} bytes")
        if h <= prev:
            raise MalformedRecord(f"{what}: block hashes must be sorted and unique")
        prev = h


def validate_record(record: DigestRecord) -> None:
    """Check every field's type, length and range; raise Malformed/OversizeRecord."""
    origin = record.origin
    if (
        type(origin) is not bytes
        or len(origin) != PEER_ID_BYTES
        or not origin.startswith(PEER_ID_PREFIX)
    ):
        raise MalformedRecord("origin must be an Ed25519 identity-multihash peer id")
    _check_uint(record.epoch, "epoch")
    _check_uint(record.seq, "seq")
    issued = _check_float(record.issued_at, "issued_at", 0.0, 1e12)
    expires = _check_float(record.expires_at, "expires_at", 0.0, 1e12 + MAX_TTL_S)
    if not expires > issued:
        raise MalformedRecord("expires_at must be after issued_at")
    if expires - issued > MAX_TTL_S:
        raise OversizeRecord(f"TTL {expires - issued:.1f} s exceeds the {MAX_TTL_S:.0f} s limit")
    if type(record.model) is not bytes or not 1 <= len(record.model) <= MAX_MODEL_FP_BYTES:
        raise MalformedRecord(f"model fingerprint must be 1..{MAX_MODEL_FP_BYTES} bytes")
    if record.kind not in _KIND_CODES:
        raise MalformedRecord(f"kind must be 'delta' or 'snapshot', got {record.kind!r}")
    if type(record.namespaces) is not tuple:
        raise MalformedRecord("namespaces must be a tuple")
    if len(record.namespaces) > MAX_NAMESPACES_PER_RECORD:
        raise OversizeRecord(
            f"{len(record.namespaces)} namespaces exceeds the limit of {MAX_NAMESPACES_PER_RECORD}"
        )
    total = 0
    prev_ns = b""
    for d in record.namespaces:
        if not isinstance(d, NamespaceDelta):
            raise MalformedRecord("namespaces must hold NamespaceDelta entries")
        if type(d.ns) is not bytes or len(d.ns) != NAMESPACE_ID_BYTES:
            raise MalformedRecord(f"namespace ids are {NAMESPACE_ID_BYTES} bytes")
        if d.ns <= prev_ns:
            raise MalformedRecord("namespaces must be sorted by id and unique")
        prev_ns = d.ns
        if type(d.added) is not tuple or type(d.removed) is not tuple:
            raise MalformedRecord("added/removed must be tuples")
        total += len(d.added) + len(d.removed)
        if total > MAX_HASHES_PER_RECORD:
            raise OversizeRecord(f"more than {MAX_HASHES_PER_RECORD} block hashes in one record")
        _check_hashes(d.added, "added")
        _check_hashes(d.removed, "removed")
        if record.kind == KIND_SNAPSHOT and d.removed:
            raise MalformedRecord("a snapshot cannot carry removed hashes")
        if d.removed and not set(d.added).isdisjoint(d.removed):
            raise MalformedRecord("a hash cannot be both added and removed in one record")
    load = record.load
    if not isinstance(load, LoadFigures):
        raise MalformedRecord("load must be LoadFigures")
    _check_uint(load.queue_depth, "queue_depth", MAX_COUNT)
    _check_uint(load.active, "active", MAX_COUNT)
    _check_float(load.prefill_tps, "prefill_tps", 0.0, MAX_TPS)
    _check_float(load.decode_tps, "decode_tps", 0.0, MAX_TPS)
    _check_uint(record.kv_capacity_bytes, "kv_capacity_bytes")
    _check_uint(record.kv_used_bytes, "kv_used_bytes")
    if type(record.addrs) is not tuple:
        raise MalformedRecord("addrs must be a tuple")
    if len(record.addrs) > MAX_ADDRS:
        raise OversizeRecord(f"{len(record.addrs)} addrs exceeds the limit of {MAX_ADDRS}")
    for addr in record.addrs:
        if type(addr) is not str:
            raise MalformedRecord("addrs must be text")
        if len(addr) > MAX_ADDR_CHARS:
            raise OversizeRecord(f"an addr of {len(addr)} chars exceeds {MAX_ADDR_CHARS}")


# --- decoding ---------------------------------------------------------------------------


def _split_hashes(blob: object, what: str) -> tuple[bytes, ...]:
    if type(blob) is not bytes:
        raise MalformedRecord(f"{what} must be a byte string of concatenated hashes")
    if len(blob) % HASH_BYTES:
        raise MalformedRecord(f"{what} length {len(blob)} is not a multiple of {HASH_BYTES}")
    if len(blob) > MAX_HASHES_PER_RECORD * HASH_BYTES:
        raise OversizeRecord(f"more than {MAX_HASHES_PER_RECORD} block hashes in one record")
    return tuple(blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES))


def _record_from_body(body: object) -> DigestRecord:
    if type(body) is not dict:
        raise MalformedRecord("record body must be a CBOR map")
    if set(body) != _BODY_KEYS:
        missing = sorted(str(k) for k in _BODY_KEYS - set(body))
        extra = sorted(repr(k) for k in set(body) - _BODY_KEYS)
        raise MalformedRecord(f"record body keys wrong (missing {missing}, unexpected {extra})")
    kind_code = body["k"]
    if type(kind_code) is not int or kind_code not in _KIND_NAMES:
        raise MalformedRecord(f"unknown record kind {kind_code!r}")
    raw_ns = body["n"]
    if type(raw_ns) is not list:
        raise MalformedRecord("namespaces must be an array")
    if len(raw_ns) > MAX_NAMESPACES_PER_RECORD:
        raise OversizeRecord(
            f"{len(raw_ns)} namespaces exceeds the limit of {MAX_NAMESPACES_PER_RECORD}"
        )
    namespaces = []
    for entry in raw_ns:
        if type(entry) is not list or len(entry) != 3:
            raise MalformedRecord("a namespace entry is [ns, added, removed]")
        ns, added, removed = entry
        if type(ns) is not bytes:
            raise MalformedRecord("namespace id must be bytes")
        namespaces.append(
            NamespaceDelta(ns, _split_hashes(added, "added"), _split_hashes(removed, "removed"))
        )
    raw_load = body["l"]
    if type(raw_load) is not list or len(raw_load) != 4:
        raise MalformedRecord("load is [queue_depth, active, prefill_tps, decode_tps]")
    raw_addrs = body["a"]
    if type(raw_addrs) is not list:
        raise MalformedRecord("addrs must be an array")
    if len(raw_addrs) > MAX_ADDRS:
        raise OversizeRecord(f"{len(raw_addrs)} addrs exceeds the limit of {MAX_ADDRS}")
    record = DigestRecord(
        origin=body["o"],
        epoch=body["e"],
        seq=body["s"],
        issued_at=body["i"],
        expires_at=body["x"],
        model=body["m"],
        kind=_KIND_NAMES[kind_code],
        namespaces=tuple(namespaces),
        load=LoadFigures(*raw_load),
        kv_capacity_bytes=body["c"],
        kv_used_bytes=body["u"],
        addrs=tuple(raw_addrs),
    )
    validate_record(record)
    return record


def decode_record(
    raw: bytes,
    *,
    now: float,
    max_clock_skew: float = 30.0,
    check_expiry: bool = True,
) -> SignedRecord:
    """Parse, validate and verify one encoded record; raise a :class:`DigestError`.

    Order of checks: size (before parsing), bounded CBOR parse, version, envelope shape,
    canonical envelope, body fields and limits, canonical body, signer == origin,
    signature, then time: :class:`FutureRecord` if ``issued_at > now + max_clock_skew``,
    :class:`ExpiredRecord` if ``expires_at <= now`` (skipped with ``check_expiry=False``:
    the anti-entropy state accepts an expired snapshot that a fresh later record of the
    same origin keeps alive, and decides liveness itself).
    """
    envelope = loads_bounded(raw, max_bytes=MAX_RECORD_BYTES, max_items=8)
    if type(envelope) is not list or not envelope:
        raise MalformedRecord("record envelope must be a non-empty CBOR array")
    version = envelope[0]
    if type(version) is not int:
        raise MalformedRecord("record version must be an integer")
    if version != RECORD_VERSION:
        raise UnknownVersion(f"record version {version} (this code speaks {RECORD_VERSION})")
    if len(envelope) != 4:
        raise MalformedRecord("record envelope is [version, body, signer key, signature]")
    _, body_bytes, signer_key, signature = envelope
    if type(body_bytes) is not bytes:
        raise MalformedRecord("record body must be a byte string")
    if type(signer_key) is not bytes or len(signer_key) != ED25519_PUBLIC_KEY_BYTES:
        raise MalformedRecord(f"signer key must be {ED25519_PUBLIC_KEY_BYTES} bytes")
    if type(signature) is not bytes or len(signature) != ED25519_SIGNATURE_BYTES:
        raise MalformedRecord(f"signature must be {ED25519_SIGNATURE_BYTES} bytes")
    if cbor2.dumps(envelope, canonical=True) != bytes(raw):
        raise MalformedRecord("record envelope is not canonically encoded")
    body = loads_bounded(body_bytes, max_bytes=MAX_RECORD_BYTES, max_items=MAX_BODY_ITEMS)
    record = _record_from_body(body)
    if cbor2.dumps(body, canonical=True) != body_bytes:
        raise MalformedRecord("record body is not canonically encoded")
    if peer_id_from_public_key(signer_key) != record.origin:
        raise SignerMismatch("the signer key's peer id is not the record's origin")
    if not verify_with_public_key(signer_key, SIGNATURE_LABEL + body_bytes, signature):
        raise BadSignature("record signature does not verify")
    if record.issued_at > now + max_clock_skew:
        raise FutureRecord(
            f"issued_at is {record.issued_at - now:.1f} s ahead (allowed skew {max_clock_skew} s)"
        )
    if check_expiry and record.expires_at <= now:
        raise ExpiredRecord(f"record expired {now - record.expires_at:.1f} s ago")
    return SignedRecord(record, bytes(raw))
