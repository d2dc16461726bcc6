"""bench/policies.py: the baseline routing policies (simulator and swarm benchmark only).

Each baseline on small hand-built RouteContexts: ``paper`` forwards to the longest
unvisited match, ``oracle`` to the cheapest estimated peer with ties to local,
``round-robin`` cycles through self and peers, ``consistent-hash`` picks one node per first
block (rendezvous), ``random`` only known nodes, and every one serves when the hop budget is
spent. ``make_policy`` knows the deployable policies and these, and nothing else."""

from __future__ import annotations

import random

import pytest

from prefixmesh.bench import policies
from prefixmesh.overlay.core import routing
from prefixmesh.overlay.core.routing import FORWARD, Candidate, RouteContext

ME, A, B, C = b"\x00" * 32, b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32


def cand(peer: bytes, matched: int = 0, *, wait: float = 0.0) -> Candidate:
    return Candidate(peer, matched, 1000.0, wait, 0.0, 0.01)


def ctx(*cands: Candidate, prompt: int = 2000, local: int = 0, hops: int = 2, visited=(),
        first_block: bytes | None = b"h1", peers=(A, B, C)) -> RouteContext:
    return RouteContext(prompt, local, 1000.0, 0.0, 0.0, cands, hops, frozenset(visited),
                        first_block, peers)


def make(name: str, seed: int = 0):
    return policies.make_policy(name, rng=random.Random(seed), self_id=ME)


def test_names_are_the_deployable_policies_and_the_baselines_only():
    assert policies.POLICY_NAMES == (*routing.DEPLOYABLE_POLICIES, *policies.BASELINE_POLICIES)
    assert not set(policies.BASELINE_POLICIES) & set(routing.DEPLOYABLE_POLICIES)
    for name in policies.POLICY_NAMES:
        assert make(name).name == name
    with pytest.raises(routing.UnknownPolicy, match="unknown routing policy 'nope'"):
        make("nope")


def test_paper_forwards_to_the_longest_unvisited_match_else_serves():
    c = ctx(cand(A, 500), cand(B, 1500), cand(C, 1800), visited={C}, local=100)
    d = make("paper").decide(c)
    assert (d.action, d.peer) == (FORWARD, B) and d.fallbacks[:1] == (A,)
    d = make("paper").decide(ctx(cand(A, 100), local=100))  # no longer match than local
    assert d.action != FORWARD


def test_oracle_forwards_only_when_a_peer_is_cheaper():
    cheap = ctx(cand(A, 1900), cand(B, 0))
    d = make("oracle").decide(cheap)
    assert (d.action, d.peer) == (FORWARD, A) and d.est_peer_s < d.est_local_s
    assert make("oracle").decide(ctx(cand(A, 0, wait=5.0))).action != FORWARD


def test_round_robin_cycles_through_self_and_the_peers():
    p = make("round-robin")
    picks = [p.decide(ctx(hops=5)) for _ in range(8)]
    targets = [d.peer if d.action == FORWARD else ME for d in picks]
    assert targets[:4] == targets[4:] and set(targets) == {ME, A, B, C}


def test_consistent_hash_sends_a_first_block_to_one_node_wherever_it_enters():
    for block in (b"h1", b"h2", b"h3"):
        d1 = make("consistent-hash", 1).decide(ctx(first_block=block))
        d2 = make("consistent-hash", 2).decide(ctx(first_block=block))
        assert (d1.action, d1.peer) == (d2.action, d2.peer)
    assert make("consistent-hash").decide(ctx(first_block=None)).action != FORWARD


def test_random_picks_only_known_nodes():
    p = make("random", 7)
    for _ in range(30):
        d = p.decide(ctx())
        assert d.action != FORWARD or d.peer in {A, B, C}


@pytest.mark.parametrize("name", policies.BASELINE_POLICIES)
def test_every_baseline_serves_with_no_hop_budget_left(name):
    p = make(name)
    for _ in range(4):
        assert p.decide(ctx(cand(A, 1900), hops=0)).action != FORWARD
