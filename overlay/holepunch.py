"""Hole punching (issue 16): the library's DCUtR, run only where it can work.

What is the library's: py-libp2p 0.8.1's ``DCUtRProtocol`` (``/libp2p/dcutr``: the
CONNECT/SYNC exchange over a relayed connection, TCP simultaneous open from our listen
port, closing the relayed connection 60 s after the direct one is up) and its auto-drive
loop, which tries every peer we hold only a relayed connection to (3 attempts each).

What is ours (docs/bench/nat.md, "Recommended design"):

* it runs only when ``[nat] hole_punching`` is on **and** our dial-back verdict
  (``overlay/dialback.py``) is ``private`` behind a ``port-preserving`` NAT. Behind a
  symmetric NAT every punch fails (0/10 in the lab) and costs ~24 s of futile dials
  (bug 5), so such a node does not speak ``/libp2p/dcutr`` at all and a peer's attempt
  fails at protocol negotiation; a public node needs no punching (a peer's "unilateral
  upgrade" simply dials it). It starts and stops as the verdict changes;
* ``dial_timeout=3`` (:data:`DIAL_TIMEOUT_S`): the library's 10 s default is spent
  before every punch on dials to unreachable addresses (bug 3: 10.2 s vs 3.4 s to direct);
* identify address discovery on (``OverlayHost(observe_addrs=True)``): without the
  observed WAN address DCUtR sends our private listen address and never connects (bug 4);
* one side leads: the peer with the lower peer id initiates, the other answers (the
  library's auto-drive on both sides made two sessions collide, and both failed);
* counts for ``status`` and ``/metrics``: attempts, successes, and the peers we now reach
  directly thanks to a punch (``private (direct via hole punching with N peers)``).
"""

from __future__ import annotations

import functools
import logging

import trio

from .core import reachability as rb
from .dialback import ReachabilityService, is_relayed

__all__ = ["HolePunchService", "DIAL_TIMEOUT_S", "should_punch", "counting_dcutr_class"]

log = logging.getLogger(__name__)

#: DCUtR's dial timeout (the library's default is 10 s; see the module docstring)
DIAL_TIMEOUT_S = 3


def should_punch(enabled: bool, reach: rb.Reachability) -> bool:
    """Whether DCUtR is worth running with this verdict."""
    return enabled and reach.kind == "private" and reach.nat == "port-preserving"


@functools.cache
def counting_dcutr_class() -> type:
    """py-libp2p's DCUtR protocol, with each initiated punch counted by its owner (a
    :class:`HolePunchService`). Defined on first use: py-libp2p is imported when the host
    is built (overlay/host.py)."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    class CountingDCUtR(DCUtRProtocol):
        def __init__(self, host, owner: HolePunchService) -> None:
            super().__init__(host, dial_timeout=DIAL_TIMEOUT_S)
            self._owner = owner

        async def initiate_hole_punch(self, peer_id) -> bool:
            if await self._have_direct_connection(peer_id):
                return True  # nothing to punch: not an attempt
            if self.host.get_id().to_bytes() > peer_id.to_bytes():
                # the library's auto-drive runs on both sides and starts both sessions at the
                # same moment; they collide and both fail (~22 s, seen in the lab). The lower
                # peer id leads, we answer its session
                return False
            self._owner.attempts += 1
            ok = await super().initiate_hole_punch(peer_id)
            if ok:
                self._owner.successes += 1
                self._owner.punched.add(peer_id)
                log.info("hole punch to %s: direct connection", str(peer_id)[-12:])
            else:
                log.info("hole punch to %s failed; staying relayed", str(peer_id)[-12:])
            return ok

    return CountingDCUtR


class HolePunchService:
    """Runs py-libp2p's DCUtR (:func:`counting_dcutr_class`) while :func:`should_punch`
    holds."""

    def __init__(self, host, reachability: ReachabilityService, *, enabled: bool) -> None:
        self.host = host  # an OverlayHost
        self.reachability = reachability
        self.enabled = enabled
        self.attempts = 0
        self.successes = 0
        self.punched: set = set()  # py-libp2p IDs
        self.running = False
        self._dcutr = None
        self._changed = trio.Event()
        reachability.on_change.append(lambda old, new: self._changed.set())

    def direct_peers(self) -> int:
        """Peers we reach over a direct connection that a hole punch made."""
        peers = set(self.punched)
        if self._dcutr is not None:  # the responder side of a punch counts too
            peers |= set(self._dcutr._direct_connections)
        return sum(any(not is_relayed(c) for c in self.host.links(pid.to_bytes()))
                   for pid in peers)

    def counts(self) -> dict[str, int]:
        return {"attempts": self.attempts, "successes": self.successes,
                "direct_peers": self.direct_peers(), "running": int(self.running)}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if not self.enabled:
            log.info("hole punching off ([nat] hole_punching = false)")
            return
        while True:
            self._changed = trio.Event()
            if should_punch(self.enabled, self.reachability.reachability):
                await self._run_dcutr_until_change()
            else:
                await self._changed.wait()

    async def _run_dcutr_until_change(self) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        self._dcutr = counting_dcutr_class()(self.host.libp2p, self)
        log.info("hole punching on (DCUtR, dial timeout %d s): behind a port-preserving NAT",
                 DIAL_TIMEOUT_S)
        self.running = True
        try:
            async with background_trio_service(self._dcutr):
                await self._changed.wait()
        finally:
            self.running = False
            self._dcutr = None
            log.info("hole punching stopped: reachability is now %s, NAT %s",
                     self.reachability.reachability.kind, self.reachability.reachability.nat)
