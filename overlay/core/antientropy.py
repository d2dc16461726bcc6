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

Exchanges
---------
The messages that carry summaries and records between two nodes (the 3-message
push-pull exchange, the summary-hash opener, bucketed summaries) are encoded and decoded
by :mod:`.exchange`; this module keeps what they carry. The summary is kept
incrementally (every change of an origin's (epoch, seq) goes through one method) with each
entry's canonical CBOR cached, so :meth:`AntiEntropy.summary_digest`,
:meth:`AntiEntropy.encoded_summary` and :meth:`AntiEntropy.encode_reply` cost O(1) while
nothing changed; :meth:`AntiEntropy.records_for` looks only at origins whose (epoch, seq)
differ from the peer's, and :meth:`AntiEntropy.bucket_hashes` stays current under changes.

*Digest-rate knobs*: ``min_record_interval`` batches own changes into at most one delta per
interval; ``compaction_ratio`` issues a compaction snapshot only when the deltas since the
last one outweigh it that many times (1.0: the historical rule; a snapshot is re-sent to
every node, so at ratio r snapshots are ~1/(1+r) of the record bytes instead of ~1/2).

Limits (module constants)
-------------------------
- :data:`MAX_ORIGINS` = 1024 remote origins held. A new origin into a full table evicts
  the least valuable one (:mod:`.admission`: never seen up before seen up before
  long-standing, by ``origin_merit``; then the most crowded subnet; then the oldest) if
  it is worth at least as much, else it is refused (:class:`OriginTableFull`): a flood of
  fresh identities only displaces other never-seen-up origins.
- :data:`MAX_ORIGINS_PER_SUBNET` = 64 origins whose records' addresses lie in one /24
  (/48); past that a newcomer of the subnet must displace one of the same subnet
  (:class:`OriginSubnetFull`). Loopback addresses are exempt unless
  ``exempt_loopback=False`` (local test clusters).
- New origins cost tokens: one delivered by a sender ``sender_known`` says is
  long-standing (or with no sender given) costs 1 token of a bucket of
  :data:`KNOWN_ORIGIN_BURST` (1,024) refilled at :data:`KNOWN_ORIGIN_TOKENS_PER_S` (64/s);
  one delivered by any other sender costs :data:`STRANGER_ORIGIN_COST` (4) tokens of a
  bucket of :data:`NEW_ORIGIN_BURST` (256) refilled at :data:`NEW_ORIGIN_TOKENS_PER_S`
  (8/s) shared by all strangers (:class:`NewOriginBudget` when empty): strangers together
  add at most 64 origins at once and 2 per second, and cannot spend the known peers'
  budget. A node's peers are strangers for their first 30 s on its heartbeat, so a fresh
  node in a mesh of more than 64 origins learns the rest over its first half minute.
- :data:`MAX_DELTAS_PER_ORIGIN` = 256 and :data:`MAX_ORIGIN_BYTES` = 2 MiB held per
  origin (snapshot + deltas); a delta beyond that is refused (:class:`TooManyDeltas`)
  until the origin compacts. Our own compaction keeps us well inside both.
- Worst case held: MAX_ORIGINS x MAX_ORIGIN_BYTES = 2 GiB, only reachable by 1024
  hostile identities each publishing maximal chains; honest nodes with 1,000 cached
  prefixes hold a few tens of KiB each (see bench/micro_core_digest.py).
- :data:`MAX_ADVERTISED_HASHES` = 65,536 local hashes (a 16-record snapshot chain).

Pure code: time and randomness come in as arguments; no trio, libp2p or llama imports.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest

from .admission import Merit, MeritTable
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
    sign_record,
)
from .exchange import (
    MAX_BUCKETS,
    AntiEntropyError,
    Summary,
    bucket_key,
    bucket_of,
    encode_entry,
    entry_hash,
    entry_list,
    hash_encoded_summary,
    reply_message,
    summary_message,
)
from .identity import Identity
from .limits import PeerRateLimiter, _is_loopback, subnet_of_multiaddr

__all__ = [
    "MAX_ORIGINS",
    "MAX_DELTAS_PER_ORIGIN",
    "MAX_ORIGIN_BYTES",
    "MAX_ADVERTISED_HASHES",
    "AntiEntropy",
    "ReceiveResult",
    "WrongModel",
    "OriginTableFull",
    "OriginSubnetFull",
    "NewOriginBudget",
    "MAX_ORIGINS_PER_SUBNET",
    "TooManyDeltas",
]

MAX_ORIGINS = 1024
#: origins per /24 (/48): 1/16 of the table, so at least 16 address blocks are needed to
#: fill it (an honest data-centre /24 rarely runs more than a few dozen nodes)
MAX_ORIGINS_PER_SUBNET = 64
#: tokens per second and bucket size of the new-origin budget all strangers share
NEW_ORIGIN_TOKENS_PER_S = 8.0
NEW_ORIGIN_BURST = 256.0
#: the same for long-standing senders: a fresh node fills its whole table from one of them
#: in one exchange, and a steady mesh never comes near 64 new origins a second
KNOWN_ORIGIN_TOKENS_PER_S = 64.0
KNOWN_ORIGIN_BURST = float(MAX_ORIGINS)
#: what a new origin delivered by a stranger costs (a known sender's costs 1): strangers
#: add at most 256 / 4 = 64 origins at once, then 2 per second, all of them together
STRANGER_ORIGIN_COST = 4.0
MAX_DELTAS_PER_ORIGIN = 256
MAX_ORIGIN_BYTES = 2 * 1024 * 1024
MAX_ADVERTISED_HASHES = 65536
_MAX_CACHED_BUCKET_COUNTS = 4  # bucket counts whose hashes are kept current


# --- errors (the message errors and their base are in .exchange) --------------------------


class WrongModel(AntiEntropyError):
    """A record for a different model fingerprint than ours."""


class OriginTableFull(AntiEntropyError):
    """A new origin into a full table, worth less than every origin held."""


class OriginSubnetFull(AntiEntropyError):
    """A new origin of a subnet holding :data:`MAX_ORIGINS_PER_SUBNET`, worth less than
    every origin of that subnet."""


class NewOriginBudget(AntiEntropyError):
    """A new origin while its sender class's new-origin budget is empty."""


class TooManyDeltas(AntiEntropyError):
    """A delta beyond :data:`MAX_DELTAS_PER_ORIGIN` / :data:`MAX_ORIGIN_BYTES` for its origin."""


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
        "origins_evicted": 0,  # displaced by a newcomer worth as much or more
        "own_epoch_bumps": 0,
        "unadvertised_hashes": 0,
    }


def _check_ns(ns: bytes) -> bytes:
    if not isinstance(ns, bytes | bytearray) or len(ns) != NAMESPACE_ID_BYTES:
        raise ValueError(f"a namespace id is {NAMESPACE_ID_BYTES} bytes")
    return bytes(ns)


def _check_chain(chain: Sequence[bytes]) -> list[bytes]:
    hashes = list(chain)
    for h in hashes:  # the usual case: exact bytes of the right size, kept as they are
        if type(h) is not bytes or len(h) != HASH_BYTES:
            return _check_chain_items(hashes)
    return hashes


def _check_chain_items(chain: list) -> list[bytes]:
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
        compaction_ratio: float = 1.0,
        exempt_loopback: bool = True,
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
        # the canonical CBOR of each entry and of the whole list, cached until they change.
        self._summary: Summary = {}
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
        # admission by merit (module docstring, Limits); the daemon sets the callbacks
        self.origin_merit: Callable[[bytes], int] | None = None  # admission.NEVER_UP ..
        self.sender_known: Callable[[bytes], bool] | None = None  # None: all known
        self.exempt_loopback = exempt_loopback
        self._merits = MeritTable(MAX_ORIGINS_PER_SUBNET)
        self._budgets = {
            True: PeerRateLimiter(KNOWN_ORIGIN_TOKENS_PER_S, KNOWN_ORIGIN_BURST, max_peers=1),
            False: PeerRateLimiter(NEW_ORIGIN_TOKENS_PER_S, NEW_ORIGIN_BURST, max_peers=1),
        }
        self._batch: tuple[float, bytes | None] = (now, None)
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
        self._entry_cbor.pop(origin, None)  # re-encoded when next needed
        old_h = self._entry_hash.pop(origin, None)
        self._list_cbor = self._digest = None
        if self._buckets:  # keep the cached bucket hashes current: XOR the entry out and in
            new_h = self._hash_entry(origin, version)
            key = bucket_key(origin)
            for k, hashes in self._buckets.items():
                hashes[key & (k - 1)] ^= new_h if old_h is None else new_h ^ old_h

    def _untouch(self, origin: bytes) -> None:
        """Record that ``origin`` is no longer held."""
        if self._summary.pop(origin, None) is None:
            return
        self._entry_cbor.pop(origin, None)
        old_h = self._entry_hash.pop(origin, None)
        self._sorted_origins = None
        self._list_cbor = self._digest = None
        if old_h is not None:
            key = bucket_key(origin)
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
                        entry[o] = encode_entry(o, version)
            self._list_cbor = entry_list([entry[o] for o in self._sorted_origins])
        return self._list_cbor

    def encoded_summary(self) -> bytes:
        """Message 1 for our summary: the bytes of ``encode_summary(self.summary())``,
        built from cached per-origin encodings."""
        return summary_message(self._summary_list_cbor(), len(self._summary))

    def summary_digest(self) -> bytes:
        """``summary_hash(self.summary())``, cached until the summary changes."""
        if self._digest is None:
            self._digest = hash_encoded_summary(self.encoded_summary())
        return self._digest

    def encode_reply(
        self, records: Iterable[SignedRecord | bytes], want_snapshots: Iterable[bytes] = ()
    ) -> bytes:
        """Message 2 carrying our summary: the bytes of
        ``encode_reply(records, self.summary(), want_snapshots)``, without re-encoding
        the summary."""
        return reply_message(
            records, self._summary_list_cbor(), len(self._summary), want_snapshots
        )

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
            out[bucket_key(origin) & mask] ^= h
        if len(self._buckets) >= _MAX_CACHED_BUCKET_COUNTS:
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[k] = out  # kept current by _touch/_untouch from now on
        return list(out)

    def _hash_entry(self, origin: bytes, version: tuple[int, int]) -> int:
        entry = self._entry_cbor.get(origin) or encode_entry(origin, version)
        h = self._entry_hash[origin] = entry_hash(entry)
        return h

    def summary_size(self) -> int:
        """Number of origins held, our own included (``len(self.summary())``)."""
        return len(self._summary)

    def scoped_summary(self, k: int, buckets: Iterable[int]) -> Summary:
        """Our summary's entries whose origins fall in ``buckets`` (of ``k``)."""
        wanted = set(buckets)
        mask = k - 1
        return {o: v for o, v in self._summary.items() if bucket_key(o) & mask in wanted}

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

    def receive(
        self, raws: Sequence[bytes], now: float, sender: bytes | None = None
    ) -> ReceiveResult:
        """Verify and apply received records (any order of origins; each origin's in seq
        order). Idempotent: records already held are skipped silently. ``sender``: the
        peer that delivered them (what a new origin costs depends on it)."""
        result = ReceiveResult()
        self._batch = (now, sender)
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
        held = self._merits.entries.get(origin)
        since = held.since if held is not None else self._batch[0]
        self._merits.put(origin, Merit(0, self._subnet_of(signed.record.addrs), since))

    # --- admission by merit (module docstring, Limits) ---------------------------------

    def _merit(self, origin: bytes) -> int:
        return self.origin_merit(origin) if self.origin_merit is not None else 0

    def _subnet_of(self, addrs: Sequence[str]) -> str | None:
        """The subnet an origin counts in: its first non-exempt address's."""
        for a in addrs:
            if self.exempt_loopback and _is_loopback(a):
                continue
            subnet = subnet_of_multiaddr(a)
            if subnet is not None:
                return subnet
        return None

    def _admit(self, signed: SignedRecord, result: ReceiveResult) -> bool:
        """Make room for a new origin if it is worth it; False (rejected) if not."""
        r = signed.record
        now, sender = self._batch
        known = sender is None or self.sender_known is None or self.sender_known(sender)
        cost = 1.0 if known else STRANGER_ORIGIN_COST
        budget = self._budgets[known]
        if budget.tokens(b"", now) < cost:
            self._reject(result, NewOriginBudget(
                f"new-origin budget of {'known peers' if known else 'strangers'} spent"))
            return False
        newcomer = Merit(self._merit(r.origin), self._subnet_of(r.addrs), now)
        victim = None
        if self._merits.subnet_full(newcomer.subnet):
            victim = self._merits.victim(newcomer, subnet=newcomer.subnet, merit_now=self._merit)
            if victim is None:
                self._reject(result, OriginSubnetFull(
                    f"subnet {newcomer.subnet} holds {MAX_ORIGINS_PER_SUBNET} origins"))
                return False
        elif len(self._logs) - 1 >= MAX_ORIGINS:
            victim = self._merits.victim(newcomer, merit_now=self._merit)
            if victim is None:
                self._reject(result, OriginTableFull(
                    f"holding {MAX_ORIGINS} origins, each worth more"))
                return False
        budget.allow(b"", now, cost)
        if victim is not None:
            self._drop(victim)
            self.stats["origins_evicted"] += 1
        return True

    def _drop(self, origin: bytes) -> None:
        self._held_raws.difference_update(s.raw for s in self._logs.pop(origin).records)
        self._untouch(origin)
        self._merits.remove(origin)

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
            if not self._admit(signed, result):
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
            self._drop(origin)
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


