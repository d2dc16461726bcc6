"""What the attack benchmarks share: start a node process, sample it, ask it as an honest
client. Used by ``bench/attack_digest_flood.py``, ``bench/attack_slowloris.py`` and
``bench/attack_soak.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import trio

__all__ = ["FOREIGN_IPS", "count_dials", "honest_request", "open_fds", "rss_mib", "spawn_node"]

#: the "foreign" addresses attack records name (loopback aliases nobody else uses)
FOREIGN_IPS = [f"127.0.0.{i}" for i in range(2, 10)]


def spawn_node(root: Path, *, backend: str = "sim", bootstrap: Sequence[str] = (),
               pythonpath: str | None = None) -> tuple[subprocess.Popen, str]:
    """A node process with its key, cache, config and ``node.log`` under ``root``; returns
    it and its first address once it printed ``ready``. With ``pythonpath``, the tree in
    ``DIR/prefixmesh`` (e.g. an older commit, for before/after figures) through that
    tree's own ``python -m prefixmesh.node.daemon`` flags."""
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath:  # an older tree: its own entry point and flags
        env["PYTHONPATH"] = pythonpath
        cmd = [sys.executable, "-m", "prefixmesh.node.daemon", "--listen", "/ip4/127.0.0.1/tcp/0",
               "--key", str(root / "node.key"), "--cache-dir", str(root / "cache"),
               "--backend", backend, "--no-dht", "-v"]
    else:  # this tree: from a config file, like `prefixmesh node --config FILE`
        from prefixmesh.bench.node_entry import write_config

        config = write_config(root / "node.toml", {"node": {
            "key_file": str(root / "node.key"), "cache_dir": str(root / "cache"),
            "mdns": False, "log_level": "info", "bootstrap": list(bootstrap)}})
        cmd = [sys.executable, "-m", "prefixmesh.bench.node_entry", "--config", str(config),
               "--backend", backend, "--no-dht"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(root / "node.log", "wb"),
                            text=True, env=env, cwd=tempfile.gettempdir())
    addr = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("/ip") and not addr:
            addr = line
        if line == "ready":
            break
    if not addr:
        proc.kill()
        raise RuntimeError(f"the node did not start: see {root / 'node.log'}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, addr


def rss_mib(pid: int) -> float | None:
    """The process's resident memory in MiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    """The process's open file descriptors (None once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


async def honest_request(addr: str, *, timeout_s: float = 15.0, prompt: str = "hello",
                         max_tokens: int = 2) -> float | str:
    """One request on a new connection (a fresh identity, no history with the node): its
    latency in seconds, or why it failed (a figure, never an exception)."""
    from prefixmesh.node.client import Client

    t0 = time.perf_counter()
    try:
        with trio.fail_after(timeout_s):
            async with Client.connect(addr) as c:
                await c.ask([("user", prompt)], max_tokens=max_tokens)
        return time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a figure, not a crash
        return f"{type(exc).__name__}: {exc}"[:100]


async def count_dials(dials: list[float], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Counting listeners on one port at each of :data:`FOREIGN_IPS`: the monotonic time of
    every TCP connection that reaches them goes into ``dials``. Started (``nursery.start``)
    with their multiaddrs; runs until cancelled."""
    first = await trio.open_tcp_listeners(0, host=FOREIGN_IPS[0])
    port = first[0].socket.getsockname()[1]
    listeners = list(first)
    for ip in FOREIGN_IPS[1:]:
        listeners += await trio.open_tcp_listeners(port, host=ip)

    async def count(stream) -> None:
        dials.append(time.monotonic())
        await stream.aclose()

    task_status.started([f"/ip4/{ip}/tcp/{port}" for ip in FOREIGN_IPS])
    await trio.serve_listeners(count, listeners)
