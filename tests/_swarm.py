"""Test helper: real node processes on 127.0.0.1, each started like ``prefixmesh node
--config FILE``: a TOML config per node (``<root>/<name>/swarm.toml``), run by the test-only
entry point ``tests/_fault_node.py`` (``bench/node_entry.py`` plus fault injection).

Not a test module. Each :class:`NodeProc` is one node process with its own key, cache
dir and log file; it is started, read for its printed multiaddrs (up to ``ready``), and
always killed at the end (``Swarm`` is a context manager). The process is forked from the
session's pre-imported fork server where it can be (``tests/_forkserver.py``: the same
main, saving ~2 s of imports per start; ``PREFIXMESH_TEST_FORKSERVER=0`` turns it off).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import trio

from prefixmesh.bench.node_entry import write_config
from prefixmesh.node.client import Client
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_from_b58

try:
    import _forkserver
    from _model_fixture import TEST_THREADS, default_model_path
except ImportError:  # pragma: no cover - running from another directory
    from tests import _forkserver
    from tests._model_fixture import TEST_THREADS, default_model_path

START_TIMEOUT_S = 90.0

# ``extra`` items that set config keys: flag -> (key, type); a None type is a switch (true)
_EXTRA_KEYS = {
    "--listen": ("node.listen", str), "--key": ("node.key_file", str),
    "--cache-dir": ("node.cache_dir", str), "--ram-budget": ("node.ram_budget", str),
    "--disk-budget": ("node.disk_budget", str), "--log-level": ("node.log_level", str),
    "--log-format": ("node.log_format", str), "--model": ("model.path", str),
    "--n-ctx": ("model.n_ctx", int), "--n-threads": ("model.n_threads", int),
    "--policy": ("routing.policy", str), "--hop-budget": ("routing.hop_budget", int),
    "--digest-interval": ("digest.interval_s", float), "--fanout": ("digest.fanout", int),
    "--spot-check": ("routing.spot_check_fraction", float),
    "--share-cap": ("routing.share_cap", None), "--mdns": ("node.mdns", None),
}
# ``extra`` items passed on to the entry point (harness switches, bench/node_entry.py)
_ENTRY_FLAGS = {"--sim-prefill-tps": 1, "--sim-decode-tps": 1, "--seed": 1, "--backend": 1,
                "--no-digest": 0, "--no-dht": 0, "--link-delay-ms": 1,
                "--membership": 1}
_PATH_KEYS = {("node", "key_file"), ("node", "cache_dir"), ("model", "path")}


def _file_tables(path: Path) -> dict:
    """A ``--config`` file's tables, relative paths made absolute (against its folder)."""
    doc = tomllib.loads(path.read_text())
    for section, key in _PATH_KEYS:
        value = doc.get(section, {}).get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            doc[section][key] = str(path.parent / value)
    for spec in doc.get("tenants", {}).values():
        value = spec.get("secret_file") if isinstance(spec, dict) else None
        if isinstance(value, str) and not Path(value).expanduser().is_absolute():
            spec["secret_file"] = str(path.parent / value)
    return doc


def _apply_extra(doc: dict, entry: list[str], extra: list[str]) -> None:
    """``extra``: ``--config FILE`` (its tables under ours), config flags (over ours) and
    entry-point switches (appended to ``entry``). Unknown items are an error."""
    items, keys = list(extra), {}
    while items:
        flag = items.pop(0)
        if flag == "--config":
            base = _file_tables(Path(items.pop(0)))
            for section, table in doc.items():
                base.setdefault(section, {}).update(table)
            doc.clear()
            doc.update(base)
        elif flag == "--bootstrap":
            doc["node"].setdefault("bootstrap", []).append(items.pop(0))
        elif flag in _EXTRA_KEYS:
            key, kind = _EXTRA_KEYS[flag]
            keys[key] = True if kind is None else kind(items.pop(0))
        elif flag in _ENTRY_FLAGS:
            entry += [flag, *[items.pop(0) for _ in range(_ENTRY_FLAGS[flag])]]
        else:
            raise ValueError(f"_swarm.NodeProc: unknown extra item {flag!r}")
    for key, value in keys.items():
        section, _, name = key.partition(".")
        doc.setdefault(section, {})[name] = value


class NodeProc:
    def __init__(self, root: Path, name: str, *, bootstrap: list[str] = (), digest: bool = True,
                 dht: bool = False, mdns: bool = False, backend: str = "llama",
                 extra: list[str] = (), netns: str | None = None, n_ctx: int = 1024,
                 digest_interval: float = 0.5, listen: str = "/ip4/127.0.0.1/tcp/0"):
        self.root = root / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = self.root / "node.log"
        doc: dict = {
            "node": {"listen": listen, "key_file": str(self.root / "node.key"),
                     "cache_dir": str(self.root / "cache"), "mdns": mdns, "log_level": "info"},
            "digest": {"interval_s": digest_interval},
        }
        if bootstrap:
            doc["node"]["bootstrap"] = list(bootstrap)
        if backend == "llama":
            doc["node"].update(disk_budget="64MiB", ram_budget="256MiB")
            doc["model"] = {"path": str(default_model_path()), "n_ctx": n_ctx,
                            "n_threads": TEST_THREADS}
        entry = ["--backend", backend, "--seed", str(abs(hash(name)) % 10_000)]
        if not digest:
            entry.append("--no-digest")
        if not dht:
            entry.append("--no-dht")
        _apply_extra(doc, entry, list(extra))
        self.config_path = write_config(self.root / "swarm.toml", doc)
        # the node's start as `prefixmesh node --config FILE` does it, through the test-only
        # entry that injects PREFIXMESH_FAULT
        args = [sys.executable, str(Path(__file__).with_name("_fault_node.py")),
                "--config", str(self.config_path), *entry]
        if netns:
            args = ["ip", "netns", "exec", netns, *args]
        self.args = args
        self.proc: subprocess.Popen | _forkserver.ForkedProc | None = None
        self.addrs: list[str] = []
        self._stdout_lines: list[str] = []
        self._log = None
        self._ready = threading.Event()

    def launch(self, env: dict[str, str] | None = None) -> NodeProc:
        """Start the process and return at once (:meth:`wait_ready` waits for it);
        ``env``: extra environment variables for this node only."""
        common = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env = dict(common, **(env or {}))
        if self._log is not None:
            self._log.close()  # a restart's earlier process
        self._log = open(self.log_path, "ab")
        # forked from a pre-imported interpreter where it runs the same main (tests/
        # _forkserver.py: saves ~2 s of imports per start), else a fresh interpreter
        self.proc = _forkserver.spawn(self.args, env, self._log.fileno(), common) or \
            subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._log, env=env,
                             text=True)
        self._ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                line = line.strip()
                self._stdout_lines.append(line)
                if line.startswith("/ip"):
                    self.addrs.append(line)
                if line == "ready":
                    self._ready.set()
            self._ready.set()

        threading.Thread(target=read, daemon=True).start()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> NodeProc:
        """Wait until the launched node printed its addresses and ``ready``."""
        if not self._ready.wait(timeout_s) or not self.addrs:
            self.kill()
            raise RuntimeError(f"node {self.name} did not start; log:\n{self.log_tail()}")
        return self

    def start(self, env: dict[str, str] | None = None) -> NodeProc:
        return self.launch(env).wait_ready()

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> NodeProc:
        """Kill the process (if running) and start it again with the same config, key and
        cache dir: the same peer id, a new incarnation (new port unless one was fixed)."""
        self.kill()
        self.addrs = []
        return self.launch().wait_ready(timeout_s)

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

    def add(self, name: str, *, env: dict[str, str] | None = None, **kwargs) -> NodeProc:
        node = NodeProc(self.root, name, **kwargs)
        self.nodes.append(node)
        return node.start(env)

    def add_many(self, specs, **common) -> list[NodeProc]:
        """Start several nodes together and wait until all are ready (node starts are
        mostly imports and model loading: in parallel they overlap on the cores).
        ``specs``: names, or ``(name, kwargs)`` pairs whose kwargs (``NodeProc``'s, plus
        ``env``) go over ``common``. Returns the nodes in ``specs`` order."""
        started: list[NodeProc] = []
        try:
            for spec in specs:
                name, own = (spec, {}) if isinstance(spec, str) else spec
                kwargs = {**common, **own}
                env = kwargs.pop("env", None)
                node = NodeProc(self.root, name, **kwargs)
                self.nodes.append(node)
                started.append(node.launch(env))
            deadline = time.monotonic() + START_TIMEOUT_S
            for node in started:
                node.wait_ready(max(0.0, deadline - time.monotonic()))
        except BaseException:
            for node in started:
                node.kill()
            raise
        return started

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        for n in self.nodes:
            n.kill()

    def logs(self) -> str:
        return "\n".join(f"==== {n.name}\n{n.log_tail()}" for n in self.nodes)


# --- client helpers (each runs its own trio loop) -----------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a listener of a test's own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
