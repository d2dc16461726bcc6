"""Circuit relay v2 (py-libp2p 0.8.1) in the NAT lab: a home reserves at a public relay
and a home behind another NAT reaches it through ``/p2p/RELAY/p2p-circuit/p2p/B``.

Real namespaces and real NAT (bench/natlab.py), plain py-libp2p hosts in child
processes driven by bench/nat_probe.py (Noise only, Yamux, as overlay/host.py). No model.
"""

from __future__ import annotations

import pytest

from prefixmesh.bench.nat_probe import Scenario, circuit
from prefixmesh.bench.natlab import lab_unavailable_reason

REASON = lab_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def lab():
    with Scenario(homes_nat=("eim", "eim", "symmetric"), public_hosts=1) as sc:
        relay = sc.public(0, "relay", hop=True, limits={"duration": 120,
                                                        "data": 4 * 1024 * 1024})
        yield sc, relay


@pytest.mark.parametrize("b_home", [1, 2], ids=["B_behind_eim", "B_behind_symmetric"])
def test_a_home_reaches_a_reserved_home_through_the_relay(lab, b_home):
    sc, relay = lab
    a = sc.home(0, f"A{b_home}", port=4200 + b_home)
    b = sc.home(b_home, f"B{b_home}")
    res = b.call("reserve", addr=relay.addr, timeout=15)
    assert res["ok"] and res["relay"] == relay.peer, res
    assert res["expire_in"] > 0

    # the home cannot be dialled directly: only the circuit gets there
    dial = a.call("dial_circuit", addr=circuit(relay, b), timeout=20)
    assert dial["ok"] and dial["registered"] and dial["kinds"] == ["relayed"], dial

    echo = a.call("echo", peer=b.peer, sizes=[1024, 100 * 1024], reps=5, timeout=30)
    assert echo["ok"] and echo["kinds"] == ["relayed"], echo

    # an inference-sized exchange: 4 KB up, 50 KB down in chunks, over ~2 s
    down = a.call("stream_down", peer=b.peer, up=4096, chunks=25, chunk=2048, gap=0.08,
                  timeout=30)
    assert down["ok"] and down["received"] == 51200 and down["err"] is None, down


def test_a_circuit_to_a_peer_without_reservation_is_refused(lab):
    sc, relay = lab
    a = sc.home(0, "A_norsv", port=4210)
    b = sc.home(1, "B_norsv", port=4211)
    dial = a.call("dial_circuit", addr=circuit(relay, b), timeout=25)
    assert not dial["ok"]
    assert "NO_RESERVATION" in dial["err"] or "204" in dial["err"], dial


def test_our_fixed_splice_keeps_other_circuits_and_tells_the_far_end(lab):
    """bench/nat_probe.py's FixedHop (docs/bench/nat.md): with the library's splice, the
    end of A1's circuit to B can close A2's healthy circuit to B, and B is never told that
    A1 is gone. Ours: A2 keeps its circuit and B drops its connection to A1."""
    import time

    sc, _ = lab
    relay = sc.public(0, "relay_fixed", port=4002, hop=True, fixed_hop=True)
    b = sc.home(1, "B_fixed", port=4230)
    a1, a2 = sc.home(0, "A1_fixed", port=4231), sc.home(0, "A2_fixed", port=4232)
    assert b.call("reserve", addr=relay.addr, timeout=15)["ok"]
    for a in (a1, a2):
        assert a.call("dial_circuit", addr=circuit(relay, b), timeout=20)["ok"]
    assert a2.call("echo", peer=b.peer, sizes=[1024], reps=3)["ok"]
    a1.kill()
    deadline = time.monotonic() + 5
    while b.call("kinds", peer=a1.peer)["kinds"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.call("kinds", peer=a1.peer)["kinds"] == []
    echo = a2.call("echo", peer=b.peer, sizes=[1024], reps=3, timeout=15)
    assert echo["ok"] and echo["kinds"] == ["relayed"], echo
