"""``prefixmesh bench engine --against-llama-server PATH``: prefixmesh vs llama-server.

Runs the same workloads, HTTP to HTTP, against a llama-server binary (``make llama-server``
builds one from the llama.cpp source vendored in the llama-cpp-python sdist we run) and
against a prefixmesh node with its OpenAI-compatible gateway (``prefixmesh node --config``,
local routing, one node), both on the same model (the embedded default unless ``--model``)
with the same llama thread count (``--threads``, default 1 each). Not part of CI.

- llama-server: ``-fa off --parallel 4 --kv-unified --no-repack`` (its AMX repack kernel
  dies with an illegal instruction on the project's CPU), ``-c N_CTX``, prompt cache on
  (``cache_prompt``; its default ``--cache-ram`` host-RAM prompt cache too). Requests go to
  ``/v1/completions`` with the prompt as token ids.
- prefixmesh: ``/v1/completions`` with the same token ids (the prompts are texts whose
  tokenization, the engine's: special tokens parsed, no BOS, is exactly those ids; until
  2026-12-06 the node was sent the text and tokenized it); every answer's
  ``usage.prompt_tokens`` is checked against them. One node per batch mode
  (``--modes``: ``deterministic`` with ``live_sequence`` on, ``throughput``).

Servers run side by side; every workload interleaves them (the order rotates per round)
and reports medians. Greedy (temperature 0). TTFT is measured by the client: request sent
to the first streamed text. The machine's load (``os.getloadavg``) is recorded before and
after every workload.

Workloads (``--workloads``):

- ``warm``: a ~533-token prefix is cached, then ``--rounds`` requests of prefix + a short
  new suffix (8 tokens), max_tokens 1: warm TTFT. Target prefixmesh <= 0.8x llama-server.
- ``concurrent``: 8 clients x 4 requests one after the other, shared ~500-token prefix
  (cached first, then one unmeasured round per server: llama-server's slots take the prefix
  once each) + 16 unique tokens, max_tokens 32, non-streaming; throughput = completion
  tokens / wall time of the round, latency = request sent to answer received. Targets:
  throughput >= 1.5x, p99 latency <= 1.0x.
- ``cycle``: 32 prefixes of ~500 tokens (more than llama-server's 4 slots), each requested
  once (cold TTFT), then cycled ``--cycle-passes`` times with a new suffix each time:
  median TTFT. Target <= 0.5x.
- ``restart``: each server is stopped and started again: ready = process start to its
  HTTP API answering; then TTFT of one of the cycled prefixes + a new suffix. prefixmesh's
  disk cache survives; it is first padded to ``--cache-gb`` with synthetic-but-valid state
  files (its own fingerprint and namespace, random payloads of real sizes) and dropped
  from the page cache before each start. llama-server's caches are in RAM only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .bench_restart import drop_page_cache

__all__ = [
    "LLAMA_SERVER_FLAGS",
    "WORKLOADS",
    "MODES",
    "TARGETS",
    "llama_server_path",
    "bench_against_llama_server",
    "format_report",
    "run_against_llama_server",
]

LLAMA_SERVER_FLAGS = ("-fa", "off", "--parallel", "4", "--kv-unified", "--no-repack")
WORKLOADS = ("warm", "concurrent", "cycle", "restart")
MODES = ("deterministic", "throughput")
# (workload, metric) -> (comparison, bound): prefixmesh / llama-server  <= or >=  bound
TARGETS = {
    ("warm", "ttft_s"): ("<=", 0.8),
    ("concurrent", "tok_per_s"): (">=", 1.5),
    ("concurrent", "p99_latency_s"): ("<=", 1.0),
    ("cycle", "ttft_s"): ("<=", 0.5),
}
_LS = "llama-server"
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "river mountain network cache prefix token model memory window garden letter market "
    "history science music winter harbor engine signal volunteer question answer number"
).split()


def llama_server_path(text: str) -> Path:
    """argparse type of ``--against-llama-server``: an existing executable file."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(
            f"{text}: no such file (build llama-server with `make llama-server`: "
            ".build/llama-server/build/bin/llama-server)")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: not an executable file")
    return path.resolve()


def _pos_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _pos_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _csv(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return items

    return parse


def add_comparison_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "comparison with llama-server (--against-llama-server; docs/bench/engine.md)")
    g.add_argument("--against-llama-server", type=llama_server_path, default=None,
                   metavar="PATH", help="run the comparison workloads against this llama-server "
                   "binary instead of the engine benchmark (build: make llama-server)")
    g.add_argument("--workloads", type=_csv(WORKLOADS), default=list(WORKLOADS),
                   help="comma-separated: " + ",".join(WORKLOADS))
    g.add_argument("--modes", type=_csv(MODES), default=list(MODES),
                   help="prefixmesh batch modes to run (one node each)")
    g.add_argument("--rounds", type=_pos_int, default=5,
                   help="interleaved rounds (warm: requests; concurrent: rounds of 32)")
    g.add_argument("--cycle-prefixes", type=_pos_int, default=32)
    g.add_argument("--cycle-passes", type=_pos_int, default=1)
    g.add_argument("--cycle-prefix-tokens", type=_pos_int, default=500,
                   help="cycle: length of each of the prefixes")
    g.add_argument("--cache-gb", type=_pos_float, default=1.5,
                   help="restart: pad prefixmesh's disk cache to this size")
    g.add_argument("--restarts", type=_pos_int, default=3, help="restart: runs per server")
    g.add_argument("--n-ctx", type=_pos_int, default=8192, help="context of every server")


# --------------------------------------------------------------------------- prompts


class _Prompts:
    """Deterministic pseudo-text whose token ids are known exactly (vocab-only llama)."""

    def __init__(self, model: Path) -> None:
        import llama_cpp

        self._llama = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        # what the engine does for a completion prompt: special tokens parsed, no BOS
        return self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def text(self, seed: int, n_tokens: int) -> str:
        """About ``n_tokens`` tokens of words, starting with a space, ending with '.', so
        that tokens(a + b) == tokens(a) + tokens(b) for two such texts."""
        rng = random.Random(seed)
        words: list[str] = []
        while True:
            words.extend(rng.choice(_WORDS) for _ in range(16))
            text = " " + " ".join(words) + "."
            if len(self.tokenize(text)) >= n_tokens:
                break
        while len(words) > 1:
            shorter = " " + " ".join(words[:-1]) + "."
            if len(self.tokenize(shorter)) < n_tokens:
                break
            words.pop()
        return " " + " ".join(words) + "."

    def close(self) -> None:
        self._llama.close()


# --------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    name = ""
    ready_path = "/v1/models"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / f"{self.name}.log"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 300.0) -> float:
        """Start the process; seconds until its HTTP API answers (ready)."""
        import httpx

        log = open(self.log_path, "ab")
        # one client for the whole wait: httpx.get() builds a client (and a TLS context)
        # per call, 22 ms of CPU, so polling every 20 ms took half a core from the server
        # that was starting (on 2 cores, from the node's load thread)
        with httpx.Client(timeout=2.0) as client:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
            log.close()
            deadline = t0 + timeout_s
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} at "
                                       f"start; log: {self.log_path}\n{self.log_tail()}")
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def body(self, tokens: list[int], max_tokens: int, stream: bool) -> dict:
        raise NotImplementedError


class _LlamaServer(_Server):
    name = _LS
    ready_path = "/health"

    def __init__(self, workdir: Path, binary: Path, model: Path, threads: int,
                 n_ctx: int) -> None:
        super().__init__(workdir)
        self.binary, self.model, self.threads, self.n_ctx = binary, model, threads, n_ctx

    def argv(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "-t", str(self.threads), "-tb", str(self.threads),
                "-c", str(self.n_ctx), "-ngl", "0", *LLAMA_SERVER_FLAGS]

    def body(self, tokens, max_tokens, stream):
        out = {"model": "m", "prompt": list(tokens), "max_tokens": max_tokens,
               "temperature": 0.0, "stream": stream, "cache_prompt": True}
        if stream:
            out["stream_options"] = {"include_usage": True}
        return out

    def version(self) -> str:
        try:
            done = subprocess.run([str(self.binary), "--version"], capture_output=True,
                                  text=True, timeout=30)
            return " ".join((done.stdout + done.stderr).split())[:200]
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unknown ({exc})"


class _Node(_Server):
    def __init__(self, workdir: Path, mode: str, model: Path | None, threads: int,
                 n_ctx: int) -> None:
        self.name = f"prefixmesh-{mode}"
        super().__init__(workdir)
        self.mode = mode
        self.cache_dir = workdir / f"kv-{mode}"
        self.config = workdir / f"{self.name}.toml"
        model_line = f'path = "{model}"\n' if model is not None else ""
        live = "true" if mode == "deterministic" else "false"
        self.config.write_text(
            "[node]\n"
            'listen = "/ip4/127.0.0.1/tcp/0"\nmdns = false\n'
            f'key_file = "{workdir / (self.name + ".key")}"\n'
            f'cache_dir = "{self.cache_dir}"\n'
            'ram_budget = "2GiB"\ndisk_budget = "8GiB"\nlog_level = "info"\n'
            f"[model]\n{model_line}n_ctx = {n_ctx}\nn_threads = {threads}\n"
            f'batch_mode = "{mode}"\nlive_sequence = {live}\n'
            '[routing]\npolicy = "local"\n'
            f'[http]\nlisten = "127.0.0.1:{self.port}"\n')

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "prefixmesh", "node", "--config", str(self.config)]

    def engine_ready_s(self) -> float | None:
        """The node's own log line: model load + KV cache index, the last start's."""
        found = None
        try:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if "checking the KV cache: done in" in line:
                    with contextlib.suppress(ValueError, IndexError):
                        found = float(line.rsplit("done in", 1)[1].split()[0])
        except OSError:
            pass
        return found

    def body(self, tokens, max_tokens, stream):
        out = {"model": "prefixmesh", "prompt": list(tokens), "max_tokens": max_tokens,
               "temperature": 0.0, "stream": stream}
        if stream:
            out["stream_options"] = {"include_usage": True}
        return out


# --------------------------------------------------------------------------- requests


class _Result:
    __slots__ = ("ttft_s", "total_s", "completion_tokens", "prompt_tokens", "cached_tokens",
                 "server_ttft_s")

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        # the server's own figure: prefixmesh's route ttft_ms (engine service time to the
        # first token), llama-server's timings.prompt_ms (prompt evaluation)
        self.server_ttft_s: float | None = None
        self.total_s = 0.0
        self.completion_tokens = 0
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None


def _usage(res: _Result, usage: dict | None) -> None:
    if not usage:
        return
    res.completion_tokens = int(usage.get("completion_tokens") or res.completion_tokens)
    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        res.cached_tokens = details["cached_tokens"]


def _server_ttft(res: _Result, obj: dict) -> None:
    route = (obj.get("prefixmesh") or {}).get("route") or {}
    if route.get("ttft_ms") is not None:
        res.server_ttft_s = float(route["ttft_ms"]) / 1000
    timings = obj.get("timings") or {}
    if timings.get("prompt_ms") is not None:
        res.server_ttft_s = float(timings["prompt_ms"]) / 1000


def _request(client, server: _Server, tokens: list[int], max_tokens: int,
             stream: bool) -> _Result:
    res = _Result()
    body = server.body(tokens, max_tokens, stream)
    url = server.url + "/v1/completions"
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url, json=body)
        res.total_s = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")
        obj = r.json()
        _usage(res, obj.get("usage"))
        _server_ttft(res, obj)
        return res
    pieces = 0
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                pieces += 1
                if res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - t0
            _usage(res, obj.get("usage"))
            _server_ttft(res, obj)
    res.total_s = time.perf_counter() - t0
    if res.ttft_s is None:
        res.ttft_s = res.total_s
    res.completion_tokens = res.completion_tokens or pieces
    return res


def _percentile(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _rotate(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


# --------------------------------------------------------------------------- workloads


class _Bench:
    def __init__(self, servers: list[_Server], prompts: _Prompts, rounds: int,
                 log: Callable[[str], None]) -> None:
        import httpx

        self.servers = servers
        self.p = prompts
        self.rounds = rounds
        self.log = log
        self.client = httpx.Client(timeout=600.0)
        self.token_mismatches = 0

    def one(self, server: _Server, text: str, max_tokens: int, stream: bool = True,
            client=None, tokens: list[int] | None = None) -> _Result:
        tokens = self.p.tokenize(text) if tokens is None else tokens
        res = _request(client or self.client, server, tokens, max_tokens, stream)
        if res.prompt_tokens is not None and res.prompt_tokens != len(tokens):
            self.token_mismatches += 1
            self.log(f"warning: {server.name} counted {res.prompt_tokens} prompt tokens, "
                     f"expected {len(tokens)}")
        return res

    def warm(self, prefix_tokens: int = 533, suffix_tokens: int = 8) -> dict:
        prefix = self.p.text(17_000, prefix_tokens)
        for s in self.servers:  # cache the prefix (and warm the server up)
            self.one(s, prefix + self.p.text(17_001, suffix_tokens), 1)
        ttft: dict[str, list[float]] = {s.name: [] for s in self.servers}
        inner: dict[str, list[float]] = {s.name: [] for s in self.servers}
        for i in range(self.rounds):
            text = prefix + self.p.text(17_100 + i, suffix_tokens)
            for s in _rotate(self.servers, i):
                res = self.one(s, text, 1)
                ttft[s.name].append(res.ttft_s)
                if res.server_ttft_s is not None:
                    inner[s.name].append(res.server_ttft_s)
            self.log(f"warm {i}: " + ", ".join(f"{k} {v[-1] * 1000:.0f} ms"
                                               for k, v in ttft.items()))
        return {"prefix_tokens": len(self.p.tokenize(prefix)), "suffix_tokens": suffix_tokens,
                "max_tokens": 1,
                "servers": {k: {"ttft_s": statistics.median(v), "samples": v,
                                "server_ttft_s": statistics.median(inner[k]) if inner[k]
                                else None} for k, v in ttft.items()}}

    def _clients(self, server: _Server, texts: list[list[str]], toks: list[list[list[int]]],
                 max_tokens: int) -> tuple[float, list[float], int]:
        """One client thread per row of ``texts``, each sending its requests one after the
        other (non-streaming); all start together. (wall s, latencies, completion tokens)"""
        import httpx

        lat: list[float] = []
        done = [0]
        lock = threading.Lock()
        errors: list[BaseException] = []
        start = threading.Barrier(len(texts) + 1)

        def client_main(c: int) -> None:
            with httpx.Client(timeout=600.0) as cl:
                start.wait()
                try:
                    for j in range(len(texts[c])):
                        r = self.one(server, texts[c][j], max_tokens, stream=False,
                                     client=cl, tokens=toks[c][j])
                        with lock:
                            lat.append(r.total_s)
                            done[0] += r.completion_tokens
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

        threads = [threading.Thread(target=client_main, args=(c,), daemon=True)
                   for c in range(len(texts))]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return wall, lat, done[0]

    def concurrent(self, clients: int = 8, per_client: int = 4, prefix_tokens: int = 500,
                   suffix_tokens: int = 16, max_tokens: int = 32) -> dict:
        prefix = self.p.text(18_000, prefix_tokens)
        for s in self.servers:
            self.one(s, prefix + self.p.text(18_001, suffix_tokens), 1)
        out: dict[str, dict] = {s.name: {"tok_per_s": [], "latencies": [], "tokens": 0}
                                for s in self.servers}
        # one unmeasured round first: llama-server's slots each take the shared prefix the
        # first time they serve it (its first round ran 2-3x slower than its later ones)
        warm_texts = [[prefix + self.p.text(60_000 + c * 10 + j, suffix_tokens)
                       for j in range(per_client)] for c in range(clients)]
        warm_toks = [[self.p.tokenize(t) for t in row] for row in warm_texts]
        for s in self.servers:
            wall, _, n_tokens = self._clients(s, warm_texts, warm_toks, max_tokens)
            self.log(f"concurrent warm-up {s.name}: {n_tokens / wall:.1f} tok/s (not counted)")
        for rnd in range(self.rounds):
            texts = [[prefix + self.p.text(18_100 + rnd * 1000 + c * 10 + j, suffix_tokens)
                      for j in range(per_client)] for c in range(clients)]
            toks = [[self.p.tokenize(t) for t in row] for row in texts]
            for s in _rotate(self.servers, rnd):
                wall, lat, n_tokens = self._clients(s, texts, toks, max_tokens)
                o = out[s.name]
                o["tok_per_s"].append(n_tokens / wall)
                o["latencies"].extend(lat)
                o["tokens"] += n_tokens
                self.log(f"concurrent round {rnd} {s.name}: {n_tokens / wall:.1f} tok/s, "
                         f"p99 {_percentile(lat, 0.99):.2f} s, wall {wall:.1f} s")
        servers = {}
        for name, o in out.items():
            servers[name] = {
                "tok_per_s": statistics.median(o["tok_per_s"]),
                "p50_latency_s": _percentile(o["latencies"], 0.5),
                "p99_latency_s": _percentile(o["latencies"], 0.99),
                "completion_tokens": o["tokens"], "samples_tok_per_s": o["tok_per_s"],
            }
        return {"clients": clients, "requests_per_client": per_client,
                "prefix_tokens": len(self.p.tokenize(prefix)), "suffix_tokens": suffix_tokens,
                "max_tokens": max_tokens, "rounds": self.rounds, "servers": servers}

    def cycle_prefixes(self, n: int, prefix_tokens: int = 500) -> list[str]:
        return [self.p.text(19_000 + j, prefix_tokens) for j in range(n)]

    def cycle(self, n: int, passes: int, suffix_tokens: int = 8,
              prefix_tokens: int = 500) -> dict:
        prefixes = self.cycle_prefixes(n, prefix_tokens)
        cold: dict[str, list[float]] = {s.name: [] for s in self.servers}
        warm: dict[str, list[float]] = {s.name: [] for s in self.servers}
        for j, pre in enumerate(prefixes):
            text = pre + self.p.text(19_500 + j, suffix_tokens)
            for s in _rotate(self.servers, j):
                cold[s.name].append(self.one(s, text, 1).ttft_s)
        self.log("cycle cold: " + ", ".join(f"{k} {statistics.median(v):.2f} s"
                                             for k, v in cold.items()))
        for k in range(passes):
            for j, pre in enumerate(prefixes):
                text = pre + self.p.text(20_000 + k * 1000 + j, suffix_tokens)
                for s in _rotate(self.servers, j + k):
                    warm[s.name].append(self.one(s, text, 1).ttft_s)
            self.log(f"cycle pass {k}: " + ", ".join(f"{name} {statistics.median(v):.3f} s"
                                                     for name, v in warm.items()))
        return {"prefixes": n, "passes": passes,
                "prefix_tokens": len(self.p.tokenize(prefixes[0])),
                "servers": {name: {"ttft_s": statistics.median(warm[name]),
                                   "p90_ttft_s": _percentile(warm[name], 0.9),
                                   "cold_ttft_s": statistics.median(cold[name]),
                                   "samples": warm[name]} for name in warm}}

    def restart(self, restarts: int, cache_gb: float, suffix_tokens: int = 8,
                prefix_tokens: int = 500) -> dict:
        pre = self.cycle_prefixes(1, prefix_tokens)[0]
        # the prefix must be cached (and on disk) before the first stop
        for s in self.servers:
            self.one(s, pre + self.p.text(21_000, suffix_tokens), 1)
        for s in self.servers:
            s.stop()
        cache = {}
        for s in self.servers:
            if isinstance(s, _Node):
                cache[s.name] = _pad_cache(s.cache_dir, cache_gb, self.log)
        ready: dict[str, list[float]] = {s.name: [] for s in self.servers}
        ttft: dict[str, list[float]] = {s.name: [] for s in self.servers}
        cached: dict[str, list] = {s.name: [] for s in self.servers}
        engine_ready: dict[str, list] = {s.name: [] for s in self.servers}
        for r in range(restarts):
            for s in _rotate(self.servers, r):
                if isinstance(s, _Node):
                    drop_page_cache(s.cache_dir)
                ready[s.name].append(s.start())
                if isinstance(s, _Node):
                    engine_ready[s.name].append(s.engine_ready_s())
                res = self.one(s, pre + self.p.text(21_100 + r, suffix_tokens), 1)
                ttft[s.name].append(res.ttft_s)
                cached[s.name].append(res.cached_tokens)
                s.stop()
                self.log(f"restart {r} {s.name}: ready {ready[s.name][-1]:.2f} s, "
                         f"TTFT {res.ttft_s:.3f} s (cached {res.cached_tokens})")
        for s in self.servers:  # leave them running, as found
            s.start()
        return {"restarts": restarts, "prefix_tokens": len(self.p.tokenize(pre)),
                "cache": cache,
                "servers": {name: {"ready_s": statistics.median(ready[name]),
                                   "ttft_s": statistics.median(ttft[name]),
                                   "cached_tokens": cached[name],
                                   "engine_ready_s": engine_ready[name],
                                   "samples_ready": ready[name], "samples_ttft": ttft[name]}
                            for name in ready}}


def _pad_cache(cache_dir: Path, cache_gb: float, log: Callable[[str], None]) -> dict:
    """Add synthetic-but-valid state files (the node's own fingerprint and namespace, read
    from a real file's header; random payloads of the real bytes per token) until the
    node's disk cache holds ``cache_gb``."""
    import numpy as np

    from .kvstore import _HEADER, KVStore

    files = sorted(cache_dir.rglob("*.kv"), key=lambda p: p.stat().st_size)
    if not files:
        raise RuntimeError(f"no state file in {cache_dir}: nothing was cached")
    real = len(files)
    with open(files[-1], "rb") as f:
        _magic, _v, _flags, fp, ns_id, n_tokens, payload_len = _HEADER.unpack_from(
            f.read(_HEADER.size))
    per_token = max(1, payload_len // max(1, n_tokens))
    target = int(cache_gb * (1 << 30))
    store = KVStore(fingerprint=fp, ram_budget_bytes=0, disk_budget_bytes=2 * target + (8 << 30),
                    disk_dir=cache_dir, fsync=False)
    rng = random.Random(0)
    nprng = np.random.default_rng(1)
    try:
        while store.disk_used_bytes < target:
            n_tok = rng.randrange(300, 1500)
            toks = [rng.randrange(100, 40000) for _ in range(n_tok)]
            store.put(ns_id, toks, nprng.bytes(n_tok * per_token))
        store.wait_written()
    finally:
        store.close()
    all_files = list(cache_dir.rglob("*.kv"))
    size = sum(p.stat().st_size for p in all_files)
    log(f"prefixmesh cache {cache_dir.name}: {len(all_files)} files ({real} real), "
        f"{size / 1e9:.2f} GB")
    return {"files": len(all_files), "real_files": real, "bytes": size}


# --------------------------------------------------------------------------- driver


def _machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "memory": mem,
            "python": platform.python_version(), "platform": platform.platform()}


def _uptime() -> str:
    exe = shutil.which("uptime")
    if exe is None:
        return f"load average: {_load()}"
    try:
        return subprocess.run([exe], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average: {_load()}"


def bench_against_llama_server(binary: Path, *, model: str | None = None, threads: int = 1,
                               workloads: Sequence[str] = WORKLOADS,
                               modes: Sequence[str] = MODES, rounds: int = 5,
                               cycle_prefixes: int = 32, cycle_passes: int = 1,
                               cycle_prefix_tokens: int = 500,
                               cache_gb: float = 1.5, restarts: int = 3, n_ctx: int = 8192,
                               workdir: str | None = None,
                               log: Callable[[str], None] = lambda m: None) -> dict:
    import llama_cpp

    from .model import resolve_model

    model_path = resolve_model(model, progress=False)
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pm-vs-llama-server-")
        workdir = tmp.name
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    ls = _LlamaServer(root, binary, model_path, threads, n_ctx)
    nodes = [_Node(root, m, Path(model) if model else None, threads, n_ctx) for m in modes]
    servers: list[_Server] = [ls, *nodes]
    report: dict = {
        "machine": _machine(), "uptime_start": _uptime(),
        "model": str(model_path), "threads": threads, "n_ctx": n_ctx, "rounds": rounds,
        "llama_server": {"path": str(binary), "version": ls.version(),
                         "argv": ls.argv()[1:]},
        "llama_cpp_python": llama_cpp.__version__,
        "prefixmesh": {n.name: {"batch_mode": n.mode, "live_sequence": n.mode ==
                                "deterministic"} for n in nodes},
        "workloads": {},
    }
    prompts = _Prompts(model_path)
    try:
        for s in servers:
            ready = s.start()
            log(f"{s.name} ready in {ready:.2f} s ({s.url})")
        bench = _Bench(servers, prompts, rounds, log)
        for w in workloads:
            before, t0 = _load(), time.perf_counter()
            log(f"--- {w} (load {before})")
            if w == "warm":
                out = bench.warm()
            elif w == "concurrent":
                out = bench.concurrent()
            elif w == "cycle":
                out = bench.cycle(cycle_prefixes, cycle_passes,
                                  prefix_tokens=cycle_prefix_tokens)
            elif w == "restart":
                out = bench.restart(restarts, cache_gb, prefix_tokens=cycle_prefix_tokens)
            else:
                raise ValueError(f"unknown workload {w!r}")
            out["load_before"], out["load_after"] = before, _load()
            out["seconds"] = round(time.perf_counter() - t0, 1)
            report["workloads"][w] = out
        report["prompt_token_mismatches"] = bench.token_mismatches
    finally:
        for s in servers:
            try:
                s.stop()
            except Exception as exc:  # keep stopping the others
                log(f"stopping {s.name}: {exc}")
        prompts.close()
        if tmp is not None:
            tmp.cleanup()
    report["uptime_end"] = _uptime()
    report["ratios"] = ratios(report)
    return report


def ratios(report: dict) -> list[dict]:
    """One row per (workload, metric, prefixmesh server): value / llama-server's value,
    with the target where the issue set one."""
    rows = []
    metrics = {"warm": ("ttft_s",), "concurrent": ("tok_per_s", "p99_latency_s"),
               "cycle": ("ttft_s",), "restart": ("ready_s", "ttft_s")}
    for w, out in report.get("workloads", {}).items():
        servers = out.get("servers", {})
        base = servers.get(_LS)
        if base is None:
            continue
        for metric in metrics.get(w, ()):
            for name, vals in servers.items():
                if name == _LS or metric not in vals or not base.get(metric):
                    continue
                ratio = vals[metric] / base[metric]
                target = TARGETS.get((w, metric))
                met = None
                if target is not None:
                    op, bound = target
                    met = ratio <= bound if op == "<=" else ratio >= bound
                rows.append({"workload": w, "metric": metric, "server": name,
                             "prefixmesh": vals[metric], "llama_server": base[metric],
                             "ratio": ratio,
                             "target": None if target is None else f"{target[0]} {target[1]}",
                             "met": met})
    return rows


def _fmt(metric: str, value: float) -> str:
    return f"{value:.1f}" if metric == "tok_per_s" else f"{value:.3f} s"


def format_report(report: dict) -> str:
    """The table printed by the comparison mode (also in docs/bench/engine.md)."""
    lines = [
        f"prefixmesh vs llama-server: model {Path(report.get('model', '?')).name}, "
        f"{report.get('threads')} llama thread(s) each, n_ctx {report.get('n_ctx')}",
        f"machine: {report.get('machine', {}).get('cpu', '?')}, "
        f"{report.get('machine', {}).get('cores', '?')} cores",
        f"load: start `{report.get('uptime_start', '?')}`; end `{report.get('uptime_end', '?')}`",
        f"llama-server {' '.join(report.get('llama_server', {}).get('argv', [])[-6:])}",
        "",
        f"{'workload':<11} {'metric':<14} {'prefixmesh mode':<16} {'prefixmesh':>11} "
        f"{'llama-server':>13} {'ratio':>7} {'target':>8} {'met':>4}",
    ]
    for r in report.get("ratios", []):
        mode = r["server"].removeprefix("prefixmesh-")
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(
            f"{r['workload']:<11} {r['metric']:<14} {mode:<16} "
            f"{_fmt(r['metric'], r['prefixmesh']):>11} "
            f"{_fmt(r['metric'], r['llama_server']):>13} {r['ratio']:>7.2f} "
            f"{r['target'] or '':>8} {met:>4}")
    for w, out in report.get("workloads", {}).items():
        if "load_before" in out:
            lines.append(f"{w}: load {out['load_before']} -> {out['load_after']}, "
                         f"{out.get('seconds', '?')} s")
    cyc = report.get("workloads", {}).get("cycle")
    if cyc:
        lines.append("cycle cold TTFT: " + ", ".join(
            f"{k} {v['cold_ttft_s']:.3f} s" for k, v in cyc["servers"].items()))
    rst = report.get("workloads", {}).get("restart")
    if rst and rst.get("cache"):
        lines.append("restart cache: " + ", ".join(
            f"{k} {v['bytes'] / 1e9:.2f} GB in {v['files']} files"
            for k, v in rst["cache"].items()))
    if rst:
        for k, v in rst["servers"].items():
            if v.get("engine_ready_s"):
                lines.append(f"restart {k}: ready {v['ready_s']:.2f} s, of which model load + "
                             f"KV index (its log) {v['engine_ready_s']}; cached tokens after "
                             f"restart {v.get('cached_tokens')}")
    if report.get("prompt_token_mismatches"):
        lines.append(f"WARNING: {report['prompt_token_mismatches']} prompt token count "
                     "mismatches")
    return "\n".join(lines)


def run_against_llama_server(args: argparse.Namespace) -> int:
    """``prefixmesh bench engine --against-llama-server PATH``; returns the exit status."""
    threads = getattr(args, "threads", None)
    report = bench_against_llama_server(
        args.against_llama_server, model=getattr(args, "model", None),
        threads=1 if threads is None else int(threads),
        workloads=args.workloads, modes=args.modes, rounds=args.rounds,
        cycle_prefixes=args.cycle_prefixes, cycle_passes=args.cycle_passes,
        cycle_prefix_tokens=args.cycle_prefix_tokens,
        cache_gb=args.cache_gb, restarts=args.restarts, n_ctx=args.n_ctx,
        log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2) if getattr(args, "json", False)
          else format_report(report))
    return 0
