"""The digest-flood attack of issue 14 (finding 1) against one node process, any code tree.

    .venv/bin/python bench/attack_digest_flood.py [--pythonpath DIR] [--window 30]

Starts one node with the simulated engine (``prefixmesh.bench.node_entry --config FILE
--backend sim``; with ``--pythonpath DIR``, the tree in ``DIR/prefixmesh``, e.g. an older
commit unpacked with ``git archive C | tar -x -C DIR/prefixmesh``, through that tree's own
``python -m prefixmesh.node.daemon`` flags), sends 20 honest requests (each on a new
connection), then runs the outside attacker of ``tests/adversary/digest_flood.py`` (1,100
fresh-identity snapshot records naming 127.0.0.2..9, twice) during 20 more, counts TCP
connections at those addresses for ``--window`` seconds, and prints one line of figures
(JSON). The test ``tests/swarm/test_attack_digest_flood.py`` asserts the bounds on the
current tree; this script gives the before/after comparison in docs/SECURITY.md (D19).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from adversary.digest_flood import flood  # noqa: E402

FOREIGN_IPS = [f"127.0.0.{i}" for i in range(2, 10)]


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_node(pythonpath: str | None) -> tuple[subprocess.Popen, str, Path]:
    root = Path(tempfile.mkdtemp(prefix="attack-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if pythonpath:  # an older tree: its own entry point and flags (the before/after figures)
        cmd = [sys.executable, "-m", "prefixmesh.node.daemon", "--listen", "/ip4/127.0.0.1/tcp/0",
               "--key", str(root / "node.key"), "--cache-dir", str(root / "cache"),
               "--backend", "sim", "--no-dht", "-v"]
    else:  # this tree: from a config file, like `prefixmesh node --config FILE`
        from prefixmesh.bench.node_entry import write_config  # noqa: PLC0415

        config = write_config(root / "node.toml", {"node": {
            "key_file": str(root / "node.key"), "cache_dir": str(root / "cache"),
            "mdns": False, "log_level": "info"}})
        cmd = [sys.executable, "-m", "prefixmesh.bench.node_entry", "--config", str(config),
               "--backend", "sim", "--no-dht"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE, stderr=open(root / "node.log", "wb"), text=True, env=env,
        cwd=tempfile.gettempdir())
    addr = ""
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("/ip") and not addr:
            addr = line
        if line == "ready":
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, addr, root


async def _honest(addr: str):
    from prefixmesh.node.client import Client

    t0 = time.perf_counter()
    try:
        with trio.fail_after(15):
            async with Client.connect(addr) as c:
                await c.ask([("user", "hello")], max_tokens=2)
        return time.perf_counter() - t0
    except Exception as exc:
        return type(exc).__name__


async def run(proc: subprocess.Popen, addr: str, window_s: float) -> dict:
    dials: list[float] = []
    first = await trio.open_tcp_listeners(0, host=FOREIGN_IPS[0])
    port = first[0].socket.getsockname()[1]
    listeners = list(first)
    for ip in FOREIGN_IPS[1:]:
        listeners += await trio.open_tcp_listeners(port, host=ip)

    async def count(stream):
        dials.append(time.monotonic())
        await stream.aclose()

    foreign = [f"/ip4/{ip}/tcp/{port}" for ip in FOREIGN_IPS]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, count, listeners)
        rss0 = _rss_mib(proc.pid)
        quiet = [await _honest(addr) for _ in range(20)]
        t0 = time.monotonic()
        await flood(addr, foreign)
        attacked = []
        for i in range(20):
            if i == 10:
                try:
                    await flood(addr, foreign)
                except Exception as exc:  # the victim may be gone already
                    attacked.append(f"flood failed: {type(exc).__name__}")
            attacked.append(await _honest(addr))
        while time.monotonic() - t0 < window_s:
            await trio.sleep(0.5)
        elapsed = time.monotonic() - t0
        after = await _honest(addr)
        nursery.cancel_scope.cancel()
    ok = [x for x in attacked if isinstance(x, float)]
    quiet_ok = [x for x in quiet if isinstance(x, float)]
    return {
        "quiet_answered": len(quiet_ok), "quiet_median_s": statistics.median(quiet_ok),
        "attacked_answered": len(ok),
        "attacked_median_s": statistics.median(ok) if ok else None,
        "failures": sorted({x for x in attacked if not isinstance(x, float)}),
        "foreign_dials": len(dials), "window_s": round(elapsed, 1),
        "dials_per_min": round(len(dials) * 60 / elapsed, 1),
        "rss_mib": [rss0, _rss_mib(proc.pid)], "after": after,
        "alive": proc.poll() is None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", default=None)
    ap.add_argument("--window", type=float, default=30.0)
    args = ap.parse_args()
    proc, addr, root = start_node(args.pythonpath)
    try:
        figures = trio.run(run, proc, addr, args.window)
    finally:
        proc.kill()
    figures["log"] = str(root / "node.log")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
