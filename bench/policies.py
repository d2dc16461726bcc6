"""Baseline routing policies, for the simulator and the swarm benchmark only.

``paper``, ``round-robin``, ``random``, ``consistent-hash`` and ``oracle`` (described in
``overlay/core/routing.py``'s module docstring) are references to measure ``prefixmesh``
against, not policies a node should run: ``node/config.py`` accepts only
``routing.DEPLOYABLE_POLICIES``. The simulator builds policies with :func:`make_policy`
here; node processes that a benchmark starts with a baseline get it through
``bench/node_entry.py``.
"""

from __future__ import annotations

import random

from prefixmesh.overlay.core import routing
from prefixmesh.overlay.core.routing import (
    FORWARD,
    Decision,
    Policy,
    RouteContext,
    RoutingConfig,
    UnknownPolicy,
    _break_top_tie,
    _PolicyBase,
    _pool,
    _same_cost,
    _serve,
    candidate_cost_s,
    local_cost_s,
    peer_label,
    rendezvous_score,
)

__all__ = ["BASELINE_POLICIES", "POLICY_NAMES", "make_policy"]

BASELINE_POLICIES = ("paper", "round-robin", "random", "consistent-hash", "oracle")
#: every policy the simulator and the swarm benchmark can run
POLICY_NAMES = (*routing.DEPLOYABLE_POLICIES, *BASELINE_POLICIES)


class PaperPolicy(_PolicyBase):
    """arXiv:2606.17059: the longest estimated match wins; ties go to local."""

    name = "paper"

    def decide(self, ctx: RouteContext) -> Decision:
        local = local_cost_s(ctx)
        if ctx.hop_budget <= 0:
            return _serve(f"{self.name}: serve, hop budget exhausted", local)
        longer = [
            (-min(c.matched_tokens, ctx.prompt_tokens), c.peer)
            for c in ctx.candidates
            if c.peer != self.self_id
            and c.peer not in ctx.visited
            and min(c.matched_tokens, ctx.prompt_tokens) > ctx.local_matched_tokens
        ]
        if not longer:
            return _serve(
                f"{self.name}: serve, no unvisited peer matches more than local "
                f"{ctx.local_matched_tokens} tok",
                local,
            )
        ranked = _break_top_tie(sorted(longer), self.rng)
        neg_matched, peer = ranked[0]
        c = next(c for c in ctx.candidates if c.peer == peer)
        fallbacks = tuple(p for _, p in ranked[1 : 1 + self.config.max_fallbacks])
        return Decision(
            FORWARD,
            peer,
            f"{self.name}: forward to {peer_label(peer)}, longest match {-neg_matched} tok "
            f"vs local {ctx.local_matched_tokens} of {ctx.prompt_tokens}",
            local,
            candidate_cost_s(ctx, c, use_trust=False),
            fallbacks,
        )


class OraclePolicy(_PolicyBase):
    """Exact information, minimum cost, no margin/trust/bound: the simulator's upper reference."""

    name = "oracle"

    def decide(self, ctx: RouteContext) -> Decision:
        local = local_cost_s(ctx)
        if ctx.hop_budget <= 0:
            return _serve(f"{self.name}: serve, hop budget exhausted", local)
        cheaper = sorted(
            (cost, c.peer)
            for c in ctx.candidates
            if c.peer != self.self_id and c.peer not in ctx.visited
            for cost in (candidate_cost_s(ctx, c, use_trust=False),)
            if cost < local and not _same_cost(cost, local)  # ties go to local
        )
        if not cheaper:
            return _serve(f"{self.name}: serve, local est {local:.3f}s is the minimum", local)
        ranked = _break_top_tie(cheaper, self.rng)
        cost, peer = ranked[0]
        fallbacks = tuple(p for _, p in ranked[1 : 1 + self.config.max_fallbacks])
        return Decision(
            FORWARD,
            peer,
            f"{self.name}: forward to {peer_label(peer)}, est {cost:.3f}s vs local {local:.3f}s",
            local,
            cost,
            fallbacks,
        )


class _PickOnePolicy(_PolicyBase):
    """Shared shape of the baselines that pick a target without looking at costs."""

    name = ""

    def _ranked_targets(self, ctx: RouteContext) -> tuple[bytes, list[bytes]]:
        """(target, fallbacks-in-order before checking visited / hop budget)."""
        raise NotImplementedError

    def decide(self, ctx: RouteContext) -> Decision:
        local = local_cost_s(ctx)
        target, further = self._ranked_targets(ctx)
        if target == self.self_id:
            return _serve(f"{self.name}: serve, picked self", local)
        label = peer_label(target)
        if ctx.hop_budget <= 0:
            return _serve(f"{self.name}: serve, picked {label} but hop budget exhausted", local)
        if target in ctx.visited:
            return _serve(f"{self.name}: serve, picked {label} but it was visited", local)
        fallbacks = tuple(
            p for p in further if p != self.self_id and p not in ctx.visited and p != target
        )[: self.config.max_fallbacks]
        c = next((c for c in ctx.candidates if c.peer == target), None)
        est_peer = candidate_cost_s(ctx, c, use_trust=False) if c is not None else None
        return Decision(
            FORWARD, target, f"{self.name}: forward to {label}", local, est_peer, fallbacks
        )


class RoundRobinPolicy(_PickOnePolicy):
    name = "round-robin"

    def __init__(self, config: RoutingConfig, rng: random.Random, self_id: bytes) -> None:
        super().__init__(config, rng, self_id)
        self.counter = 0

    def _ranked_targets(self, ctx: RouteContext) -> tuple[bytes, list[bytes]]:
        ring = [self.self_id, *_pool(ctx, self.self_id)]
        target = ring[self.counter % len(ring)]
        self.counter += 1
        return target, []


class RandomPolicy(_PickOnePolicy):
    name = "random"

    def _ranked_targets(self, ctx: RouteContext) -> tuple[bytes, list[bytes]]:
        ring = [self.self_id, *_pool(ctx, self.self_id)]
        return ring[self.rng.randrange(len(ring))], []


class ConsistentHashPolicy(_PickOnePolicy):
    name = "consistent-hash"

    def decide(self, ctx: RouteContext) -> Decision:
        if ctx.first_block is None:
            return _serve(f"{self.name}: serve, request has no whole block", local_cost_s(ctx))
        return super().decide(ctx)

    def _ranked_targets(self, ctx: RouteContext) -> tuple[bytes, list[bytes]]:
        assert ctx.first_block is not None
        key = ctx.first_block
        ring = [self.self_id, *_pool(ctx, self.self_id)]
        ranked = sorted(ring, key=lambda n: (-rendezvous_score(key, n), n))
        target = ranked[0]
        # Fallbacks: the next nodes in rendezvous order, up to (not past) this node,
        # which would serve the request itself.
        rest = ranked[1:]
        if self.self_id in rest:
            rest = rest[: rest.index(self.self_id)]
        return target, rest


_BASELINES: dict[str, type] = {
    "paper": PaperPolicy,
    "round-robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "consistent-hash": ConsistentHashPolicy,
    "oracle": OraclePolicy,
}


def make_policy(
    name: str,
    config: RoutingConfig | None = None,
    rng: random.Random | None = None,
    self_id: bytes = b"",
) -> Policy:
    """``routing.make_policy`` that also knows the baselines (one of ``POLICY_NAMES``)."""
    cls = _BASELINES.get(name)
    if cls is None:
        if name not in routing.POLICY_NAMES:
            raise UnknownPolicy(
                f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
        return routing.make_policy(name, config, rng, self_id)
    return cls(config or RoutingConfig(), rng if rng is not None else random.Random(0), self_id)
