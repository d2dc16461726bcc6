"""The examples in examples/ run, so they never rot.

- ``three_node_swarm.sh --fast --chat``: three real nodes (default model) on 127.0.0.1,
  three questions through three entry nodes, a chat on a terminal, everything stopped at
  exit, also on SIGTERM;
- ``client_api.py`` against a real node;
- ``volunteer-node.toml`` and ``tenants.toml`` load through ``load_config``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _pty import Terminal  # noqa: E402
from _swarm import Swarm  # noqa: E402

from prefixmesh.node.config import load_config  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_SCRIPT = Path(sys.executable).parent / "prefixmesh"
PREFIXMESH = str(_SCRIPT) if _SCRIPT.exists() else None
SCRIPT_TIMEOUT_S = 300


def _script_env() -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable)
    if PREFIXMESH:
        env["PREFIXMESH"] = PREFIXMESH
    return env


def _pids(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"^node\d pid (\d+) ", output, re.M)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too: the script's shell reaps its children, so this is rare
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _work_dir(output: str) -> Path:
    m = re.search(r"work folder (\S+)\)", output)
    assert m, output
    return Path(m.group(1))


# --- the shell example ----------------------------------------------------------------


def _check_three_questions(out: str) -> list[int]:
    """The script's run up to its chat: three nodes that see each other, three questions
    through three entry nodes, the later ones reusing the shared system prompt's cache.
    Returns the nodes' pids."""
    pids = _pids(out)
    assert len(pids) == 3, out
    assert "all three nodes see each other" in out
    rows = re.findall(r"^(node\d)\s+(node\d)\s+(\d+)\s+(\d+)/(\d+)\s+([\d.]+) s", out, re.M)
    assert [r[0] for r in rows] == ["node1", "node2", "node3"], out
    for entry, served, hops, cached, prompt, _ttft in rows:
        assert (int(hops) == 0) == (served == entry), out
        assert 0 <= int(cached) <= int(prompt)
    assert int(rows[0][3]) == 0, out  # nobody holds the system prompt yet
    # the point of the example: later questions reuse the shared system prompt's cache
    assert all(int(r[3]) > 0 for r in rows[1:]), out
    return pids


@pytest.mark.slow
def test_three_node_swarm_script_stops_its_nodes_when_interrupted():
    proc = subprocess.Popen([str(EXAMPLES / "three_node_swarm.sh"), "--fast"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_script_env(), stdin=subprocess.DEVNULL)
    out = ""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + SCRIPT_TIMEOUT_S
        while "node3 pid" not in out and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out += line
        pids = _pids(out)
        assert len(pids) == 3, out
        proc.send_signal(signal.SIGTERM)  # mid start-up: nodes are loading or ready
        rest, err = proc.communicate(timeout=60)
        out += rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, (proc.returncode, out, err)
    assert "swarm stopped" in out
    assert not any(_alive(p) for p in pids), pids
    work = _work_dir(out)
    assert "kept in" in err and work.exists()  # kept for its logs when a run is cut short
    shutil.rmtree(work)


@pytest.mark.slow
def test_three_node_swarm_script_fast_then_chat_on_a_terminal():
    """``--fast --chat``: the whole ``--fast`` run (three questions), then the chat on a
    terminal; one run of the script checks both (each starts three real nodes)."""
    term = Terminal([str(EXAMPLES / "three_node_swarm.sh"), "--fast", "--chat"],
                    _script_env(), wait_s=120.0, exit_s=60.0)
    try:
        at = term.wait_for(b"chatting through node2", 0, SCRIPT_TIMEOUT_S)
        at = term.wait_for(b"> ", at, 60)
        term.write(b"Hello, who are you?\n")
        at = term.wait_for(b"served by", at)
        at = term.wait_for(b"> ", at)
        # Ctrl-C at the chat prompt is the chat's: it asks for confirmation, and the nodes
        # (in their own sessions) do not see it
        term.write(b"\x03")
        at = term.wait_for(b"Ctrl-C again", at, 30)
        term.write(b"What do you do?\n")
        at = term.wait_for(b"served by", at)
        at = term.wait_for(b"> ", at)
        term.write(b"\x04")  # Ctrl-D: leave the chat; the script stops the swarm
        code = term.exit_code()
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)
        os.close(term.fd)
    text = term.out.decode(errors="replace").replace("\r\n", "\n")
    assert code == 0, text[-3000:]
    pids = _check_three_questions(text)
    # clean shutdown: every node gone, the temporary folder removed
    assert text.rstrip().endswith("swarm stopped"), text[-3000:]
    assert not any(_alive(p) for p in pids), pids
    assert not _work_dir(text).exists()


def test_three_node_swarm_script_rejects_unknown_arguments():
    proc = subprocess.run([str(EXAMPLES / "three_node_swarm.sh"), "--colour"],
                          capture_output=True, text=True, timeout=30, env=_script_env())
    assert proc.returncode == 2
    assert proc.stderr.strip() == "three_node_swarm.sh: unknown argument --colour (see --help)"
    proc = subprocess.run([str(EXAMPLES / "three_node_swarm.sh"), "--help"],
                          capture_output=True, text=True, timeout=30, env=_script_env())
    assert proc.returncode == 0 and "--fast" in proc.stdout and "--chat" in proc.stdout


# --- the Python client example --------------------------------------------------------


@pytest.mark.slow
def test_client_api_example_streams_and_prints_route_and_stats(tmp_path):
    with Swarm(tmp_path) as swarm:
        node = swarm.add("solo")
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / "client_api.py"), "--peer", node.addr,
             "--max-tokens", "8", "--system", "Answer in one short sentence.",
             "What is a library card?"],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    short = f"{node.peer_b58[:8]}…{node.peer_b58[-6:]}"
    assert out.startswith(f"connected to {short}, which knows 0 peer(s)\n\n")
    answer = out.split("\n\n", 1)[1].split("\n\nroute:", 1)[0]
    assert answer.strip(), out
    assert re.search(rf"^  1\. {re.escape(short)} serve: prefixmesh: serve", out, re.M), out
    assert f"served by     {short}" in out
    m = re.search(r"prompt tokens (\d+) \((\d+) from a KV cache\)", out)
    assert m and int(m.group(1)) > 0, out
    assert "answer tokens 8 (finish: length)" in out


def test_client_api_example_unreachable_node_is_one_line():
    peer = "12D3KooWPS715mMuyrmCNYeTeJczmSQWkdgDfW5bYDoDYxeU6zWg"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "client_api.py"), "--peer",
         f"/ip4/127.0.0.1/tcp/1/p2p/{peer}", "hi"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach"), proc.stderr


# --- the config examples --------------------------------------------------------------


def test_volunteer_node_toml_loads():
    cfg = load_config(EXAMPLES / "volunteer-node.toml")
    assert cfg.source == EXAMPLES / "volunteer-node.toml"
    assert cfg.node.listen == "/ip4/0.0.0.0/tcp/4001"
    assert cfg.node.advertise == ["/ip4/203.0.113.10/tcp/4001"]
    assert len(cfg.node.bootstrap) == 1 and cfg.node.mdns is True
    # relative paths are relative to the file's folder
    assert cfg.node.key_file.resolve() == EXAMPLES.parent / "keys" / "node.key"
    assert cfg.node.cache_dir.resolve() == EXAMPLES.parent / "var" / "kv"
    assert cfg.node.ram_budget == 2 * 2**30 and cfg.node.disk_budget == 20 * 2**30
    assert cfg.model.path is None and cfg.model.n_ctx == 4096
    assert cfg.digest.byte_budget == 64 * 1024
    assert cfg.routing.policy == "prefixmesh" and cfg.routing.hop_budget == 2
    assert cfg.routing.routing_config().margin_frac == 0.1
    assert cfg.http.listen == ""
    assert [t.name for t in cfg.tenant_specs()] == ["public"]  # no tenants: the default


def test_tenants_toml_loads_once_its_secret_file_exists(tmp_path):
    from prefixmesh.node.config import ConfigError

    # as shipped, the private tenant's secret file does not exist: a precise error
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLES / "tenants.toml")
    assert "[tenants.acme].secret_file" in str(err.value)
    assert "not found" in str(err.value)
    # following the file's own instructions makes it load
    copy = tmp_path / "tenants.toml"
    shutil.copy(EXAMPLES / "tenants.toml", copy)
    (tmp_path / "secrets").mkdir()
    secret = tmp_path / "secrets" / "acme.secret"
    secret.write_text("k3P9v0yTq1uQ8m2ZxN4wR7sLhC6bJdEa\n")
    secret.chmod(0o600)
    cfg = load_config(copy)
    acme = cfg.tenant("acme")
    assert acme is not None and acme.visibility == "private"
    assert acme.secret_source == "file" and acme.secret_file == secret
    assert len(acme.allowed_peers) == 1
    shared = cfg.tenant("system-prompts")
    assert shared is not None and shared.visibility == "public"
    assert cfg.client.tenant == "acme"
    assert cfg.tenant("public") is None  # declaring tenants replaces the default one
    # a secret file that others may read is refused, like a key file
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="acme"):
        load_config(copy)


def test_examples_readme_mentions_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    for path in sorted(EXAMPLES.iterdir()):
        if path.name != "README.md" and not path.name.startswith("."):
            assert path.name in readme, path.name
    # and the script's flags are documented where users look
    assert "--fast" in readme and "--chat" in readme
