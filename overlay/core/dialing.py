"""Bounded dialing: addresses peers tell us about are hints, never orders.

Why
---
Every digest record carries its origin's addresses, and anyone can sign records with fresh
keys: one exchange of 1,100 records, each naming the same 8 foreign addresses, made a node
dial those addresses 2,763 times in ~20 s (a connection reflector aimed wherever the
records point) and starve its own inbound connections (issue 14, finding 1). This module
decides, for the heartbeat (``overlay/heartbeat.py``), *whether* a dial may start now and
*which* of a peer's addresses it may use, and *when* a peer that never answered is given up.

DialGate
--------
A dial of a peer we are not connected to must pass, at ``now``:

- a global limit on dials in flight (:data:`MAX_CONCURRENT_DIALS`) and a global token
  bucket (:data:`DIAL_RATE_PER_S`, burst :data:`DIAL_BURST`);
- for each address it uses, a per-address bucket (:data:`ADDR_RATE_PER_S`, burst
  :data:`ADDR_BURST`) and a per-/24 (IPv6 /48) bucket (:data:`SUBNET_RATE_PER_S`, burst
  :data:`SUBNET_BURST`); at most :data:`MAX_ADDRS_PER_DIAL` addresses per dial (a record
  names up to 8, and each one is a TCP connection attempt at its target).

Addresses whose buckets are empty are skipped; if none is left (or the global limits say
no), :meth:`DialGate.admit` returns None and charges nothing (a refused dial costs
nothing, so knocking more often never empties the buckets faster). A dial that connected (:meth:`DialGate.done` with ``ok=True``) refunds
its addresses' tokens: reaching a live peer is never what the limits are for.

Guarantee (property-tested): over any window of ``T`` seconds, dial attempts to one address
are at most ``ADDR_BURST + ADDR_RATE_PER_S * T`` plus the refunded successes, and all
dials at most ``DIAL_BURST + DIAL_RATE_PER_S * T``; at no time are more than
``MAX_CONCURRENT_DIALS`` in flight.

Giving up
---------
:func:`give_up` says when a monitored peer is forgotten: a peer that has *never* answered
after :data:`NEVER_UP_ATTEMPTS` failed dials (exponential backoff between them), or one
that was up and has been down longer than ``forget_after_s``. The heartbeat also gives up
at once on a never-answered peer all of whose addresses are :meth:`DialGate.saturated`
(so such hints never hold a monitoring slot while they wait for tokens).

Pure: no trio, libp2p, socket, time or os; time comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .limits import PeerRateLimiter, subnet_of_multiaddr

__all__ = [
    "DIAL_RATE_PER_S",
    "DIAL_BURST",
    "MAX_CONCURRENT_DIALS",
    "ADDR_RATE_PER_S",
    "ADDR_BURST",
    "SUBNET_RATE_PER_S",
    "SUBNET_BURST",
    "MAX_ADDRS_PER_DIAL",
    "NEVER_UP_ATTEMPTS",
    "MAX_HINT_PEERS",
    "DialTicket",
    "DialGate",
    "give_up",
]

#: sustained dials per second of peers we are not connected to. An honest node needs few:
#: connected peers are kept, so dials happen at start-up (the burst) and when a peer
#: restarts; 1/s still reaches a 60-peer mesh within a minute after the burst.
DIAL_RATE_PER_S = 1.0
#: dials allowed at once after a quiet spell: a start-up with a dozen bootstrap and gossip
#: peers dials them all without waiting
DIAL_BURST = 16.0
#: dials in flight at once: each holds a socket, a trio task and, once TCP connects, a
#: Noise handshake; py-libp2p counts a connection against ``max_connections`` only once
#: it is upgraded, so pending dials must be bounded here
MAX_CONCURRENT_DIALS = 8
#: dial attempts per second at one address after its burst: an address that does not
#: answer is knocked on at most once per 10 s (a peer that restarts is found again within
#: its 10 s heartbeat backoff anyway)
ADDR_RATE_PER_S = 0.1
#: attempts at one address before its rate applies: the heartbeat's first retries
#: (0.5 s, 1 s, 2 s) go through
ADDR_BURST = 3.0
#: dial attempts per second into one /24 (IPv6 /48) after the burst: the reflector of
#: finding 1 aimed at one victim network is bounded by this, whatever the number of
#: addresses the records name in it
SUBNET_RATE_PER_S = 1.0
#: attempts into one /24 before its rate applies (a LAN or loopback cluster of 32 nodes
#: starting together dials all its peers at once)
SUBNET_BURST = 32.0
#: addresses used by one dial: a record lists up to 8 and py-libp2p tries each (a TCP
#: connection attempt each); the newest two cover a peer that moved
MAX_ADDRS_PER_DIAL = 2
#: failed dials after which a peer that never answered is forgotten (backoff 0.5 s, 1 s,
#: 2 s, 4 s between them: given up ~8 s after it was learned)
NEVER_UP_ATTEMPTS = 4
#: peers learned only from hints (digest records, DHT, PEERS replies, mDNS) that are
#: dialled and monitored at once; the rest wait, and take a slot when one frees. Peers
#: that dial us, bootstrap peers and peers we route to do not count.
MAX_HINT_PEERS = 32


@dataclass(frozen=True)
class DialTicket:
    """An admitted dial: the addresses it may use and the buckets they were charged to."""

    addrs: tuple[str, ...]
    subnets: tuple[str, ...]


def _key(text: str) -> bytes:
    return text.encode("utf-8", "replace")


class DialGate:
    """Global, per-address and per-subnet dial limits (module docstring)."""

    def __init__(
        self,
        *,
        rate_per_s: float = DIAL_RATE_PER_S,
        burst: float = DIAL_BURST,
        max_in_flight: int = MAX_CONCURRENT_DIALS,
        addr_rate_per_s: float = ADDR_RATE_PER_S,
        addr_burst: float = ADDR_BURST,
        subnet_rate_per_s: float = SUBNET_RATE_PER_S,
        subnet_burst: float = SUBNET_BURST,
        max_addrs_per_dial: int = MAX_ADDRS_PER_DIAL,
        max_tracked: int = 4096,
    ) -> None:
        if max_in_flight < 1 or max_addrs_per_dial < 1:
            raise ValueError("max_in_flight and max_addrs_per_dial must be >= 1")
        self._global = PeerRateLimiter(rate_per_s, burst, max_peers=1)
        self._addrs = PeerRateLimiter(addr_rate_per_s, addr_burst, max_peers=max_tracked)
        self._subnets = PeerRateLimiter(subnet_rate_per_s, subnet_burst, max_peers=max_tracked)
        self.max_in_flight = max_in_flight
        self.max_addrs_per_dial = max_addrs_per_dial
        self.in_flight = 0
        self.admitted = 0
        self.refused = 0

    def _usable(self, addrs: Sequence[str], now: float) -> list[tuple[str, str]]:
        """Up to ``max_addrs_per_dial`` (addr, subnet) pairs whose buckets have a token,
        in the given order (newest first), one per address."""
        picked: list[tuple[str, str]] = []
        subnet_use: dict[str, int] = {}
        for a in addrs:
            if len(picked) >= self.max_addrs_per_dial:
                break
            if any(a == p for p, _ in picked):
                continue
            subnet = subnet_of_multiaddr(a) or "none"
            need = subnet_use.get(subnet, 0) + 1
            if self._addrs.tokens(_key(a), now) < 1 or self._subnets.tokens(
                _key(subnet), now
            ) < need:
                continue
            subnet_use[subnet] = need
            picked.append((a, subnet))
        return picked

    def admit(self, addrs: Sequence[str], now: float) -> DialTicket | None:
        """A ticket for a dial now using some of ``addrs``, or None (nothing charged)."""
        if self.in_flight >= self.max_in_flight or self._global.tokens(b"", now) < 1:
            self.refused += 1
            return None
        picked = self._usable(addrs, now)
        if not picked:
            self.refused += 1
            return None
        self._global.allow(b"", now)
        for a, subnet in picked:
            self._addrs.allow(_key(a), now)
            self._subnets.allow(_key(subnet), now)
        self.in_flight += 1
        self.admitted += 1
        return DialTicket(tuple(a for a, _ in picked), tuple(s for _, s in picked))

    def saturated(self, addrs: Sequence[str], now: float) -> bool:
        """True when every one of ``addrs`` is over its address or subnet budget: a hint
        naming only addresses others already knock at as fast as allowed (finding 1's
        records all named the same 8) is given up at once rather than queued."""
        return not self._usable(addrs, now)

    def retry_after_s(self, addrs: Sequence[str], now: float) -> float:
        """Seconds until :meth:`admit` might say yes for ``addrs`` (a hint for sleeping)."""
        wait = self._global.retry_after_s(b"", now)
        per_addr = [
            max(self._addrs.retry_after_s(_key(a), now),
                self._subnets.retry_after_s(_key(subnet_of_multiaddr(a) or "none"), now))
            for a in addrs
        ]
        return max(wait, min(per_addr, default=0.0))

    def done(self, ticket: DialTicket, ok: bool) -> None:
        """The dial of ``ticket`` ended; a connected one gives its address tokens back."""
        self.in_flight = max(0, self.in_flight - 1)
        if ok:
            for a in ticket.addrs:
                self._addrs.forget(_key(a))  # a fresh bucket is a full one


def give_up(
    *, ever_up: bool, failed_attempts: int, down_for_s: float | None, forget_after_s: float
) -> bool:
    """True when a monitored peer should be forgotten (module docstring, *Giving up*)."""
    if not ever_up:
        return failed_attempts >= NEVER_UP_ATTEMPTS
    return down_for_s is not None and down_for_s > forget_after_s
