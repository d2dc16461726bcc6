"""Partial replication of cache digests: each prefix's metadata lives at ``r`` home nodes.

Why
---
With full replication (:mod:`.antientropy` alone) every record an origin issues reaches
every node, so per-node digest traffic grows with N: under load at N=64 it is ~12 KB/s
per node however the summaries are encoded (docs/bench/sim.md, T7). Here a record reaches
``r`` nodes (default 3), independent of N, and a router that is not one of them asks one
(a *lookup*, one RTT, cached per prefix root).

Partitions and homes
--------------------
All block hashes of one prompt's chain descend from its first block (the *root*), so a
cached prefix belongs to exactly one partition: ``partition_of(ns, root, P)`` (a keyed
BLAKE2b of namespace and root, mod ``P``). The homes of partition ``p`` are the ``r``
highest of :func:`~.routing.rendezvous_score` over the live nodes (rendezvous hashing: a
join or leave moves only the partitions whose top ``r`` it enters or leaves).

Streams
-------
An origin keeps one ordinary :class:`~.antientropy.AntiEntropy` record stream per
partition it has cached something in (created on first use): snapshots, deltas,
tombstones, compaction and all limits unchanged. The partition is bound into the signed
model-fingerprint field (:func:`partition_model_fp`), so a record of partition ``p`` is
refused (``WrongModel``) by any other partition's state: a relay cannot replay it
elsewhere, and no record format changes.

Dissemination (push and acknowledge; no summaries)
--------------------------------------------------
Each round, for every own stream whose ``(epoch, seq)`` a current home has not
acknowledged, the origin sends that home the records it lacks (:func:`encode_push`, only
the origin's own stream: ``records_for(..., origins=(self,))`` from the home's last
acknowledgement, so a gap or a lost message restarts from what the home really holds);
the home verifies and applies them (``AntiEntropy.receive``), feeds its per-partition
:class:`~.peerindex.PeerCacheIndex` and answers with its entry for the origin
(:func:`encode_ack`). A push still unacknowledged after ``resend_after_s`` is sent
again; receiving is idempotent. A home refuses pushes for partitions it is not a home of
(:class:`NotAHome`). Cost per record: ``r`` receivers instead of ``N - 1``; an idle swarm
sends only refresh records, so partition streams should refresh rarely (node liveness is
the heartbeats' job, not the digests').

Lookups
-------
A router that is a home of the request's partition reads its own index. Otherwise it
sends a home the request's chain (:func:`encode_lookup`); the home answers the matched
block count and last load figures of the :data:`ANSWER_HOLDERS` best holders (:func:`encode_lookup_answer`;
:meth:`PartitionedDigest.lookup`), and the router keeps the answer in a
:class:`LookupCache` for ``lookup_ttl_s`` keyed by (namespace, root): a later request
with the same root is credited with the common prefix of its chain and the matched
chain it cached (never more than the home reported). The routing policy then decides
exactly as with a local index. A hostile home can omit holders or claim false ones; the
serving node re-matches locally, so that costs a miss, never a wrong answer (the same
guarantee as a lying origin).

Limits
------
:data:`MAX_PARTITIONS` = 65,536 partitions, :data:`MAX_REPLICAS` = 16;
:data:`MAX_LOOKUP_BLOCKS` = 4,096 blocks per lookup (64 Ki tokens),
:data:`MAX_LOOKUP_HOLDERS` = 256 holders per answer decoded (a home sends at most
:data:`ANSWER_HOLDERS` = 16: the longest matches, lighter load first among equals),
:data:`MAX_PARTITION_MESSAGE_BYTES`
= 1 MiB per push/ack/lookup message (a push carries at most one 64 KiB record budget in
practice); every decoder is bounded (:func:`~.digest.loads_bounded`) and raises
:class:`PartitionMessageError` only. A node holds at most ``P`` streams and ``P``
indexes; each stream is bounded as any :class:`~.antientropy.AntiEntropy`, and across
the partitions it homes a node holds at most ``PartitionConfig.max_origin_bytes`` (2 MiB,
what one origin may cost a full-replication node) of one remote origin's records and
``max_held_bytes`` (256 MiB) in all, each exceeded by at most one push: a push beyond
either budget is refused (:class:`OverBudget`) and resent later, so the home misses that
origin's news until records expire (a miss, never a wrong answer).

Pure code: time comes in as arguments; no trio, libp2p or llama imports.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import cbor2

from .antientropy import MAX_ORIGIN_BYTES, AntiEntropy
from .digest import (
    HASH_BYTES,
    MAX_MODEL_FP_BYTES,
    NAMESPACE_ID_BYTES,
    DigestError,
    DigestRecord,
    LoadFigures,
    loads_bounded,
)
from .exchange import AntiEntropyError, parse_record_list, parse_summary_entries, summary_entries
from .identity import PEER_ID_BYTES, Identity
from .peerindex import PeerCacheIndex
from .routing import rendezvous_score

__all__ = [
    "MAX_PARTITIONS",
    "MAX_REPLICAS",
    "MAX_LOOKUP_BLOCKS",
    "MAX_LOOKUP_HOLDERS",
    "ANSWER_HOLDERS",
    "MAX_PARTITION_MESSAGE_BYTES",
    "PartitionConfig",
    "PartitionError",
    "NotAHome",
    "OverBudget",
    "PartitionMessageError",
    "Push",
    "HolderMatch",
    "PartitionedDigest",
    "LookupCache",
    "partition_of",
    "partition_key",
    "lookup_pays",
    "partition_model_fp",
    "partition_homes",
    "encode_push",
    "decode_push",
    "encode_ack",
    "decode_ack",
    "encode_lookup",
    "decode_lookup",
    "encode_lookup_answer",
    "decode_lookup_answer",
]

MAX_PARTITIONS = 65536
MAX_REPLICAS = 16
MAX_LOOKUP_BLOCKS = 4096
MAX_LOOKUP_HOLDERS = 256
#: holders a home puts in an answer. Every node holding a popular prompt's first blocks
#: matches it, so at N=256 answers listed dozens of holders (most with a short, shared
#: header match) and lookups grew to 0.65 KB/s per node; the router needs the longest
#: matches and a few alternatives for load. A holder left out costs a miss, never a
#: wrong answer (the LookupCache's reasoning then understates, see there).
ANSWER_HOLDERS = 16
MAX_PARTITION_MESSAGE_BYTES = 1024 * 1024
_MAX_PUSH_RECORDS = 256
_PARTITION_KEY = b"prefixmesh/partition/v1"
_FP_SEPARATOR = b"#p"

MSG_PUSH, MSG_ACK, MSG_LOOKUP, MSG_LOOKUP_ANSWER = 20, 21, 22, 23


class PartitionError(ValueError):
    """Base class of partition errors."""


class NotAHome(PartitionError):
    """A push for a partition this node is not a home of."""


class OverBudget(PartitionError):
    """A push refused because the home already holds its byte budget (for the sender, or
    in all): ``PartitionConfig.max_origin_bytes`` / ``max_held_bytes``."""


class PartitionMessageError(PartitionError):
    """A push, acknowledgement, lookup or lookup answer that does not decode."""


@dataclass(frozen=True, slots=True)
class PartitionConfig:
    """``n_partitions`` P, ``replicas`` r (homes per partition), how long a router keeps a
    lookup answer, when an unacknowledged push is sent again, and what a home holds of
    other origins' records across all the partitions it homes (see Limits)."""

    n_partitions: int = 256
    replicas: int = 3
    key_depth: int = 4
    lookup_ttl_s: float = 2.0
    resend_after_s: float = 5.0
    max_origin_bytes: int = MAX_ORIGIN_BYTES  # one remote origin, all partitions together
    max_held_bytes: int = 256 * 1024 * 1024  # every remote origin, all partitions together

    def __post_init__(self) -> None:
        if not 1 <= self.n_partitions <= MAX_PARTITIONS:
            raise ValueError(f"n_partitions must be in [1, {MAX_PARTITIONS}]")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in [1, {MAX_REPLICAS}]")
        if not 1 <= self.key_depth <= MAX_LOOKUP_BLOCKS:
            raise ValueError(f"key_depth must be in [1, {MAX_LOOKUP_BLOCKS}]")
        if not (math.isfinite(self.lookup_ttl_s) and self.lookup_ttl_s >= 0):
            raise ValueError("lookup_ttl_s must be finite and >= 0")
        if not (math.isfinite(self.resend_after_s) and self.resend_after_s > 0):
            raise ValueError("resend_after_s must be finite and > 0")
        for name in ("max_origin_bytes", "max_held_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def partition_key(chain: Sequence[bytes], key_depth: int) -> bytes:
    """The block a chain is partitioned by: its ``key_depth``-th (or last, if shorter)."""
    return chain[min(len(chain), key_depth) - 1]


def partition_of(ns: bytes, key: bytes, n_partitions: int) -> int:
    """The partition of a chain with key block ``key`` (:func:`partition_key`) in ``ns``."""
    digest = hashlib.blake2b(ns + key, digest_size=8, key=_PARTITION_KEY).digest()
    return int.from_bytes(digest, "big") % n_partitions


def _partition_key(p: int) -> bytes:
    return _PARTITION_KEY + p.to_bytes(4, "big")


def partition_homes(p: int, nodes: Iterable[bytes], replicas: int) -> list[bytes]:
    """The ``replicas`` homes of partition ``p`` among ``nodes`` (best first)."""
    key = _partition_key(p)
    return heapq.nsmallest(replicas, set(nodes), key=lambda n: (-rendezvous_score(key, n), n))


def partition_model_fp(model_fp: bytes, p: int, n_partitions: int) -> bytes:
    """The model fingerprint partition ``p``'s records are signed with (binds p and P)."""
    fp = bytes(model_fp) + _FP_SEPARATOR + p.to_bytes(4, "big") + n_partitions.to_bytes(4, "big")
    if len(fp) > MAX_MODEL_FP_BYTES:
        raise ValueError(
            f"model fingerprint of {len(model_fp)} bytes leaves no room for the partition tag "
            f"(at most {MAX_MODEL_FP_BYTES - len(fp) + len(model_fp)} bytes)"
        )
    return fp


@dataclass(frozen=True, slots=True)
class Push:
    """Records of our own stream for ``partition`` that ``home`` lacks."""

    home: bytes
    partition: int
    records: list[bytes]


@dataclass(frozen=True, slots=True)
class HolderMatch:
    """One holder in a lookup answer: leading blocks matched and its last load figures."""

    peer: bytes
    blocks: int
    load: LoadFigures
    expires_at: float  # of the holder's record the load comes from (freshness)


StreamFactory = Callable[[bytes, float], AntiEntropy]


class PartitionedDigest:
    """One node's partitioned digest state: its own stream per partition, the streams and
    index of the partitions it is a home of, acknowledgements, and its view of peers'
    load figures (see the module docstring)."""

    def __init__(
        self,
        identity: Identity,
        model_fp: bytes,
        *,
        config: PartitionConfig,
        make_stream: StreamFactory,
    ) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.model_fp = bytes(model_fp)
        self.config = config
        partition_model_fp(self.model_fp, 0, config.n_partitions)  # length check, early
        self._make_stream = make_stream
        self.streams: dict[int, AntiEntropy] = {}
        self._fresh: set[int] = set()  # streams created since the last tick
        self._members: frozenset[bytes] = frozenset()
        self._members_src: object = None
        self._home_cache: dict[int, list[bytes]] = {}
        self.indexes: dict[int, PeerCacheIndex] = {}
        # (partition, home) -> the home's acknowledged (epoch, seq) of our stream, and
        # the version and time of the push in flight to it
        self._acked: dict[tuple[int, bytes], tuple[int, int] | None] = {}
        self._inflight: dict[tuple[int, bytes], tuple[tuple[int, int] | None, float]] = {}
        self._load: tuple[LoadFigures, int, int] | None = None
        self._estimates: dict[bytes, tuple[float, LoadFigures]] = {}
        # lookup answers this node received as a router (both shells use this one)
        self.lookup_cache = LookupCache(config.lookup_ttl_s, config.key_depth)
        self.stats = {"pushes": 0, "acks": 0, "lookups_answered": 0, "refused_pushes": 0,
                      "over_budget_pushes": 0}
        # bytes of remote origins' records held, per (partition, origin), per origin and in
        # all: a stream's remote logs change only when a push is applied or an origin
        # expires, and both update these (_set_bytes)
        self._pbytes: dict[tuple[int, bytes], int] = {}
        self._obytes: dict[bytes, int] = {}
        self.remote_bytes = 0

    # --- partitions ---------------------------------------------------------------------

    def partition(self, ns: bytes, chain: Sequence[bytes]) -> int:
        key = partition_key(chain, self.config.key_depth)
        return partition_of(ns, key, self.config.n_partitions)

    def homes(self, p: int, nodes: Iterable[bytes]) -> list[bytes]:
        """The homes of ``p`` among ``nodes`` and us (we are always live to ourselves).
        Cached per membership: a caller passing the same collection object again skips
        even the membership comparison."""
        if nodes is not self._members_src:
            members = frozenset(nodes) | {self.peer_id}
            if members != self._members:
                self._members = members
                self._home_cache = {}
            self._members_src = nodes
        homes = self._home_cache.get(p)
        if homes is None:
            homes = partition_homes(p, self._members, self.config.replicas)
            self._home_cache[p] = homes
        return homes

    def _stream(self, p: int, now: float) -> AntiEntropy:
        ae = self.streams.get(p)
        if ae is None:
            fp = partition_model_fp(self.model_fp, p, self.config.n_partitions)
            ae = self._make_stream(fp, now)
            if self._load is not None:
                ae.set_local_load(*self._load)
            self.streams[p] = ae
            self._fresh.add(p)
            self.indexes[p] = PeerCacheIndex()
            for signed in ae.held_records(self.peer_id):
                self.indexes[p].apply(signed.record, now)
                self._note_load(self.peer_id, signed.record.expires_at, signed.record.load)
        return ae

    # --- the local cache ----------------------------------------------------------------

    def local_add_prefix(self, ns: bytes, chain: Sequence[bytes], now: float) -> None:
        if chain:
            self._stream(self.partition(ns, chain), now).local_add_prefix(ns, chain)

    def local_remove_prefix(self, ns: bytes, chain: Sequence[bytes], now: float) -> None:
        if chain:
            self._stream(self.partition(ns, chain), now).local_remove_prefix(ns, chain)

    def set_local_addrs(self, addrs: Sequence[str]) -> None:
        """Our addresses changed (a relay came or went): every stream states them in a
        fresh snapshot at the next tick, so homes stop handing out the old ones."""
        for ae in self.streams.values():
            ae.set_local_addrs(addrs)
        self._fresh.update(self.streams)

    def set_local_load(self, load: LoadFigures, kv_capacity_bytes: int, kv_used_bytes: int) -> None:
        self._load = (load, kv_capacity_bytes, kv_used_bytes)
        for ae in self.streams.values():
            ae.set_local_load(load, kv_capacity_bytes, kv_used_bytes)

    def tick(self, now: float) -> list[DigestRecord]:
        """Issue due own records in every stream (applied to our own partition index, so a
        home's lookup answers include itself); expire remote origins. Returns the records
        issued."""
        issued = []
        fresh, self._fresh = self._fresh, set()
        for p, ae in self.streams.items():
            index = self.indexes[p]
            # a stream created since the last tick restates at once, so its first
            # prefixes go out in its first snapshot, not a batching interval later
            for signed in ae.restate(now) if p in fresh else ae.tick(now):
                index.apply(signed.record, now)
                issued.append(signed.record)
                self._note_load(self.peer_id, signed.record.expires_at, signed.record.load)
            for origin in ae.expire(now):
                index.drop_peer(origin)
                self._set_bytes(p, origin, 0)
            index.expire(now)
        return issued

    def _set_bytes(self, p: int, origin: bytes, n: int) -> None:
        """``origin``'s records in partition ``p`` now take ``n`` bytes here."""
        delta = n - self._pbytes.get((p, origin), 0)
        if not delta:
            return
        if n:
            self._pbytes[(p, origin)] = n
        else:
            self._pbytes.pop((p, origin), None)
        total = self._obytes.get(origin, 0) + delta
        if total:
            self._obytes[origin] = total
        else:
            self._obytes.pop(origin, None)
        self.remote_bytes += delta

    def origin_held_bytes(self, origin: bytes) -> int:
        """Bytes of ``origin``'s records this home holds, all partitions together."""
        return self._obytes.get(origin, 0)

    # --- dissemination ------------------------------------------------------------------

    def pushes(self, now: float, nodes: Iterable[bytes], budget_bytes: int) -> list[Push]:
        """The pushes due now: per own stream, to each current home (other than us) that
        has not acknowledged our latest (epoch, seq) and has no recent push in flight.

        This includes a home's own (possibly empty) stream of a partition it only homes:
        its records carry the home's load figures to the other homes, which pass them on
        in lookup answers (measured: not pushing empty streams took max/mean load from
        1.82 to 2.00 at N=64 for no saving in bytes)."""
        out: list[Push] = []
        me = self.peer_id
        for p, ae in self.streams.items():
            version = ae.version_of(me)
            for home in self.homes(p, nodes):
                if home == me:
                    continue
                key = (p, home)
                acked = self._acked.get(key)
                if acked == version:
                    continue
                inflight = self._inflight.get(key)
                if (
                    inflight is not None
                    and inflight[0] == version
                    and now - inflight[1] < self.config.resend_after_s
                ):
                    continue
                theirs = {me: acked} if acked is not None else {}
                records = ae.records_for(theirs, budget_bytes, origins=(me,))
                if not records:
                    continue
                self._inflight[key] = (version, now)
                self.stats["pushes"] += 1
                out.append(Push(home, p, [s.raw for s in records[:_MAX_PUSH_RECORDS]]))
        return out

    def receive_push(
        self, sender: bytes, p: int, raws: Sequence[bytes], now: float, nodes: Iterable[bytes]
    ) -> tuple[dict[bytes, tuple[int, int]], list[DigestRecord]]:
        """Apply a push from ``sender`` for partition ``p``: (the acknowledgement to send
        back, the remote records applied). Raises :class:`NotAHome` when we are not a home
        of ``p`` among ``nodes`` (+ us)."""
        if not 0 <= p < self.config.n_partitions:
            raise PartitionMessageError(f"partition {p} out of range")
        if self.peer_id not in self.homes(p, nodes):
            self.stats["refused_pushes"] += 1
            raise NotAHome(f"not a home of partition {p}")
        cfg = self.config
        # Budgets across partitions: each stream alone is bounded like any AntiEntropy,
        # but a node homes many partitions, and one origin could fill every one of them.
        # Checked before applying, so a home holds at most one push (<= 1 MiB) beyond.
        if self._obytes.get(sender, 0) >= cfg.max_origin_bytes:
            self.stats["over_budget_pushes"] += 1
            raise OverBudget(f"{self._obytes[sender]} bytes of this origin held "
                             f"(budget {cfg.max_origin_bytes})")
        if self.remote_bytes >= cfg.max_held_bytes:
            self.stats["over_budget_pushes"] += 1
            raise OverBudget(f"{self.remote_bytes} bytes of records held "
                             f"(budget {cfg.max_held_bytes})")
        ae = self._stream(p, now)
        result = ae.receive(raws, now)
        index = self.indexes[p]
        applied = []
        touched = {sender}
        for record in result.applied:
            if record.origin == self.peer_id:
                continue
            index.apply(record, now)
            self._note_load(record.origin, record.expires_at, record.load)
            applied.append(record)
            touched.add(record.origin)
        for origin in touched - {self.peer_id}:
            self._set_bytes(p, origin, ae.bytes_of(origin))
        version = ae.version_of(sender)
        return ({sender: version} if version is not None else {}), applied

    def receive_ack(self, home: bytes, p: int, entries: Mapping[bytes, tuple[int, int]]) -> None:
        """A home's acknowledgement of our stream for ``p``."""
        key = (p, home)
        if p not in self.streams:
            return
        self.stats["acks"] += 1
        version = entries.get(self.peer_id)
        self._acked[key] = version
        inflight = self._inflight.get(key)
        if inflight is not None and inflight[0] == version:
            del self._inflight[key]
        elif version is None:
            self._inflight.pop(key, None)  # the home holds nothing: resend at once

    # --- lookups and estimates ----------------------------------------------------------

    def lookup(self, p: int, ns: bytes, chain: Sequence[bytes]) -> list[HolderMatch]:
        """Answer a lookup as a home of ``p`` (our own holdings included): the
        :data:`ANSWER_HOLDERS` holders with the most leading blocks of ``chain``, ties
        broken by the lighter load (then peer id), longest first."""
        if not 0 <= p < self.config.n_partitions:
            raise PartitionMessageError(f"partition {p} out of range")
        self.stats["lookups_answered"] += 1
        index = self.indexes.get(p)
        if index is None or not chain:
            return []
        # the freshest load figures we know of each holder, from any of its streams we
        # hold (its stream of this partition may be quiet while another is busy); ranked
        # as plain tuples (peer ids are unique: a total order) and only the answered
        # holders are built
        estimates = self._estimates.get
        ranked = []
        for peer, blocks in index.longest_matches(ns, chain).items():
            known = estimates(peer)
            if known is not None:
                load = known[1]
                ranked.append((-blocks, load.queue_depth + load.active, peer, known))
        ranked.sort()
        return [HolderMatch(peer, -neg_blocks, known[1], known[0])
                for neg_blocks, _, peer, known in ranked[:ANSWER_HOLDERS]]

    def _note_load(self, peer: bytes, expires_at: float, load: LoadFigures) -> None:
        known = self._estimates.get(peer)
        if known is None or known[0] < expires_at:
            self._estimates[peer] = (expires_at, load)

    def note_answer(self, holders: Iterable[HolderMatch]) -> None:
        """Fold a lookup answer's load figures into our view of peers."""
        for h in holders:
            if h.peer != self.peer_id:
                self._note_load(h.peer, h.expires_at, h.load)

    def take_answer(
        self, ns: bytes, chain: Sequence[bytes], holders: Sequence[HolderMatch], now: float
    ) -> None:
        """A lookup answer for ``chain`` arrived: note its load figures and cache it."""
        self.note_answer(holders)
        self.lookup_cache.put(ns, chain, holders, now)

    def known_matches(
        self, ns: bytes, chain: Sequence[bytes], nodes: Iterable[bytes], now: float,
        carried: Mapping[bytes, int] | None = None,
    ) -> tuple[dict[bytes, int] | None, list[bytes]]:
        """What a router knows without asking: (holder -> matched blocks, or None when a
        lookup is needed; the homes of the chain's partition, best first). Matches come
        from our own partition index when we are a home, else from the holder list the
        request carries from the previous hop (``carried``: decided for this very chain),
        else from a cached answer."""
        p = self.partition(ns, chain)
        homes = self.homes(p, nodes)
        if self.peer_id in homes:
            index = self.indexes.get(p)
            return (dict(index.longest_matches(ns, chain)) if index is not None else {}), homes
        if carried is not None:
            return dict(carried), homes
        answer = self.lookup_cache.get(ns, chain, now)
        if answer is None:
            return None, homes
        return {h.peer: h.blocks for h in answer}, homes

    def load_of(self, peer: bytes) -> tuple[LoadFigures, float] | None:
        """The freshest load figures we know of ``peer`` (from any index or answer) and the
        ``expires_at`` of the record they come from."""
        known = self._estimates.get(peer)
        return (known[1], known[0]) if known is not None else None

    def known_peers(self) -> list[bytes]:
        """Peers whose load figures we know (ourselves excluded)."""
        return [p for p in self._estimates if p != self.peer_id]

    def priced_peers(self) -> Iterable[bytes]:
        """Every peer :meth:`load_of` answers for (ourselves included): a live view."""
        return self._estimates.keys()

    def held_bytes(self) -> int:
        return sum(ae.held_bytes() for ae in self.streams.values())

    def namespace_holders(self, ns: bytes) -> set[bytes]:
        """Peers that some partition index we home estimates to hold a block in ``ns``
        (ourselves excluded). A node that is not configured for ``ns`` cannot compute its
        chains, hence not the partition of a request in it: this is what it can still
        relay by. Sparse by design (we home about r/N of the partitions)."""
        out: set[bytes] = set()
        for index in self.indexes.values():
            out.update(p for p in index.peers() if index.holds_namespace(p, ns))
        out.discard(self.peer_id)
        return out


def lookup_pays(unmatched_tokens: int, prefill_tps: float, rtt_s: float) -> bool:
    """Whether a lookup can pay at all: it and the forward it may lead to cost two round
    trips, and the most a hit elsewhere can save over serving here is prefilling the
    tokens this node does not hold (prompt minus the local match). (A router that is a
    home, or holds a cached answer, needs no lookup.)"""
    return prefill_tps > 0 and 2.0 * rtt_s < unmatched_tokens / prefill_tps


class LookupCache:
    """A router's lookup answers, kept ``ttl_s`` per (namespace, partition key block).

    An answer is reused for another chain with the same key only when that chain agrees
    with the looked-up one on every block some holder matched (``L``, the longest match
    in the answer). Then no unlisted node can match the new chain (it would have matched
    the looked-up one too), and each listed holder is credited with its answered match,
    which is exact unless the holder matched right up to where the two chains depart (it
    may hold more of the new chain: an understatement, never an overstatement). A chain
    that departs before ``L`` (same system prompt, another document) is a miss and looks
    up afresh.
    """

    def __init__(self, ttl_s: float, key_depth: int, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.key_depth = key_depth
        self.max_entries = max_entries
        # (ns, key block) -> (expires, the looked-up chain up to L, holders)
        self._entries: dict[tuple[bytes, bytes], tuple[float, tuple, list[HolderMatch]]] = {}
        self.hits = 0
        self.misses = 0

    def put(
        self, ns: bytes, chain: Sequence[bytes], holders: Sequence[HolderMatch], now: float
    ) -> None:
        if not chain or self.ttl_s <= 0:
            return
        if len(self._entries) >= self.max_entries:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            if len(self._entries) >= self.max_entries:
                self._entries.pop(next(iter(self._entries)))
        longest = max((h.blocks for h in holders), default=0)
        key = (ns, partition_key(chain, self.key_depth))
        self._entries[key] = (now + self.ttl_s, tuple(chain[:longest]), list(holders))

    def get(self, ns: bytes, chain: Sequence[bytes], now: float) -> list[HolderMatch] | None:
        """The cached holders for ``chain``, or None on a miss (see the class docstring)."""
        if not chain:
            return None
        entry = self._entries.get((ns, partition_key(chain, self.key_depth)))
        if entry is None or entry[0] <= now:
            self.misses += 1
            return None
        _, matched, holders = entry
        if len(chain) < len(matched) or any(a != b for a, b in zip(matched, chain, strict=False)):
            self.misses += 1
            return None
        self.hits += 1
        return list(holders)


# --- messages ---------------------------------------------------------------------------


def _dump(message: list) -> bytes:
    return cbor2.dumps(message, canonical=True)


def _load(data: bytes, msg_type: int, arity: int, max_items: int) -> list:
    try:
        message = loads_bounded(
            data,
            max_bytes=MAX_PARTITION_MESSAGE_BYTES,
            max_depth=4,
            max_items=max_items,
            error=DigestError,
            oversize_error=DigestError,
        )
    except DigestError as exc:
        raise PartitionMessageError(str(exc)) from None
    if type(message) is not list or len(message) != arity or message[0] != msg_type:
        raise PartitionMessageError(f"expected a message of type {msg_type} with {arity} items")
    return message


def _check_partition(p: object) -> int:
    if type(p) is not int or not 0 <= p < MAX_PARTITIONS:
        raise PartitionMessageError("partition must be an integer in [0, 65536)")
    return p


def _check_ns(ns: object) -> bytes:
    if type(ns) is not bytes or len(ns) != NAMESPACE_ID_BYTES:
        raise PartitionMessageError(f"namespace must be {NAMESPACE_ID_BYTES} bytes")
    return ns


def _check_peer(peer: object) -> bytes:
    if type(peer) is not bytes or len(peer) != PEER_ID_BYTES:
        raise PartitionMessageError(f"peer id must be {PEER_ID_BYTES} bytes")
    return peer


def encode_push(p: int, raws: Sequence[bytes]) -> bytes:
    return _dump([MSG_PUSH, p, list(raws)])


def decode_push(data: bytes) -> tuple[int, list[bytes]]:
    m = _load(data, MSG_PUSH, 3, 8 + _MAX_PUSH_RECORDS)
    p = _check_partition(m[1])
    raws = m[2]
    if type(raws) is list and len(raws) > _MAX_PUSH_RECORDS:
        raise PartitionMessageError(f"a push carries at most {_MAX_PUSH_RECORDS} records")
    try:
        return p, parse_record_list(raws)  # the exchange codecs' check of a records array
    except AntiEntropyError as exc:
        raise PartitionMessageError(str(exc)) from None


def encode_ack(p: int, entries: Mapping[bytes, tuple[int, int]]) -> bytes:
    return _dump([MSG_ACK, p, summary_entries(entries)])


def decode_ack(data: bytes) -> tuple[int, dict[bytes, tuple[int, int]]]:
    m = _load(data, MSG_ACK, 3, 64)
    p = _check_partition(m[1])
    entries = m[2]
    if type(entries) is list and len(entries) > 8:
        raise PartitionMessageError("an acknowledgement lists at most 8 entries")
    try:
        return p, parse_summary_entries(entries)  # the exchange codecs' check of summary entries
    except AntiEntropyError as exc:
        raise PartitionMessageError(str(exc)) from None


def encode_lookup(p: int, ns: bytes, chain: Sequence[bytes]) -> bytes:
    return _dump([MSG_LOOKUP, p, ns, b"".join(chain[:MAX_LOOKUP_BLOCKS])])


def decode_lookup(data: bytes) -> tuple[int, bytes, list[bytes]]:
    m = _load(data, MSG_LOOKUP, 4, 8)
    p = _check_partition(m[1])
    ns = _check_ns(m[2])
    blob = m[3]
    if type(blob) is not bytes or len(blob) % HASH_BYTES or len(blob) > MAX_LOOKUP_BLOCKS * HASH_BYTES:
        raise PartitionMessageError(
            f"chain must be at most {MAX_LOOKUP_BLOCKS} concatenated {HASH_BYTES}-byte hashes"
        )
    return p, ns, [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def encode_lookup_answer(holders: Sequence[HolderMatch]) -> bytes:
    items = [
        [h.peer, h.blocks, [h.load.queue_depth, h.load.active, h.load.prefill_tps,
                            h.load.decode_tps], h.expires_at]
        for h in holders[:MAX_LOOKUP_HOLDERS]
    ]  # fmt: skip
    return _dump([MSG_LOOKUP_ANSWER, items])


def decode_lookup_answer(data: bytes) -> list[HolderMatch]:
    m = _load(data, MSG_LOOKUP_ANSWER, 2, 8 + 9 * MAX_LOOKUP_HOLDERS)
    items = m[1]
    if type(items) is not list or len(items) > MAX_LOOKUP_HOLDERS:
        raise PartitionMessageError(f"an answer lists at most {MAX_LOOKUP_HOLDERS} holders")
    out = []
    for item in items:
        if type(item) is not list or len(item) != 4:
            raise PartitionMessageError("a holder is [peer, blocks, load, expires_at]")
        peer, blocks, load, expires_at = item
        _check_peer(peer)
        if type(blocks) is not int or not 1 <= blocks <= MAX_LOOKUP_BLOCKS:
            raise PartitionMessageError(f"blocks must be in [1, {MAX_LOOKUP_BLOCKS}]")
        if type(expires_at) is not float or not math.isfinite(expires_at):
            raise PartitionMessageError("expires_at must be a finite float")
        if type(load) is not list or len(load) != 4:
            raise PartitionMessageError("load is [queue_depth, active, prefill_tps, decode_tps]")
        qd, active, ptps, dtps = load
        if any(type(v) is not int or not 0 <= v < 2**63 for v in (qd, active)):
            raise PartitionMessageError("queue_depth/active must be non-negative integers")
        if any(type(v) is not float or not (math.isfinite(v) and 0 <= v <= 1e9)
               for v in (ptps, dtps)):  # fmt: skip
            raise PartitionMessageError("tps figures must be finite floats in [0, 1e9]")
        out.append(HolderMatch(peer, blocks, LoadFigures(qd, active, ptps, dtps), expires_at))
    return out
