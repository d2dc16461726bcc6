"""Micro-benchmark of the digest / anti-entropy core.

Prints:

1. digest records signed and decoded+verified per second (a small delta and a full
   4,096-hash record);
2. for a node holding 1,000 cached prefixes: snapshot size (bytes, records) with
   MMLU-like sharing (57 few-shot prefixes shared by many questions) and with no sharing;
3. steady-state anti-entropy bytes per second that node issues (deltas + refreshes +
   the compaction snapshots they trigger) under a given cache churn, and with no churn
   (refreshes only) -- i.e. what each peer downloads per second to track this node;
4. the size of a summary message for a 64-node network.

Synthetic prefixes (no workload files needed); virtual time, so results do not depend
on wall-clock speed except for (1). Run: ``python -m prefixmesh.bench.micro_core_digest``.
"""

from __future__ import annotations

import argparse
import random
import time

from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.digest import (
    KIND_DELTA,
    KIND_SNAPSHOT,
    MAX_HASHES_PER_RECORD,
    DigestRecord,
    LoadFigures,
    NamespaceDelta,
    decode_record,
    sign_record,
)
from prefixmesh.overlay.core.exchange import encode_summary
from prefixmesh.overlay.core.identity import Identity

NS = b"bench-ns"
MODEL = b"bench-model-fingerprint"
T0 = 1_700_000_000.0


def _rate(fn, min_seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(50):
            fn()
        n += 50
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return n / elapsed


def bench_sign_verify(seconds: float) -> None:
    me = Identity.from_seed(bytes(32))
    rng = random.Random(1)
    for label, n_hashes, kind in (
        ("delta, 12 hashes", 12, KIND_DELTA),
        (f"snapshot, {MAX_HASHES_PER_RECORD} hashes", MAX_HASHES_PER_RECORD, KIND_SNAPSHOT),
    ):
        hashes = tuple(rng.randbytes(8) for _ in range(n_hashes))
        record = DigestRecord(
            origin=me.peer_id,
            epoch=1,
            seq=1,
            issued_at=T0,
            expires_at=T0 + 60,
            model=MODEL,
            kind=kind,
            namespaces=(NamespaceDelta(NS, hashes),),
            load=LoadFigures(1, 1, 450.0, 120.0),
            kv_capacity_bytes=1 << 33,
            kv_used_bytes=1 << 32,
            addrs=("/ip4/192.168.1.20/tcp/4001",),
        )
        raw = sign_record(record, me).raw
        sign_rate = _rate(lambda record=record: sign_record(record, me), seconds)
        verify_rate = _rate(lambda raw=raw: decode_record(raw, now=T0 + 1), seconds)
        print(
            f"  {label:28s} {len(raw):6d} B   sign {sign_rate:8.0f}/s   "
            f"decode+verify {verify_rate:8.0f}/s"
        )


class PrefixFactory:
    """Synthetic prefix chains: `n_shared` few-shot headers of `shared_blocks` blocks,
    each prefix = one header + `unique_blocks` blocks of its own (chained hashes)."""

    def __init__(self, rng: random.Random, n_shared: int, shared_blocks: int, unique_blocks: int):
        self.rng = rng
        self.headers = [
            [rng.randbytes(8) for _ in range(shared_blocks)] for _ in range(max(1, n_shared))
        ]
        self.shared = n_shared > 0
        self.shared_blocks = shared_blocks
        self.unique_blocks = unique_blocks

    def make(self) -> list[bytes]:
        head = (
            self.rng.choice(self.headers)
            if self.shared
            else [self.rng.randbytes(8) for _ in range(self.shared_blocks)]
        )
        return head + [self.rng.randbytes(8) for _ in range(self.unique_blocks)]


def bench_node(
    label: str,
    factory: PrefixFactory,
    n_prefixes: int,
    churn_per_s: float,
    duration_s: float,
    tick_s: float,
    refresh_s: float,
) -> None:
    node = AntiEntropy(
        Identity.from_seed(b"\x07" * 32),
        MODEL,
        epoch=1,
        now=T0,
        ttl=3 * refresh_s,
        refresh_interval=refresh_s,
        addrs=("/ip4/192.168.1.20/tcp/4001",),
    )
    prefixes = [factory.make() for _ in range(n_prefixes)]
    for chain in prefixes:
        node.local_add_prefix(NS, chain)
    snap = node.tick(T0 + 1)
    n_hashes = sum(len(h) for h in node.local_hashes().values())
    print(
        f"  {label}: {n_prefixes} prefixes, {n_hashes} advertised hashes -> snapshot "
        f"{sum(len(s.raw) for s in snap)} B in {len(snap)} record(s)"
    )
    t = T0 + 1
    for churn in (churn_per_s, 0.0):
        phase_start = t
        start_bytes = node.stats["bytes_issued"]
        start_snaps = node.stats["snapshots_issued"]
        start_records = node.stats["records_issued"]
        owed = 0.0
        while t < phase_start + duration_s:
            t += tick_s
            owed += churn * tick_s
            while owed >= 1.0:  # one new prefix replaces the least recently used one
                owed -= 1.0
                node.local_remove_prefix(NS, prefixes.pop(0))
                prefixes.append(factory.make())
                node.local_add_prefix(NS, prefixes[-1])
            node.tick(t)
        issued = node.stats["bytes_issued"] - start_bytes
        print(
            f"    churn {churn:4.1f} prefixes/s: {issued / duration_s:8.1f} B/s issued "
            f"({node.stats['records_issued'] - start_records} records, "
            f"{node.stats['snapshots_issued'] - start_snaps} compaction snapshots in "
            f"{duration_s:.0f} s); held own log {len(node.held_records(node.peer_id))} "
            f"records / {sum(len(s.raw) for s in node.held_records(node.peer_id))} B"
        )


def bench_summary(n_peers: int) -> None:
    summary = {
        Identity.from_seed(i.to_bytes(32, "big")).peer_id: (3, 12345) for i in range(n_peers)
    }
    print(f"  summary message for {n_peers} origins: {len(encode_summary(summary))} B")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0, help="per crypto measurement")
    p.add_argument("--prefixes", type=int, default=1000)
    p.add_argument("--churn", type=float, default=0.5, help="new prefixes per second")
    p.add_argument("--duration", type=float, default=3600.0, help="virtual seconds per phase")
    p.add_argument("--tick", type=float, default=1.0)
    p.add_argument("--refresh", type=float, default=20.0)
    args = p.parse_args(argv)

    print("digest sign / verify:")
    bench_sign_verify(args.seconds)
    print(f"node with cached prefixes (tick {args.tick:.0f} s, refresh {args.refresh:.0f} s):")
    rng = random.Random(42)
    # MMLU-like: 57 subjects' 5-shot headers (~440 tokens = 27 blocks), question ~64 tokens
    bench_node(
        "MMLU-like sharing",
        PrefixFactory(rng, 57, 27, 4),
        args.prefixes,
        args.churn,
        args.duration,
        args.tick,
        args.refresh,
    )
    # no sharing: every prefix 32 blocks of its own (512 tokens)
    bench_node(
        "no sharing",
        PrefixFactory(rng, 0, 28, 4),
        args.prefixes,
        args.churn,
        args.duration,
        args.tick,
        args.refresh,
    )
    bench_summary(64)


if __name__ == "__main__":
    main()
