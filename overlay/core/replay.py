"""Replay memory for authenticated requests: ids are remembered until their deadline.

A tenant credential (``node/tenants.py``) binds a request's id, deadline and content, and
is accepted only before the deadline (plus a clock skew). A node that holds the secret
records every request it accepted in a :class:`ReplayWindow` until that moment, so a
captured request cannot be served twice by the same node however many other requests
came in between (issue 14, finding 3: the old memory was the last 8,192 ids, so a replay
after 8,192 newer ones was accepted again).

Memory is bounded by ``capacity`` entries; when that many accepted requests all still
have time left, :meth:`ReplayWindow.admit` answers ``FULL`` and the node refuses new
requests with a retryable ``overloaded`` error until some expire, rather than forgetting
an id that could still be replayed. Only a secret holder can mint entries (the caller
records a request after its credential checked out), and public namespaces need no
replay memory at all (anyone can make their credentials).

Pure code: ``heapq`` only; the caller passes ``now``.
"""

from __future__ import annotations

import heapq

__all__ = ["NEW", "REPLAY", "FULL", "DEFAULT_CAPACITY", "ReplayWindow"]

NEW = "new"
REPLAY = "replay"
FULL = "full"
#: about 100 bytes an entry: 65,536 accepted requests in flight cost under 10 MiB
DEFAULT_CAPACITY = 65_536


class ReplayWindow:
    """Keys (namespace id + request id) remembered until their expiry time."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._expiry: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, key: object) -> bool:
        return key in self._expiry

    def expire(self, now: float) -> int:
        """Forget every key whose expiry is before ``now``; returns how many."""
        n = 0
        while self._heap and self._heap[0][0] < now:
            _, key = heapq.heappop(self._heap)
            del self._expiry[key]
            n += 1
        return n

    def admit(self, key: bytes, expiry: float, now: float) -> str:
        """Record ``key`` until ``expiry``: :data:`NEW`; :data:`REPLAY` if it is still
        remembered; :data:`FULL` (nothing recorded) if ``capacity`` keys are live."""
        self.expire(now)
        if key in self._expiry:
            return REPLAY
        if len(self._expiry) >= self.capacity:
            return FULL
        if expiry < now:  # already past: nothing to remember (the caller refuses it anyway)
            return NEW
        self._expiry[key] = expiry
        heapq.heappush(self._heap, (expiry, key))
        return NEW
