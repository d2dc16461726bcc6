"""Idle membership traffic on a real swarm: SWIM against the all-to-all heartbeat.

    python -m prefixmesh.bench.membership_swarm --nodes 8 --membership swim,heartbeat

For each membership implementation (``NodeOptions.membership``) the benchmark starts
``--nodes`` real node processes on 127.0.0.1 (the daemon's ``run_node``, simulated engine,
digests, DHT and mDNS off, so what flows is membership and libp2p's own housekeeping;
each node bootstrapped from every node started before it, so the heartbeat, which has no
dissemination of its own, can form the full mesh too), waits until every node's PEERS view shows every
other up (at most ``--mesh-timeout`` s), lets 3 s pass, then measures an idle window of
``--idle`` s with no client connected: per node process the TCP payload its sockets sent
(``ss -tinp`` bytes_sent, Noise and yamux framing included, TCP/IP headers not; the same
figure ``bench/swarm.py`` reports). With SWIM it also reports the membership frames the
node counted itself (``swim_bytes_out``, CBOR plus 4-byte length prefix), read before and
after the window. The figures go to docs/SCALING.md with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _node_main(config_path: str, membership: str) -> int:
    from prefixmesh.node import daemon
    from prefixmesh.node.config import load_config

    options = daemon.NodeOptions(backend="sim", digest=False, dht=False,
                                 membership=membership)
    return daemon.run_node(load_config(config_path), options)


class _Node:
    def __init__(self, root: Path, i: int, membership: str, bootstrap: list[str]):
        d = root / f"n{i}"
        d.mkdir(parents=True)
        doc = {"node": {"listen": "/ip4/127.0.0.1/tcp/0", "key_file": str(d / "node.key"),
                        "cache_dir": str(d / "cache"), "mdns": False, "log_level": "warning",
                        **({"bootstrap": bootstrap} if bootstrap else {})}}
        cfg = write_config(d / "node.toml", doc)
        self.log = open(d / "node.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixmesh.bench.membership_swarm", "--node", str(cfg),
             "--membership", membership],
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


def _all_up(nodes: list[_Node]) -> bool:
    n = len(nodes)
    for nd in nodes:
        reply = trio.run(_peers, nd.addr)
        if sum(1 for p in reply.peers if p.up) < n - 1:
            return False
    return True


def _swim_bytes(nodes: list[_Node]) -> list[int]:
    return [trio.run(_peers, nd.addr).stats.get("swim_bytes_out", 0) for nd in nodes]


def measure(n: int, membership: str, idle_s: float, mesh_timeout_s: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"pm-membership-{membership}-"))
    nodes: list[_Node] = []
    try:
        for i in range(n):
            nd = _Node(root, i, membership, [x.addr for x in nodes])
            nodes.append(nd)
            nd.wait_ready(120)
        t0 = time.monotonic()
        while not _all_up(nodes):
            if time.monotonic() - t0 > mesh_timeout_s:
                return {"membership": membership, "nodes": n, "mesh_formed": False}
            time.sleep(2.0)
        formed_s = time.monotonic() - t0
        swim0 = _swim_bytes(nodes) if membership == "swim" else None
        time.sleep(SETTLE_S)
        ss0, w0 = _socket_bytes(), time.monotonic()
        time.sleep(idle_s)
        ss1, dt = _socket_bytes(), time.monotonic() - w0
        out: dict = {"membership": membership, "nodes": n, "mesh_formed": True,
                     "mesh_formed_within_s": round(formed_s, 1), "window_s": round(dt, 1),
                     "load_1min": round(os.getloadavg()[0], 1)}
        if ss0 is not None and ss1 is not None:
            sent = _sent_by_pid(ss0, ss1)
            per = sorted(sent.get(nd.proc.pid, 0) / dt for nd in nodes)
            out.update(tcp_payload_per_node_s_median=round(statistics.median(per)),
                       tcp_payload_per_node_s_min=round(per[0]),
                       tcp_payload_per_node_s_max=round(per[-1]))
        if swim0 is not None:
            # read after the window (outside it: the PEERS replies are not counted above);
            # the SETTLE_S before the window is inside this difference
            swim1 = _swim_bytes(nodes)
            per = sorted((b - a) / (dt + SETTLE_S) for a, b in zip(swim0, swim1, strict=True))
            out["swim_frames_per_node_s_median"] = round(statistics.median(per))
        out["still_all_up"] = _all_up(nodes)
        return out
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
    p.add_argument("--node", help=argparse.SUPPRESS)  # child process: run one node
    a = p.parse_args(argv)
    if a.node:
        return _node_main(a.node, a.membership)
    for m in a.membership.split(","):
        print(json.dumps(measure(a.nodes, m.strip(), a.idle, a.mesh_timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
