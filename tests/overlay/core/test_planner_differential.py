"""Differential test: the node and the simulator take the same decisions.

Both bodies call the one planner (overlay/core/planner.py); what could still differ is how
each turns what it knows into a ``PlanInput``. Hypothesis builds one world (peers' digest
records and load, this node's match, queue and mean service time, RTT, partitioned or
not); the node's path (``InferService._plan_input`` with a stub host, heartbeat and
engine: no network) and the simulator's path (``Simulator._plan_input`` on a simulated
node put in the same state) must give identical plans: same action, targets, carried
holders, decision (reason and estimates included) and routing context.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixmesh.bench.policies import make_policy
from prefixmesh.bench.sim import MODEL_FP, SimConfig, Simulator, _Req
from prefixmesh.bench.workloads import Request, Workload
from prefixmesh.inference.backend import BackendLoad
from prefixmesh.inference.core.blocks import BLOCK_TOKENS, chain_hashes
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.digest import DigestRecord, LoadFigures, NamespaceDelta
from prefixmesh.overlay.core.partition import HolderMatch
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.heartbeat import PeerHealth
from prefixmesh.overlay.infer import InferService, InferSettings

# 0: the simulator's exact queue wait (busy_until - now) then equals the node's estimate
# (requests x mean service time) to the last bit
NOW = 0.0
PROMPT_BLOCKS = 8


@dataclass
class _Host:
    peer_id: bytes

    def remote_addrs(self, peer: bytes) -> list[str]:
        return []


@dataclass
class _Heartbeat:
    health: dict[bytes, PeerHealth]

    def up_peers(self) -> list[bytes]:
        return list(self.health)

    def is_up(self, peer: bytes) -> bool:
        return peer in self.health

    def rtt_s(self, peer: bytes) -> float | None:
        return self.health[peer].rtt_s


@dataclass
class _Backend:
    load: BackendLoad
    model_fingerprint: bytes = MODEL_FP

    def load_figures(self) -> BackendLoad:
        return self.load


@dataclass
class _Tenant:
    namespace_key: bytes

    def may_serve(self, peer: bytes) -> bool:
        return True


@dataclass
class _PartitionGossip:
    pd: object
    members_: tuple[bytes, ...] = field(default=())

    def members(self) -> list[bytes]:
        return list(self.members_)


@dataclass(frozen=True)
class World:
    policy: str
    partitioned: bool
    local_blocks: int
    busy: bool
    svc_mean: float
    delay_ms: float
    peers: tuple[tuple[int, int, int, float, bool], ...]  # blocks, queue, active, tps, known
    prompt_blocks: int = PROMPT_BLOCKS


peer_st = st.tuples(
    st.integers(0, PROMPT_BLOCKS),
    st.integers(0, 3),
    st.integers(0, 1),
    st.sampled_from([0.0, 300.0, 420.0, 900.0]),
    st.booleans(),
)
world_st = st.builds(
    World,
    # the policies a node runs (the pick-one baselines use the simulator's exact pool)
    policy=st.sampled_from(["prefixmesh", "paper", "local"]),
    partitioned=st.booleans(),
    local_blocks=st.integers(0, PROMPT_BLOCKS),
    busy=st.booleans(),
    svc_mean=st.floats(0.01, 3.0),
    delay_ms=st.sampled_from([0.5, 1.0, 2.0, 50.0, 500.0]),
    peers=st.lists(peer_st, min_size=1, max_size=6).map(tuple),
)


def _records(sim: Simulator, world: World, chain: list[bytes]) -> list[tuple[int, DigestRecord]]:
    out = []
    for i, (blocks, queue, active, tps, known) in enumerate(world.peers, start=1):
        if not known:
            continue
        out.append((i, DigestRecord(
            origin=sim.nodes[i].pid, epoch=1, seq=1, issued_at=NOW - 1, expires_at=NOW + 60,
            model=MODEL_FP, kind="snapshot",
            namespaces=(NamespaceDelta(sim.ns, tuple(chain[:blocks]), ()),) if blocks else (),
            load=LoadFigures(queue, active, tps, 120.0), kv_capacity_bytes=1 << 30,
            kv_used_bytes=0,
        )))  # fmt: skip
    return out


def _simulator(world: World, tokens: tuple[int, ...]) -> tuple[Simulator, list[bytes]]:
    wl = Workload("differential", [Request(0, 0.0, tokens, 8)], "none")
    sim = Simulator(wl, SimConfig(nodes=1 + len(world.peers), policy=world.policy,
                                  delay_ms=world.delay_ms, partitions=16 if world.partitioned
                                  else 0, seed=0))  # fmt: skip
    sim.now = NOW
    chain = chain_hashes(sim.ns_key, tokens)
    router = sim.nodes[0]
    router.svc_mean = world.svc_mean
    if world.busy:  # one request running, finishing in one mean service time
        router.busy, router.busy_until = True, NOW + world.svc_mean
    if world.local_blocks:
        # the simulated engine holds this prefix (no value: nothing advertised)
        router.cache.save(tokens[: world.local_blocks * BLOCK_TOKENS], lambda n: None)
    return sim, chain


def _feed(target, records, ns: bytes, chain: list[bytes], partitioned: bool) -> None:
    """Full: the records go into the peer index. Partitioned: this router has a cached
    lookup answer for the chain (the holders' matches and load figures)."""
    if not partitioned:
        for _, rec in records:
            target.apply(rec, NOW)
        return
    holders = [HolderMatch(rec.origin, len(rec.namespaces[0].added) if rec.namespaces else 0,
                           rec.load, rec.expires_at) for _, rec in records]
    target.note_answer(holders)
    target.take_answer(ns, chain, [h for h in holders if h.blocks > 0], NOW)


def _node_service(sim: Simulator, world: World, records, chain: list[bytes]) -> InferService:
    router = sim.nodes[0]
    rtt = sim.rtt_s
    health = {n.pid: PeerHealth(up=True, rtt_s=rtt) for n in sim.nodes[1:]}
    load = BackendLoad(queue_depth=0, active=1 if world.busy else 0,
                       prefill_tps=sim.cfg.prefill_tps, decode_tps=sim.cfg.decode_tps,
                       kv_capacity_bytes=1 << 30, kv_used_bytes=0,
                       avg_request_s=world.svc_mean)  # fmt: skip
    index = PeerCacheIndex()
    svc = InferService(
        host=_Host(router.pid), backend=_Backend(load), tenants=None, index=index,
        heartbeat=_Heartbeat(health),
        policy=make_policy(world.policy, sim.routing, random.Random(7), router.pid),
        settings=InferSettings(max_peers_per_subnet=0), clock=lambda: NOW,
    )  # fmt: skip
    if world.partitioned:
        from prefixmesh.overlay.core.partition import PartitionConfig, PartitionedDigest

        pd = PartitionedDigest(router.ident, MODEL_FP, make_stream=lambda fp, now: None,
                               config=PartitionConfig(n_partitions=16, replicas=3,
                                                      lookup_ttl_s=sim.cfg.lookup_ttl_s))
        _feed(pd, records, sim.ns, chain, True)
        svc.partition = _PartitionGossip(pd, sim.all_pids[1:])
    else:
        _feed(index, records, sim.ns, chain, False)
    return svc


def _plans(world: World):
    rng = random.Random(repr(world))
    tokens = tuple(rng.randrange(1, 50_000) for _ in range(world.prompt_blocks * BLOCK_TOKENS + 5))
    sim, chain = _simulator(world, tokens)
    records = _records(sim, world, chain)
    router = sim.nodes[0]
    router.policy = make_policy(world.policy, sim.routing, random.Random(7), router.pid)
    router.planner.policy = router.policy
    router.planner.rng = random.Random(3)  # the same shed-candidate draws on both paths
    _feed(router.pd if world.partitioned else router.index, records, sim.ns, chain,
          world.partitioned)
    local_matched = min(Simulator._local_match(router, tokens), len(tokens))
    sr = _Req(sim.workload.requests[0], 0)
    sim_plan = router.planner.plan(sim._plan_input(router, sr, chain, local_matched), NOW)

    svc = _node_service(sim, world, records, chain)
    svc.planner.rng = random.Random(3)
    req = wire.Request(id=b"r" * 16, ns=sim.ns, tokens=tokens, deadline=NOW + 60,
                       hop_budget=sim.max_hops)  # fmt: skip
    inp = svc._plan_input(req, _Tenant(sim.ns_key), chain, local_matched,
                          svc.backend.load_figures())
    node_plan = svc.planner.plan(inp, NOW)
    return sim_plan, node_plan


def _same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    for name in ("targets", "carry", "homes", "code", "reason", "decision", "ctx"):
        assert getattr(a, name, None) == getattr(b, name, None), name


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_st)
def test_node_and_simulator_plan_alike(world):
    sim_plan, node_plan = _plans(world)
    _same(sim_plan, node_plan)


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_world_where_the_router_forwards(partitioned):
    """A recorded case (not only generated ones): one peer holds the whole prompt, idle;
    this node holds nothing and is busy. Both bodies forward to it."""
    world = World("prefixmesh", partitioned, 0, True, 2.0, 1.0,
                  ((PROMPT_BLOCKS, 0, 0, 420.0, True), (0, 1, 0, 420.0, True)))
    sim_plan, node_plan = _plans(world)
    _same(sim_plan, node_plan)
    assert type(sim_plan).__name__ == "Forward"


#: decisions recorded from a real swarm (tests/overlay/core/record_planner_trace.py: four
#: full nodes on loopback, real digests and heartbeats, 64 requests): what each router saw
RECORDED = json.loads(Path(__file__).with_name("planner_trace.json").read_text())["decisions"]


def test_decisions_recorded_from_a_real_swarm_plan_alike():
    """Each recorded decision's inputs (its prompt and local match, its load, its peers'
    matches and digest load, the median RTT) rebuilt in both bodies: identical plans.
    (Rebuilt, 106 of the 110 also take the action the real node took; the other 4 differ
    by what a world cannot hold: per-peer RTTs and the node's measured prefill rate.)"""
    kinds: Counter[str] = Counter()
    for d in RECORDED:
        world = World("prefixmesh", False, d["local_blocks"], d["busy"], d["svc_mean"],
                      d["delay_ms"], tuple(tuple(p) for p in d["peers"]),
                      prompt_blocks=d["prompt_blocks"])
        sim_plan, node_plan = _plans(world)
        _same(sim_plan, node_plan)
        kinds[type(node_plan).__name__] += 1
    assert kinds["Serve"] >= 10 and kinds["Forward"] >= 10, kinds
