"""Test helper: real node processes on 127.0.0.1 (``python -m prefixmesh.node.daemon``).

Not a test module. Each :class:`NodeProc` is one daemon process with its own key, cache
dir and log file; it is started, read for its printed multiaddrs (up to ``ready``), and
always killed at the end (``Swarm`` is a context manager).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import trio

from prefixmesh.node.client import Client
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_from_b58

try:
    from _model_fixture import TEST_THREADS, default_model_path
except ImportError:  # pragma: no cover - running from another directory
    from tests._model_fixture import TEST_THREADS, default_model_path

START_TIMEOUT_S = 90.0


class NodeProc:
    def __init__(self, root: Path, name: str, *, bootstrap: list[str] = (), digest: bool = True,
                 dht: bool = False, mdns: bool = False, backend: str = "llama",
                 extra: list[str] = (), netns: str | None = None, n_ctx: int = 1024,
                 digest_interval: float = 0.5, listen: str = "/ip4/127.0.0.1/tcp/0"):
        self.root = root / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = self.root / "node.log"
        # the daemon's main, through the test-only entry that injects PREFIXMESH_FAULT
        args = [sys.executable, str(Path(__file__).with_name("_fault_node.py")),
                "--listen", listen,
                "--key", str(self.root / "node.key"),
                "--cache-dir", str(self.root / "cache"),
                "--backend", backend,
                "--digest-interval", str(digest_interval),
                "--seed", str(abs(hash(name)) % 10_000),
                "-v"]
        if backend == "llama":
            args += ["--model", str(default_model_path()), "--n-ctx", str(n_ctx),
                     "--n-threads", str(TEST_THREADS), "--disk-budget", "64MiB",
                     "--ram-budget", "256MiB"]
        for b in bootstrap:
            args += ["--bootstrap", b]
        if not digest:
            args.append("--no-digest")
        if not dht:
            args.append("--no-dht")
        if mdns:
            args.append("--mdns")
        args += list(extra)
        if netns:
            args = ["ip", "netns", "exec", netns, *args]
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.addrs: list[str] = []
        self._stdout_lines: list[str] = []

    def start(self) -> NodeProc:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     text=True)
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                line = line.strip()
                self._stdout_lines.append(line)
                if line.startswith("/ip"):
                    self.addrs.append(line)
                if line == "ready":
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or not self.addrs:
            self.kill()
            raise RuntimeError(f"node {self.name} did not start; log:\n{self.log_tail()}")
        return self

    @property
    def addr(self) -> str:
        return self.addrs[0]

    @property
    def peer_b58(self) -> str:
        return self.addr.rsplit("/p2p/", 1)[1]

    @property
    def peer_id(self) -> bytes:
        return peer_id_from_b58(self.peer_b58)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def send_signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)

    def terminate(self, timeout: float = 15.0) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc else None


class Swarm:
    def __init__(self, root: Path):
        self.root = root
        self.nodes: list[NodeProc] = []

    def add(self, name: str, **kwargs) -> NodeProc:
        node = NodeProc(self.root, name, **kwargs)
        self.nodes.append(node)
        return node.start()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        for n in self.nodes:
            n.kill()

    def logs(self) -> str:
        return "\n".join(f"==== {n.name}\n{n.log_tail()}" for n in self.nodes)


# --- client helpers (each runs its own trio loop) -----------------------------------------


def ask(addr: str, messages, **kwargs):
    async def main():
        async with Client.connect(addr) as c:
            return await c.ask(messages, **kwargs)

    return trio.run(main)


def peers(addr: str) -> wire.PeersReply:
    async def main():
        async with Client.connect(addr) as c:
            return await c.peers()

    return trio.run(main)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")
