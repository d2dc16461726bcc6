"""SWIM's bounded dialing (issue 14) on real py-libp2p hosts over loopback: a stranger that
never answers is dialled a bounded number of times and forgotten without entering the
member table; a flood of hint peers (out of band or gossiped) is checked at most
MAX_HINT_PEERS at a time, through the gate, never becomes members and is never spread on;
an honest peer that dials us, and an honest hint queued behind the flood, still get in.
Also: a peer is up from the other side's probes, with RTT and its ACK figures."""

from __future__ import annotations

import trio
from _listeners import FOREIGN_IPS, counting_listeners

from prefixmesh.overlay.core import dialing
from prefixmesh.overlay.core import membership as mb
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.heartbeat import FRESH_LOAD_S
from prefixmesh.overlay.host import OverlayHost
from prefixmesh.overlay.swim import Swim


def _swim(host: OverlayHost, addrs: dict, **kwargs) -> Swim:
    return Swim(host, addrs_of=lambda p: addrs.get(p, []), local_load=lambda: (2, 1),
                self_addrs=host.listen_addrs, **kwargs)


async def _until(predicate, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)


def test_two_nodes_probe_each_other_and_carry_figures_on_acks():
    async def main():
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        async with a.run(), b.run(), trio.open_nursery() as nursery:
            sa = _swim(a, {b.peer_id: b.listen_addrs()}, model=(b"\x01" * 32, "model-a"),
                       context_tokens=lambda: 4096)
            sb = _swim(b, {})
            sb.summary_hash = lambda: b"h" * 32
            await nursery.start(sa.run)
            await nursery.start(sb.run)
            sa.watch(b.peer_id)  # only a knows b's address
            await _until(lambda: sa.is_up(b.peer_id) and sb.is_up(a.peer_id), 30)
            await _until(lambda: sa.health[b.peer_id].summary_hash == b"h" * 32
                         and sb.health[a.peer_id].model == b"\x01" * 32, 30)
            hb, ha = sa.health[b.peer_id], sb.health[a.peer_id]
            assert hb.rtt_s is not None and hb.pongs > 0 and (hb.queue_depth, hb.active) == (2, 1)
            assert ha.model_name == "model-a" and ha.n_ctx == 4096
            # routing reads the ACK's load while fresh, the digest's after that
            assert sa.fresh_load(b.peer_id) == 3.0
            assert sa.fresh_load(b.peer_id, now=hb.figures_at + FRESH_LOAD_S + 1) is None
            assert sa.up_peers_of(b"\x01" * 32) == [b.peer_id]  # b never said: any model
            assert sa.merit(b.peer_id) == 1 and not sa.is_known(b.peer_id)  # seen up, young
            assert sa.stats["bad_messages"] == 0 and sb.pings_answered > 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_bad_frame_is_dropped_and_the_node_keeps_probing():
    async def main():
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        async with a.run(), b.run(), trio.open_nursery() as nursery:
            sa = _swim(a, {b.peer_id: b.listen_addrs()})
            sb = _swim(b, {})
            await nursery.start(sa.run)
            await nursery.start(sb.run)
            sa.watch(b.peer_id)
            await _until(lambda: sa.is_up(b.peer_id), 30)
            from prefixmesh.overlay.host import FramedStream
            from prefixmesh.overlay.swim import SWIM_PROTOCOL

            fs = FramedStream(await a.open_stream(b.peer_id, SWIM_PROTOCOL))
            await fs.send_raw(b"\xff not cbor")
            await fs.send_raw(mb.encode_message(mb.Ping(1, 1))[:-1] + b"\x07")
            await _until(lambda: sb.stats["bad_messages"] >= 1, 10)
            pings = sb.pings_answered
            await _until(lambda: sb.pings_answered > pings, 20)  # a's probes still answered
            assert sb.is_up(a.peer_id)
            await fs.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_stranger_that_never_answers_is_forgotten_after_a_few_dials():
    async def main():
        counts = [0]
        async with trio.open_nursery() as nursery:
            port = await counting_listeners(nursery, counts)
            host = OverlayHost(Identity.generate())
            async with host.run():
                ghost = Identity.generate().peer_id
                addrs = {ghost: [f"/ip4/{ip}/tcp/{port}" for ip in FOREIGN_IPS]}
                sw = _swim(host, addrs)
                forgotten = []
                sw.on_forget = forgotten.append
                await nursery.start(sw.run)
                sw.watch(ghost)
                await _until(lambda: forgotten, 60)
                assert forgotten == [ghost]
                assert ghost not in sw.health and sw.membership.state_of(ghost) is None
                assert 0 < counts[0] <= dialing.NEVER_UP_ATTEMPTS * dialing.MAX_ADDRS_PER_DIAL
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_flood_of_hint_peers_is_bounded_never_spread_and_honest_peers_get_in():
    async def main():
        counts = [0]
        async with trio.open_nursery() as nursery:
            port = await counting_listeners(nursery, counts)
            node, honest = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
            quiet = OverlayHost(Identity.generate())  # honest, learned only as a hint
            async with node.run(), honest.run(), quiet.run():
                foreign = [f"/ip4/{ip}/tcp/{port}" for ip in FOREIGN_IPS]
                flood = [Identity.generate().peer_id for _ in range(300)]
                addrs = dict.fromkeys(flood, foreign)
                sw = _swim(node, addrs)
                await nursery.start(sw.run)
                s_honest = _swim(honest, {node.peer_id: node.listen_addrs()})
                await nursery.start(s_honest.run)
                await nursery.start(_swim(quiet, {}).run)  # answers, dials nobody
                for p in flood[:150]:
                    sw.watch(p)  # out of band (digest, DHT hints)
                # and gossiped: a connected peer's claims about the other 150
                claims = tuple(mb.Update(p, 5, mb.ALIVE, tuple(foreign[:4])) for p in flood[150:])
                addrs[quiet.peer_id] = quiet.listen_addrs()
                sw.watch(quiet.peer_id)  # queued behind the flood
                t0 = trio.current_time()
                s_honest.watch(node.peer_id)  # the honest peer dials the flooded node
                await _until(lambda: sw.is_up(honest.peer_id), 30)
                for i in range(0, len(claims), 16):
                    sw.on_message(honest.peer_id, mb.Ping(10_000 + i, 1, claims[i:i + 16]))
                most = 0
                with trio.fail_after(60):
                    while not sw.is_up(quiet.peer_id):
                        most = max(most, len(sw._vetting))
                        await trio.sleep(0.05)
                elapsed = trio.current_time() - t0
                assert most <= dialing.MAX_HINT_PEERS
                assert not any(sw.membership.state_of(p) for p in flood)  # none a member
                # none spread on: the honest peer never hears of them
                assert not any(s_honest.membership.state_of(p) for p in flood)
                bound = len(foreign) * (dialing.ADDR_BURST + elapsed * dialing.ADDR_RATE_PER_S)
                assert 0 < counts[0] <= bound, (counts[0], bound)
                assert sw.gate.in_flight <= dialing.MAX_CONCURRENT_DIALS
            nursery.cancel_scope.cancel()

    trio.run(main)
