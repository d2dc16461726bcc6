"""overlay/core/planner.py and relayed links (issue 16): a link through a relay is charged
the relay's extra RTT in its candidate's cost; all-direct inputs plan as before (the
recorded swarm trace in test_planner_differential.py checks that on real decisions)."""

from __future__ import annotations

import random

from _planner_stub import StubView
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.planner import (
    DEFAULT_RTT_S,
    RELAY_EXTRA_RTT_S,
    Forward,
    PeerLink,
    PlanInput,
    Planner,
    Serve,
    link_cost_s,
)
from prefixmesh.overlay.core.routing import make_policy

ME = b"me"
NS = b"n" * 8
CHAIN = tuple(bytes([i]) * 8 for i in range(40))


def _plan(links: dict, matches: dict, *, local_matched: int = 0, seed: int = 0):
    planner = Planner(ME, make_policy("prefixmesh", rng=random.Random(seed), self_id=ME), StubView(matches),
                      rng=random.Random(seed))
    inp = PlanInput(
        ns=NS, chain=CHAIN, prompt_tokens=len(CHAIN) * 16, local_matched_tokens=local_matched,
        local_prefill_tps=500.0, local_queue_wait_s=0.0, local_load=0.0, avg_request_s=1.0,
        hop_budget=2, visited=frozenset({ME}), forwarded_in=False, peers=links,
        may_serve_here=True)
    return planner.plan(inp, 0.0)


@given(st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_link_cost_adds_the_relay_extra(rtt):
    direct = link_cost_s(PeerLink(rtt_s=rtt))
    assert direct == (rtt if rtt is not None else DEFAULT_RTT_S)
    assert link_cost_s(PeerLink(rtt_s=rtt, relayed=True)) == direct + RELAY_EXTRA_RTT_S


def test_of_two_equal_holders_the_direct_one_is_chosen():
    for direct, relayed in ((b"a", b"b"), (b"b", b"a")):  # whatever the id order
        links = {direct: PeerLink(rtt_s=0.004, load=0.0),
                 relayed: PeerLink(rtt_s=0.004, load=0.0, relayed=True)}
        plan = _plan(links, {b"a": 20, b"b": 20})
        assert isinstance(plan, Forward) and plan.targets[0] == direct, plan
        cands = {c.peer: c.rtt_s for c in plan.ctx.candidates}
        assert cands[relayed] == cands[direct] + RELAY_EXTRA_RTT_S


def test_a_relayed_holder_of_a_long_prefix_still_beats_a_cold_prefill():
    """The relay costs tens of ms; prefilling 640 tokens here costs over a second."""
    plan = _plan({b"home": PeerLink(rtt_s=0.03, load=0.0, relayed=True)}, {b"home": 40})
    assert isinstance(plan, Forward) and plan.targets[0] == b"home"


def test_a_relayed_holder_of_almost_nothing_is_not_worth_it():
    plan = _plan({b"home": PeerLink(rtt_s=0.03, load=0.0, relayed=True)}, {b"home": 1},
                 local_matched=16)
    assert isinstance(plan, Serve)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0005, 0.05), st.integers(0, 40)), min_size=1, max_size=5),
       st.integers(0, 2**16))
def test_all_direct_plans_are_those_of_links_without_the_flag(peers, seed):
    """``relayed=False`` is the default: the same links plan the same, decision for
    decision (the planner's outputs for all-direct inputs are unchanged)."""
    ids = [bytes([65 + i]) for i in range(len(peers))]
    matches = {p: m for p, (_, m) in zip(ids, peers, strict=True) if m}
    plain = {p: PeerLink(rtt_s=r, load=0.0) for p, (r, _) in zip(ids, peers, strict=True)}
    flagged = {p: PeerLink(rtt_s=r, load=0.0, relayed=False)
               for p, (r, _) in zip(ids, peers, strict=True)}
    a, b = _plan(plain, matches, seed=seed), _plan(flagged, matches, seed=seed)
    assert type(a) is type(b) and a.reason == b.reason
    assert getattr(a, "targets", None) == getattr(b, "targets", None)
