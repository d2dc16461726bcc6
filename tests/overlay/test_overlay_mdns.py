"""mDNS discovery between two real node processes on a virtual LAN: two network
namespaces joined by a veth pair, created (and removed) by the test. Needs root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
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


def test_cli_client_without_peer_finds_a_node_over_mdns(lan, tmp_path):
    """`prefixmesh peers` with no --peer and no local node reaches the network via mDNS."""
    (ns_a, ns_b), (ip_a, _ip_b) = lan
    empty = tmp_path / "client-cache"
    empty.mkdir()
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[node]\ncache_dir = "{empty}"\n')
    with Swarm(tmp_path) as s:
        a = s.add("A", netns=ns_a, listen=f"/ip4/{ip_a}/tcp/0", mdns=True, digest=False)

        def ask_peers():
            out = subprocess.run(
                ["ip", "netns", "exec", ns_b, sys.executable, "-m", "prefixmesh", "peers",
                 "--json", "--config", str(cfg)],
                capture_output=True, text=True, timeout=60,
            )
            return json.loads(out.stdout) if out.returncode == 0 else None

        report = wait_until(ask_peers, timeout_s=40, interval_s=1.0,
                            what="the client to find A over mDNS")
        assert report["self"] == a.peer_b58  # A's own node answered the query
        assert any(addr.startswith(f"/ip4/{ip_a}/tcp/") for addr in report["addrs"])


def test_cli_client_without_peer_or_lan_node_fails_with_one_clear_line(tmp_path):
    """Nothing to reach: one line naming all three ways to find a node, non-zero exit."""
    empty = tmp_path / "client-cache"
    empty.mkdir()
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[node]\ncache_dir = "{empty}"\n')
    if os.geteuid() == 0 and shutil.which("ip"):
        # an empty namespace of our own: no node can answer there, whatever runs here
        ns = f"pm{uuid.uuid4().hex[:6]}x"
        _ip("netns", "add", ns)
        try:
            _ip("-n", ns, "link", "set", "lo", "up")
            out = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "prefixmesh", "peers",
                 "--json", "--config", str(cfg)],
                capture_output=True, text=True, timeout=60,
            )
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    else:
        pytest.skip("needs root and iproute2 to isolate the client from this host's LAN")
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "mDNS" in lines[0] and "--peer" in lines[0], out.stderr
