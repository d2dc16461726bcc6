"""bench/node_entry.py: a benchmark's node process may run a baseline policy, which the
node's own config refuses."""

from __future__ import annotations

import random

from prefixmesh.bench import node_entry
from prefixmesh.bench.policies import PaperPolicy
from prefixmesh.node import daemon
from prefixmesh.overlay.core.routing import RoutingConfig


def test_a_baseline_policy_reaches_the_daemon_through_the_bench_entry(monkeypatch):
    seen = {}
    monkeypatch.setattr(daemon, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    monkeypatch.setattr(daemon, "make_policy", daemon.make_policy)  # undone after the test
    assert node_entry.main(["--listen", "/ip4/127.0.0.1/tcp/0", "--policy", "paper"]) == 0
    # the flag is taken out (the config would refuse it) and the factory builds the baseline
    assert seen["argv"] == ["--listen", "/ip4/127.0.0.1/tcp/0"]
    policy = daemon.make_policy("prefixmesh", RoutingConfig(), random.Random(0), b"me")
    assert isinstance(policy, PaperPolicy)


def test_an_unknown_policy_is_refused(capsys):
    assert node_entry.main(["--policy", "no-such"]) == 2
    assert "--policy needs one of" in capsys.readouterr().err
