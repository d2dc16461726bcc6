"""Where warm time to first token goes, engine level (no HTTP, no node).

``python -m prefixmesh.inference.bench_warm_path --p 533 --suffix 8 --runs 7 --n-ctx 8192``:
one engine per batch mode (``live_sequence`` on in deterministic mode, as the llama-server
comparison runs it), the same context size as that comparison. Interleaved per run:

- ``live``: prefix + a new suffix right after the previous such request (deterministic: the
  prefix is still in sequence 0; throughput: a sequence resident from the last request);
- ``ram``: the same after a request of another namespace took the context (the prefix is
  restored from the RAM tier);
- ``cycle``: ``--cycle`` prefixes requested in turn, each with a new suffix (more than the
  engine keeps live: RAM restores).

Reported per path and mode: medians of the engine's TTFT, restore time and prefill time.
Also the raw cost of ``llama_decode`` for one token alone and for ``suffix`` tokens in one
batch at that prefix length (the kernels' floor for this workload).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

__all__ = ["bench_warm_path", "main"]


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000.0, 1) if values else float("nan")


def bench_warm_path(p: int = 533, suffix: int = 8, runs: int = 7, cycle: int = 12,
                    n_ctx: int = 8192, threads: int = 1, modes=("deterministic", "throughput"),
                    model=None) -> dict:
    from .engine import Engine, SamplingParams

    one = SamplingParams(max_tokens=1)
    rng = random.Random(17)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    prefix = toks(p)
    cycled = [toks(p) for _ in range(cycle)]
    engines = {}
    for mode in modes:
        engines[mode] = Engine(model_path=model, n_ctx=n_ctx, n_threads=threads, kv_dir=None,
                               ram_budget_bytes=2 << 30, disk_budget_bytes=0,
                               live_sequence=mode == "deterministic", batch_mode=mode)
    paths = ("live", "ram", "cycle")
    out = {m: {k: {"ttft": [], "restore": [], "prefill": [], "tiers": []} for k in paths}
           for m in modes}

    def record(mode: str, path: str, c) -> None:
        o = out[mode][path]
        o["ttft"].append(c.stats.ttft_s)
        o["restore"].append(c.stats.restore_s)
        o["prefill"].append(c.stats.prefill_s)
        o["tiers"].append(c.stats.hit_tier)

    try:
        for eng in engines.values():
            ns = eng.default_namespace
            eng.complete_tokens(prefix + toks(suffix + 1), ns, one)
            for pre in cycled:
                eng.complete_tokens(pre + toks(suffix + 1), ns, one)
        other = toks(16)
        for r in range(runs):
            for mode in (modes if r % 2 == 0 else tuple(reversed(modes))):
                eng = engines[mode]
                ns = eng.default_namespace
                eng.complete_tokens(prefix + toks(suffix), ns, one)
                record(mode, "live", eng.complete_tokens(prefix + toks(suffix), ns, one))
                eng.complete_tokens(other, eng.namespace("other"), one)
                record(mode, "ram", eng.complete_tokens(prefix + toks(suffix), ns, one))
                for pre in cycled[r % 2 :: 2]:
                    record(mode, "cycle", eng.complete_tokens(pre + toks(suffix), ns, one))
    finally:
        for eng in engines.values():
            eng.close(flush=False)
    report: dict = {"p": p, "suffix": suffix, "runs": runs, "cycle": cycle, "n_ctx": n_ctx,
                    "threads": threads, "load": list(os.getloadavg()), "modes": {}}
    for mode in modes:
        report["modes"][mode] = {
            path: {"ttft_ms": _median_ms(o["ttft"]), "restore_ms": _median_ms(o["restore"]),
                   "prefill_ms": _median_ms(o["prefill"]),
                   "tiers": sorted(set(o["tiers"]))}
            for path, o in out[mode].items()}
    report["kernel_floor_ms"] = _kernel_floor(p, suffix, threads, model)
    report["load_after"] = list(os.getloadavg())
    return report


def _kernel_floor(p: int, suffix: int, threads: int, model, runs: int = 5) -> dict:
    """Raw llama_decode times after a p-token prefix: one token alone, ``suffix`` tokens in
    one batch, and ``suffix - 1`` + 1 (two passes)."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    from .model import resolve_model

    original = lib.llama_model_default_params

    def without_repacking():  # as the engine loads it (and its AMX repack crashes here)
        params = original()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without_repacking
    try:
        llama = llama_cpp.Llama(model_path=str(resolve_model(model, progress=False)),
                                n_ctx=p + 2 * suffix + 8, n_batch=512, n_ubatch=512,
                                n_threads=threads, n_threads_batch=threads, verbose=False)
    finally:
        lib.llama_model_default_params = original
    ctx, mem = llama._ctx.ctx, lib.llama_get_memory(llama._ctx.ctx)
    rng = random.Random(3)

    def decode(tokens: list[int], n_past: int) -> None:
        for i in range(0, len(tokens), 512):
            llama._batch.set_batch(batch=tokens[i : i + 512], n_past=n_past + i,
                                   logits_all=False)
            if lib.llama_decode(ctx, llama._batch.batch) != 0:
                raise RuntimeError("llama_decode failed")

    try:
        decode([rng.randrange(100, 40000) for _ in range(p)], 0)
        times: dict[str, list[float]] = {"one_token": [], "one_batch": [], "two_passes": []}
        for _ in range(runs):
            new = [rng.randrange(100, 40000) for _ in range(suffix)]
            for name in times:
                lib.llama_memory_seq_rm(mem, 0, p, -1)
                t0 = time.perf_counter()
                if name == "one_token":
                    decode(new[:1], p)
                elif name == "one_batch":
                    decode(new, p)
                else:
                    decode(new[:-1], p)
                    decode(new[-1:], p + suffix - 1)
                times[name].append(time.perf_counter() - t0)
        return {k: _median_ms(v) for k, v in times.items()}
    finally:
        llama.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=533)
    ap.add_argument("--suffix", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cycle", type=int, default=12)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="deterministic,throughput")
    ap.add_argument("--model", default=None)
    a = ap.parse_args(argv)
    report = bench_warm_path(a.p, a.suffix, a.runs, a.cycle, a.n_ctx, a.threads,
                             tuple(a.modes.split(",")), a.model)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
