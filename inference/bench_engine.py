"""``prefixmesh bench engine``: time to first token, cold vs restored from RAM vs from disk.

For each shared-prefix length P (default 512, 1024, 2048 tokens) and ``runs`` repetitions
(default 5), one engine in one process serves prompts ``prefix(P) + suffix(64)`` where every
run uses a fresh 64-token suffix:

- cold: the prefix is in no cache (a namespace of its own per run);
- ram:  the prefix's state is in the RAM tier (restored with ``llama_state_seq_set_data``,
  then only the suffix is evaluated);
- disk: the prefix's state is only in the disk tier, and its file has been dropped from the
  OS page cache (``posix_fadvise(DONTNEED)`` after an fsynced write) so the read really
  comes from the device; the read includes the checksum verification.

TTFT is the engine's service time to the first sampled token (restore + evaluation +
snapshot of the new prefix + first sample); medians over the runs. Also reported: bytes
of saved state per cached token (RAM payload and disk file). Prompts are token ids of
deterministic pseudo-text (no chat template), greedy, max_tokens = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

__all__ = ["add_arguments", "add_engine_arguments", "run_bench_engine", "bench_engine"]

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "river mountain network cache prefix token model memory window garden letter market "
    "history science music winter harbor engine signal volunteer question answer number"
).split()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _lengths(text: str) -> list[int]:
    """``512,1024`` -> [512, 1024] (a bad list is a usage error, not a traceback)."""
    try:
        out = [_positive_int(x.strip()) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if not out:
        raise argparse.ArgumentTypeError("needs at least one length, e.g. 512,1024")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--prefix-lengths", type=_lengths, default="512,1024,2048",
                        help="comma-separated shared-prefix lengths in tokens")
    parser.add_argument("--runs", type=_positive_int, default=5,
                        help="runs per length and path (>= 1)")
    parser.add_argument("--suffix-tokens", type=_positive_int, default=64)
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="llama.cpp threads (default 2; 1 with --against-llama-server)")
    parser.add_argument("--model", default=None, help="GGUF path (default: embedded model)")
    from .bench_llama_server import add_comparison_arguments

    add_comparison_arguments(parser)


# the name ``prefixmesh bench engine`` looks for (``add_<NAME>_arguments``, as bench/sim.py)
add_engine_arguments = add_arguments


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words)) + "."


def _tokens(engine, seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out.extend(engine.tokenize(" " + _text(rng, 200), special=False))
    return out[:n]


def _drop_page_cache(path: Path) -> None:
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_engine(prefix_lengths, runs: int = 5, suffix_tokens: int = 64, threads: int = 2,
                 model: str | None = None, log=lambda msg: None) -> dict:
    from .engine import Engine, SamplingParams

    if runs < 1:
        raise ValueError("runs must be >= 1")
    lengths = sorted(int(p) for p in prefix_lengths)
    n_ctx = max(lengths) + suffix_tokens + 64
    params = SamplingParams(max_tokens=1)
    results = []
    with tempfile.TemporaryDirectory(prefix="prefixmesh-bench-") as kv_dir:
        engine = Engine(model_path=model, n_ctx=n_ctx, n_threads=threads, kv_dir=kv_dir,
                        ram_budget_bytes=4 << 30, disk_budget_bytes=8 << 30, fsync=True)
        try:
            # warm-up: first decode calls allocate buffers
            engine.complete_tokens(_tokens(engine, 1, 64), engine.namespace("warmup"), params)
            for p in lengths:
                prefix = _tokens(engine, 1000 + p, p)
                suffixes = [_tokens(engine, 2000 + p * 10 + i, suffix_tokens)
                            for i in range(3 * runs)]
                cold, ram, disk = [], [], []
                for i in range(runs):
                    ns = engine.namespace(f"cold-{p}-{i}")
                    c = engine.complete_tokens(prefix + suffixes[i], ns, params)
                    assert c.stats.cached_tokens == 0
                    cold.append(c.stats.ttft_s)
                    log(f"P={p} cold run {i}: {c.stats.ttft_s * 1000:.0f} ms")
                ns = engine.namespace(f"warm-{p}")
                # seed the cache with exactly the prefix (the engine stores prompt bodies)
                engine.complete_tokens(prefix + [prefix[0]], ns, params)
                lease = engine.lease_prefix(ns, prefix)
                assert lease is not None and lease.entry_tokens == p
                ram_bytes_per_token = len(lease.data) / p
                lease.release()
                for i in range(runs):
                    suffix = suffixes[runs + i]
                    c = engine.complete_tokens(prefix + suffix, ns, params)
                    assert c.stats.hit_tier == "ram" and c.stats.cached_tokens == p
                    ram.append(c.stats.ttft_s)
                    engine.store.remove(ns.id, (prefix + suffix)[:-1])
                    log(f"P={p} ram run {i}: {c.stats.ttft_s * 1000:.0f} ms")
                ram_budget = engine.store.stats.ram_budget_bytes
                file_bytes_per_token = 0.0
                for i in range(runs):
                    engine.store.wait_written()  # write-behind: the file must be complete
                    engine.store.set_budgets(ram_bytes=0)  # demote to disk
                    engine.store.set_budgets(ram_bytes=ram_budget)
                    path = engine.store._path_for(ns.id, (-1, *prefix))
                    file_bytes_per_token = path.stat().st_size / p
                    _drop_page_cache(path)
                    suffix = suffixes[2 * runs + i]
                    c = engine.complete_tokens(prefix + suffix, ns, params)
                    assert c.stats.hit_tier == "disk" and c.stats.cached_tokens == p
                    disk.append(c.stats.ttft_s)
                    engine.store.remove(ns.id, (prefix + suffix)[:-1])
                    log(f"P={p} disk run {i}: {c.stats.ttft_s * 1000:.0f} ms")
                row = {
                    "prefix_tokens": p,
                    "suffix_tokens": suffix_tokens,
                    "runs": runs,
                    "cold_ttft_s": statistics.median(cold),
                    "ram_ttft_s": statistics.median(ram),
                    "disk_ttft_s": statistics.median(disk),
                    "ram_bytes_per_token": ram_bytes_per_token,
                    "disk_bytes_per_token": file_bytes_per_token,
                    "samples": {"cold": cold, "ram": ram, "disk": disk},
                }
                row["ram_over_cold"] = row["ram_ttft_s"] / row["cold_ttft_s"]
                row["disk_over_cold"] = row["disk_ttft_s"] / row["cold_ttft_s"]
                results.append(row)
            load = engine.load()
        finally:
            engine.close(flush=False)
    return {
        "model": str(engine.model_path),
        "model_fingerprint": engine.model_fingerprint.hex(),
        "threads": threads,
        "n_ctx": n_ctx,
        "prefill_tps_ewma": load.prefill_tps,
        "results": results,
    }


def _table(report: dict) -> str:
    lines = [
        f"model {Path(report['model']).name}  threads={report['threads']}  "
        f"TTFT medians (prefix + {report['results'][0]['suffix_tokens']}-token suffix)",
        f"{'prefix':>7} {'cold ms':>9} {'ram ms':>8} {'disk ms':>8} {'ram/cold':>9} "
        f"{'disk/cold':>10} {'B/token ram':>12} {'B/token disk':>13}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['prefix_tokens']:>7} {r['cold_ttft_s'] * 1000:>9.1f} "
            f"{r['ram_ttft_s'] * 1000:>8.1f} {r['disk_ttft_s'] * 1000:>8.1f} "
            f"{r['ram_over_cold']:>9.3f} {r['disk_over_cold']:>10.3f} "
            f"{r['ram_bytes_per_token']:>12.0f} {r['disk_bytes_per_token']:>13.0f}"
        )
    return "\n".join(lines)


def run_bench_engine(args: argparse.Namespace) -> int:
    """Entry point of ``prefixmesh bench engine``; returns the exit status."""
    if getattr(args, "against_llama_server", None) is not None:
        from .bench_llama_server import run_against_llama_server

        return run_against_llama_server(args)
    lengths = getattr(args, "prefix_lengths", "512,1024,2048")
    if isinstance(lengths, str):
        lengths = [int(x) for x in lengths.split(",") if x.strip()]
    as_json = bool(getattr(args, "json", False))
    report = bench_engine(
        lengths,
        runs=int(getattr(args, "runs", 5)),
        suffix_tokens=int(getattr(args, "suffix_tokens", 64)),
        threads=int(getattr(args, "threads", None) or 2),
        model=getattr(args, "model", None),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(json.dumps(report, indent=2) if as_json else _table(report))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="prefixmesh bench engine")
    add_arguments(parser)
    raise SystemExit(run_bench_engine(parser.parse_args()))
