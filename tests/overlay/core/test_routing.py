"""Tests of overlay/core/routing.py: each policy's rule, and invariants shared by all of them."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# every policy, baselines included (bench/policies.py builds them all)
from prefixmesh.bench.policies import POLICY_NAMES, make_policy
from prefixmesh.overlay.core.routing import (
    FORWARD,
    SERVE,
    Candidate,
    Decision,
    InvalidRouteContext,
    InvalidRoutingConfig,
    PlacementLedger,
    Policy,
    RentLedger,
    RouteContext,
    RoutingConfig,
    RoutingError,
    UnknownPolicy,
    candidate_cost_s,
    is_hot,
    load_bound,
    local_cost_s,
    make_candidate,
    placement_bound,
    rent_key,
)

SELF = b"self-node"
A, B, C, D = b"peer-A", b"peer-B", b"peer-C", b"peer-D"


def cand(peer: bytes, matched: int = 0, *, tps: float = 400.0, wait: float = 0.0,
         load: float = 0.0, rtt: float = 0.01, trust: float = 1.0,
         placed: float = 0.0) -> Candidate:
    return Candidate(peer, matched, tps, wait, load, rtt, trust, placed)


def ctx(*candidates: Candidate, prompt: int = 2000, local_matched: int = 0,
        local_tps: float = 400.0, local_wait: float = 0.0, local_load: float = 0.0,
        hop_budget: int = 2, visited: frozenset[bytes] = frozenset(),
        first_block: bytes | None = b"\x01" * 8, all_peers: tuple[bytes, ...] = (),
        rent: float = 0.0, placed_total: float = 0.0, placed_local: float = 0.0,
        n_nodes: int = 0, fwd_in: float = 0.0) -> RouteContext:
    return RouteContext(prompt, local_matched, local_tps, local_wait, local_load,
                        tuple(candidates), hop_budget, visited, first_block, all_peers,
                        rent_paid_s=rent, recent_placed_total=placed_total,
                        recent_placed_local=placed_local, recent_forwarded_in=fwd_in,
                        n_nodes=n_nodes)


def policy(name: str, seed: int = 0, **cfg: object) -> Policy:
    return make_policy(name, RoutingConfig(**cfg), random.Random(seed), SELF)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs", [
    {"load_epsilon": -0.1}, {"margin_s": -1.0}, {"margin_frac": 1.0}, {"margin_frac": float("nan")},
    {"trust_floor": 1.5}, {"max_fallbacks": -1}, {"max_fallbacks": 1.5},
    {"ski_rental": 1}, {"bound_placements": "yes"}, {"load_slack": -1.0},
    {"placement_slack": float("inf")}, {"placement_tau_s": 0.0},
])
def test_config_rejects_out_of_range(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRoutingConfig):
        RoutingConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_are_documented_values() -> None:
    cfg = RoutingConfig()
    assert (cfg.load_epsilon, cfg.margin_s, cfg.margin_frac, cfg.trust_floor) == (
        0.25, 0.05, 0.10, 0.2)
    assert (cfg.ski_rental, cfg.load_slack, cfg.bound_placements, cfg.placement_slack,
            cfg.placement_tau_s) == (True, 1.0, True, 1.0, 30.0)


def test_context_rejects_impossible_values() -> None:
    with pytest.raises(InvalidRouteContext, match="local_matched_tokens"):
        ctx(prompt=10, local_matched=11)
    with pytest.raises(InvalidRouteContext, match="local_prefill_tps"):
        ctx(local_tps=0.0)
    with pytest.raises(InvalidRouteContext, match="listed twice"):
        ctx(cand(A), cand(A))
    with pytest.raises(InvalidRouteContext, match="trust"):
        cand(A, trust=1.2)
    with pytest.raises(InvalidRouteContext, match="rtt_s"):
        cand(A, rtt=float("inf"))
    with pytest.raises(InvalidRouteContext, match="matched_tokens"):
        cand(A, -1)
    with pytest.raises(InvalidRouteContext, match="recent_placed"):
        cand(A, placed=-1.0)
    with pytest.raises(InvalidRouteContext, match="rent_paid_s"):
        ctx(rent=float("nan"))
    with pytest.raises(InvalidRouteContext, match="n_nodes"):
        ctx(n_nodes=-1)
    with pytest.raises(InvalidRouteContext, match="recent_placed_local"):
        ctx(placed_local=-0.5)


def test_context_freezes_collections() -> None:
    c = RouteContext(10, 0, 1.0, 0.0, 0.0, [cand(A)], 1, {B}, None, [A, B])  # type: ignore[arg-type]
    assert c.candidates == (cand(A),) and c.visited == frozenset({B}) and c.all_peers == (A, B)


def test_unknown_policy_is_a_typed_error() -> None:
    with pytest.raises(UnknownPolicy, match="no-such"):
        make_policy("no-such")
    from prefixmesh.overlay.core import routing

    with pytest.raises(UnknownPolicy, match="oracle"):  # baselines: bench/policies.py only
        routing.make_policy("oracle")
    assert issubclass(UnknownPolicy, RoutingError)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_name_makes_a_policy(name: str) -> None:
    p = make_policy(name)
    assert isinstance(p, Policy) and p.name == name
    d = p.decide(ctx(cand(A, 1000)))
    assert d.action in (SERVE, FORWARD) and d.reason.startswith(name)


def test_decision_checks_its_own_shape() -> None:
    with pytest.raises(RoutingError):
        Decision(FORWARD, None, "", 1.0, None, ())
    with pytest.raises(RoutingError):
        Decision(SERVE, A, "", 1.0, None, ())
    with pytest.raises(RoutingError):
        Decision(FORWARD, A, "", 1.0, 0.5, (A,))


# ----------------------------------------------------------------------- cost model


def test_cost_model_formulas() -> None:
    c = ctx(cand(A, 1200, tps=500.0, wait=0.2, rtt=0.03, trust=0.5),
            local_matched=400, local_wait=1.0)
    assert local_cost_s(c) == pytest.approx(1600 / 400 + 1.0)
    assert candidate_cost_s(c, c.candidates[0]) == pytest.approx((2000 - 600) / 500 + 0.23)
    assert candidate_cost_s(c, c.candidates[0], use_trust=False) == pytest.approx(800 / 500 + 0.23)


def test_unknown_peer_prefill_rate_falls_back_to_local_rate() -> None:
    c = ctx(cand(A, 0, tps=0.0, rtt=0.0), local_tps=250.0)
    assert candidate_cost_s(c, c.candidates[0]) == pytest.approx(2000 / 250)


def test_load_bound_counts_the_request_and_rounds_to_whole_requests() -> None:
    # loads 1 (local), 1, 1, 1, 6: mean with the request = 11/5 = 2.2; 1.25 * 2.2 = 2.75
    # -> ceil 3 requests after placement -> a candidate may carry at most 2 now.
    c = ctx(cand(A, load=1), cand(B, load=1), cand(C, load=1), cand(D, load=6), local_load=1)
    assert load_bound(c, 0.25) == 2
    # Two idle nodes: the peer may carry 0 (and will carry the 1 request placed).
    assert load_bound(ctx(cand(A)), 0.25) == 0
    # Local idle, the peer carrying one request is still eligible.
    assert load_bound(ctx(cand(A, load=1)), 0.25) == 1
    # 1.25 * 4.0 is exactly 5: float noise must not grant a sixth request.
    c4 = ctx(cand(A, load=3), cand(B, load=3), cand(C, load=3), local_load=6)
    assert load_bound(c4, 0.25) == 4


# ----------------------------------------------------------------------- prefixmesh


def test_prefixmesh_forwards_when_match_saves_more_than_rtt_and_margin() -> None:
    d = policy("prefixmesh").decide(ctx(cand(A, 1600, rtt=0.02), cand(B, 320, rtt=0.02)))
    assert d.action == FORWARD and d.peer == A
    assert d.est_local_s == pytest.approx(5.0)
    assert d.est_peer_s == pytest.approx(400 / 400 + 0.02)
    assert d.fallbacks == (B,)  # B also pays: saves 0.78 s
    assert "forward to" in d.reason and "1600 tok" in d.reason


def test_prefixmesh_serves_when_rtt_eats_the_saving() -> None:
    # The match saves 64/400 = 0.16 s of prefill; a 500 ms link makes forwarding a loss.
    d = policy("prefixmesh").decide(ctx(cand(A, 64, rtt=0.5), prompt=200))
    assert d.action == SERVE and d.peer is None and d.fallbacks == ()
    assert d.est_local_s == pytest.approx(0.5) and "saves" in d.reason


def test_prefixmesh_margin_blocks_small_savings() -> None:
    # saving = 32/400 - 0.01 = 0.07 s; required = 0.05 + 0.1 * 0.5 = 0.10 s.
    p = policy("prefixmesh")
    assert p.decide(ctx(cand(A, 32), prompt=200)).action == SERVE
    # With no margin the same saving is worth a hop.
    p0 = policy("prefixmesh", margin_s=0.0, margin_frac=0.0)
    assert p0.decide(ctx(cand(A, 32), prompt=200)).action == FORWARD


def test_prefixmesh_excludes_hot_node_that_paper_picks() -> None:
    hot = cand(A, 1900, load=8, wait=0.0)  # longest match, but far above its share
    warm = cand(B, 1500, load=1)
    c = ctx(hot, warm, cand(C, 0, load=1), local_load=1)
    assert load_bound(c, 0.25) < 8
    d = policy("prefixmesh").decide(c)
    assert d.action == FORWARD and d.peer == B and A not in d.fallbacks
    assert "1 over load bound" in d.reason
    assert policy("paper").decide(c).peer == A  # the reference rule has no load awareness


def test_prefixmesh_sheds_load_to_idle_peer_without_cache_gain() -> None:
    # Local queue wait dominates: an idle peer with no match wins on cost alone.
    c = ctx(cand(A, 0, wait=0.0, load=0), local_wait=20.0, local_load=2)
    d = policy("prefixmesh").decide(c)
    assert d.action == FORWARD and d.peer == A
    assert d.est_peer_s == pytest.approx(5.01)


def test_prefixmesh_trust_discounts_and_floor_excludes() -> None:
    # Trust 0.5 halves the claimed 1600-token match: A's cost 3.01 s vs B's honest 1000 -> 2.51 s.
    c = ctx(cand(A, 1600, trust=0.5), cand(B, 1000))
    assert policy("prefixmesh").decide(c).peer == B
    # Under the floor the liar is not even a fallback.
    c2 = ctx(cand(A, 2000, trust=0.1), cand(B, 1000))
    d = policy("prefixmesh").decide(c2)
    assert d.peer == B and d.fallbacks == () and "1 under trust floor" in d.reason


def test_prefixmesh_respects_hop_budget_and_visited() -> None:
    p = policy("prefixmesh")
    d = p.decide(ctx(cand(A, 2000), hop_budget=0))
    assert d.action == SERVE and "hop budget" in d.reason
    d = p.decide(ctx(cand(A, 2000), cand(B, 1500), visited=frozenset({A})))
    assert d.peer == B
    d = p.decide(ctx(cand(A, 2000), cand(SELF, 2000), visited=frozenset({A})))
    assert d.action == SERVE


def test_prefixmesh_tie_break_is_seeded() -> None:
    c = ctx(cand(A, 1600), cand(B, 1600), cand(C, 1600))
    picks = {policy("prefixmesh", seed=s).decide(c).peer for s in range(40)}
    assert picks == {A, B, C}
    for s in range(5):
        assert policy("prefixmesh", seed=s).decide(c) == policy("prefixmesh", seed=s).decide(c)


def test_prefixmesh_max_fallbacks() -> None:
    cands = [cand(bytes([65 + i]) * 4, 1800 - 10 * i) for i in range(6)]
    d = policy("prefixmesh", max_fallbacks=2).decide(ctx(*cands))
    assert d.peer == cands[0].peer and d.fallbacks == (cands[1].peer, cands[2].peer)


# ----------------------------------------------------------------------- paper, oracle


def test_paper_longest_match_wins_ties_to_local() -> None:
    p = policy("paper")
    assert p.decide(ctx(cand(A, 800), cand(B, 1200, rtt=5.0), local_matched=400)).peer == B
    d = p.decide(ctx(cand(A, 400), local_matched=400))
    assert d.action == SERVE
    d = p.decide(ctx(cand(A, 800), cand(B, 1200), cand(C, 600), local_matched=700))
    assert d.peer == B and d.fallbacks == (A,)
    assert p.decide(ctx(cand(B, 1200), hop_budget=0)).action == SERVE


def test_oracle_minimises_cost_without_margin_or_trust() -> None:
    p = policy("oracle")
    # Saves 0.07 s: prefixmesh's margin refuses, the oracle takes it.
    assert p.decide(ctx(cand(A, 32), prompt=200)).peer == A
    # Trust is ignored: the oracle's caller gives exact matches.
    assert p.decide(ctx(cand(A, 1600, trust=0.1), cand(B, 1000))).peer == A
    # Exact tie with local -> serve.
    assert p.decide(ctx(cand(A, 4, rtt=0.01), prompt=200, local_tps=400.0)).action == SERVE
    d = p.decide(ctx(cand(A, 1000, load=50, wait=0.1), cand(B, 900, wait=0.0), local_wait=3.0))
    assert d.peer == A and d.fallbacks == (B,)


# ----------------------------------------------------------------------- baselines


def test_local_always_serves() -> None:
    d = policy("local").decide(ctx(cand(A, 2000)))
    assert d.action == SERVE and d.est_local_s == pytest.approx(5.0)


def test_round_robin_cycles_self_then_sorted_pool() -> None:
    p = policy("round-robin")
    c = ctx(all_peers=(C, A, B))
    got = [p.decide(c).peer for _ in range(8)]
    assert got == [None, A, B, C, None, A, B, C]
    # Without all_peers the candidates form the pool.
    p2 = policy("round-robin")
    assert [p2.decide(ctx(cand(B), cand(A))).peer for _ in range(3)] == [None, A, B]


def test_round_robin_falls_back_to_local_for_visited_or_no_budget() -> None:
    p = policy("round-robin")
    p.decide(ctx(all_peers=(A,)))  # self's turn
    d = p.decide(ctx(all_peers=(A,), visited=frozenset({A})))
    assert d.action == SERVE and "visited" in d.reason
    p.decide(ctx(all_peers=(A,)))
    d = p.decide(ctx(all_peers=(A,), hop_budget=0))
    assert d.action == SERVE and "hop budget" in d.reason


def test_random_is_seeded_and_covers_the_ring() -> None:
    c = ctx(all_peers=(A, B, C))
    p1, p2 = policy("random", seed=7), policy("random", seed=7)
    seq1 = [p1.decide(c).peer for _ in range(50)]
    seq2 = [p2.decide(c).peer for _ in range(50)]
    assert seq1 == seq2 and set(seq1) == {None, A, B, C}


def test_consistent_hash_agrees_across_nodes_and_handles_no_block() -> None:
    members = (SELF, A, B, C, D)
    for i in range(30):
        key = i.to_bytes(8, "little")
        targets = set()
        for me in members:
            d = make_policy("consistent-hash", self_id=me).decide(
                ctx(first_block=key, all_peers=members))
            targets.add(me if d.action == SERVE else d.peer)
        assert len(targets) == 1  # every member sends the key to the same owner
    d = policy("consistent-hash").decide(ctx(first_block=None, all_peers=(A, B)))
    assert d.action == SERVE and "no whole block" in d.reason


def test_consistent_hash_fallbacks_stop_at_self_and_skip_visited() -> None:
    from prefixmesh.overlay.core.routing import rendezvous_score

    members = (A, B, C, D)
    for i in range(50):
        key = i.to_bytes(8, "little")
        ranked = sorted((SELF, *members), key=lambda n: (-rendezvous_score(key, n), n))
        d = policy("consistent-hash").decide(
            ctx(first_block=key, all_peers=members, visited=frozenset({D})))
        if ranked[0] == SELF or ranked[0] == D:
            assert d.action == SERVE
            continue
        assert d.peer == ranked[0]
        expected = [p for p in ranked[1:ranked.index(SELF)] if p != D][:3]
        assert list(d.fallbacks) == expected


# ----------------------------------------------------------------------- properties

PEERS = [bytes([0x50, i]) for i in range(8)]


@st.composite
def contexts(draw: st.DrawFn) -> RouteContext:
    prompt = draw(st.integers(0, 4000))
    local_matched = draw(st.integers(0, prompt))
    peers = draw(st.lists(st.sampled_from(PEERS + [SELF]), unique=True, max_size=7))
    cands = tuple(
        Candidate(
            p,
            draw(st.integers(0, prompt + 32)),
            draw(st.sampled_from([0.0, 100.0, 400.0, 2000.0])),
            draw(st.floats(0, 30)),
            float(draw(st.integers(0, 12))),
            draw(st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.5])),
            draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])),
            draw(st.floats(0, 20)),
        )
        for p in peers
    )
    visited = frozenset(draw(st.lists(st.sampled_from(PEERS), max_size=4)))
    all_peers = tuple(draw(st.lists(st.sampled_from(PEERS), unique=True, max_size=8)))
    return RouteContext(
        prompt, local_matched, draw(st.sampled_from([50.0, 400.0, 1000.0])),
        draw(st.floats(0, 30)), float(draw(st.integers(0, 12))), cands,
        draw(st.integers(-1, 3)), visited,
        draw(st.one_of(st.none(), st.binary(min_size=8, max_size=8))), all_peers,
        rent_paid_s=draw(st.sampled_from([0.0, 0.01, 0.5, 3.0])),
        recent_placed_total=draw(st.floats(0, 60)), recent_placed_local=draw(st.floats(0, 20)),
        recent_forwarded_in=draw(st.floats(0, 20)), n_nodes=draw(st.integers(0, 9)),
    )


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(POLICY_NAMES), seed=st.integers(0, 2**32),
       ctxs=st.lists(contexts(), min_size=1, max_size=6))
def test_every_policy_respects_visited_budget_and_is_deterministic(
    name: str, seed: int, ctxs: list[RouteContext]
) -> None:
    p1, p2 = policy(name, seed), policy(name, seed)
    for c in ctxs:
        d = p1.decide(c)
        assert d == p2.decide(c)  # same seed, same sequence -> same decisions
        if d.action == SERVE:
            assert d.peer is None and d.fallbacks == ()
            continue
        assert c.hop_budget > 0
        assert d.peer not in c.visited and d.peer != SELF
        assert len(set(d.fallbacks)) == len(d.fallbacks) <= RoutingConfig().max_fallbacks
        for f in d.fallbacks:
            assert f not in c.visited and f != d.peer and f != SELF


@settings(max_examples=100, deadline=None)
@given(c=contexts(), seed=st.integers(0, 2**32))
def test_prefixmesh_only_forwards_to_eligible_paying_candidates(c: RouteContext, seed: int) -> None:
    cfg = RoutingConfig()
    d = policy("prefixmesh", seed).decide(c)
    local = local_cost_s(c)
    assert d.est_local_s == pytest.approx(local)
    bound = load_bound(c, cfg.load_epsilon, cfg.load_slack)
    placed = placement_bound(c, cfg.load_epsilon, cfg.placement_slack)
    shedding = is_hot(c, cfg.load_epsilon, cfg.placement_slack)
    required = cfg.margin_s + cfg.margin_frac * local
    need = -cfg.margin_s if shedding else required
    by_peer = {x.peer: x for x in c.candidates}
    eligible = [
        x for x in c.candidates
        if x.peer not in c.visited and x.peer != SELF and x.trust >= cfg.trust_floor
        and x.load <= bound and x.recent_placed <= placed
    ]
    paying = [x for x in eligible if local - candidate_cost_s(c, x) > need]
    if d.action == SERVE:
        if c.hop_budget > 0 and paying:
            # the only other reason to serve: ski rental bought the prefix
            assert "ski rental" in d.reason
            low = min(candidate_cost_s(c, x) for x in paying)
            assert any(
                c.rent_paid_s + x.rtt_s >= local - (candidate_cost_s(c, x) - x.rtt_s)
                for x in paying
                if candidate_cost_s(c, x) == pytest.approx(low) and x.matched_tokens > c.local_matched_tokens
                and local - candidate_cost_s(c, x) > required
            )
        return
    chosen = by_peer[d.peer]  # type: ignore[index]
    assert chosen in paying
    assert chosen.load <= bound  # never over the load bound
    assert chosen.recent_placed <= placed  # nor over this router's placement bound
    assert d.est_peer_s == pytest.approx(candidate_cost_s(c, chosen))
    assert d.est_peer_s == pytest.approx(min(candidate_cost_s(c, x) for x in paying))
    for f in d.fallbacks:
        assert by_peer[f] in paying


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(16, 4000), data=st.data(),
       tps=st.sampled_from([100.0, 400.0, 1500.0]), rtt=st.floats(0, 1.0),
       wait=st.floats(0, 5.0))
def test_prefixmesh_forwards_iff_saving_beats_rtt_plus_margin(
    prompt: int, data: st.DataObject, tps: float, rtt: float, wait: float
) -> None:
    local_matched = data.draw(st.integers(0, prompt))
    peer_matched = data.draw(st.integers(0, prompt))
    c = ctx(cand(A, peer_matched, tps=tps, wait=wait, rtt=rtt), prompt=prompt,
            local_matched=local_matched, local_tps=tps, local_wait=wait)
    cfg = RoutingConfig()
    saving = (peer_matched - local_matched) / tps - rtt
    required = cfg.margin_s + cfg.margin_frac * local_cost_s(c)
    d = policy("prefixmesh").decide(c)
    if saving > required + 1e-9:
        assert d.action == FORWARD and d.peer == A
    elif saving < required - 1e-9:
        assert d.action == SERVE


def test_prefixmesh_huge_rtt_never_forwards_small_saving() -> None:
    for matched in range(0, 160, 16):  # saves at most 0.4 s of prefill
        d = policy("prefixmesh").decide(ctx(cand(A, matched, rtt=0.5), prompt=200))
        assert d.action == SERVE


# ----------------------------------------------------------------------- ski rental


def test_ski_rental_buys_once_rent_reaches_one_local_miss() -> None:
    # Peer holds 1600 of 2000 tokens: local 5.0 s, peer 1.0 + 0.5 rtt = 1.5 s.
    # Buying (serving the miss here) costs local - (peer - rtt) = 4.0 s of extra prefill.
    peer = cand(A, 1600, rtt=0.5)
    p = policy("prefixmesh")
    assert p.decide(ctx(peer, rent=0.0)).action == FORWARD
    assert p.decide(ctx(peer, rent=3.49)).action == FORWARD  # 3.49 + 0.5 < 4.0
    d = p.decide(ctx(peer, rent=3.5))  # 3.5 + 0.5 >= 4.0: buy
    assert d.action == SERVE and "ski rental" in d.reason
    assert policy("prefixmesh", ski_rental=False).decide(ctx(peer, rent=100.0)).action == FORWARD


def test_ski_rental_never_buys_for_a_load_shedding_forward() -> None:
    # The peer matches nothing more than local: forwarding sheds queue wait, not rent.
    c = ctx(cand(A, 0, wait=0.0), local_wait=20.0, local_load=2, rent=1000.0)
    assert policy("prefixmesh").decide(c).peer == A


def test_rent_key_is_the_deepest_claimed_block() -> None:
    chain = [bytes([i]) * 8 for i in range(1, 6)]
    assert rent_key(chain, []) is None
    assert rent_key(chain, [cand(A, 15)]) is None  # no whole block
    assert rent_key(chain, [cand(A, 16), cand(B, 47)]) == chain[1]
    assert rent_key(chain, [cand(A, 10_000)]) == chain[-1]  # capped at the chain


def test_rent_ledger_pays_settles_ages_and_is_bounded() -> None:
    led = RentLedger(max_entries=2, max_age_s=10.0)
    k1, k2, k3 = b"k1", b"k2", b"k3"
    assert led.paid(k1, 0.0) == 0.0 and led.paid(None, 0.0) == 0.0
    assert led.pay(k1, 0.5, 0.0) == 0.5
    assert led.pay(k1, 0.5, 1.0) == 1.0
    assert led.paid(k1, 11.0) == 1.0
    assert led.paid(k1, 11.5) == 0.0  # untouched for longer than max_age_s
    led.pay(k2, 0.1, 2.0)
    led.pay(k3, 0.1, 3.0)  # evicts the least recently touched: k1
    assert len(led) == 2 and led.paid(k1, 3.0) == 0.0 and led.paid(k2, 3.0) == 0.1
    led.settle(k2)
    assert led.paid(k2, 3.0) == 0.0 and len(led) == 1
    with pytest.raises(RoutingError):
        RentLedger(max_entries=0)
    with pytest.raises(RoutingError):
        led.pay(k1, -1.0, 4.0)


def test_rent_ledger_observe_books_forwards_and_clears_on_serve() -> None:
    led = RentLedger()
    key = b"prefix-k"
    c = ctx(cand(A, 1600, rtt=0.5), cand(B, 0, rtt=0.25), local_matched=0)
    led.observe(key, c, Decision(FORWARD, A, "", 5.0, 1.5), 0.0)
    assert led.paid(key, 0.0) == 0.5
    led.observe(key, c, Decision(FORWARD, B, "", 5.0, 5.25), 0.0)  # B claims no more: no rent
    assert led.paid(key, 0.0) == 0.5
    led.observe(None, c, Decision(FORWARD, A, "", 5.0, 1.5), 0.0)  # no key: nothing
    led.observe(key, c, Decision(SERVE, None, "", 5.0, None), 0.0)  # served here = bought
    assert led.paid(key, 0.0) == 0.0 and len(led) == 0


def test_rent_loop_reaches_the_break_even_and_then_stays_local() -> None:
    # A router seeing the same prefix again and again forwards until the rent paid
    # reaches the buy price, then serves it (and would cache it) - the 2-competitive rule.
    led, p, key = RentLedger(), policy("prefixmesh"), b"k"
    actions = []
    for i in range(12):
        c = ctx(cand(A, 1600, rtt=0.5), rent=led.paid(key, float(i)))
        d = p.decide(c)
        led.observe(key, c, d, float(i))
        actions.append(d.action)
    # buy price 4.0 s at 0.5 s per forward: 7 forwards (3.5 s), the 8th buys.
    assert actions[:8] == [FORWARD] * 7 + [SERVE]
    assert actions[8] == FORWARD  # a new rental period (the sim's cache makes it a hit)


# ----------------------------------------------------------------------- load slack


def test_load_slack_keeps_a_busy_long_match_eligible_in_a_small_swarm() -> None:
    # Three nodes, loads (0, 1, 0): the rounded bound is 0, so without slack the peer
    # with one running request is excluded although it holds most of the prompt.
    holder, idle = cand(A, 1900, load=1), cand(B, 0, load=0)
    c = ctx(holder, idle)
    assert load_bound(c, 0.25) == 0
    assert load_bound(c, 0.25, 1.0) == pytest.approx(1 / 3 + 1)
    assert policy("prefixmesh", load_slack=0.0).decide(c).action == SERVE
    assert policy("prefixmesh").decide(c).peer == A
    # slack never lowers the rounded bound
    even = ctx(cand(A, load=3), cand(B, load=3), cand(C, load=3), local_load=3)
    assert load_bound(even, 0.25) == load_bound(even, 0.25, 0.5) == 4  # ceil(4.06) - 1 > 3.5


# ----------------------------------------------------------------------- placement bound


def test_placement_bound_formula() -> None:
    assert placement_bound(ctx(), 0.25) == float("inf")  # no ledger: no bound
    # 8 nodes, 15 recent placements: mean with the request 2.0; ceil(2.5) - 1 = 2; slack 1 -> 3
    c = ctx(placed_total=15.0, n_nodes=8)
    assert placement_bound(c, 0.25) == 2
    assert placement_bound(c, 0.25, 1.0) == 3.0
    c2 = ctx(placed_total=79.0, n_nodes=8)  # mean 10: ceil(12.5) - 1 = 12 > 10 + 1
    assert placement_bound(c2, 0.25, 1.0) == 12


def test_placement_bound_excludes_a_peer_this_router_has_fed_too_much() -> None:
    hot, other = cand(A, 1900, placed=6.0), cand(B, 1500, placed=1.0)
    c = ctx(hot, other, placed_total=15.0, placed_local=2.0, n_nodes=8)  # bound 3
    d = policy("prefixmesh").decide(c)
    assert d.peer == B and "1 over placement bound" in d.reason
    assert policy("prefixmesh", bound_placements=False).decide(c).peer == A
    assert policy("prefixmesh").decide(ctx(hot, other)).peer == A  # n_nodes 0: no ledger


def test_is_hot_compares_forwards_in_with_forwards_out() -> None:
    assert not is_hot(ctx(fwd_in=100.0), 0.25)  # no ledger
    # 10 placements, 4 served here -> 6 sent out; 1.25 * 6 + 1 = 8.5
    base = {"placed_total": 10.0, "placed_local": 4.0, "n_nodes": 4}
    assert not is_hot(ctx(fwd_in=8.5, **base), 0.25, 1.0)
    assert is_hot(ctx(fwd_in=8.6, **base), 0.25, 1.0)
    assert is_hot(ctx(fwd_in=1.1, placed_total=3.0, placed_local=3.0, n_nodes=4), 0.25, 1.0)


def test_hot_node_sheds_to_an_equal_peer_but_not_to_a_worse_one() -> None:
    # Local and A both hold the prompt; serving here is cheaper by the RTT only.
    equal = cand(A, 1900, rtt=0.01)
    load = {"local_matched": 1900, "placed_total": 15.0, "placed_local": 9.0, "n_nodes": 8}
    assert policy("prefixmesh").decide(ctx(equal, fwd_in=2.0, **load)).action == SERVE
    d = policy("prefixmesh").decide(ctx(equal, fwd_in=20.0, **load))
    assert d.peer == A and "shedding" in d.reason
    assert policy("prefixmesh", bound_placements=False).decide(
        ctx(equal, fwd_in=20.0, **load)).action == SERVE
    # ... never to a peer worse than local by more than margin_s (a miss, or a far peer)
    for worse in (cand(A, 0), cand(A, 1900, rtt=0.2)):
        assert policy("prefixmesh").decide(ctx(worse, fwd_in=20.0, **load)).action == SERVE
    # ... and never to one over this router's placement bound (bound 2 + slack 1 = 3)
    fed = cand(A, 1900, rtt=0.01, placed=5.0)
    assert policy("prefixmesh").decide(ctx(fed, fwd_in=20.0, **load)).action == SERVE


def test_placement_ledger_decays_exponentially_and_is_bounded() -> None:
    led = PlacementLedger(tau_s=10.0, max_entries=2)
    led.record_inbound(0.0)
    led.record_inbound(10.0)
    assert led.inbound(10.0) == pytest.approx(math.exp(-1.0) + 1.0)
    led.record(A, 0.0)
    led.record(A, 0.0)
    led.record(B, 5.0)
    assert led.recent(A, 0.0) == pytest.approx(2.0)
    assert led.recent(A, 10.0) == pytest.approx(2.0 * math.exp(-1.0))
    assert led.total(10.0) == pytest.approx(2.0 * math.exp(-1.0) + math.exp(-0.5))
    assert led.recent(C, 10.0) == 0.0
    led.record(C, 6.0)  # a third node: the least recently placed (A) is dropped
    assert len(led) == 2 and led.recent(A, 6.0) == 0.0
    # time running backwards is treated as no time passing
    led.record(B, 1.0)
    assert led.recent(B, 6.0) == pytest.approx(math.exp(-0.1) + 1.0)
    with pytest.raises(RoutingError):
        PlacementLedger(tau_s=0.0)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(PEERS[:4]), st.floats(0, 5)), max_size=40))
def test_placement_ledger_total_is_the_sum_of_its_nodes(events: list[tuple[bytes, float]]) -> None:
    led, now = PlacementLedger(tau_s=7.0), 0.0
    for node, dt in events:
        now += dt
        led.record(node, now)
    later = now + 3.0
    assert led.total(later) == pytest.approx(sum(led.recent(p, later) for p in PEERS[:4]))
    assert led.total(later) <= len(events)


# ----------------------------------------------------------------------- router memory

_step = st.tuples(
    st.floats(0.0, 5.0),  # time advance
    st.booleans(),  # forwarded in from a peer
    st.lists(st.tuples(st.sampled_from([A, B, C, D]), st.integers(0, 64),
                       st.floats(0.001, 1.0)), max_size=4, unique_by=lambda t: t[0]),
    st.integers(0, 64),  # local match
)


@settings(max_examples=75, deadline=None)
@given(steps=st.lists(_step, min_size=1, max_size=25))
def test_router_memory_equals_the_documented_call_sequence(steps) -> None:
    """RouterMemory.decide (what the node and the simulator call) makes exactly the
    decisions of the hand-written sequence in docs/ARCHITECTURE.md: record_inbound,
    recent_placed per candidate, rent key, context, decide, rent.observe, record."""
    from prefixmesh.overlay.core.routing import PlacementLedger, RouterMemory

    chain = [bytes([i]) * 8 for i in range(4)]
    mem = RouterMemory(SELF, block_tokens=16)
    p1, p2 = policy("prefixmesh", seed=3), policy("prefixmesh", seed=3)
    rent, placements = RentLedger(), PlacementLedger()
    now = 0.0
    for advance, forwarded_in, cands, local in steps:
        now += advance
        base = [cand(peer, matched, rtt=rtt) for peer, matched, rtt in cands]
        got_ctx, got = mem.decide(
            p1, now=now, chain=chain, prompt_tokens=64, local_matched_tokens=local,
            local_prefill_tps=400.0, local_queue_wait_s=0.0, local_load=0.0,
            candidates=base, hop_budget=2, visited=frozenset(), n_nodes=5,
            forwarded_in=forwarded_in)
        if forwarded_in:
            placements.record_inbound(now)
        full = [cand(c.peer, c.matched_tokens, rtt=c.rtt_s, placed=placements.recent(c.peer, now))
                for c in base]
        key = rent_key(chain, full)
        want_ctx = ctx(*full, prompt=64, local_matched=local, rent=rent.paid(key, now),
                       placed_total=placements.total(now),
                       placed_local=placements.recent(SELF, now),
                       fwd_in=placements.inbound(now), n_nodes=5, first_block=chain[0])
        want = p2.decide(want_ctx)
        rent.observe(key, want_ctx, want, now)
        placements.record(want.peer or SELF, now)
        assert got_ctx == want_ctx
        assert (got.action, got.peer, got.fallbacks) == (want.action, want.peer, want.fallbacks)


def test_router_memory_disabled_leaves_every_ledger_field_zero() -> None:
    from prefixmesh.overlay.core.routing import RouterMemory

    mem = RouterMemory(SELF, enabled=False)
    for i in range(3):
        c, d = mem.decide(policy("round-robin"), now=float(i), chain=[b"k" * 8],
                          prompt_tokens=32, local_matched_tokens=0, local_prefill_tps=400.0,
                          local_queue_wait_s=0.0, local_load=0.0,
                          candidates=[cand(A, 32)], hop_budget=2, visited=(), n_nodes=4,
                          forwarded_in=True, all_peers=(A, B))
        assert (c.rent_paid_s, c.recent_placed_total, c.recent_forwarded_in, c.n_nodes) == (
            0.0, 0.0, 0.0, 0)
        assert c.candidates[0].recent_placed == 0.0
    assert len(mem.placements) == 0 and len(mem.rent) == 0


_number_st = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(),
    st.sampled_from([0.0, -0.0, 1.0, 0.5, 420.0]),
)


@settings(max_examples=300, deadline=None)
@given(peer=st.one_of(st.binary(min_size=1, max_size=4), st.text(max_size=2)),
       matched=st.one_of(st.integers(-2, 10_000), st.floats(0, 10), st.booleans()),
       values=st.tuples(_number_st, _number_st, _number_st, _number_st, _number_st))
def test_make_candidate_is_the_validating_constructor(peer, matched, values) -> None:
    """The planner's fast constructor builds exactly ``Candidate(...)``, and refuses
    exactly what it refuses, with the same error."""
    args = (peer, matched, *values)
    try:
        expected = Candidate(*args)
    except InvalidRouteContext as exc:
        with pytest.raises(InvalidRouteContext) as got:
            make_candidate(*args)
        assert str(got.value) == str(exc)
        return
    made = make_candidate(*args)
    assert made == expected and repr(made) == repr(expected)
    assert all(type(getattr(made, f)) is type(getattr(expected, f)) for f in vars(expected))
    assert made.recent_placed == 0.0
