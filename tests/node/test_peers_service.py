"""node/peers_service.py on real py-libp2p hosts: past a few fresh replies a second, the last
one built serves every query in its window; a peer asking past its budget gets `overloaded`
with a retry hint; another peer is still answered."""

from __future__ import annotations

import trio

from prefixmesh.node import peers_service
from prefixmesh.node.peers_service import PeersService
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.host import FramedStream, OverlayHost


async def _ask(client: OverlayHost, node: OverlayHost) -> wire.Frame | None:
    s = await client.open_stream(node.peer_id, wire.PEERS_PROTOCOL)
    fs = FramedStream(s, timeout_s=5)
    await fs.send(wire.PeersQuery())
    frame = await fs.receive()
    await fs.close()
    return frame


def test_replies_are_shared_and_each_peer_is_rate_limited():
    node_id = Identity.generate()
    built: list[int] = []

    def build() -> wire.PeersReply:
        built.append(1)
        return wire.PeersReply(self_peer=node_id.peer_id, model=b"m" * 8, addrs=(), peers=(),
                               stats={"n": len(built)})

    async def main():
        node = OverlayHost(node_id)
        greedy, other = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        now = [100.0]  # a clock the test moves: no refill while it asks
        service = PeersService(build, clock=lambda: now[0])
        node.set_handler(wire.PEERS_PROTOCOL, service.handle)
        async with node.run(), greedy.run(), other.run():
            for c in (greedy, other):
                await c.connect(node.peer_id, node.listen_addrs())
            answers = [await _ask(greedy, node) for _ in range(int(peers_service.QUERY_BURST) + 4)]
            replies = [a for a in answers if isinstance(a, wire.PeersReply)]
            refusals = [a for a in answers if isinstance(a, wire.Error)]
            assert refusals
            assert all(r.code == "overloaded" and "retry in" in r.message for r in refusals)
            assert len(replies) == peers_service.QUERY_BURST  # no time passed: no refill
            # the first few got fresh replies, the rest shared the last one built
            assert len(built) == peers_service.FRESH_REPLIES_PER_S
            assert replies[0].stats["n"] == 1 and replies[-1].stats["n"] == len(built)
            assert isinstance(await _ask(other, node), wire.PeersReply)
            now[0] += peers_service.REPLY_REUSE_S
            reply = await _ask(other, node)
            assert isinstance(reply, wire.PeersReply)
            assert reply.stats["n"] == len(built) == peers_service.FRESH_REPLIES_PER_S + 1

    trio.run(main)
