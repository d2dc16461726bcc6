"""Tests of overlay/core/peerindex.py: record semantics, match rule, expiry, cap, and a
hypothesis comparison against a naive reference model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.digest import DigestRecord, LoadFigures, NamespaceDelta
from prefixmesh.overlay.core.peerindex import (
    MAX_HASHES_PER_PEER,
    PeerCacheIndex,
    PeerIndexError,
    UnknownRecordKind,
)

NS1, NS2 = b"ns-one..", b"ns-two.."
P1, P2, P3 = b"peer-1", b"peer-2", b"peer-3"
MODEL = b"model-fp"


def h(*path: int) -> bytes:
    """A fake chained hash naming the prefix ``path`` (tree-shaped: shared prefixes
    share hashes, as real chained hashes do)."""
    return (hash(path) & (2**64 - 1)).to_bytes(8, "little")


def chain(*path: int) -> list[bytes]:
    return [h(*path[: i + 1]) for i in range(len(path))]


def rec(
    peer: bytes,
    kind: str,
    ns_map: Mapping[bytes, tuple[Sequence[bytes], Sequence[bytes]] | Sequence[bytes]],
    *,
    expires_at: float = 100.0,
    seq: int = 1,
    load: LoadFigures = LoadFigures(0, 0, 400.0, 100.0),  # noqa: B008 (frozen)
    addrs: tuple[str, ...] = (),
) -> DigestRecord:
    deltas = []
    for ns, v in ns_map.items():
        if isinstance(v, tuple):
            added, removed = v
        else:
            added, removed = v, ()
        deltas.append(NamespaceDelta(ns, tuple(added), tuple(removed)))
    return DigestRecord(
        origin=peer, epoch=1, seq=seq, issued_at=0.0, expires_at=expires_at, model=MODEL,
        kind=kind, namespaces=tuple(deltas), load=load, kv_capacity_bytes=1 << 30,
        kv_used_bytes=1 << 20, addrs=addrs,
    )


# ----------------------------------------------------------------------- unit tests


def test_chain_prefix_match_counts_leading_blocks() -> None:
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "snapshot", {NS1: chain(1, 2, 3, 4, 5)}), now=0.0)
    idx.apply(rec(P2, "snapshot", {NS1: chain(1, 2, 9)}), now=0.0)
    assert idx.longest_matches(NS1, chain(1, 2, 3, 4, 5, 6, 7, 8)) == {P1: 5, P2: 2}
    assert idx.longest_matches(NS1, chain(1, 2, 9)) == {P1: 2, P2: 3}
    assert idx.longest_matches(NS1, chain(7, 2)) == {}
    assert idx.longest_matches(NS2, chain(1, 2)) == {}  # namespaces are disjoint
    assert idx.longest_matches(NS1, []) == {}
    assert idx.longest_match(P1, NS1, chain(1, 2, 3, 9)) == 3


def test_gap_ends_the_match() -> None:
    c = chain(1, 2, 3, 4, 5)
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "snapshot", {NS1: [c[0], c[1], c[3], c[4]]}), now=0.0)  # h3 missing
    idx.apply(rec(P2, "snapshot", {NS1: [c[4]]}), now=0.0)  # only the deepest
    assert idx.longest_matches(NS1, c) == {P1: 2}
    assert idx.longest_match(P2, NS1, c) == 0


def test_delta_adds_and_removes_and_remove_comes_first() -> None:
    c = chain(1, 2, 3)
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "delta", {NS1: (c, ())}), now=0.0)
    assert idx.longest_matches(NS1, c) == {P1: 3}
    idx.apply(rec(P1, "delta", {NS1: ((), [c[2]])}, seq=2), now=1.0)
    assert idx.longest_matches(NS1, c) == {P1: 2}
    # Listed in both: removed first, then added -> present.
    idx.apply(rec(P1, "delta", {NS1: ([c[2]], [c[2]])}, seq=3), now=2.0)
    assert idx.longest_matches(NS1, c) == {P1: 3}
    # Removing what was never there is harmless.
    idx.apply(rec(P1, "delta", {NS2: ((), [c[0]])}, seq=4), now=3.0)
    assert idx.estimate(P1).n_hashes == 3  # type: ignore[union-attr]


def test_snapshot_replaces_and_clears_absent_namespaces() -> None:
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "snapshot", {NS1: chain(1, 2), NS2: chain(5, 6)}), now=0.0)
    idx.apply(rec(P1, "snapshot", {NS1: chain(1, 3)}, seq=2), now=1.0)
    assert idx.longest_matches(NS1, chain(1, 2)) == {P1: 1}
    assert idx.longest_matches(NS1, chain(1, 3)) == {P1: 2}
    assert idx.longest_matches(NS2, chain(5, 6)) == {}
    assert idx.holdings(P1) == {NS1: frozenset(chain(1, 3))}
    # An empty snapshot keeps the peer (alive, with load) but with nothing cached.
    idx.apply(rec(P1, "snapshot", {}, seq=3), now=2.0)
    assert idx.peers() == [P1] and idx.holdings(P1) == {}
    assert idx.estimate(P1).n_hashes == 0  # type: ignore[union-attr]
    assert idx._postings == {}  # no empty tables left behind


def test_every_record_refreshes_estimate() -> None:
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "snapshot", {NS1: chain(1)}, expires_at=60.0, addrs=("/ip4/1",)), now=5.0)
    e = idx.estimate(P1)
    assert e is not None and e.expires_at == 60.0 and e.updated_at == 5.0
    assert e.addrs == ("/ip4/1",) and e.model == MODEL and e.n_hashes == 1
    load = LoadFigures(3, 1, 300.0, 90.0)
    idx.apply(rec(P1, "delta", {}, expires_at=80.0, seq=2, load=load, addrs=("/ip4/2",)),
              now=20.0)
    e = idx.estimate(P1)
    assert e is not None and e.load == load and e.expires_at == 80.0 and e.updated_at == 20.0
    assert e.addrs == ("/ip4/2",) and e.seq == 2 and e.n_hashes == 1
    assert idx.estimate(P2) is None


def test_expire_drops_stale_peers_in_order_and_honours_refresh() -> None:
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "snapshot", {NS1: chain(1)}, expires_at=30.0), now=0.0)
    idx.apply(rec(P2, "snapshot", {NS1: chain(1)}, expires_at=20.0), now=0.0)
    idx.apply(rec(P3, "snapshot", {NS1: chain(1)}, expires_at=30.0), now=0.0)
    idx.apply(rec(P3, "delta", {}, expires_at=90.0, seq=2), now=10.0)  # refreshed
    assert idx.expire(19.9) == []
    assert idx.expire(30.0) == [P2, P1]  # by expiry time; expiry is inclusive
    assert idx.peers() == [P3]
    assert idx.longest_matches(NS1, chain(1)) == {P3: 1}
    assert idx.expire(89.0) == [] and idx.expire(1000.0) == [P3]
    assert idx.stats.peers_expired == 3 and len(idx) == 0 and idx._postings == {}


def test_drop_peer_and_rejoin() -> None:
    idx = PeerCacheIndex()
    idx.apply(rec(P1, "snapshot", {NS1: chain(1, 2)}, expires_at=10.0), now=0.0)
    idx.apply(rec(P2, "snapshot", {NS1: chain(1, 2)}), now=0.0)
    idx.drop_peer(P1)
    idx.drop_peer(b"unknown")  # no error
    assert idx.longest_matches(NS1, chain(1, 2)) == {P2: 2}
    assert P1 not in idx and P2 in idx and idx.stats.peers_dropped == 1
    # Re-joining with the same expiry: the stale heap entry must not drop it twice
    # nor miss it.
    idx.apply(rec(P1, "snapshot", {NS1: chain(1)}, expires_at=10.0), now=1.0)
    assert idx.expire(10.0) == [P1]


def test_per_peer_cap_bounds_what_one_peer_holds() -> None:
    idx = PeerCacheIndex(max_hashes_per_peer=4)
    many = [h(9, i) for i in range(10)]
    idx.apply(rec(P1, "snapshot", {NS1: many[:6], NS2: many[6:]}), now=0.0)
    e = idx.estimate(P1)
    assert e is not None and e.n_hashes == 4 and idx.stats.hashes_truncated == 6
    assert idx.holdings(P1) == {NS1: frozenset(many[:4])}
    # NS1's removal frees one slot, then only the first of NS2's two additions fits.
    idx.apply(rec(P1, "delta", {NS1: ((), many[:1]), NS2: (many[6:8], ())}, seq=2), now=1.0)
    assert idx.estimate(P1).n_hashes == 4  # type: ignore[union-attr]
    assert idx.holdings(P1) == {NS1: frozenset(many[1:4]), NS2: frozenset(many[6:7])}
    assert MAX_HASHES_PER_PEER == PeerCacheIndex().max_hashes_per_peer == 65_536


def test_unknown_record_kind_is_a_typed_error() -> None:
    idx = PeerCacheIndex()
    with pytest.raises(UnknownRecordKind, match="'full'"):
        idx.apply(rec(P1, "full", {NS1: chain(1)}), now=0.0)
    assert issubclass(UnknownRecordKind, PeerIndexError) and idx.peers() == []


def test_many_peers_share_a_system_prompt() -> None:
    idx = PeerCacheIndex()
    peers = [bytes([7, i]) for i in range(50)]
    for i, p in enumerate(peers):
        idx.apply(rec(p, "snapshot", {NS1: chain(1, 2, 3, 100 + i, 7)}), now=0.0)
    got = idx.longest_matches(NS1, chain(1, 2, 3, 110, 7, 8))
    assert got == {p: (5 if i == 10 else 3) for i, p in enumerate(peers)}


# ----------------------------------------------------------------------- reference model


class NaiveIndex:
    """The obvious implementation: dict of peer -> ns -> set, brute-force matching."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[bytes, dict[bytes, set[bytes]]] = {}
        self.expiry: dict[bytes, float] = {}

    def apply(self, r: DigestRecord) -> None:
        old = self.held.get(r.origin, {})
        if r.kind == "snapshot":
            new: dict[bytes, set[bytes]] = {}
            n = 0
            for d in r.namespaces:
                for x in d.added:
                    if x not in new.setdefault(d.ns, set()) and n < self.cap:
                        new[d.ns].add(x)
                        n += 1
        else:
            new = {ns: set(s) for ns, s in old.items()}
            for d in r.namespaces:
                s = new.setdefault(d.ns, set())
                s -= set(d.removed)
                for x in d.added:
                    if x not in s and sum(map(len, new.values())) < self.cap:
                        s.add(x)
        self.held[r.origin] = {ns: s for ns, s in new.items() if s}
        self.expiry[r.origin] = r.expires_at

    def drop(self, peer: bytes) -> None:
        self.held.pop(peer, None)
        self.expiry.pop(peer, None)

    def expire(self, now: float) -> list[bytes]:
        gone = sorted((t, p) for p, t in self.expiry.items() if t <= now)
        for _, p in gone:
            self.drop(p)
        return [p for _, p in gone]

    def matches(self, ns: bytes, q: Sequence[bytes]) -> dict[bytes, int]:
        out = {}
        for p, by_ns in self.held.items():
            s = by_ns.get(ns, set())
            n = 0
            while n < len(q) and q[n] in s:
                n += 1
            if n:
                out[p] = n
        return out


PEERS = [bytes([0xAA, i]) for i in range(4)]
NSS = [NS1, NS2]
# A small universe of tree-shaped paths so that peers overlap and chains share prefixes.
PATHS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 7, 8), (1, 9, 10), (11, 12, 13, 14), (1, 2, 15)]
UNIVERSE = sorted({x for p in PATHS for x in chain(*p)})
QUERIES = [chain(*p) for p in PATHS] + [chain(1, 2, 3, 4), chain(11, 12, 99), chain(1)]

hash_lists = st.lists(st.sampled_from(UNIVERSE), max_size=12)
prefix_lists = st.builds(
    lambda p, n: chain(*p)[:n], st.sampled_from(PATHS), st.integers(0, 6)
)
some_hashes = st.one_of(hash_lists, prefix_lists)

ops = st.one_of(
    st.tuples(
        st.just("record"),
        st.sampled_from(["delta", "snapshot"]),
        st.sampled_from(PEERS),
        st.dictionaries(st.sampled_from(NSS), st.tuples(some_hashes, hash_lists), max_size=2),
        st.floats(0.5, 30.0),  # ttl
    ),
    st.tuples(st.just("drop"), st.sampled_from(PEERS)),
    st.tuples(st.just("advance"), st.floats(0.0, 20.0)),
)


def check_consistent(idx: PeerCacheIndex, ref: NaiveIndex) -> None:
    assert idx.peers() == sorted(ref.expiry)
    for p in ref.expiry:
        assert idx.holdings(p) == {ns: frozenset(s) for ns, s in ref.held[p].items()}
        for ns in NSS:
            assert idx.holds_namespace(p, ns) == bool(ref.held[p].get(ns))
        e = idx.estimate(p)
        assert e is not None and e.n_hashes == sum(map(len, ref.held[p].values()))
        assert e.expires_at == ref.expiry[p]
    for ns in NSS:
        for q in QUERIES:
            assert idx.longest_matches(ns, q) == ref.matches(ns, q)
    # The inverted index is exactly the inversion of the holdings (no leaks).
    inverted: dict[bytes, dict[bytes, set[bytes]]] = {}
    for p, by_ns in ref.held.items():
        for ns, s in by_ns.items():
            for x in s:
                inverted.setdefault(ns, {}).setdefault(x, set()).add(p)
    got = {
        ns: {x: ({v} if isinstance(v, bytes) else set(v)) for x, v in table.items()}
        for ns, table in idx._postings.items()
    }
    assert got == inverted


@settings(max_examples=100, deadline=None)
@given(seq=st.lists(ops, max_size=40), cap=st.sampled_from([3, 8, MAX_HASHES_PER_PEER]))
def test_matches_naive_reference(seq: list[tuple], cap: int) -> None:
    idx = PeerCacheIndex(max_hashes_per_peer=cap)
    ref = NaiveIndex(cap)
    now = 0.0
    for n, op in enumerate(seq):
        if op[0] == "record":
            _, kind, peer, ns_map, ttl = op
            if kind == "snapshot":
                ns_map = {ns: added for ns, (added, _removed) in ns_map.items()}
            r = rec(peer, kind, ns_map, expires_at=now + ttl, seq=n)
            idx.apply(r, now)
            ref.apply(r)
        elif op[0] == "drop":
            idx.drop_peer(op[1])
            ref.drop(op[1])
        else:
            now += op[1]
            assert idx.expire(now) == ref.expire(now)
        check_consistent(idx, ref)
