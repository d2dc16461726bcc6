"""Scuttlebutt-style anti-entropy over signed digest records (pure state machine).

Each node is the *origin* of one record stream (see :mod:`.digest`): within an epoch
(incarnation) every record has the next sequence number. A ``snapshot`` record resets
what is known about the origin; each ``delta`` after it adds hashes and removes
(tombstones) hashes. So the state of an origin is fully described by its latest
snapshot plus the deltas after it, and that is exactly what every node holds, per
origin, byte-identical and signed by the origin: relays never re-sign or re-encode.

Summaries and what a peer lacks
-------------------------------
``summary()`` maps origin -> (epoch, last seq held). Given a peer's summary,
:meth:`AntiEntropy.records_for` returns, per origin, the records the peer lacks:

- peer has the same epoch and a seq at or after our snapshot: the deltas after it;
- peer has an older epoch, nothing, a seq before our snapshot, or asked for a
  snapshot (``want_snapshots``): our snapshot and every delta after it;
- peer is newer (later epoch or seq): nothing.

Within ``budget_bytes`` origins are served round-robin, one record per origin per pass,
origins with the fewest bytes needed (then the freshest) first, so one origin's big
snapshot cannot starve the others. An origin's records are sent in seq order and an
origin is cut off at its first record that does not fit, so a receiver always gets a
gap-free prefix. (A budget smaller than a single record sends nothing for that origin;
hosts should use budgets of at least :data:`~.digest.MAX_RECORD_BYTES`.)

Receiving
---------
:meth:`AntiEntropy.receive` verifies each record (signature, limits, clock skew), then:

- byte-identical to a held record: ignored silently (counted as ``duplicates``);
- other model fingerprint: :class:`WrongModel`;
- same (epoch, seq) as a held record, different bytes: :class:`~.digest.ReplayedRecord`
  (the origin signed two records for one seq: equivocation);
- lower epoch, or a seq older than the held snapshot:
  :class:`~.digest.SequenceRegression` (this also happens in normal operation when a
  stale relay races a fresh one; do not punish the sender for it);
- a delta whose seq is not last+1, a delta of an unknown origin, or a delta of a new
  epoch: a *gap*; it is not applied and the origin is reported in ``need_snapshot``
  (the next exchange's summary fetches what is missing; hosts may also list such
  origins as snapshot requests);
- a snapshot newer than what is held replaces the origin's log.

Expiry: a record whose ``expires_at`` has passed is accepted only when a fresher record
of the same origin arrives in the same batch (an origin's snapshot may be old while its
latest refresh keeps it alive). :meth:`AntiEntropy.expire` drops remote origins whose
newest record has expired.

The local node
--------------
The local cache is refcounted per (namespace, block hash): several prefixes share their
leading blocks, and a hash stays advertised while any prefix holding it remains.
:meth:`AntiEntropy.tick` turns the changes since the last record into deltas (removals
become tombstones), issues a refresh (an empty delta carrying load figures) every
``refresh_interval`` so peers do not expire the node, and compacts into a new snapshot
when the deltas since the snapshot outweigh it in bytes (or number half of
:data:`MAX_DELTAS_PER_ORIGIN`), which garbage-collects old deltas and tombstones
everywhere. A snapshot larger than one record's limits is a *snapshot chain*: one
``snapshot`` record followed by ``delta`` records adding the rest (consecutive seqs).
At most :data:`MAX_ADVERTISED_HASHES` hashes are advertised; hashes beyond that are
tracked but unadvertised until space frees and the next snapshot (an honest
under-statement: a peer index then sees a shorter match, never a false one).

If a peer hands us a record of our own origin newer than anything we issued (our epoch
counter went backwards, e.g. a restart reusing an epoch), we move to a later epoch and
issue a fresh snapshot.

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
The summary is kept incrementally (every change of an origin's (epoch, seq) goes through
one method) with each entry's canonical CBOR cached, so ``summary_digest()``,
``encoded_summary()`` and ``encode_reply()`` cost O(1) while nothing changed and are
byte-identical to ``summary_hash``/``encode_summary``/``encode_reply`` of ``summary()``;
``records_for`` looks only at origins whose (epoch, seq) differ from the peer's.

*Bucketed summaries* (messages 7-8): when the opening summary hash differs, the responder
answers with ``k`` 4-byte bucket hashes (``k = bucket_count(origins held)``, about one
origin per bucket; bucket = low bits of the origin id; hash = XOR of the 4-byte hashes of
the bucket's entries), the initiator sends only its entries of the differing buckets
(:class:`ScopedSummary`), and both sides run ``records_for(..., scope=(k, buckets))`` and
reply with their entries of those buckets only. Same message count as the hash-opened
exchange; summaries shrink from ~45 bytes per origin to ~4 per origin plus ~45 per
*differing* origin. A bucket collision (2^-32 per differing bucket) only delays that
origin to a later exchange.

*Per-peer delta summaries* (messages 4-6): a summary sent to a peer lists only origins
changed since the last summary we told it, against a base named by its summary hash; the
receiver patches the view it holds under that hash (LRU of ``max_peer_views`` peers) or
answers ``[6]`` (send the whole summary) when it does not hold it, so a lost message
costs one full summary, never a wrong view. Entries are untrusted like a full summary:
validated by the decoder, and a patched view is bounded by :data:`MAX_SUMMARY_ENTRIES`.
Helps only when the same pair meets again before most origins changed (rare under random
peer choice; docs/bench/sim.md has the numbers).

*Digest-rate knobs*: ``min_record_interval`` batches own changes into at most one delta per
interval; ``compaction_ratio`` issues a compaction snapshot only when the deltas since the
last one outweigh it that many times (1.0: the historical rule; a snapshot is re-sent to
every node, so at ratio r snapshots are ~1/(1+r) of the record bytes instead of ~1/2).

Limits (module constants)
-------------------------
- :data:`MAX_ORIGINS` = 1024 remote origins held; records of further new origins are
  refused (:class:`OriginTableFull`) until some expire.
- :data:`MAX_DELTAS_PER_ORIGIN` = 256 and :data:`MAX_ORIGIN_BYTES` = 2 MiB held per
  origin (snapshot + deltas); a delta beyond that is refused (:class:`TooManyDeltas`)
  until the origin compacts. Our own compaction keeps us well inside both.
- Worst case held: MAX_ORIGINS x MAX_ORIGIN_BYTES = 2 GiB, only reachable by 1024
  hostile identities each publishing maximal chains; honest nodes with 1,000 cached
  prefixes hold a few tens of KiB each (see bench/micro_core_digest.py).
- :data:`MAX_ADVERTISED_HASHES` = 65,536 local hashes (a 16-record snapshot chain).
- :data:`MAX_BUCKETS` = 4096 bucket hashes per message 7; :data:`MAX_PEER_VIEWS` = 64
  peers' delta-summary state by default (each a summary: O(origins)).
- :data:`MAX_MESSAGE_BYTES` = 8 MiB, :data:`MAX_RECORDS_PER_MESSAGE` = 4096,
  :data:`MAX_SUMMARY_ENTRIES` = 4096, :data:`MAX_SNAPSHOT_REQUESTS` = 4096, and
  :data:`MAX_MESSAGE_ITEMS` CBOR items in all (bounds the scan cost of hostile input).

Pure code: time and randomness come in as arguments; no trio, libp2p or llama imports.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest

import cbor2

from .digest import (
    HASH_BYTES,
    KIND_DELTA,
    KIND_SNAPSHOT,
    MAX_HASHES_PER_RECORD,
    MAX_NAMESPACES_PER_RECORD,
    MAX_TTL_S,
    MAX_UINT,
    NAMESPACE_ID_BYTES,
    DigestError,
    DigestRecord,
    ExpiredRecord,
    LoadFigures,
    NamespaceDelta,
    ReplayedRecord,
    SequenceRegression,
    SignedRecord,
    decode_record,
    loads_bounded,
    sign_record,
)
from .identity import PEER_ID_BYTES, Identity

__all__ = [
    "MAX_ORIGINS",
    "MAX_DELTAS_PER_ORIGIN",
    "MAX_ORIGIN_BYTES",
    "MAX_ADVERTISED_HASHES",
    "MAX_MESSAGE_BYTES",
    "MAX_RECORDS_PER_MESSAGE",
    "MAX_SUMMARY_ENTRIES",
    "MAX_SNAPSHOT_REQUESTS",
    "MAX_MESSAGE_ITEMS",
    "MSG_SUMMARY_HASH",
    "MSG_SUMMARY",
    "summary_hash",
    "encode_summary_hash",
    "decode_summary_hash",
    "MSG_REPLY",
    "MSG_RECORDS",
    "MSG_DELTA_SUMMARY",
    "MSG_DELTA_REPLY",
    "MSG_NEED_SUMMARY",
    "MAX_PEER_VIEWS",
    "MSG_BUCKETS",
    "MSG_SCOPED_SUMMARY",
    "MAX_BUCKETS",
    "bucket_count",
    "bucket_of",
    "ScopedSummary",
    "encode_buckets",
    "decode_buckets",
    "encode_scoped_summary",
    "decode_scoped_summary",
    "peek_message_type",
    "FULL_BASE",
    "DeltaSummary",
    "DeltaReply",
    "encode_delta_summary",
    "decode_delta_summary",
    "encode_need_summary",
    "decode_need_summary",
    "encode_delta_reply",
    "decode_delta_reply",
    "AntiEntropy",
    "ReceiveResult",
    "ExchangeReply",
    "Summary",
    "AntiEntropyError",
    "WrongModel",
    "OriginTableFull",
    "TooManyDeltas",
    "MalformedMessage",
    "OversizeMessage",
    "encode_summary",
    "decode_summary",
    "encode_reply",
    "decode_reply",
    "encode_records",
    "decode_records",
    "summary_entries",
    "parse_summary_entries",
    "parse_record_list",
]

MAX_ORIGINS = 1024
MAX_DELTAS_PER_ORIGIN = 256
MAX_ORIGIN_BYTES = 2 * 1024 * 1024
MAX_ADVERTISED_HASHES = 65536
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_RECORDS_PER_MESSAGE = 4096
MAX_SUMMARY_ENTRIES = 4096
MAX_SNAPSHOT_REQUESTS = 4096
# type + records + summary entries (4 items each) + snapshot requests, with room to spare
MAX_MESSAGE_ITEMS = 8 + MAX_RECORDS_PER_MESSAGE + 4 * MAX_SUMMARY_ENTRIES + MAX_SNAPSHOT_REQUESTS

MSG_SUMMARY = 1
MSG_REPLY = 2
MSG_RECORDS = 3
MSG_DELTA_SUMMARY = 4
MSG_DELTA_REPLY = 5
MSG_NEED_SUMMARY = 6
MAX_PEER_VIEWS = 64
MSG_BUCKETS = 7
MSG_SCOPED_SUMMARY = 8
MAX_BUCKETS = 4096
BUCKET_HASH_BYTES = 4
_MAX_CACHED_BUCKET_COUNTS = 4  # bucket counts whose hashes are kept current

Summary = dict[bytes, tuple[int, int]]


# --- errors -----------------------------------------------------------------------------


class AntiEntropyError(DigestError):
    """Base class of the errors this module adds to the digest errors."""


class WrongModel(AntiEntropyError):
    """A record for a different model fingerprint than ours."""


class OriginTableFull(AntiEntropyError):
    """A record of a new origin while :data:`MAX_ORIGINS` origins are held."""


class TooManyDeltas(AntiEntropyError):
    """A delta beyond :data:`MAX_DELTAS_PER_ORIGIN` / :data:`MAX_ORIGIN_BYTES` for its origin."""


class MalformedMessage(AntiEntropyError):
    """An exchange message that does not parse or has the wrong structure."""


class OversizeMessage(AntiEntropyError):
    """An exchange message beyond a documented limit."""


# --- state ------------------------------------------------------------------------------


@dataclass
class ReceiveResult:
    applied: list[DigestRecord] = field(default_factory=list)  # in apply order
    rejected: list[DigestError] = field(default_factory=list)
    need_snapshot: set[bytes] = field(default_factory=set)
    duplicates: int = 0


class _OriginLog:
    """One origin's latest snapshot and the deltas after it (consecutive seqs)."""

    __slots__ = ("epoch", "records", "n_bytes", "expires_at")

    def __init__(self, snapshot: SignedRecord):
        self.epoch = snapshot.record.epoch
        self.records: list[SignedRecord] = [snapshot]
        self.n_bytes = len(snapshot.raw)
        self.expires_at = snapshot.record.expires_at

    @property
    def first_seq(self) -> int:
        return self.records[0].record.seq

    @property
    def last_seq(self) -> int:
        return self.records[-1].record.seq

    def get(self, seq: int) -> SignedRecord | None:
        i = seq - self.first_seq
        return self.records[i] if 0 <= i < len(self.records) else None

    def append(self, signed: SignedRecord) -> None:
        self.records.append(signed)
        self.n_bytes += len(signed.raw)
        self.expires_at = max(self.expires_at, signed.record.expires_at)

    def after(self, seq: int) -> list[SignedRecord]:
        """Held records with a seq greater than ``seq``."""
        start = max(0, seq + 1 - self.first_seq)
        return self.records[start:]


def _new_stats() -> dict:
    return {
        "records_sent": 0,
        "bytes_sent": 0,
        "records_received": 0,
        "bytes_received": 0,
        "records_applied": 0,
        "duplicates": 0,
        "gaps": 0,
        "rejected": Counter(),  # error class name -> count
        "records_issued": 0,
        "bytes_issued": 0,
        "snapshots_issued": 0,
        "refreshes_issued": 0,
        "origins_expired": 0,
        "own_epoch_bumps": 0,
        "unadvertised_hashes": 0,
    }


def _check_ns(ns: bytes) -> bytes:
    if not isinstance(ns, bytes | bytearray) or len(ns) != NAMESPACE_ID_BYTES:
        raise ValueError(f"a namespace id is {NAMESPACE_ID_BYTES} bytes")
    return bytes(ns)


def _check_chain(chain: Sequence[bytes]) -> list[bytes]:
    out = []
    for h in chain:
        if not isinstance(h, bytes | bytearray) or len(h) != HASH_BYTES:
            raise ValueError(f"block hashes are {HASH_BYTES} bytes")
        out.append(bytes(h))
    return out


class AntiEntropy:
    """The anti-entropy state of one node: its own record stream and everyone else's."""

    def __init__(
        self,
        identity: Identity,
        model_fp: bytes,
        *,
        epoch: int,
        now: float,
        ttl: float = 60.0,
        refresh_interval: float = 20.0,
        addrs: Sequence[str] = (),
        max_clock_skew: float = 30.0,
        min_record_interval: float = 0.0,
        max_peer_views: int = MAX_PEER_VIEWS,
        compaction_ratio: float = 1.0,
    ):
        if not 0 < ttl <= MAX_TTL_S:
            raise ValueError(f"ttl must be in (0, {MAX_TTL_S}]")
        if not 0 < refresh_interval < ttl:
            raise ValueError("refresh_interval must be positive and shorter than ttl")
        if not 0 <= min_record_interval < refresh_interval:
            raise ValueError("min_record_interval must be in [0, refresh_interval)")
        if not 0 <= epoch <= MAX_UINT:
            raise ValueError("epoch out of range")
        self.identity = identity
        self.peer_id = identity.peer_id
        self.model_fp = bytes(model_fp)
        self.ttl = float(ttl)
        self.refresh_interval = float(refresh_interval)
        self.min_record_interval = float(min_record_interval)
        if not 0 < compaction_ratio <= 64:
            raise ValueError("compaction_ratio must be in (0, 64]")
        self.compaction_ratio = float(compaction_ratio)
        if max_peer_views < 0:
            raise ValueError("max_peer_views must be >= 0")
        self.max_peer_views = max_peer_views
        # per-peer delta summaries (LRU, at most max_peer_views each): what we last told a
        # peer our summary was (stamp, hash), and the last summary we know of a peer's
        self._told: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._views: OrderedDict[bytes, tuple[bytes, Summary]] = OrderedDict()
        self.max_clock_skew = float(max_clock_skew)
        self.addrs = tuple(addrs)
        self.epoch = epoch
        self.stats = _new_stats()
        self._load = LoadFigures()
        self._kv_capacity = 0
        self._kv_used = 0
        # local cache: refcounts, what is advertised, what changed since the last record
        self._refs: dict[bytes, dict[bytes, int]] = {}
        self._advertised: dict[bytes, set[bytes]] = {}
        self._n_advertised = 0
        self._overflow: dict[bytes, dict[bytes, None]] = {}  # present but unadvertised
        self._pending_add: dict[bytes, set[bytes]] = {}
        self._pending_remove: dict[bytes, set[bytes]] = {}
        # record streams: own and remote
        self._logs: dict[bytes, _OriginLog] = {}
        self._held_raws: set[bytes] = set()
        # The summary, kept incrementally (every change goes through _touch/_untouch), with
        # per-origin change stamps in change order (oldest first) for per-peer deltas, and
        # the canonical CBOR of each entry and of the whole list, cached until they change.
        self._summary: Summary = {}
        self._stamp = 0
        self._changed_at: dict[bytes, int] = {}
        self._removed_at = 0  # stamp of the latest origin removal
        self._entry_cbor: dict[bytes, bytes] = {}
        self._sorted_origins: list[bytes] | None = None
        self._list_cbor: bytes | None = None
        self._digest: bytes | None = None
        self._entry_hash: dict[bytes, int] = {}  # origin -> 4-byte hash of its entry
        self._buckets: dict[int, list[int]] = {}  # k -> bucket hashes (until a change)
        self._next_seq = 0
        self._base_bytes = 0  # bytes of our latest snapshot chain
        self._last_issued_at = now
        self._force_snapshot = True
        self.tick(now)

    # --- the summary, kept incrementally --------------------------------------------------

    def _touch(self, origin: bytes) -> None:
        """Record that ``origin``'s (epoch, last seq) changed."""
        log = self._logs[origin]
        version = (log.epoch, log.records[-1].record.seq)
        if self._summary.get(origin) == version:
            return
        if origin not in self._summary:
            self._sorted_origins = None
        self._summary[origin] = version
        self._stamp += 1
        self._changed_at.pop(origin, None)
        self._changed_at[origin] = self._stamp  # re-inserted: dict order = change order
        self._entry_cbor.pop(origin, None)  # re-encoded when next needed
        old_h = self._entry_hash.pop(origin, None)
        self._list_cbor = self._digest = None
        if self._buckets:  # keep the cached bucket hashes current: XOR the entry out and in
            new_h = self._hash_entry(origin, version)
            key = _bucket_key(origin)
            for k, hashes in self._buckets.items():
                hashes[key & (k - 1)] ^= new_h if old_h is None else new_h ^ old_h

    def _untouch(self, origin: bytes) -> None:
        """Record that ``origin`` is no longer held."""
        if self._summary.pop(origin, None) is None:
            return
        self._stamp += 1
        self._removed_at = self._stamp
        self._changed_at.pop(origin, None)
        self._entry_cbor.pop(origin, None)
        old_h = self._entry_hash.pop(origin, None)
        self._sorted_origins = None
        self._list_cbor = self._digest = None
        if old_h is not None:
            key = _bucket_key(origin)
            for k, hashes in self._buckets.items():
                hashes[key & (k - 1)] ^= old_h
        else:
            self._buckets.clear()

    def _summary_list_cbor(self) -> bytes:
        """Canonical CBOR of the summary's entry array (cached until it changes)."""
        if self._list_cbor is None:
            if self._sorted_origins is None:
                self._sorted_origins = sorted(self._summary)
            entry = self._entry_cbor
            if len(entry) < len(self._summary):
                for o, version in self._summary.items():
                    if o not in entry:
                        entry[o] = _entry_cbor(o, version)
            self._list_cbor = _cbor_head(4, len(self._sorted_origins)) + b"".join(
                [entry[o] for o in self._sorted_origins]
            )
        return self._list_cbor

    def encoded_summary(self) -> bytes:
        """Message 1 for our summary: the bytes of ``encode_summary(self.summary())``,
        built from cached per-origin encodings."""
        if len(self._summary) > MAX_SUMMARY_ENTRIES:
            raise OversizeMessage(
                f"summary of {len(self._summary)} entries exceeds {MAX_SUMMARY_ENTRIES}"
            )
        return _MSG_SUMMARY_PREFIX + self._summary_list_cbor()

    def summary_digest(self) -> bytes:
        """``summary_hash(self.summary())``, cached until the summary changes."""
        if self._digest is None:
            self._digest = hashlib.blake2b(
                self.encoded_summary(), digest_size=SUMMARY_HASH_BYTES
            ).digest()
        return self._digest

    def encode_reply(
        self, records: Iterable[SignedRecord | bytes], want_snapshots: Iterable[bytes] = ()
    ) -> bytes:
        """Message 2 carrying our summary: the bytes of
        ``encode_reply(records, self.summary(), want_snapshots)``, without re-encoding
        the summary."""
        raws = _raws(records)
        want = sorted(set(want_snapshots))
        _check_reply_bounds(len(raws), len(self._summary), len(want))
        data = b"".join(
            (
                _REPLY_PREFIX,
                cbor2.dumps(raws, canonical=True),
                self._summary_list_cbor(),
                cbor2.dumps(want, canonical=True),
            )
        )
        if len(data) > MAX_MESSAGE_BYTES:
            raise OversizeMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return data

    # --- bucketed summaries ------------------------------------------------------------------

    def bucket_hashes(self, k: int) -> list[int]:
        """Our summary split into ``k`` buckets by origin (:func:`bucket_of`): per bucket
        the XOR of the 4-byte hashes of its entries (0 when empty). Equal buckets on two
        nodes mean equal entries (up to a 2^-32 chance per differing bucket), so an
        exchange needs to compare only the entries of the buckets that differ."""
        cached = self._buckets.get(k)
        if cached is not None:
            return list(cached)
        if not (0 < k <= MAX_BUCKETS and k & (k - 1) == 0):
            raise ValueError(f"bucket count must be a power of two <= {MAX_BUCKETS}")
        out = [0] * k
        eh = self._entry_hash
        mask = k - 1
        for origin, version in self._summary.items():
            h = eh.get(origin)
            if h is None:
                h = self._hash_entry(origin, version)
            out[_bucket_key(origin) & mask] ^= h
        if len(self._buckets) >= _MAX_CACHED_BUCKET_COUNTS:
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[k] = out  # kept current by _touch/_untouch from now on
        return list(out)

    def _hash_entry(self, origin: bytes, version: tuple[int, int]) -> int:
        cbor = self._entry_cbor.get(origin) or _entry_cbor(origin, version)
        h = self._entry_hash[origin] = int.from_bytes(
            hashlib.blake2b(cbor, digest_size=BUCKET_HASH_BYTES).digest(), "big"
        )
        return h

    def summary_size(self) -> int:
        """Number of origins held, our own included (``len(self.summary())``)."""
        return len(self._summary)

    def scoped_summary(self, k: int, buckets: Iterable[int]) -> Summary:
        """Our summary's entries whose origins fall in ``buckets`` (of ``k``)."""
        wanted = set(buckets)
        mask = k - 1
        return {o: v for o, v in self._summary.items() if _bucket_key(o) & mask in wanted}

    # --- per-peer delta summaries ---------------------------------------------------------

    def delta_summary_for(self, peer: bytes) -> DeltaSummary:
        """Our summary as a delta against what we last told ``peer`` (or in full).

        The delta lists the origins whose (epoch, seq) changed since then; ``base`` is the
        hash of the summary it patches (:data:`FULL_BASE`: none, the entries are the whole
        summary). It is a full summary when we have told ``peer`` nothing yet (or forgot:
        LRU), or an origin was dropped since (a delta cannot express removals). Records
        the summary as told: if the message is lost, the peer's next base check fails and
        it asks for the full summary (:func:`encode_need_summary`).
        """
        new_hash = self.summary_digest()
        told = self._told.get(peer)
        if told is None or self._removed_at > told[0]:
            delta = DeltaSummary(FULL_BASE, new_hash, dict(self._summary))
        else:
            since = told[0]
            entries: Summary = {}
            for origin in reversed(self._changed_at):
                if self._changed_at[origin] <= since:
                    break
                entries[origin] = self._summary[origin]
            delta = DeltaSummary(told[1], new_hash, entries)
        self._remember(self._told, peer, (self._stamp, new_hash))
        return delta

    def full_summary_for(self, peer: bytes) -> DeltaSummary:
        """Our whole summary as a :class:`DeltaSummary` (the answer to a need-summary)."""
        self._told.pop(peer, None)
        return self.delta_summary_for(peer)

    def peer_summary(self, peer: bytes, delta: DeltaSummary) -> Summary | None:
        """The full summary of ``peer`` that ``delta`` describes, or None when we do not
        hold its base (ask for the full summary then). The entries are the peer's claims,
        as untrusted as a full summary: validated by the decoder and bounded here by
        :data:`MAX_SUMMARY_ENTRIES` in all (:class:`OversizeMessage`)."""
        if delta.base == FULL_BASE:
            view = dict(delta.entries)
        else:
            held = self._views.pop(peer, None)
            if held is None or held[0] != delta.base:
                return None
            view = held[1]  # ours alone: patched in place
            view.update(delta.entries)
            if len(view) > MAX_SUMMARY_ENTRIES:
                raise OversizeMessage(
                    f"patched summary of {len(view)} entries exceeds {MAX_SUMMARY_ENTRIES}"
                )
        self._remember(self._views, peer, (delta.new, view))
        return dict(view)

    def forget_peer(self, peer: bytes) -> None:
        """Drop the per-peer delta state of ``peer`` (the next summaries are full)."""
        self._told.pop(peer, None)
        self._views.pop(peer, None)

    def _remember(self, table: OrderedDict, peer: bytes, value: object) -> None:
        if self.max_peer_views == 0:
            return
        table[peer] = value
        table.move_to_end(peer)
        while len(table) > self.max_peer_views:
            table.popitem(last=False)

    # --- local cache -------------------------------------------------------------------

    def local_add_prefix(self, ns: bytes, chain: Sequence[bytes]) -> None:
        """Count one more cached prefix whose block hashes are ``chain``."""
        ns = _check_ns(ns)
        hashes = _check_chain(chain)
        refs = self._refs.setdefault(ns, {})
        for h in hashes:
            count = refs.get(h, 0)
            refs[h] = count + 1
            if count == 0:
                self._became_present(ns, h)

    def local_remove_prefix(self, ns: bytes, chain: Sequence[bytes]) -> None:
        """Count one cached prefix fewer. Raises ``ValueError`` (changing nothing) if
        ``chain`` holds a hash that is not counted (more removes than adds)."""
        ns = _check_ns(ns)
        hashes = _check_chain(chain)
        refs = self._refs.get(ns, {})
        for h, n in Counter(hashes).items():
            if refs.get(h, 0) < n:
                raise ValueError(f"removing block hash {h.hex()} that is not held")
        for h in hashes:
            count = refs[h] - 1
            if count:
                refs[h] = count
            else:
                del refs[h]
                self._became_absent(ns, h)
        if not refs:
            self._refs.pop(ns, None)

    def _became_present(self, ns: bytes, h: bytes) -> None:
        if self._n_advertised >= MAX_ADVERTISED_HASHES:
            self._overflow.setdefault(ns, {})[h] = None
            self.stats["unadvertised_hashes"] += 1
            return
        self._advertised.setdefault(ns, set()).add(h)
        self._n_advertised += 1
        removed = self._pending_remove.get(ns)
        if removed and h in removed:
            removed.discard(h)  # removed then re-added before any record: no change
        else:
            self._pending_add.setdefault(ns, set()).add(h)

    def _became_absent(self, ns: bytes, h: bytes) -> None:
        overflow = self._overflow.get(ns)
        if overflow and h in overflow:
            del overflow[h]
            if not overflow:
                del self._overflow[ns]
            return
        advertised = self._advertised[ns]
        advertised.discard(h)
        if not advertised:
            del self._advertised[ns]
        self._n_advertised -= 1
        added = self._pending_add.get(ns)
        if added and h in added:
            added.discard(h)
        else:
            self._pending_remove.setdefault(ns, set()).add(h)

    def local_hashes(self) -> dict[bytes, frozenset[bytes]]:
        """What the local node currently advertises, per namespace."""
        return {ns: frozenset(hs) for ns, hs in self._advertised.items()}

    def set_local_load(self, load: LoadFigures, kv_capacity_bytes: int, kv_used_bytes: int) -> None:
        """Load figures for the next record (delta, refresh or snapshot)."""
        self._load = load
        self._kv_capacity = kv_capacity_bytes
        self._kv_used = kv_used_bytes

    def set_local_addrs(self, addrs: Sequence[str]) -> None:
        """Listen addrs for the next record."""
        self.addrs = tuple(addrs)

    # --- issuing own records -----------------------------------------------------------

    def _has_pending(self) -> bool:
        return any(self._pending_add.values()) or any(self._pending_remove.values())

    def tick(self, now: float) -> list[SignedRecord]:
        """Issue our own records that are due at ``now``; returns them (oldest first).

        Due: a snapshot (chain) at start, after an epoch bump, or when compaction is due;
        otherwise deltas for pending changes, at most once per ``min_record_interval``
        (changes made meanwhile are batched into one delta); otherwise a refresh every
        ``refresh_interval``.
        """
        if self._force_snapshot:
            return self._issue_snapshot(now)
        pending = self._has_pending()
        since = now - self._last_issued_at
        if since < (self.min_record_interval if pending else self.refresh_interval):
            return []  # nothing due; pending changes wait for the batching interval
        own = self._logs[self.peer_id]
        tail_bytes = own.n_bytes - self._base_bytes
        n_deltas = len(own.records) - 1
        estimate = self._estimate_delta_bytes()
        if (
            tail_bytes + estimate > self.compaction_ratio * self._base_bytes
            or n_deltas + 1 > MAX_DELTAS_PER_ORIGIN // 2
            or own.n_bytes + estimate > MAX_ORIGIN_BYTES // 2
        ):
            return self._issue_snapshot(now)
        if not pending:
            self.stats["refreshes_issued"] += 1
            return [self._issue(now, KIND_DELTA, ())]
        groups = [
            (ns, sorted(self._pending_add.get(ns, ())), sorted(self._pending_remove.get(ns, ())))
            for ns in sorted(set(self._pending_add) | set(self._pending_remove))
        ]
        self._pending_add.clear()
        self._pending_remove.clear()
        return [self._issue(now, KIND_DELTA, chunk) for chunk in self._chunk(groups)]

    def restate(self, now: float) -> list[SignedRecord]:
        """Issue a fresh snapshot now, whatever is due. A new partition stream
        (:mod:`.partition`) states its first prefixes this way in one record, instead of
        an empty snapshot followed by a delta ``min_record_interval`` later."""
        self._force_snapshot = True
        return self.tick(now)

    def _estimate_delta_bytes(self) -> int:
        n = sum(len(s) for s in self._pending_add.values())
        n += sum(len(s) for s in self._pending_remove.values())
        n_ns = len(set(self._pending_add) | set(self._pending_remove))
        return 250 + sum(len(a) for a in self.addrs) + HASH_BYTES * n + 12 * n_ns

    def _issue_snapshot(self, now: float) -> list[SignedRecord]:
        # space may have freed since hashes overflowed: advertise them now
        for ns in list(self._overflow):
            overflow = self._overflow[ns]
            while overflow and self._n_advertised < MAX_ADVERTISED_HASHES:
                h = next(iter(overflow))
                del overflow[h]
                self._advertised.setdefault(ns, set()).add(h)
                self._n_advertised += 1
            if not overflow:
                del self._overflow[ns]
        self._pending_add.clear()
        self._pending_remove.clear()
        if self._force_snapshot:
            self._force_snapshot = False
        groups = [(ns, sorted(hs), []) for ns, hs in sorted(self._advertised.items())]
        chunks = list(self._chunk(groups)) or [()]
        issued = [self._issue(now, KIND_SNAPSHOT, chunks[0])]
        issued += [self._issue(now, KIND_DELTA, chunk) for chunk in chunks[1:]]
        self._base_bytes = sum(len(s.raw) for s in issued)
        self.stats["snapshots_issued"] += 1
        return issued

    @staticmethod
    def _chunk(groups):
        """Split (ns, added, removed) groups into record-sized tuples of NamespaceDelta."""
        chunk: list[NamespaceDelta] = []
        room = MAX_HASHES_PER_RECORD
        for ns, added, removed in groups:
            added, removed = list(added), list(removed)
            while added or removed:
                if room == 0 or len(chunk) == MAX_NAMESPACES_PER_RECORD:
                    yield tuple(chunk)
                    chunk, room = [], MAX_HASHES_PER_RECORD
                take_a = added[:room]
                del added[: len(take_a)]
                take_r = removed[: room - len(take_a)]
                del removed[: len(take_r)]
                chunk.append(NamespaceDelta(ns, tuple(take_a), tuple(take_r)))
                room -= len(take_a) + len(take_r)
        if chunk:
            yield tuple(chunk)

    def _issue(self, now: float, kind: str, namespaces) -> SignedRecord:
        record = DigestRecord(
            origin=self.peer_id,
            epoch=self.epoch,
            seq=self._next_seq,
            issued_at=float(now),
            expires_at=float(now) + self.ttl,
            model=self.model_fp,
            kind=kind,
            namespaces=tuple(namespaces),
            load=self._load,
            kv_capacity_bytes=self._kv_capacity,
            kv_used_bytes=self._kv_used,
            addrs=self.addrs,
        )
        signed = sign_record(record, self.identity)
        self._next_seq += 1
        self._last_issued_at = now
        if kind == KIND_SNAPSHOT:
            old = self._logs.get(self.peer_id)
            if old is not None:
                self._held_raws.difference_update(s.raw for s in old.records)
            self._logs[self.peer_id] = _OriginLog(signed)
        else:
            self._logs[self.peer_id].append(signed)
        self._held_raws.add(signed.raw)
        self._touch(self.peer_id)
        self.stats["records_issued"] += 1
        self.stats["bytes_issued"] += len(signed.raw)
        return signed

    # --- summaries and sending ---------------------------------------------------------

    def summary(self) -> Summary:
        """origin -> (epoch, last seq held), including our own stream."""
        return dict(self._summary)

    def version_of(self, origin: bytes) -> tuple[int, int] | None:
        """(epoch, last seq) held for ``origin`` (our own included), or None."""
        return self._summary.get(origin)

    def origins(self) -> list[bytes]:
        """Remote origins currently held."""
        return [o for o in self._logs if o != self.peer_id]

    def held_records(self, origin: bytes) -> list[SignedRecord]:
        """The records held for ``origin`` (its snapshot first), for relaying/inspection."""
        log = self._logs.get(origin)
        return list(log.records) if log else []

    def records_for(
        self,
        peer_summary: Mapping[bytes, tuple[int, int]],
        budget_bytes: int,
        want_snapshots: Iterable[bytes] = (),
        scope: tuple[int, Iterable[int]] | None = None,
        origins: Iterable[bytes] | None = None,
    ) -> list[SignedRecord]:
        """The records a peer with ``peer_summary`` lacks, within ``budget_bytes``.

        ``scope=(k, buckets)``: the peer's summary covers only the origins in those
        buckets (a :class:`ScopedSummary`); origins outside them are left out.
        ``origins``: only these origins' records (a partition push sends the pusher's own
        stream only, see :mod:`.partition`)."""
        want = set(want_snapshots)
        logs = self._logs
        try:
            # origins whose (epoch, seq) differ from the peer's, in C: the common case is
            # that most are equal, and those need no further look
            differ = {o for o, _ in self._summary.items() - peer_summary.items()}
        except TypeError:  # unhashable values in a caller's mapping: look at every origin
            differ = set(logs)
        if scope is not None:
            k, buckets = scope
            in_scope = set(buckets)
            differ = {o for o in differ if bucket_of(o, k) in in_scope}
        differ.update(o for o in want if o in logs)  # snapshot requests: whatever the scope
        if origins is not None:
            differ.intersection_update(origins)
        queues = []
        for origin in differ:
            log = logs[origin]
            theirs = peer_summary.get(origin)
            if theirs is None or origin in want or theirs[0] < log.epoch:
                needed = log.records
            elif theirs[0] > log.epoch or theirs[1] >= log.last_seq:
                continue
            elif theirs[1] < log.first_seq:
                needed = log.records
            else:
                needed = log.after(theirs[1])
            if needed:
                n_bytes = log.n_bytes if needed is log.records else sum(len(s.raw) for s in needed)
                queues.append((n_bytes, -needed[-1].record.issued_at, origin, needed))
        queues.sort(key=lambda q: q[:3])
        out: list[SignedRecord] = []
        if sum(q[0] for q in queues) <= budget_bytes:
            # everything fits: the same round-robin order without the budget bookkeeping
            for layer in zip_longest(*[q[3] for q in queues]):
                out.extend(r for r in layer if r is not None)
        else:
            remaining = budget_bytes
            active = [deque(q[3]) for q in queues]
            while active:
                still = []
                for queue in active:
                    size = len(queue[0].raw)
                    if size > remaining:
                        continue  # cut this origin off here: the rest depends on this record
                    out.append(queue.popleft())
                    remaining -= size
                    if queue:
                        still.append(queue)
                active = still
        self.stats["records_sent"] += len(out)
        self.stats["bytes_sent"] += sum(len(s.raw) for s in out)
        return out

    # --- receiving ---------------------------------------------------------------------

    def _reject(self, result: ReceiveResult, error: DigestError) -> None:
        result.rejected.append(error)
        self.stats["rejected"][type(error).__name__] += 1

    def receive(self, raws: Sequence[bytes], now: float) -> ReceiveResult:
        """Verify and apply received records (any order of origins; each origin's in seq
        order). Idempotent: records already held are skipped silently."""
        result = ReceiveResult()
        decoded: list[SignedRecord] = []
        for raw in raws:
            self.stats["records_received"] += 1
            self.stats["bytes_received"] += len(raw) if isinstance(raw, bytes) else 0
            if isinstance(raw, bytes) and raw in self._held_raws:
                result.duplicates += 1
                self.stats["duplicates"] += 1
                continue
            try:
                signed = decode_record(
                    raw, now=now, max_clock_skew=self.max_clock_skew, check_expiry=False
                )
            except DigestError as exc:
                self._reject(result, exc)
                continue
            if signed.record.model != self.model_fp:
                self._reject(
                    result,
                    WrongModel(
                        f"record for model {signed.record.model.hex()[:16]}, "
                        f"ours is {self.model_fp.hex()[:16]}"
                    ),
                )
                continue
            decoded.append(signed)
        # an expired record is kept only if a fresh one of its origin comes with it
        freshest: dict[bytes, float] = {}
        for signed in decoded:
            r = signed.record
            freshest[r.origin] = max(freshest.get(r.origin, 0.0), r.expires_at)
        for signed in decoded:
            r = signed.record
            if r.origin == self.peer_id:
                self._receive_own(signed)
                continue
            if freshest[r.origin] <= now:
                self._reject(
                    result,
                    ExpiredRecord(f"record expired {now - r.expires_at:.1f} s ago"),
                )
                continue
            self._apply(signed, result)
        return result

    def _receive_own(self, signed: SignedRecord) -> None:
        r = signed.record
        own = self._logs[self.peer_id]
        if self._force_snapshot:
            return  # a restatement is already due
        # Newer than anything we issued, or a different record for a seq we hold (raws we
        # hold were skipped as duplicates): a record of ours from an earlier incarnation
        # that used this epoch too. Our epoch went backwards: move past it and restate.
        if r.epoch > own.epoch or (r.epoch == own.epoch and r.seq >= own.first_seq):
            self.epoch = max(self.epoch, r.epoch) + 1
            self._next_seq = 0
            self._force_snapshot = True
            self.stats["own_epoch_bumps"] += 1
        # else: an old record of ours, or one we hold: nothing to do

    def _replace(self, signed: SignedRecord) -> None:
        origin = signed.record.origin
        old = self._logs.get(origin)
        if old is not None:
            self._held_raws.difference_update(s.raw for s in old.records)
        self._logs[origin] = _OriginLog(signed)
        self._held_raws.add(signed.raw)
        self._touch(origin)

    def _apply(self, signed: SignedRecord, result: ReceiveResult) -> None:
        r = signed.record
        if signed.raw in self._held_raws:  # the same record twice in one batch
            result.duplicates += 1
            self.stats["duplicates"] += 1
            return
        log = self._logs.get(r.origin)
        is_snapshot = r.kind == KIND_SNAPSHOT
        if log is None:
            if not is_snapshot:
                self._gap(r.origin, result)
                return
            if len(self._logs) - 1 >= MAX_ORIGINS:
                self._reject(result, OriginTableFull(f"already holding {MAX_ORIGINS} origins"))
                return
            self._replace(signed)
        elif r.epoch < log.epoch:
            self._reject(
                result,
                SequenceRegression(f"epoch {r.epoch} is older than the held epoch {log.epoch}"),
            )
            return
        elif r.epoch > log.epoch or r.seq > log.last_seq + 1:
            if not is_snapshot:
                self._gap(r.origin, result)
                return
            self._replace(signed)
        elif r.seq <= log.last_seq:
            if log.get(r.seq) is not None:  # held, and not byte-identical (checked above)
                self._reject(
                    result,
                    ReplayedRecord(
                        f"a different record for the held (epoch {r.epoch}, seq {r.seq})"
                    ),
                )
            else:
                self._reject(
                    result,
                    SequenceRegression(
                        f"seq {r.seq} is older than the held snapshot (seq {log.first_seq})"
                    ),
                )
            return
        elif is_snapshot:  # seq == last + 1
            self._replace(signed)
        else:
            if (
                len(log.records) - 1 >= MAX_DELTAS_PER_ORIGIN
                or log.n_bytes + len(signed.raw) > MAX_ORIGIN_BYTES
            ):
                self._reject(
                    result,
                    TooManyDeltas(
                        f"origin already holds {len(log.records) - 1} deltas / "
                        f"{log.n_bytes} bytes; waiting for its next snapshot"
                    ),
                )
                return
            log.append(signed)
            self._held_raws.add(signed.raw)
            self._touch(r.origin)
        result.applied.append(r)
        self.stats["records_applied"] += 1

    def _gap(self, origin: bytes, result: ReceiveResult) -> None:
        result.need_snapshot.add(origin)
        self.stats["gaps"] += 1

    def expire(self, now: float) -> list[bytes]:
        """Drop remote origins whose newest record has expired; returns them."""
        dropped = [
            o for o, log in self._logs.items() if o != self.peer_id and log.expires_at <= now
        ]
        for origin in dropped:
            self._held_raws.difference_update(s.raw for s in self._logs.pop(origin).records)
            self._untouch(origin)
        self.stats["origins_expired"] += len(dropped)
        return dropped

    def held_bytes(self) -> int:
        """Total bytes of records held (own and remote)."""
        return sum(log.n_bytes for log in self._logs.values())

    def bytes_of(self, origin: bytes) -> int:
        """Bytes of ``origin``'s records held: what a caller that keeps several streams
        budgets across them (``partition.PartitionedDigest``)."""
        log = self._logs.get(origin)
        return log.n_bytes if log is not None else 0


# --- exchange message codecs ---------------------------------------------------------------


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


def _entry_cbor(origin: bytes, version: tuple[int, int]) -> bytes:
    """Canonical CBOR of the summary entry ``[origin, epoch, seq]``."""
    return b"".join(
        (b"\x83", _cbor_head(2, len(origin)), origin, _cbor_head(0, version[0]),
         _cbor_head(0, version[1]))
    )  # fmt: skip


_MSG_SUMMARY_PREFIX = b"\x82\x01"  # [1, ...]: a 2-element array, then the type
_REPLY_PREFIX = b"\x84\x02"  # [2, ...]


def _check_reply_bounds(n_records: int, n_summary: int, n_want: int) -> None:
    if n_records > MAX_RECORDS_PER_MESSAGE:
        raise OversizeMessage(f"{n_records} records exceeds {MAX_RECORDS_PER_MESSAGE}")
    if n_summary > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(f"summary of {n_summary} entries exceeds {MAX_SUMMARY_ENTRIES}")
    if n_want > MAX_SNAPSHOT_REQUESTS:
        raise OversizeMessage(f"{n_want} snapshot requests exceeds {MAX_SNAPSHOT_REQUESTS}")


MSG_SUMMARY_HASH = 0
SUMMARY_HASH_BYTES = 16
_MAX_HASH_MESSAGE_BYTES = 64


def summary_hash(summary: Mapping[bytes, tuple[int, int]]) -> bytes:
    """16-byte hash of a summary's canonical encoding (equal iff the summaries are).

    An exchange opens with it (:func:`encode_summary_hash`): two peers that are already
    in sync (the steady state) exchange 16 bytes and a boolean instead of their summaries.
    """
    return hashlib.blake2b(encode_summary(summary), digest_size=SUMMARY_HASH_BYTES).digest()


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


# --- per-peer delta summaries (messages 4-6) ------------------------------------------------

FULL_BASE = bytes(SUMMARY_HASH_BYTES)  # the base of a delta that is a whole summary


@dataclass(frozen=True)
class DeltaSummary:
    """A summary relative to ``base`` (the hash of a summary the receiver holds for us;
    :data:`FULL_BASE`: none) whose result hashes to ``new``."""

    base: bytes
    new: bytes
    entries: Summary


@dataclass(frozen=True)
class DeltaReply:
    records: list[bytes]
    summary: DeltaSummary
    want_snapshots: frozenset[bytes]


def _check_delta(delta: DeltaSummary) -> None:
    for value in (delta.base, delta.new):
        if type(value) is not bytes or len(value) != SUMMARY_HASH_BYTES:
            raise ValueError(f"summary hashes are {SUMMARY_HASH_BYTES} bytes")
    if len(delta.entries) > MAX_SUMMARY_ENTRIES:
        raise OversizeMessage(
            f"summary of {len(delta.entries)} entries exceeds {MAX_SUMMARY_ENTRIES}"
        )


def encode_delta_summary(delta: DeltaSummary) -> bytes:
    """Message 4: ``[4, base16, new16, [[origin, epoch, seq], ...]]`` (replaces message 1)."""
    _check_delta(delta)
    return _dump([MSG_DELTA_SUMMARY, delta.base, delta.new, summary_entries(delta.entries)])


def encode_need_summary() -> bytes:
    """Message 6: ``[6]``, the answer to a delta whose base the responder does not hold:
    send the full summary (as message 4 with :data:`FULL_BASE`)."""
    return _dump([MSG_NEED_SUMMARY])


def encode_delta_reply(
    records: Iterable[SignedRecord | bytes],
    delta: DeltaSummary,
    want_snapshots: Iterable[bytes] = (),
) -> bytes:
    """Message 5: ``[5, [raw, ...], base16, new16, [[origin, epoch, seq], ...], [origin,
    ...]]`` (replaces message 2)."""
    raws = _raws(records)
    want = sorted(set(want_snapshots))
    _check_reply_bounds(len(raws), len(delta.entries), len(want))
    _check_delta(delta)
    return _dump(
        [MSG_DELTA_REPLY, raws, delta.base, delta.new, summary_entries(delta.entries), want]
    )


def _parse_hash(value: object) -> bytes:
    if type(value) is not bytes or len(value) != SUMMARY_HASH_BYTES:
        raise MalformedMessage(f"a summary hash is a {SUMMARY_HASH_BYTES}-byte string")
    return value


def _parse_want(want: object) -> frozenset[bytes]:
    if type(want) is not list:
        raise MalformedMessage("snapshot requests must be an array")
    if len(want) > MAX_SNAPSHOT_REQUESTS:
        raise OversizeMessage(f"{len(want)} snapshot requests exceeds {MAX_SNAPSHOT_REQUESTS}")
    if any(type(o) is not bytes or len(o) != PEER_ID_BYTES for o in want):
        raise MalformedMessage("snapshot requests must be peer ids")
    return frozenset(want)


def decode_delta_summary(data: bytes) -> DeltaSummary:
    _, base, new, entries = _load_message(data, MSG_DELTA_SUMMARY, 4)
    return DeltaSummary(_parse_hash(base), _parse_hash(new), parse_summary_entries(entries))


def decode_need_summary(data: bytes) -> None:
    """Accepts exactly message 6; raises :class:`MalformedMessage` otherwise."""
    _load_message(data, MSG_NEED_SUMMARY, 1)


def decode_delta_reply(data: bytes) -> DeltaReply:
    _, raws, base, new, entries, want = _load_message(data, MSG_DELTA_REPLY, 6)
    delta = DeltaSummary(_parse_hash(base), _parse_hash(new), parse_summary_entries(entries))
    return DeltaReply(parse_record_list(raws), delta, _parse_want(want))


# --- bucketed summaries (messages 7-8) --------------------------------------------------------


def bucket_count(n_origins: int) -> int:
    """The bucket count a node uses for ``n_origins`` held: the power of two >= it (about
    one origin per bucket), at most :data:`MAX_BUCKETS`."""
    return min(MAX_BUCKETS, 1 << max(0, n_origins - 1).bit_length())


@functools.lru_cache(maxsize=1 << 16)
def _bucket_key(origin: bytes) -> int:
    return int.from_bytes(origin[-4:], "big")


def bucket_of(origin: bytes, k: int) -> int:
    """The bucket of ``origin`` among ``k`` (a power of two): low bits of its last 4 bytes
    (peer ids end with a public key: uniformly spread)."""
    return _bucket_key(origin) & (k - 1)


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
