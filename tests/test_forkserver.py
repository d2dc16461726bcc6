"""The test fork server (tests/_forkserver.py) starts a node that behaves like one started
with ``subprocess.Popen``: the real node code in a process of its own (its pid is the
node's: it is the pid the node writes into its key file's lock), the caller's environment
and stderr, the same exit status for SIGSTOP/SIGCONT, SIGTERM and SIGKILL, and the same
exit status and error output for a refused start through the ``prefixmesh`` console
script."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import _forkserver
import pytest
from _swarm import NodeProc, Swarm, ask

pytestmark = pytest.mark.slow  # real node processes and the real model


def test_command_lines_the_server_runs():
    script = os.path.join(os.path.dirname(sys.executable), "prefixmesh")
    assert _forkserver.program_for([sys.executable, _forkserver.FAULT_NODE, "--config", "x"]) \
        == ("fault_node", [_forkserver.FAULT_NODE, "--config", "x"])
    assert _forkserver.program_for([script, "node", "--config", "x"]) == \
        ("cli", [script, "node", "--config", "x"])
    assert _forkserver.program_for([sys.executable, "-m", "prefixmesh", "node"])[0] == "cli"
    assert _forkserver.program_for(["ip", "netns", "exec", "ns", sys.executable,
                                    _forkserver.FAULT_NODE]) is None
    assert _forkserver.program_for([sys.executable, "-c", "pass"]) is None


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_forked_node_is_its_own_process_with_its_env_and_signals(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFIXMESH_TEST_FORKSERVER", raising=False)
    with Swarm(tmp_path) as s:
        a, b = s.add_many(["A", ("B", {"env": {"PREFIXMESH_FAULT": "wrong-tokens"}})])
        assert isinstance(a.proc, _forkserver.ForkedProc), "the fork server was not used"
        lock = (a.root / "node.key").with_name("node.key.lock")
        assert lock.read_text().strip() == str(a.proc.pid)  # signals reach the node itself
        assert "FAULT INJECTION ACTIVE: wrong-tokens" in b.log_tail()  # its own env
        assert "FAULT INJECTION" not in a.log_tail()
        assert ask(a.addr, [("user", "Hi")], max_tokens=2, hop_budget=0).final.serving \
            == a.peer_id

        a.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(a.proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(a.proc.pid) == "T" and a.proc.poll() is None
        a.send_signal(signal.SIGCONT)
        assert a.terminate() == 0  # a clean stop, as with subprocess.Popen
        b.proc.kill()
        assert b.proc.wait(10) == -signal.SIGKILL


def test_refused_start_through_the_cli_matches_a_fresh_interpreter(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[node]\nlisten = 7\n")
    script = os.path.join(os.path.dirname(sys.executable), "prefixmesh")
    node = NodeProc(tmp_path, "X")
    node.args = [script, "node", "--config", str(bad)]
    try:
        node.launch()
        assert isinstance(node.proc, _forkserver.ForkedProc)
        forked_rc = node.proc.wait(60)
    finally:
        node.kill()
    fresh = subprocess.run(node.args, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert forked_rc == fresh.returncode != 0
    assert fresh.stderr.strip() and fresh.stderr.strip() in node.log_tail()


def test_forked_node_takes_the_callers_open_files_limit(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 4096) if soft != min(hard, 4096) else soft - 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        with Swarm(tmp_path) as s:
            a = s.add("A", backend="sim", digest=False)
            assert isinstance(a.proc, _forkserver.ForkedProc)
            with open(f"/proc/{a.proc.pid}/limits") as f:
                line = next(ln for ln in f if ln.startswith("Max open files"))
            assert line.split()[3] == str(wanted), line
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_run_captures_like_subprocess_run_in_the_callers_folder(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[node]\nlisten = 7\n")
    script = os.path.join(os.path.dirname(sys.executable), "prefixmesh")
    forked = _forkserver.run([script, "node", "--config", "bad.toml"], cwd=tmp_path,
                             timeout=60, stdin_devnull=True)
    fresh = subprocess.run([script, "node", "--config", "bad.toml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode != 0 and "listen" in fresh.stderr
    version = _forkserver.run([sys.executable, "-m", "prefixmesh", "--version"], timeout=60)
    assert version.returncode == 0 and version.stdout.strip()
