"""Slow peers: whole-frame deadlines and the admission of request streams.

Issue 14, finding 2: five fresh identities each opened 64 ``/prefixmesh/infer`` streams,
announced a 512 KiB frame and sent one byte every 5 s. Reads had a timeout each, so a
trickle held a slot forever; the per-peer cap (64) held, the global cap (256) fell, and
every honest request got ``overloaded``. Two defences live here, as pure code:

**Whole-frame deadlines** (:func:`frame_budget_s`): a frame (or a raw length-prefixed
message) must arrive complete within a budget that starts at its first byte and grows
with the size its length prefix announces: ``FRAME_BASE_S`` plus the time to move the
announced bytes at ``FRAME_MIN_RATE`` bytes/s, at most ``FRAME_MAX_S``. Until the prefix
is complete the budget of the largest allowed frame applies. ``overlay/host.py``
(``FramedStream.receive`` / ``receive_raw``) enforces it on every protocol.

**Stream slots** (:class:`StreamSlots`): the request streams a node answers at once.
A slot is *incomplete* while its first frame (the REQUEST) is still being read, and
*complete* once it has arrived. Budgets:

* at most ``capacity`` slots in all, and ``per_peer`` per peer with history (up on our
  heartbeat for 30 s, ``Heartbeat.is_known``) or ``per_new_peer`` per other peer;
* peers without history together hold at most ``new_capacity`` slots, so peers with
  history always keep ``capacity - new_capacity`` for themselves;
* when a budget is full, a newcomer is still admitted by **shedding the oldest
  incomplete slot** of that budget (a peer without history's first, then any): an
  honest client sends its REQUEST at once, so its slot completes in milliseconds and
  is never the oldest incomplete one for long, while a trickling peer's slots are.
  Complete slots (requests being served) are never shed; when every slot is complete
  the node is really busy and says ``overloaded``.

A peer over its own per-peer cap is refused, never served by shedding (it would only
shed itself or others to make room for more of the same).

Pure code: no clock reads (``now`` is passed in), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "FRAME_BASE_S",
    "FRAME_MIN_RATE",
    "FRAME_MAX_S",
    "frame_budget_s",
    "Slot",
    "Admission",
    "StreamSlots",
]

FRAME_BASE_S = 5.0  # any frame: this long, plus its transfer time at the minimum rate
FRAME_MIN_RATE = 128 * 1024  # bytes/s; a link slower than 1 Mbit/s is not served
FRAME_MAX_S = 60.0  # hard cap, whatever the announced size (8 MiB digest messages)


def frame_budget_s(announced_bytes: int | None, max_bytes: int) -> float:
    """Seconds a frame may take from its first byte to its last: for the announced body
    size, or for ``max_bytes`` while the length prefix is incomplete (``None``)."""
    n = max_bytes if announced_bytes is None else min(announced_bytes, max_bytes)
    return min(FRAME_MAX_S, FRAME_BASE_S + max(0, n) / FRAME_MIN_RATE)


@dataclass
class Slot:
    id: int
    peer: bytes
    known: bool  # the peer had history when the slot was opened
    opened: float
    complete: bool = False


@dataclass
class Admission:
    """What :meth:`StreamSlots.open` decided: a slot (or None and why), and the slots
    shed to make room (their streams must be reset by the caller)."""

    slot: Slot | None
    shed: list[Slot] = field(default_factory=list)
    refusal: str = ""


class StreamSlots:
    def __init__(self, capacity: int = 256, per_peer: int = 64, per_new_peer: int = 32,
                 new_capacity: int = 192):
        if not 1 <= per_new_peer <= new_capacity <= capacity or not 1 <= per_peer <= capacity:
            raise ValueError("need 1 <= per_new_peer <= new_capacity <= capacity and "
                             "1 <= per_peer <= capacity")
        self.capacity = capacity
        self.per_peer = per_peer
        self.per_new_peer = per_new_peer
        self.new_capacity = new_capacity
        self._slots: dict[int, Slot] = {}  # insertion order = opening order
        self._by_peer: dict[bytes, int] = {}
        self._new = 0
        self._next_id = 0
        self.shed_total = 0

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def new_peer_slots(self) -> int:
        return self._new

    def held_by(self, peer: bytes) -> int:
        return self._by_peer.get(peer, 0)

    def incomplete(self) -> int:
        return sum(1 for s in self._slots.values() if not s.complete)

    def open(self, peer: bytes, known: bool, now: float) -> Admission:
        """Admit a new stream of ``peer`` (``known``: it has history), shedding the
        oldest incomplete slot of a full budget if need be."""
        cap = self.per_peer if known else self.per_new_peer
        if self._by_peer.get(peer, 0) >= cap:
            return Admission(None, refusal="too many open request streams from this peer")
        victim: Slot | None = None
        if not known and self._new >= self.new_capacity:
            victim = self._oldest_incomplete(new_only=True)
            if victim is None:
                return Admission(None, refusal="too many open request streams from new peers")
        elif len(self._slots) >= self.capacity:
            victim = self._oldest_incomplete(new_only=True) or self._oldest_incomplete(False)
            if victim is None:
                return Admission(None, refusal="too many open request streams")
        shed = [self._remove(victim)] if victim is not None else []
        self.shed_total += len(shed)
        slot = Slot(self._next_id, bytes(peer), known, now)
        self._next_id += 1
        self._insert(slot)
        return Admission(slot, shed)

    def complete(self, slot: Slot) -> None:
        """The slot's first frame arrived: it is never shed from now on."""
        slot.complete = True

    def close(self, slot: Slot) -> None:
        """The stream ended (also fine for a slot that was shed)."""
        if self._slots.get(slot.id) is slot:
            self._remove(slot)

    def _oldest_incomplete(self, new_only: bool) -> Slot | None:
        for s in self._slots.values():
            if not s.complete and (not new_only or not s.known):
                return s
        return None

    def _insert(self, slot: Slot) -> None:
        self._slots[slot.id] = slot
        self._by_peer[slot.peer] = self._by_peer.get(slot.peer, 0) + 1
        self._new += not slot.known

    def _remove(self, slot: Slot) -> Slot:
        del self._slots[slot.id]
        left = self._by_peer[slot.peer] - 1
        if left:
            self._by_peer[slot.peer] = left
        else:
            del self._by_peer[slot.peer]
        self._new -= not slot.known
        return slot
