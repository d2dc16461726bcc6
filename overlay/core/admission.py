"""Admission by merit: full tables evict their least valuable entry instead of refusing
newcomers (issue 14, finding 1: the origin table and the peer directory filled
first-come with 1,100 fresh identities and kept honest newcomers out for good).

Value of an entry, compared as a tuple (smaller is less valuable, evicted first):

1. ``merit``: 0 never seen up (a hint only), 1 seen up (answered our heartbeat),
   2 long-standing (connected long enough to count as known; the caller decides);
2. minus the number of entries that share its subnet (/24, /48): one address block
   crowding the table is the first to give way;
3. ``since``: when the entry came; among equals the oldest goes.

A newcomer is admitted into a full table iff it is worth at least as much as the least
valuable entry (that entry is evicted); so a flood of never-seen-up identities only
ever displaces other never-seen-up entries, never one that was seen up.

:class:`MeritTable` keeps entries and their subnet counts and answers ``victim`` in
O(n); it is pure (no clock: ``since`` comes in), and ``subnet`` is the caller's string
(``None``: exempt, e.g. loopback, counts in no bucket).

Per-subnet cap: :meth:`MeritTable.subnet_full` says whether a subnet already holds
``max_per_subnet`` entries; the caller then admits a newcomer of that subnet only by
evicting the least valuable entry *of the same subnet* (:meth:`MeritTable.victim` with
``subnet``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["INBOUND_HEADROOM", "INBOUND_LIMIT", "InboundConn", "Merit", "MeritTable", "NEVER_UP",
           "SEEN_UP", "LONG_STANDING", "inbound_victim"]

NEVER_UP, SEEN_UP, LONG_STANDING = 0, 1, 2


@dataclass(frozen=True)
class Merit:
    merit: int
    subnet: str | None
    since: float


class MeritTable:
    """Entries keyed by any hashable, with their merit, subnet and arrival time."""

    def __init__(self, max_per_subnet: int) -> None:
        if max_per_subnet < 1:
            raise ValueError("max_per_subnet must be >= 1")
        self.max_per_subnet = max_per_subnet
        self.entries: dict[Hashable, Merit] = {}
        self.per_subnet: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def put(self, key: Hashable, merit: Merit) -> None:
        self.remove(key)
        self.entries[key] = merit
        if merit.subnet is not None:
            self.per_subnet[merit.subnet] += 1

    def remove(self, key: Hashable) -> None:
        old = self.entries.pop(key, None)
        if old is not None and old.subnet is not None:
            self.per_subnet[old.subnet] -= 1
            if self.per_subnet[old.subnet] <= 0:
                del self.per_subnet[old.subnet]

    def value(self, m: Merit, merit: int | None = None) -> tuple[int, int, float]:
        crowd = self.per_subnet.get(m.subnet, 0) if m.subnet is not None else 0
        return (m.merit if merit is None else merit, -crowd, m.since)

    def subnet_full(self, subnet: str | None) -> bool:
        return subnet is not None and self.per_subnet.get(subnet, 0) >= self.max_per_subnet

    def victim(self, newcomer: Merit, *, subnet: str | None = None,
               merit_now=None) -> Hashable | None:
        """The entry a ``newcomer`` may displace (least valuable, of ``subnet`` if
        given), or None when every candidate is worth more than the newcomer.

        ``merit_now(key) -> int | None``: the caller's current merit of an entry (it
        changes as peers come up); None keeps the stored one."""
        best_key, best_value = None, None
        for key, m in self.entries.items():
            if subnet is not None and m.subnet != subnet:
                continue
            current = merit_now(key) if merit_now is not None else None
            v = self.value(m, current)
            if best_value is None or v < best_value:
                best_key, best_value = key, v
        if best_value is None:
            return None
        crowd = self.per_subnet.get(newcomer.subnet, 0) if newcomer.subnet else 0
        if (newcomer.merit, -crowd, newcomer.since) >= best_value:
            return best_key
        return None


#: established inbound connections py-libp2p 0.8.1 admits (its resource manager's
#: default ``max_established_inbound``); past it every new inbound connection is closed
INBOUND_LIMIT = 256
#: inbound connections kept free for newcomers: at this many the least valuable
#: inbound connection is closed to make room (:func:`inbound_victim`)
INBOUND_HEADROOM = 8


@dataclass(frozen=True)
class InboundConn:
    """What the host knows of one inbound connection, for :func:`inbound_victim`."""

    peer: bytes
    known: bool  # long-standing (up on our heartbeat long enough): never evicted for a stranger
    streams: int  # open streams now (a connection in use is worth more than an idle one)
    since: float  # when it was established


def inbound_victim(conns: list[InboundConn], newcomer: bytes) -> bytes | None:
    """The inbound connection to close so that ``newcomer`` (just connected) has room
    while inbound connections are at ``INBOUND_LIMIT - INBOUND_HEADROOM``: a stranger's
    (never a known peer's, never the newcomer's), idle before busy, oldest first. A
    flood of idle identities then gives way to each new client instead of locking them
    out (py-libp2p refused every new inbound connection once 256 were held). None when
    below the threshold or only known peers are left."""
    if len(conns) < INBOUND_LIMIT - INBOUND_HEADROOM:
        return None
    strangers = [c for c in conns if not c.known and c.peer != newcomer]
    if not strangers:
        return None
    return min(strangers, key=lambda c: (c.streams > 0, c.since)).peer
