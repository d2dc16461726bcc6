"""Which peers a digest round contacts (overlay/gossip.py), with real libp2p hosts on
127.0.0.1 in one process: a peer whose membership-reported summary hash is stale (SWIM
reports it only on the ACKs to our own probes) is contacted once, found in sync, and then
left alone until our own summary changes; either side of an exchange that ends at the
summary-hash check remembers the other as in sync."""

from __future__ import annotations

import time

import trio

from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.gossip import Gossip
from prefixmesh.overlay.host import OverlayHost

MODEL = b"model-fp-test-00"
NS = b"N" * 8
STALE = b"\x00" * 16  # a hash reported long ago: never ours


def _gossip(host: OverlayHost, identity: Identity, peers: list[bytes]) -> Gossip:
    ae = AntiEntropy(identity, MODEL, epoch=1, now=time.time())
    # backstop far away: only the hash rule decides whom a round contacts
    return Gossip(host, ae, PeerCacheIndex(), peers=lambda: peers,
                  peer_hash=lambda peer: STALE, backstop_rounds=10_000,
                  exchange_timeout_s=10.0)


def test_a_peer_found_in_sync_is_not_contacted_again_until_our_summary_changes():
    a_id, b_id = Identity.generate(), Identity.generate()

    async def main():
        a, b = OverlayHost(a_id), OverlayHost(b_id)
        g_a = _gossip(a, a_id, [b_id.peer_id])
        g_b = _gossip(b, b_id, [a_id.peer_id])
        g_a.register()
        g_b.register()
        async with a.run(), b.run():
            await a.connect(b_id.peer_id, b.listen_addrs(), 10)
            g_a.rounds = g_b.rounds = 1  # not a backstop round
            # the two summaries differ at first: the first exchange carries records
            await g_a.round()
            assert g_a.stats["exchanges_ok"] == 1, g_a.stats
            assert g_a.ae.summary_digest() == g_b.ae.summary_digest()
            # now in sync, but the reported hash is stale: one more exchange finds that
            # out at the hash check, and both sides remember it
            await g_a.round()
            assert g_a.stats["exchanges_ok"] == 2
            assert g_a.stats["exchanges_in_sync"] == 1
            assert g_b.stats["exchanges_in_sync"] == 1
            # further rounds of either side contact nobody
            for _ in range(5):
                await g_a.round()
                await g_b.round()
            assert g_a.stats["exchanges_ok"] == 2 and g_b.stats["exchanges_ok"] == 0
            assert g_a.stats["peers_skipped_in_sync"] == 5
            assert g_b.stats["peers_skipped_in_sync"] == 5
            # a new record of ours: the peer lacks it, so it is contacted again
            g_a.ae.local_add_prefix(NS, [bytes([7, i]) * 4 for i in range(3)])
            await g_a.round()
            assert g_a.stats["exchanges_ok"] == 3
            assert g_a.ae.summary_digest() == g_b.ae.summary_digest()
            assert g_b.index.estimate(a_id.peer_id).n_hashes == 3

    trio.run(main)
