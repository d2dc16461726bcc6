"""Micro-benchmark of inference.radix.RadixTree: inserts and matches per second.

Workload: N prefixes of ~1000 tokens (vocabulary 49k, like the default model). Each prefix is a
namespace pseudo-token, one of S shared "system prompts" (400-600 tokens), and a distinct
"conversation" tail (400-600 tokens). Queries are stored prefixes cut at a random point and
continued with fresh tokens (partial hits), plus a few misses.

Run: ``python -m prefixmesh.bench.micro_radix [--prefixes 10000] [--system-prompts 20]``.
Prints one line per phase; numbers are wall-clock on this machine, single thread.
"""

from __future__ import annotations

import argparse
import random
import time

from prefixmesh.inference.core.radix import RadixTree

VOCAB = 49_152
KV_BYTES_PER_TOKEN = 23_052  # SmolLM2-135M, see docs/dependency facts


def make_prefixes(rng: random.Random, n: int, n_system: int) -> list[list[int]]:
    systems = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(400, 600))] for _ in range(n_system)
    ]
    prefixes = []
    for _ in range(n):
        namespace = -1 - rng.randrange(4)
        system = systems[rng.randrange(n_system)]
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(400, 600))]
        prefixes.append([namespace, *system, *tail])
    return prefixes


def make_queries(rng: random.Random, prefixes: list[list[int]], n: int) -> list[list[int]]:
    queries = []
    for i in range(n):
        if i % 10 == 9:  # a miss
            queries.append([-9, *(rng.randrange(VOCAB) for _ in range(1000))])
            continue
        base = prefixes[rng.randrange(len(prefixes))]
        cut = rng.randint(1, len(base))
        queries.append([*base[:cut], *(rng.randrange(VOCAB) for _ in range(1000 - cut // 2))])
    return queries


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:>10,.0f}/s  ({seconds * 1e6 / count:7.1f} us each)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--system-prompts", type=int, default=20)
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    prefixes = make_prefixes(rng, args.prefixes, args.system_prompts)
    queries = make_queries(rng, prefixes, args.queries)
    tokens = sum(map(len, prefixes))
    print(
        f"{len(prefixes)} prefixes, mean {tokens / len(prefixes):.0f} tokens, "
        f"{args.system_prompts} system prompts, {len(queries)} queries"
    )

    tree = RadixTree(capacity_bytes=2**62)
    t0 = time.perf_counter()
    for i, p in enumerate(prefixes):
        tree.insert(p, i, len(p) * KV_BYTES_PER_TOKEN)
    t1 = time.perf_counter()
    print(f"insert (no eviction)      {rate(len(prefixes), t1 - t0)}")

    t0 = time.perf_counter()
    hit_tokens = 0
    for q in queries:
        hit_tokens += tree.match(q).length
    t1 = time.perf_counter()
    print(
        f"match                     {rate(len(queries), t1 - t0)}  mean hit {hit_tokens / len(queries):.0f} tokens"
    )

    t0 = time.perf_counter()
    for p in prefixes:
        tree.get(p)
    t1 = time.perf_counter()
    print(f"get (exact)               {rate(len(prefixes), t1 - t0)}")

    # Re-insert everything into a tree that holds only a quarter: every insert evicts.
    evicted = 0

    def on_evict(_entry: object) -> None:
        nonlocal evicted
        evicted += 1

    small = RadixTree(capacity_bytes=tokens * KV_BYTES_PER_TOKEN // 4, on_evict=on_evict)
    t0 = time.perf_counter()
    for i, p in enumerate(prefixes):
        small.insert(p, i, len(p) * KV_BYTES_PER_TOKEN)
    t1 = time.perf_counter()
    print(f"insert (LRU-evicting)     {rate(len(prefixes), t1 - t0)}  evicted {evicted}")

    t0 = time.perf_counter()
    for p in prefixes:
        tree.remove(p)
    t1 = time.perf_counter()
    print(f"remove                    {rate(len(prefixes), t1 - t0)}  left {len(tree)}")


if __name__ == "__main__":
    main()
