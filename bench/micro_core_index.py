"""Micro-benchmark: ``PeerCacheIndex.longest_matches`` for one routing decision.

Setting (defaults): 1,000 peers, each advertising ~1,000 cached prefixes. Every prefix is
one of 20 shared system prompts (16-64 blocks, popularity Zipf(1)) followed by a
conversation tail of 1-4 blocks of its own, so the index holds a few million postings:
long shared runs held by hundreds of peers, and a mass of single-holder tails. A request
is 2,000 tokens = 125 blocks: a system prompt, then (half the time) the tail of one peer's
cached conversation, then new blocks nobody holds.

Prints build time, index size, lookups/s and median / p90 / p99 microseconds of
``longest_matches``, and for contrast the median of a naive scan that asks every peer in
turn (``longest_match`` per peer, what the inverted index avoids).

Run: ``python -m prefixmesh.bench.micro_core_index [--peers N] [--prefixes N] ...``
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import time

from prefixmesh.overlay.core.digest import DigestRecord, LoadFigures, NamespaceDelta
from prefixmesh.overlay.core.peerindex import PeerCacheIndex

NS = b"bench-ns"
RECORD_HASHES = 4096  # what one digest record may carry (digest.MAX_HASHES_PER_RECORD)


def zipf_weights(n: int, alpha: float = 1.0) -> list[float]:
    return [1.0 / (rank + 1) ** alpha for rank in range(n)]


def build(args: argparse.Namespace, rng: random.Random) -> tuple[PeerCacheIndex, list, list]:
    system_prompts = [
        [rng.randbytes(8) for _ in range(rng.randint(16, 64))] for _ in range(args.system_prompts)
    ]
    weights = zipf_weights(args.system_prompts)
    idx = PeerCacheIndex()
    peers = [rng.randbytes(38) for _ in range(args.peers)]
    conversations: list[list[bytes]] = []  # (sys prompt + tail) chains, for the requests
    load = LoadFigures(0, 0, 400.0, 100.0)
    for p in peers:
        hashes: set[bytes] = set()
        for _ in range(args.prefixes):
            sp = rng.choices(system_prompts, weights)[0]
            tail = [rng.randbytes(8) for _ in range(rng.randint(1, 4))]
            hashes.update(sp)
            hashes.update(tail)
            if rng.random() < 0.002:
                conversations.append(sp + tail)
        ordered = sorted(hashes)  # digest records carry hashes sorted
        for seq, start in enumerate(range(0, len(ordered), RECORD_HASHES)):
            idx.apply(
                DigestRecord(
                    origin=p, epoch=1, seq=seq, issued_at=0.0, expires_at=60.0,
                    model=b"bench", kind="delta",
                    namespaces=(NamespaceDelta(NS, tuple(ordered[start : start + RECORD_HASHES])),),
                    load=load, kv_capacity_bytes=1 << 30, kv_used_bytes=0,
                ),
                now=0.0,
            )
    requests: list[list[bytes]] = []
    for _ in range(args.requests):
        if conversations and rng.random() < 0.5:
            head = list(rng.choice(conversations))
        else:
            head = list(rng.choices(system_prompts, weights)[0])
        requests.append((head + [rng.randbytes(8) for _ in range(args.blocks)])[: args.blocks])
    return idx, peers, requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--prefixes", type=int, default=1000, help="cached prefixes per peer")
    ap.add_argument("--system-prompts", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=125, help="request length in 16-token blocks")
    ap.add_argument("--requests", type=int, default=200, help="distinct requests")
    ap.add_argument("--rounds", type=int, default=10, help="passes over the requests")
    ap.add_argument("--naive", type=int, default=20, help="requests timed with a naive scan")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    t0 = time.perf_counter()
    idx, peers, requests = build(args, rng)
    build_s = time.perf_counter() - t0
    n_postings = sum(e.n_hashes for e in (idx.estimate(p) for p in peers) if e is not None)
    print(
        f"index: {len(idx)} peers, {n_postings:,} (peer, hash) postings, "
        f"{len(idx._postings.get(NS, {})):,} distinct hashes; built in {build_s:.1f} s; "
        f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )

    gc.collect()
    gc.disable()  # keep collector pauses out of the per-lookup figures
    samples_ns: list[int] = []
    matched_peers = 0
    for _ in range(args.rounds):
        for chain in requests:
            t = time.perf_counter_ns()
            got = idx.longest_matches(NS, chain)
            samples_ns.append(time.perf_counter_ns() - t)
            matched_peers += len(got)
    gc.enable()
    total_s = sum(samples_ns) / 1e9
    q = statistics.quantiles(samples_ns, n=100)
    print(
        f"longest_matches, {args.blocks}-block request: {len(samples_ns) / total_s:,.0f} "
        f"lookups/s; median {statistics.median(samples_ns) / 1000:.0f} us, "
        f"p90 {q[89] / 1000:.0f} us, p99 {q[98] / 1000:.0f} us; "
        f"{matched_peers / len(samples_ns):.0f} matching peers per lookup on average"
    )

    if args.naive:
        naive_ns = []
        for chain in requests[: args.naive]:
            t = time.perf_counter_ns()
            got = {p: n for p in peers if (n := idx.longest_match(p, NS, chain))}
            naive_ns.append(time.perf_counter_ns() - t)
            assert got == idx.longest_matches(NS, chain)
        print(
            f"naive scan of all {len(peers)} peers (for contrast): median "
            f"{statistics.median(naive_ns) / 1000:.0f} us"
        )


if __name__ == "__main__":
    main()
