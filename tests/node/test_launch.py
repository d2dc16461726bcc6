"""node/launch.py: the node process's start. It begins the engine's load before it imports
the overlay (py-libp2p), so the two overlap; what fails fast fails before anything slow;
a load that fails in its thread is the same one-line error as before; a signal before the
daemon takes over exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from _model_fixture import default_model_path

from prefixmesh.inference.model import read_gguf_info

# what the launcher must not have imported when it begins the load: the overlay's
# network stack and the engine's own libraries (they load in the engine's thread)
HEAVY = ("libp2p", "multiaddr", "numpy", "llama_cpp", "jinja2", "prefixmesh.node.daemon",
         "prefixmesh.inference.engine", "prefixmesh.overlay.host")


def _run_python(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_what_runs_before_the_load_begins_imports_neither_overlay_nor_engine():
    done = _run_python(
        "import sys\n"
        "import prefixmesh.cli, prefixmesh.node.config, prefixmesh.node.launch\n"
        "from prefixmesh.node.config import load_config\n"
        "from prefixmesh.node.process import NodeOptions, make_backend\n"
        "make_backend(load_config(None, {'node.cache_dir': '/nonexistent/kv'}), "
        "NodeOptions(backend='sim'))\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_load_begins_before_the_overlay_is_imported(tmp_path):
    """The point of the launcher: when the engine's load begins, py-libp2p is not imported
    yet (the two then overlap). A begin_load that stops the start there shows it."""
    overrides = {"node.key_file": str(tmp_path / "node.key"),
                 "node.cache_dir": str(tmp_path / "kv"),
                 "node.listen": "/ip4/127.0.0.1/tcp/0", "node.mdns": False}
    done = _run_python(
        "import sys\n"
        "from prefixmesh.inference.backend import SimulatedBackend\n"
        "def begin(self):\n"
        f"    print('heavy at begin_load:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "    raise SystemExit(7)\n"
        "SimulatedBackend.begin_load = begin\n"
        "from prefixmesh.node.config import load_config\n"
        "from prefixmesh.node.launch import run_node\n"
        "from prefixmesh.node.process import NodeOptions\n"
        f"run_node(load_config(None, {overrides!r}), NodeOptions(backend='sim'))\n")
    assert done.returncode == 7, done.stderr
    assert done.stdout.strip() == "heavy at begin_load: []"
    assert not (tmp_path / "kv").exists()  # the start stopped there left nothing behind


def test_a_signal_before_the_daemon_takes_over_exits_at_once():
    done = _run_python(
        "import os, signal, time\n"
        "from prefixmesh.node.launch import _exit_on_signals_during_start_up\n"
        "_exit_on_signals_during_start_up()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n")
    assert done.returncode == 130, done.stderr
    assert f"signal {int(signal.SIGTERM)} during start-up: exiting now" in done.stderr


@pytest.mark.slow  # a node process and llama.cpp
def test_a_model_that_fails_to_load_in_the_background_is_a_one_line_error(tmp_path):
    src = default_model_path()
    cut = tmp_path / "cut.gguf"  # its header is whole (the fingerprint reads), no weights
    with open(src, "rb") as f:
        cut.write_bytes(f.read(read_gguf_info(src).header_bytes + 1000))
    cache = tmp_path / "kv"
    done = subprocess.run(
        [sys.executable, "-m", "prefixmesh", "node", "--model", str(cut), "--n-threads", "1",
         "--key-file", str(tmp_path / "node.key"), "--cache-dir", str(cache),
         "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if "error:" in ln]
    assert errors == [f"prefixmesh node: error: llama.cpp could not load {cut}: Failed to "
                      f"load model from file: {cut}"], done.stderr
    assert "Traceback" not in done.stderr
    assert not cache.exists()  # a start that failed leaves no folder of its own behind
