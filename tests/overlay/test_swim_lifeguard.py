"""overlay/swim.py's Lifeguard wiring (issue 18) on a real py-libp2p host: the ticker
passes how late it runs after the deadline it slept to, so a process whose event loop is
blocked (a long synchronous stretch: what a node starved of CPU, or busy in a prefill on
its own loop, lives through) raises its local health multiplier, and on-time periods bring
it back to 0. The rules themselves: tests/overlay/core/test_membership_lifeguard.py."""

from __future__ import annotations

import time

import trio

from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.host import OverlayHost
from prefixmesh.overlay.swim import Swim


def test_a_blocked_event_loop_raises_local_health_and_on_time_ticks_lower_it():
    async def main():
        a = OverlayHost(Identity.generate())
        async with a.run(), trio.open_nursery() as nursery:
            sa = Swim(a, addrs_of=lambda p: [], local_load=lambda: (0, 0),
                      self_addrs=a.listen_addrs)
            await nursery.start(sa.run)
            await trio.sleep(0.2)
            assert sa.membership.local_health == 0
            # nothing runs for 2 s: the ticker's deadline (at most a period ahead) passes
            # by at least 1 s, beyond half the probe timeout
            time.sleep(2.0)
            await trio.sleep(0.05)  # the ticker runs, late
            assert sa.membership.local_health >= 1
            assert sa.node_stats()["swim_local_health"] == sa.membership.local_health
            assert sa.membership.probe_interval_s() > 1.0
            with trio.fail_after(20):  # on time again: one step down per period
                while sa.membership.local_health:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    trio.run(main)
