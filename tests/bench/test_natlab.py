"""bench/natlab.py: the lab's NAT behaves like home routers do (real namespaces, real NAT).

Plain sockets, no nodes: a home connects out and the public side sees its router's
address; the public side cannot connect in; an "eim" router keeps one mapping for every
destination, a "symmetric" one maps each destination to another port.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from prefixmesh.bench.natlab import NatLab, lab_unavailable_reason

REASON = lab_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# prints "host:port" of each peer that connects, then closes the connection
ECHO_PEER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print("ready", flush=True)
while True:
    c, (h, p) = s.accept(); c.sendall(f"{h}:{p}".encode()); c.close()
"""
# connects from a fixed local port to each destination and prints what the peer saw
DIAL_FROM_PORT = """
import socket, sys
src_port = int(sys.argv[1])
for dest in sys.argv[2:]:
    h, p = dest.rsplit(":", 1)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", src_port)); s.settimeout(5); s.connect((h, int(p)))
    print(s.recv(100).decode(), flush=True); s.close()
"""


@pytest.fixture(scope="module")
def lab():
    with NatLab(homes_nat=("eim", "symmetric"), public_hosts=2) as lab:
        yield lab


def _echo(lab, ip: str, port: int) -> subprocess.Popen:
    p = lab.popen(lab.public_ns, [sys.executable, "-c", ECHO_PEER, ip, str(port)],
                  stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture(scope="module")
def echoes(lab):
    procs = [_echo(lab, lab.public_ip(0), 7001), _echo(lab, lab.public_ip(1), 7002)]
    yield [f"{lab.public_ip(0)}:7001", f"{lab.public_ip(1)}:7002"]
    for p in procs:
        p.kill()
        p.wait()


def _seen_from(lab, home, src_port: int, dests) -> list[str]:
    r = lab.run(home.ns, [sys.executable, "-c", DIAL_FROM_PORT, str(src_port), *dests])
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_a_home_connects_out_and_is_seen_at_its_routers_address(lab, echoes):
    for home in lab.homes:
        seen = _seen_from(lab, home, 40000 + home.index, echoes[:1])
        assert seen[0].split(":")[0] == home.wan_ip != home.ip


def test_an_eim_router_keeps_one_mapping_for_every_destination(lab, echoes):
    [home] = [h for h in lab.homes if h.nat == "eim"]
    ports = {s.split(":")[1] for s in _seen_from(lab, home, 41000, echoes)}
    assert len(ports) == 1


def test_a_symmetric_router_maps_each_destination_to_another_port(lab, echoes):
    [home] = [h for h in lab.homes if h.nat == "symmetric"]
    # random ports can collide by chance (1 in ~28k); three tries make a flake negligible
    for _ in range(3):
        ports = {s.split(":")[1] for s in _seen_from(lab, home, 42000, echoes)}
        if len(ports) == 2:
            break
        time.sleep(0.2)
    assert len(ports) == 2


def test_the_public_side_cannot_connect_to_a_home(lab):
    home = lab.homes[0]
    server = lab.popen(home.ns, [sys.executable, "-c", ECHO_PEER, "0.0.0.0", "7100"],
                       stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        inside = lab.run(home.ns, [sys.executable, "-c", DIAL_FROM_PORT, "43000",
                                   f"{home.ip}:7100"])
        assert inside.returncode == 0  # the server is up
        for target in (home.wan_ip, home.ip):
            r = lab.run(lab.public_ns, [sys.executable, "-c", DIAL_FROM_PORT, "43001",
                                        f"{target}:7100"])
            assert r.returncode != 0, f"public side reached the home at {target}"
    finally:
        server.kill()
        server.wait()


def test_closing_the_lab_removes_every_namespace():
    with NatLab(homes_nat=("eim",), public_hosts=1, prefix="pmclosetest") as lab:
        made = list(lab._made)
        assert len(made) == 3
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in made)
