"""Which NAT role runs (overlay/natroles.py): the relay service while public, the
reservation keeper while private, none while unknown; a role that no longer fits is
stopped. The roles here are stand-ins that record their runs (the real ones are
overlay/relay.py's, tested with real hosts in tests/overlay/test_relay.py); trio's
autojump clock stands in for the role check's period."""

from __future__ import annotations

import trio
import trio.testing

from prefixmesh.overlay.core.identity import Identity, peer_id_to_b58
from prefixmesh.overlay.discovery import PeerDirectory
from prefixmesh.overlay.natroles import NatRoles, known_public_peers


class _Role:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    async def run(self) -> None:
        self.log.append(f"{self.name} started")
        try:
            await trio.sleep_forever()
        finally:
            self.log.append(f"{self.name} stopped")


def _roles(kind: list[str], *, relay: bool = True):
    log: list[str] = []
    roles = NatRoles(lambda: kind[0],
                     relay=(lambda: _Role(log, "relay")) if relay else None,
                     keeper=lambda: _Role(log, "keeper"),
                     on_keeper_stop=lambda: log.append("keeper's addresses withdrawn"))
    return roles, log


def test_the_role_follows_the_reachability_verdict():
    kind = ["unknown"]
    roles, log = _roles(kind)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(roles.run)
            await trio.sleep(5 * NatRoles.CHECK_S)
            assert log == [] and roles.relay is None and roles.keeper is None
            kind[0] = "public"
            await trio.sleep(2 * NatRoles.CHECK_S)
            assert log == ["relay started"] and roles.relay is not None
            kind[0] = "private"
            await trio.sleep(2 * NatRoles.CHECK_S)
            # the relay's cancellation and the keeper's start run in either order
            assert log[0] == "relay started"
            assert sorted(log[1:]) == ["keeper started", "relay stopped"]
            assert roles.relay is None and roles.keeper is not None
            kind[0] = "unknown"
            await trio.sleep(2 * NatRoles.CHECK_S)
            assert sorted(log[3:]) == ["keeper stopped", "keeper's addresses withdrawn"]
            assert roles.keeper is None
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_public_node_without_the_relay_service_runs_no_role():
    kind = ["public"]
    roles, log = _roles(kind, relay=False)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(roles.run)
            await trio.sleep(5 * NatRoles.CHECK_S)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert log == [] and roles.relay is None


def test_known_public_peers_are_relay_candidates_one_address_each():
    me, pub, home, relayed = (Identity.generate().peer_id for _ in range(4))
    directory = PeerDirectory(me)
    directory.learn(pub, ["/ip4/192.168.1.5/tcp/4001", "/ip4/8.8.4.4/tcp/4001",
                          "/ip4/8.8.8.8/tcp/4001"], "gossip")
    directory.learn(home, ["/ip4/192.168.1.6/tcp/4001"], "gossip")
    directory.learn(relayed, ["/ip4/8.8.8.8/tcp/4001/p2p/R/p2p-circuit"], "gossip")
    got = known_public_peers(directory)
    assert len(got) == 1
    addr, _, b58 = got[0].partition("/p2p/")
    assert addr in ("/ip4/8.8.4.4/tcp/4001", "/ip4/8.8.8.8/tcp/4001")
    assert b58 == peer_id_to_b58(pub)
