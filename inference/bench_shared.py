"""Prefix-shared storage: bytes of K prompts behind one P-token prefix, and restored TTFT.

``python -m prefixmesh.inference.bench_shared`` (defaults K=20, P=1000, S=50) serves K
prompts ``prefix(P) + suffix_i(S) + 1 token`` (random token ids, greedy, max_tokens 1) on one
engine and reports the RAM and disk bytes of the store against the ideal
``(P + K*S) * bytes_per_token`` (bytes per token measured on the first, whole state). Then
TTFT medians: cold (a namespace of its own per run, ``--runs`` runs) against each prompt
served again from its two-segment chain in RAM (K runs) and from disk after a restart
with the files dropped from the page cache (K runs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from .bench_restart import drop_page_cache

__all__ = ["bench_shared", "main"]


def bench_shared(k: int = 20, p: int = 1000, s: int = 50, runs: int = 3, threads: int = 1,
                 model=None, log=lambda m: None) -> dict:
    from .engine import Engine, SamplingParams

    one = SamplingParams(max_tokens=1)
    rng = random.Random(3)
    prefix = [rng.randrange(100, 40000) for _ in range(p)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(s + 1)] for _ in range(k)]
    with tempfile.TemporaryDirectory(prefix="pm-shared-") as kv_dir:
        kw = dict(model_path=model, n_ctx=p + s + 64, n_threads=threads, kv_dir=kv_dir,
                  ram_budget_bytes=4 << 30, disk_budget_bytes=8 << 30)
        eng = Engine(**kw)
        try:
            eng.complete_tokens(prompts[0], params=one)
            per_token = eng.store.ram_used_bytes / (p + s)
            for q in prompts[1:]:
                eng.complete_tokens(q, params=one)
            eng.store.wait_written()
            ideal = (p + k * s) * per_token
            ram, disk = eng.store.ram_used_bytes, eng.store.disk_used_bytes
            log(f"bytes: ram {ram / ideal:.3f} x ideal, disk {disk / ideal:.3f} x ideal")
            cold = []
            for i in range(runs):
                c = eng.complete_tokens(prompts[i], eng.namespace(f"cold-{i}"), one)
                assert c.stats.cached_tokens == 0
                cold.append(c.stats.ttft_s)
                log(f"cold {i}: {c.stats.ttft_s:.3f} s")
            warm = []
            for q in prompts:
                c = eng.complete_tokens(q, params=one)
                # the same prompt again: all but its last 2 tokens (evaluated together)
                assert c.stats.hit_tier == "ram" and c.stats.cached_tokens == p + s - 1
                warm.append(c.stats.ttft_s)
        finally:
            eng.close()
        drop_page_cache(Path(kv_dir))
        eng = Engine(**kw)
        try:
            from_disk = []
            for q in prompts:
                c = eng.complete_tokens(q, params=one)
                assert c.stats.cached_tokens == p + s - 1
                from_disk.append(c.stats.ttft_s)
        finally:
            eng.close(flush=False)
    med = statistics.median
    return {"k": k, "p": p, "s": s, "threads": threads, "bytes_per_token": round(per_token, 1),
            "ideal_bytes": int(ideal), "ram_bytes": ram, "disk_bytes": disk,
            "ram_over_ideal": ram / ideal, "disk_over_ideal": disk / ideal,
            "cold_ttft_s": med(cold), "chain_ram_ttft_s": med(warm),
            "chain_disk_ttft_s": med(from_disk),
            "ram_over_cold": med(warm) / med(cold), "disk_over_cold": med(from_disk) / med(cold)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--p", type=int, default=1000)
    ap.add_argument("--s", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    a = ap.parse_args(argv)
    print(json.dumps(bench_shared(a.k, a.p, a.s, a.runs, a.threads, a.model,
                                  log=lambda m: print(m, flush=True)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
