"""Issue 14, adversarial suite, against a real node process: connection floods from many
identities and a PEERS query flood (tests/adversary/sybil.py: plain py-libp2p + Noise,
hand-built CBOR). While 300 fresh identities hold connections (more than the 256 inbound
connections py-libp2p admits; loopback is exempt from the per-/24 cap, so only the room the
node keeps for newcomers, closing the oldest idle stranger's connection, lets an honest
client in) and 4 identities query PEERS in a loop, an honest client sends 20
sequential requests, each on a new connection with a fresh identity. Asserted: every
honest request is answered, the node still accepts new connections and is alive, the
PEERS reply is built at most a few times a second however fast the flood asks. Figures (printed): honest median latency
unattacked vs attacked (same run), connections admitted/refused, PEERS replies/refusals."""

from __future__ import annotations

import resource
import statistics
import time

import trio
from _swarm import Swarm
from adversary.sybil import connection_flood, peers_flood

from prefixmesh.bench.attack_nodes import honest_request
from prefixmesh.node import peers_service
from prefixmesh.node.client import Client

N_REQUESTS = 20
N_IDENTITIES = 300


async def _honest(addr: str) -> float:
    """A request on a fresh connection (and identity); it must be answered."""
    latency = await honest_request(addr)
    assert isinstance(latency, float), latency
    return latency


def test_connection_and_peers_floods_from_many_identities(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # 300 attacker hosts
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim")
        figures: dict = {}

        async def main():
            quiet = [await _honest(a.addr) for _ in range(N_REQUESTS // 2)]
            conns: dict = {}
            peers: dict = {}
            async with trio.open_nursery() as nursery:
                await nursery.start(connection_flood, a.addr, N_IDENTITIES, conns)
                t_flood = time.monotonic()
                nursery.start_soon(peers_flood, a.addr, 4, peers)
                await trio.sleep(1.0)
                attacked = [await _honest(a.addr) for _ in range(N_REQUESTS)]
                nursery.cancel_scope.cancel()
            t_stop = time.monotonic()
            after = await _honest(a.addr)
            async with Client.connect(a.addr) as c:
                stats = (await c.peers()).stats
            flood_s = t_stop - t_flood
            figures.update(
                quiet_median_s=statistics.median(quiet),
                attacked_median_s=statistics.median(attacked),
                after_s=after, recovered_within_s=time.monotonic() - t_stop,
                connections=conns, peers_flood=peers, flood_s=flood_s,
                peers_built=stats["peers_built"], peers_answered=stats["peers_answered"],
                inbound_evicted=stats["inbound_evicted"])

        trio.run(main)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("sybil figures:", figures)
        assert a.proc.poll() is None, a.log_tail()
        assert "internal error" not in a.log_tail(20000)
        assert figures["connections"]["connected"] + figures["connections"]["refused"] == \
            N_IDENTITIES
        assert figures["inbound_evicted"] > 0  # the room for newcomers was used
        flood = figures["peers_flood"]
        assert flood["replies"] > 0, flood
        # however fast the flood asked, the reply was built a few times a second at most
        per_s = peers_service.FRESH_REPLIES_PER_S + 1 / peers_service.REPLY_REUSE_S
        assert figures["peers_built"] <= figures["flood_s"] * per_s + 8
        assert figures["peers_answered"] >= flood["replies"]
