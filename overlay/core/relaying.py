"""Relaying decisions (issue 16): circuit addresses, whether we look reachable, which
relay to reserve at next, and the relay service's admission and bandwidth accounting.

Circuit addresses
    A node behind NAT that holds a reservation at relay R advertises
    ``/ip4/R/tcp/P/p2p/R/p2p-circuit`` as a *transport* address (our records and the DHT
    carry transport addresses; ``/p2p/SELF`` is appended where full addresses are
    wanted). :func:`transport_part` strips a trailing ``/p2p/<peer>`` without cutting a
    circuit address at its relay's ``/p2p/R``.

Reachability guess
    :func:`reachability_from_addrs` stands in for a dial-back verdict: ``public`` when one
    of our addresses is a global IP, ``private`` when they are RFC 1918 / CGNAT / ULA
    addresses, ``unknown`` for loopback only (a test cluster on one machine: neither a
    relay service nor reservations make sense there). 198.18.0.0/15 (the NAT lab's
    "public" net, RFC 2544) counts as global here on purpose.

Peer addresses
    :func:`keep_peer_addr`: a private address of a peer is only worth keeping when it is
    on one of our own networks (same /24); anything else would be a dial into our own
    LAN or nowhere (measured: a relay's peer wasted 8 s on a home's private address).

Relay choice
    :class:`RelayChooser`: bootstrap peers first, then other public peers in the order
    given; never one we hold, never one that failed within :data:`RELAY_RETRY_S`.

Relay service admission (:class:`CircuitBook`) and pacing (:class:`ByteBucket`): the
limits of docs/bench/nat.md, "Recommended design". Property-tested
(tests/overlay/core/test_relaying.py).

Pure: no trio, libp2p, socket or clock; time comes in as ``now``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CIRCUIT_DURATION_S", "CIRCUIT_IDLE_S", "CIRCUIT_DATA_BYTES", "MAX_RESERVATIONS", "RESERVATION_TTL_S",
    "MAX_CIRCUITS_PER_DEST", "MAX_CIRCUITS", "MAX_CIRCUITS_PER_SUBNET", "RELAY_RATE_BPS",
    "CIRCUIT_RATE_BPS", "RESERVE_AT", "RENEW_FRACTION", "PROBE_EVERY_S", "PROBE_TIMEOUT_S",
    "RELAY_RETRY_S",
    "is_circuit", "transport_part", "circuit_addr", "relay_of_circuit", "ip_of",
    "is_private_ip", "reachability_from_addrs", "keep_peer_addr", "RelayChooser",
    "CircuitBook", "ByteBucket",
]

#: per circuit (a whole A<->B connection, not one request): ~55 KB per inference exchange
#: plus heartbeats makes this hundreds of requests; a cut circuit is redialled in 0.1-0.3 s
CIRCUIT_DURATION_S = 600
#: a circuit that carried nothing either way for this long is cut: a live connection
#: carries our heartbeat every 0.5 s; a dead or abandoned one would hold a slot until
#: CIRCUIT_DURATION_S (measured in the lab: abandoned circuits filled a relay's slots)
CIRCUIT_IDLE_S = 30.0
CIRCUIT_DATA_BYTES = 32 * 1024 * 1024
MAX_RESERVATIONS = 64
RESERVATION_TTL_S = 900
#: circuits to one reserved destination (the library enforces it per reservation too)
MAX_CIRCUITS_PER_DEST = 4
MAX_CIRCUITS = 64
#: circuits from one source /24: the open-network subnet caps apply to relayed dials too
MAX_CIRCUITS_PER_SUBNET = 8
#: bytes/s over all circuits, and per circuit (worst case 64 x 1 MB/s, bounded by 4 MB/s)
RELAY_RATE_BPS = 4_000_000
CIRCUIT_RATE_BPS = 1_000_000
#: relays a private node holds reservations at
RESERVE_AT = 2
#: renew a reservation when this share of its TTL has passed
RENEW_FRACTION = 0.8
#: liveness probe of each relay held: a frozen relay keeps its TCP connection open
PROBE_EVERY_S = 5.0
PROBE_TIMEOUT_S = 3.0
#: a relay that refused or failed is not asked again for this long
RELAY_RETRY_S = 30.0

_CIRCUIT = "/p2p-circuit"
# RFC 1918, CGNAT (RFC 6598), link-local, IPv6 ULA and link-local: behind someone's NAT
PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16",
    "fc00::/7", "fe80::/10"))


def is_circuit(addr: str) -> bool:
    return _CIRCUIT in addr


def transport_part(addr: str) -> str:
    """``addr`` without its trailing ``/p2p/<peer>`` (a circuit address keeps its relay's
    ``/p2p/R`` and ends at ``/p2p-circuit``)."""
    if is_circuit(addr):
        return addr[: addr.index(_CIRCUIT) + len(_CIRCUIT)]
    return addr.split("/p2p/")[0]


def circuit_addr(relay_transport: str, relay_b58: str) -> str:
    """Our transport address through relay ``relay_b58`` at ``relay_transport``."""
    return f"{transport_part(relay_transport)}/p2p/{relay_b58}{_CIRCUIT}"


def relay_of_circuit(addr: str) -> str | None:
    """The relay's peer id (base58) in a circuit address, or None."""
    if not is_circuit(addr):
        return None
    head = addr[: addr.index(_CIRCUIT)]
    if "/p2p/" not in head:
        return None
    return head.rsplit("/p2p/", 1)[1] or None


def ip_of(addr: str) -> str | None:
    """The IP of a ``/ip4/...`` or ``/ip6/...`` multiaddr string (its first hop)."""
    parts = addr.split("/") if isinstance(addr, str) else []
    if len(parts) < 3 or parts[0] != "" or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def ip_in_nets(ip: str, nets, *, invalid: bool) -> bool:
    """Whether ``ip`` lies in one of ``nets``; ``invalid`` for text that is no IP."""
    try:
        a = ipaddress.ip_address(ip)
    except ValueError:
        return invalid
    return any(a in net for net in nets if net.version == a.version)


def is_private_ip(ip: str) -> bool:
    """True for addresses behind somebody's NAT (module docstring); False for loopback."""
    return ip_in_nets(ip, PRIVATE_NETS, invalid=False)


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def reachability_from_addrs(addrs: Iterable[str]) -> str:
    """``public`` | ``private`` | ``unknown`` from our own transport addresses."""
    kinds = set()
    for a in addrs:
        if is_circuit(a):
            continue
        ip = ip_of(a)
        if ip is None or ip in ("0.0.0.0", "::"):
            continue
        kinds.add("loopback" if _is_loopback(ip) else
                  "private" if is_private_ip(ip) else "public")
    if "public" in kinds:
        return "public"
    if "private" in kinds:
        return "private"
    return "unknown"


def _same_subnet(ip: str, own_ips: Iterable[str]) -> bool:
    try:
        a = ipaddress.ip_address(ip)
    except ValueError:
        return False
    prefix = 24 if a.version == 4 else 64
    net = ipaddress.ip_network(f"{a}/{prefix}", strict=False)
    for own in own_ips:
        try:
            if ipaddress.ip_address(own) in net:
                return True
        except ValueError:
            continue
    return False


def keep_peer_addr(addr: str, own_ips: Iterable[str]) -> bool:
    """Whether a peer's address is worth storing and dialling (module docstring)."""
    if is_circuit(addr):
        return True
    ip = ip_of(addr)
    if ip is None or not is_private_ip(ip):
        return True  # global, loopback (local clusters) or a DNS name
    return _same_subnet(ip, own_ips)


@dataclass
class RelayChooser:
    """Which relays to reserve at next (module docstring). Candidates are full relay
    multiaddrs (``.../p2p/R``) keyed by relay id; failures are remembered for
    ``retry_s``."""

    retry_s: float = RELAY_RETRY_S
    failed_at: dict[str, float] = field(default_factory=dict)

    def failed(self, relay: str, now: float) -> None:
        self.failed_at[relay] = now

    def succeeded(self, relay: str) -> None:
        self.failed_at.pop(relay, None)

    def next(self, bootstrap: Sequence[tuple[str, str]], known: Sequence[tuple[str, str]],
             held: Iterable[str], now: float, want: int) -> list[tuple[str, str]]:
        """Up to ``want`` (relay id, addr) pairs to try now, bootstrap peers first."""
        held = set(held)
        out: list[tuple[str, str]] = []
        seen: set[str] = set()
        for relay, addr in [*bootstrap, *known]:
            if len(out) >= want:
                break
            if relay in held or relay in seen:
                continue
            seen.add(relay)
            at = self.failed_at.get(relay)
            if at is not None and now - at < self.retry_s:
                continue
            out.append((relay, addr))
        return out


class CircuitBook:
    """Admission of circuits at a relay (module docstring): total, per destination and
    per source subnet; every admitted circuit is released exactly once."""

    def __init__(self, max_total: int = MAX_CIRCUITS, per_dest: int = MAX_CIRCUITS_PER_DEST,
                 per_subnet: int = MAX_CIRCUITS_PER_SUBNET) -> None:
        self.max_total, self.per_dest, self.per_subnet = max_total, per_dest, per_subnet
        self.by_dest: dict[str, int] = {}
        self.by_subnet: dict[str, int] = {}
        self.open: dict[int, tuple[str, str]] = {}
        self._next = 0
        self.total = 0  # admitted since start
        self.refused: dict[str, int] = {}

    def admit(self, dest: str, src_subnet: str) -> int | str:
        """A circuit ticket (int), or the refusal reason (str)."""
        if len(self.open) >= self.max_total:
            why = "relay_full"
        elif self.by_dest.get(dest, 0) >= self.per_dest:
            why = "destination_full"
        elif self.by_subnet.get(src_subnet, 0) >= self.per_subnet:
            why = "subnet_full"
        else:
            self._next += 1
            self.open[self._next] = (dest, src_subnet)
            self.by_dest[dest] = self.by_dest.get(dest, 0) + 1
            self.by_subnet[src_subnet] = self.by_subnet.get(src_subnet, 0) + 1
            self.total += 1
            return self._next
        self.refused[why] = self.refused.get(why, 0) + 1
        return why

    def release(self, ticket: int) -> None:
        entry = self.open.pop(ticket, None)
        if entry is None:
            return
        dest, subnet = entry
        for table, key in ((self.by_dest, dest), (self.by_subnet, subnet)):
            left = table[key] - 1
            if left:
                table[key] = left
            else:
                del table[key]


class ByteBucket:
    """Pacing: ``rate`` bytes/s with ``burst`` bytes of credit. :meth:`take` charges
    ``n`` bytes at ``now`` and returns how long the sender waits before sending them;
    the credit may go negative (the debt is what the wait pays back), so a chunk larger
    than the burst is delayed, never refused. Bound (property-tested): bytes charged at
    or before their release time ``t`` never exceed ``burst + rate * (t - t0)``."""

    def __init__(self, rate: float, burst: float) -> None:
        if not (rate > 0 and burst > 0):
            raise ValueError("rate and burst must be > 0")
        self.rate, self.burst = float(rate), float(burst)
        self.credit = float(burst)
        self.at: float | None = None

    def take(self, n: int, now: float) -> float:
        if self.at is None:
            self.at = now
        if now > self.at:
            self.credit = min(self.burst, self.credit + (now - self.at) * self.rate)
            self.at = now
        self.credit -= n
        return 0.0 if self.credit >= 0 else -self.credit / self.rate
