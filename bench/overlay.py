"""Overlay benchmarks (results in docs/bench/overlay.md).

    python -m prefixmesh.bench.overlay hop          [--requests 200]
    python -m prefixmesh.bench.overlay digest-bytes [--nodes 8 --prefixes 1000 --seconds 30]
    python -m prefixmesh.bench.overlay convergence  [--nodes 8 --trials 20]
    python -m prefixmesh.bench.overlay digest-load  [--nodes 16 --rate 0.5 --seconds 30
                                                         --partitions 0,256]

``hop``: two node *processes* on 127.0.0.1 with the simulated backend (no model, so only
overlay cost is measured). X holds a prefix; A is slow at prefill, so A forwards that
prefix's requests to X. Added latency of one forwarding hop = client-measured TTFT via A
minus TTFT asking X directly (same prompt, same cache state, alternating), plus the
in-trace figure (A's hop TTFT minus X's, which excludes the client link).

``digest-bytes`` and ``convergence``: N in-process nodes (one trio loop, real libp2p
over loopback, simulated backend), digest interval 1 s, fanout 3. ``digest-bytes``
loads every node with ``--prefixes`` cached prefixes, waits until every index holds every
node, then counts digest-protocol bytes each node *sends* (application payload incl.
length prefixes) over ``--seconds``; it also counts every byte written to TCP in the
process (Noise, Yamux, stream negotiation included) during that window and during an
equal window with digest exchanges stopped, and reports the difference per node.
``digest-load``: the same in-process swarm (every node bootstrapped to every earlier one),
once per ``--partitions`` value (0 = full replication), under load: every node caches
``--rate`` new prompts per second (an MMLU-like shape: one of 57 shared 600-token
"five-shot" prefixes, Zipf 1, plus a 60-token question) for ``--seconds``; digest bytes
per node per second are the payload the digest protocol sends and the TCP bytes of the
window minus those of an equal window after inserts stop and (full replication)
exchanges are stopped. No requests are routed, so no lookups.
``convergence`` adds one new prefix at a random node per trial and measures the time from
the digest tick that issues its record until every other node's index holds it, in
digest intervals (rounds), rounded up.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

from prefixmesh.inference.core.blocks import chain_hashes
from prefixmesh.node.client import Client
from prefixmesh.node.config import load_config
from prefixmesh.node.daemon import Node, NodeOptions
from prefixmesh.overlay.core.identity import Identity, peer_id_from_b58

from .node_entry import write_config


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# --- hop latency (processes) ------------------------------------------------------------


def _start(args, tmp: Path, name: str, bootstrap: tuple[str, ...] = ()):
    """A simulated-engine node process from its config file (``bench/node_entry.py``);
    ``args``: harness switches."""
    config = write_config(tmp / f"{name}.toml", {"node": {
        "key_file": str(tmp / f"{name}.key"), "cache_dir": str(tmp / name), "mdns": False,
        "bootstrap": list(bootstrap), "log_level": "warning"}})
    cmd = [sys.executable, "-m", "prefixmesh.bench.node_entry", "--config", str(config),
           "--backend", "sim", "--no-dht", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    addrs: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith("/ip"):
                addrs.append(line.strip())
            if line.strip() == "ready":
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(60)
    return proc, addrs[0]


def bench_hop(requests: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        x, x_addr = _start(["--sim-prefill-tps", "0"], tmp, "X")
        a, a_addr = _start(["--sim-prefill-tps", "400"], tmp, "A", (x_addr,))
        try:
            return trio.run(_hop_main, a_addr, x_addr, requests)
        finally:
            for p in (a, x):
                p.kill()


async def _hop_main(a_addr: str, x_addr: str, requests: int) -> dict:
    prompt = [("system", "a fixed system prompt for the hop benchmark. " * 14), ("user", "go")]
    x_id = peer_id_from_b58(x_addr.rsplit("/p2p/", 1)[1])
    async with Client.connect(x_addr) as cx, Client.connect(a_addr) as ca:
        await cx.ask(prompt, max_tokens=1, hop_budget=0)  # X caches the prefix
        for _ in range(100):  # wait until A's index knows (before A ever serves it itself)
            info = {p.peer: p for p in (await ca.peers()).peers}.get(x_id)
            if info is not None and info.n_hashes > 0 and info.up:
                break
            await trio.sleep(0.2)
        for _ in range(100):
            ans = await ca.ask(prompt, max_tokens=1)
            if ans.final.serving == x_id:
                break
            await trio.sleep(0.2)
        else:
            raise RuntimeError("A never forwarded to X")
        direct, via, trace = [], [], []
        for _ in range(20):  # warm-up
            await cx.ask(prompt, max_tokens=1)
            await ca.ask(prompt, max_tokens=1)
        for _ in range(requests):
            d = await cx.ask(prompt, max_tokens=1, hop_budget=0)
            v = await ca.ask(prompt, max_tokens=1)
            assert v.final.serving == x_id and len(v.final.hops) == 2
            direct.append(d.ttft_s * 1000)
            via.append(v.ttft_s * 1000)
            trace.append(v.final.hops[0].ttft_ms - v.final.hops[1].ttft_ms)
    added = [v - d for v, d in zip(via, direct, strict=True)]
    return {
        "requests": requests,
        "ttft_direct_ms_median": statistics.median(direct),
        "ttft_via_hop_ms_median": statistics.median(via),
        "added_ms_median": statistics.median(via) - statistics.median(direct),
        "added_ms_paired_median": statistics.median(added),
        "added_ms_paired_p90": _pct(added, 0.9),
        "in_trace_hop_ms_median": statistics.median(trace),
        "in_trace_hop_ms_p90": _pct(trace, 0.9),
    }


# --- in-process swarms ------------------------------------------------------------------


async def _swarm(nursery, n: int, tmp: Path, interval: float, fanout: int,
                 extra: dict | None = None, bootstrap_all: bool = False) -> list[Node]:
    nodes: list[Node] = []
    for i in range(n):
        boot = nodes if bootstrap_all else nodes[:1]
        overrides = {
            "node.cache_dir": str(tmp / f"n{i}"), "node.mdns": False,
            "node.key_file": str(tmp / f"n{i}.key"),
            "node.bootstrap": [nd.full_addrs()[0] for nd in boot] or None,
            "digest.interval_s": interval, "digest.fanout": fanout,
            **(extra or {}),
        }
        node = Node(load_config(None, overrides),
                    NodeOptions(backend="sim", dht=False, print_addrs=False, seed=i),
                    identity=Identity.generate())
        await nursery.start(node.run)
        nodes.append(node)
    return nodes


def _ns(node: Node):
    tenant = next(iter(node.tenants))
    return tenant.ns_id, tenant.namespace_key


def _knows(observer: Node, origin: Node, ns: bytes, chain) -> bool:
    return observer.index.longest_matches(ns, chain).get(origin.identity.peer_id, 0) == len(chain)


async def _converged(nodes: list[Node], timeout: float) -> float:
    t0 = time.monotonic()
    ids = {n.identity.peer_id for n in nodes}
    while time.monotonic() - t0 < timeout:
        if all(set(n.index.peers()) >= ids - {n.identity.peer_id} for n in nodes):
            return time.monotonic() - t0
        await trio.sleep(0.1)
    raise RuntimeError("swarm did not converge")


_WIRE_BYTES = [0]


def _count_socket_bytes() -> None:
    """Count every byte py-libp2p writes to TCP in this process (trio.SocketStream)."""
    original = trio.SocketStream.send_all
    if getattr(original, "_counted", False):
        return

    async def send_all(self, data):
        _WIRE_BYTES[0] += len(data)
        return await original(self, data)

    send_all._counted = True
    trio.SocketStream.send_all = send_all


def bench_digest_bytes(n: int, prefixes: int, seconds: float, interval: float, fanout: int,
                       summary_hash: bool = True, pong_hash: bool = True) -> dict:
    _count_socket_bytes()
    async def main():
        with tempfile.TemporaryDirectory() as d:
            async with trio.open_nursery() as nursery:
                nodes = await _swarm(nursery, n, Path(d), interval, fanout)
                for nd in nodes:
                    nd.exchange.summary_hash_check = summary_hash
                    if not pong_hash:
                        nd.exchange.peer_hash = None
                rng = random.Random(1)
                shared = [rng.randrange(50_000) for _ in range(32)]
                for node in nodes:
                    ns, _ = _ns(node)
                    for _ in range(prefixes):
                        node.backend.insert_prefix(ns, shared + [rng.randrange(50_000) for _ in range(32)])
                await _converged(nodes, 60)
                # wait until every node's index holds every other node's full cache
                expect = {nd.identity.peer_id: len(nd.ae.local_hashes().get(_ns(nd)[0], ())) for nd in nodes}
                t0 = time.monotonic()
                while time.monotonic() - t0 < 120:
                    ok = all(
                        (est := obs.index.estimate(p)) is not None and est.n_hashes >= expect[p]
                        for obs in nodes for p in expect if p != obs.identity.peer_id
                    )
                    if ok:
                        break
                    await trio.sleep(0.2)
                sync_s = time.monotonic() - t0
                await trio.sleep(2 * interval)
                before = [dict(nd.exchange.stats) for nd in nodes]
                wire0 = _WIRE_BYTES[0]
                await trio.sleep(seconds)
                wire1 = _WIRE_BYTES[0]
                after = [dict(nd.exchange.stats) for nd in nodes]
                # the same window length with no digest exchanges: heartbeats and libp2p
                # housekeeping only; the difference is the digest protocol on the wire
                for nd in nodes:
                    nd.exchange.fanout = 0
                await trio.sleep(2 * interval)
                wire2 = _WIRE_BYTES[0]
                await trio.sleep(seconds)
                wire3 = _WIRE_BYTES[0]
                wire_digest = ((wire1 - wire0) - (wire3 - wire2)) / n / seconds
                out_rates = [(a.get("bytes_out", 0) - b.get("bytes_out", 0)) / seconds
                             for a, b in zip(after, before, strict=True)]
                in_sync = sum(a.get("exchanges_in_sync", 0) - b.get("exchanges_in_sync", 0)
                              for a, b in zip(after, before, strict=True))
                total_ex = in_sync + sum(
                    a.get("exchanges_ok", 0) + a.get("exchanges_answered", 0)
                    - b.get("exchanges_ok", 0) - b.get("exchanges_answered", 0)
                    for a, b in zip(after, before, strict=True))
                result = {
                    "nodes": n, "prefixes_per_node": prefixes, "summary_hash_check": summary_hash,
                    "peer_choice_by_pong_hash": pong_hash,
                    "hashes_per_node": statistics.mean(expect.values()),
                    "initial_full_sync_s": round(sync_s, 2),
                    "window_s": seconds,
                    "bytes_sent_per_node_per_s_mean": statistics.mean(out_rates),
                    "bytes_sent_per_node_per_s_max": max(out_rates),
                    "exchange_sides_in_window": total_ex,
                    "in_sync_fraction": in_sync / total_ex if total_ex else math.nan,
                    "wire_bytes_per_node_per_s_all_traffic": (wire1 - wire0) / n / seconds,
                    "wire_bytes_per_node_per_s_without_digests": (wire3 - wire2) / n / seconds,
                    "wire_bytes_per_node_per_s_digest": wire_digest,
                }
                for nd in nodes:
                    await nd.shutdown(grace_s=0.1)
                return result

    return trio.run(main)


def bench_digest_load(n: int, rate: float, seconds: float, partitions: int,
                      interval: float = 1.0, fanout: int = 3, seed: int = 1,
                      min_record_interval: float = 0.0, replicas: int = 3) -> dict:
    _count_socket_bytes()

    async def main():
        with tempfile.TemporaryDirectory() as d:
            async with trio.open_nursery() as nursery:
                extra = {"digest.partitions": partitions, "digest.replicas": replicas,
                         "digest.min_record_interval_s": min_record_interval}
                nodes = await _swarm(nursery, n, Path(d), interval, fanout, extra,
                                     bootstrap_all=True)
                t0 = time.monotonic()
                while any(len(nd.heartbeat.up_peers()) < n - 1 for nd in nodes):
                    if time.monotonic() - t0 > 60:
                        raise RuntimeError("the swarm did not connect fully in 60 s")
                    await trio.sleep(0.2)
                rng = random.Random(seed)
                subjects = [[rng.randrange(50_000) for _ in range(600)] for _ in range(57)]
                weights = [1.0 / (k + 1) for k in range(57)]
                digest = [nd.exchange for nd in nodes]  # Gossip, or PartitionGossip with partitions

                async def load(stop_at: float) -> int:
                    inserted = 0
                    while time.monotonic() < stop_at:
                        for nd in nodes:
                            if rng.random() < rate * 0.1:
                                ns, _ = _ns(nd)
                                prefix = rng.choices(subjects, weights)[0]
                                nd.backend.insert_prefix(
                                    ns, prefix + [rng.randrange(50_000) for _ in range(60)])
                                inserted += 1
                        await trio.sleep(0.1)
                    return inserted

                await load(time.monotonic() + 5 * interval)  # warm-up: streams, snapshots
                before = [dict(g.stats) for g in digest]
                wire0 = _WIRE_BYTES[0]
                inserted = await load(time.monotonic() + seconds)
                wire1 = _WIRE_BYTES[0]
                after = [dict(g.stats) for g in digest]
                # drain what the last inserts made due, then an equal window without
                # digest traffic: heartbeats and libp2p housekeeping only
                await trio.sleep(3 * interval)
                if not partitions:
                    for g in digest:
                        g.fanout = 0
                await trio.sleep(2 * interval)
                wire2 = _WIRE_BYTES[0]
                await trio.sleep(seconds)
                wire3 = _WIRE_BYTES[0]
                out_rates = [(a.get("bytes_out", 0) - b.get("bytes_out", 0)) / seconds
                             for a, b in zip(after, before, strict=True)]
                result = {
                    "nodes": n, "partitions": partitions, "insert_rate_per_node": rate,
                    "min_record_interval_s": min_record_interval, "replicas": replicas,
                    "window_s": seconds, "inserted": inserted,
                    "payload_bytes_per_node_per_s_mean": statistics.mean(out_rates),
                    "payload_bytes_per_node_per_s_max": max(out_rates),
                    "wire_bytes_per_node_per_s_all_traffic": (wire1 - wire0) / n / seconds,
                    "wire_bytes_per_node_per_s_without_digests": (wire3 - wire2) / n / seconds,
                    "wire_bytes_per_node_per_s_digest":
                        ((wire1 - wire0) - (wire3 - wire2)) / n / seconds,
                }
                for nd in nodes:
                    await nd.shutdown(grace_s=0.1)
                return result

    return trio.run(main)


def bench_convergence(n: int, trials: int, interval: float, fanout: int) -> dict:
    async def main():
        with tempfile.TemporaryDirectory() as d:
            async with trio.open_nursery() as nursery:
                nodes = await _swarm(nursery, n, Path(d), interval, fanout)
                await _converged(nodes, 60)
                await trio.sleep(3 * interval)
                rng = random.Random(7)
                rounds, seconds = [], []
                for _ in range(trials):
                    origin = rng.choice(nodes)
                    ns, key = _ns(origin)
                    tokens = [rng.randrange(50_000) for _ in range(64)]
                    chain = chain_hashes(key, tokens)
                    issued: list[float] = []
                    hook = origin.exchange.before_tick

                    def before_tick(now, hook=hook, issued=issued):
                        hook(now)
                        if not issued:  # this tick turns the new prefix into a record
                            issued.append(time.monotonic())

                    origin.exchange.before_tick = before_tick
                    origin.backend.insert_prefix(ns, tokens)
                    t0 = time.monotonic()
                    while not all(_knows(o, origin, ns, chain) for o in nodes if o is not origin):
                        await trio.sleep(0.005)
                        if time.monotonic() - t0 > 30:
                            raise RuntimeError("a prefix did not spread in 30 s")
                    origin.exchange.before_tick = hook
                    spread = time.monotonic() - issued[0]
                    # rounds: digest intervals from the record's issue until all know it
                    rounds.append(math.ceil(spread / interval))
                    seconds.append(spread)
                    await trio.sleep(interval * rng.random())
                for nd in nodes:
                    await nd.shutdown(grace_s=0.1)
        bound = 2 * math.log(n + 1) / fanout + 2
        return {
            "nodes": n, "fanout": fanout, "interval_s": interval, "trials": trials,
            "rounds_median": statistics.median(rounds), "rounds_max": max(rounds),
            "rounds_mean": statistics.mean(rounds),
            "seconds_median": statistics.median(seconds), "seconds_max": max(seconds),
            "target_rounds": bound,
        }

    return trio.run(main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.overlay")
    sub = p.add_subparsers(dest="which", required=True)
    h = sub.add_parser("hop")
    h.add_argument("--requests", type=int, default=200)
    b = sub.add_parser("digest-bytes")
    b.add_argument("--nodes", type=int, default=8)
    b.add_argument("--prefixes", type=int, default=1000)
    b.add_argument("--seconds", type=float, default=30.0)
    b.add_argument("--no-summary-hash", action="store_true",
                   help="always exchange full summaries (for comparison)")
    b.add_argument("--no-pong-hash", action="store_true",
                   help="pick exchange peers at random, ignoring the hashes heartbeats report")
    dl = sub.add_parser("digest-load")
    dl.add_argument("--nodes", type=int, default=16)
    dl.add_argument("--rate", type=float, default=0.5, help="new cached prompts/s per node")
    dl.add_argument("--seconds", type=float, default=30.0)
    dl.add_argument("--partitions", default="0,256",
                    help="comma-separated [digest] partitions values, one swarm each")
    dl.add_argument("--replicas", type=int, default=3, help="[digest] replicas")
    dl.add_argument("--min-record-interval", type=float, default=0.0,
                    help="[digest] min_record_interval_s of every node")
    c = sub.add_parser("convergence")
    c.add_argument("--nodes", type=int, default=8)
    c.add_argument("--trials", type=int, default=20)
    for sp in (b, c, dl):
        sp.add_argument("--interval", type=float, default=1.0)
        sp.add_argument("--fanout", type=int, default=3)
    a = p.parse_args(argv)
    if a.which == "hop":
        result = bench_hop(a.requests)
    elif a.which == "digest-load":
        result = [bench_digest_load(a.nodes, a.rate, a.seconds, int(p), a.interval, a.fanout,
                                    min_record_interval=a.min_record_interval,
                                    replicas=a.replicas)
                  for p in a.partitions.split(",")]
    elif a.which == "digest-bytes":
        result = bench_digest_bytes(a.nodes, a.prefixes, a.seconds, a.interval, a.fanout,
                                    not a.no_summary_hash, not a.no_pong_hash)
    else:
        result = bench_convergence(a.nodes, a.trials, a.interval, a.fanout)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
