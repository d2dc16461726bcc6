"""Heartbeat's bounded dialing on real py-libp2p hosts over loopback: hint peers that never
answer are dialled a bounded number of times and forgotten, at most MAX_HINT_PEERS are
monitored at once, a peer that dials us is monitored at once whatever the hint load, and
an honest hint queued behind a flood of hints naming the same saturated addresses gets its
turn (those are given up without a dial)."""

from __future__ import annotations

import trio
from _listeners import FOREIGN_IPS, counting_listeners

from prefixmesh.overlay.core import dialing
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.heartbeat import Heartbeat
from prefixmesh.overlay.host import OverlayHost


def _heartbeat(host: OverlayHost, addrs: dict) -> Heartbeat:
    return Heartbeat(host, addrs_of=lambda p: addrs.get(p, []), local_load=lambda: (0, 0),
                     interval_s=0.3, timeout_s=1.0)


def test_a_peer_that_never_answers_is_forgotten_after_a_few_dials():
    async def main():
        counts = [0]
        async with trio.open_nursery() as nursery:
            port = await counting_listeners(nursery, counts)
            host = OverlayHost(Identity.generate())
            async with host.run():
                ghost = Identity.generate().peer_id
                addrs = {ghost: [f"/ip4/{ip}/tcp/{port}" for ip in FOREIGN_IPS]}
                hb = _heartbeat(host, addrs)
                forgotten = []
                hb.on_forget = forgotten.append
                await nursery.start(hb.run)
                hb.watch(ghost)
                with trio.fail_after(30):
                    while not forgotten:
                        await trio.sleep(0.1)
                assert forgotten == [ghost]
                assert ghost not in hb.health and ghost not in hb.monitored()
                # each failed attempt used at most MAX_ADDRS_PER_DIAL of its 8 addresses
                assert 0 < counts[0] <= dialing.NEVER_UP_ATTEMPTS * dialing.MAX_ADDRS_PER_DIAL
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_flood_of_hint_peers_is_bounded_and_an_honest_peer_still_gets_in():
    async def main():
        counts = [0]
        async with trio.open_nursery() as nursery:
            port = await counting_listeners(nursery, counts)
            node, honest = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
            quiet = OverlayHost(Identity.generate())  # honest, learned only as a hint
            async with node.run(), honest.run(), quiet.run():
                foreign = [f"/ip4/{ip}/tcp/{port}" for ip in FOREIGN_IPS]
                addrs = {Identity.generate().peer_id: foreign for _ in range(300)}
                hb = _heartbeat(node, addrs)
                await nursery.start(hb.run)
                hb_honest = _heartbeat(honest, {node.peer_id: node.listen_addrs()})
                await nursery.start(hb_honest.run)
                hb_quiet = _heartbeat(quiet, {})
                await nursery.start(hb_quiet.run)  # answers PINGs, dials nobody
                for p in addrs:
                    hb.watch(p)
                addrs[quiet.peer_id] = quiet.listen_addrs()
                hb.watch(quiet.peer_id)  # queued behind 268 flood hints
                most = 0
                t0 = trio.current_time()
                hb_honest.watch(node.peer_id)  # the honest peer dials the flooded node
                with trio.fail_after(20):
                    while not (hb.is_up(honest.peer_id) and hb.is_up(quiet.peer_id)):
                        most = max(most, len(hb.monitored()))
                        await trio.sleep(0.05)
                while trio.current_time() - t0 < 10.0:
                    most = max(most, len(hb.monitored()))
                    await trio.sleep(0.05)
                elapsed = trio.current_time() - t0
                # the honest peer dialled us: it is monitored beside the hint slots
                assert most <= dialing.MAX_HINT_PEERS + 1
                bound = len(foreign) * (dialing.ADDR_BURST + elapsed * dialing.ADDR_RATE_PER_S)
                assert 0 < counts[0] <= bound, (counts[0], bound)
                assert hb.gate.in_flight <= dialing.MAX_CONCURRENT_DIALS
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_our_dials_stop_at_the_outbound_share_and_inbound_still_gets_in(monkeypatch):
    from prefixmesh.overlay import libp2p_guard

    monkeypatch.setattr(libp2p_guard, "MAX_OUTBOUND_CONNECTIONS", 1)

    async def main():
        node = OverlayHost(Identity.generate())
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        async with node.run(), a.run(), b.run(), trio.open_nursery() as nursery:
            addrs = {a.peer_id: a.listen_addrs(), b.peer_id: b.listen_addrs()}
            hb = _heartbeat(node, addrs)
            await nursery.start(hb.run)
            for h in (a, b):
                await nursery.start(_heartbeat(h, {}).run)  # answer PINGs
            hb.watch(a.peer_id)
            with trio.fail_after(10):
                while not hb.is_up(a.peer_id):
                    await trio.sleep(0.05)
            hb.watch(b.peer_id)  # our one outbound slot is taken: no dial
            await trio.sleep(2.0)
            assert not node.is_connected(b.peer_id) and hb.gate.admitted == 1
            hb_b = _heartbeat(b, {node.peer_id: node.listen_addrs()})
            await nursery.start(hb_b.run)
            hb_b.watch(node.peer_id)  # b dials in: the inbound share is untouched
            with trio.fail_after(10):
                while not hb.is_up(b.peer_id):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
