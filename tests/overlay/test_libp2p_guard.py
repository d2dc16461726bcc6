"""libp2p_guard on real py-libp2p hosts: a handler exception inside py-libp2p is contained
and the host keeps serving; our own peerstore entry survives a flood of peer entries;
the connection limits are the ones we set."""

from __future__ import annotations

import contextlib

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from prefixmesh.overlay import libp2p_guard
from prefixmesh.overlay.core import dialing, wire
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.host import FramedStream, OverlayHost, PeerUnreachable


def test_an_exception_in_a_library_handler_is_contained_and_the_host_serves_on():
    async def main():
        node, client = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())

        async def broken(stream):  # registered straight on py-libp2p, like identify
            raise KeyError("peer ID not found")

        async def echo(stream):
            fs = FramedStream(stream, timeout_s=5)
            frame = await fs.receive()
            await fs.send(frame)

        node.libp2p.set_stream_handler(TProtocol("/test/broken/1"), broken)
        node.set_handler(wire.PING_PROTOCOL, echo)
        async with node.run(), client.run():
            await client.connect(node.peer_id, node.listen_addrs())
            for _ in range(3):
                # the reset may reach the client before its negotiation finished
                with contextlib.suppress(PeerUnreachable):
                    s = await client.open_stream(node.peer_id, "/test/broken/1")
                    await s.reset()
                await trio.sleep(0.2)
            assert libp2p_guard.CONTAINED[("/test/broken/1", "KeyError")] >= 3
            s = await client.open_stream(node.peer_id, wire.PING_PROTOCOL)
            fs = FramedStream(s, timeout_s=5)
            await fs.send(wire.Ping(7))
            assert await fs.receive() == wire.Ping(7)

    trio.run(main)


def test_our_own_peerstore_entry_survives_a_flood_of_entries():
    async def main():
        node = OverlayHost(Identity.generate())
        store = node.libp2p.get_peerstore()
        async with node.run():
            addr = multiaddr.Multiaddr("/ip4/127.0.0.2/tcp/9")
            for _ in range(libp2p_guard.MAX_PEERSTORE_PEERS + 500):
                store.add_addrs(ID(Identity.generate().peer_id), [addr], 3600)
            store._cleanup_expired_records()
            assert len(store.peer_ids()) <= libp2p_guard.MAX_PEERSTORE_PEERS
            # what identify reads on every inbound identify request
            assert node.libp2p.get_public_key().to_bytes() == node.identity.public_bytes
            store.clear_peerdata(node.libp2p.get_id())  # refused
            assert node.libp2p.get_public_key() is not None

    trio.run(main)


def test_connection_limits_are_explicit_and_keep_an_inbound_reserve():
    node = OverlayHost(Identity.generate())
    cfg = node.libp2p.get_network().connection_config
    assert cfg.max_connections == libp2p_guard.MAX_CONNECTIONS
    assert cfg.max_connections_per_peer == 1
    assert node.libp2p.get_network().retry_config.max_retries == 0
    assert libp2p_guard.outbound_room(libp2p_guard.MAX_OUTBOUND_CONNECTIONS - 1)
    assert not libp2p_guard.outbound_room(libp2p_guard.MAX_OUTBOUND_CONNECTIONS)
    assert libp2p_guard.MAX_CONNECTIONS - libp2p_guard.MAX_OUTBOUND_CONNECTIONS >= 128


def test_library_dials_pass_the_dial_gate_and_own_dials_are_not_charged_twice():
    """What Kademlia does with a FIND_NODE answer: put the named peers' addresses in the
    peerstore and open a stream to each. Past the gate's budget those dials fail at once,
    without a TCP attempt; the node's own dials (OverlayHost.connect) are not charged."""

    async def main():
        node, honest = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        gate = node.dial_gate
        store = node.libp2p.get_peerstore()
        async with node.run(), honest.run():
            refused_before = libp2p_guard.LIBRARY_DIALS_REFUSED["refused"]
            admitted_before = gate.admitted
            named = [ID(Identity.generate().peer_id) for _ in range(40)]
            for i, pid in enumerate(named):  # closed ports on addresses of one /24
                store.add_addrs(pid, [multiaddr.Multiaddr(f"/ip4/127.0.0.{2 + i % 8}/tcp/9")],
                                3600)
            failures = 0
            t0 = trio.current_time()
            for pid in named:
                with contextlib.suppress(Exception), trio.move_on_after(2):
                    await node.libp2p.new_stream(pid, [TProtocol("/ipfs/kad/1.0.0")])
                failures += 1
            refused = libp2p_guard.LIBRARY_DIALS_REFUSED["refused"] - refused_before
            elapsed = trio.current_time() - t0
            assert failures == 40
            # the global budget lets its burst through (then its rate); everything else is
            # refused untried
            admitted = gate.admitted - admitted_before
            assert admitted <= dialing.DIAL_BURST + elapsed * dialing.DIAL_RATE_PER_S + 1
            assert admitted + refused == 40 and refused >= 40 - dialing.DIAL_BURST - 1 - elapsed
            # our own dial (the heartbeat's, already admitted) is not refused by the gate
            admitted = gate.admitted
            await node.connect(honest.peer_id, honest.listen_addrs(), 5)
            assert node.is_connected(honest.peer_id) and gate.admitted == admitted

    trio.run(main)


def test_an_inbound_slot_comes_back_when_its_connection_closes():
    """py-libp2p 0.8.1's inbound handler held its slot until the swarm stopped, so the cap
    counted every inbound connection since start and a node refused all new ones after
    max_connections of them (issue 14, the soak). With a cap of 4 here, 12 clients one
    after the other (each closing at the end, like `prefixmesh ask`) all get in."""

    async def main():
        node = OverlayHost(Identity.generate())
        async with node.run():
            limiter = node.libp2p.get_network()._inbound_limiter = trio.CapacityLimiter(4)
            for _ in range(12):
                client = OverlayHost(Identity.generate())
                async with client.run():
                    await client.connect(node.peer_id, node.listen_addrs(), 5)
                with trio.fail_after(5):  # the node notices the close and frees the slot
                    while limiter.borrowed_tokens:
                        await trio.sleep(0.02)
            assert limiter.borrowed_tokens == 0

    trio.run(main)
