"""Routing policies compared on real node processes (``prefixmesh bench swarm``).

For each policy in ``--policies`` the benchmark starts ``--nodes`` real node processes on
127.0.0.1 (``python -m prefixmesh.bench.node_entry``: the daemon's ``run_node`` that ``prefixmesh
node`` runs, with the real default model, one llama.cpp thread each, its own key and cache
folder in a fresh temporary folder, every node bootstrapped from node 0, DHT and mDNS off)
and replays the *same* request sequence through the client API (``node/client.py``):

- the first ``--requests`` requests of the MMLU Zipf trace
  (``<shared>/workloads/mmlu_zipf_trace.jsonl.gz`` via ``bench/workloads.py``, tokenised with
  the default model's own vocabulary, sent as token ids so every policy sees identical
  prompts); without the trace file (or without a usable tokenizer) the built-in synthetic
  generator, with token ids inside the model's vocabulary;
- prompts longer than ``--n-ctx - --max-tokens - 16`` tokens are cut to that length (the
  same cut for every policy);
- arrivals keep the trace's Poisson shape, rescaled to ``--rate`` requests/s; the entry node
  is chosen round-robin by request index;
- before the first request every node must see all others as up (heartbeats), so no policy
  starts with a half-formed mesh.

Measured per request (client side): TTFT (from opening the request until the first text
piece arrives), total time, and from the FINAL frame the serving node, prompt and cached
tokens and the route (forward hops). Per policy: mean/p50/p99 TTFT, token hit ratio
(cached / prompt tokens), forwarded fraction (served elsewhere than the entry node), mean
forward hops, requests served per node, errors, and the ideal hit ratio of the replayed
prefix of the trace (an unlimited global cache) for reference.

Per-link delay
    The nodes and the client run inside a network namespace the benchmark creates
    (``ip netns add``), with ``tc qdisc add dev lo root netem delay D`` on that namespace's
    loopback. netem delays every packet on lo, so a round trip between two nodes costs
    2 x D. Needs root, ``ip`` and the kernel's ``sch_netem``; without a namespace the run
    falls back to the host loopback. Without netem every node process delays each frame
    it sends by D in the application instead (``bench/node_entry.py --link-delay-ms``,
    ``overlay.host.set_link_delay``): the same 2 x D between nodes for requests, answers,
    heartbeats and digests, but not for libp2p's own handshake bytes, and node-to-client
    answers are delayed by D too (equal for every policy). Either way the output says
    what happened (``network`` field). The namespace (and any process
    left in it) is removed on exit, also on errors and on SIGTERM/SIGINT.

Bounds
    Node start-up 300 s each; mesh formation 60 s; each request ``--request-timeout`` s;
    each policy's replay ends ``--drain`` s after the last arrival (requests still running
    are cancelled and counted as errors). Everything is bounded, so a run stops by itself.

Process layout
    The command re-executes itself (``python -m prefixmesh.bench.swarm --inner SPEC OUT``)
    inside the namespace; the inner process starts the nodes, drives the client and writes
    JSON results; the outer process owns the namespace and its clean-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SwarmBenchConfig",
    "add_swarm_arguments",
    "config_from_namespace",
    "run_bench_swarm",
    "run_swarm_bench",
    "build_trace",
    "summarise",
    "format_table",
    "SwarmBenchError",
]

#: a node start is mostly Python imports; with 32 processes starting on a loaded 2-core
#: machine one took 84 s just to import, so the harness waits long before calling it failed
NODE_START_TIMEOUT_S = 300.0
#: the churn-mode options (left out of the result's config when churn mode is off)
CHURN_FIELDS = ("churn", "churn_minutes", "churn_pre_s", "churn_post_s", "churn_interval_s",
                "churn_down_s", "churn_attempt_timeout_s", "churn_attempts", "churn_baseline",
                "churn_idle_s", "start_batch")
#: left out of the result's config while the real model runs
SIM_FIELDS = ("backend", "sim_prefill_tps", "sim_decode_tps")
MESH_TIMEOUT_S = 60.0
#: token ids of the synthetic fallback stay below this (SmolLM2's vocabulary is 49,152)
SYNTHETIC_VOCAB = 32_000
#: room left in the context window besides prompt and output (template slack)
CTX_SLACK_TOKENS = 16


class SwarmBenchError(RuntimeError):
    """The benchmark could not run (nodes did not start, mesh did not form, bad options)."""


@dataclass
class SwarmBenchConfig:
    nodes: int = 4
    requests: int = 200
    policies: tuple[str, ...] = ("prefixmesh", "round-robin", "local")
    delay_ms: float = 2.0
    max_tokens: int = 4
    rate: float = 0.5  # requests/s
    workload: str = "mmlu"  # mmlu | synthetic
    shared_dir: str | None = None
    n_ctx: int = 2048
    n_threads: int = 1
    ram_budget: str = "256MiB"
    disk_budget: str = "512MiB"
    digest_interval_s: float = 1.0
    hop_budget: int = 2
    request_timeout_s: float = 120.0
    drain_s: float = 120.0
    keep: bool = False  # keep the temporary folder (node logs)
    netns: bool = True  # try a network namespace
    # churn mode (``--churn F``; 0 = off: the policy comparison above, unchanged)
    churn: float = 0.0  # fraction of the nodes that are cycled (kill -9 / SIGSTOP)
    churn_minutes: float = 10.0  # length of the churn phase
    churn_pre_s: float = 60.0  # phase before churn
    churn_post_s: float = 90.0  # phase after churn
    churn_interval_s: float = 15.0  # seconds between churn events (round-robin over victims)
    churn_down_s: float = 20.0  # pause before restart (kill -9) or SIGCONT (SIGSTOP)
    churn_attempt_timeout_s: float = 20.0  # the client gives up on an entry after this
    churn_attempts: int = 6  # entries a request tries before it counts as lost
    churn_baseline: bool = True  # also run the same replay without churn (hit-ratio reference)
    churn_idle_s: float = 30.0  # idle window after the replay: membership + digest bytes
    start_batch: int = 8  # churn mode: node processes started in parallel
    # the nodes' engine: the real model, or the simulated engine (no model, no CPU: it
    # sleeps prefill and decode at these rates and keeps a real prefix tree)
    backend: str = "llama"  # llama | sim
    sim_prefill_tps: float = 300.0
    sim_decode_tps: float = 30.0

    def validate(self) -> None:
        from .policies import POLICY_NAMES  # noqa: PLC0415

        max_nodes = 64 if self.churn > 0 else 16
        if not 1 <= self.nodes <= max_nodes:
            raise SwarmBenchError(f"--nodes must be 1..{max_nodes}, got {self.nodes}")
        if not 0 <= self.churn < 1:
            raise SwarmBenchError(f"--churn must be in [0, 1), got {self.churn}")
        if self.churn > 0:
            if self.nodes < 3:
                raise SwarmBenchError("--churn needs at least 3 nodes")
            if min(self.churn_minutes, self.churn_interval_s, self.churn_down_s,
                   self.churn_attempt_timeout_s) <= 0 or self.churn_attempts < 1:
                raise SwarmBenchError("churn durations and --churn-attempts must be > 0")
            if self.churn_down_s >= self.churn_minutes * 60:
                raise SwarmBenchError("--churn-down must be shorter than the churn phase")
        if self.requests < 1:
            raise SwarmBenchError(f"--requests must be >= 1, got {self.requests}")
        if not self.policies:
            raise SwarmBenchError("--policies names no policy")
        for p in self.policies:
            if p not in POLICY_NAMES:
                raise SwarmBenchError(f"unknown policy {p!r}; known: {', '.join(POLICY_NAMES)}")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise SwarmBenchError(f"--rate must be > 0, got {self.rate}")
        if not 0 <= self.delay_ms <= 1000:
            raise SwarmBenchError(f"--delay-ms must be 0..1000, got {self.delay_ms}")
        if not 1 <= self.max_tokens <= 256:
            raise SwarmBenchError(f"--max-tokens must be 1..256, got {self.max_tokens}")
        if self.n_ctx < self.max_tokens + CTX_SLACK_TOKENS + 32:
            raise SwarmBenchError(f"--n-ctx {self.n_ctx} is too small")
        if self.backend not in ("llama", "sim"):
            raise SwarmBenchError(f"--backend must be llama or sim, got {self.backend!r}")
        if self.workload not in ("mmlu", "synthetic"):
            raise SwarmBenchError(f"--workload must be mmlu or synthetic, got {self.workload!r}")


@dataclass
class TraceRequest:
    arrival_s: float
    tokens: list[int]
    group: str = ""


@dataclass
class Trace:
    source: str  # what was replayed, in words
    requests: list[TraceRequest]
    ideal_hit_ratio: float
    truncated: int = 0  # prompts cut to fit the context window
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the trace


def build_trace(cfg: SwarmBenchConfig) -> Trace:
    """The request sequence every policy replays (deterministic for a given config)."""
    from .workloads import WorkloadError, ideal_hits, load_workload, synthetic_workload

    notes: list[str] = []
    wl = None
    if cfg.workload == "mmlu":
        try:
            wl = load_workload("mmlu", n_requests=cfg.requests, shared=cfg.shared_dir,
                               tokenizer="llama")
            source = f"MMLU Zipf trace ({wl.meta.get('source', '?')}), first {len(wl)} requests"
        except (WorkloadError, OSError, ImportError, ValueError) as exc:
            notes.append(f"MMLU trace unavailable ({exc}); using the synthetic workload")
    if wl is None:
        wl = synthetic_workload(cfg.requests, rate=4.0, max_tokens=cfg.max_tokens,
                                vocab=SYNTHETIC_VOCAB, seed=0)
        source = f"synthetic workload (alpha=1.0, seed 0), {len(wl)} requests"
    limit = cfg.n_ctx - cfg.max_tokens - CTX_SLACK_TOKENS
    reqs = list(wl.requests)
    if not reqs:
        raise SwarmBenchError("the workload has no requests")
    # the trace's arrivals (Poisson) rescaled to the configured mean rate
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    native_rate = (len(reqs) - 1) / span if len(reqs) > 1 and span > 0 else cfg.rate
    scale = native_rate / cfg.rate
    t0 = reqs[0].arrival_s
    out: list[TraceRequest] = []
    truncated = 0
    for r in reqs:
        toks = list(r.tokens)
        if len(toks) > limit:
            toks = toks[:limit]
            truncated += 1
        out.append(TraceRequest((r.arrival_s - t0) * scale, toks, r.group))
    hits = ideal_hits([r.tokens for r in out])
    total = sum(len(r.tokens) for r in out)
    return Trace(source, out, sum(hits) / total if total else 0.0, truncated, notes)


# --------------------------------------------------------------------------- node processes


class NodeProcess:
    """One ``python -m prefixmesh.bench.node_entry`` process (the daemon's ``run_node``
    from a config file, like ``prefixmesh node --config FILE``; baselines allowed) with
    its own config, key and cache folder."""

    def __init__(self, root: Path, index: int, cfg: SwarmBenchConfig, policy: str,
                 model_path: Path, bootstrap: Sequence[str] = (), *,
                 link_delay_ms: float = 0.0, listen: str = "/ip4/127.0.0.1/tcp/0"):
        from .node_entry import write_config  # noqa: PLC0415

        self.index = index
        self.root = root / f"node{index}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "node.log"
        config = write_config(self.root / "node.toml", {
            "node": {"listen": listen, "key_file": str(self.root / "node.key"),
                     "cache_dir": str(self.root / "cache"), "ram_budget": cfg.ram_budget,
                     "disk_budget": cfg.disk_budget, "bootstrap": list(bootstrap),
                     "mdns": False, "log_level": "info"},
            "model": {"path": str(model_path), "n_ctx": cfg.n_ctx, "n_threads": cfg.n_threads},
            "routing": {"hop_budget": cfg.hop_budget},
            "digest": {"interval_s": cfg.digest_interval_s},
        })
        self.args = [
            # the bench entry point: it lets --policy name a baseline (bench/policies.py)
            sys.executable, "-m", "prefixmesh.bench.node_entry", "--config", str(config),
            "--policy", policy, "--seed", str(index), "--no-dht",
        ]
        if link_delay_ms:
            self.args += ["--link-delay-ms", str(link_delay_ms)]
        if cfg.backend == "sim":
            self.args += ["--backend", "sim", "--sim-prefill-tps", str(cfg.sim_prefill_tps),
                          "--sim-decode-tps", str(cfg.sim_decode_tps)]
        self.proc: subprocess.Popen | None = None
        self.addrs: list[str] = []

    def start(self) -> NodeProcess:
        self.addrs = []  # a restart (churn mode) prints them again
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log,
                                         env=env, text=True)
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                line = line.strip()
                if line.startswith("/ip"):
                    self.addrs.append(line)
                if line == "ready":
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(NODE_START_TIMEOUT_S) or not self.addrs:
            self.stop()
            raise SwarmBenchError(f"node {self.index} did not start; log tail:\n{self.log_tail()}")
        return self

    @property
    def addr(self) -> str:
        return self.addrs[0]

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 3.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


# --------------------------------------------------------------------------- one policy


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(1, math.ceil(q / 100.0 * len(s)))
    return s[min(k, len(s)) - 1]


def summarise(records: Sequence[dict[str, Any]], n_nodes: int) -> dict[str, Any]:
    """Per-policy figures from per-request records (see :func:`_replay` for their fields)."""
    ok = [r for r in records if r.get("ok")]
    ttfts = [r["ttft_s"] for r in ok if not math.isnan(r["ttft_s"])]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    per_node = [0] * n_nodes
    for r in ok:
        if r["served_by"] is not None:
            per_node[r["served_by"]] += 1
    forwarded = sum(1 for r in ok if r["served_by"] != r["entry"])
    errors: dict[str, int] = {}
    for r in records:
        if not r.get("ok"):
            key = r.get("error", "?").split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": errors,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "total_mean_s": (sum(r["total_s"] for r in ok) / len(ok)) if ok else math.nan,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_ratio": cached / prompt if prompt else 0.0,
        "forwarded_fraction": forwarded / len(ok) if ok else 0.0,
        "mean_forward_hops": (sum(r["forward_hops"] for r in ok) / len(ok)) if ok else 0.0,
        "served_per_node": per_node,
    }


async def _wait_mesh(clients: Sequence[Any], want_up: int, timeout_s: float) -> float:
    """Wait until every node sees ``want_up`` peers as up; returns seconds waited."""
    import trio  # noqa: PLC0415

    t0 = time.monotonic()
    last: list[int] = []
    with trio.move_on_after(timeout_s):
        while True:
            last = []
            for c in clients:
                reply = await c.peers()
                last.append(sum(1 for p in reply.peers if p.up))
            if all(n >= want_up for n in last):
                return time.monotonic() - t0
            await trio.sleep(0.5)
    raise SwarmBenchError(f"mesh did not form within {timeout_s:.0f} s (peers up per node: {last})")


async def _replay(addrs: Sequence[str], trace: Sequence[TraceRequest],
                  cfg: SwarmBenchConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import trio  # noqa: PLC0415

    from prefixmesh.node.client import Client, ClientError  # noqa: PLC0415
    from prefixmesh.overlay.core.identity import peer_id_from_b58  # noqa: PLC0415

    n = len(addrs)
    index_of = {peer_id_from_b58(a.rsplit("/p2p/", 1)[1]): i for i, a in enumerate(addrs)}
    records: list[dict[str, Any]] = [
        {"i": i, "entry": i % n, "ok": False, "error": "not finished"} for i in range(len(trace))
    ]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Client.connect(a)) for a in addrs]
        tenants = [await c.tenant() for c in clients]
        mesh_s = await _wait_mesh(clients, n - 1, MESH_TIMEOUT_S) if n > 1 else 0.0

        async def one(i: int, req: TraceRequest) -> None:
            entry = i % n
            rec = records[i]
            try:
                ans = await clients[entry].ask(
                    tokens=req.tokens, tenant=tenants[entry], max_tokens=cfg.max_tokens,
                    deadline_s=cfg.request_timeout_s, hop_budget=cfg.hop_budget,
                )  # fmt: skip
            except ClientError as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                return
            f = ans.final
            ttft = ans.ttft_s
            if math.isnan(ttft):  # no text piece (e.g. an empty first token): use FINAL's
                ttft = ans.total_s
            rec.update(
                ok=True, error="", ttft_s=ttft, total_s=ans.total_s,
                served_by=index_of.get(f.serving), prompt_tokens=f.prompt_tokens,
                cached_tokens=f.cached_tokens, completion_tokens=f.completion_tokens,
                server_ttft_ms=f.ttft_ms,
                forward_hops=sum(1 for h in f.hops if h.action == "forward"),
            )  # fmt: skip

        async def report_progress() -> None:  # a long replay is not silence
            while True:
                await trio.sleep(PROGRESS_EVERY_S)
                done = sum(1 for r in records if r["error"] != "not finished")
                print(f"bench swarm: {done}/{len(trace)} requests answered or failed",
                      file=sys.stderr, flush=True)

        t_start = trio.current_time()
        last_arrival = trace[-1].arrival_s if trace else 0.0
        with trio.move_on_after(last_arrival + cfg.drain_s) as scope:
            async with trio.open_nursery() as nursery:
                progress = trio.CancelScope()

                async def progress_task() -> None:
                    with progress:
                        await report_progress()

                nursery.start_soon(progress_task)
                async with trio.open_nursery() as requests:
                    for i, req in enumerate(trace):
                        await trio.sleep_until(t_start + req.arrival_s)
                        requests.start_soon(one, i, req)
                progress.cancel()
        wall = trio.current_time() - t_start
    meta = {"mesh_wait_s": round(mesh_s, 2), "replay_wall_s": round(wall, 2),
            "cut_short": scope.cancelled_caught}
    return records, meta


def run_policy(cfg: SwarmBenchConfig, policy: str, trace: Sequence[TraceRequest],
               root: Path, model_path: Path, *, link_delay_ms: float = 0.0) -> dict[str, Any]:
    """Fresh nodes (fresh caches) for ``policy``; replay ``trace``; stop the nodes
    (``link_delay_ms``: each node's application-level frame delay, without netem)."""
    import trio  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    nodes: list[NodeProcess] = []
    t0 = time.monotonic()
    try:
        first = NodeProcess(root, 0, cfg, policy, model_path,
                            link_delay_ms=link_delay_ms).start()
        nodes.append(first)
        for i in range(1, cfg.nodes):
            nodes.append(NodeProcess(root, i, cfg, policy, model_path, [first.addr],
                                     link_delay_ms=link_delay_ms).start())
        startup_s = time.monotonic() - t0
        records, meta = trio.run(_replay, [nd.addr for nd in nodes], trace, cfg)
    finally:
        for nd in nodes:
            nd.stop()
    dead = [nd.index for nd in nodes if nd.proc is not None and nd.proc.returncode not in
            (0, -signal.SIGTERM, -signal.SIGKILL)]
    out = {"policy": policy, **summarise(records, cfg.nodes), **meta,
           "startup_s": round(startup_s, 2), "nodes_failed": dead}
    out["records"] = records
    return out


# --------------------------------------------------------------------------- churn mode
#
# ``--churn F`` replaces the policy comparison with one run of the first policy in three
# phases: before churn (``--churn-pre`` s), churn (``--churn-minutes``), after churn
# (``--churn-post`` s). round(F x nodes) nodes (never node 0, the bootstrap node) are the
# victims: the first half is cycled with ``kill -9`` and restarted from the same config, key,
# cache folder and TCP port after ``--churn-down`` s; the other half is frozen with SIGSTOP
# and resumed with SIGCONT after the same pause. Every ``--churn-interval`` s the next victim
# (round-robin) is cycled; a victim still down or restarting is skipped (and counted).
#
# Requests arrive open-loop (the trace's Poisson arrivals at ``--rate``; ``--requests`` is
# ignored: rate x duration); each picks its first entry node uniformly at random among
# *all* nodes (the client does not know which are down). The client's behaviour: an
# attempt that fails (connection refused or lost, an error frame) or gives no answer within
# ``--churn-attempt-timeout`` s (a frozen entry accepts the TCP connection and then says
# nothing) is abandoned and the request is retried at another random node it has not tried;
# after ``--churn-attempts`` failed attempts it counts as lost. A request is *answered* when
# some attempt returns a FINAL. TTFT is the user's: from the first attempt's start to the
# first text piece of the answering attempt (retries included).
#
# Death detection: at each kill -9 (and SIGSTOP) the client polls every live node whose
# last PEERS reply (refreshed every ``VIEW_POLL_S``) had the victim up, every
# ``DETECT_POLL_S``, until the node reports the victim not up (or no longer lists it); the
# time of that reply minus the time of the signal is that node's detection time, the
# largest over those nodes is the time until every live node knows. Live nodes that did not
# see the victim up are counted (``not_seen_up``), not timed.
#
# Membership + digest bytes: after the replay, when every node sees all others up again, an
# idle window of ``--churn-idle`` s with no requests and no client polling: the namespace's
# loopback counters (/proc/net/dev ``lo``: every byte any node sent, TCP/IP headers
# included; only our processes run in the namespace) divided by nodes and seconds, and
# per process the TCP payload its sockets sent (``ss -tinp`` bytes_sent, before and after
# the window). Without a namespace only the ``ss`` figure is attributable.

DETECT_POLL_S = 0.5
VIEW_POLL_S = 3.0  # each node's PEERS view is refreshed this often outside detections
PHASES = ("before", "during", "after")


@dataclass(frozen=True)
class ChurnEvent:
    at_s: float  # seconds from the start of the churn phase
    node: int
    kind: str  # "kill" (kill -9, restart) | "stop" (SIGSTOP, SIGCONT)
    down_s: float


def churn_victims(n_nodes: int, fraction: float, seed: int = 0) -> list[tuple[int, str]]:
    """The cycled nodes (never node 0) and how each is cycled: the first half ``kill``
    (rounded up), the rest ``stop``."""
    import random  # noqa: PLC0415

    k = min(n_nodes - 1, max(1, round(fraction * n_nodes))) if fraction > 0 else 0
    picked = random.Random(seed).sample(range(1, n_nodes), k)
    n_kill = (k + 1) // 2
    return [(node, "kill" if j < n_kill else "stop") for j, node in enumerate(picked)]


def churn_schedule(n_nodes: int, fraction: float, churn_s: float, interval_s: float,
                   down_s: float, seed: int = 0) -> list[ChurnEvent]:
    """Events every ``interval_s`` from ``interval_s / 2`` on, round-robin over the victims,
    each back (restart or SIGCONT issued) before the churn phase ends."""
    victims = churn_victims(n_nodes, fraction, seed)
    out: list[ChurnEvent] = []
    if not victims:
        return out
    j = 0
    while True:
        at = interval_s * (j + 0.5)
        if at + down_s > churn_s:
            return out
        node, kind = victims[j % len(victims)]
        out.append(ChurnEvent(round(at, 3), node, kind, down_s))
        j += 1


def phase_of(t_s: float, pre_s: float, churn_s: float) -> str:
    """The phase of an arrival ``t_s`` seconds after the replay started."""
    if t_s < pre_s:
        return "before"
    return "during" if t_s < pre_s + churn_s else "after"


def summarise_phases(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per phase: sent, answered, lost, p50/p99 user TTFT, token hit ratio, retried."""
    out: dict[str, dict[str, Any]] = {}
    for ph in (*PHASES, "all"):
        rs = [r for r in records if ph == "all" or r["phase"] == ph]
        ok = [r for r in rs if r.get("ok")]
        ttft = [r["ttft_s"] for r in ok if not math.isnan(r["ttft_s"])]
        prompt = sum(r["prompt_tokens"] for r in ok)
        cached = sum(r["cached_tokens"] for r in ok)
        errors: dict[str, int] = {}
        for r in rs:
            for e in r.get("attempt_errors", []):
                key = e.split(":", 1)[0]
                errors[key] = errors.get(key, 0) + 1
        out[ph] = {
            "sent": len(rs), "answered": len(ok), "lost": len(rs) - len(ok),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "token_hit_ratio": cached / prompt if prompt else 0.0,
            "retried": sum(1 for r in rs if r.get("attempts", 1) > 1),
            "attempt_errors": errors,
        }  # fmt: skip
    return out


def summarise_detection(detections: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (kill, stop): over the events whose every observer reported, the median and
    p99 of the time until every live node knew, and of the single observations."""
    out: dict[str, Any] = {}
    for kind in ("kill", "stop"):
        ds = [d for d in detections if d["kind"] == kind]
        complete = [d["all_s"] for d in ds if d["all_s"] is not None]
        single = [t for d in ds for t in d["per_node_s"].values()]
        out[kind] = {
            "events": len(ds), "complete": len(complete),
            "all_median_s": _percentile(complete, 50), "all_p99_s": _percentile(complete, 99),
            "all_max_s": max(complete) if complete else math.nan,
            "node_median_s": _percentile(single, 50), "node_p99_s": _percentile(single, 99),
            "observations": len(single),
        }  # fmt: skip
    return out


def _free_ports(n: int) -> list[int]:
    import socket  # noqa: PLC0415

    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _lo_counters() -> tuple[int, int] | None:
    """(tx bytes, tx packets) of ``lo`` in this process's network namespace."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                f = rest.split()
                return int(f[8]), int(f[9])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _socket_bytes() -> dict[tuple[str, str], tuple[int, int]] | None:
    """Per established TCP socket (local, peer): (owner pid, bytes_sent) from ``ss -tinp``
    (the kernel's tcp_info: payload bytes, Noise and yamux framing included, TCP/IP
    headers not); None without ``ss``."""
    import re  # noqa: PLC0415

    try:
        text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                              text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out: dict[tuple[str, str], tuple[int, int]] = {}
    key: tuple[str, str] | None = None
    pid = -1
    for line in text.splitlines():
        if not line.startswith(("\t", " ")):
            f = line.split()
            m = re.search(r"pid=(\d+)", line)
            key, pid = ((f[2], f[3]) if len(f) >= 4 else None), (int(m.group(1)) if m else -1)
            continue
        m = re.search(r"bytes_sent:(\d+)", line)
        if key is not None and pid >= 0:
            out[key] = (pid, int(m.group(1)) if m else 0)
        key = None
    return out


def _sent_by_pid(before: dict[tuple[str, str], tuple[int, int]],
                 after: dict[tuple[str, str], tuple[int, int]]) -> dict[int, int]:
    """Bytes each pid sent between two :func:`_socket_bytes` snapshots (sockets opened in
    between count from 0; sockets closed in between are missed)."""
    out: dict[int, int] = {}
    for key, (pid, sent) in after.items():
        prev = before.get(key)
        base = prev[1] if prev is not None and prev[0] == pid else 0
        out[pid] = out.get(pid, 0) + max(0, sent - base)
    return out


def _pss_kib(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


class _Holder:
    """The client's connection to one node, kept by one task (reconnects after a loss);
    ``client`` is None while not connected."""

    def __init__(self, index: int, node: NodeProcess):
        self.index = index
        self.node = node
        self.client: Any = None
        self.broken = False
        self.watch: dict[int, dict[str, Any]] = {}  # event id -> detection record
        self.view_up: set[bytes] = set()  # peers up in this node's last PEERS reply
        self.view_t = -math.inf  # when that reply came (trio clock)


async def _churn_replay(nodes: Sequence[NodeProcess], trace: Sequence[TraceRequest],
                        cfg: SwarmBenchConfig, schedule: Sequence[ChurnEvent],
                        in_netns: bool) -> dict[str, Any]:
    import random  # noqa: PLC0415

    import trio  # noqa: PLC0415

    from prefixmesh.node.client import Client, ClientError  # noqa: PLC0415
    from prefixmesh.overlay.core.identity import peer_id_from_b58  # noqa: PLC0415

    n = len(nodes)
    pre_s, churn_s = cfg.churn_pre_s, cfg.churn_minutes * 60.0
    addrs = [nd.addr for nd in nodes]
    peer_of = [peer_id_from_b58(a.rsplit("/p2p/", 1)[1]) for a in addrs]
    index_of = {p: i for i, p in enumerate(peer_of)}
    holders = [_Holder(i, nd) for i, nd in enumerate(nodes)]
    state = ["up"] * n  # up | killed | restarting | stopped
    events_log: list[dict[str, Any]] = []
    detections: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    tenant_box: list[Any] = []
    quiet = [False]  # the idle window: no client polls
    t_origin = trio.current_time()

    async def session(h: _Holder) -> None:
        async with Client.connect(addrs[h.index], timeout_s=8.0) as c:
            h.client, h.broken = c, False
            try:
                if not tenant_box:
                    with trio.fail_after(10):
                        tenant_box.append(await c.tenant())
                while not h.broken and state[h.index] not in ("killed", "restarting"):
                    # polls: fast while a detection is open, every VIEW_POLL_S otherwise
                    # (to know who sees whom up), never in the idle window
                    due = h.watch or trio.current_time() - h.view_t >= VIEW_POLL_S
                    if quiet[0] or state[h.index] != "up" or not due:
                        await trio.sleep(0.25)
                        continue
                    with trio.fail_after(10):
                        reply = await c.peers(timeout_s=9.0)
                    now = trio.current_time()
                    up = {p.peer for p in reply.peers if p.up}
                    h.view_up, h.view_t = up, now
                    for ev_id, det in list(h.watch.items()):
                        if peer_of[det["node"]] not in up:
                            det["per_node_s"][h.index] = round(now - det["t0"], 3)
                            del h.watch[ev_id]
                    await trio.sleep(DETECT_POLL_S if h.watch else 0.25)
            finally:
                h.client = None

    async def hold(h: _Holder) -> None:
        while True:
            if state[h.index] in ("killed", "restarting"):
                await trio.sleep(0.5)
                continue
            try:
                await session(h)
            except (Exception, trio.TooSlowError):  # lost, refused, frozen: reconnect
                pass
            h.client = None
            await trio.sleep(1.0)

    def start_detection(ev: ChurnEvent, t0: float) -> dict[str, Any]:
        det = {"node": ev.node, "kind": ev.kind, "at_s": round(t0 - t_origin, 2), "t0": t0,
               "observers": 0, "not_seen_up": 0, "per_node_s": {}, "all_s": None}
        for h in holders:
            if h.index != ev.node and state[h.index] == "up":
                # an observer counts only if its last view (recent) had the victim up
                if t0 - h.view_t <= 2 * VIEW_POLL_S + 10 and peer_of[ev.node] in h.view_up:
                    h.watch[id(det)] = det
                    det["observers"] += 1
                else:
                    det["not_seen_up"] += 1
        detections.append(det)
        return det

    async def finish_detection(det: dict[str, Any]) -> None:
        # until every observer reported, or the victim is back (then incomplete)
        with trio.move_on_after(max(1.0, cfg.churn_down_s - 0.5)):
            while any(id(det) in h.watch for h in holders):
                for h in holders:  # an observer that went down stops counting
                    if id(det) in h.watch and state[h.index] != "up":
                        del h.watch[id(det)]
                        det["observers"] -= 1
                await trio.sleep(0.1)
        for h in holders:
            h.watch.pop(id(det), None)
        if len(det["per_node_s"]) >= det["observers"] and det["per_node_s"]:
            det["all_s"] = max(det["per_node_s"].values())

    async def cycle(ev: ChurnEvent) -> None:
        nd = nodes[ev.node]
        rec = {"node": ev.node, "kind": ev.kind, "at_s": round(trio.current_time() - t_origin,
                                                                2)}
        events_log.append(rec)
        if state[ev.node] != "up" or nd.proc is None or nd.proc.poll() is not None:
            rec["skipped"] = f"node {state[ev.node]}"
            return
        async with trio.open_nursery() as nursery:
            if ev.kind == "kill":
                nd.proc.send_signal(signal.SIGKILL)
                state[ev.node] = "killed"
            else:
                nd.proc.send_signal(signal.SIGSTOP)
                state[ev.node] = "stopped"
            t0 = trio.current_time()
            holders[ev.node].broken = ev.kind == "kill"
            det = start_detection(ev, t0)
            nursery.start_soon(finish_detection, det)
            await trio.sleep(ev.down_s)
            if ev.kind == "kill":
                await trio.to_thread.run_sync(nd.proc.wait)
                state[ev.node] = "restarting"
                t1 = trio.current_time()
                try:
                    await trio.to_thread.run_sync(nd.start)
                    rec["restart_s"] = round(trio.current_time() - t1, 2)
                    if nd.addr != addrs[ev.node]:
                        rec["new_addr"] = nd.addr
                        addrs[ev.node] = nd.addr
                    state[ev.node] = "up"
                except SwarmBenchError as exc:
                    rec["restart_failed"] = str(exc)[:500]
                    state[ev.node] = "killed"
            else:
                nd.proc.send_signal(signal.SIGCONT)
                state[ev.node] = "up"

    async def one(i: int, req: TraceRequest, phase: str) -> None:
        rng = random.Random(1_000_003 * (i + 1))
        rec: dict[str, Any] = {"i": i, "phase": phase, "ok": False, "attempts": 0,
                               "attempt_errors": [], "entries": []}
        records.append(rec)
        tried: set[int] = set()
        t_req = trio.current_time()
        while rec["attempts"] < cfg.churn_attempts:
            pool = [j for j in range(n) if j not in tried] or list(range(n))
            entry = rng.choice(pool)
            tried.add(entry)
            rec["attempts"] += 1
            rec["entries"].append(entry)
            h = holders[entry]
            c = h.client
            if c is None or not tenant_box:
                rec["attempt_errors"].append("NotConnected")
                await trio.sleep(0.05)
                continue
            t_att = trio.current_time()
            ans = None
            with trio.move_on_after(cfg.churn_attempt_timeout_s):
                try:
                    ans = await c.ask(tokens=req.tokens, tenant=tenant_box[0],
                                      max_tokens=cfg.max_tokens,
                                      deadline_s=cfg.churn_attempt_timeout_s,
                                      hop_budget=cfg.hop_budget)
                except ClientError as exc:
                    rec["attempt_errors"].append(f"{type(exc).__name__}: {exc}"[:200])
                    if type(exc).__name__ in ("ConnectFailed", "ConnectionLost"):
                        h.broken = True
                    continue
                except Exception as exc:  # noqa: BLE001 (a dying connection, any layer)
                    rec["attempt_errors"].append(f"{type(exc).__name__}: {exc}"[:200])
                    h.broken = True
                    continue
            if ans is None:
                rec["attempt_errors"].append("AttemptTimeout")
                continue
            f = ans.final
            ttft = ans.ttft_s if not math.isnan(ans.ttft_s) else ans.total_s
            rec.update(ok=True, entry=entry, served_by=index_of.get(f.serving),
                       ttft_s=(t_att - t_req) + ttft, attempt_ttft_s=ttft,
                       prompt_tokens=f.prompt_tokens, cached_tokens=f.cached_tokens,
                       forward_hops=sum(1 for hop in f.hops if hop.action == "forward"))
            return

    async def progress() -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY_S)
            el = trio.current_time() - t_origin
            done = sum(1 for r in records if r["ok"] or r["attempts"] >= cfg.churn_attempts)
            print(f"bench swarm churn: {el:.0f} s, {done}/{len(records)} requests done, "
                  f"{sum(1 for r in records if r['ok'])} answered; nodes "
                  f"{' '.join(f'{j}:{s}' for j, s in enumerate(state) if s != 'up') or 'all up'}",
                  file=sys.stderr, flush=True)

    last_counts: list[int] = []

    async def wait_all_up(timeout_s: float) -> float | None:
        """Until every node's recent view has all others up (the holders' polls)."""
        t0 = trio.current_time()
        with trio.move_on_after(timeout_s):
            while True:
                now = trio.current_time()
                last_counts[:] = [len(h.view_up) if now - h.view_t < 3 * VIEW_POLL_S else -1
                                  for h in holders]
                if all(x >= n - 1 for x in last_counts) and now - t0 > VIEW_POLL_S:
                    return trio.current_time() - t0
                await trio.sleep(1.0)
        return None

    meta: dict[str, Any] = {}
    async with trio.open_nursery() as top:
        for h in holders:
            top.start_soon(hold, h)
        mesh_s = await wait_all_up(MESH_TIMEOUT_S + n * 1.5)
        with trio.move_on_after(MESH_TIMEOUT_S * 2):  # an overloaded mesh answers late
            while not tenant_box:
                await trio.sleep(0.5)
        if not tenant_box:
            top.cancel_scope.cancel()
            raise SwarmBenchError(f"churn mode: no node of {n} answered the client")
        # a mesh not complete by then is recorded (peers up per node), not fatal
        meta["mesh_wait_s"] = None if mesh_s is None else round(mesh_s, 2)
        meta["mesh_up_counts_at_start"] = list(last_counts)
        top.start_soon(progress)
        t_origin = trio.current_time()
        total_s = pre_s + churn_s + cfg.churn_post_s
        reqs = [r for r in trace if r.arrival_s < total_s]
        with trio.move_on_after(total_s + cfg.drain_s) as scope:
            async with trio.open_nursery() as work:
                for ev in schedule:
                    async def later(ev: ChurnEvent = ev) -> None:
                        await trio.sleep_until(t_origin + pre_s + ev.at_s)
                        await cycle(ev)
                    work.start_soon(later)
                for i, req in enumerate(reqs):
                    await trio.sleep_until(t_origin + req.arrival_s)
                    work.start_soon(one, i, req, phase_of(req.arrival_s, pre_s, churn_s))
        meta["replay_wall_s"] = round(trio.current_time() - t_origin, 2)
        meta["cut_short"] = scope.cancelled_caught
        for j, s in enumerate(state):  # a cut-short run may leave a node frozen
            if s == "stopped" and nodes[j].proc is not None:
                nodes[j].proc.send_signal(signal.SIGCONT)
                state[j] = "up"
        # idle window: membership (heartbeats) + digests only
        recovered = await wait_all_up(MESH_TIMEOUT_S + n * 2.0)
        meta["recovered_mesh_s"] = None if recovered is None else round(recovered, 2)
        meta["mesh_up_counts_before_idle"] = list(last_counts)
        quiet[0] = True
        await trio.sleep(3.0)  # let the last PEERS replies and answers settle
        pids = [nd.proc.pid for nd in nodes if nd.proc is not None and nd.proc.poll() is None]
        ss0 = await trio.to_thread.run_sync(_socket_bytes)
        lo0, w0 = _lo_counters(), trio.current_time()
        await trio.sleep(cfg.churn_idle_s)
        lo1, dt = _lo_counters(), trio.current_time() - w0
        ss1 = await trio.to_thread.run_sync(_socket_bytes)
        sent = _sent_by_pid(ss0, ss1) if ss0 is not None and ss1 is not None else {}
        per_pid = sorted(sent.get(p, 0) / dt for p in pids) if sent else []
        idle: dict[str, Any] = {"window_s": round(dt, 2), "nodes_alive": len(pids),
                                "all_up_before_window": recovered is not None}
        if in_netns and lo0 and lo1 and pids:
            idle["lo_bytes_per_node_s"] = (lo1[0] - lo0[0]) / len(pids) / dt
            idle["lo_packets_per_node_s"] = (lo1[1] - lo0[1]) / len(pids) / dt
        if per_pid:  # the nodes' own sockets (to each other and to the idle client)
            idle["tcp_payload_per_node_s_median"] = _percentile(per_pid, 50)
            idle["tcp_payload_per_node_s_mean"] = sum(per_pid) / len(per_pid)
            idle["tcp_payload_per_node_s_min"] = per_pid[0]
            idle["tcp_payload_per_node_s_max"] = per_pid[-1]
        pss = [_pss_kib(p) for p in pids]
        idle["pss_total_mib"] = round(sum(pss) / 1024, 1)
        idle["pss_per_node_mib_max"] = round(max(pss, default=0) / 1024, 1)
        meta["idle"] = idle
        top.cancel_scope.cancel()
    for d in detections:
        d.pop("t0", None)
        d["per_node_s"] = {str(k): v for k, v in d["per_node_s"].items()}
    return {"records": records, "events": events_log, "detections": detections, **meta}


def _start_nodes(cfg: SwarmBenchConfig, policy: str, root: Path, model_path: Path,
                 link_delay_ms: float) -> list[NodeProcess]:
    """Node 0, then the others in parallel batches of ``cfg.start_batch``, each on a fixed
    port (a restarted node keeps its address)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    ports = _free_ports(cfg.nodes)
    listen = [f"/ip4/127.0.0.1/tcp/{p}" for p in ports]
    first = NodeProcess(root, 0, cfg, policy, model_path, link_delay_ms=link_delay_ms,
                        listen=listen[0])
    nodes = [first]
    try:
        first.start()
        rest = [NodeProcess(root, i, cfg, policy, model_path, [first.addr],
                            link_delay_ms=link_delay_ms, listen=listen[i])
                for i in range(1, cfg.nodes)]
        nodes += rest
        with ThreadPoolExecutor(max(1, cfg.start_batch)) as pool:
            for fut in [pool.submit(nd.start) for nd in rest]:
                fut.result()
    except BaseException:
        _stop_all(nodes)
        raise
    return nodes


def _stop_all(nodes: Sequence[NodeProcess]) -> None:
    for nd in nodes:  # a frozen process cannot act on SIGTERM
        if nd.proc is not None and nd.proc.poll() is None:
            with contextlib.suppress(OSError):
                nd.proc.send_signal(signal.SIGCONT)
    for nd in nodes:
        nd.stop()


def run_churn(cfg: SwarmBenchConfig, policy: str, trace: Sequence[TraceRequest], root: Path,
              model_path: Path, *, with_churn: bool, in_netns: bool,
              link_delay_ms: float = 0.0) -> dict[str, Any]:
    """One churn-mode run on fresh nodes (``with_churn`` False: the same replay, no churn)."""
    import trio  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    schedule = (churn_schedule(cfg.nodes, cfg.churn, cfg.churn_minutes * 60.0,
                               cfg.churn_interval_s, cfg.churn_down_s) if with_churn else [])
    t0 = time.monotonic()
    nodes = _start_nodes(cfg, policy, root, model_path, link_delay_ms)
    try:
        startup_s = time.monotonic() - t0
        mem_avail_mib = _mem_available_mib()
        res = trio.run(_churn_replay, nodes, trace, cfg, schedule, in_netns)
    finally:
        _stop_all(nodes)
    res.update(run="churn" if with_churn else "no churn", policy=policy,
               startup_s=round(startup_s, 2), mem_available_after_start_mib=mem_avail_mib,
               victims=[{"node": v, "kind": k} for v, k in churn_victims(cfg.nodes, cfg.churn)]
               if with_churn else [],
               phases=summarise_phases(res["records"]),
               detection=summarise_detection(res["detections"]))
    return res


def _mem_available_mib() -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 1024, 1)
    return math.nan


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_churn_table(result: dict[str, Any]) -> str:
    cfg, net = result["config"], result["network"]
    lines = [
        f"churn mode: {cfg['nodes']} nodes, policy {cfg['policies'][0]}, "
        f"{cfg['churn']:.0%} of the nodes cycled; phases: before {cfg['churn_pre_s']:g} s, "
        f"churn {cfg['churn_minutes']:g} min (an event every {cfg['churn_interval_s']:g} s, "
        f"down {cfg['churn_down_s']:g} s), after {cfg['churn_post_s']:g} s",
        f"arrivals {cfg['rate']:g} req/s at random entry nodes; a request tries at most "
        f"{cfg['churn_attempts']} entries, {cfg['churn_attempt_timeout_s']:g} s each; "
        f"max_tokens {cfg['max_tokens']}; engine "
        + ("the real model" if cfg.get("backend", "llama") == "llama" else
           f"simulated ({cfg['sim_prefill_tps']:g} prefill / {cfg['sim_decode_tps']:g} decode "
           "tok/s, no model)"),
        f"workload: {result['trace']['source']}",
        f"network: {net['note']}",
        "",
        f"{'run':<10}{'phase':<8}{'answered':>12}{'retried':>9}{'p50 TTFT':>10}"
        f"{'p99 TTFT':>10}{'hit':>7}",
    ]
    for r in result["churn"]["runs"]:
        for ph in (*PHASES, "all"):
            s = r["phases"][ph]
            lines.append(f"{r['run']:<10}{ph:<8}{s['answered']:>6}/{s['sent']:<5}"
                         f"{s['retried']:>9}{_fmt(s['ttft_p50_s']):>10}{_fmt(s['ttft_p99_s']):>10}"
                         f"{s['token_hit_ratio']:>7.3f}")
    lines.append("")
    for r in result["churn"]["runs"]:
        idle = r.get("idle", {})
        lo = idle.get("lo_bytes_per_node_s")
        wc = idle.get("tcp_payload_per_node_s_median")
        lines.append(
            f"{r['run']}: idle {idle.get('window_s', 0):.0f} s, {idle.get('nodes_alive')} "
            f"nodes: membership + digest bytes/s per node "
            + (f"{lo:,.0f} on the wire (lo, headers incl., "
               f"{idle.get('lo_packets_per_node_s', 0):,.0f} packets/s)" if lo else "n/a (lo)")
            + (f", {wc:,.0f} TCP payload (median node, ss)" if wc else "")
            + f"; PSS {idle.get('pss_total_mib', 0):,.0f} MiB total; startup "
            f"{r['startup_s']:.0f} s")
        for kind, d in r["detection"].items():
            if d["events"]:
                lines.append(
                    f"{r['run']}: {kind} detection: {d['complete']}/{d['events']} events seen "
                    f"by every live node; all-nodes median {_fmt(d['all_median_s'], '.2f')} s, "
                    f"p99 {_fmt(d['all_p99_s'], '.2f')} s; single node median "
                    f"{_fmt(d['node_median_s'], '.2f')} s, p99 {_fmt(d['node_p99_s'], '.2f')} s "
                    f"({d['observations']} observations)")
        for label, key, wait in (("start", "mesh_up_counts_at_start", "mesh_wait_s"),
                                 ("end", "mesh_up_counts_before_idle", "recovered_mesh_s")):
            counts = r.get(key) or []
            if counts:
                full = r.get(wait) is not None
                lines.append(f"{r['run']}: mesh at the {label}: "
                             + (f"every node saw all others up after {r[wait]:.0f} s" if full
                                else f"incomplete; peers up per node min {min(counts)}, "
                                f"median {sorted(counts)[len(counts) // 2]} of "
                                f"{len(counts) - 1}"))
        skipped = sum(1 for e in r["events"] if "skipped" in e)
        failed = sum(1 for e in r["events"] if "restart_failed" in e)
        if r["events"]:
            lines.append(f"{r['run']}: {len(r['events'])} churn events, {skipped} skipped, "
                         f"{failed} failed restarts")
    lines.append("")
    lines.append("TTFT in seconds from the first attempt (retries included); hit = cached / "
                 "prompt tokens of the answers")
    lines.append(f"wall time {result['wall_s']:.0f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------- namespace


class NetworkNamespace:
    """A network namespace with loopback up and, if possible, netem delay on its lo.

    ``name`` is None when no namespace could be made; ``delay_applied`` says whether the
    delay is real; ``note`` says why not. ``close()`` kills what runs inside and deletes it.
    """

    def __init__(self, delay_ms: float, enabled: bool = True):
        self.name: str | None = None
        self.delay_applied = False
        self.note = ""
        if not enabled:
            self.note = "namespace disabled (--no-netns): host loopback, no delay"
            return
        name = f"pmbench{os.getpid()}"
        try:
            self._ip("netns", "add", name)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.note = f"no network namespace ({_why(exc)}): host loopback, no delay"
            return
        self.name = name
        try:
            self._ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            self.note = f"namespace loopback unusable ({_why(exc)}): host loopback, no delay"
            return
        if delay_ms <= 0:
            self.note = "network namespace, no delay requested"
            return
        try:
            self._ip("netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                     "netem", "delay", f"{delay_ms}ms")
            self.delay_applied = True
            self.note = (f"network namespace {name}, netem delay {delay_ms} ms on lo "
                         f"(RTT {2 * delay_ms:g} ms)")
        except (OSError, subprocess.CalledProcessError) as exc:
            self.note = f"network namespace without delay: netem unavailable ({_why(exc)})"

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)

    def wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv] if self.name else argv

    def close(self) -> None:
        if self.name is None:
            return
        name, self.name = self.name, None
        # processes left inside are ours (nothing else runs in a namespace we created)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True, timeout=10).stdout.split()
            for pid in pids:
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return (exc.stderr or "").strip() or f"exit {exc.returncode}"
    return str(exc)


# --------------------------------------------------------------------------- driver


def _run_inner(spec_path: Path, out_path: Path) -> int:
    """The part that runs inside the namespace: all policies, one after the other."""
    from prefixmesh.inference.model import default_model_path  # noqa: PLC0415

    spec = json.loads(spec_path.read_text())
    cfg = SwarmBenchConfig(**{**spec["config"], "policies": tuple(spec["config"]["policies"])})
    trace = [TraceRequest(**r) for r in spec["trace"]]
    model_path = Path(default_model_path())
    if not model_path.is_file():
        raise SwarmBenchError(f"default model not fetched ({model_path}): "
                              "run `prefixmesh model fetch` first")
    root = Path(spec["root"])
    results = []
    if cfg.churn > 0:  # churn mode: the first policy, with churn, then without (reference)
        policy = cfg.policies[0]
        for with_churn in (True, False) if cfg.churn_baseline else (True,):
            name = "churn" if with_churn else "nochurn"
            print(f"bench swarm: {name} run: starting {cfg.nodes} nodes", file=sys.stderr,
                  flush=True)
            res = run_churn(cfg, policy, trace, root / name, model_path, with_churn=with_churn,
                            in_netns=bool(spec.get("in_netns")),
                            link_delay_ms=float(spec.get("app_delay_ms") or 0.0))
            a = res["phases"]["all"]
            print(f"bench swarm: {name} run: {a['answered']}/{a['sent']} answered, "
                  f"hit {a['token_hit_ratio']:.3f}", file=sys.stderr, flush=True)
            results.append(res)
            out_path.write_text(json.dumps(results))
        return 0
    for policy in cfg.policies:
        print(f"bench swarm: policy {policy}: starting {cfg.nodes} nodes", file=sys.stderr,
              flush=True)
        res = run_policy(cfg, policy, trace, root / policy, model_path,
                         link_delay_ms=float(spec.get("app_delay_ms") or 0.0))
        print(f"bench swarm: policy {policy}: {res['ok']}/{res['requests']} ok, "
              f"TTFT mean {res['ttft_mean_s']:.3f} s, hit {res['token_hit_ratio']:.3f}",
              file=sys.stderr, flush=True)
        results.append(res)
        out_path.write_text(json.dumps(results))
    return 0


PROGRESS_EVERY_S = 2.0  # the CLI's rule: every step longer than 2 s says how far it is


def _time_budget_s(cfg: SwarmBenchConfig, trace: Trace) -> float:
    last = trace.requests[-1].arrival_s if trace.requests else 0.0
    if cfg.churn > 0:
        per_run = (NODE_START_TIMEOUT_S * (2 + cfg.nodes / max(1, cfg.start_batch))
                   + 2 * (MESH_TIMEOUT_S + cfg.nodes * 2.0) + cfg.churn_pre_s
                   + cfg.churn_minutes * 60.0 + cfg.churn_post_s + cfg.drain_s
                   + cfg.churn_idle_s + 60.0 + cfg.nodes * 10.0)
        return per_run * (2 if cfg.churn_baseline else 1) + 30.0
    per_policy = (cfg.nodes * NODE_START_TIMEOUT_S + MESH_TIMEOUT_S + last + cfg.drain_s
                  + 30.0 + cfg.nodes * 10.0)
    return per_policy * len(cfg.policies) + 30.0


def run_swarm_bench(cfg: SwarmBenchConfig) -> dict[str, Any]:
    """Run the whole benchmark; returns the result (``policies``: one summary each)."""
    cfg.validate()
    if cfg.churn > 0:  # open-loop arrivals over the three phases: rate x duration
        total_s = cfg.churn_pre_s + cfg.churn_minutes * 60.0 + cfg.churn_post_s
        cfg.requests = math.ceil(cfg.rate * total_s) + 5
    trace = build_trace(cfg)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="pm-bench-swarm-"))
    net = NetworkNamespace(cfg.delay_ms, cfg.netns)
    inner: subprocess.Popen | None = None
    try:
        # no netem here: fall back to the nodes' own per-frame delay (same RTT, applied
        # in the application; see overlay.host.set_link_delay for how it differs)
        app_delay_ms = cfg.delay_ms if cfg.delay_ms > 0 and not net.delay_applied else 0.0
        if app_delay_ms:
            net.note += (f"; instead each node delays every frame it sends by {app_delay_ms:g}"
                         f" ms in the application (RTT {2 * app_delay_ms:g} ms between nodes)")
        spec = {"config": asdict(cfg), "trace": [asdict(r) for r in trace.requests],
                "root": str(tmp / "run"), "app_delay_ms": app_delay_ms,
                "in_netns": net.name is not None}
        spec_path, out_path = tmp / "spec.json", tmp / "results.json"
        spec_path.write_text(json.dumps(spec))
        argv = net.wrap([sys.executable, "-m", "prefixmesh.bench.swarm", "--inner",
                         str(spec_path), str(out_path)])
        inner = subprocess.Popen(argv, start_new_session=True)
        try:
            rc = inner.wait(_time_budget_s(cfg, trace))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            partial = json.loads(out_path.read_text()) if out_path.is_file() else []
            raise SwarmBenchError(
                f"benchmark process {'timed out' if rc is None else f'failed (exit {rc})'} "
                f"after {len(partial)} of "
                + (f"{1 + cfg.churn_baseline} churn-mode runs" if cfg.churn > 0 else
                   f"{len(cfg.policies)} policies") + f"; node logs in {tmp}"
                + ("" if cfg.keep else " (removed; pass --keep to keep them)"))
        results = json.loads(out_path.read_text())
    finally:
        if inner is not None and inner.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(inner.pid, signal.SIGKILL)  # the group we started (new session)
            with contextlib.suppress(subprocess.TimeoutExpired):
                inner.wait(10)
        network = {"namespace": net.name is not None, "delay_ms": cfg.delay_ms,
                   "delay_applied": net.delay_applied,
                   "app_delay": bool(cfg.delay_ms > 0 and not net.delay_applied),
                   "note": net.note}
        net.close()
        if not cfg.keep:
            import shutil  # noqa: PLC0415

            shutil.rmtree(tmp, ignore_errors=True)
    hidden = ("keep",) if cfg.churn > 0 else ("keep", *CHURN_FIELDS)
    if cfg.backend == "llama":
        hidden = (*hidden, *SIM_FIELDS)
    out = {
        "config": {k: v for k, v in asdict(cfg).items() if k not in hidden},
        "trace": {"source": trace.source, "requests": len(trace.requests),
                  "prompt_tokens": sum(len(r.tokens) for r in trace.requests),
                  "truncated": trace.truncated, "ideal_hit_ratio": trace.ideal_hit_ratio,
                  "span_s": trace.requests[-1].arrival_s if trace.requests else 0.0,
                  "notes": trace.notes},
        "network": network,
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "wall_s": round(time.monotonic() - t0, 1),
        "policies": results,
    }
    if cfg.churn > 0:
        out["policies"] = []
        out["churn"] = {"runs": results}
        out["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return out


def format_table(result: dict[str, Any]) -> str:
    if result.get("churn"):
        return format_churn_table(result)
    tr, net = result["trace"], result["network"]
    cfg = result["config"]
    lines = [
        f"workload: {tr['source']}; {tr['requests']} requests, {tr['prompt_tokens']} prompt "
        f"tokens ({tr['truncated']} cut to the context), ideal hit ratio "
        f"{tr['ideal_hit_ratio']:.3f}",
        f"arrivals: {cfg['rate']:g} req/s (span {tr['span_s']:.0f} s), entry round-robin; "
        f"{cfg['nodes']} nodes, max_tokens {cfg['max_tokens']}, n_threads {cfg['n_threads']}",
        f"network: {net['note']}",
        *[f"note: {n}" for n in tr["notes"]],
        "",
        f"{'policy':<16}{'ok':>8}{'TTFT mean':>11}{'p50':>8}{'p99':>8}{'hit':>7}"
        f"{'fwd':>7}{'hops':>6}  served per node",
    ]
    for p in result["policies"]:
        lines.append(
            f"{p['policy']:<16}{p['ok']:>4}/{p['requests']:<3}{p['ttft_mean_s']:>11.3f}"
            f"{p['ttft_p50_s']:>8.3f}{p['ttft_p99_s']:>8.3f}{p['token_hit_ratio']:>7.3f}"
            f"{p['forwarded_fraction']:>7.3f}{p['mean_forward_hops']:>6.2f}  "
            f"{' '.join(str(x) for x in p['served_per_node'])}"
            + (f"  errors {p['errors']}" if p["errors"] else ""))
    lines.append("")
    lines.append("TTFT in seconds (client side); hit = cached / prompt tokens; fwd = share "
                 "served by a node other than the entry")
    lines.append(f"wall time {result['wall_s']:.0f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def add_swarm_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``prefixmesh bench swarm``."""
    d = SwarmBenchConfig()
    p.add_argument("--nodes", type=int, default=d.nodes, help="node processes (1-16)")
    p.add_argument("--requests", type=int, default=d.requests,
                   help="replay the first N requests of the trace")
    p.add_argument("--policies", default=",".join(d.policies),
                   help="comma-separated routing policies, each run on fresh nodes")
    p.add_argument("--delay-ms", type=float, default=d.delay_ms,
                   help="netem delay on the namespace loopback (RTT = 2 x this)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens")
    p.add_argument("--rate", type=float, default=d.rate, help="mean arrivals per second")
    p.add_argument("--workload", default=d.workload, choices=["mmlu", "synthetic"])
    p.add_argument("--shared-dir", default=None,
                   help="folder holding workloads/ (default $PREFIXMESH_SHARED_DIR or ../shared)")
    p.add_argument("--n-ctx", type=int, default=d.n_ctx, help="context window per node")
    p.add_argument("--n-threads", type=int, default=d.n_threads, help="llama.cpp threads per node")
    p.add_argument("--ram-budget", default=d.ram_budget, help="KV RAM budget per node")
    p.add_argument("--disk-budget", default=d.disk_budget, help="KV disk budget per node")
    p.add_argument("--digest-interval", type=float, default=d.digest_interval_s,
                   help="seconds between digest exchanges")
    p.add_argument("--hop-budget", type=int, default=d.hop_budget)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="deadline of each request, seconds")
    p.add_argument("--drain", type=float, default=d.drain_s,
                   help="seconds after the last arrival before a policy's run is cut off")
    p.add_argument("--no-netns", action="store_true", help="run on the host loopback")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (node logs)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    g = p.add_argument_group("churn mode (--churn F > 0: one policy, phases before/during/"
                             "after churn, then the same replay without churn)")
    g.add_argument("--churn", type=float, default=d.churn,
                   help="fraction of the nodes cycled (half kill -9 + restart, half "
                   "SIGSTOP + SIGCONT); 0 = off (up to 64 nodes when on)")
    g.add_argument("--churn-minutes", type=float, default=d.churn_minutes,
                   help="length of the churn phase, minutes")
    g.add_argument("--churn-pre", type=float, default=d.churn_pre_s,
                   help="seconds of requests before churn")
    g.add_argument("--churn-post", type=float, default=d.churn_post_s,
                   help="seconds of requests after churn")
    g.add_argument("--churn-interval", type=float, default=d.churn_interval_s,
                   help="seconds between churn events (round-robin over the victims)")
    g.add_argument("--churn-down", type=float, default=d.churn_down_s,
                   help="seconds a victim stays killed or frozen")
    g.add_argument("--churn-attempt-timeout", type=float, default=d.churn_attempt_timeout_s,
                   help="the client abandons an entry node after this many seconds")
    g.add_argument("--churn-attempts", type=int, default=d.churn_attempts,
                   help="entry nodes a request tries before it counts as lost")
    g.add_argument("--churn-idle", type=float, default=d.churn_idle_s,
                   help="idle seconds after the replay in which membership + digest bytes "
                   "are measured")
    g.add_argument("--no-churn-baseline", action="store_true",
                   help="skip the reference run without churn")
    g.add_argument("--backend", choices=["llama", "sim"], default=d.backend,
                   help="the nodes' engine: the real model or the simulated one (no CPU)")
    g.add_argument("--sim-prefill-tps", type=float, default=d.sim_prefill_tps,
                   help="simulated engine: prompt tokens per second")
    g.add_argument("--sim-decode-tps", type=float, default=d.sim_decode_tps,
                   help="simulated engine: output tokens per second")
    g.add_argument("--start-batch", type=int, default=d.start_batch,
                   help="node processes started in parallel (churn mode)")


def config_from_namespace(ns: argparse.Namespace) -> SwarmBenchConfig:
    return SwarmBenchConfig(
        nodes=ns.nodes, requests=ns.requests,
        policies=tuple(p.strip() for p in ns.policies.split(",") if p.strip()),
        delay_ms=ns.delay_ms, max_tokens=ns.max_tokens, rate=ns.rate, workload=ns.workload,
        shared_dir=ns.shared_dir, n_ctx=ns.n_ctx, n_threads=ns.n_threads,
        ram_budget=ns.ram_budget, disk_budget=ns.disk_budget,
        digest_interval_s=ns.digest_interval, hop_budget=ns.hop_budget,
        request_timeout_s=ns.request_timeout, drain_s=ns.drain, keep=ns.keep,
        netns=not ns.no_netns,
        **_churn_options(ns),
    )  # fmt: skip


def _churn_options(ns: argparse.Namespace) -> dict[str, Any]:
    sim = {} if getattr(ns, "backend", "llama") == "llama" else {
        "backend": ns.backend, "sim_prefill_tps": ns.sim_prefill_tps,
        "sim_decode_tps": ns.sim_decode_tps}
    if not getattr(ns, "churn", 0.0):
        return sim
    return {**sim,
        "churn": ns.churn, "churn_minutes": ns.churn_minutes, "churn_pre_s": ns.churn_pre,
        "churn_post_s": ns.churn_post, "churn_interval_s": ns.churn_interval,
        "churn_down_s": ns.churn_down, "churn_attempt_timeout_s": ns.churn_attempt_timeout,
        "churn_attempts": ns.churn_attempts, "churn_idle_s": ns.churn_idle,
        "churn_baseline": not ns.no_churn_baseline, "start_batch": ns.start_batch,
    }  # fmt: skip


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


class _Terminated(Exception):
    pass


def run_bench_swarm(ns: argparse.Namespace) -> int:
    """``prefixmesh bench swarm``: run the benchmark and print a table (or JSON)."""

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        result = run_swarm_bench(config_from_namespace(ns))
    except SwarmBenchError as exc:
        print(f"prefixmesh bench swarm: {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        print("prefixmesh bench swarm: terminated", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    if ns.json:
        print(json.dumps(_json_safe(result)))
    else:
        print(format_table(result))
    if result.get("churn"):
        runs = result["churn"]["runs"]
        return 0 if all(r["phases"]["all"]["lost"] == 0 for r in runs) else 2
    return 0 if all(p["ok"] == p["requests"] for p in result["policies"]) else 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--inner"] and len(argv) == 3:
        return _run_inner(Path(argv[1]), Path(argv[2]))
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.swarm",
                                description=(__doc__ or "").splitlines()[0])
    add_swarm_arguments(p)
    return run_bench_swarm(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
