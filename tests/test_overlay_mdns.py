"""mDNS discovery between two real node processes on a virtual LAN: two network
namespaces joined by a veth pair, created (and removed) by the test. Needs root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _swarm import Swarm, wait_until  # noqa: E402

pytestmark = pytest.mark.slow


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture()
def lan():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("creating network namespaces needs root and iproute2")
    tag = uuid.uuid4().hex[:6]
    ns = (f"pm{tag}a", f"pm{tag}b")
    links = (f"pm{tag}0", f"pm{tag}1")
    try:
        _ip("netns", "add", ns[0])
        _ip("netns", "add", ns[1])
    except subprocess.CalledProcessError as exc:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr!r}")
    try:
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i in (0, 1):
            _ip("link", "set", links[i], "netns", ns[i])
            _ip("-n", ns[i], "addr", "add", f"10.231.{int(tag[:2], 16)}.{i + 1}/24", "dev", links[i])
            _ip("-n", ns[i], "link", "set", links[i], "up")
            _ip("-n", ns[i], "link", "set", "lo", "up")
        yield ns, [f"10.231.{int(tag[:2], 16)}.{i + 1}" for i in (0, 1)]
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _peers_in(ns: str, addr: str) -> dict:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "prefixmesh.node.client", "peers", addr],
        capture_output=True, text=True, timeout=60,
    )
    return json.loads(out.stdout or "{}")


def test_mdns_discovery_on_a_virtual_lan(lan, tmp_path):
    (ns_a, ns_b), (ip_a, ip_b) = lan
    with Swarm(tmp_path) as s:
        # no bootstrap, no digests, no DHT: mDNS is the only way to meet
        a = s.add("A", netns=ns_a, listen=f"/ip4/{ip_a}/tcp/0", mdns=True, digest=False)
        b = s.add("B", netns=ns_b, listen=f"/ip4/{ip_b}/tcp/0", mdns=True, digest=False)
        assert a.addr.startswith(f"/ip4/{ip_a}/tcp/")  # concrete address, real port

        def b_found_a():
            report = _peers_in(ns_b, b.addr)
            return [p for p in report.get("peers", []) if p["peer"] == a.peer_b58]

        found = wait_until(b_found_a, timeout_s=40, interval_s=1.0, what="B to discover A via mDNS")
        assert "mdns" in found[0]["sources"]
        assert any(addr.startswith(f"/ip4/{ip_a}/tcp/") for addr in found[0]["addrs"])
        assert "0.0.0.0" not in json.dumps(found)
        wait_until(lambda: b_found_a()[0]["up"], timeout_s=20, what="B to connect to A")
