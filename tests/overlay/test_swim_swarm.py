"""SWIM membership (overlay/swim.py, the default; named explicitly, ``--membership swim``)
with real node processes on 127.0.0.1 (real libp2p, simulated engine: the faults are in the overlay, not the model):

- a third node learns a peer it was never told about (no digests, no DHT, no mDNS: only
  membership dissemination can teach it), and sees it up;
- a SIGSTOPped peer stops being up at the others and is up again after SIGCONT;
- a kill -9'd peer is declared down, and restarted (same key, new port) it rejoins with a
  higher incarnation.

Deadlines are generous (a loaded 2-core machine): they bound a hang, not the speed, which
docs/SCALING.md measures.
"""

from __future__ import annotations

import re
import signal

import pytest
from _swarm import Swarm, peers, wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # real node processes

SIM = dict(backend="sim", digest=False,  # no digests: their records would carry addresses
           extra=["--membership", "swim"])


def _view(observer, peer_id):
    """``observer``'s PEERS row for ``peer_id`` (None: unknown)."""
    return {p.peer: p for p in peers(observer.addr).peers}.get(peer_id)


def _up(observer, target) -> bool:
    row = _view(observer, target.peer_id)
    return row is not None and row.up


def _stats(node) -> dict[str, int]:
    return dict(peers(node.addr).stats)


@pytest.fixture()
def trio_mesh(tmp_path):
    """A, then B and C bootstrapped from A only."""
    with Swarm(tmp_path) as s:
        a = s.add("A", **SIM)
        s.add_many("BC", bootstrap=[a.addr], **SIM)
        yield s


def test_a_peer_never_named_to_a_node_is_learned_by_dissemination(trio_mesh):
    a, b, c = trio_mesh.nodes
    wait_until(lambda: _up(c, b) and _up(b, c), timeout_s=60, what="B and C to see each other")
    row = _view(c, b.peer_id)
    # C was told of A only (bootstrap); B's address reached it through membership
    assert "swim" in row.sources and "bootstrap" not in row.sources, row.sources
    # C probes B itself (its RTT comes from C's own PINGs' ACKs)
    wait_until(lambda: _view(c, b.peer_id).rtt_ms >= 0, timeout_s=30, what="C to probe B")
    st = _stats(c)
    assert st["swim_members"] == 2 and st["swim_sent"] > 0 and st["swim_bad_messages"] == 0
    assert st["heartbeat_pings_answered"] > 0  # answered B's and A's probes


def test_a_frozen_peer_is_not_up_until_it_thaws(trio_mesh):
    a, b, c = trio_mesh.nodes
    wait_until(lambda: all(_up(x, y) for x in (a, c) for y in (b,)), timeout_s=60,
               what="A and C to see B up")
    b.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: not _up(a, b) and not _up(c, b), timeout_s=45,
                   what="A and C to stop counting the frozen B as up")
        assert _up(a, c) and _up(c, a)  # the others stay up throughout
    finally:
        b.send_signal(signal.SIGCONT)
    wait_until(lambda: _up(a, b) and _up(c, b), timeout_s=90,
               what="A and C to see B up again after SIGCONT")


def test_a_killed_peer_is_declared_down_and_rejoins_with_a_higher_incarnation(trio_mesh):
    a, b, c = trio_mesh.nodes
    wait_until(lambda: _up(a, c) and _up(b, c), timeout_s=60, what="A and B to see C up")
    before = _stats(c)["swim_incarnation"]
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(10)
    wait_until(lambda: not _up(a, c) and not _up(b, c), timeout_s=45,
               what="A and B to declare the killed C down")
    c.restart()  # same key and config: a new process, a new port
    wait_until(lambda: _up(a, c) and _up(b, c), timeout_s=90,
               what="A and B to see the restarted C up")
    after = _stats(c)["swim_incarnation"]
    assert after > before
    short = c.peer_b58[-8:]
    # A holds C at a new incarnation (its log line when C came back up): the restart's own,
    # or a later one if C refuted a suspicion since (a loaded machine; Lifeguard), never
    # the one before the kill
    up_at = re.compile(rf"peer {re.escape(short)} is up \(incarnation (\d+), (?:alive|suspect)\)")

    def a_saw_c_up_anew() -> bool:
        return any(before < int(n) <= after for n in up_at.findall(a.log_tail(200_000)))

    wait_until(a_saw_c_up_anew, timeout_s=30, what="A's log to show C up at a new incarnation")
