"""The CLI client commands end to end: a real node process (simulated engine, no model;
started from a config file by the test entry point ``tests/_fault_node.py``) on 127.0.0.1,
and ``prefixmesh ask/peers/chat`` as separate processes (chat under a pseudo-terminal, so
Ctrl-C is a real SIGINT from the terminal driver)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _forkserver
import pytest
from _pty import Terminal  # noqa: E402

pytestmark = pytest.mark.slow  # real node processes

PYTHON = sys.executable
STARTUP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def node_addr(tmp_path_factory):
    work: Path = tmp_path_factory.mktemp("e2e")
    config = work / "node.toml"
    config.write_text(f'[node]\nkey_file = "{work / "node.key"}"\ncache_dir = "{work / "kv"}"\n'
                      'mdns = false\nlog_level = "warning"\n')
    # a node started from its config file, with the simulated engine of the test entry point
    args = [PYTHON, str(Path(__file__).parent / "_fault_node.py"), "--config", str(config),
            "--no-dht", "--backend", "sim", "--sim-decode-tps", "40"]
    # forked from the fork server where it can be (the same main, ~2 s of imports saved)
    env = dict(os.environ, **_forkserver.NODE_STARTUP_ENV)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        proc = _forkserver.spawn(args, env, devnull, env) or subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    finally:
        os.close(devnull)
    addrs: list[str] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline().strip()
            if line == "ready":
                break
            if not line and proc.poll() is not None:
                pytest.fail(f"daemon exited with status {proc.returncode}")
            if line.startswith("/ip4/"):
                addrs.append(line)
        assert addrs, "daemon printed no address"
        yield addrs[0]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # forked from the pre-imported fork server where it can be (saves ~1.5 s of imports)
    return _forkserver.run([PYTHON, "-m", "prefixmesh", *args], timeout=timeout)


def test_ask_json(node_addr):
    proc = cli("ask", "--peer", node_addr, "--json", "--max-tokens", "8",
               "--system", "be brief", "hello there")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    stats = result["stats"]
    assert result["answer"].strip()
    assert stats["served_by"] == node_addr.rsplit("/", 1)[1]
    assert stats["hops"] == 0 and stats["completion_tokens"] == 8
    assert stats["prompt_tokens"] > 0 and stats["ttft_s"] > 0
    assert stats["batched"] is False  # not decoded in a shared batch


def test_ask_streams_text_and_stats_line(node_addr):
    proc = cli("ask", "--peer", node_addr, "--max-tokens", "5", "hi")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "served by" in proc.stderr and "\x1b[" not in proc.stderr  # not a tty


def test_peers_json(node_addr):
    proc = cli("peers", "--peer", node_addr, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["self"] == node_addr.rsplit("/", 1)[1]
    assert node_addr in report["addrs"]


def test_unreachable_peer_is_one_line(node_addr):
    peer_id = node_addr.rsplit("/", 1)[1]
    proc = cli("ask", "--peer", f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}", "hi")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefixmesh ask: cannot reach"), lines


def test_unknown_tenant_at_the_node_is_refused(node_addr, tmp_path):
    cfg = tmp_path / "client.toml"
    cfg.write_text('[tenants.acme]\nsecret = "a-secret-the-node-does-not-know"\n')
    proc = cli("ask", "--peer", node_addr, "--config", str(cfg), "--tenant", "acme", "hi")
    # the node relays namespaces it is not configured for but never serves them
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_chat_in_a_terminal(node_addr):
    script = Path(PYTHON).parent / "prefixmesh"
    argv = [str(script)] if script.exists() else [PYTHON, "-m", "prefixmesh"]
    term = Terminal([*argv, "chat", "--peer", node_addr])
    at = term.wait_for(b"> ")
    term.write(b"/system be brief\n")
    at = term.wait_for(b"(system prompt set)", start=at)
    # a 512-token answer at 40 tokens/s takes ~13 s: Ctrl-C cancels it, not the chat
    term.write(b"tell me everything\n")
    at = term.wait_for(b"tell me everything\r\n", start=at)
    # the first streamed piece: any text after the echo other than the prompt (the pty
    # may echo the typed line before the chat prints its next "> ", so not just " ")
    term.wait_until(lambda out: out[at:].replace(b"> ", b"").strip() != b"")
    term.write(b"\x03")
    at = term.wait_for(b"(cancelled)", start=at)
    assert b"\x1b[2m(cancelled)\x1b[0m" in term.out  # faint on a tty
    at = term.wait_for(b"> ", start=at)
    term.write(b"/stats\n")
    at = term.wait_for(b"0 answered, 1 cancelled", start=at)
    term.write(b"\x03")
    at = term.wait_for(b"Ctrl-C again", start=at)
    term.write(b"\x03")
    assert term.exit_code() == 0


def test_chat_answers_and_eof_exits(node_addr, tmp_path):
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\npeer = "{node_addr}"\nmax_tokens = 12\n')
    proc = subprocess.run([PYTHON, "-m", "prefixmesh", "chat", "--config", str(cfg)],
                          input="first question\nsecond question\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("served by") == 2 and "12 tokens in" in proc.stdout
