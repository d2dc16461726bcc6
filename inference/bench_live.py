"""Warm TTFT: a prefix restored from the RAM tier vs the same prefix still live in sequence 0.

``python -m prefixmesh.inference.bench_live --p 512 --runs 7``: one engine with
``live_sequence=True``; each run serves, interleaved, ``prefix + suffix`` right after a
request of another namespace (the prefix comes from the RAM tier: ``hit_tier`` ram) and
``prefix + another suffix`` right after it (the prefix is live: nothing restored). Same
number of tokens evaluated in both; medians of the engine's TTFT.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

__all__ = ["bench_live", "main"]


def bench_live(p: int = 512, suffix: int = 16, runs: int = 7, threads: int = 1,
               model=None) -> dict:
    from .engine import Engine, SamplingParams

    one = SamplingParams(max_tokens=1)
    rng = random.Random(9)

    def toks(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    prefix = toks(p)
    eng = Engine(model_path=model, n_ctx=p + suffix + 64, n_threads=threads, kv_dir=None,
                 ram_budget_bytes=2 << 30, disk_budget_bytes=0, live_sequence=True)
    a, b = eng.namespace("a"), eng.namespace("b")
    ram, live = [], []
    try:
        eng.complete_tokens(prefix + [prefix[0]], a, one)  # stores the prefix itself
        for _ in range(runs):
            eng.complete_tokens(toks(8), b, one)  # another namespace takes the context
            c = eng.complete_tokens(prefix + toks(suffix + 1), a, one)
            assert c.stats.hit_tier == "ram" and c.stats.cached_tokens == p, c.stats
            ram.append(c.stats.ttft_s)
            c = eng.complete_tokens(prefix + toks(suffix + 1), a, one)
            assert c.stats.hit_tier == "live" and c.stats.cached_tokens == p, c.stats
            live.append(c.stats.ttft_s)
    finally:
        eng.close(flush=False)
    med = statistics.median
    return {"p": p, "suffix": suffix, "runs": runs, "threads": threads,
            "ram_ttft_s": med(ram), "live_ttft_s": med(live), "live_over_ram": med(live) / med(ram),
            "samples": {"ram": ram, "live": live}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    a = ap.parse_args(argv)
    print(json.dumps(bench_live(a.p, a.suffix, a.runs, a.threads, a.model), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
