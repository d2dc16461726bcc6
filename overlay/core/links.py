"""Our own links to the members: which of them are up *for us* (routing, forwarding).

SWIM (:mod:`.membership`) says who is alive in the mesh; a member the others vouch for
may still be out of *our* reach: the relay our connection ran through died, a NAT mapping
expired, our connection is wedged. Forwarding to it would fail on opening a stream. So a
node routes only to members it has reached itself, lately, and the membership decides
the rest:

* **Up for us**: the membership holds the member ALIVE and our link to it is good, that
  is, its latest event is an answer to one of our own direct PINGs (an ACK on the
  member's own stream), not a failure: a forward that could not open a stream, a probe
  of ours it answered only through others (or not at all) by the end of the period, a
  message we could not send it.
* **Flap rule**: a SUSPECT member whose link is good is up for us again as soon as it
  answers a direct PING of ours after the suspicion reached us (and an ALIVE one as soon
  as its refutation arrives): a peer that freezes and thaws is used while it runs, not
  only once the mesh has settled on its incarnation.
* **Checks**: a live member (ALIVE or SUSPECT) that is not up for us gets a direct PING
  (the shell re-dials it for that, with its newest addresses) when :meth:`LinkView.due`
  says so: a suspect once per period (its suspicion ends within the timeout anyway), an
  alive one after each failure and then with backoff while it stays silent
  (:data:`MAX_CHECK_BACKOFF` periods at most), never more than
  :data:`MAX_CHECKS_PER_TICK` at once. Members whose link is good are probed only by the
  round, so the extra traffic is bounded by the members we lost, not by N. Every
  :data:`FRESH_CONNECTION_EVERY`-th check a member leaves unanswered goes over a fresh
  connection (:meth:`LinkView.wants_fresh_connection`): the shell drops the old one first.

Pure (times come in as ``now``); the node's shell is ``overlay/swim.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .membership import ALIVE, PROBE_INTERVAL_S, SUSPECT

__all__ = ["LinkView", "MAX_CHECKS_PER_TICK", "MAX_CHECK_BACKOFF", "FRESH_CONNECTION_EVERY"]

#: direct link checks started by one call of :meth:`LinkView.due` (a tick): a mesh that
#: loses many members at once costs this many extra PINGs per period, not one per member
MAX_CHECKS_PER_TICK = 4
#: periods between checks of an ALIVE member that keeps not answering us: long enough to
#: cost little, short enough that a re-reachable peer is back within a probe round or so
MAX_CHECK_BACKOFF = 8
#: every this many direct checks a member leaves unanswered, the shell drops its connection
#: to it and dials a fresh one for the check: a connection wedged on either side (seen
#: after a 20 s SIGSTOP at N=32: streams opened and never written) answers nothing, however
#: many new streams it carries. 4 (the 4th check comes 7 periods after the first): with 2,
#: members that were merely slow to answer on a loaded machine lost their connections too,
#: and a 32-node mesh took 25-36 s to form instead of 10 (docs/SCALING.md)
FRESH_CONNECTION_EVERY = 4


@dataclass
class _Link:
    ok: bool = False  # the latest event: an answer to our direct PING (True) or a failure
    answered_since_suspected: bool = False  # a direct answer after the suspicion reached us
    suspect: bool = False
    silent_checks: int = 0  # checks sent since its latest direct answer
    next_check_at: float = 0.0


class LinkView:
    """Per-member state of our own link (module docstring)."""

    def __init__(self) -> None:
        self._links: dict[bytes, _Link] = {}
        self._not_up: set[bytes] = set()  # tracked members that may need a check

    def track(self, peer: bytes) -> None:
        """``peer`` is a member now (idempotent); not up for us until it answers."""
        if peer not in self._links:
            self._links[peer] = _Link()
            self._not_up.add(peer)

    def forget(self, peer: bytes) -> None:
        self._links.pop(peer, None)
        self._not_up.discard(peer)

    def __contains__(self, peer: bytes) -> bool:
        return peer in self._links

    def answered(self, peer: bytes) -> None:
        """``peer`` answered one of our own direct PINGs."""
        link = self._links.get(peer)
        if link is None:
            return
        link.ok = True
        link.silent_checks = 0
        if link.suspect:
            link.answered_since_suspected = True
        if not link.suspect or link.answered_since_suspected:
            self._not_up.discard(peer)

    def failed(self, peer: bytes, now: float) -> bool:
        """A direct contact of ours with ``peer`` failed. True when that is news (the link
        was good): then it is checked at the next tick; a link that was failing already
        keeps its backoff, so a dial that fails at once does not become a dial loop."""
        link = self._links.get(peer)
        if link is None:
            return False
        news = link.ok
        if news:
            link.ok = False
            link.next_check_at = min(link.next_check_at, now)
        self._not_up.add(peer)
        return news

    def wants_fresh_connection(self, peer: bytes) -> bool:
        """Whether the check :meth:`due` just returned for ``peer`` should go over a fresh
        connection (:data:`FRESH_CONNECTION_EVERY`)."""
        link = self._links.get(peer)
        return (link is not None and link.silent_checks >= FRESH_CONNECTION_EVERY
                and link.silent_checks % FRESH_CONNECTION_EVERY == 0)

    def state_changed(self, peer: bytes, state: str, now: float) -> None:
        """The membership's state of ``peer`` changed (ALIVE, SUSPECT or DEAD)."""
        link = self._links.get(peer)
        if link is None:
            return
        if state == SUSPECT:
            if not link.suspect:
                link.suspect, link.answered_since_suspected = True, False
                link.next_check_at = min(link.next_check_at, now)
                self._not_up.add(peer)
        else:
            link.suspect = link.answered_since_suspected = False
            if state != ALIVE:  # dead: its next life starts unanswered
                link.ok = False
                self._not_up.add(peer)

    def is_up(self, peer: bytes, state: str | None) -> bool:
        """Up for us, given the membership's ``state`` of ``peer``."""
        link = self._links.get(peer)
        if link is None or not link.ok:
            return False
        if state == ALIVE:
            return True
        return state == SUSPECT and link.answered_since_suspected

    def due(self, now: float, state_of: Callable[[bytes], str | None]) -> list[bytes]:
        """The live members to PING directly now (module docstring, *Checks*); each one
        returned is scheduled for its next check."""
        ready = []
        for peer in list(self._not_up):
            link = self._links[peer]
            state = state_of(peer)
            if self.is_up(peer, state):
                self._not_up.discard(peer)
            elif state in (ALIVE, SUSPECT) and now >= link.next_check_at:
                ready.append((link.next_check_at, peer))
        ready.sort()
        out = []
        for _, peer in ready[:MAX_CHECKS_PER_TICK]:
            link = self._links[peer]
            link.silent_checks += 1
            periods = 1 if link.suspect else min(2 ** (link.silent_checks - 1), MAX_CHECK_BACKOFF)
            link.next_check_at = now + periods * PROBE_INTERVAL_S
            out.append(peer)
        return out
