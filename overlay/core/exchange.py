"""Messages of the anti-entropy exchange: encoding and bounded decoding (pure).

The state they carry (summaries, records, bucket hashes) is kept by
:class:`~.antientropy.AntiEntropy`; this module only turns it into bytes and back, and
validates what a peer sends. The hosts (``overlay/gossip.py``, ``bench/gossip.py``) and
the partition codec (:mod:`.partition`, which reuses the entry and record-list parsers)
call these functions.

Exchange protocol (3 messages, push-pull)
-----------------------------------------
All messages are canonical CBOR arrays whose first element is the message type:

1. A -> B ``[1, summary]``                              (:func:`encode_summary`)
2. B -> A ``[2, records, summary, want_snapshots]``     (:func:`encode_reply`): the
   records A lacks, B's summary, and origins B wants full snapshots of
3. A -> B ``[3, records]``                              (:func:`encode_records`): the
   records B lacks

``summary`` is an array of ``[origin, epoch, seq]``; ``records`` an array of the raw
record byte strings; ``want_snapshots`` an array of origins. Decoders are bounded like
record decoding (size first, strict CBOR scan) and raise :class:`MalformedMessage` /
:class:`OversizeMessage`.

Cheaper exchanges (opt-in; the 3-message exchange above is unchanged)
-----------------------------------------------------------------------
The summary-hash opener (message 0): ``[0, hash16]``, answered ``[0, true]`` (in sync: the
exchange ends, the steady state costs two tiny messages) or ``[0, false]``.

*Bucketed summaries* (messages 7-8): when the opening summary hash differs, the responder
answers with ``k`` 4-byte bucket hashes (``k = bucket_count(origins held)``, about one
origin per bucket; bucket = low bits of the origin id; hash = XOR of the 4-byte hashes of
the bucket's entries), the initiator sends only its entries of the differing buckets
(:class:`ScopedSummary`), and both sides run ``records_for(..., scope=(k, buckets))`` and
reply with their entries of those buckets only. Same message count as the hash-opened
exchange; summaries shrink from ~45 bytes per origin to ~4 per origin plus ~45 per
*differing* origin. A bucket collision (2^-32 per differing bucket) only delays that
origin to a later exchange.

Limits (module constants)
-------------------------
:data:`MAX_BUCKETS` = 4096 bucket hashes per message 7; :data:`MAX_MESSAGE_BYTES` = 8 MiB,
:data:`MAX_RECORDS_PER_MESSAGE` = 4096, :data:`MAX_SUMMARY_ENTRIES` = 4096,
:data:`MAX_SNAPSHOT_REQUESTS` = 4096, and :data:`MAX_MESSAGE_ITEMS` CBOR items in all
(bounds the scan cost of hostile input).

Pure code: imports ``cbor2`` and other pure modules only.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import cbor2

from .digest import MAX_UINT, DigestError, SignedRecord, loads_bounded
from .identity import PEER_ID_BYTES

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_RECORDS_PER_MESSAGE",
    "MAX_SUMMARY_ENTRIES",
    "MAX_SNAPSHOT_REQUESTS",
    "MAX_MESSAGE_ITEMS",
    "MAX_BUCKETS",
    "MSG_SUMMARY_HASH",
    "MSG_SUMMARY",
    "MSG_REPLY",
    "MSG_RECORDS",
    "MSG_BUCKETS",
    "MSG_SCOPED_SUMMARY",
    "SUMMARY_HASH_BYTES",
    "Summary",
    "ExchangeReply",
    "ScopedSummary",
    "AntiEntropyError",
    "MalformedMessage",
    "OversizeMessage",
    "summary_hash",
    "hash_encoded_summary",
    "encode_summary_hash",
    "decode_summary_hash",
    "encode_summary",
    "decode_summary",
    "encode_reply",
    "decode_reply",
    "encode_records",
    "decode_records",
    "encode_entry",
    "entry_list",
    "summary_message",
    "reply_message",
    "entry_hash",
    "bucket_key",
    "bucket_count",
    "bucket_of",
    "encode_buckets",
    "decode_buckets",
    "encode_scoped_summary",
    "decode_scoped_summary",
    "peek_message_type",
    "summary_entries",
    "parse_summary_entries",
    "parse_record_list",
]

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_RECORDS_PER_MESSAGE = 4096
MAX_SUMMARY_ENTRIES = 4096
MAX_SNAPSHOT_REQUESTS = 4096
# type + records + summary entries (4 items each) + snapshot requests, with room to spare
MAX_MESSAGE_ITEMS = 8 + MAX_RECORDS_PER_MESSAGE + 4 * MAX_SUMMARY_ENTRIES + MAX_SNAPSHOT_REQUESTS

MSG_SUMMARY_HASH = 0
MSG_SUMMARY = 1
MSG_REPLY = 2
MSG_RECORDS = 3
MSG_BUCKETS = 7  # (4-6 were per-peer delta summaries: removed, never used by the node)
MSG_SCOPED_SUMMARY = 8
MAX_BUCKETS = 4096
BUCKET_HASH_BYTES = 4
SUMMARY_HASH_BYTES = 16
_MAX_HASH_MESSAGE_BYTES = 64

Summary = dict[bytes, tuple[int, int]]


# --- errors -----------------------------------------------------------------------------


class AntiEntropyError(DigestError):
    """Base class of the errors anti-entropy adds to the digest errors (messages and state)."""


class MalformedMessage(AntiEntropyError):
    """An exchange message that does not parse or has the wrong structure."""


class OversizeMessage(AntiEntropyError):
    """An exchange message beyond a documented limit."""


# --- messages 0-3 -------------------------------------------------------------------------


@dataclass(frozen=True)
class ExchangeReply:
    records: list[bytes]
    summary: Summary
    want_snapshots: frozenset[bytes]


def _raws(records: Iterable[SignedRecord | bytes]) -> list[bytes]:
    return [r.raw if isinstance(r, SignedRecord) else bytes(r) for r in records]


def summary_entries(summary: Mapping[bytes, tuple[int, int]]) -> list:
    """A summary as the wire's sorted ``[origin, epoch, seq]`` array."""
    return [[o, e, s] for o, (e, s) in sorted(summary.items())]


def _dump(message: list) -> bytes:
    data = cbor2.dumps(message, canonical=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise OversizeMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def _cbor_head(major: int, n: int) -> bytes:
    """Canonical (shortest) CBOR head of major type ``major`` with argument ``n``."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


def encode_entry(origin: bytes, version: tuple[int, int]) -> bytes:
    """Canonical CBOR of the summary entry ``[origin, epoch, seq]``."""
    return b"".join(
        (b"\x83", _cbor_head(2, len(origin)), origin, _cbor_head(0, version[0]),
         _cbor_head(0, version[1]))
    )  # fmt: skip


_MSG_SUMMARY_PREFIX = b"\x82\x01"  # [1, ...]: a 2-element array, then the type
_REPLY_PREFIX = b"\x84\x02"  # [2, ...]


def entry_list(entries: Sequence[bytes]) -> bytes:
    """Canonical CBOR of the array of already-encoded entries (:func:`encode_entry`, in
    origin order): what a state that caches its entries' encodings builds summaries from."""
    return _cbor_head(4, len(entries)) + b"".join(entries)


def summary_message(list_cbor: bytes, n_entries: int) -> bytes:
    """Message 1 around an encoded entry array (:func:`entry_list`): the bytes of
    :func:`encode_summary` of the same summary."""
    if n_entries > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(f"summary of {n_entries} entries exceeds {MAX_SUMMARY_ENTRIES}")
    return _MSG_SUMMARY_PREFIX + list_cbor


def reply_message(
    records: Iterable[SignedRecord | bytes],
    list_cbor: bytes,
    n_entries: int,
    want_snapshots: Iterable[bytes] = (),
) -> bytes:
    """Message 2 around an encoded entry array: the bytes of :func:`encode_reply`."""
    raws = _raws(records)
    want = sorted(set(want_snapshots))
    _check_reply_bounds(len(raws), n_entries, len(want))
    data = b"".join(
        (_REPLY_PREFIX, cbor2.dumps(raws, canonical=True), list_cbor,
         cbor2.dumps(want, canonical=True))
    )  # fmt: skip
    if len(data) > MAX_MESSAGE_BYTES:
        raise OversizeMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def hash_encoded_summary(message: bytes) -> bytes:
    """The summary hash of an encoded message 1 (:func:`summary_hash` without re-encoding)."""
    return hashlib.blake2b(message, digest_size=SUMMARY_HASH_BYTES).digest()


def entry_hash(entry: bytes) -> int:
    """The 4-byte hash of one encoded entry; a bucket's hash is the XOR of its entries'."""
    return int.from_bytes(hashlib.blake2b(entry, digest_size=BUCKET_HASH_BYTES).digest(), "big")


def _check_reply_bounds(n_records: int, n_summary: int, n_want: int) -> None:
    if n_records > MAX_RECORDS_PER_MESSAGE:
        raise OversizeMessage(f"{n_records} records exceeds {MAX_RECORDS_PER_MESSAGE}")
    if n_summary > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(f"summary of {n_summary} entries exceeds {MAX_SUMMARY_ENTRIES}")
    if n_want > MAX_SNAPSHOT_REQUESTS:
        raise OversizeMessage(f"{n_want} snapshot requests exceeds {MAX_SNAPSHOT_REQUESTS}")


def summary_hash(summary: Mapping[bytes, tuple[int, int]]) -> bytes:
    """16-byte hash of a summary's canonical encoding (equal iff the summaries are).

    An exchange opens with it (:func:`encode_summary_hash`): two peers that are already
    in sync (the steady state) exchange 16 bytes and a boolean instead of their summaries.
    """
    return hash_encoded_summary(encode_summary(summary))


def encode_summary_hash(value: bytes | bool) -> bytes:
    """Message 0: ``[0, hash16]`` (the opener) or ``[0, bool]`` (the answer: in sync?)."""
    return _dump([MSG_SUMMARY_HASH, value])


def decode_summary_hash(data: bytes) -> bytes | bool:
    """Inverse of :func:`encode_summary_hash`; raises :class:`MalformedMessage`."""
    if len(data) > _MAX_HASH_MESSAGE_BYTES:
        raise OversizeMessage(f"summary-hash message of {len(data)} bytes")
    try:
        msg = cbor2.loads(data)
    except Exception as exc:  # cbor2 raises several types on garbage; all mean malformed
        raise MalformedMessage(f"summary-hash message is not CBOR: {exc}") from None
    if isinstance(msg, list) and len(msg) == 2 and msg[0] == MSG_SUMMARY_HASH and (
        (type(msg[1]) is bytes and len(msg[1]) == SUMMARY_HASH_BYTES) or type(msg[1]) is bool
    ):
        return msg[1]
    raise MalformedMessage("summary-hash message must be [0, hash16] or [0, bool]")


def encode_summary(summary: Mapping[bytes, tuple[int, int]]) -> bytes:
    """Message 1: ``[1, [[origin, epoch, seq], ...]]``."""
    if len(summary) > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(f"summary of {len(summary)} entries exceeds {MAX_SUMMARY_ENTRIES}")
    return _dump([MSG_SUMMARY, summary_entries(summary)])


def encode_reply(
    records: Iterable[SignedRecord | bytes],
    summary: Mapping[bytes, tuple[int, int]],
    want_snapshots: Iterable[bytes] = (),
) -> bytes:
    """Message 2: ``[2, [raw, ...], [[origin, epoch, seq], ...], [origin, ...]]``."""
    raws = _raws(records)
    want = sorted(set(want_snapshots))
    _check_reply_bounds(len(raws), len(summary), len(want))
    return _dump([MSG_REPLY, raws, summary_entries(summary), want])


def encode_records(records: Iterable[SignedRecord | bytes]) -> bytes:
    """Message 3: ``[3, [raw, ...]]``."""
    raws = _raws(records)
    if len(raws) > MAX_RECORDS_PER_MESSAGE:
        raise OversizeMessage(f"{len(raws)} records exceeds {MAX_RECORDS_PER_MESSAGE}")
    return _dump([MSG_RECORDS, raws])


def _load_message(data: bytes, msg_type: int, arity: int) -> list:
    message = loads_bounded(
        data,
        max_bytes=MAX_MESSAGE_BYTES,
        max_depth=4,
        max_items=MAX_MESSAGE_ITEMS,
        error=MalformedMessage,
        oversize_error=OversizeMessage,
    )
    if type(message) is not list or not message or type(message[0]) is not int:
        raise MalformedMessage("an exchange message is a CBOR array starting with its type")
    if message[0] != msg_type:
        raise MalformedMessage(f"expected message type {msg_type}, got {message[0]}")
    if len(message) != arity:
        raise MalformedMessage(f"message type {msg_type} has {arity} elements")
    return message


def parse_summary_entries(entries: object) -> Summary:
    """Validate a decoded ``[origin, epoch, seq]`` array (raises MalformedMessage /
    OversizeMessage)."""
    if type(entries) is not list:
        raise MalformedMessage("summary must be an array")
    if len(entries) > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(f"summary of {len(entries)} entries exceeds {MAX_SUMMARY_ENTRIES}")
    summary: Summary = {}
    for entry in entries:
        if type(entry) is not list or len(entry) != 3:
            raise MalformedMessage("a summary entry is [origin, epoch, seq]")
        origin, epoch, seq = entry
        if type(origin) is not bytes or len(origin) != PEER_ID_BYTES:
            raise MalformedMessage(f"summary origin must be a {PEER_ID_BYTES}-byte peer id")
        for value in (epoch, seq):
            if type(value) is not int or not 0 <= value <= MAX_UINT:
                raise MalformedMessage("summary epoch/seq must be integers in [0, 2^63)")
        if origin in summary:
            raise MalformedMessage("summary lists an origin twice")
        summary[origin] = (epoch, seq)
    return summary


def parse_record_list(items: object) -> list[bytes]:
    """Validate a decoded array of raw records (raises MalformedMessage / OversizeMessage)."""
    if type(items) is not list:
        raise MalformedMessage("records must be an array")
    if len(items) > MAX_RECORDS_PER_MESSAGE:
        raise OversizeMessage(f"{len(items)} records exceeds {MAX_RECORDS_PER_MESSAGE}")
    if any(type(item) is not bytes for item in items):
        raise MalformedMessage("each record must be a byte string")
    return items


def decode_summary(data: bytes) -> Summary:
    return parse_summary_entries(_load_message(data, MSG_SUMMARY, 2)[1])


def decode_reply(data: bytes) -> ExchangeReply:
    _, raws, summary, want = _load_message(data, MSG_REPLY, 4)
    if type(want) is not list:
        raise MalformedMessage("snapshot requests must be an array")
    if len(want) > MAX_SNAPSHOT_REQUESTS:
        raise OversizeMessage(f"{len(want)} snapshot requests exceeds {MAX_SNAPSHOT_REQUESTS}")
    if any(type(o) is not bytes or len(o) != PEER_ID_BYTES for o in want):
        raise MalformedMessage("snapshot requests must be peer ids")
    return ExchangeReply(parse_record_list(raws), parse_summary_entries(summary), frozenset(want))


def decode_records(data: bytes) -> list[bytes]:
    return parse_record_list(_load_message(data, MSG_RECORDS, 2)[1])


# --- bucketed summaries (messages 7-8) --------------------------------------------------------


def bucket_count(n_origins: int) -> int:
    """The bucket count a node uses for ``n_origins`` held: the power of two >= it (about
    one origin per bucket), at most :data:`MAX_BUCKETS`."""
    return min(MAX_BUCKETS, 1 << max(0, n_origins - 1).bit_length())


@functools.lru_cache(maxsize=1 << 16)
def bucket_key(origin: bytes) -> int:
    return int.from_bytes(origin[-4:], "big")


def bucket_of(origin: bytes, k: int) -> int:
    """The bucket of ``origin`` among ``k`` (a power of two): low bits of its last 4 bytes
    (peer ids end with a public key: uniformly spread)."""
    return bucket_key(origin) & (k - 1)


@dataclass(frozen=True)
class ScopedSummary:
    """The initiator's entries for the ``buckets`` (of ``k``) whose hashes differ."""

    k: int
    buckets: tuple[int, ...]
    entries: Summary


def _check_k(k: object, error: type[Exception]) -> int:
    if type(k) is not int or not (0 < k <= MAX_BUCKETS and k & (k - 1) == 0):
        raise error(f"bucket count must be a power of two <= {MAX_BUCKETS}")
    return k


def encode_buckets(hashes: Sequence[int]) -> bytes:
    """Message 7: ``[7, bytes]``, the responder's bucket hashes (4 bytes each, big-endian)
    when the opening summary hash differs (replaces ``[0, false]``)."""
    _check_k(len(hashes), ValueError)
    return _dump([MSG_BUCKETS, b"".join(h.to_bytes(BUCKET_HASH_BYTES, "big") for h in hashes)])


def decode_buckets(data: bytes) -> list[int]:
    _, packed = _load_message(data, MSG_BUCKETS, 2)
    if type(packed) is not bytes or len(packed) % BUCKET_HASH_BYTES:
        raise MalformedMessage("bucket hashes are a byte string of 4-byte hashes")
    k = _check_k(len(packed) // BUCKET_HASH_BYTES, MalformedMessage)
    return [
        int.from_bytes(packed[i : i + BUCKET_HASH_BYTES], "big")
        for i in range(0, k * BUCKET_HASH_BYTES, BUCKET_HASH_BYTES)
    ]


def encode_scoped_summary(scoped: ScopedSummary) -> bytes:
    """Message 8: ``[8, k, [bucket, ...], [[origin, epoch, seq], ...]]`` (replaces message
    1): the initiator's entries for the differing buckets."""
    _check_k(scoped.k, ValueError)
    if len(scoped.entries) > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(
            f"summary of {len(scoped.entries)} entries exceeds {MAX_SUMMARY_ENTRIES}"
        )
    buckets = sorted(set(scoped.buckets))
    return _dump([MSG_SCOPED_SUMMARY, scoped.k, buckets, summary_entries(scoped.entries)])


def decode_scoped_summary(data: bytes) -> ScopedSummary:
    """Inverse of :func:`encode_scoped_summary`; validated like a summary, and every bucket
    must be in range and listed once, every entry in a listed bucket."""
    _, k, buckets, entries = _load_message(data, MSG_SCOPED_SUMMARY, 4)
    k = _check_k(k, MalformedMessage)
    if type(buckets) is not list or len(buckets) > k:
        raise MalformedMessage("buckets must be an array of at most k indices")
    if any(type(b) is not int or not 0 <= b < k for b in buckets):
        raise MalformedMessage("bucket indices must be integers in [0, k)")
    scope = set(buckets)
    if len(scope) != len(buckets):
        raise MalformedMessage("a bucket is listed twice")
    summary = parse_summary_entries(entries)
    if any(bucket_of(o, k) not in scope for o in summary):
        raise MalformedMessage("a summary entry outside the listed buckets")
    return ScopedSummary(k, tuple(buckets), summary)


def peek_message_type(data: bytes) -> int | None:
    """The type of an exchange message (its first element) without decoding it, or None
    when ``data`` does not start like one (a CBOR array whose first item is a small
    unsigned integer). Decode with the matching ``decode_*``, which validates everything."""
    if len(data) >= 2 and 0x81 <= data[0] <= 0x97 and data[1] < 24:
        return data[1]
    return None
