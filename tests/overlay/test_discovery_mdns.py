"""mDNS discovery between two real node processes on a virtual LAN: two network
namespaces joined by a veth pair, created (and removed) by the test. Needs root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
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


# Polls a node's peers report (what ``python -m prefixmesh.node.client peers ADDR`` prints)
# from inside a namespace until it lists PEER, then until it lists PEER up; prints the entry
# each time (one JSON line each). One interpreter for all the polls: an interpreter start in
# a namespace (no fork server there) costs ~2 s of imports, as much as mDNS discovery itself.
_WATCH_FOR_PEER = """
import json, sys, time
import trio
from prefixmesh.node.client import Client
addr, peer = sys.argv[1], sys.argv[2]

async def report():
    async with Client.connect(addr) as client:
        return await client.peers_report()

def entry():
    try:
        rep = trio.run(report)
    except Exception:  # not answering yet: poll again (the caller's timeout bounds it)
        return None
    return next((p for p in rep.get("peers", []) if p["peer"] == peer), None)

for want_up in (False, True):
    while (found := entry()) is None or (want_up and not found["up"]):
        time.sleep(0.5)
    print(json.dumps(found), flush=True)
"""


def _watch_in(ns: str, addr: str, peer_b58: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _WATCH_FOR_PEER, addr, peer_b58],
        stdout=subprocess.PIPE, text=True)


def _next_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The watcher's next line within ``timeout_s``; the watcher is killed on a timeout."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0]:
        proc.kill()
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
    return lines[0]


def test_mdns_discovery_on_a_virtual_lan(lan, tmp_path):
    (ns_a, ns_b), (ip_a, ip_b) = lan
    with Swarm(tmp_path) as s:
        # no bootstrap, no digests, no DHT: mDNS is the only way to meet
        a = s.add("A", netns=ns_a, listen=f"/ip4/{ip_a}/tcp/0", mdns=True, digest=False)
        b = s.add("B", netns=ns_b, listen=f"/ip4/{ip_b}/tcp/0", mdns=True, digest=False)
        assert a.addr.startswith(f"/ip4/{ip_a}/tcp/")  # concrete address, real port

        watcher = _watch_in(ns_b, b.addr, a.peer_b58)
        try:
            found = json.loads(_next_line(watcher, 40, "B to discover A"))
            assert any(addr.startswith(f"/ip4/{ip_a}/tcp/") for addr in found["addrs"])
            assert "0.0.0.0" not in json.dumps(found)
            if "mdns" not in found["sources"]:
                # A's browser saw B first (each browser's queries back off: 1, 2, 4 ... s)
                # and dialled it; B listed A from that connection. A must have mDNS then.
                _assert_learned_over_mdns(ns_a, a.addr, b.peer_b58)
            assert json.loads(_next_line(watcher, 20, "B to connect to A"))["up"]
        finally:
            watcher.kill()
            watcher.wait()


def _assert_learned_over_mdns(ns: str, addr: str, peer_b58: str) -> None:
    watcher = _watch_in(ns, addr, peer_b58)
    try:
        found = json.loads(_next_line(watcher, 40, "the other node to list its peer"))
        assert "mdns" in found["sources"], found
    finally:
        watcher.kill()
        watcher.wait()


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
