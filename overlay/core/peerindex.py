"""What every known peer is estimated to hold: an inverted index over peers' block hashes.

Peers gossip signed digest records (``overlay/core/digest.py``) that list the chained block
hashes of the prefixes they have cached, per namespace. ``PeerCacheIndex`` folds those
records into two structures:

* per peer, per namespace, the set of advertised hashes (needed to apply deltas,
  replace snapshots and drop a peer), and
* an inverted index ``ns -> hash -> peers`` (needed to answer a routing query without
  looking at every peer).

Record semantics (``apply``)
    ``delta``: per namespace, the ``removed`` hashes are taken out first, then the
    ``added`` ones are put in (so a hash listed in both ends up present).
    ``snapshot``: the origin's whole holding is replaced by the ``added`` sets of the
    record; ``removed`` is ignored and namespaces absent from the snapshot are cleared.
    Every record, of either kind, refreshes the peer's load, KV capacity/usage, model,
    listen addresses and expiry time. Records are applied in the order given: ordering,
    replay and signature checks are the anti-entropy layer's job, not this index's.

Match rule (``longest_matches``)
    Because ``h_i`` covers the whole prefix of ``i`` blocks, an honest peer that holds
    ``h_i`` also advertises ``h_1 .. h_{i-1}``. A peer whose advertisement has a gap
    (it lists ``h_5`` but not ``h_3``: a lost delta, a holding truncated by the per-peer
    cap below, or a lie) is credited only with the *contiguous* run from the root:
    ``matched = max i such that h_1 .. h_i are all advertised``. Anything past the first
    gap is ignored. Why the conservative rule: forwarding on an over-estimate costs a
    wasted network hop plus a full prefill on the far side, while an under-estimate
    costs at most a missed reuse; and the rule makes a peer's claim for the prefix
    ``h_1..h_i`` independent of what else it advertises. It is also what makes the
    query cheap: the query walks the request's chain from the root, intersecting the set
    of still-matching peers with each block's postings, and stops as soon as no peer is
    left. Its cost is O(request blocks walked + sum of the matched lengths), never a scan
    of all peers; peers that share nothing with the request are never touched.

Limits
    ``MAX_HASHES_PER_PEER`` (65,536 by default, i.e. 1 Mi tokens of 16-token blocks,
    about 22 GiB of KV for the default 135M model) bounds what one peer can make this
    index hold. Additions past the cap are dropped, in record order, and counted in
    ``stats.hashes_truncated``. (Digest records carry hashes sorted by value, not by
    chain position, so which hashes survive is arbitrary but deterministic; the
    contiguous match rule turns the resulting gaps into shorter matches, never wrong
    ones.) A well-behaved node stays under the cap by construction: the cap is a
    defence against a peer that does not. Memory is therefore O(peers x cap). A posting held
    by a single peer is stored as that peer's id rather than a one-element set, which
    is the common case for the unique tail blocks of conversations and roughly halves
    the index's memory.

Expiry
    A peer's estimate expires at the ``expires_at`` of its latest record;
    ``expire(now)`` drops every peer whose expiry is ``<= now`` (a min-heap with lazy
    deletion keeps this O(log n) per record, not a scan of all peers).

Pure code: no trio, libp2p or llama imports; time comes in as ``now``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only types are needed: records are read by attribute
    from .digest import DigestRecord, LoadFigures

__all__ = [
    "MAX_HASHES_PER_PEER",
    "PeerCacheIndex",
    "PeerEstimate",
    "PeerIndexError",
    "PeerIndexStats",
    "UnknownRecordKind",
]

# Equal to what an honest node ever advertises (antientropy.MAX_ADVERTISED_HASHES), so the
# cap only ever bites on peers that break the protocol.
MAX_HASHES_PER_PEER = 65_536

_EMPTY: frozenset[bytes] = frozenset()


class PeerIndexError(ValueError):
    """Base class of every error raised by the peer index."""


class UnknownRecordKind(PeerIndexError):
    """A record whose ``kind`` is neither ``"delta"`` nor ``"snapshot"``."""


@dataclass(frozen=True, slots=True)
class PeerEstimate:
    """The latest known state of one peer (read-only; replaced on every record)."""

    peer: bytes
    load: LoadFigures
    kv_capacity_bytes: int
    kv_used_bytes: int
    n_hashes: int  # hashes this index holds for the peer (after the cap)
    updated_at: float  # `now` of the latest apply()
    expires_at: float  # the latest record's expires_at
    addrs: tuple[str, ...]
    model: bytes
    epoch: int = 0  # (epoch, seq) of the latest record, for route traces
    seq: int = 0


@dataclass(slots=True)
class PeerIndexStats:
    """Counters, for diagnostics and benchmarks."""

    records_applied: int = 0
    snapshots_applied: int = 0
    hashes_truncated: int = 0  # additions dropped by the per-peer cap
    peers_expired: int = 0
    peers_dropped: int = 0  # drop_peer() calls that removed a known peer


# A posting is the set of peers advertising one (namespace, hash). Single-holder postings
# are stored as the bare peer id (bytes) to save memory; see the module docstring.
_Posting = bytes | set[bytes]


class PeerCacheIndex:
    """Peers' estimated caches with an inverted index for longest-prefix queries."""

    def __init__(self, *, max_hashes_per_peer: int = MAX_HASHES_PER_PEER) -> None:
        if max_hashes_per_peer < 0:
            raise ValueError("max_hashes_per_peer must be >= 0")
        self.max_hashes_per_peer = max_hashes_per_peer
        self.stats = PeerIndexStats()
        # ns -> hash -> peer id | set of peer ids
        self._postings: dict[bytes, dict[bytes, _Posting]] = {}
        # peer -> ns -> advertised hashes (no empty sets are kept)
        self._held: dict[bytes, dict[bytes, set[bytes]]] = {}
        self._n_hashes: dict[bytes, int] = {}
        self._estimates: dict[bytes, PeerEstimate] = {}
        # (expires_at, peer), lazily invalidated: an entry is live only while it equals
        # the peer's current estimate's expiry.
        self._expiry_heap: list[tuple[float, bytes]] = []

    # ------------------------------------------------------------------ updates

    def apply(self, record: DigestRecord, now: float) -> None:
        """Fold one (already verified, in-order) digest record into the index."""
        peer = record.origin
        if record.kind == "delta":
            self._apply_delta(peer, record)
        elif record.kind == "snapshot":
            self._apply_snapshot(peer, record)
            self.stats.snapshots_applied += 1
        else:
            raise UnknownRecordKind(
                f"record kind {record.kind!r} from origin {peer.hex()} is neither "
                "'delta' nor 'snapshot'"
            )
        self.stats.records_applied += 1
        previous = self._estimates.get(peer)
        self._estimates[peer] = PeerEstimate(
            peer=peer,
            load=record.load,
            kv_capacity_bytes=record.kv_capacity_bytes,
            kv_used_bytes=record.kv_used_bytes,
            n_hashes=self._n_hashes.get(peer, 0),
            updated_at=now,
            expires_at=record.expires_at,
            addrs=tuple(record.addrs),
            model=record.model,
            epoch=record.epoch,
            seq=record.seq,
        )
        if previous is None or previous.expires_at != record.expires_at:
            heapq.heappush(self._expiry_heap, (record.expires_at, peer))
            if len(self._expiry_heap) > 4 * len(self._estimates) + 64:
                # Refreshes leave stale entries behind; if expire() is called rarely
                # they would pile up, so rebuild from the live estimates.
                self._expiry_heap = [(e.expires_at, p) for p, e in self._estimates.items()]
                heapq.heapify(self._expiry_heap)

    def drop_peer(self, peer: bytes) -> None:
        """Forget everything about ``peer`` (no error if it is unknown)."""
        if self._forget(peer):
            self.stats.peers_dropped += 1

    def _forget(self, peer: bytes) -> bool:
        held = self._held.pop(peer, None)
        if held:
            for ns, hashes in held.items():
                table = self._postings[ns]
                for h in hashes:
                    self._unpost(table, h, peer)
                if not table:
                    del self._postings[ns]
        self._n_hashes.pop(peer, None)
        # Stale heap entries for this peer are skipped lazily in expire().
        return self._estimates.pop(peer, None) is not None

    def expire(self, now: float) -> list[bytes]:
        """Drop every peer whose latest record expired at or before ``now``.

        Returns the dropped peers in expiry order (ties by peer id): deterministic.
        """
        dropped: list[bytes] = []
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expires_at, peer = heapq.heappop(heap)
            estimate = self._estimates.get(peer)
            if estimate is None or estimate.expires_at != expires_at:
                continue  # stale entry: the peer was dropped or refreshed since
            self._forget(peer)
            self.stats.peers_expired += 1
            dropped.append(peer)
        return dropped

    # ------------------------------------------------------------------ queries

    def longest_matches(self, ns: bytes, chain: Sequence[bytes]) -> dict[bytes, int]:
        """Peer -> number of leading blocks of ``chain`` it advertises (only peers > 0).

        ``chain`` is the request's chained block hashes ``h_1 .. h_n`` in namespace
        ``ns``. A peer is credited with the longest contiguous run from ``h_1`` (see the
        module docstring for why gaps end a match).
        """
        table = self._postings.get(ns)
        if not table or not chain:
            return {}
        first = table.get(chain[0])
        if first is None:
            return {}
        active: set[bytes] | frozenset[bytes]
        active = {first} if type(first) is bytes else set(first)
        out: dict[bytes, int] = {}
        for i in range(1, len(chain)):
            posting = table.get(chain[i])
            if posting is None:
                survivors: set[bytes] | frozenset[bytes] = _EMPTY
            elif type(posting) is bytes:
                survivors = {posting} if posting in active else _EMPTY
            elif active <= posting:
                continue  # nobody drops out: the common case along a shared prompt,
                # and a subset test is about twice as fast as building the intersection
            else:
                survivors = active & posting  # iterates the smaller of the two
            if len(survivors) != len(active):
                for peer in active - survivors:
                    out[peer] = i  # matched h_1 .. h_i (0-based indices 0 .. i-1)
                if not survivors:
                    return out
                active = survivors
        n = len(chain)
        for peer in active:
            out[peer] = n
        return out

    def longest_match(self, peer: bytes, ns: bytes, chain: Sequence[bytes]) -> int:
        """Matched blocks of ``chain`` for one peer (0 if none or unknown)."""
        hashes = self._held.get(peer, {}).get(ns)
        if not hashes:
            return 0
        for i, h in enumerate(chain):
            if h not in hashes:
                return i
        return len(chain)

    def estimate(self, peer: bytes) -> PeerEstimate | None:
        return self._estimates.get(peer)

    def peers(self) -> list[bytes]:
        """Every peer with a live estimate, sorted by id (deterministic)."""
        return sorted(self._estimates)

    def holds_namespace(self, peer: bytes, ns: bytes) -> bool:
        """Whether ``peer`` is estimated to hold any block in namespace ``ns`` (no copy:
        what a node that cannot compute the namespace's hashes relays by)."""
        return bool(self._held.get(peer, {}).get(ns))

    def holdings(self, peer: bytes) -> dict[bytes, frozenset[bytes]]:
        """A copy of what ``peer`` is estimated to hold: ns -> hashes."""
        return {ns: frozenset(hs) for ns, hs in self._held.get(peer, {}).items()}

    def __len__(self) -> int:
        return len(self._estimates)

    def __contains__(self, peer: object) -> bool:
        return peer in self._estimates

    # ------------------------------------------------------------------ internals

    def _apply_delta(self, peer: bytes, record: DigestRecord) -> None:
        held = self._held.setdefault(peer, {})
        count = self._n_hashes.get(peer, 0)
        for nd in record.namespaces:
            hashes = held.get(nd.ns)
            if hashes and nd.removed:
                table = self._postings[nd.ns]
                for h in nd.removed:
                    if h in hashes:
                        hashes.remove(h)
                        self._unpost(table, h, peer)
                        count -= 1
            if nd.added:
                if hashes is None:
                    hashes = held[nd.ns] = set()
                count = self._add_hashes(peer, nd.ns, hashes, nd.added, count)
            if hashes is not None and not hashes:
                del held[nd.ns]
                if nd.ns in self._postings and not self._postings[nd.ns]:
                    del self._postings[nd.ns]
        self._n_hashes[peer] = count
        if not held:
            del self._held[peer]

    def _apply_snapshot(self, peer: bytes, record: DigestRecord) -> None:
        old = self._held.get(peer, {})
        # The new holding, with the cap applied in record order.
        new: dict[bytes, set[bytes]] = {}
        budget = self.max_hashes_per_peer
        truncated = 0
        if sum(len(nd.added) for nd in record.namespaces) <= budget:
            # the cap cannot bite: build the sets in C (the common case by far)
            for nd in record.namespaces:
                target = new.get(nd.ns)
                if target is None:
                    new[nd.ns] = set(nd.added)
                else:
                    target.update(nd.added)
            budget -= sum(len(hs) for hs in new.values())
        else:
            for nd in record.namespaces:
                target = new.setdefault(nd.ns, set())
                for h in nd.added:
                    if h in target:
                        continue
                    if budget <= 0:
                        truncated += 1
                        continue
                    target.add(h)
                    budget -= 1
        self.stats.hashes_truncated += truncated
        # Touch the postings only for what changed: periodic snapshots mostly repeat.
        for ns, old_hashes in old.items():
            gone = old_hashes - new.get(ns, _EMPTY)
            if gone:
                table = self._postings[ns]
                for h in gone:
                    self._unpost(table, h, peer)
                if not table:
                    del self._postings[ns]
        for ns, new_hashes in new.items():
            fresh = new_hashes - old.get(ns, _EMPTY)
            if fresh:
                self._post_all(self._postings.setdefault(ns, {}), fresh, peer)
        held = {ns: hs for ns, hs in new.items() if hs}
        if held:
            self._held[peer] = held
        else:
            self._held.pop(peer, None)
        self._n_hashes[peer] = self.max_hashes_per_peer - budget

    def _add_hashes(
        self, peer: bytes, ns: bytes, hashes: set[bytes], added: Iterable[bytes], count: int
    ) -> int:
        table = self._postings.setdefault(ns, {})
        fresh = [h for h in dict.fromkeys(added) if h not in hashes]  # record order, unique
        room = self.max_hashes_per_peer - count
        if len(fresh) > room:
            self.stats.hashes_truncated += len(fresh) - max(0, room)
            fresh = fresh[: max(0, room)]
        hashes.update(fresh)
        self._post_all(table, fresh, peer)
        return count + len(fresh)

    @staticmethod
    def _post_all(table: dict[bytes, _Posting], hashes: Iterable[bytes], peer: bytes) -> None:
        """Add ``peer`` to the posting of each of ``hashes`` (one call per record: this
        is the index's hottest loop)."""
        get = table.get
        for h in hashes:
            posting = get(h)
            if posting is None:
                table[h] = peer
            elif type(posting) is bytes:
                if posting != peer:
                    table[h] = {posting, peer}
            else:
                posting.add(peer)

    @staticmethod
    def _unpost(table: dict[bytes, _Posting], h: bytes, peer: bytes) -> None:
        posting = table.get(h)
        if posting is None:
            return
        if type(posting) is bytes:
            if posting == peer:
                del table[h]
            return
        posting.discard(peer)
        if len(posting) == 1:
            (table[h],) = posting  # back to the compact single-holder form
        elif not posting:
            del table[h]
