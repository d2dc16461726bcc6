"""overlay/partgossip.py with two real libp2p hosts on 127.0.0.1 in one process: a node's
new cached prefix is pushed to the home of its partition and acknowledged, the push stream
is reused on the next round, a lookup at the home answers the pushing node as holder (and
lands in the router's lookup cache), and a malformed message is counted without stopping
the responder. All decisions are the pure PartitionedDigest's (tests/overlay/core/
test_partition.py); its interface with Gossip: tests/overlay/test_digestexchange.py; real
node processes: tests/swarm/test_partition_node.py."""

from __future__ import annotations

import time

import trio

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import PartitionConfig, PartitionedDigest
from prefixmesh.overlay.host import FramedStream, OverlayHost
from prefixmesh.overlay.partgossip import PartitionGossip

MODEL = b"model-fp-test-00"
NS = b"N" * 8


def _pgossip(host: OverlayHost, ident: Identity, peers) -> PartitionGossip:
    def make_stream(fp: bytes, now: float) -> AntiEntropy:
        return AntiEntropy(ident, fp, epoch=int(now * 1000), now=now, ttl=900.0,
                           refresh_interval=300.0)

    # two nodes, two replicas: each node is a home of every partition
    pd = PartitionedDigest(ident, MODEL, config=PartitionConfig(n_partitions=4, replicas=2),
                           make_stream=make_stream)
    return PartitionGossip(host, pd, peers=peers, exchange_timeout_s=10.0)


def _chain(k: int) -> list[bytes]:
    return [bytes([k, i]) * 4 for i in range(3)]  # 8-byte block hashes


def test_push_ack_reuse_lookup_and_a_malformed_message():
    a_id, b_id = Identity.generate(), Identity.generate()

    async def main():
        a, b = OverlayHost(a_id, []), OverlayHost(b_id)
        pa = _pgossip(a, a_id, lambda: [b_id.peer_id])
        pb = _pgossip(b, b_id, lambda: [a_id.peer_id])
        pa.register()
        pb.register()
        async with a.run(), b.run():
            await a.connect(b_id.peer_id, b.listen_addrs(), 10)
            p, homes = pa.homes_of(NS, _chain(1))
            assert b_id.peer_id in homes

            # round 1: A's new prefix goes to its home B, which acknowledges it
            pa.pd.local_add_prefix(NS, _chain(1), time.time())
            with trio.fail_after(20):
                await pa.round()
            assert pa.stats["acks"] >= 1 and pa.stats["push_streams_opened"] == 1, pa.stats
            assert pb.stats["pushes_received"] >= 1 and pb.stats["records_applied"] >= 1
            assert a_id.peer_id in pb.last_heard
            assert pa.rounds == 1 and pa.node_stats()["part_acks"] == pa.stats["acks"]

            # round 2: another prefix, on the stream already open to B
            pa.pd.local_add_prefix(NS, _chain(2), time.time() + 0.01)
            with trio.fail_after(20):
                await pa.round()
            assert pa.stats["push_streams_reused"] >= 1, pa.stats
            assert pa.stats["push_streams_opened"] == 1

            # a lookup at the home: A holds the whole chain; the answer is cached
            with trio.fail_after(20):
                holders = await pa.lookup(b_id.peer_id, NS, _chain(1), 10.0)
            assert holders and holders[0].peer == a_id.peer_id
            assert holders[0].blocks == len(_chain(1))
            assert pb.stats["lookups_answered"] == 1
            assert pa.lookup_cache.get(NS, _chain(1), time.time()) == holders

            # garbage on the protocol: counted, the stream closed, B keeps answering
            stream = await a.open_stream(b_id.peer_id, wire.PARTITION_PROTOCOL, 10)
            fs = FramedStream(stream, timeout_s=10.0)
            await fs.send_raw(b"\xff not a partition message")
            with trio.fail_after(20):
                while pb.stats["malformed"] < 1:
                    await trio.sleep(0.01)
            await fs.close()
            with trio.fail_after(20):
                again = await pa.lookup(b_id.peer_id, NS, _chain(2), 10.0)
            assert again and again[0].peer == a_id.peer_id

            # no home to ask answers nothing: a routing miss, not an error
            assert await pa.lookup(b_id.peer_id, NS, [], 10.0) == []

    trio.run(main)
