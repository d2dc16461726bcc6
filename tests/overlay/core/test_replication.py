"""Full and partial replication behind one interface (overlay/core/replication.py): the
same calls put a node's own cache changes into the right digest stream."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.digest import LoadFigures
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import PartitionConfig, PartitionedDigest
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.core.planner import FullView, PartitionedView
from prefixmesh.overlay.core.replication import FullReplication, PartialReplication

MODEL = b"test-model-fp"
NS = b"N" * 8
IDENT = Identity.from_seed(b"\x07" * 32)


def _ae(fp: bytes = MODEL, now: float = 0.0) -> AntiEntropy:
    return AntiEntropy(IDENT, fp, epoch=1, now=now, ttl=600.0, refresh_interval=200.0)


def _full() -> FullReplication:
    return FullReplication(_ae(), PeerCacheIndex(), MODEL)


def _partial() -> PartialReplication:
    pd = PartitionedDigest(IDENT, MODEL, config=PartitionConfig(n_partitions=16, replicas=2),
                           make_stream=lambda fp, now: _ae(fp, now))  # fmt: skip
    return PartialReplication(pd, lambda: [])


def _advertised(repl) -> set[bytes]:
    if isinstance(repl, FullReplication):
        streams = [repl.ae]
    else:
        streams = list(repl.pd.streams.values())
    return {h for ae in streams for hs in ae.local_hashes().values() for h in hs}


def _chain(seed: int, n: int) -> list[bytes]:
    return [bytes([seed % 256, i % 256]) * 4 for i in range(n)]


def test_views_match_the_mode():
    assert isinstance(_full().view, FullView)
    assert isinstance(_partial().view, PartitionedView)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 6)), max_size=30))
def test_both_modes_advertise_exactly_the_held_prefixes(ops):
    """Adds and removes through the one interface leave both modes advertising the same
    set: the hashes of the prefixes still held."""
    full, partial = _full(), _partial()
    held: list[tuple[int, int]] = []
    for add, seed, n in ops:
        if add:
            held.append((seed, n))
            for repl in (full, partial):
                repl.add(NS, _chain(seed, n), 1.0)
        elif (seed, n) in held:
            held.remove((seed, n))
            for repl in (full, partial):
                repl.remove(NS, _chain(seed, n), 2.0)
    want = {h for seed, n in held for h in _chain(seed, n)}
    assert _advertised(full) == want
    assert _advertised(partial) == want


def test_load_reaches_every_stream():
    load = LoadFigures(3, 1, 400.0, 90.0)
    full, partial = _full(), _partial()
    partial.add(NS, _chain(1, 4), 0.0)
    for repl in (full, partial):
        repl.set_local_load(load, 1 << 30, 1 << 20)
    partial.add(NS, _chain(200, 4), 0.0)  # a stream made after the load was set gets it too
    streams = [full.ae, *partial.pd.streams.values()]
    assert len(streams) >= 2
    assert all(ae._load == load for ae in streams)


def test_new_addresses_go_out_in_fresh_records_in_both_modes():
    """A relay came or went: the next records carry the new addresses at once (full: a
    snapshot now; partial: every partition stream restates at its next tick)."""
    relayed = ("/ip4/198.18.0.1/tcp/4001/p2p/Relay/p2p-circuit",)
    full, partial = _full(), _partial()
    full.add(NS, _chain(1, 4), 0.0)
    full.ae.tick(0.0)
    partial.add(NS, _chain(1, 4), 0.0)
    partial.add(NS, _chain(200, 4), 0.0)
    partial.pd.tick(0.0)
    assert not partial.pd.tick(1.0)  # nothing due: refresh is 200 s away
    full.set_local_addrs(relayed, 1.0)
    partial.set_local_addrs(relayed, 1.0)
    assert full.ae.held_records(IDENT.peer_id)[-1].record.addrs == relayed
    issued = partial.pd.tick(2.0)
    assert len(issued) == len(partial.pd.streams) >= 2
    assert all(r.addrs == relayed for r in issued)
