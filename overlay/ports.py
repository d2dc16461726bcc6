"""Listen ports, checked before anything slow starts (no libp2p here: the node's launcher,
``node/launch.py``, checks them before the model load and the overlay's imports).

py-libp2p listens with ``SO_REUSEPORT``, so a second process bound to a port in use would
silently share it (the kernel splits inbound connections between the two, and the dials
that land on the wrong node fail their handshake). Each fixed listen port is therefore
first bound here, without ``SO_REUSEPORT``: a port that is taken raises
:class:`ListenAddrInUse`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

__all__ = ["HostError", "ListenAddrInUse", "check_listen_addrs_free", "note_bound"]


class HostError(Exception):
    """Base class of host and stream errors (``overlay/host.py``)."""


class ListenAddrInUse(HostError):
    """A listen address cannot be bound: its port is taken, or the address is not ours."""


#: fixed (host, port) pairs a host of this process listened on: py-libp2p leaves a closed
#: host's listening socket open, so a later host of the same process (tests) would find
#: its own port "in use"; the check is about *other* processes
_bound_here: set[tuple[str, int]] = set()


def _host_port(addr: str) -> tuple[int, str, int] | None:
    """``/ip4|ip6/HOST/tcp/PORT`` -> (address family, HOST, PORT); None for other addresses."""
    parts = str(addr).strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
        return None
    family = socket.AF_INET6 if parts[0] == "ip6" else socket.AF_INET
    return family, parts[1], int(parts[3])


def note_bound(addrs: Sequence[str]) -> None:
    """A host of this process now listens on ``addrs``: later checks let their fixed ports be."""
    for addr in addrs:
        hp = _host_port(addr)
        if hp is not None and hp[2] != 0:
            _bound_here.add(hp[1:])


def check_listen_addrs_free(addrs: Sequence[str]) -> None:
    """Bind each ``/ip4|ip6/HOST/tcp/PORT`` (PORT > 0) briefly *without* SO_REUSEPORT;
    raises :class:`ListenAddrInUse` naming the address if that fails (module docstring)."""
    for addr in addrs:
        hp = _host_port(addr)
        if hp is None:
            continue
        family, host, port = hp
        if port == 0 or (host, port) in _bound_here:
            continue  # the kernel picks a free port / our own earlier listener
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR (as trio's listeners): a port left in TIME_WAIT by our previous
            # run is free; on Linux a port another socket LISTENS on still fails to bind
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ListenAddrInUse(
                        f"listen address {addr}: TCP port {port} is already in use (another "
                        "prefixmesh node or program listens there); stop it or choose "
                        "another port (--listen, [node].listen)"
                    ) from None
                raise ListenAddrInUse(f"listen address {addr}: cannot listen there: "
                                      f"{exc.strerror}") from None
