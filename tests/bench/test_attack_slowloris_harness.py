"""bench/attack_slowloris.py, the benchmark's harness without its minute-long attack (the
attack on real nodes is tests/swarm/test_attack_slowloris.py; the figures are in
docs/SECURITY.md D20): the attacker's command line, the node's CPU seconds from /proc, and
the honest request and connection probe it times, against one real node (simulated
engine, ~2 s) and against an address where nothing listens. (The ``_harness`` suffix: the
swarm test already has the basename test_attack_slowloris.py.)"""

from __future__ import annotations

import argparse
import math
import os
import socket

import trio

from prefixmesh.bench import attack_slowloris
from prefixmesh.bench.attack_nodes import spawn_node


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    attack_slowloris.add_arguments(ap)
    return ap.parse_args(argv)


def test_defaults_and_the_attacker_command_line():
    a = _args()
    assert (a.duration, a.flood_identities, a.identities, a.streams, a.settle, a.nice) == \
        (60.0, 5, 2, 4, 10.0, 10)
    cmd = attack_slowloris._attacker_cmd("/ip4/127.0.0.1/tcp/1/p2p/X",
                                         _args("--duration", "7", "--streams", "3"))
    assert cmd[1].endswith("bench/attack_slowloris.py")
    assert cmd[2:4] == ["--attacker", "/ip4/127.0.0.1/tcp/1/p2p/X"]
    assert cmd[cmd.index("--duration") + 1] == "7.0" and cmd[cmd.index("--streams") + 1] == "3"
    assert _args(*cmd[2:]).attacker == "/ip4/127.0.0.1/tcp/1/p2p/X"  # it parses back


def test_cpu_seconds_of_a_live_and_of_a_gone_process():
    sum(i * i for i in range(200_000))  # burn a little CPU
    assert attack_slowloris._cpu_s(os.getpid()) > 0
    assert math.isnan(attack_slowloris._cpu_s(2**22 + 1))


def test_honest_request_and_probe_against_a_node_and_against_nothing(tmp_path):
    proc, addr = spawn_node(tmp_path / "node")
    try:
        assert trio.run(attack_slowloris._probe, addr) is True
        latency = trio.run(attack_slowloris._honest, addr)
        assert isinstance(latency, float) and latency > 0, latency
    finally:
        proc.kill()
        proc.wait()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = addr.replace(addr.split("/")[4], str(port))
    assert trio.run(attack_slowloris._probe, dead) is False
    failed = trio.run(lambda: attack_slowloris._honest(dead, timeout_s=5.0))
    assert isinstance(failed, str) and failed
