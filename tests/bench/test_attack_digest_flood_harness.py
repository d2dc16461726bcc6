"""bench/attack_digest_flood.py, the benchmark's harness without the attack run itself
(40 honest requests, two floods and a counting window: ~25 s even with ``--window 0``; the
attack on a real node is tests/swarm/test_attack_digest_flood.py): the node it starts (a
fresh folder with the node's log, the simulated engine, answering an honest request, ~2 s)
and its command line. (The ``_harness`` suffix: the swarm test already has the basename
test_attack_digest_flood.py.)"""

from __future__ import annotations

import shutil
import sys

import pytest
import trio

from prefixmesh.bench import attack_digest_flood
from prefixmesh.bench.attack_nodes import honest_request


def test_start_node_gives_a_node_in_its_own_folder():
    proc, addr, root = attack_digest_flood.start_node(None)
    try:
        assert root.name.startswith("attack-") and (root / "node.log").is_file()
        assert addr.startswith("/ip4/127.0.0.1/tcp/")
        latency = trio.run(honest_request, addr)
        assert isinstance(latency, float) and latency > 0, latency
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)  # the benchmark keeps it for its log


def test_command_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attack_digest_flood.py", "--help"])
    with pytest.raises(SystemExit) as info:
        attack_digest_flood.main()
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--pythonpath" in out and "--window" in out
    monkeypatch.setattr(sys, "argv", ["attack_digest_flood.py", "--window", "soon"])
    with pytest.raises(SystemExit) as info:
        attack_digest_flood.main()
    assert info.value.code == 2 and "--window" in capsys.readouterr().err
