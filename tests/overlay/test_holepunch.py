"""overlay/holepunch.py in one process, on a real OverlayHost over loopback: when DCUtR is
worth running (every verdict), the service starting and stopping the library's protocol
as the dial-back verdict changes (the verdicts are set here; how they are reached is
tests/overlay/test_dialback.py), and the rule that only the lower peer id leads a punch.
The punch itself needs two NATs: tests/nat/test_reachability_lab.py (root, NAT lab)."""

from __future__ import annotations

import itertools

import trio
from libp2p.peer.id import ID

from prefixmesh.overlay.core import reachability as rb
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.dialback import ReachabilityService
from prefixmesh.overlay.holepunch import (
    DIAL_TIMEOUT_S,
    HolePunchService,
    counting_dcutr_class,
    should_punch,
)
from prefixmesh.overlay.host import OverlayHost

PUNCHABLE = rb.Reachability("private", "port-preserving", "2 of 2 peers saw our port")


def test_should_punch_only_when_enabled_private_and_port_preserving():
    for enabled, kind, nat in itertools.product((True, False), rb.KINDS, rb.NAT_KINDS):
        want = enabled and kind == "private" and nat == "port-preserving"
        assert should_punch(enabled, rb.Reachability(kind, nat, "")) == want, (enabled, kind, nat)


def _host() -> OverlayHost:
    return OverlayHost(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"])


def _service(host: OverlayHost, *, enabled: bool) -> tuple[ReachabilityService, HolePunchService]:
    svc = ReachabilityService(host, peers=list, claimed_addrs=host.transport_addrs)
    return svc, HolePunchService(host, svc, enabled=enabled)


def test_dcutr_runs_while_the_verdict_allows_it_and_stops_when_it_changes():
    async def main():
        host = _host()
        async with host.run():
            svc, hp = _service(host, enabled=True)
            async with trio.open_nursery() as nursery:
                await nursery.start(hp.run)
                await trio.sleep(0.05)
                assert not hp.running  # unknown verdict: nothing to punch
                svc._set(PUNCHABLE)
                with trio.fail_after(5):
                    while not hp.running:
                        await trio.sleep(0.01)
                assert hp._dcutr is not None and hp._dcutr.dial_timeout == DIAL_TIMEOUT_S
                assert hp.counts() == {"attempts": 0, "successes": 0, "direct_peers": 0,
                                       "running": 1}
                # behind a symmetric NAT every punch fails: the protocol is stopped
                svc._set(rb.Reachability("private", "symmetric", "ports differ"))
                with trio.fail_after(5):
                    while hp.running:
                        await trio.sleep(0.01)
                assert hp._dcutr is None and hp.counts()["running"] == 0
                svc._set(PUNCHABLE)  # and started again when the NAT allows it
                with trio.fail_after(5):
                    while not hp.running:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_disabled_service_returns_at_once_and_never_runs():
    async def main():
        host = _host()
        svc, hp = _service(host, enabled=False)
        with trio.fail_after(5):
            await hp.run()  # returns: [nat] hole_punching = false
        svc._set(PUNCHABLE)
        assert not hp.running and hp.counts()["running"] == 0

    trio.run(main)


def test_only_the_lower_peer_id_leads_a_punch():
    async def main():
        a, b = _host(), _host()
        low, high = sorted((a, b), key=lambda h: h.peer_id)
        async with a.run(), b.run():
            _, hp = _service(high, enabled=True)
            dcutr = counting_dcutr_class()(high.libp2p, hp)
            # the higher id answers the lower one's session instead of starting its own:
            # no attempt, no dial
            with trio.fail_after(5):
                assert await dcutr.initiate_hole_punch(ID(low.peer_id)) is False
            assert (hp.attempts, hp.successes, hp.punched) == (0, 0, set())

    trio.run(main)
