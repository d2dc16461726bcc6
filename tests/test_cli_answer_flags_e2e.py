"""``prefixmesh ask --max-tokens`` and ``--timeout`` as a user runs them: a real node
process (real libp2p, the real default model) and real ``prefixmesh ask`` processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _forkserver
import pytest
from _swarm import Swarm  # noqa: E402

pytestmark = pytest.mark.slow  # real node processes and the real model

_SCRIPT = Path(sys.executable).parent / "prefixmesh"
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "prefixmesh"]
ASK_BOUND_S = 120.0  # detects a hang only


def _ask(*args: str) -> subprocess.CompletedProcess[str]:
    # forked from the pre-imported fork server where it can be (saves ~1.5 s of imports)
    return _forkserver.run([*CLI, "ask", *args], timeout=ASK_BOUND_S, stdin_devnull=True)


def test_max_tokens_and_timeout(tmp_path):
    with Swarm(tmp_path) as swarm:
        node = swarm.add("a", n_ctx=1024)
        proc = _ask("--peer", node.addr, "--json", "--max-tokens", "3", "Tell me a story.")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["stats"]["completion_tokens"] == 3

        # ~900 tokens take several seconds on this model and CPU: 1 s cannot be enough
        proc = _ask("--peer", node.addr, "--timeout", "1", "--max-tokens", "900",
                    "Count from one to five hundred, in words.")
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1 and "no complete answer within" in err[0], proc.stderr
        assert "--timeout" in err[0], proc.stderr
        assert node.proc.poll() is None  # the node keeps running
