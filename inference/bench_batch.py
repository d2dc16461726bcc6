"""Continuous batching (``batch_mode="throughput"``) against the deterministic engine.

``python -m prefixmesh.inference.bench_batch --prompts 24 --clients 8 --requests 4 --rounds 3``

1. Agreement: the same chat prompts (cold, greedy, ``--max-tokens``) through a
   deterministic engine one at a time and through a throughput engine all submitted at
   once (up to ``max_batch`` per ``llama_decode``); outputs compared token for token, and
   where they part, how far the deterministic token led its runner-up (log probability,
   nats: what spot checks of batched answers judge by, ``overlay/core/trust.py``).
2. Load, interleaved: ``--clients`` threads, each sending ``--requests`` requests one after
   the other, every prompt a shared ~``--prefix``-token prefix + a unique suffix, max_tokens
   ``--max-tokens``; both engines loaded side by side, rounds alternate which goes first.
   Throughput = generated tokens / wall time of the round; latency = submit -> last token,
   as the client sees it; p50/p99 over all requests of all rounds of a mode.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

__all__ = ["bench_agreement", "bench_load", "main"]


def _engine(mode: str, n_ctx: int, threads: int, model, max_batch: int, ram: int,
            max_queue: int = 64):
    from .engine import Engine

    return Engine(model_path=model, n_ctx=n_ctx, n_threads=threads, kv_dir=None,
                  max_queue=max_queue,
                  ram_budget_bytes=ram, disk_budget_bytes=0, batch_mode=mode,
                  max_batch=max_batch)


def bench_agreement(n: int = 24, max_tokens: int = 32, threads: int = 1, model=None,
                    max_batch: int = 8) -> dict:
    from .bench_kvtype import chat_prompts
    from .engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    prompts = chat_prompts(n)
    det = _engine("deterministic", 1024, threads, model, max_batch, 0)
    try:  # each token with its runner-up: how clear the deterministic choice was
        pieces, ends = [], []
        for p in prompts:
            h = det.submit_chat(p, params=SamplingParams(max_tokens=max_tokens, logprobs=2))
            pieces.append(list(h))
            ends.append(h.result().end)
    finally:
        det.close(flush=False)
    ref = [[x.token for x in ps] for ps in pieces]
    # the lead of every token, then of the end-of-sequence token where the model stopped
    # (where a batched answer that goes on parts from this one)
    leads = [[x.top[0][1] - x.top[1][1] for x in ps]
             + ([end.top[0][1] - end.top[1][1]] if end is not None else [])
             for ps, end in zip(pieces, ends, strict=True)]
    thr = _engine("throughput", 4096, threads, model, max_batch, 0, max_queue=max(64, n))
    try:
        handles = [thr.submit_chat(p, params=params) for p in prompts]
        got = [h.result() for h in handles]
    finally:
        thr.close(flush=False)
    identical = first = 0
    fractions = []
    batch_seen = []
    diverged_at: list[int] = []
    lead_there: list[float] = []  # the deterministic token's lead where the modes part
    for want, lead, c in zip(ref, leads, got, strict=True):
        have = list(c.tokens)
        identical += have == want
        first += bool(have and want and have[0] == want[0])
        k = 0
        for a, b in zip(have, want, strict=False):
            if a != b:
                break
            k += 1
        fractions.append(k / max(len(want), 1))
        batch_seen.append(c.stats.max_batch_seen)
        if have != want:
            diverged_at.append(k)
            if k < len(lead):
                lead_there.append(lead[k])
    every = [x for lead in leads for x in lead]
    return {"prompts": n, "max_tokens": max_tokens, "identical": identical,
            "first_token_agree": first, "mean_common_prefix": statistics.mean(fractions),
            "max_batch_seen_median": statistics.median(batch_seen),
            "first_divergence_tokens": sorted(diverged_at),
            "lead_at_divergence_nats": [round(x, 4) for x in sorted(lead_there)],
            "steps_leading_by_more_than_1_nat": sum(x > 1.0 for x in every) / max(len(every), 1)}


def bench_load(clients: int = 8, requests: int = 4, rounds: int = 3, prefix: int = 500,
               suffix: int = 16, max_tokens: int = 32, threads: int = 1, model=None) -> dict:
    from .engine import SamplingParams

    rng = random.Random(17)
    shared = [rng.randrange(100, 40000) for _ in range(prefix)]
    params = SamplingParams(max_tokens=max_tokens)
    engines = {m: _engine(m, 4096, threads, model, clients, 1 << 30)
               for m in ("deterministic", "throughput")}
    lat = {m: [] for m in engines}
    tps = {m: [] for m in engines}
    before = dict(engines["throughput"].batch_counters)
    hits = {m: {} for m in engines}
    try:
        for eng in engines.values():  # the shared prefix is cached in both before timing
            eng.complete_tokens(shared + [shared[0]], params=SamplingParams(max_tokens=1))
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for mode in order:
                eng = engines[mode]
                out_tokens = [0] * clients
                lock = threading.Lock()

                def client(i, r=r, eng=eng, mode=mode, out_tokens=out_tokens, lock=lock):
                    local = random.Random(1000 * r + i)
                    for _ in range(requests):
                        toks = shared + [local.randrange(100, 40000) for _ in range(suffix)]
                        t0 = time.perf_counter()
                        c = eng.complete_tokens(toks, params=params)
                        dt = time.perf_counter() - t0
                        with lock:
                            lat[mode].append(dt)
                            out_tokens[i] += c.stats.completion_tokens
                            hits[mode][c.stats.hit_tier] = hits[mode].get(c.stats.hit_tier, 0) + 1

                ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                tps[mode].append(sum(out_tokens) / (time.perf_counter() - t0))
        counters = {k: v - before[k] for k, v in engines["throughput"].batch_counters.items()}
    finally:
        for eng in engines.values():
            eng.close(flush=False)

    def p(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    res = {"clients": clients, "requests_per_client": requests, "rounds": rounds,
           "prefix": prefix, "suffix": suffix, "max_tokens": max_tokens, "threads": threads}
    for m in engines:
        res[m] = {"tok_s_median": statistics.median(tps[m]), "tok_s_rounds": tps[m],
                  "latency_p50_s": p(lat[m], 0.5), "latency_p99_s": p(lat[m], 0.99),
                  "hit_tiers": hits[m]}
    res["throughput_ratio"] = (res["throughput"]["tok_s_median"]
                               / res["deterministic"]["tok_s_median"])
    res["round_ratios"] = [t / d for t, d in zip(tps["throughput"], tps["deterministic"],
                                                strict=True)]
    res["throughput_steps"] = counters
    res["mean_sequences_per_step"] = counters["sequences"] / max(counters["steps"], 1)
    res["p99_ratio"] = (res["throughput"]["latency_p99_s"]
                        / res["deterministic"]["latency_p99_s"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--skip", choices=("agreement", "load"), default=None)
    a = ap.parse_args(argv)
    out = {}
    if a.skip != "agreement":
        out["agreement"] = bench_agreement(a.prompts, a.max_tokens, a.threads, a.model,
                                           a.clients)
        print(json.dumps(out["agreement"]), flush=True)
    if a.skip != "load":
        out["load"] = bench_load(a.clients, a.requests, a.rounds, a.prefix,
                                 max_tokens=a.max_tokens, threads=a.threads, model=a.model)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
