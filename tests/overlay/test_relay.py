"""overlay/relay.py with real libp2p hosts on loopback (no NAT lab needed): a relay
service, a reservation keeper, a dial through the circuit address the keeper publishes,
the relay's counters, and the keeper moving on when its relay goes."""

from __future__ import annotations

import trio

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.host import FramedStream, OverlayHost
from prefixmesh.overlay.relay import RelayService, ReservationKeeper

ECHO = "/prefixmesh-test/echo/1"


def test_a_keeper_reserves_publishes_a_circuit_and_a_peer_reaches_it_through_the_relay():
    async def main():
        relay_host, home, caller = (OverlayHost(Identity.generate()) for _ in range(3))
        changes = []

        async def echo(stream):
            fs = FramedStream(stream, timeout_s=5)
            frame = await fs.receive()
            await fs.send(frame)
            await fs.close()

        home.set_handler(ECHO, echo)
        async with relay_host.run(), home.run(), caller.run(), trio.open_nursery() as nursery:
            service = await nursery.start(RelayService(relay_host).run)
            keeper = ReservationKeeper(home, bootstrap=lambda: relay_host.full_addrs(),
                                       on_change=lambda: changes.append(keeper.circuit_addrs()))
            await nursery.start(keeper.run)
            with trio.fail_after(10):
                while not keeper.reserved_relays():
                    await trio.sleep(0.05)
            assert keeper.reserved_relays() == [relay_host.identity.peer_id_b58]
            assert keeper.tried() == [relay_host.identity.peer_id_b58]
            assert keeper.last_failure is None
            circuit = keeper.circuit_addrs()[0]
            assert circuit.endswith(f"/p2p/{relay_host.identity.peer_id_b58}/p2p-circuit")
            assert changes == [[circuit]]
            home.set_circuit_addrs(keeper.circuit_addrs())
            assert home.listen_addrs() == [circuit]

            # the caller knows the home only by its circuit address
            await caller.connect(home.peer_id, [circuit])
            assert caller.link_kind(home.peer_id) == "relayed"
            stream = await caller.open_stream(home.peer_id, ECHO)
            fs = FramedStream(stream, timeout_s=5)
            await fs.send(wire.Ping(nonce=7))
            assert await fs.receive() == wire.Ping(nonce=7)
            stats = service.stats()
            assert stats["circuits_total"] >= 1 and stats["reservations"] == 1
            assert stats["bytes_relayed"] > 0 and stats["refused"] == 0

            # the relay goes: the keeper says so and has nowhere else to go
            await relay_host._close_connections()
            with trio.fail_after(10):
                while keeper.reserved_relays():
                    await trio.sleep(0.05)
            assert "lost" in (keeper.last_failure or "")
            assert changes[-1] == []
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_relay_connection_dialled_again_before_the_keeper_looks_still_counts_as_lost():
    # the relay drops a reservation with its connection; py-libp2p (its auto-connector) or
    # anyone else may dial the relay again within the keeper's 0.5 s loop, so "connected"
    # alone would keep advertising a circuit the relay no longer holds
    async def main():
        relay_host, home = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        async with relay_host.run(), home.run(), trio.open_nursery() as nursery:
            await nursery.start(RelayService(relay_host).run)
            keeper = ReservationKeeper(home, bootstrap=lambda: relay_host.full_addrs())
            await keeper._fill()  # the loop's steps by hand: nothing runs in between
            assert keeper.reserved_relays() == [relay_host.identity.peer_id_b58]
            await keeper._check()
            assert keeper.reserved_relays() and keeper.last_failure is None  # nothing changed

            await relay_host._close_connections()
            with trio.fail_after(5):
                while home.is_connected(relay_host.peer_id):
                    await trio.sleep(0.02)
            await home.connect(relay_host.peer_id, relay_host.listen_addrs(), 5)
            assert home.is_connected(relay_host.peer_id)

            await keeper._check()
            assert keeper.reserved_relays() == []
            assert "dialled again" in (keeper.last_failure or "")
            nursery.cancel_scope.cancel()

    trio.run(main)
