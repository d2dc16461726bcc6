"""overlay/core/planner.py: the context-length rule (a prompt no node fits is refused before
routing; a peer too small for the prompt is never a candidate). The planner's other rules
are exercised by test_planner_differential.py and test_routing.py."""

from __future__ import annotations

from _planner_stub import StubView
from hypothesis import given
from hypothesis import strategies as st

from prefixmesh.overlay.core.planner import (
    Forward,
    PeerLink,
    PlanInput,
    Planner,
    Reject,
    Serve,
    fits_context,
)
from prefixmesh.overlay.core.routing import make_policy

ME, SMALL, BIG = b"me", b"small", b"big"
NS = b"n" * 8
CHAIN = tuple(bytes([i]) * 8 for i in range(40))


def _plan(prompt_tokens: int, *, here: bool, context: int | None, peers: dict):
    planner = Planner(ME, make_policy("prefixmesh", self_id=ME),
                      StubView({p: len(CHAIN) for p in peers}))
    inp = PlanInput(
        ns=NS, chain=CHAIN, prompt_tokens=prompt_tokens, local_matched_tokens=0,
        local_prefill_tps=500.0, local_queue_wait_s=0.0, local_load=0.0, avg_request_s=1.0,
        hop_budget=2, visited=frozenset({ME}), forwarded_in=False,
        peers={p: PeerLink(rtt_s=0.001, load=0.0, context_tokens=c) for p, c in peers.items()},
        may_serve_here=here, context_tokens=context)
    return planner.plan(inp, 0.0)


def test_a_prompt_that_fits_no_node_is_refused_before_routing():
    plan = _plan(3000, here=False, context=2048, peers={SMALL: 512, BIG: 2048})
    assert isinstance(plan, Reject) and plan.code == "context_length_exceeded"


def test_a_prompt_too_long_here_goes_to_the_peer_it_fits():
    plan = _plan(1000, here=False, context=2048, peers={SMALL: 512, BIG: 2048})
    assert isinstance(plan, Forward) and plan.targets[0] == BIG
    assert SMALL not in plan.targets


def test_a_peer_that_did_not_say_its_context_stays_a_candidate():
    plan = _plan(1000, here=False, context=None, peers={BIG: None})
    assert isinstance(plan, Forward) and plan.targets[0] == BIG


def test_a_prompt_that_fits_here_is_still_served_here_when_peers_are_small():
    plan = _plan(400, here=True, context=1024, peers={SMALL: 256})
    assert isinstance(plan, Serve)


@given(st.integers(0, 5000), st.one_of(st.none(), st.integers(1, 5000)))
def test_fits_context_leaves_a_free_position(prompt, ctx):
    assert fits_context(prompt, ctx) == (ctx is None or prompt < ctx)
