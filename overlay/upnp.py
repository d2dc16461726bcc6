"""UPnP port mapping, opt-in (``[nat] upnp = true``; issue 16).

What is the library's: py-libp2p 0.8.1's ``UpnpManager``
(``libp2p/discovery/upnp/upnp.py``, over ``miniupnpc``): SSDP discovery of an Internet
Gateway Device, its external IP, ``addportmapping`` / ``deleteportmapping`` of one TCP port
(same internal and external port). The host's own ``enable_upnp`` runs it inside
``host.run`` without a deadline and never tells us the external address, so we drive the
manager ourselves.

What is ours (:class:`PortMapper`):

* every step has a deadline: the manager's calls block in ``miniupnpc`` (C, no timeout of
  ours), so each runs in a worker thread we abandon when its deadline passes
  (:data:`DISCOVER_DEADLINE_S`, :data:`MAP_DEADLINE_S`); the node never waits on a router;
* it maps each TCP port we listen on (not loopback), and on success
  :attr:`PortMapper.external_addrs` holds ``/ip4/<external IP>/tcp/<port>``: the daemon
  advertises it and the dial-back check (``overlay/dialback.py``) confirms it from outside
  before the node calls itself ``public``;
* the mapping is removed when the node stops (bounded too);
* a router that offers no mapping (no IGD, a double NAT, UPnP off) is one INFO line, and
  the node carries on with relays and hole punching.

Not tested against a real router: the NAT lab's routers offer no UPnP (they are Linux
namespaces with nftables). ``tests/overlay/test_upnp.py`` checks the no-gateway path with
the real library inside a lab home, and the mapping/cleanup logic with a stand-in gateway.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import trio

from .core import reachability as rb

__all__ = ["PortMapper", "DISCOVER_DEADLINE_S", "MAP_DEADLINE_S"]

log = logging.getLogger(__name__)

#: SSDP discovery plus the IGD's first answers (miniupnpc waits ``discoverdelay`` ms)
DISCOVER_DEADLINE_S = 8.0
#: one AddPortMapping / DeletePortMapping request
MAP_DEADLINE_S = 4.0
#: miniupnpc's SSDP wait, milliseconds (its default, 0, means "2 s inside the C code")
_SSDP_WAIT_MS = 2000


def _library_manager():
    from libp2p.discovery.upnp.upnp import UpnpManager

    mgr = UpnpManager()
    with contextlib.suppress(Exception):
        mgr._gateway.discoverdelay = _SSDP_WAIT_MS
    return mgr


async def _bounded(deadline_s: float, fn: Callable, *args):
    """Run the manager's coroutine ``fn(*args)`` on its own trio loop in a worker thread,
    abandoned (its result ignored) when ``deadline_s`` passes: returns None then."""
    with trio.move_on_after(deadline_s):
        return await trio.to_thread.run_sync(lambda: trio.run(fn, *args),
                                             abandon_on_cancel=True)
    return None


class PortMapper:
    """Maps our listen ports at the home router while running (module docstring)."""

    def __init__(self, host, *, enabled: bool, on_change: Callable[[], None] = lambda: None,
                 manager_factory: Callable[[], object] = _library_manager) -> None:
        self.host = host  # an OverlayHost
        self.enabled = enabled
        self.on_change = on_change
        self.manager_factory = manager_factory
        self.external_addrs: list[str] = []
        self.status = "off" if not enabled else "not tried yet"
        self._mapped: list[int] = []

    def _ports(self) -> list[int]:
        ports = []
        for a in self.host.transport_addrs():
            ip, port = rb.addr_ip(a), rb.addr_port(a)
            if ip and port and not ip.startswith("127.") and ip != "::1" and port not in ports:
                ports.append(port)
        return ports

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if not self.enabled:
            return
        ports = self._ports()
        if not ports:
            self.status = "no non-loopback TCP listen port to map"
            log.info("UPnP: %s", self.status)
            return
        mgr = self.manager_factory()
        found = await _bounded(DISCOVER_DEADLINE_S, mgr.discover)
        external = mgr.get_external_ip() if found else None
        if not found or not external:
            self.status = (f"the router offers no port mapping (no UPnP gateway answered "
                           f"within {DISCOVER_DEADLINE_S:.0f} s, or it is behind another NAT)")
            log.info("UPnP: %s; reachability relies on relays and hole punching", self.status)
            return
        for port in ports:
            if await _bounded(MAP_DEADLINE_S, mgr.add_port_mapping, port, "TCP"):
                self._mapped.append(port)
            else:
                log.info("UPnP: the router at %s refused to map TCP port %d", external, port)
        if not self._mapped:
            self.status = f"the router ({external}) refused every mapping"
            return
        fam = "ip6" if ":" in external else "ip4"
        self.external_addrs = [f"/{fam}/{external}/tcp/{p}" for p in self._mapped]
        self.status = "mapped " + ", ".join(self.external_addrs)
        log.info("UPnP: %s (the dial-back check confirms it from outside)", self.status)
        self.on_change()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                for port in self._mapped:
                    if not await _bounded(MAP_DEADLINE_S, mgr.remove_port_mapping, port, "TCP"):
                        log.info("UPnP: could not remove the mapping of TCP port %d", port)
                self._mapped.clear()
                self.external_addrs = []
