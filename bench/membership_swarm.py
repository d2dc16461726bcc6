"""Idle membership traffic on a real swarm: SWIM against the all-to-all heartbeat.

    python -m prefixmesh.bench.membership_swarm --nodes 8 --membership swim,heartbeat
    python -m prefixmesh.bench.membership_swarm --nodes 32 --membership swim \
        --digests --prefixes 4 --rate 0.5          # membership + digests, under load

For each membership implementation (``NodeOptions.membership``) the benchmark starts
``--nodes`` real node processes on 127.0.0.1 (the daemon's ``run_node``, simulated engine,
digests, DHT and mDNS off, so what flows is membership and libp2p's own housekeeping;
each node bootstrapped from every node started before it, so the heartbeat, which has no
dissemination of its own, can form the full mesh too; a SWIM node from the first and the
last 3 started, SWIM spreads the rest), waits until every node's PEERS view shows every
other up (at most ``--mesh-timeout`` s), lets 3 s pass, then measures an idle window of
``--idle`` s with no client connected: per node process the TCP payload its sockets sent
(``ss -tinp`` bytes_sent, Noise and yamux framing included, TCP/IP headers not; the same
figure ``bench/swarm.py`` reports). With SWIM it also reports the membership frames the
node counted itself (``swim_bytes_out``, CBOR plus 4-byte length prefix), read before and
after the window. The figures go to docs/SCALING.md with the machine and its load.

``--digests`` runs the digest exchange too (``--partitions P``: partial replication):
before the mesh wait every node serves ``--prefixes`` prompts of its own (160 tokens,
hop budget 0), so every digest is non-empty, and the digest frames each node counted
(``digest_bytes_out`` or ``part_bytes_out``: messages plus length prefixes) are
reported beside SWIM's. ``--rate R`` sends R requests per second (all nodes together,
entry node at random) in a second window after the idle one: a seeded prompt of a random node plus a fresh
32-token suffix, so holders are found and new prefixes are cached (digest deltas). The
TCP payload then includes the requests' own traffic (tokens to the client, forwards);
the frame counts do not.

``--thaw S`` then freezes the middle node with SIGSTOP for S seconds and, from its SIGCONT
on, reads that node's own PEERS view every second for at most ``--watch`` s: how long
until it holds every other node up again for good (``thaw_rejoin_s``: from then on
through the end of the watch, which stops once that has lasted 15 s; null if not all up
at the end), the fewest it held up meanwhile (``thaw_min_up``) and how many at the end
(``thaw_up_at_end``)::

    python -m prefixmesh.bench.membership_swarm --nodes 32 --membership swim \
        --start-batch 4 --idle 10 --thaw 20 --watch 90
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from .node_entry import write_config
from .swarm import _sent_by_pid, _socket_bytes

SETTLE_S = 3.0
START_TIMEOUT_S = 300.0
SWIM_SEEDS = 4  # bootstrap peers of a SWIM node: the first node and the last 3 started
#: --thaw: how long the thawed node's view must stay all-up before the watch ends early
THAW_STABLE_S = 15.0
PROMPT_TOKENS = 160  # 10 blocks: past the partition key's 4th block
SUFFIX_TOKENS = 32
DIGEST_SETTLE_S = 10.0  # after the mesh formed, before the window: seeded records spread
DIGEST_FRAME_KEYS = ("digest_bytes_out", "part_bytes_out")
# full replication's exchanges initiated (ok; of them ended at the summary-hash check)
EXCHANGE_KEYS = ("digest_exchanges_ok", "digest_exchanges_in_sync")


def _node_main(config_path: str, membership: str, digests: bool) -> int:
    from prefixmesh.node import launch, process
    from prefixmesh.node.config import load_config

    options = process.NodeOptions(backend="sim", digest=digests, dht=False,
                                 membership=membership)
    return launch.run_node(load_config(config_path), options)


class _Node:
    def __init__(self, root: Path, i: int, membership: str, bootstrap: list[str],
                 digests: bool = False, partitions: int = 0, refresh_s: float = 0.0):
        d = root / f"n{i}"
        d.mkdir(parents=True)
        doc: dict = {"node": {"listen": "/ip4/127.0.0.1/tcp/0", "key_file": str(d / "node.key"),
                              "cache_dir": str(d / "cache"), "mdns": False,
                              "log_level": "warning",
                              **({"bootstrap": bootstrap} if bootstrap else {})}}
        digest: dict = {}
        if partitions:
            digest["partitions"] = partitions
        if refresh_s:  # the full stream's refresh, its records living 3x as long
            digest.update(refresh_interval_s=refresh_s, ttl_s=min(3600.0, 3 * refresh_s))
        if digest:
            doc["digest"] = digest
        cfg = write_config(d / "node.toml", doc)
        self.log = open(d / "node.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixmesh.bench.membership_swarm", "--node", str(cfg),
             "--membership", membership, *(["--digests"] if digests else [])],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
        self.addr = ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().strip()
            if line.startswith("/ip4/") and not self.addr:
                self.addr = line
            if line == "ready":
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("a node did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


async def _peers(addr: str):
    from prefixmesh.node.client import Client

    with trio.fail_after(20):
        async with Client.connect(addr) as c:
            return await c.peers()


def _up_peers(node: _Node) -> int:
    """How many peers ``node``'s own PEERS view holds up."""
    return sum(1 for p in trio.run(_peers, node.addr).peers if p.up)


def _all_up(nodes: list[_Node]) -> bool:
    return all(_up_peers(nd) >= len(nodes) - 1 for nd in nodes)


def _frame_bytes(nodes: list[_Node]) -> list[tuple[int, ...]]:
    """Per node so far: SWIM frame bytes sent, digest frame bytes sent, then the
    :data:`EXCHANGE_KEYS` counters."""
    out = []
    for nd in nodes:
        stats = trio.run(_peers, nd.addr).stats
        out.append((stats.get("swim_bytes_out", 0),
                    sum(stats.get(k, 0) for k in DIGEST_FRAME_KEYS),
                    *(stats.get(k, 0) for k in EXCHANGE_KEYS)))
    return out


def _prompt(node: int, k: int) -> list[int]:
    """The k-th seeded prompt of a node: distinct per (node, k) from the first token."""
    rng = random.Random(node * 1000 + k)
    return [rng.randrange(1, 50000) for _ in range(PROMPT_TOKENS)]


async def _ask(addr: str, tokens: list[int], hop_budget: int) -> bool:
    from prefixmesh.node.client import Client, ClientError

    try:
        with trio.fail_after(60):
            async with Client.connect(addr) as c:
                await c.ask(tokens=tokens, max_tokens=4, deadline_s=30.0,
                            hop_budget=hop_budget)
        return True
    except (ClientError, trio.TooSlowError):
        return False


async def _seed(nodes: list[_Node], prefixes: int) -> int:
    """Every node serves its own ``prefixes`` prompts (hop budget 0: cached there)."""
    from prefixmesh.node.client import Client, ClientError

    ok = 0
    for i, nd in enumerate(nodes):
        try:
            with trio.fail_after(60 + 30 * prefixes):
                async with Client.connect(nd.addr) as c:
                    for k in range(prefixes):
                        await c.ask(tokens=_prompt(i, k), max_tokens=4, deadline_s=30.0,
                                    hop_budget=0)
                        ok += 1
        except (ClientError, trio.TooSlowError):
            pass
    return ok


async def _load(nodes: list[_Node], prefixes: int, rate: float, seconds: float,
                rng: random.Random) -> tuple[int, int]:
    """``rate`` requests/s for ``seconds``: a random node's seeded prompt plus a fresh
    suffix, entering at a random node. Returns (sent, answered)."""
    sent = answered = 0

    async def one(entry: str, tokens: list[int]) -> None:
        nonlocal answered
        answered += await _ask(entry, tokens, 2)

    async with trio.open_nursery() as nursery:
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            owner = rng.randrange(len(nodes))
            tokens = _prompt(owner, rng.randrange(max(1, prefixes)))
            tokens += [rng.randrange(1, 50000) for _ in range(SUFFIX_TOKENS)]
            nursery.start_soon(one, rng.choice(nodes).addr, tokens)
            sent += 1
            await trio.sleep(rng.expovariate(rate))
    return sent, answered


def _window(nodes: list[_Node], seconds: float, rate: float, prefixes: int,
            rng: random.Random) -> dict:
    """One measured window (idle, or ``rate`` requests/s): TCP payload and frames sent
    per node per second."""
    n = len(nodes)
    frames0 = _frame_bytes(nodes)
    time.sleep(SETTLE_S)
    ss0, w0 = _socket_bytes(), time.monotonic()
    if rate > 0:
        sent, answered = trio.run(_load, nodes, prefixes, rate, seconds, rng)
    else:
        time.sleep(seconds)
    ss1, dt = _socket_bytes(), time.monotonic() - w0
    out: dict = {"window_s": round(dt, 1), "load_1min": round(os.getloadavg()[0], 1),
                 "rate_per_s": rate}
    if rate > 0:
        out.update(requests_sent=sent, requests_answered=answered)
    if ss0 is not None and ss1 is not None:
        sent_by = _sent_by_pid(ss0, ss1)
        per = sorted(sent_by.get(nd.proc.pid, 0) / dt for nd in nodes)
        out.update(tcp_payload_per_node_s_median=round(statistics.median(per)),
                   tcp_payload_per_node_s_min=round(per[0]),
                   tcp_payload_per_node_s_max=round(per[-1]))
    # frame counters read after the window (outside it: the PEERS replies are not
    # counted above); the SETTLE_S before the window is inside these differences
    frames1 = _frame_bytes(nodes)
    span = dt + SETTLE_S
    for j, name in enumerate(("swim", "digest")):
        per = sorted((b[j] - a[j]) / span for a, b in zip(frames0, frames1, strict=True))
        if per[-1] > 0:
            out[f"{name}_frames_per_node_s_median"] = round(statistics.median(per))
            out[f"{name}_frames_per_node_s_min"] = round(per[0])
            out[f"{name}_frames_per_node_s_max"] = round(per[-1])
    for j, name in enumerate(EXCHANGE_KEYS, start=2):
        total = sum(b[j] - a[j] for a, b in zip(frames0, frames1, strict=True))
        if total:
            out[f"{name}_per_node_s"] = round(total / n / span, 2)
    return out


def _up_count(node: _Node) -> int:
    try:
        return _up_peers(node)
    except Exception:  # noqa: BLE001 - not answering (yet): nobody up as far as we know
        return 0


def _thaw(nodes: list[_Node], freeze_s: float, watch_s: float) -> dict:
    """SIGSTOP the middle node for ``freeze_s``, then watch its own view (module docstring).
    Right after SIGCONT the node still shows its view from before the freeze, so the rejoin
    is when its view became all-up *for good*: all-up from then to the end of the watch,
    which ends early once that has held for :data:`THAW_STABLE_S`."""
    node = nodes[len(nodes) // 2]
    node.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(freeze_s)
    finally:
        node.proc.send_signal(signal.SIGCONT)
    t0 = time.monotonic()
    all_up_since: float | None = None
    up = min_up = len(nodes) - 1
    while (now := time.monotonic()) - t0 < watch_s:
        up = _up_count(node)
        min_up = min(min_up, up)
        if up < len(nodes) - 1:
            all_up_since = None
        elif all_up_since is None:
            all_up_since = now
        elif now - all_up_since >= THAW_STABLE_S:
            break
        time.sleep(1.0)
    return {"thaw_freeze_s": freeze_s,
            "thaw_rejoin_s": None if all_up_since is None else round(all_up_since - t0, 1),
            "thaw_min_up": min_up, "thaw_up_at_end": up, "thaw_watch_s": watch_s}


def measure(n: int, membership: str, idle_s: float, mesh_timeout_s: float, *,
            digests: bool = False, partitions: int = 0, prefixes: int = 0,
            rate: float = 0.0, seed: int = 1, refresh_s: float = 0.0,
            start_batch: int = 1, thaw_s: float = 0.0, watch_s: float = 90.0) -> list[dict]:
    """An idle window, then (``rate`` > 0) a loaded one, on one swarm: one dict each."""
    root = Path(tempfile.mkdtemp(prefix=f"pm-membership-{membership}-"))
    nodes: list[_Node] = []
    head: dict = {"membership": membership, "nodes": n}
    if digests:
        head.update(digests="partitioned" if partitions else "full", partitions=partitions,
                    **({"refresh_s": refresh_s} if refresh_s else {}))
    try:
        while len(nodes) < n:
            # SWIM spreads members itself: a few seeds each (dialling every earlier node
            # timed out on a saturated machine); the heartbeat needs every one
            seeds = [x.addr for x in nodes]
            if membership == "swim":
                seeds = seeds[:1] + seeds[-(SWIM_SEEDS - 1):] if len(seeds) > SWIM_SEEDS else seeds
            # the first node alone, then ``start_batch`` at a time from the nodes before
            batch = [_Node(root, len(nodes) + j, membership, seeds, digests, partitions,
                           refresh_s)
                     for j in range(min(start_batch if nodes else 1, n - len(nodes)))]
            nodes.extend(batch)  # before waiting: a start that fails still stops them all
            for nd in batch:
                nd.wait_ready(START_TIMEOUT_S)
        if digests and prefixes:
            head["prefixes_seeded"] = trio.run(_seed, nodes, prefixes)
        t0 = time.monotonic()
        while not _all_up(nodes):
            if time.monotonic() - t0 > mesh_timeout_s:
                return [{**head, "mesh_formed": False}]
            time.sleep(2.0)
        head.update(mesh_formed=True, mesh_formed_within_s=round(time.monotonic() - t0, 1))
        if digests:
            time.sleep(DIGEST_SETTLE_S)
        rng = random.Random(seed)
        rows = [{**head, **_window(nodes, idle_s, r, prefixes, rng)}
                for r in ([0.0, rate] if rate > 0 else [0.0])]
        rows[-1]["still_all_up"] = _all_up(nodes)
        if thaw_s > 0:
            rows[-1].update(_thaw(nodes, thaw_s, watch_s))
        return rows
    finally:
        for nd in nodes:
            nd.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.membership_swarm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--membership", default="swim,heartbeat",
                   help="comma-separated: swim, heartbeat")
    p.add_argument("--idle", type=float, default=30.0, help="idle window (s)")
    p.add_argument("--mesh-timeout", type=float, default=180.0)
    p.add_argument("--digests", action="store_true", help="run the digest exchange too")
    p.add_argument("--partitions", type=int, default=0,
                   help="with --digests: partial replication over this many partitions")
    p.add_argument("--prefixes", type=int, default=4,
                   help="with --digests: prompts each node serves before the window")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests/s (all nodes together) during the window; 0: idle")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start-batch", type=int, default=1,
                   help="nodes started at once after the first (1: one by one)")
    p.add_argument("--refresh", type=float, default=0.0,
                   help="with --digests: [digest] refresh_interval_s (ttl 3x; 0: the default)")
    p.add_argument("--thaw", type=float, default=0.0,
                   help="then SIGSTOP the middle node this many s and time its rejoin")
    p.add_argument("--watch", type=float, default=90.0,
                   help="with --thaw: how long to watch the thawed node's view (s)")
    p.add_argument("--node", help=argparse.SUPPRESS)  # child process: run one node
    a = p.parse_args(argv)
    if a.node:
        return _node_main(a.node, a.membership, a.digests)
    for m in a.membership.split(","):
        for row in measure(a.nodes, m.strip(), a.idle, a.mesh_timeout, digests=a.digests,
                           partitions=a.partitions, prefixes=a.prefixes, rate=a.rate,
                           seed=a.seed, refresh_s=a.refresh, start_batch=a.start_batch,
                           thaw_s=a.thaw, watch_s=a.watch):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
