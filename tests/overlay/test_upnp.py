"""UPnP port mapping (overlay/upnp.py).

No router here or in the NAT lab offers UPnP, so the mapping itself is checked with a
stand-in gateway (the object the library's ``UpnpManager`` would be): ports mapped, the
external address offered for advertising, the mapping removed at stop, a gateway that
never answers abandoned at the deadline. The library's real manager is run inside a lab
home (real SSDP over a real NAT router that offers no UPnP): the node logs one line and
carries on.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import trio

from prefixmesh.overlay import upnp
from prefixmesh.overlay.upnp import PortMapper

HOME = SimpleNamespace(transport_addrs=lambda: ["/ip4/10.0.0.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"])


class StandInGateway:
    def __init__(self, *, found=True, hang=False, refuse=False):
        self.found, self.hang, self.refuse = found, hang, refuse
        self.mapped: list[int] = []
        self.removed: list[int] = []

    async def discover(self):
        if self.hang:
            await trio.sleep(3600)
        return self.found

    def get_external_ip(self):
        return "203.0.113.5" if self.found else None

    async def add_port_mapping(self, port, protocol="TCP"):
        if self.refuse:
            return False
        self.mapped.append(port)
        return True

    async def remove_port_mapping(self, port, protocol="TCP"):
        self.removed.append(port)
        return True


def _run_mapper(gw: StandInGateway, stop_after_map: bool = True) -> PortMapper:
    changes = []
    mapper = PortMapper(HOME, enabled=True, on_change=lambda: changes.append(1),
                        manager_factory=lambda: gw)

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mapper.run)
                while not mapper.external_addrs and "mapped" not in mapper.status \
                        and mapper.status == "not tried yet":
                    await trio.sleep(0.01)
                if mapper.external_addrs:
                    assert changes == [1]
                    assert mapper.external_addrs == ["/ip4/203.0.113.5/tcp/4001"]
                nursery.cancel_scope.cancel()

    trio.run(main)
    return mapper


def test_maps_the_listen_port_advertises_it_and_removes_it_at_stop():
    gw = StandInGateway()
    mapper = _run_mapper(gw)
    assert gw.mapped == [4001]  # the loopback listener is not mapped (same port once)
    assert gw.removed == [4001]
    assert mapper.external_addrs == []


def test_no_gateway_and_refusals_are_one_status_and_no_address():
    mapper = _run_mapper(StandInGateway(found=False))
    assert "offers no port mapping" in mapper.status and mapper.external_addrs == []
    mapper = _run_mapper(StandInGateway(refuse=True))
    assert "refused every mapping" in mapper.status and mapper.external_addrs == []


def test_a_gateway_that_never_answers_is_abandoned_at_the_deadline(monkeypatch):
    monkeypatch.setattr(upnp, "DISCOVER_DEADLINE_S", 0.5)
    mapper = _run_mapper(StandInGateway(hang=True))
    assert "offers no port mapping" in mapper.status


def test_off_by_default_does_nothing():
    mapper = PortMapper(HOME, enabled=False, manager_factory=lambda: 1 / 0)
    trio.run(mapper.run)
    assert mapper.status == "off" and mapper.external_addrs == []


_IN_HOME = """
import logging, sys, trio
from types import SimpleNamespace
from prefixmesh.overlay.upnp import PortMapper
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
host = SimpleNamespace(transport_addrs=lambda: ["/ip4/{ip}/tcp/4101"])
m = PortMapper(host, enabled=True)
trio.run(m.run)
print("STATUS", m.status, m.external_addrs)
"""


def test_real_library_in_a_lab_home_finds_no_gateway():
    from prefixmesh.bench.natlab import NatLab, lab_unavailable_reason

    why = lab_unavailable_reason()
    if why:
        pytest.skip(why)
    with NatLab(homes_nat=("eim",), public_hosts=1) as lab:
        home = lab.homes[0]
        r = lab.run(home.ns, [sys.executable, "-c", _IN_HOME.format(ip=home.ip)], timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "STATUS the router offers no port mapping" in r.stdout, r.stdout[-2000:]
    assert "[]" in r.stdout
