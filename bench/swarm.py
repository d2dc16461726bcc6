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
    Node start-up 90 s each; mesh formation 60 s; each request ``--request-timeout`` s;
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

NODE_START_TIMEOUT_S = 90.0
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

    def validate(self) -> None:
        from .policies import POLICY_NAMES  # noqa: PLC0415

        if not 1 <= self.nodes <= 16:
            raise SwarmBenchError(f"--nodes must be 1..16, got {self.nodes}")
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
                 link_delay_ms: float = 0.0):
        from .node_entry import write_config  # noqa: PLC0415

        self.index = index
        self.root = root / f"node{index}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "node.log"
        config = write_config(self.root / "node.toml", {
            "node": {"listen": "/ip4/127.0.0.1/tcp/0", "key_file": str(self.root / "node.key"),
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
        self.proc: subprocess.Popen | None = None
        self.addrs: list[str] = []

    def start(self) -> NodeProcess:
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
    per_policy = (cfg.nodes * NODE_START_TIMEOUT_S + MESH_TIMEOUT_S + last + cfg.drain_s
                  + 30.0 + cfg.nodes * 10.0)
    return per_policy * len(cfg.policies) + 30.0


def run_swarm_bench(cfg: SwarmBenchConfig) -> dict[str, Any]:
    """Run the whole benchmark; returns the result (``policies``: one summary each)."""
    cfg.validate()
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
                "root": str(tmp / "run"), "app_delay_ms": app_delay_ms}
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
                f"after {len(partial)} of {len(cfg.policies)} policies; node logs in {tmp}"
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
    return {
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("keep",)},
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


def format_table(result: dict[str, Any]) -> str:
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
    )  # fmt: skip


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
