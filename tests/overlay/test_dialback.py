"""``/prefixmesh/dialback/1`` between real OverlayHosts (py-libp2p, Noise) in one process.

Three hosts on three loopback addresses (127.0.0.1-3: distinct IPs, so each counts as its
own answerer). What is checked is behaviour, not timing:

* an answerer dials back a claimed address at the IP it sees the asker at, on a fresh
  connection (Noise checks the peer id), and reports the port it saw: on loopback that is
  our own end of the connection, so the NAT kind is ``port-preserving``;
* a claim at another IP is refused without dialing (no amplification);
* a second request from the same peer within a minute is refused;
* a dial-back to an address where a *different* peer listens fails (peer id checked);
* loopback is a LAN address: dialled back at it, the verdict is ``private``, never
  ``public`` (a neighbour reaching us says nothing about the internet).
"""

from __future__ import annotations

import socket

import trio

from prefixmesh.overlay.core import reachability as rb
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.dialback import DialbackServer, ReachabilityService, local_port
from prefixmesh.overlay.host import FramedStream, HostError, OverlayHost


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _host(ip: str) -> OverlayHost:
    return OverlayHost(Identity.generate(), [f"/ip4/{ip}/tcp/{_free_port(ip)}"])


async def _ask_raw(asker: OverlayHost, peer: bytes, claims: list[str]) -> rb.DialbackAnswer | None:
    try:  # a refused request is reset: the stream may fail as early as its negotiation
        stream = await asker.open_stream(peer, rb.PROTOCOL)
        fs = FramedStream(stream, timeout_s=10.0)
        await fs.send_raw(rb.encode_request(rb.DialbackRequest(tuple(claims))))
        return rb.decode_answer(await fs.receive_raw(max_bytes=rb.MAX_MESSAGE_BYTES))
    except (HostError, rb.DialbackError):
        return None


def test_dialback_between_real_hosts():
    async def main() -> None:
        a, b, c = _host("127.0.0.1"), _host("127.0.0.2"), _host("127.0.0.3")
        impostor = _host("127.0.0.1")
        async with a.run(), b.run(), c.run(), impostor.run():
            for h in (a, b, c):
                # as for connections older than the grace period (every real one): a second
                # connection to a peer makes py-libp2p trim one (max_connections_per_peer=1)
                h.libp2p.get_network().connection_config.grace_period = 0.0
            servers = {h.peer_id: DialbackServer(h) for h in (b, c)}
            for h in (b, c):
                h.set_handler(rb.PROTOCOL, servers[h.peer_id].handle)
            for h in (b, c):
                await a.connect(h.peer_id, h.listen_addrs())
            svc = ReachabilityService(a, peers=lambda: [b.peer_id, c.peer_id],
                                      claimed_addrs=a.listen_addrs)
            changes = []
            svc.on_change.append(lambda old, new: changes.append((old.kind, new.kind)))
            with trio.fail_after(60):
                r = await svc.check_once()
            assert r.kind == "private" and "LAN" in r.why, r
            assert r.nat == "port-preserving", r
            assert r.seen_ip == "127.0.0.1"
            assert changes == [("unknown", "private")]
            assert all(s.answered == 1 and s.dials_ok == 1 for s in servers.values())

            # asked again within a minute: refused, no answer
            with trio.fail_after(30):
                assert await _ask_raw(a, b.peer_id, a.listen_addrs()) is None
            assert servers[b.peer_id].refused == 1

            # c answers once more after we forget the rate limit: other IP refused,
            # the impostor's address fails the Noise peer-id check
            servers[c.peer_id]._asked_at.clear()
            other_ip = f"/ip4/127.0.0.9/tcp/{_free_port('127.0.0.1')}"
            with trio.fail_after(30):
                ans = await _ask_raw(a, c.peer_id, [other_ip, impostor.listen_addrs()[0]])
            assert ans is not None
            by = {x.addr: x for x in ans.results}
            assert not by[other_ip].ok and "seen at" in by[other_ip].why
            assert not by[impostor.listen_addrs()[0]].ok
            assert servers[c.peer_id].dials_failed == 1

            stream = await a.open_stream(b.peer_id, "/ipfs/id/1.0.0")
            assert local_port(stream) is not None
            await stream.reset()

    trio.run(main)


def test_status_metrics_and_screen_show_the_reachability_line():
    """The one report (overlay/dialback.reachability_report) feeds ``/metrics``, the
    overview JSON and ``prefixmesh status``'s screen; the relay keeper and the hole
    puncher are read where the node has them."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from prefixmesh.node.metrics import NodeMetrics
    from prefixmesh.node.status import overview, render_text
    from prefixmesh.overlay.dialback import reachability_report
    from prefixmesh.overlay.holepunch import HolePunchService, should_punch

    me = Identity.generate()
    host = OverlayHost(me, ["/ip4/127.0.0.1/tcp/0"])
    svc = ReachabilityService(host, peers=list, claimed_addrs=host.transport_addrs)
    node = SimpleNamespace(identity=me, model_fp=b"", reachability=svc,
                           dialback=DialbackServer(host))
    assert reachability_report(node)["line"] == "unknown: not checked yet"

    svc.reachability = rb.Reachability("private", "symmetric", "2 of 2 peers could not")
    assert reachability_report(node)["line"] == (
        "private, not reachable: no relay reservation (relay client not running)")
    node.keeper = SimpleNamespace(reserved_relays=lambda: [], tried=lambda: ["R1", "R2"],
                                  last_failure=None)
    assert reachability_report(node)["line"] == (
        "private, not reachable: no relay accepted a reservation (tried R1, R2)")
    node.keeper = SimpleNamespace(reserved_relays=lambda: ["R2"], tried=lambda: ["R1", "R2"],
                                  last_failure="R1: NO_RESERVATION")
    rep = reachability_report(node)
    assert rep["line"] == "private (reachable via relay R2)" and rep["nat"] == "symmetric"

    node.holepunch = HolePunchService(host, svc, enabled=True)
    assert not should_punch(True, svc.reachability)
    assert should_punch(True, rb.Reachability("private", "port-preserving", ""))
    assert not should_punch(False, rb.Reachability("private", "port-preserving", ""))
    assert not should_punch(True, rb.Reachability("public", "port-preserving", ""))

    text = NodeMetrics(node).exposition().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    key = ("prefixmesh:reachability", (("kind", "private"), ("nat", "symmetric"),
                                       ("status", "private (reachable via relay R2)")))
    assert samples[key] == 1
    assert samples[("prefixmesh:relay_reservations", ())] == 1
    assert samples[("prefixmesh:hole_punch_attempts_total", (("result", "success"),))] == 0
    assert samples[("prefixmesh:dialback_requests_total", (("result", "answered"),))] == 0

    ov = overview(node)
    assert ov["node"]["reachability"]["line"] == "private (reachable via relay R2)"
    assert "reachability: private (reachable via relay R2)  (NAT symmetric)" in render_text(ov)


def test_answers_are_bounded_per_peer_and_in_all():
    """One request per peer per minute, and at most MAX_ANSWERS_PER_MINUTE over all
    peers (many identities do not make a node a dialing service)."""
    from prefixmesh.overlay.dialback import MAX_ANSWERS_PER_MINUTE

    now = [0.0]
    server = DialbackServer(None, clock=lambda: now[0])  # admission needs no host
    assert server._admit(b"peer-a") and not server._admit(b"peer-a")
    for i in range(MAX_ANSWERS_PER_MINUTE - 1):
        assert server._admit(f"peer-{i}".encode())
    assert not server._admit(b"one-more")
    now[0] = rb.ANSWER_INTERVAL_S
    assert server._admit(b"one-more") and server._admit(b"peer-a")
