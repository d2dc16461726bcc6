"""Which NAT role a node plays (issue 16): the relay service while it is public, the
relay reservations while it is private (both in ``overlay/relay.py``, which this module
imports only when a role starts: it needs py-libp2p, which a node loads after it began
serving, see overlay/host.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from .core import relaying as rl
from .core.identity import peer_id_to_b58

if TYPE_CHECKING:
    from .relay import RelayService, ReservationKeeper

__all__ = ["NatRoles", "known_public_peers"]

log = logging.getLogger(__name__)


def known_public_peers(directory, limit: int = 16) -> list[str]:
    """Full multiaddrs of peers in ``directory`` whose addresses look public (relay
    candidates after the bootstrap peers): newest-first, one address each."""
    out: list[str] = []
    for peer, known in list(directory.peers.items()):
        for a in known.addrs:
            if not rl.is_circuit(a) and rl.reachability_from_addrs([a]) == "public":
                out.append(f"{a}/p2p/{peer_id_to_b58(peer)}")
                break
        if len(out) >= limit:
            break
    return out


class NatRoles:
    """Runs the relay service while we are ``public`` (and ``[nat].relay_service`` is on)
    and the reservation keeper while we are ``private``; ``kind()`` is the node's current
    verdict (the dial-back's, or :func:`~.core.relaying.reachability_from_addrs` until it
    has one), looked at every :data:`CHECK_S`. A role that no longer fits is stopped (a
    stopped keeper's circuit addresses are withdrawn through ``on_keeper_stop``)."""

    CHECK_S = 1.0

    def __init__(self, kind: Callable[[], str], *, relay: Callable[[], RelayService] | None,
                 keeper: Callable[[], ReservationKeeper],
                 on_keeper_stop: Callable[[], None] = lambda: None) -> None:
        self.kind = kind
        self._make_relay, self._make_keeper = relay, keeper
        self.on_keeper_stop = on_keeper_stop
        self.relay: RelayService | None = None
        self.keeper: ReservationKeeper | None = None
        self._scopes: dict[str, trio.CancelScope] = {}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started(self)
            while True:
                kind = self.kind()
                want = {"public": "relay" if self._make_relay else None,
                        "private": "keeper"}.get(kind)
                for role in list(self._scopes):
                    if role != want:
                        self._scopes.pop(role).cancel()
                        log.info("reachability now %s: %s stopped", kind, role)
                        if role == "keeper":
                            self.keeper = None
                            self.on_keeper_stop()
                        else:
                            self.relay = None
                if want and want not in self._scopes:
                    await nursery.start(self._run_role, want)
                await trio.sleep(self.CHECK_S)

    async def _run_role(self, role: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._scopes[role] = scope
            if role == "relay":
                assert self._make_relay is not None
                self.relay = self._make_relay()
                service = self.relay
            else:
                self.keeper = self._make_keeper()
                service = self.keeper
            task_status.started()
            try:
                await service.run()
            except trio.Cancelled:
                raise
            except Exception:  # the node keeps serving without this role
                log.exception("%s stopped", role)
            self._scopes.pop(role, None)
