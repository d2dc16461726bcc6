"""A node answers HTTP on its engine before it joins the overlay (node/daemon.py,
"Start-up"): py-libp2p's import (~0.5 s) no longer stands between the model load and the
first answer. Node processes with the simulated engine (no model) on 127.0.0.1: both APIs
(OpenAI, Ollama) and the operator endpoints answer before the overlay starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from _swarm import free_port

# importing these must not import py-libp2p: they are what a node needs to serve HTTP
SERVING_MODULES = ("prefixmesh.node.daemon", "prefixmesh.node.http_gateway",
                   "prefixmesh.overlay.infer", "prefixmesh.overlay.host")


def test_what_a_node_serves_with_imports_no_py_libp2p():
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys\n"
         f"for m in {SERVING_MODULES!r}: __import__(m)\n"
         "print(sorted({m.split('.')[0] for m in sys.modules} & {'libp2p', 'multiaddr'}))\n"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# a node whose overlay import never finishes: what it serves meanwhile is what it serves
# before it joins the overlay, and none of it may import py-libp2p (an import fails)
_HELD_NODE = """
import sys, threading
import prefixmesh.overlay.host as host
host._import_libp2p = lambda: threading.Event().wait(120)
class NoLibp2p:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("libp2p", "multiaddr"):
            raise ImportError(name + " imported before the node joined the overlay")
sys.meta_path.insert(0, NoLibp2p())
from prefixmesh.node.config import load_config
from prefixmesh.node.launch import run_node
from prefixmesh.node.process import NodeOptions
sys.exit(run_node(load_config(None, {overrides!r}), NodeOptions(backend="sim", dht=False)))
"""


def test_the_node_answers_http_before_it_joins_the_overlay_and_stops_gracefully(tmp_path):
    port = free_port()
    overrides = {"node.key_file": str(tmp_path / "node.key"),
                 "node.cache_dir": str(tmp_path / "kv"),
                 "node.listen": f"/ip4/127.0.0.1/tcp/{free_port()}", "node.mdns": False,
                 "http.listen": f"127.0.0.1:{port}"}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-c", _HELD_NODE.format(overrides=overrides)],
                                stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    models = client.get(f"{url}/v1/models")
                    break
                except httpx.TransportError:
                    assert proc.poll() is None, err.read_text()
                    assert time.monotonic() < deadline, err.read_text()
                    time.sleep(0.05)
            assert models.status_code == 200
            model = models.json()["data"][0]["id"]
            answer = client.post(f"{url}/v1/chat/completions", json={
                "model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
            for path in ("/healthz", "/prefixmesh/status", "/metrics", "/prefixmesh/overview",
                         "/api/tags"):
                got = client.get(f"{url}{path}")
                assert got.status_code == 200, (path, got.text)
            ollama = client.post(f"{url}/api/chat", json={
                "model": model, "stream": False, "options": {"num_predict": 4},
                "messages": [{"role": "user", "content": "hello"}]})
            assert ollama.status_code == 200, ollama.text
            assert ollama.json()["message"]["content"]
        # all that while the overlay had not started: no address, no "ready" yet
        assert out.read_text() == ""
        # served requests: a signal now stops the node gracefully (not "exit at once")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, err.read_text()
        assert "stopped in" in err.read_text()
        assert "during start-up" not in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
