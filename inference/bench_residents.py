"""Many live sequences in one unified KV cache: do they pay for themselves?

``python -m prefixmesh.inference.bench_residents --p 256 --prefixes 32 --passes 2``: two
throughput-mode engines side by side, one keeping ``1`` finished sequence resident (the
default) and one keeping up to ``--prefixes`` (every cycled prefix stays live, so a
returning prefix is a cell copy, ``hit_tier`` "live", and restores nothing). ``--prefixes``
prompts of ``--p`` random tokens are requested once (cold), then cycled ``--passes`` times
with a new 8-token suffix each (max_tokens 1), the two engines interleaved per request (the
order alternates). Reported per engine: medians of the engine's TTFT and restore time, and
the hit tiers. ``n_ctx`` is ``--n-ctx`` (default 16,384: 32 x 264 cells fit).

What it measures: in a unified cache llama.cpp sizes every step's attention by the highest
used cell (``get_n_kv``), so resident cells are attended (masked) by every evaluated token;
the saving is the restore (a RAM-tier ``llama_state_seq_set_data``). docs/bench/engine.md,
section 8.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics

__all__ = ["bench_residents", "main"]


def bench_residents(p: int = 256, prefixes: int = 32, passes: int = 2, suffix: int = 8,
                    n_ctx: int = 16384, threads: int = 1, model=None) -> dict:
    from .engine import Engine, SamplingParams

    one = SamplingParams(max_tokens=1)
    rng = random.Random(5)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    cycled = [toks(p) for _ in range(prefixes)]
    residents = (1, prefixes)
    engines = {}
    for r in residents:
        e = Engine(model_path=model, n_ctx=n_ctx, n_threads=threads, kv_dir=None,
                   ram_budget_bytes=2 << 30, disk_budget_bytes=0, batch_mode="throughput",
                   max_batch=min(63, prefixes + 4))
        e._resident_max = r
        engines[r] = e
    out: dict[int, list] = {r: [] for r in residents}
    try:
        for pre in cycled:  # cold pass
            t = pre + toks(suffix)
            for r in residents:
                engines[r].complete_tokens(t, params=one)
        for k in range(passes):
            for j, pre in enumerate(cycled):
                t = pre + toks(suffix)
                order = residents if (j + k) % 2 else residents[::-1]
                for r in order:
                    s = engines[r].complete_tokens(t, params=one).stats
                    out[r].append((s.ttft_s, s.restore_s, s.hit_tier))
    finally:
        for e in engines.values():
            e.close()
    report = {"p": p, "prefixes": prefixes, "passes": passes, "suffix": suffix, "n_ctx": n_ctx,
              "load": [round(x, 2) for x in os.getloadavg()], "engines": {}}
    for r, rows in out.items():
        tiers: dict[str, int] = {}
        for *_, tier in rows:
            tiers[str(tier)] = tiers.get(str(tier), 0) + 1
        report["engines"][f"residents={r}"] = {
            "ttft_ms": round(statistics.median(x[0] for x in rows) * 1000, 1),
            "restore_ms": round(statistics.median(x[1] for x in rows) * 1000, 1),
            "tiers": tiers,
        }
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=256, help="tokens per cycled prefix")
    ap.add_argument("--prefixes", type=int, default=32)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    print(json.dumps(bench_residents(args.p, args.prefixes, args.passes, n_ctx=args.n_ctx,
                                     threads=args.threads, model=args.model), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
