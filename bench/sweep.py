"""Parameter sweeps over the simulator: CSV tables, PNG plots and a markdown summary.

``python -m prefixmesh.bench.sweep --out docs/bench [--experiments delay,skew,...]``

Experiments (each writes ``<out>/sim_<name>.csv``; plots go to ``--plots`` (default
``<out>/../plots``) and need matplotlib, imported only when plotting):

``delay``        reproduction: MMLU trace (stretched to 1 req/s), N=4, 512 MiB/node: hit
                 ratio and mean latency vs RTT for client-side round-robin, the paper's
                 rule, prefixmesh, local-only and the oracle.
``load``         the same at the trace's nominal 4 req/s and at 2 req/s.
``capacity``     hit ratio / ideal vs KV capacity per node.
``skew``         MMLU regenerated with Zipf alpha in {0.6, 1.0, 1.5, 2.0}, N=8: load
                 imbalance (max/mean requests per node) and hit ratio / ideal.
``scale``        MMLU regenerated, 0.5 req/s per node, N in {4, 16, 64, 256}.
``convergence``  no requests, N in {16, 64, 256, 1024}: time until a new prefix is known
                 to all nodes, vs the bound 2 ln(N+1)/fanout + 2 intervals; digest bytes/s.
``digest``       N=64: digest bytes/s and hits vs gossip interval and fanout.
``speed``        simulated requests per wall-clock minute at N=64.
``t7``           digest bytes/s per node (idle and at 0.5 req/s per node) and hits for
                 the anti-entropy variants: full summaries, bucketed summaries, and the
                 digest-rate knobs; N in {4, 64, 256}.
``liars``        N=64, 0 / 10 % / 30 % lying peers: hit ratio per policy.
``sharegpt``     multi-turn chat (needs the internal ShareGPT file), N=8.
``targets``      the prefixmesh targets re-run at the node's default 9 GiB KV budget.
``ski``          the ski-rental warming proposal (``SimConfig.ski_rental``) vs delay/capacity.

``--quick`` shrinks every experiment to a few hundred synthetic requests (the CI harness
test); its numbers mean nothing. The markdown summary (``<out>/sim.md``) is regenerated
from the CSVs; text after the line ``<!-- analysis -->`` in an existing file is kept.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .sim import SimConfig, measure_convergence, measure_idle_digest, simulate
from .workloads import Workload, WorkloadError, load_workload, synthetic_workload

__all__ = ["EXPERIMENTS", "run_sweep", "main"]

ANALYSIS_MARKER = "<!-- analysis -->"
DELAY_POLICIES = ["round-robin", "paper", "prefixmesh", "local", "consistent-hash", "oracle"]


class Ctx:
    """What every experiment needs: options, a workload cache, output paths."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.quick: bool = ns.quick
        self.out = Path(ns.out)
        self.plots = Path(ns.plots) if ns.plots else self.out.parent / "plots"
        self._wl: dict[tuple, Workload] = {}

    def log(self, msg: str) -> None:
        print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def workload(self, kind: str, n: int, alpha: float | None = None, rate: float | None = None,
                 seed: int = 0) -> Workload:  # fmt: skip
        key = (kind, n, alpha, rate, seed)
        if key not in self._wl:
            if self.quick:
                wl = synthetic_workload(
                    n, rate=rate or 4.0, alpha=alpha or 1.0, seed=seed, n_docs=40, n_system=4
                )
            else:
                wl = load_workload(
                    kind, n_requests=n, shared=self.ns.shared_dir, tokenizer=self.ns.tokenizer,
                    alpha=alpha, rate=rate, seed=seed,
                )  # fmt: skip
            self._wl[key] = wl
        return self._wl[key]


def _row(exp: str, cfg: SimConfig, res, **extra) -> dict:
    m = res.metrics
    row = {
        "experiment": exp,
        "policy": cfg.policy,
        "nodes": cfg.nodes,
        "delay_ms": cfg.delay_ms,
        "rtt_ms": 2 * cfg.delay_ms,
        "requests": res.requests,
        "hit_ratio": round(m["hit_ratio"], 4),
        "ideal_hit_ratio": round(m["ideal_hit_ratio"], 4),
        "hit_vs_ideal": round(m["hit_vs_ideal"], 4),
        "request_hit_fraction": round(m["request_hit_fraction"], 4),
        "latency_mean_s": round(m["latency_s"]["mean"], 4),
        "latency_p50_s": round(m["latency_s"]["p50"], 4),
        "latency_p99_s": round(m["latency_s"]["p99"], 4),
        "ttft_mean_s": round(m["ttft_s"]["mean"], 4),
        "load_imbalance": round(m["load_imbalance_requests"], 3),
        "busy_imbalance": round(m["load_imbalance_busy"], 3),
        "forwarded": round(m["forwarded_fraction"], 4),
        "false_hit_rate": round(m["false_hit_rate"], 4),
        "digest_Bps_per_node": round(m["digest_bytes_per_node_s"], 1),
        "req_per_wall_min": round(m["requests_per_wall_minute"]),
        "lookup_Bps_per_node": round(m.get("lookup_bytes_per_node_s", 0.0), 1),
    }
    row.update(extra)
    return row


# ---------------------------------------------------------------------------- experiments

# (label, policy, entry): "round-robin" is the reference paper's baseline, a client-side
# load balancer that sends request i to node i mod N (no forwarding hop); every other
# variant lets requests enter at a uniformly random node that routes them.
PAPER_VARIANTS = [
    ("round-robin", "local", "round-robin"),
    ("paper", "paper", "random"),
    ("prefixmesh", "prefixmesh", "random"),
    ("local", "local", "random"),
    ("oracle", "oracle", "random"),
]
EXTRA_VARIANTS = [
    ("round-robin (mesh hop)", "round-robin", "random"),
    ("random", "random", "random"),
    ("consistent-hash", "consistent-hash", "random"),
]
REPRO_RATE_FACTOR = 0.25  # the trace's 4 req/s stretched to 1 req/s (see sim.md)
PER_NODE_RATE = 0.5  # req/s per node in the skew / scale / liars experiments


def _n(ctx: Ctx, default: int, quick: int = 300) -> int:
    if ctx.quick:
        return quick
    return ctx.ns.requests if ctx.ns.requests else default


def _run(ctx: Ctx, exp: str, wl: Workload, label: str, cfg: SimConfig, **extra) -> dict:
    res = simulate(wl, cfg)
    row = _row(exp, cfg, res, label=label, entry=cfg.entry, **extra)
    ctx.log(f"{exp} {label} N={cfg.nodes} d={cfg.delay_ms:g}ms {extra}: hit "
            f"{row['hit_ratio']:.3f} ({row['hit_vs_ideal']:.3f} x ideal) lat "
            f"{row['latency_mean_s']:.3f}s imb {row['load_imbalance']:.2f} "
            f"[{res.wall_seconds:.0f}s wall]")  # fmt: skip
    return row


def _repro_workload(ctx: Ctx, n: int, rate_factor: float = REPRO_RATE_FACTOR) -> Workload:
    wl = ctx.workload("mmlu", n)
    return wl if ctx.quick or rate_factor == 1 else wl.scaled(rate_factor)


def exp_delay(ctx: Ctx) -> list[dict]:
    """Reproduction: MMLU trace at 1 req/s, N=4, 512 MiB per node, delay swept."""
    wl = _repro_workload(ctx, _n(ctx, 5000, 200))
    delays = [1, 100] if ctx.quick else [1, 10, 25, 50, 100, 150, 250, 500]
    rows = []
    for label, pol, entry in PAPER_VARIANTS:
        for d in delays:
            cfg = SimConfig(nodes=4, policy=pol, entry=entry, delay_ms=d, seed=ctx.ns.seed)
            rows.append(_run(ctx, "delay", wl, label, cfg))
    for label, pol, entry in [] if ctx.quick else EXTRA_VARIANTS:
        cfg = SimConfig(nodes=4, policy=pol, entry=entry, delay_ms=1, seed=ctx.ns.seed)
        rows.append(_run(ctx, "delay", wl, label, cfg))
    return rows


def exp_load(ctx: Ctx) -> list[dict]:
    """The same trace at its nominal 4 req/s (and 2 req/s): N=4, 1 ms one-way."""
    n = _n(ctx, 5000, 200)
    rows = []
    for factor in [0.5, 1.0]:
        wl = _repro_workload(ctx, n, factor)
        for label, pol, entry in PAPER_VARIANTS:
            cfg = SimConfig(nodes=4, policy=pol, entry=entry, delay_ms=1, seed=ctx.ns.seed)
            rows.append(_run(ctx, "load", wl, label, cfg, rate_rps=4.0 * factor))
    return rows


def exp_capacity(ctx: Ctx) -> list[dict]:
    """Hit ratio vs KV capacity per node (N=4, 1 ms, 1 req/s): what limits the hit ratio."""
    wl = _repro_workload(ctx, _n(ctx, 3000, 200))
    caps = [256, 9216] if ctx.quick else [256, 512, 1024, 2048, 9216]
    rows = []
    for label, pol, entry in PAPER_VARIANTS:
        if label == "local":
            continue
        for mib in caps:
            cfg = SimConfig(nodes=4, policy=pol, entry=entry, delay_ms=1,
                            kv_capacity_bytes=mib * 2**20, seed=ctx.ns.seed)  # fmt: skip
            rows.append(_run(ctx, "capacity", wl, label, cfg, kv_capacity_mib=mib))
    return rows


def exp_skew(ctx: Ctx) -> list[dict]:
    n_nodes = 4 if ctx.quick else 8
    alphas = [1.0, 2.0] if ctx.quick else [0.6, 1.0, 1.5, 2.0]
    rows = []
    for alpha in alphas:
        wl = ctx.workload("mmlu-gen", _n(ctx, 4000), alpha=alpha, rate=PER_NODE_RATE * n_nodes)
        for label, pol, entry in PAPER_VARIANTS + EXTRA_VARIANTS[2:]:
            if label in ("local",):
                continue
            cfg = SimConfig(nodes=n_nodes, policy=pol, entry=entry, seed=ctx.ns.seed)
            rows.append(_run(ctx, "skew", wl, label, cfg, zipf_alpha=alpha))
    return rows


def exp_scale(ctx: Ctx) -> list[dict]:
    sizes = [4, 8] if ctx.quick else [4, 16, 64, 256]
    rows = []
    for n in sizes:
        n_req = _n(ctx, max(4000, 40 * n))
        wl = ctx.workload("mmlu-gen", n_req, alpha=1.0, rate=PER_NODE_RATE * n)
        variants = [v for v in PAPER_VARIANTS if v[0] in ("round-robin", "paper", "prefixmesh")]
        if n <= 16:
            variants += [v for v in PAPER_VARIANTS if v[0] == "oracle"]
        for label, pol, entry in variants:
            cfg = SimConfig(nodes=n, policy=pol, entry=entry, seed=ctx.ns.seed)
            rows.append(_run(ctx, "scale", wl, label, cfg))
    return rows


def exp_convergence(ctx: Ctx) -> list[dict]:
    sizes = [8, 16] if ctx.quick else [16, 64, 256, 1024]
    rows = []
    for n in sizes:
        for fanout in [3] if ctx.quick or n > 256 else [2, 3]:
            r = measure_convergence(n, fanout=fanout, interval_s=1.0, seed=ctx.ns.seed)
            r = {"experiment": "convergence", **{k: (round(v, 4) if isinstance(v, float) else v)
                                                 for k, v in r.items()}}  # fmt: skip
            rows.append(r)
            ctx.log(f"convergence N={n} f={fanout}: {r['convergence_intervals']} intervals "
                    f"(bound {r['bound_intervals']}), {r['digest_bytes_per_node_s']} B/s "
                    f"[{r['wall_s']:.0f}s wall]")  # fmt: skip
    return rows


def exp_digest(ctx: Ctx) -> list[dict]:
    """Digest traffic and hits vs gossip interval and fanout (N=64, prefixmesh)."""
    n = 8 if ctx.quick else 64
    wl = ctx.workload("mmlu-gen", _n(ctx, 4000), alpha=1.0, rate=PER_NODE_RATE * n)
    rows = []
    for interval in [1.0, 5.0] if ctx.quick else [1.0, 2.0, 5.0, 10.0]:
        for fanout in [1, 3]:
            cfg = SimConfig(nodes=n, policy="prefixmesh", gossip_interval_s=interval,
                            gossip_fanout=fanout, seed=ctx.ns.seed)  # fmt: skip
            rows.append(_run(ctx, "digest", wl, "prefixmesh", cfg, interval_s=interval,
                             fanout=fanout))  # fmt: skip
    return rows


def exp_speed(ctx: Ctx) -> list[dict]:
    n = 8 if ctx.quick else 64
    n_req = _n(ctx, 10_000)
    rows = []
    for per_node in [PER_NODE_RATE, 4.0]:
        wl = ctx.workload("mmlu-gen", n_req, alpha=1.0, rate=per_node * n)
        wl.ideal_per_request()  # not part of the timed run
        cfg = SimConfig(nodes=n, policy="prefixmesh", seed=ctx.ns.seed)
        res = simulate(wl, cfg)
        rows.append(_row("speed", cfg, res, label="prefixmesh", rate_per_node=per_node,
                         wall_s=round(res.wall_seconds, 2)))  # fmt: skip
        ctx.log(f"speed N={n} {per_node} req/s/node: "
                f"{res.metrics['requests_per_wall_minute']:.0f} req/min")
    return rows


def exp_liars(ctx: Ctx) -> list[dict]:
    n = 8 if ctx.quick else 64
    wl = ctx.workload("mmlu-gen", _n(ctx, 6000), alpha=1.0, rate=PER_NODE_RATE * n)
    rows = []
    for frac in [0.0, 0.25] if ctx.quick else [0.0, 0.1, 0.3]:
        for pol, trust in [("prefixmesh", False), ("prefixmesh", True), ("paper", False)]:
            label = pol + (" + trust feedback" if trust else "")
            cfg = SimConfig(nodes=n, policy=pol, liar_fraction=frac, trust_feedback=trust,
                            seed=ctx.ns.seed)  # fmt: skip
            res = simulate(wl, cfg)
            rows.append(_row("liars", cfg, res, label=label, liar_fraction=frac,
                             forwarded_to_liars=res.metrics["forwarded_to_liars"]))  # fmt: skip
            ctx.log(f"liars {frac} {label}: hit {res.metrics['hit_ratio']:.3f}")
    return rows


def exp_sharegpt(ctx: Ctx) -> list[dict]:
    """Multi-turn chat (ShareGPT, internal only), N=8, 0.25 req/s per node."""
    n_nodes = 8
    wl = ctx.workload("sharegpt", _n(ctx, 3000), rate=0.25 * n_nodes)
    rows = []
    for label, pol, entry in PAPER_VARIANTS:
        cfg = SimConfig(nodes=n_nodes, policy=pol, entry=entry, seed=ctx.ns.seed)
        rows.append(_run(ctx, "sharegpt", wl, label, cfg))
    return rows


NODE_DEFAULT_KV_MIB = 9216  # the node's default KV budget: 1 GiB RAM + 8 GiB disk tier


def exp_targets(ctx: Ctx) -> list[dict]:
    """The prefixmesh targets at the node's default KV budget (the other experiments use
    512 MiB, the paper's cache-starved regime); one row per run, labelled by target."""
    kv = (256 if ctx.quick else NODE_DEFAULT_KV_MIB) * 2**20
    seed = ctx.ns.seed
    rows = []
    trace = _repro_workload(ctx, _n(ctx, 5000, 200))
    runs = [
        ("T1/T3 N=4 hits, latency vs round-robin", trace, "round-robin", "local", "round-robin", 1),
        ("T1/T3 N=4 hits, latency vs round-robin", trace, "prefixmesh", "prefixmesh", "random", 1),
        ("T4 vs local-only at 500 ms", trace, "local", "local", "random", 500),
        ("T4 vs local-only at 500 ms", trace, "prefixmesh", "prefixmesh", "random", 500),
    ]
    nominal = _repro_workload(ctx, _n(ctx, 5000, 200), 1.0)
    runs += [
        ("T3 at the trace's 4 req/s", nominal, "round-robin", "local", "round-robin", 1),
        ("T3 at the trace's 4 req/s", nominal, "prefixmesh", "prefixmesh", "random", 1),
    ]
    runs += [("T4 vs local-only at 500 ms", trace, "prefixmesh + ski rental", "prefixmesh",
              "random", 500)]
    skew_n = 4 if ctx.quick else 8
    skewed = ctx.workload("mmlu-gen", _n(ctx, 4000), alpha=1.5, rate=PER_NODE_RATE * skew_n)
    runs += [("T5 Zipf 1.5, N=8", skewed, "prefixmesh", "prefixmesh", "random", 1)]
    for target, wl, label, pol, entry, d in runs:
        nodes = skew_n if target.startswith("T5") else 4
        cfg = SimConfig(nodes=nodes, policy=pol, entry=entry, delay_ms=d, kv_capacity_bytes=kv,
                        ski_rental="ski" in label, seed=seed)  # fmt: skip
        rows.append(_run(ctx, "targets", wl, label, cfg, target=target,
                         kv_capacity_mib=kv // 2**20))  # fmt: skip
    big = 8 if ctx.quick else 256
    wl = ctx.workload("mmlu-gen", _n(ctx, max(4000, 40 * big)), alpha=1.0,
                      rate=PER_NODE_RATE * big)  # fmt: skip
    cfg = SimConfig(nodes=big, policy="prefixmesh", kv_capacity_bytes=kv, seed=seed)
    rows.append(_run(ctx, "targets", wl, "prefixmesh", cfg, target="T2 N=256 hits",
                     kv_capacity_mib=kv // 2**20))  # fmt: skip
    return rows


def exp_ski(ctx: Ctx) -> list[dict]:
    """The ski-rental proposal vs plain prefixmesh and local-only, over delay and capacity."""
    wl = _repro_workload(ctx, _n(ctx, 5000, 200))
    rows = []
    for mib in [512, NODE_DEFAULT_KV_MIB]:
        for d in [1, 100] if ctx.quick else [1, 50, 100, 250, 500]:
            for label, pol, ski in [("local", "local", False), ("prefixmesh", "prefixmesh", False),
                                    ("prefixmesh + ski rental", "prefixmesh", True)]:  # fmt: skip
                cfg = SimConfig(nodes=4, policy=pol, delay_ms=d, ski_rental=ski,
                                kv_capacity_bytes=mib * 2**20, seed=ctx.ns.seed)  # fmt: skip
                rows.append(_run(ctx, "ski", wl, label, cfg, kv_capacity_mib=mib))
    return rows

# (label, SimConfig overrides) of the T7 experiment; each starts from the plain exchange
# (no buckets, compaction 1, a refresh every 20 s living 60 s: the node's digest defaults
# when T7 was run, before liveness moved to the membership), not from today's defaults
_T7_PLAIN = {"bucket_summaries": False, "compaction_ratio": 1.0,
             "refresh_interval_s": 20.0, "digest_ttl_s": 60.0}
T7_VARIANTS = [(label, {**_T7_PLAIN, **knobs}) for label, knobs in [
    ("full summaries", {}),
    ("buckets", {"bucket_summaries": True}),
    ("compaction 4", {"compaction_ratio": 4.0}),
    ("batch 5 s", {"min_record_interval_s": 5.0}),
    ("buckets + compaction 4 + batch 5 s",
     {"bucket_summaries": True, "compaction_ratio": 4.0, "min_record_interval_s": 5.0}),
    ("same + refresh 60 s / TTL 180 s",
     {"bucket_summaries": True, "compaction_ratio": 4.0, "min_record_interval_s": 5.0,
      "refresh_interval_s": 60.0, "digest_ttl_s": 180.0}),
    ("buckets + compaction 4 + batch 5 s + fanout 1",
     {"bucket_summaries": True, "compaction_ratio": 4.0, "min_record_interval_s": 5.0,
      "gossip_fanout": 1}),
]]  # fmt: skip
_T7_IDLE_KEYS = ("bucket_summaries", "min_record_interval_s",
                 "compaction_ratio", "refresh_interval_s", "digest_ttl_s")  # fmt: skip


def exp_t7(ctx: Ctx) -> list[dict]:
    """T7: digest bytes/s per node, idle and under load, per anti-entropy variant."""
    rows = []
    sizes = [4, 8] if ctx.quick else [4, 64, 256]
    for n in sizes:
        for label, knobs in T7_VARIANTS:
            idle_knobs = {k: v for k, v in knobs.items() if k in _T7_IDLE_KEYS}
            if len(idle_knobs) != len(knobs):
                continue  # the idle harness has no fanout knob
            r = measure_idle_digest(n, duration_s=60.0 if ctx.quick else 360.0,
                                    seed=ctx.ns.seed, **idle_knobs)  # fmt: skip
            rows.append({"experiment": "t7", "mode": "idle", "label": label, "nodes": n,
                         "digest_Bps_per_node": round(r["digest_bytes_per_node_s"], 1)})
            ctx.log(f"t7 idle N={n} {label}: {rows[-1]['digest_Bps_per_node']} B/s")
        big = n >= 256
        for label, knobs in T7_VARIANTS:
            if big and label not in ("full summaries", "buckets + compaction 4 + batch 5 s",
                                     "same + refresh 60 s / TTL 180 s"):
                continue  # N=256 request runs take minutes each
            wl = ctx.workload("mmlu-gen", _n(ctx, max(4000, 40 * n)), alpha=1.0,
                              rate=PER_NODE_RATE * n)  # fmt: skip
            cfg = SimConfig(nodes=n, policy="prefixmesh", seed=ctx.ns.seed, **knobs)
            rows.append(_run(ctx, "t7", wl, label, cfg, mode="load"))
    return rows


# the best full-replication variant (T7 table) and partial replication on top of it
_FULL_BEST = {"bucket_summaries": True, "compaction_ratio": 4.0, "min_record_interval_s": 5.0}
PARTITION_VARIANTS = [
    ("full replication (buckets + compaction 4 + batch 5 s)", _FULL_BEST),
    ("partitioned P=256 r=3", {**_FULL_BEST, "partitions": 256}),
    ("partitioned P=256 r=3, no batching", {**_FULL_BEST, "partitions": 256,
                                            "min_record_interval_s": 0.0}),
    ("partitioned P=256 r=2", {**_FULL_BEST, "partitions": 256, "replicas": 2}),
]  # fmt: skip


def exp_partition(ctx: Ctx) -> list[dict]:
    """Partial replication (overlay/core/partition.py) against the best full replication:
    digest + lookup traffic, hits and latency under load; idle traffic; convergence;
    simulator speed; T2 at N=256; and lookups at high delay (they cost an RTT)."""
    seed = ctx.ns.seed
    rows: list[dict] = []
    sizes = [4, 8] if ctx.quick else [4, 64, 256]
    for n in sizes:
        wl = ctx.workload("mmlu-gen", _n(ctx, max(4000, 40 * n)), alpha=1.0,
                          rate=PER_NODE_RATE * n)  # fmt: skip
        for label, knobs in PARTITION_VARIANTS:
            if n >= 256 and label.endswith(("no batching", "r=2")):
                continue  # the N=256 full-replication run alone takes minutes
            cfg = SimConfig(nodes=n, policy="prefixmesh", seed=seed, **knobs)
            rows.append(_run(ctx, "partition", wl, label, cfg, mode="load"))
    for n in sizes:
        r = measure_idle_digest(n, duration_s=120.0 if ctx.quick else 720.0, seed=seed,
                                partitions=256, compaction_ratio=4.0)  # fmt: skip
        rows.append({"experiment": "partition", "mode": "idle", "nodes": n,
                     "label": "partitioned P=256 r=3 (refresh 300 s)",
                     "digest_Bps_per_node": round(r["digest_bytes_per_node_s"], 1)})  # fmt: skip
        ctx.log(f"partition idle N={n}: {rows[-1]['digest_Bps_per_node']} B/s")
    for n in [16, 64] if ctx.quick else [64, 256, 1024]:
        for s in range(3):
            r = measure_convergence(n, fanout=3, seed=seed + s, partitions=256)
            rows.append({"experiment": "partition", "mode": "convergence", "nodes": n,
                         "label": f"partitioned P=256 r=3, seed {seed + s}",
                         "convergence_intervals": round(r["convergence_intervals"], 3),
                         "bound_intervals": round(r["bound_intervals"], 3)})  # fmt: skip
            ctx.log(f"partition convergence N={n}: {r['convergence_intervals']:.3f} intervals")
    n = 8 if ctx.quick else 64
    for per_node in [PER_NODE_RATE, 4.0]:
        wl = ctx.workload("mmlu-gen", _n(ctx, 10_000), alpha=1.0, rate=per_node * n)
        wl.ideal_per_request()  # not part of the timed run
        for label, knobs in PARTITION_VARIANTS[:2]:
            cfg = SimConfig(nodes=n, policy="prefixmesh", seed=seed, **knobs)
            res = simulate(wl, cfg)
            rows.append(_row("partition", cfg, res, label=label, mode="speed",
                             rate_per_node=per_node))  # fmt: skip
            ctx.log(f"partition speed N={n} {per_node} req/s/node {label}: "
                    f"{res.metrics['requests_per_wall_minute']:.0f} req/min")
    big = 8 if ctx.quick else 256
    kv = (256 if ctx.quick else NODE_DEFAULT_KV_MIB) * 2**20
    wl = ctx.workload("mmlu-gen", _n(ctx, max(4000, 40 * big)), alpha=1.0,
                      rate=PER_NODE_RATE * big)  # fmt: skip
    cfg = SimConfig(nodes=big, policy="prefixmesh", kv_capacity_bytes=kv, seed=seed,
                    **PARTITION_VARIANTS[1][1])  # fmt: skip
    rows.append(_run(ctx, "partition", wl, "partitioned P=256 r=3, 9 GiB/node", cfg,
                     mode="T2"))  # fmt: skip
    n = 8 if ctx.quick else 16
    wl = ctx.workload("mmlu-gen", _n(ctx, 2000), alpha=1.0, rate=PER_NODE_RATE * n)
    for d in [1, 50, 250]:
        for label, pol, knobs in [("local", "local", {}),
                                  ("full replication", "prefixmesh", _FULL_BEST),
                                  ("partitioned P=256 r=3", "prefixmesh",
                                   PARTITION_VARIANTS[1][1])]:  # fmt: skip
            cfg = SimConfig(nodes=n, policy=pol, delay_ms=d, seed=seed, **knobs)
            rows.append(_run(ctx, "partition", wl, label, cfg, mode="delay"))
    return rows


EXPERIMENTS: dict[str, Callable[[Ctx], list[dict]]] = {
    "delay": exp_delay,
    "load": exp_load,
    "capacity": exp_capacity,
    "digest": exp_digest,
    "skew": exp_skew,
    "scale": exp_scale,
    "convergence": exp_convergence,
    "speed": exp_speed,
    "t7": exp_t7,
    "liars": exp_liars,
    "sharegpt": exp_sharegpt,
    "targets": exp_targets,
    "ski": exp_ski,
    "partition": exp_partition,
}


# ---------------------------------------------------------------------------- output


def write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = float(v) if any(c in v for c in ".eEin") else int(v)
            except (ValueError, TypeError):
                pass
    return rows


def plot_experiment(name: str, rows: list[dict], plots: Path) -> list[Path]:
    """PNG plots of one experiment; [] if matplotlib is missing or nothing to plot."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return []
    plots.mkdir(parents=True, exist_ok=True)

    def lines(ax, xkey: str, ykey: str, group: str, rws: list[dict]) -> None:
        groups = list(dict.fromkeys(r[group] for r in rws))
        for g in groups:
            pts = sorted((r[xkey], r[ykey]) for r in rws if r[group] == g)
            if len(pts) > 1:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(g))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    fig = None
    if name == "delay":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        lines(axes[0], "rtt_ms", "hit_ratio", "label", rows)
        axes[0].set(xscale="log", xlabel="RTT (ms)", ylabel="token hit ratio",
                    title="MMLU trace, N=4: hit ratio vs RTT")  # fmt: skip
        lines(axes[1], "rtt_ms", "latency_mean_s", "label", rows)
        axes[1].set(xscale="log", xlabel="RTT (ms)", ylabel="mean latency (s)",
                    title="MMLU trace, N=4: mean latency vs RTT")  # fmt: skip
    elif name == "capacity":
        fig, ax = plt.subplots(figsize=(6, 4))
        lines(ax, "kv_capacity_mib", "hit_vs_ideal", "label", rows)
        ax.set(xscale="log", xlabel="KV capacity per node (MiB)", ylabel="hit ratio / ideal",
               title="MMLU trace, N=4, 1 ms: hits vs capacity")  # fmt: skip
    elif name == "skew":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        lines(axes[0], "zipf_alpha", "load_imbalance", "label", rows)
        axes[0].axhline(1.3, color="grey", ls="--", lw=1)
        axes[0].set(xlabel="Zipf alpha", ylabel="max/mean requests per node",
                    title="N=8: load imbalance vs skew")  # fmt: skip
        lines(axes[1], "zipf_alpha", "hit_vs_ideal", "label", rows)
        axes[1].set(xlabel="Zipf alpha", ylabel="hit ratio / ideal", title="N=8: hits vs skew")
    elif name == "scale":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        lines(axes[0], "nodes", "hit_vs_ideal", "label", rows)
        axes[0].set(xscale="log", xlabel="nodes", ylabel="hit ratio / ideal",
                    title="MMLU, 0.5 req/s per node: hits vs N")  # fmt: skip
        lines(axes[1], "nodes", "latency_mean_s", "label", rows)
        axes[1].set(xscale="log", xlabel="nodes", ylabel="mean latency (s)",
                    title="mean latency vs N")  # fmt: skip
    elif name == "convergence":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for f in sorted({r["fanout"] for r in rows}):
            rs = sorted((r for r in rows if r["fanout"] == f), key=lambda r: r["nodes"])
            ns_ = [r["nodes"] for r in rs]
            axes[0].plot(ns_, [r["convergence_intervals"] for r in rs], marker="o",
                         label=f"measured, fanout {f}")  # fmt: skip
            axes[0].plot(ns_, [r["bound_intervals"] for r in rs], ls="--",
                         label=f"2 ln(N+1)/{f} + 2")  # fmt: skip
            axes[1].plot(ns_, [r["digest_bytes_per_node_s"] for r in rs], marker="o",
                         label=f"fanout {f}")  # fmt: skip
        axes[0].set(xscale="log", xlabel="nodes", ylabel="gossip intervals",
                    title="new prefix known to all nodes")  # fmt: skip
        axes[0].legend(fontsize=8)
        axes[1].axhline(1000, color="grey", ls="--", lw=1)
        axes[1].legend(fontsize=8)
        axes[1].set(xscale="log", yscale="log", xlabel="nodes", ylabel="bytes/s per node",
                    title="digest traffic (idle caches)")  # fmt: skip
    elif name == "digest":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        lines(axes[0], "interval_s", "digest_Bps_per_node", "fanout", rows)
        axes[0].axhline(1000, color="grey", ls="--", lw=1)
        axes[0].set(xscale="log", yscale="log", xlabel="gossip interval (s)",
                    ylabel="digest bytes/s per node", title="N=64: digest traffic")  # fmt: skip
        lines(axes[1], "interval_s", "hit_vs_ideal", "fanout", rows)
        axes[1].set(xscale="log", xlabel="gossip interval (s)", ylabel="hit ratio / ideal",
                    title="N=64: hits vs gossip interval")  # fmt: skip
    elif name == "ski":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, mib in zip(axes, sorted({r["kv_capacity_mib"] for r in rows}), strict=False):
            lines(ax, "rtt_ms", "latency_mean_s", "label",
                  [r for r in rows if r["kv_capacity_mib"] == mib])  # fmt: skip
            ax.set(xscale="log", xlabel="RTT (ms)", ylabel="mean latency (s)",
                   title=f"N=4, {mib} MiB/node: ski rental")  # fmt: skip
    elif name == "liars":
        fig, ax = plt.subplots(figsize=(6, 4))
        lines(ax, "liar_fraction", "hit_ratio", "label", rows)
        ax.set(xlabel="fraction of lying peers", ylabel="token hit ratio",
               title="N=64: hit ratio with lying peers")  # fmt: skip
    if fig is None:
        return []
    fig.tight_layout()
    path = plots / f"sim_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _md_table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write_summary(out: Path, plots: Path, command: str) -> Path:
    """Regenerate ``<out>/sim.md`` from the CSVs present, keeping the analysis section."""
    path = out / "sim.md"
    analysis = ""
    if path.is_file():
        text = path.read_text()
        if ANALYSIS_MARKER in text:
            analysis = text[text.index(ANALYSIS_MARKER):]
    rel = os.path.relpath(plots, out)
    parts = [
        "# Simulator results",
        "",
        f"Generated by `{command}` (the tables below come from the CSV files next to this "
        "file; re-running the command regenerates them). Model: the discrete-event simulator "
        "in `bench/sim.py` driving the real radix tree, signed digest records, anti-entropy, "
        "peer index and routing policies. Defaults: prefill 420 tok/s, decode 120 tok/s, "
        "restore 0.2 s, 512 MiB KV per node (23,052 B/token), gossip every 1 s to 3 peers (the node defaults), "
        "requests enter at a uniformly random node. `delay_ms` is the one-way link delay; "
        "RTT = 2 x delay. The analysis, with the verdict on each target and the proposed "
        "changes, is at the end.",
        "",
    ]
    sections = {
        "delay": ("Reproduction and delay sweep (MMLU Zipf trace at 1 req/s, N=4, 512 MiB/node)",
                  ["label", "rtt_ms", "hit_ratio", "hit_vs_ideal", "request_hit_fraction",
                   "latency_mean_s",
                   "latency_p99_s", "ttft_mean_s", "forwarded", "load_imbalance",
                   "false_hit_rate", "digest_Bps_per_node"]),
        "load": ("The same trace at 2 and 4 req/s (N=4, 1 ms one-way)",
                 ["label", "rate_rps", "hit_ratio", "hit_vs_ideal", "latency_mean_s",
                  "latency_p99_s", "load_imbalance", "forwarded"]),
        "capacity": ("Hit ratio vs KV capacity per node (N=4, 1 ms, 1 req/s)",
                     ["label", "kv_capacity_mib", "hit_ratio", "hit_vs_ideal",
                      "latency_mean_s", "load_imbalance"]),
        "skew": ("Load imbalance vs skew (MMLU regenerated, N=8, 0.5 req/s per node)",
                 ["label", "zipf_alpha", "load_imbalance", "busy_imbalance", "hit_vs_ideal",
                  "latency_mean_s", "forwarded"]),
        "scale": ("Scaling (MMLU regenerated, Zipf 1.0, 0.5 req/s per node)",
                  ["label", "nodes", "requests", "hit_ratio", "hit_vs_ideal", "latency_mean_s",
                   "load_imbalance", "forwarded", "false_hit_rate", "digest_Bps_per_node"]),
        "convergence": ("Convergence of a new prefix (interval 1 s)",
                        ["nodes", "fanout", "convergence_intervals", "bound_intervals",
                         "within_bound", "median_known_s", "digest_bytes_per_node_s",
                         "wall_s"]),
        "digest": ("Digest traffic vs gossip interval and fanout (N=64, prefixmesh)",
                   ["interval_s", "fanout", "digest_Bps_per_node", "hit_ratio", "hit_vs_ideal",
                    "latency_mean_s", "false_hit_rate", "load_imbalance"]),
        "speed": ("Simulator speed (one core, N=64, prefixmesh)",
                  ["nodes", "rate_per_node", "requests", "wall_s", "req_per_wall_min"]),
        "t7": ("T7: digest traffic per anti-entropy variant (0.5 req/s per node under load)",
               ["mode", "nodes", "label", "digest_Bps_per_node", "hit_ratio",
                "hit_vs_ideal"]),
        "targets": ("Targets at the node's default KV budget (1 GiB RAM + 8 GiB disk = 9 GiB)",
                    ["target", "label", "nodes", "rtt_ms", "requests", "hit_ratio",
                     "hit_vs_ideal", "latency_mean_s", "latency_p99_s", "load_imbalance",
                     "busy_imbalance", "digest_Bps_per_node"]),
        "ski": ("Ski-rental warming (proposal) vs plain prefixmesh (MMLU trace 1 req/s, N=4)",
                ["label", "kv_capacity_mib", "rtt_ms", "hit_vs_ideal", "latency_mean_s",
                 "latency_p99_s", "forwarded"]),
        "sharegpt": ("Multi-turn chat: ShareGPT conversations (N=8, 0.25 req/s per node)",
                     ["label", "requests", "hit_ratio", "hit_vs_ideal", "latency_mean_s",
                      "latency_p99_s", "ttft_mean_s", "load_imbalance", "forwarded"]),
        "partition": ("Partial replication (MMLU regenerated, Zipf 1.0, 0.5 req/s per node "
                      "unless noted; mode: load, idle, convergence, speed, T2, delay)",
                      ["mode", "label", "nodes", "rtt_ms", "rate_per_node", "hit_ratio",
                       "hit_vs_ideal", "latency_mean_s", "latency_p99_s", "load_imbalance",
                       "digest_Bps_per_node", "lookup_Bps_per_node", "convergence_intervals",
                       "bound_intervals", "req_per_wall_min"]),
        "liars": ("Lying peers (N=64, 0.5 req/s per node)",
                  ["label", "liar_fraction", "hit_ratio", "hit_vs_ideal",
                   "latency_mean_s", "false_hit_rate", "forwarded_to_liars"]),
    }  # fmt: skip
    for name, (title, cols) in sections.items():
        csv_path = out / f"sim_{name}.csv"
        if not csv_path.is_file():
            continue
        rows = read_csv(csv_path)
        parts += [
            f"## {title}",
            "",
            f"Data: `sim_{name}.csv`. Command: `python -m prefixmesh.bench.sweep "
            f"--tokenizer proxy --out docs/bench --experiments {name}`.",
        ]
        png = plots / f"sim_{name}.png"
        if png.is_file():
            parts += ["", f"![{name}]({rel}/sim_{name}.png)"]
        parts += ["", _md_table(rows, cols), ""]
    parts.append(analysis or ANALYSIS_MARKER + "\n")
    path.write_text("\n".join(parts))
    return path


def run_sweep(ns: argparse.Namespace) -> int:
    ctx = Ctx(ns)
    names = [s for s in ns.experiments.split(",") if s]
    unknown = [s for s in names if s not in EXPERIMENTS]
    if unknown:
        print(f"unknown experiments: {unknown}; known: {list(EXPERIMENTS)}", file=sys.stderr)
        return 2
    ctx.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        try:
            rows = EXPERIMENTS[name](ctx)
        except WorkloadError as exc:  # e.g. the shared workload files are not there
            ctx.log(f"{name}: skipped ({exc})")
            continue
        write_csv(ctx.out / f"sim_{name}.csv", rows)
        if not ns.no_plots:
            plot_experiment(name, rows, ctx.plots)
        ctx.log(f"{name}: {len(rows)} rows in {time.perf_counter() - t0:.0f}s")
    cmd = "python -m prefixmesh.bench.sweep " + " ".join(sys.argv[1:]) if ns.command is None \
        else ns.command  # fmt: skip
    write_summary(ctx.out, ctx.plots, cmd)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--plots", default=None, help="PNG folder (default <out>/../plots)")
    p.add_argument("--experiments", default=",".join(EXPERIMENTS))
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: each experiment's own)")
    p.add_argument("--shared-dir", default=None)
    p.add_argument("--tokenizer", default="auto", choices=["auto", "llama", "proxy"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny synthetic runs (harness test)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_sweep(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


