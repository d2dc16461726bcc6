"""Issue 14, finding 1, against a real node process: an outside attacker
(tests/adversary/digest_flood.py: plain py-libp2p + Noise, hand-built CBOR, records signed
with fresh Ed25519 keys) pushes 1,100 snapshot records, each naming the same 8 foreign
addresses 127.0.0.2..9 where counting TCP listeners stand, twice (two attacker
identities), while an honest client sends 20 sequential requests, each on a new
connection. Asserted: every honest request is answered, the node still accepts new
connections and is alive, and its dials to the foreign addresses stay within the
documented bound (per address ADDR_BURST + ADDR_RATE_PER_S x elapsed: 9 a minute).
Figures (printed; docs/SECURITY.md): dials per minute, RSS, honest median latency
unattacked vs attacked, measured in the same run."""

from __future__ import annotations

import statistics
import time

import trio
from _swarm import Swarm
from adversary.digest_flood import flood

from prefixmesh.bench.attack_nodes import FOREIGN_IPS, count_dials, honest_request, rss_mib
from prefixmesh.overlay.core import dialing

N_REQUESTS = 20


async def _honest(addr: str) -> float:
    """A request on a fresh connection (and identity); it must be answered."""
    latency = await honest_request(addr)
    assert isinstance(latency, float), latency
    return latency


def test_digest_flood_with_foreign_addresses(tmp_path):
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim")
        figures = {}

        async def main():
            dials = []  # monotonic times of TCP connections at the foreign addresses
            async with trio.open_nursery() as nursery:
                foreign = await nursery.start(count_dials, dials)
                figures["rss_before_mib"] = rss_mib(a.proc.pid)
                quiet = [await _honest(a.addr) for _ in range(N_REQUESTS)]
                t_attack = time.monotonic()
                figures["flood"] = await flood(a.addr, foreign)
                attacked = []
                for i in range(N_REQUESTS):
                    if i == N_REQUESTS // 2:  # a second attacker identity, more records
                        await flood(a.addr, foreign)
                    attacked.append(await _honest(a.addr))
                while time.monotonic() - t_attack < 30.0:  # let the dialing play out
                    await trio.sleep(0.5)
                elapsed = time.monotonic() - t_attack
                after = await _honest(a.addr)  # still accepting new connections
                figures.update(
                    quiet_median_s=statistics.median(quiet),
                    attacked_median_s=statistics.median(attacked),
                    after_s=after,
                    window_s=elapsed,
                    foreign_dials=len(dials),
                    dials_per_min=len(dials) * 60.0 / elapsed,
                    rss_after_mib=rss_mib(a.proc.pid),
                )
                nursery.cancel_scope.cancel()

        trio.run(main)
        print("digest-flood figures:", figures)
        assert a.proc.poll() is None, a.log_tail()
        assert "internal error" not in a.log_tail(20000)
        bound = len(FOREIGN_IPS) * (
            dialing.ADDR_BURST + dialing.ADDR_RATE_PER_S * figures["window_s"])
        assert figures["foreign_dials"] <= bound, (figures, bound, a.log_tail())
