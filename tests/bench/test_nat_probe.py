"""bench/nat_probe.py without the NAT lab (the lab needs root and nftables, and each probe
takes tens of seconds: tests/bench/test_nat_relay.py and tests/nat/ run the lab itself).

Checked here: the driven child host and its line protocol, two children started through
the parent's ``Node`` on 127.0.0.1 (the lab's only part in that is ``popen`` inside a
namespace; a stand-in runs the same command line outside one): ``ready`` with the peer
and address, ``info``, ``connect``, ``echo`` (payloads must come back identical) and an
action's error reported as a line, not a crash (~3 s); the circuit address; and the
command line, including the refusal when the lab is unavailable."""

from __future__ import annotations

import socket
import subprocess
from types import SimpleNamespace

import pytest

from prefixmesh.bench import nat_probe, natlab
from prefixmesh.overlay.core.identity import Identity


class NoNamespaces:
    """The lab's ``popen`` without ``ip netns exec``: the command line as given."""

    def popen(self, ns, argv, **kw):
        return subprocess.Popen(argv, **kw)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_driven_hosts_connect_echo_and_report_errors(tmp_path):
    lab = NoNamespaces()
    a = nat_probe.Node(lab, "-", "a", str(tmp_path), ip="127.0.0.1", port=_port())
    b = None
    try:
        b = nat_probe.Node(lab, "-", "b", str(tmp_path), ip="127.0.0.1", port=_port())
        assert a.addr.endswith(f"/p2p/{a.peer}") and a.peer != b.peer
        info = a.call("info")
        assert info["ok"] and info["peer"] == a.peer and info["current_relay"] is None
        assert b.call("connect", addr=a.addr)["ok"]
        echo = b.call("echo", peer=a.peer, sizes=[16, 4096], reps=2)
        assert echo["ok"], echo
        assert set(echo["ms"]) == {"16", "4096"} and all(v > 0 for v in echo["ms"].values())
        nobody = Identity.generate().peer_id_b58
        bad = b.call("connect", timeout=5, addr=f"/ip4/127.0.0.1/tcp/{_port()}/p2p/{nobody}")
        assert bad["ok"] is False and bad["err"]  # nobody listens there: a reported error
        assert b.call("info")["ok"]  # and the child still answers
    finally:
        a.kill()
        if b is not None:
            b.kill()


def test_circuit_address():
    relay = SimpleNamespace(addr="/ip4/10.0.0.1/tcp/4001/p2p/R", peer="R")
    dest = SimpleNamespace(addr="/ip4/10.0.1.2/tcp/4001/p2p/D", peer="D")
    assert nat_probe.circuit(relay, dest) == "/ip4/10.0.0.1/tcp/4001/p2p/R/p2p-circuit/p2p/D"


def test_command_line(monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        nat_probe.main(["teleport"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    # where the lab cannot be built, the probe says why and exits 2 (before any namespace)
    monkeypatch.setattr(natlab, "lab_unavailable_reason", lambda: "needs root")
    assert nat_probe.main(["relay"]) == 2
    assert capsys.readouterr().err.strip() == "NAT lab unavailable: needs root"
