"""Deterministic discrete-event simulator of a prefixmesh network, driving the real pure core.

Nothing of the protocol is reimplemented here. Every simulated node owns the same objects
a real node owns:

- a :class:`~prefixmesh.inference.core.segments.SegmentTree` of cached prompt states (the KV
  store's prefix-shared accounting on a radix tree), with its byte budget and LRU-2 eviction
  (``kv_capacity_bytes``, ``bytes_per_token`` per stored token);
- an :class:`~prefixmesh.overlay.core.antientropy.AntiEntropy` state with its own Ed25519
  identity, issuing real signed :class:`~prefixmesh.overlay.core.digest.DigestRecord` bytes;
  exchanges are push-pull over simulated links, and every message is the real encoded
  byte string (so digest bytes/s are real);
- a :class:`~prefixmesh.overlay.core.peerindex.PeerCacheIndex` fed with the records the node
  has received (stale by however long gossip took);
- a routing :class:`~prefixmesh.overlay.core.routing.Policy` from ``bench/policies.make_policy``.

Event model (heapq, virtual seconds, one seeded ``random.Random``; no trio, no clock)
    A request enters at one node (``entry``: a seeded uniform pick, by default). The node
    plans from what *it* knows: its own radix match, its own queue, and its cache view
    (estimated matches from digests, load figures from the last record it saw, RTT =
    twice the link's mean one-way delay). A forward
    travels one link delay and the next node decides again, with ``hop_budget`` reduced
    and ``visited`` grown. The serving node queues the request (FIFO, one at a time) and,
    when it starts, re-matches the prompt against its *own* tree: the estimate a router
    used versus the actual reuse gives the false-hit rate. The response travels back
    along the path (sum of hop delays).

Service model (defaults: measured SmolLM2-135M figures, docs in dependency-facts.md)
    ``service = restore_s [if reused] + (prompt - reused) / prefill_tps +
    max_tokens / decode_tps``; TTFT = arrival-to-start wait + restore + prefill + return
    path; end-to-end adds decode. ``reused`` is the radix match at the serving node, capped
    at ``prompt - 1`` (the last token must be evaluated to get logits), and only taken
    when it pays (``reused >= min_reuse_tokens``, by default ``restore_s * prefill_tps``
    tokens). After serving, the prompt is saved as the engine saves it, with the KV
    store's prefix-shared accounting (``inference/core/segments.SegmentTree``, the same
    byte charge ``KVStore`` uses: a state stores only the tokens past the longest stored
    prefix, ``bytes_per_token`` each, a branch point with a stored prompt becomes a state
    of its own and the other is rebased onto it, parents are pinned); each stored state's
    block chain is added to the node's anti-entropy state; evictions remove theirs.
    ``prefix_sharing=False``: one whole state per cached prompt (the model before issue
    17).

Deliberate simplifications
    Constant prefill/decode rates (no context-length dependence); no batching; links are
    independent one-way delays with optional exponential jitter (no bandwidth, no loss);
    one namespace for all requests. Record decoding and signature verification are
    memoised by exact bytes for the duration of a run (see
    :func:`memoised_record_decoding`: each distinct record is parsed and verified once
    per simulation instead of once per receiving node), which changes no outcome.

Trust (``trust_feedback``, off by default so routing is compared without it)
    Every router keeps the node's own ``TrustTracker`` (``overlay/core/trust.py``): candidates
    carry its trust, and when a forwarded request finishes, each router on its path
    charges its next hop with what the serving node really reused (rule (a), exactly as
    ``RouteExecutor.observe_final`` does with the FINAL frame; observed at completion,
    the return delay aside). Without it every claim is taken at face value (trust 1).

One planner (``overlay/core/planner.py``)
    A simulated router decides exactly as the node does: it fills a ``PlanInput`` with
    what it knows (radix match, own queue, the cache view of its digest state, every
    other node one link away) and carries out the ``Planner``'s action (serve, forward
    with the holder list to carry, or look up a partition home first). Only the
    ``oracle`` baseline bypasses it (exact candidates). The differential test
    ``tests/overlay/core/test_planner_differential.py`` holds the node's and this caller's inputs
    equal.

Routing improvements (node features: ``RoutingConfig`` in ``overlay/core/routing.py``)
    Every ``prefixmesh`` node keeps a ``RentLedger`` (ski rental: serve a prefix
    locally once the RTT it has paid forwarding that prefix reaches the cost of one
    local miss) and a ``PlacementLedger`` (decayed counts of where it placed requests and
    of requests peers forwarded to it: the placement bound and hot-node shedding), exactly
    as a real node would; ``SimConfig.ski_rental``
    and ``RoutingConfig(bound_placements=..., load_slack=...)`` switch them off for
    before/after comparisons.

Digest knobs (issue 6, T7; defaults = the node's ``[digest]`` defaults)
    ``bucket_summaries`` (bucket hashes first, then only the differing buckets' entries),
    ``min_record_interval_s`` (batch own
    deltas) and ``compaction_ratio`` (rarer compaction snapshots): see
    ``overlay/core/antientropy.py``. :func:`measure_idle_digest` measures an idle swarm.

Limits
    Memory and time grow with N x (records per node): N=1024 is fine for the convergence
    experiment (no requests), request simulations are meant for N <= 256.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from prefixmesh.inference.core.blocks import (
    BLOCK_TOKENS,
    chain_hashes,
    derive_namespace_key,
    namespace_id,
)
from prefixmesh.inference.core.radix import RadixTree
from prefixmesh.inference.core.segments import SegmentTree
from prefixmesh.node.config import DigestSection
from prefixmesh.overlay.core import antientropy as _ae_mod
from prefixmesh.overlay.core import digest as _digest_mod
from prefixmesh.overlay.core import partition as _partition_mod
from prefixmesh.overlay.core.digest import LoadFigures
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import (
    HolderMatch,
    OverBudget,
    PartitionConfig,
    PartitionedDigest,
    decode_ack,
    decode_lookup,
    decode_lookup_answer,
    decode_push,
    encode_ack,
    encode_lookup,
    encode_lookup_answer,
    encode_push,
)
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.core.planner import (
    Forward,
    FrozenPeers,
    LookUp,
    PeerLink,
    PlanInput,
    Planner,
)
from prefixmesh.overlay.core.replication import FullReplication, PartialReplication
from prefixmesh.overlay.core.routing import (
    FORWARD,
    Candidate,
    RouterMemory,
    RoutingConfig,
)
from prefixmesh.overlay.core.trust import TrustTracker

from . import gossip as _gossip
from .policies import make_policy
from .workloads import Request, Workload

__all__ = [
    "SimConfig",
    "SimResult",
    "Simulator",
    "simulate",
    "measure_convergence",
    "add_sim_arguments",
    "run_bench_sim",
    "main",
]

BYTES_PER_TOKEN = 23_052  # SmolLM2-135M KV state per token (dependency-facts.md)
MODEL_FP = b"smollm2-135m-instruct-q4_1"
_PICK_ONE = frozenset({"round-robin", "random", "consistent-hash", "local"})
_EXACT_POOL = _PICK_ONE - {"local"}  # baselines that pick from every node, known or not

# The node's digest defaults ([digest] in node/config.py): the simulator overrides only
# what an experiment varies.
_NODE_DIGEST = DigestSection()

_EV_ARRIVE, _EV_DONE, _EV_GOSSIP, _EV_MSG, _EV_PART = range(5)
_PUSH, _ACK, _LOOKUP, _ANSWER = range(4)


@dataclass
class SimConfig:
    """Knobs of one simulation (see the module docstring for the model)."""

    nodes: int = 4
    policy: str = "prefixmesh"
    delay_ms: float = 2.0  # one-way per-link delay; RTT = 2x
    jitter_ms: float = 0.0  # mean of an exponential extra delay per message
    prefill_tps: float = 420.0
    decode_tps: float = 120.0
    restore_s: float = 0.2
    min_reuse_tokens: int | None = None  # None: ceil(restore_s * prefill_tps)
    kv_capacity_bytes: int = 512 * 1024 * 1024
    bytes_per_token: int = BYTES_PER_TOKEN
    # the KV store's prefix-shared accounting (a stored prefix is kept once, extensions
    # store only their own tokens; inference/core/segments.py); False: one whole state
    # per cached prompt (the model before issue 17)
    prefix_sharing: bool = True
    min_share_tokens: int = 16  # the engine's min_snapshot_tokens (branch points)
    gossip_interval_s: float = _NODE_DIGEST.interval_s
    gossip_fanout: int = _NODE_DIGEST.fanout
    gossip_budget_bytes: int = _NODE_DIGEST.byte_budget
    decode_messages: bool = False  # decode exchange messages (see bench/gossip.py)
    digest_ttl_s: float = _NODE_DIGEST.ttl_s
    refresh_interval_s: float = _NODE_DIGEST.refresh_interval_s
    # digest-rate knobs (AntiEntropy): at most one own delta per this many seconds (0:
    # every gossip tick with changes)
    min_record_interval_s: float = _NODE_DIGEST.min_record_interval_s
    # answer a differing summary hash with bucket hashes (the node's [digest] default)
    bucket_summaries: bool = _NODE_DIGEST.bucket_summaries
    # own snapshot when the deltas since outweigh it this much (the node's default)
    compaction_ratio: float = _NODE_DIGEST.compaction_ratio
    warmup_s: float | None = None  # gossip before the first request; None: 3 intervals
    max_hops: int | None = None  # None: 1 for pick-one baselines, 2 otherwise
    trust_feedback: bool = False  # routers keep the node's TrustTracker (module docstring)
    # Ski rental now lives in routing (RoutingConfig.ski_rental, on by default); None
    # follows `routing`, True/False override it (the sweeps compare both).
    ski_rental: bool | None = None
    # Partial replication (overlay/core/partition.py; 0 = full replication, what the node does):
    # P partitions by chain root, each replicated at `replicas` home nodes; routers that
    # are not a home look up a home and cache the answer `lookup_ttl_s`. Partition streams
    # refresh every `partition_refresh_s` (records live `partition_ttl_s`).
    partitions: int = 0
    replicas: int = 3
    lookup_ttl_s: float = 2.0
    partition_refresh_s: float = _NODE_DIGEST.partition_refresh_s
    partition_ttl_s: float = _NODE_DIGEST.partition_ttl_s
    liar_fraction: float = 0.0  # nodes advertising prefixes they do not hold
    entry: str = "random"  # random | round-robin | first (all requests enter at node 0)
    seed: int = 0
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def resolved_max_hops(self) -> int:
        if self.max_hops is not None:
            return self.max_hops
        return 1 if self.policy in _PICK_ONE else 2


@dataclass
class SimResult:
    config: dict
    workload: str
    requests: int
    sim_seconds: float
    wall_seconds: float
    metrics: dict

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


# ---------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def memoised_record_decoding(maxsize: int = 1 << 20) -> Iterator[None]:
    """Memoise record parsing and verification by exact bytes for one run.

    Every node decodes every record it receives; in one process the same bytes are
    decoded N times. ``decode_record`` is a pure function of ``raw`` except for its two
    clock checks, so the memo calls the real function the first time a raw record is
    seen (with ``check_expiry=False``: the full parse, validation and signature check)
    and afterwards returns the same ``SignedRecord`` only when the call is one whose
    outcome cannot differ: ``check_expiry=False`` (what ``AntiEntropy.receive`` passes)
    and ``issued_at <= now + max_clock_skew``. Any other call, and every failing record,
    goes to the real function. Signature checks are memoised the same way.

    The run's own records are known from the start: ``sign_record`` returns what
    ``decode_record`` yields for its bytes (its contract, property-tested in
    tests/overlay/core/test_digest.py), so each record the run signs enters the memo as
    it is signed, and a signature made during the run is known valid (Ed25519 signing is
    deterministic and what ``Identity.sign`` returns verifies under that identity's
    public key). Any other bytes, a record altered or signed elsewhere included, go to
    the real parse and the real Ed25519 check.
    """
    original_decode = _ae_mod.decode_record
    original_verify = _digest_mod.verify_with_public_key
    original_sign = Identity.sign
    original_sign_record = _ae_mod.sign_record
    memo: dict[bytes, object] = {}
    verdicts: dict[tuple[bytes, bytes, bytes], bool] = {}

    def decode(raw, *, now, max_clock_skew=30.0, check_expiry=True):
        signed = memo.get(raw) if not check_expiry else None
        if signed is not None and signed.record.issued_at <= now + max_clock_skew:
            return signed
        signed = original_decode(
            raw, now=now, max_clock_skew=max_clock_skew, check_expiry=check_expiry
        )
        if not check_expiry and len(memo) < maxsize:
            memo[signed.raw] = signed
        return signed

    def sign_record(record, identity):
        # what decode_record yields for these bytes (sign_record's contract, checked in
        # tests/bench/test_sim.py): the run's own records are parsed once, here
        signed = original_sign_record(record, identity)
        if len(memo) < maxsize:
            memo[signed.raw] = signed
        return signed

    def sign(identity: Identity, data: bytes) -> bytes:
        signature = original_sign(identity, data)
        if len(verdicts) < maxsize:
            verdicts[(identity.public_bytes, bytes(data), signature)] = True
        return signature

    def verify(pub32: bytes, data: bytes, sig: bytes) -> bool:
        key = (pub32, data, sig)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = original_verify(pub32, data, sig)
            if len(verdicts) < maxsize:
                verdicts[key] = verdict
        return verdict

    _ae_mod.decode_record = decode
    _digest_mod.verify_with_public_key = verify
    Identity.sign = sign
    _ae_mod.sign_record = sign_record
    try:
        yield
    finally:
        _ae_mod.decode_record = original_decode
        _digest_mod.verify_with_public_key = original_verify
        Identity.sign = original_sign
        _ae_mod.sign_record = original_sign_record


# Young-generation threshold during a run: the default (700 allocations) runs a
# collection every few events, and each one walks the objects that survived since.
RUN_GC_THRESHOLD = 100_000


@contextlib.contextmanager
def frozen_setup_objects() -> Iterator[None]:
    """Keep the cyclic garbage collector off the objects built before the run.

    N nodes' identities, trees, indexes and streams live for the whole run, yet every
    full collection walked them all again (about 15 % of the run's CPU time at N=1024).
    ``gc.freeze`` moves them to a permanent generation, and a larger young-generation
    threshold makes collections rarer; garbage is still collected, so no outcome
    changes (no simulated state depends on when a collection runs)."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(RUN_GC_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


@contextlib.contextmanager
def memoised_partition_homes() -> Iterator[None]:
    """Memoise ``partition_homes`` for one run: it is a pure function of (partition,
    member set, replicas), and every simulated node computes the same homes for the same
    membership (each node caches its own, so without this N nodes pay N x P rendezvous
    rankings over all N members)."""
    original = _partition_mod.partition_homes
    memo: dict[tuple, list[bytes]] = {}
    # each node passes its own (equal) member set: map each set object to one token by
    # identity (the set is kept alive with it), so equal sets are compared once
    tokens: dict[frozenset, int] = {}
    by_id: dict[int, tuple[frozenset, int]] = {}

    def homes(p, nodes, replicas):
        members = nodes if isinstance(nodes, frozenset) else frozenset(nodes)
        known = by_id.get(id(members))
        if known is None or known[0] is not members:
            known = by_id[id(members)] = (members, tokens.setdefault(members, len(tokens)))
        key = (p, known[1], replicas)
        got = memo.get(key)
        if got is None:
            got = memo[key] = original(p, members, replicas)
        return list(got)

    _partition_mod.partition_homes = homes
    try:
        yield
    finally:
        _partition_mod.partition_homes = original


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return float(sorted_values[k])


def _stats(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {
        "mean": sum(s) / len(s) if s else 0.0,
        "p50": percentile(s, 50),
        "p99": percentile(s, 99),
    }


class _Node:
    __slots__ = (
        "idx", "ident", "pid", "ae", "index", "policy", "tree", "queue", "busy", "busy_until",
        "queued_work", "served", "busy_time", "svc_mean", "liar", "lies", "trust",
        "true_blocks", "bytes_sent", "rr_entry", "current", "rent", "placements", "memory",
        "pd", "lookup_bytes", "side", "planner", "links", "gossip_round", "cache",
    )  # fmt: skip


class _TrustOf:
    """``Mapping.get`` over a router's TrustTracker at one instant (read lazily: the
    planner asks only for its candidates)."""

    __slots__ = ("tracker", "now")

    def __init__(self, tracker: TrustTracker, now: float) -> None:
        self.tracker = tracker
        self.now = now

    def get(self, peer: bytes, default: float = 1.0) -> float:
        return self.tracker.trust(peer, self.now)


class _Req:
    """Per-request simulation state."""

    __slots__ = (
        "req", "entry", "node", "hops", "visited", "back_s", "est_tokens", "est_from",
        "enqueued_at", "svc_est", "answer", "carried", "looked_up", "claims", "reused",
    )  # fmt: skip

    def __init__(self, req: Request, entry: int) -> None:
        self.req = req
        self.entry = entry
        self.node = entry
        self.hops = 0
        self.visited: frozenset[bytes] = frozenset()
        self.back_s = 0.0
        self.est_tokens = -1  # estimate of the last forwarding router (-1: none)
        self.est_from = -1
        self.enqueued_at = 0.0
        self.svc_est = 0.0
        self.answer = None  # a lookup answer (holder -> blocks) to decide with
        self.carried = None  # the holder list the request carries (partitioned digests)
        self.looked_up = False
        self.claims: list[tuple[int, bytes, int]] = []  # (router, next hop, its claim)
        self.reused = 0  # tokens the serving node reused (the FINAL frame's cached_tokens)


# ---------------------------------------------------------------------------- simulator


CHAINS_KEPT = 1 << 16  # prompts whose block hashes are kept (_chain), then it starts over
PROGRESS_EVERY_S = 2.0  # the CLI's rule: every step longer than 2 s says how far it is


class Simulator:
    """One simulation run of ``workload`` under ``config`` (see the module docstring)."""

    def __init__(self, workload: Workload, config: SimConfig,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if config.nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.progress = progress  # (done, total) about every PROGRESS_EVERY_S of wall time
        self.cfg = config
        self.workload = workload
        self.routing = (
            config.routing
            if config.ski_rental is None
            else dataclasses.replace(config.routing, ski_rental=config.ski_rental)
        )
        # Independent random streams, so that e.g. a policy that samples extra candidates
        # does not change which node each request enters at: every policy sees the same
        # entries, gossip partners and link jitter for one seed.
        self.rng = random.Random(config.seed)
        self.rng_entry = random.Random(f"{config.seed}/entry")
        self.rng_gossip = random.Random(f"{config.seed}/gossip")
        self.rng_link = random.Random(f"{config.seed}/link")
        self.rng_route = random.Random(f"{config.seed}/route")
        self.rng_liar = random.Random(f"{config.seed}/liar")
        self.ns_key = derive_namespace_key(b"public", "public", MODEL_FP)
        self.ns = namespace_id(self.ns_key)
        self.min_reuse = (
            config.min_reuse_tokens
            if config.min_reuse_tokens is not None
            else math.ceil(config.restore_s * config.prefill_tps)
        )
        self.delay_s = config.delay_ms / 1000.0
        self.jitter_s = config.jitter_ms / 1000.0
        self.rtt_s = 2.0 * (self.delay_s + self.jitter_s)
        self.max_hops = config.resolved_max_hops()
        self.warmup = (
            config.warmup_s if config.warmup_s is not None else 3 * config.gossip_interval_s
        )
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.nodes: list[_Node] = []
        self.by_pid: dict[bytes, int] = {}
        self.recent_chains: deque[list[bytes]] = deque(maxlen=512)
        self.chains_by_prompt: dict[tuple[int, ...], list[bytes]] = {}  # see _chain
        n_liars = round(config.liar_fraction * config.nodes)
        liars = set(self.rng_liar.sample(range(config.nodes), n_liars)) if n_liars else set()
        for i in range(config.nodes):
            self.nodes.append(self._make_node(i, i in liars))
        self.all_pids = tuple(n.pid for n in self.nodes)
        link = PeerLink(rtt_s=self.rtt_s)
        for n in self.nodes:
            n.links = FrozenPeers({p: link for p in self.all_pids if p != n.pid})
        self.entry_counter = 0
        # metrics
        self.m_ttft: list[float] = []
        self.m_e2e: list[float] = []
        self.m_reused = 0
        self.m_prompt = 0
        self.m_req_hits = 0
        self.m_forwarded = 0
        self.m_hops = 0
        self.m_est_forwards = 0
        self.m_false_hits = 0
        self.m_false_hit_tokens = 0
        self.m_to_liar = 0
        self.m_done = 0
        self.m_gossip_msgs = 0
        self.m_lookups = 0
        self.m_lookups_skipped = 0

    def _make_node(self, i: int, liar: bool) -> _Node:
        cfg = self.cfg
        n = _Node()
        n.idx = i
        n.ident = Identity.from_seed(self.rng.randbytes(32))
        n.pid = n.ident.peer_id
        n.ae = _gossip.make_antientropy(
            n.ident, MODEL_FP, now=0.0, ttl=cfg.digest_ttl_s,
            refresh_interval=cfg.refresh_interval_s,
            min_record_interval=cfg.min_record_interval_s,
            compaction_ratio=cfg.compaction_ratio,
        )  # fmt: skip
        n.index = PeerCacheIndex()
        n.pd = None
        n.lookup_bytes = 0
        n.side = FullReplication(n.ae, n.index, MODEL_FP)
        n.gossip_round = functools.partial(self._gossip_full, n)
        if cfg.partitions:
            ident = n.ident

            def make_stream(fp: bytes, now: float):
                return _gossip.make_antientropy(
                    ident, fp, now=now, ttl=cfg.partition_ttl_s,
                    refresh_interval=cfg.partition_refresh_s,
                    min_record_interval=cfg.min_record_interval_s,
                    compaction_ratio=cfg.compaction_ratio,
                )  # fmt: skip

            n.pd = PartitionedDigest(
                n.ident, MODEL_FP, make_stream=make_stream,
                config=PartitionConfig(n_partitions=cfg.partitions, replicas=cfg.replicas,
                                       lookup_ttl_s=cfg.lookup_ttl_s),
            )  # fmt: skip
            n.side = PartialReplication(n.pd, lambda: self.all_pids)
            n.gossip_round = functools.partial(self._gossip_partitioned, n)
        n.policy = make_policy(
            cfg.policy, self.routing, random.Random(self.rng.getrandbits(64)), n.pid
        )
        n.true_blocks = {}
        if cfg.prefix_sharing:  # the KV store's accounting (inference/core/segments.py)
            n.cache = SegmentTree(cfg.kv_capacity_bytes, cfg.bytes_per_token,
                                  min_share=cfg.min_share_tokens,
                                  on_evict=functools.partial(self._evicted_state, n),
                                  on_store=functools.partial(self._stored_state, n))
            n.tree = None
        else:
            n.cache = None
            n.tree = RadixTree(cfg.kv_capacity_bytes,
                               on_evict=functools.partial(self._evicted, n))
        n.queue = deque()
        n.busy = False
        n.busy_until = 0.0
        n.queued_work = 0.0
        n.served = 0
        n.busy_time = 0.0
        n.svc_mean = 1.0
        n.liar = liar
        n.lies = deque()
        n.trust = TrustTracker() if self.cfg.trust_feedback else None
        n.bytes_sent = 0
        n.rr_entry = 0
        n.current = None
        n.memory = RouterMemory.for_policy(n.policy, n.pid)
        # one shed-candidate stream for all routers (independent of entries and gossip)
        n.planner = Planner(n.pid, n.policy, n.side.view, n.memory, rng=self.rng_route)
        n.links = {}  # filled once every node exists: every other node, one link delay away
        n.rent = n.memory.rent  # the ledgers, for reports and tests
        n.placements = n.memory.placements
        self.by_pid[n.pid] = i
        return n

    # -- event queue -----------------------------------------------------------------

    def _push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def link_delay(self) -> float:
        if self.jitter_s > 0:
            return self.delay_s + self.rng_link.expovariate(1.0 / self.jitter_s)
        return self.delay_s

    # -- cache bookkeeping ---------------------------------------------------------------

    def _chain(self, req: Request) -> list[bytes]:
        if req.chain is None:
            # a pure function of the prompt: repeated prompts (a third of an MMLU trace)
            # reuse the hashes of the first (each request gets its own list)
            tokens = req.tokens
            keyable = type(tokens) is tuple  # hashable prompts only
            known = self.chains_by_prompt.get(tokens) if keyable else None
            if known is None:
                known = chain_hashes(self.ns_key, tokens)
                if keyable:
                    if len(self.chains_by_prompt) >= CHAINS_KEPT:
                        self.chains_by_prompt.clear()
                    self.chains_by_prompt[tokens] = known
            req.chain = list(known)
        return req.chain

    def _evicted(self, node: _Node, entry) -> None:
        self._evicted_state(node, entry.tokens, entry.payload)

    def _stored_state(self, node: _Node, tokens, chain) -> None:
        if chain:
            self._advertise(node, chain)  # liars advertise real ones too
            tb = node.true_blocks
            for h in chain:
                tb[h] = tb.get(h, 0) + 1

    def _evicted_state(self, node: _Node, tokens, chain) -> None:
        if chain:
            self._unadvertise(node, chain)
            tb = node.true_blocks
            for h in chain:
                c = tb[h] - 1
                if c:
                    tb[h] = c
                else:
                    del tb[h]

    def _advertise(self, node: _Node, chain: list[bytes]) -> None:
        node.side.add(self.ns, chain, self.now)

    def _unadvertise(self, node: _Node, chain: list[bytes]) -> None:
        node.side.remove(self.ns, chain, self.now)

    def _true_match_tokens(self, node: _Node, chain: list[bytes]) -> int:
        tb = node.true_blocks
        k = 0
        for h in chain:
            if h not in tb:
                break
            k += 1
        return k * BLOCK_TOKENS

    # -- run ---------------------------------------------------------------------------

    def run(self) -> SimResult:
        with frozen_setup_objects():  # before the clocks start: it collects the setup's
            return self._run()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        cfg = self.cfg
        with memoised_record_decoding(), memoised_partition_homes():
            if cfg.nodes > 1:
                for n in self.nodes:
                    self._push(self.rng_gossip.uniform(0, cfg.gossip_interval_s), _EV_GOSSIP, n)
            reqs = self.workload.requests
            n_reqs = len(reqs)
            next_i = 0
            heap = self.heap
            last_report = wall0
            steps = 0
            while self.m_done < n_reqs:
                steps += 1
                if self.progress is not None and steps % 4096 == 0:  # cheap: rarely a clock
                    t = time.perf_counter()
                    if t - last_report >= PROGRESS_EVERY_S:
                        last_report = t
                        self.progress(self.m_done, n_reqs)
                if next_i < n_reqs and (
                    not heap or reqs[next_i].arrival_s + self.warmup <= heap[0][0]
                ):
                    r = reqs[next_i]
                    next_i += 1
                    self.now = r.arrival_s + self.warmup
                    self._client_arrival(r)
                    continue
                t, _, kind, a, b = heapq.heappop(heap)
                self.now = t
                self._dispatch(kind, a, b)
        wall = time.perf_counter() - wall0
        self.cpu_seconds = time.process_time() - cpu0
        return self._result(wall)

    def _dispatch(self, kind: int, a: object, b: object) -> None:
        """Handle one event popped from the heap (``self.now`` already set)."""
        if kind == _EV_ARRIVE:
            self._arrive(a)
        elif kind == _EV_DONE:
            self._done(a)
        elif kind == _EV_GOSSIP:
            self._gossip(a)
        elif kind == _EV_MSG:
            self._message(a, b)
        else:
            self._partition_message(a, b)

    # -- requests ------------------------------------------------------------------------

    def _client_arrival(self, req: Request) -> None:
        cfg = self.cfg
        if cfg.entry == "random":
            entry = self.rng_entry.randrange(cfg.nodes)
        elif cfg.entry == "round-robin":
            entry = self.entry_counter % cfg.nodes
            self.entry_counter += 1
        else:
            entry = 0
        self._arrive(_Req(req, entry))

    def _queue_wait(self, node: _Node) -> float:
        return max(0.0, node.busy_until - self.now) + node.queued_work

    def _arrive(self, sr: _Req) -> None:
        """A request reaches ``sr.node``: plan (overlay/core/planner.py, as the node does)
        and carry the plan out."""
        node = self.nodes[sr.node]
        req = sr.req
        tokens = req.tokens
        chain = self._chain(req)
        local_matched = min(self._local_match(node, tokens), len(tokens))
        if self.cfg.policy == "oracle":
            self._oracle_arrive(node, sr, chain, local_matched)
            return
        plan = node.planner.plan(self._plan_input(node, sr, chain, local_matched), self.now)
        if "partition_lookups_skipped" in plan.counters:
            self.m_lookups_skipped += 1
        if isinstance(plan, LookUp):
            self._look_up(node, sr, chain, plan.homes[0])
            return
        sr.answer = None
        if isinstance(plan, Forward):
            if plan.carry is not None:
                # rides on the forwarded request: the next hop decides with it too
                sr.carried = dict(plan.carry)
            est = next((c.matched_tokens for c in plan.ctx.candidates if c.peer == plan.peer), 0)
            self._forward(node, sr, plan.peer, est)
            return
        self._enqueue(node, sr, local_matched)

    @staticmethod
    def _local_match(node: _Node, tokens) -> int:
        """What the node's engine says it holds of ``tokens`` (marks it used)."""
        if node.cache is not None:
            return node.cache.lookup_length(tokens)
        return node.tree.match(tokens).length

    def _plan_input(self, node: _Node, sr: _Req, chain: list[bytes], local_matched: int
                    ) -> PlanInput:
        """What a simulated node knows at decision time (what InferService gathers from its
        engine, heartbeat and trust tracker). Every other node is up, one link away; the
        pick-one baselines draw from every node (the planner does not look up for them)."""
        cfg = self.cfg
        return PlanInput(
            ns=self.ns,
            chain=chain,
            prompt_tokens=len(sr.req.tokens),
            local_matched_tokens=local_matched,
            local_prefill_tps=cfg.prefill_tps,
            local_queue_wait_s=self._queue_wait(node),
            local_load=float(len(node.queue) + (1 if node.busy else 0)),
            avg_request_s=node.svc_mean,
            hop_budget=self.max_hops - sr.hops,
            visited=sr.visited,
            forwarded_in=sr.hops > 0,
            peers=node.links,
            carried=sr.carried,
            answer=sr.answer,
            may_look_up=sr.hops == 0 and not sr.looked_up,
            trust=_TrustOf(node.trust, self.now) if node.trust is not None else {},
            all_peers=self.all_pids if cfg.policy in _EXACT_POOL else None,
        )

    def _forward(self, node: _Node, sr: _Req, peer: bytes, est: int) -> None:
        sr.est_tokens = est
        sr.est_from = node.idx
        if node.trust is not None:
            sr.claims.append((node.idx, peer, est))
        sr.visited = sr.visited | {node.pid}
        sr.hops += 1
        d = self.link_delay()
        sr.back_s += d
        sr.node = self.by_pid[peer]
        self._push(self.now + d, _EV_ARRIVE, sr)

    def _look_up(self, node: _Node, sr: _Req, chain: list[bytes], home_pid: bytes) -> None:
        """Send the planner's lookup to the first home (simulated homes always answer);
        the answer re-plans the request (``_partition_message``)."""
        sr.looked_up = True
        home = self.nodes[self.by_pid[home_pid]]
        p = node.pd.partition(self.ns, chain)
        data = encode_lookup(p, self.ns, chain)
        node.lookup_bytes += len(data)
        self.m_lookups += 1
        self._push(self.now + self.link_delay(), _EV_PART, (_LOOKUP, node, home, sr),
                   (data, (p, self.ns, chain)))  # fmt: skip

    def _oracle_arrive(self, node: _Node, sr: _Req, chain: list[bytes], local_matched: int
                       ) -> None:
        """The oracle baseline decides with exact candidates, no cache view (bench only)."""
        cfg = self.cfg
        hop_budget = self.max_hops - sr.hops
        candidates = (self._oracle_candidates(node, chain)
                      if hop_budget > 0 and cfg.nodes > 1 else [])  # fmt: skip
        _, decision = node.memory.decide(
            node.policy, now=self.now, chain=chain, prompt_tokens=len(sr.req.tokens),
            local_matched_tokens=local_matched, local_prefill_tps=cfg.prefill_tps,
            local_queue_wait_s=self._queue_wait(node),
            local_load=float(len(node.queue) + (1 if node.busy else 0)),
            candidates=candidates, hop_budget=hop_budget, visited=sr.visited,
            forwarded_in=sr.hops > 0,
        )  # fmt: skip
        if decision.action == FORWARD and decision.peer is not None:
            est = next((c.matched_tokens for c in candidates if c.peer == decision.peer), 0)
            self._forward(node, sr, decision.peer, est)
            return
        self._enqueue(node, sr, local_matched)

    def _partition_message(self, head: tuple, body: tuple) -> None:
        kind, src, dst, extra = head
        data, value = body
        decode = self.cfg.decode_messages
        pd = dst.pd
        if kind == _PUSH:
            p, raws = decode_push(data) if decode else value
            try:
                entries, applied = pd.receive_push(src.pid, p, raws, self.now, self.all_pids)
            except OverBudget:  # as the node: unanswered, the origin resends later
                return
            ack = encode_ack(p, entries)
            dst.bytes_sent += len(ack)
            self.m_gossip_msgs += 1
            self._push(self.now + self.link_delay(), _EV_PART, (_ACK, dst, src, None),
                       (ack, (p, entries)))  # fmt: skip
        elif kind == _ACK:
            p, entries = decode_ack(data) if decode else value
            pd.receive_ack(src.pid, p, entries)
        elif kind == _LOOKUP:
            p, ns, chain = decode_lookup(data) if decode else value
            holders = pd.lookup(p, ns, chain)
            answer = encode_lookup_answer(holders)
            dst.lookup_bytes += len(answer)
            self._push(self.now + self.link_delay(), _EV_PART, (_ANSWER, dst, src, extra),
                       (answer, holders))  # fmt: skip
        else:
            holders: list[HolderMatch] = decode_lookup_answer(data) if decode else value
            sr = extra
            dst.pd.take_answer(self.ns, self._chain(sr.req), holders, self.now)
            sr.answer = {h.peer: h.blocks for h in holders}
            self._arrive(sr)

    def _oracle_candidates(self, node: _Node, chain: list[bytes]) -> list[Candidate]:
        cands = []
        for other in self.nodes:
            if other is node:
                continue
            cands.append(
                Candidate(
                    peer=other.pid,
                    matched_tokens=self._true_match_tokens(other, chain),
                    prefill_tps=self.cfg.prefill_tps,
                    queue_wait_s=self._queue_wait(other),
                    load=float(len(other.queue) + (1 if other.busy else 0)),
                    rtt_s=self.rtt_s,
                )
            )
        return cands

    def _service_estimate(self, n_tok: int, matched: int, max_tokens: int) -> float:
        cfg = self.cfg
        reuse = matched if matched >= self.min_reuse else 0
        return (
            (cfg.restore_s if reuse else 0.0)
            + (n_tok - reuse) / cfg.prefill_tps
            + max_tokens / cfg.decode_tps
        )

    def _enqueue(self, node: _Node, sr: _Req, local_matched: int) -> None:
        sr.enqueued_at = self.now
        sr.svc_est = self._service_estimate(len(sr.req.tokens), local_matched, sr.req.max_tokens)
        if sr.hops:
            self.m_forwarded += 1
            self.m_hops += sr.hops
            if node.liar:
                self.m_to_liar += 1
        if node.busy:
            node.queue.append(sr)
            node.queued_work += sr.svc_est
        else:
            self._start(node, sr)

    def _start(self, node: _Node, sr: _Req) -> None:
        cfg = self.cfg
        req = sr.req
        tokens = req.tokens
        n_tok = len(tokens)
        m = node.cache.match(tokens) if node.cache is not None else node.tree.match(tokens).length
        reused = min(m, n_tok - 1)
        if reused < self.min_reuse:
            reused = 0
        restore = cfg.restore_s if reused else 0.0
        prefill = restore + (n_tok - reused) / cfg.prefill_tps
        decode = req.max_tokens / cfg.decode_tps
        svc = prefill + decode
        wait = self.now - (req.arrival_s + self.warmup)
        self.m_ttft.append(wait + prefill + sr.back_s)
        self.m_e2e.append(wait + svc + sr.back_s)
        self.m_reused += reused
        self.m_prompt += n_tok
        if reused:
            self.m_req_hits += 1
        if sr.est_tokens > 0:
            # A false hit: the router's estimate exceeded what the serving node's own tree
            # actually holds when the request starts (stale digest, eviction while queued,
            # or a lie). Compared with the raw match, not the reuse threshold.
            self.m_est_forwards += 1
            if m < sr.est_tokens:
                self.m_false_hits += 1
                self.m_false_hit_tokens += sr.est_tokens - m
        node.busy = True
        node.busy_until = self.now + svc
        node.busy_time += svc
        node.served += 1
        node.svc_mean = 0.9 * node.svc_mean + 0.1 * svc
        node.current = sr
        sr.reused = reused
        self._push(self.now + svc, _EV_DONE, node)

    def _done(self, node: _Node) -> None:
        sr = node.current
        node.current = None
        node.busy = False
        self.m_done += 1
        for router, peer, claimed in sr.claims:  # the FINAL frame reaches each forwarder
            self.nodes[router].trust.observe_cache(
                peer, self.now, claimed_tokens=claimed, cached_tokens=sr.reused)
        req = sr.req
        tokens = req.tokens
        chain = self._chain(req)
        if chain:
            self.recent_chains.append(chain)
        if node.cache is not None:
            # the engine's snapshot and the store's prefix-shared accounting: a branch
            # point becomes its own state, extensions store only their own tokens
            node.cache.save(tokens, lambda n: chain[: n // BLOCK_TOKENS])
        elif node.tree.get(tokens) is None:
            size = len(tokens) * self.cfg.bytes_per_token
            entry = node.tree.insert(tokens, chain, size)
            if entry is not None and chain:
                self._advertise(node, chain)  # liars advertise real ones too
                tb = node.true_blocks
                for h in chain:
                    tb[h] = tb.get(h, 0) + 1
        else:
            node.tree.match(tokens)  # a use, for the eviction order
        if node.queue:
            nxt = node.queue.popleft()
            node.queued_work = max(0.0, node.queued_work - nxt.svc_est)
            self._start(node, nxt)

    # -- gossip --------------------------------------------------------------------------

    def _gossip(self, node: _Node) -> None:
        cfg = self.cfg
        if node.liar:
            self._lie(node)
        node.side.set_local_load(
            LoadFigures(
                queue_depth=len(node.queue),
                active=1 if node.busy else 0,
                prefill_tps=cfg.prefill_tps,
                decode_tps=cfg.decode_tps,
            ),
            cfg.kv_capacity_bytes,
            node.cache.used_bytes if node.cache is not None else node.tree.used_bytes,
        )
        node.gossip_round()

    def _gossip_full(self, node: _Node) -> None:
        cfg = self.cfg
        now = self.now
        node.ae.tick(now)
        for origin in node.ae.expire(now):
            node.index.drop_peer(origin)
        node.index.expire(now)
        n = cfg.nodes
        k = min(cfg.gossip_fanout, n - 1)
        for j in self.rng_gossip.sample(range(n - 1), k):
            peer = self.nodes[j if j < node.idx else j + 1]
            self._send(node, peer, _gossip.open_exchange(node.ae))
        self._push(now + cfg.gossip_interval_s, _EV_GOSSIP, node)

    def _gossip_partitioned(self, node: _Node) -> None:
        cfg = self.cfg
        now = self.now
        pd = node.pd
        pd.tick(now)
        for push in pd.pushes(now, self.all_pids, cfg.gossip_budget_bytes):
            data = encode_push(push.partition, push.records)
            node.bytes_sent += len(data)
            self.m_gossip_msgs += 1
            home = self.nodes[self.by_pid[push.home]]
            self._push(now + self.link_delay(), _EV_PART, (_PUSH, node, home, None),
                       (data, (push.partition, push.records)))  # fmt: skip
        self._push(now + cfg.gossip_interval_s, _EV_GOSSIP, node)

    def _lie(self, node: _Node) -> None:
        """Advertise a few recently requested (hence popular) prefixes without holding them."""
        if not self.recent_chains:
            return
        for _ in range(4):
            chain = self.recent_chains[self.rng_liar.randrange(len(self.recent_chains))]
            self._advertise(node, chain)
            node.lies.append(chain)
        while len(node.lies) > 64:
            self._unadvertise(node, node.lies.popleft())

    def _send(self, src: _Node, dst: _Node, msg: _gossip.Message | None) -> None:
        if msg is None:
            return
        src.bytes_sent += msg.nbytes
        self.m_gossip_msgs += 1
        self._push(self.now + self.link_delay(), _EV_MSG, (src, dst), msg)

    def _message(self, pair: tuple[_Node, _Node], msg: _gossip.Message) -> None:
        src, dst = pair
        cfg = self.cfg
        reply, applied, dropped = _gossip.handle(
            dst.ae, msg, self.now, cfg.gossip_budget_bytes, decode=cfg.decode_messages,
            buckets=cfg.bucket_summaries,
        )  # fmt: skip
        for record in applied:
            if record.origin != dst.pid:
                dst.index.apply(record, self.now)
        for origin in dropped:
            dst.index.drop_peer(origin)
        self._send(dst, src, reply)

    # -- results -------------------------------------------------------------------------

    def _result(self, wall: float) -> SimResult:
        cfg = self.cfg
        wl = self.workload
        n = cfg.nodes
        served = [nd.served for nd in self.nodes]
        busy = [nd.busy_time for nd in self.nodes]
        mean_served = sum(served) / n
        mean_busy = sum(busy) / n
        span = max(1e-9, self.now)
        hit = self.m_reused / self.m_prompt if self.m_prompt else 0.0
        ideal = wl.ideal_hit_ratio()
        total_bytes = sum(nd.bytes_sent for nd in self.nodes)
        cpu = getattr(self, "cpu_seconds", 0.0)
        metrics = {
            "hit_ratio": hit,
            "ideal_hit_ratio": ideal,
            "hit_vs_ideal": hit / ideal if ideal else 0.0,
            "request_hit_fraction": self.m_req_hits / max(1, self.m_done),
            "ttft_s": _stats(self.m_ttft),
            "latency_s": _stats(self.m_e2e),
            "load_imbalance_requests": max(served) / mean_served if mean_served else 0.0,
            "load_imbalance_busy": max(busy) / mean_busy if mean_busy else 0.0,
            "forwarded_fraction": self.m_forwarded / max(1, self.m_done),
            "mean_hops_forwarded": self.m_hops / self.m_forwarded if self.m_forwarded else 0.0,
            "false_hit_rate": self.m_false_hits / self.m_est_forwards
            if self.m_est_forwards
            else 0.0,
            "forwards_with_estimate": self.m_est_forwards,
            "digest_bytes_per_node_s": total_bytes / n / span,
            "gossip_messages": self.m_gossip_msgs,
            "lookups": self.m_lookups,
            "lookups_skipped": self.m_lookups_skipped,
            "lookup_bytes_per_node_s": sum(nd.lookup_bytes for nd in self.nodes) / n / span,
            "forwarded_to_liars": self.m_to_liar,
            "liars": sum(1 for nd in self.nodes if nd.liar),
            "requests_per_wall_minute": self.m_done / wall * 60.0 if wall > 0 else 0.0,
            # the same per CPU minute of this process (the machine may be shared)
            "requests_per_cpu_minute": self.m_done / cpu * 60.0 if cpu > 0 else 0.0,
        }
        conf = asdict(cfg)
        conf["routing"] = asdict(self.routing)
        conf["resolved_max_hops"] = self.max_hops
        conf["resolved_min_reuse_tokens"] = self.min_reuse
        return SimResult(conf, wl.name, self.m_done, span, wall, metrics)


def simulate(workload: Workload, config: SimConfig,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run one simulation (``progress(done, total)`` is called every few seconds)."""
    return Simulator(workload, config, progress).run()


# ---------------------------------------------------------------------------- convergence


def measure_convergence(
    nodes: int,
    *,
    fanout: int = 2,
    interval_s: float = 1.0,
    delay_ms: float = 2.0,
    seed: int = 0,
    max_intervals: float = 60.0,
    min_record_interval_s: float = 0.0,
    bucket_summaries: bool = False,
    partitions: int = 0,
    replicas: int = 3,
) -> dict:
    """Time for a new prefix cached at one node to be known to all others (no requests).

    With ``partitions``: the time until every home of the prefix's partition indexes it
    (from then on any router's lookup finds it; a router holding a cached answer for the
    same key block sees it at most ``lookup_ttl_s`` later).

    N nodes start converged (every node holds every other's records), gossip for two
    intervals, then node 0 caches a new prefix; the result is when the last node's ``PeerCacheIndex`` first matches it, in
    seconds and in gossip intervals, with the bound ``2 ln(N+1)/fanout + 2`` intervals.
    """
    wl = Workload("convergence", [], "none")
    cfg = SimConfig(
        nodes=nodes, policy="local", delay_ms=delay_ms, gossip_interval_s=interval_s,
        gossip_fanout=fanout, seed=seed,
        min_record_interval_s=min_record_interval_s, bucket_summaries=bucket_summaries,
        partitions=partitions, replicas=replicas,
    )  # fmt: skip
    sim = Simulator(wl, cfg)
    if partitions:
        return _partition_convergence(sim, nodes, fanout, interval_s, seed, max_intervals)
    wall0 = time.perf_counter()
    with memoised_record_decoding(), memoised_partition_homes():
        # Warm-up by pre-seeding: every node receives every other node's current signed
        # records through AntiEntropy.receive, i.e. the converged state gossip reaches
        # after O(log N) rounds, without paying for those rounds at N=1024.
        own = [[s.raw for s in n.ae.held_records(n.pid)] for n in sim.nodes]
        for n in sim.nodes:
            raws = [raw for j, rs in enumerate(own) if j != n.idx for raw in rs]
            for record in n.ae.receive(raws, 0.0).applied:
                n.index.apply(record, 0.0)
        for n in sim.nodes:
            sim._push(sim.rng_gossip.uniform(0, interval_s), _EV_GOSSIP, n)

        def run_until(pred, t_max: float) -> bool:
            while sim.heap and sim.heap[0][0] <= t_max:
                t, _, kind, a, b = heapq.heappop(sim.heap)
                sim.now = t
                sim._dispatch(kind, a, b)
                if pred():
                    return True
            return pred()

        everyone = nodes - 1

        def all_known() -> bool:
            return all(len(n.index) >= everyone for n in sim.nodes)

        warm_ok = all_known()
        t0 = 2 * interval_s  # let one round of exchanges settle first
        run_until(lambda: False, t0)
        sim.now = t0
        rng = random.Random(seed + 1)
        tokens = tuple(rng.randrange(50_000) for _ in range(64))
        chain = chain_hashes(sim.ns_key, tokens)
        src = sim.nodes[0]
        src.ae.local_add_prefix(sim.ns, chain)
        bytes0 = sum(n.bytes_sent for n in sim.nodes)
        pending = {n.idx for n in sim.nodes[1:]}
        t_known: dict[int, float] = {}

        # Checking every node after every event is O(N) per event: check after each
        # message delivered to a still-pending node instead.
        while sim.heap and pending and sim.heap[0][0] <= t0 + max_intervals * interval_s:
            t, _, kind, a, b = heapq.heappop(sim.heap)
            sim.now = t
            sim._dispatch(kind, a, b)
            if kind == _EV_MSG:
                dst = a[1]
                if dst.idx in pending and dst.index.longest_match(src.pid, sim.ns, chain) >= len(
                    chain
                ):
                    pending.discard(dst.idx)
                    t_known[dst.idx] = sim.now - t0
        t_all = max(t_known.values()) if not pending and t_known else float("inf")
        span = max(1e-9, sim.now - t0)
        bytes1 = sum(n.bytes_sent for n in sim.nodes)
    return _convergence_result(nodes, fanout, interval_s, warm_ok, pending, t_known, t_all,
                               (bytes1 - bytes0) / nodes / span, wall0)


def _convergence_result(nodes, fanout, interval_s, warm_ok, pending, t_known, t_all,
                        bytes_per_node_s, wall0, **extra) -> dict:
    bound = 2 * math.log(nodes + 1) / fanout + 2
    return {
        "nodes": nodes,
        "fanout": fanout,
        "interval_s": interval_s,
        **extra,
        "warmup_complete": warm_ok,
        "converged": not pending,
        "convergence_s": t_all,
        "convergence_intervals": t_all / interval_s,
        "bound_intervals": bound,
        "within_bound": t_all / interval_s <= bound,
        "median_known_s": percentile(sorted(t_known.values()), 50) if t_known else float("inf"),
        "digest_bytes_per_node_s": bytes_per_node_s,
        "wall_s": time.perf_counter() - wall0,
    }


def _partition_convergence(
    sim: Simulator, nodes: int, fanout: int, interval_s: float, seed: int, max_intervals: float
) -> dict:
    """measure_convergence with partitioned digests: until every home indexes the prefix."""
    wall0 = time.perf_counter()
    with memoised_record_decoding(), memoised_partition_homes():
        for n in sim.nodes:
            sim._push(sim.rng_gossip.uniform(0, interval_s), _EV_GOSSIP, n)
        rng = random.Random(seed + 1)
        # at a random phase of the source's gossip round (it pushes on its next tick)
        t0 = (2 + rng.random()) * interval_s
        tokens = tuple(rng.randrange(50_000) for _ in range(64))
        chain = chain_hashes(sim.ns_key, tokens)
        src = sim.nodes[0]
        p = src.pd.partition(sim.ns, chain)
        homes = [sim.nodes[sim.by_pid[h]] for h in src.pd.homes(p, sim.all_pids)]
        pending = {h.idx for h in homes if h is not src}
        t_known: dict[int, float] = {}
        added = False
        bytes0 = 0
        t_end = t0 + max_intervals * interval_s
        while sim.heap and pending and sim.heap[0][0] <= t_end:
            t, _, kind, a, b = heapq.heappop(sim.heap)
            if not added and t >= t0:
                sim.now = t0
                src.pd.local_add_prefix(sim.ns, chain, t0)
                bytes0 = sum(n.bytes_sent for n in sim.nodes)
                added = True
            sim.now = t
            sim._dispatch(kind, a, b)
            if kind == _EV_PART:
                dst = a[2]
                index = dst.pd.indexes.get(p)
                if (added and dst.idx in pending and index is not None
                        and index.longest_match(src.pid, sim.ns, chain) >= len(chain)):
                    pending.discard(dst.idx)
                    t_known[dst.idx] = sim.now - t0
        t_all = max(t_known.values()) if not pending and t_known else float("inf")
        span = max(1e-9, sim.now - t0)
        bytes1 = sum(n.bytes_sent for n in sim.nodes)
    return _convergence_result(nodes, fanout, interval_s, True, pending, t_known, t_all,
                               (bytes1 - bytes0) / nodes / span, wall0,
                               partitions=sim.cfg.partitions, replicas=sim.cfg.replicas)


def measure_idle_digest(
    nodes: int,
    *,
    duration_s: float = 120.0,
    fanout: int = 3,
    interval_s: float = 1.0,
    prefixes_per_node: int = 20,
    seed: int = 0,
    min_record_interval_s: float = 0.0,
    bucket_summaries: bool = False,
    compaction_ratio: float = 1.0,
    refresh_interval_s: float = SimConfig.refresh_interval_s,
    digest_ttl_s: float = SimConfig.digest_ttl_s,
    partitions: int = 0,
    partition_refresh_s: float = SimConfig.partition_refresh_s,
) -> dict:
    """Digest bytes/s per node of an idle, converged swarm (no requests).

    Every node caches ``prefixes_per_node`` distinct 16-block prefixes, all nodes start
    converged (pre-seeded as in :func:`measure_convergence`), then gossip runs for
    ``duration_s``; only the second half is counted, so the cost is that of refresh
    records and of the summaries they make differ.
    """
    wl = Workload("idle", [], "none")
    cfg = SimConfig(
        nodes=nodes, policy="local", gossip_interval_s=interval_s, gossip_fanout=fanout,
        seed=seed, min_record_interval_s=min_record_interval_s,
        bucket_summaries=bucket_summaries, compaction_ratio=compaction_ratio,
        refresh_interval_s=refresh_interval_s, digest_ttl_s=digest_ttl_s,
        partitions=partitions, partition_refresh_s=partition_refresh_s,
        partition_ttl_s=min(3600.0, 3 * partition_refresh_s),
    )  # fmt: skip
    sim = Simulator(wl, cfg)
    wall0 = time.perf_counter()
    rng = random.Random(seed + 2)
    with memoised_record_decoding(), memoised_partition_homes():
        for n in sim.nodes if partitions else ():
            # partitioned: nothing to pre-seed, the first pushes go out in the first round
            # (the first half of the run, not counted)
            for _ in range(prefixes_per_node):
                tokens = tuple(rng.randrange(50_000) for _ in range(16 * 16))
                n.pd.local_add_prefix(sim.ns, chain_hashes(sim.ns_key, tokens), 0.0)
            sim._push(sim.rng_gossip.uniform(0, interval_s), _EV_GOSSIP, n)
        for n in () if partitions else sim.nodes:
            for _ in range(prefixes_per_node):
                tokens = tuple(rng.randrange(50_000) for _ in range(16 * 16))
                n.ae.local_add_prefix(sim.ns, chain_hashes(sim.ns_key, tokens))
            n.ae.tick(0.0)
        own = [[s.raw for s in n.ae.held_records(n.pid)] for n in sim.nodes]
        for n in sim.nodes:
            raws = [raw for j, rs in enumerate(own) if j != n.idx for raw in rs]
            for record in n.ae.receive(raws, 0.0).applied:
                n.index.apply(record, 0.0)
            sim._push(sim.rng_gossip.uniform(0, interval_s), _EV_GOSSIP, n)
        half = duration_s / 2
        bytes_half = None
        while sim.heap and sim.heap[0][0] <= duration_s:
            t, _, kind, a, b = heapq.heappop(sim.heap)
            if bytes_half is None and t > half:
                bytes_half = sum(n.bytes_sent for n in sim.nodes)
            sim.now = t
            sim._dispatch(kind, a, b)
        total = sum(n.bytes_sent for n in sim.nodes)
    return {
        "nodes": nodes,
        "fanout": fanout,
        "interval_s": interval_s,
        "bucket_summaries": bucket_summaries,
        "min_record_interval_s": min_record_interval_s,
        "compaction_ratio": compaction_ratio,
        "refresh_interval_s": refresh_interval_s,
        "partitions": partitions,
        "digest_bytes_per_node_s": (total - (bytes_half or 0)) / nodes / (duration_s - half),
        "wall_s": time.perf_counter() - wall0,
    }


# ---------------------------------------------------------------------------- CLI


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``prefixmesh bench sim`` (shared with ``python -m prefixmesh.bench.sim``)."""
    d = SimConfig()
    p.add_argument("--workload", default="mmlu",
                   help="mmlu | mmlu-gen | sharegpt | synthetic | PATH (generic JSONL)")
    p.add_argument("--shared-dir", default=None,
                   help="folder holding workloads/ (default $PREFIXMESH_SHARED_DIR or ../shared)")
    p.add_argument("--tokenizer", default="auto", choices=["auto", "llama", "proxy"])
    p.add_argument("--requests", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--zipf-alpha", type=float, default=None)
    p.add_argument("--rate", type=float, default=None,
                   help="arrival rate, requests/s (generated workloads: mmlu-gen, synthetic, sharegpt)")
    p.add_argument("--rate-factor", type=float, default=1.0,
                   help="divide every arrival time by this (0.25: the MMLU trace at 1 req/s)")
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--policy", default=d.policy)
    p.add_argument("--delay-ms", type=float, default=d.delay_ms, help="one-way link delay")
    p.add_argument("--jitter-ms", type=float, default=d.jitter_ms)
    p.add_argument("--prefill-tps", type=float, default=d.prefill_tps)
    p.add_argument("--decode-tps", type=float, default=d.decode_tps)
    p.add_argument("--restore-s", type=float, default=d.restore_s)
    p.add_argument("--kv-capacity-mb", type=float, default=d.kv_capacity_bytes / 2**20)
    p.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction,
                   default=d.prefix_sharing,
                   help="KV accounting of the store: a shared prefix is stored once "
                        "(--no-prefix-sharing: one whole state per cached prompt)")
    p.add_argument("--gossip-interval", type=float, default=d.gossip_interval_s)
    p.add_argument("--fanout", type=int, default=d.gossip_fanout)
    p.add_argument("--min-record-interval", type=float, default=d.min_record_interval_s,
                   help="at most one own digest delta per this many seconds (0: every tick)")
    p.add_argument("--compaction-ratio", type=float, default=d.compaction_ratio,
                   help="issue an own snapshot when the deltas since the last outweigh it "
                        "this many times")
    p.add_argument("--bucket-summaries", action=argparse.BooleanOptionalAction,
                   default=d.bucket_summaries,
                   help="compare bucket hashes first, then only the differing buckets' entries "
                        "(the node's default: on)")
    p.add_argument("--partitions", type=int, default=d.partitions,
                   help="partial replication: P digest partitions by chain root, each kept at "
                        "--replicas home nodes (0: full replication, the node's behaviour)")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--lookup-ttl", type=float, default=d.lookup_ttl_s,
                   help="seconds a router keeps a home's lookup answer (partitioned digests)")
    p.add_argument("--partition-refresh", type=float, default=d.partition_refresh_s,
                   help="refresh interval of partition streams, seconds (their TTL is 3x)")
    p.add_argument("--max-hops", type=int, default=None)
    p.add_argument("--liars", type=float, default=0.0, help="fraction of lying nodes")
    p.add_argument("--trust-feedback", action="store_true",
                   help="routers keep the node's TrustTracker, fed what was really reused")
    p.add_argument("--ski-rental", action=argparse.BooleanOptionalAction, default=None,
                   help="serve a prefix locally once the RTT paid forwarding it exceeds a miss "
                        "(routing default: on)")
    p.add_argument("--placement-bound", action=argparse.BooleanOptionalAction, default=True,
                   help="bound each router's smoothed placements per node (routing default: on)")
    p.add_argument("--load-slack", type=float, default=RoutingConfig().load_slack,
                   help="requests above the mean load a candidate may carry regardless of the "
                        "bound")
    p.add_argument("--entry", default=d.entry, choices=["random", "round-robin", "first"])
    p.add_argument("--seed", type=int, default=0,
                   help="the simulation's randomness (entry nodes, gossip partners, link "
                        "jitter, identities) and, unless --workload-seed, the workload's")
    p.add_argument("--workload-seed", type=int, default=None,
                   help="the workload's seed alone: for mmlu, 0 is the shared trace itself and "
                        "any other value regenerates one (mmlu-gen: subjects re-ranked, "
                        "questions drawn again); --seed S --workload-seed 0 runs the trace "
                        "under another simulation seed")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


def config_from_args(ns: argparse.Namespace) -> SimConfig:
    return SimConfig(
        nodes=ns.nodes,
        policy=ns.policy,
        delay_ms=ns.delay_ms,
        jitter_ms=ns.jitter_ms,
        prefill_tps=ns.prefill_tps,
        decode_tps=ns.decode_tps,
        restore_s=ns.restore_s,
        kv_capacity_bytes=int(ns.kv_capacity_mb * 2**20),
        prefix_sharing=ns.prefix_sharing,
        gossip_interval_s=ns.gossip_interval,
        gossip_fanout=ns.fanout,
        min_record_interval_s=ns.min_record_interval,
        bucket_summaries=ns.bucket_summaries,
        compaction_ratio=ns.compaction_ratio,
        max_hops=ns.max_hops,
        partitions=ns.partitions,
        replicas=ns.replicas,
        lookup_ttl_s=ns.lookup_ttl,
        partition_refresh_s=ns.partition_refresh,
        partition_ttl_s=min(3600.0, 3 * ns.partition_refresh),
        liar_fraction=ns.liars,
        trust_feedback=ns.trust_feedback,
        ski_rental=ns.ski_rental,
        entry=ns.entry,
        seed=ns.seed,
        routing=RoutingConfig(bound_placements=ns.placement_bound, load_slack=ns.load_slack),
    )


def run_bench_sim(ns: argparse.Namespace) -> int:
    """``prefixmesh bench sim``: run one simulation and print its metrics."""
    from .workloads import WorkloadError, load_workload  # noqa: PLC0415

    try:
        wl = load_workload(
            ns.workload, n_requests=ns.requests, shared=ns.shared_dir, tokenizer=ns.tokenizer,
            alpha=ns.zipf_alpha, rate=ns.rate,
            seed=ns.seed if ns.workload_seed is None else ns.workload_seed,
        )  # fmt: skip
        if ns.rate_factor != 1.0:
            if not ns.rate_factor > 0:
                raise ValueError("--rate-factor must be > 0")
            wl = wl.scaled(ns.rate_factor)
        cfg = config_from_args(ns)
        result = simulate(wl, cfg, progress=lambda done, total: print(
            f"bench sim: {done}/{total} requests", file=sys.stderr, flush=True))
    except (WorkloadError, ValueError) as exc:
        print(f"prefixmesh bench sim: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(result.to_json())
        return 0
    m = result.metrics
    print(
        f"{result.workload}: {result.requests} requests, N={cfg.nodes}, policy={cfg.policy}, "
        f"delay={cfg.delay_ms:g} ms one-way\n"
        f"  hit ratio {m['hit_ratio']:.3f} (ideal {m['ideal_hit_ratio']:.3f}, "
        f"{m['hit_vs_ideal']:.3f} x ideal); {m['request_hit_fraction']:.1%} of requests hit\n"
        f"  latency mean {m['latency_s']['mean']:.3f}s p50 {m['latency_s']['p50']:.3f}s "
        f"p99 {m['latency_s']['p99']:.3f}s; TTFT mean {m['ttft_s']['mean']:.3f}s\n"
        f"  load max/mean {m['load_imbalance_requests']:.2f} (busy {m['load_imbalance_busy']:.2f});"
        f" forwarded {m['forwarded_fraction']:.3f}; false hits {m['false_hit_rate']:.3f}\n"
        f"  digest {m['digest_bytes_per_node_s']:.0f} B/s per node"
        f" (+ lookups {m['lookup_bytes_per_node_s']:.0f} B/s); "
        f"{m['requests_per_wall_minute']:.0f} simulated requests per wall minute"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.sim", description=__doc__)
    add_sim_arguments(p)
    return run_bench_sim(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
