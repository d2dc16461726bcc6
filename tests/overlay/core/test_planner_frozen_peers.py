"""``FrozenPeers`` (the simulator's immutable peer table) gives the planner's fast paths;
the plans must be exactly those of a plain ``dict`` of the same links (what the node
passes): same action, targets, carry, decision and routing context, over a sequence of
decisions (ledgers and the shed-candidate rng evolve alike)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.core.blocks import BLOCK_TOKENS
from prefixmesh.overlay.core.digest import LoadFigures
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import HolderMatch, PartitionConfig, PartitionedDigest
from prefixmesh.overlay.core.planner import (
    FrozenPeers,
    PartitionedView,
    PeerLink,
    PlanInput,
    Planner,
)
from prefixmesh.overlay.core.routing import RouterMemory, RoutingConfig, make_policy

NS = b"n" * 32
MODEL = b"model"
N_PEERS = 24

peer_st = st.tuples(
    st.integers(0, 6),  # blocks matched in the lookup answer (0: not a holder)
    st.booleans(),  # has a digest load figure
    st.sampled_from([None, 0.0, 2.0]),  # PONG load
    st.sampled_from([None, 64, 4096]),  # context tokens
)
request_st = st.tuples(
    st.integers(0, 6 * BLOCK_TOKENS),  # local match
    st.integers(0, 3),  # visited peers
    st.booleans(),  # forwarded in
    st.one_of(st.none(), st.integers(0, N_PEERS - 1)),  # a peer priced just before it
)


def _world(peers, seed: int):
    ids = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(N_PEERS + 1)]
    me, others = ids[0], ids[1:]
    pd = PartitionedDigest(Identity.from_seed(b"\x01" * 32), MODEL,
                           make_stream=lambda fp, now: None,
                           config=PartitionConfig(n_partitions=16, replicas=3))
    links, holders = {}, []
    for pid, (blocks, priced, pong, ctx) in zip(others, peers, strict=False):
        links[pid] = PeerLink(rtt_s=0.004, load=pong, context_tokens=ctx)
        if priced:
            holders.append(HolderMatch(pid, blocks, LoadFigures(1, 0, 400.0, 120.0), 60.0))
    pd.note_answer(holders)
    chain = tuple(bytes([seed % 251, i]) * 16 for i in range(6))
    pd.take_answer(NS, chain, [h for h in holders if h.blocks > 0], 0.0)
    return me, pd, links, chain


def _planner(me, pd) -> Planner:
    policy = make_policy("prefixmesh", RoutingConfig(), random.Random(3), me)
    return Planner(me, policy, PartitionedView(pd, lambda: ()),
                   RouterMemory.for_policy(policy, me), rng=random.Random(5))


@settings(max_examples=60, deadline=None)
@given(peers=st.lists(peer_st, min_size=1, max_size=N_PEERS),
       requests=st.lists(request_st, min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_frozen_peers_plan_exactly_like_a_dict(peers, requests, seed):
    me, pd, links, chain = _world(peers, seed)
    plain, frozen = _planner(me, pd), _planner(me, pd)
    table = FrozenPeers(links)
    order = sorted(links)
    for t, (local, n_visited, forwarded, newly_priced) in enumerate(requests):
        if newly_priced is not None and newly_priced < len(order):
            # a peer's first load figures arrive between plans: both paths' shed pools
            # must follow
            pd.note_answer([HolderMatch(order[newly_priced], 1, LoadFigures(0, 1, 300.0, 90.0),
                                        float(t) + 60.0)])  # fmt: skip
        visited = frozenset(order[:n_visited])
        plans = []
        for planner, peer_map in ((plain, links), (frozen, table)):
            inp = PlanInput(
                ns=NS, chain=chain, prompt_tokens=6 * BLOCK_TOKENS + 3,
                local_matched_tokens=local, local_prefill_tps=420.0, local_queue_wait_s=0.3,
                local_load=1.0, avg_request_s=0.5, hop_budget=2, visited=visited,
                forwarded_in=forwarded, peers=peer_map, may_look_up=False,
            )  # fmt: skip
            plans.append(planner.plan(inp, float(t)))
        assert plans[0] == plans[1]


def test_frozen_peers_is_an_immutable_dict():
    link = PeerLink(rtt_s=0.001, load=1.0)
    table = FrozenPeers({b"a": link, b"b": PeerLink()})
    assert table == {b"a": link, b"b": PeerLink()}
    assert table.sorted_ids == (b"a", b"b") and table.loaded == frozenset({b"a"})
    for mutate in (lambda: table.__setitem__(b"c", link), lambda: table.pop(b"a"),
                   lambda: table.update({}), lambda: table.clear(),
                   lambda: table.setdefault(b"c", link), lambda: table.popitem()):
        with pytest.raises(TypeError):
            mutate()
    assert len(table) == 2


def test_cached_pools_stay_exact_past_their_bound():
    """The sorted pool is cached per left-out set (a few per table, least recently used
    dropped): every plan's pool is still exactly the sorted eligible peers, whatever the
    order in which left-out sets come back."""
    peers = [(i % 3, True, None, 64 if i % 7 == 0 else None) for i in range(N_PEERS)]
    me, pd, links, chain = _world(peers, 1)
    planner, table = _planner(me, pd), FrozenPeers(links)
    order = sorted(links)
    prompt = 6 * BLOCK_TOKENS + 3
    visited_sets = [frozenset(order[i : i + k]) for k in (0, 1, 2) for i in range(5)]
    for t, visited in enumerate(visited_sets + visited_sets[::-1] + visited_sets):
        inp = PlanInput(
            ns=NS, chain=chain, prompt_tokens=prompt, local_matched_tokens=0,
            local_prefill_tps=420.0, local_queue_wait_s=0.3, local_load=1.0,
            avg_request_s=0.5, hop_budget=2, visited=visited, forwarded_in=False,
            peers=table, may_look_up=False,
        )  # fmt: skip
        plan = planner.plan(inp, float(t))
        want = tuple(sorted(p for p, link in links.items() if p not in visited
                            and (link.context_tokens is None or prompt < link.context_tokens)))
        assert plan.ctx.all_peers == want
