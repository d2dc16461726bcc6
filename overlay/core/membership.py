"""Membership: who is in the mesh and alive, SWIM-style, with bounded per-node traffic.

Why not all-to-all heartbeats: they cost O(N) messages per node per period, so a 1,024-node
mesh spends its whole budget saying "still here". SWIM (Das, Gupta, Motivala, DSN 2002)
probes one member per period and spreads what it learns on the probe messages themselves:

* **Probing.** Every ``PROBE_INTERVAL_S`` a node pings the next member of a shuffled
  round-robin list (each member is probed once per round: bounded detection time). No ACK
  within ``PROBE_TIMEOUT_S``: it asks ``INDIRECT_PROBES`` other members to ping the target
  for it (PING-REQ), so one bad link does not condemn a peer. No ACK by the end of the
  period: the target becomes *suspect*.
* **Suspicion.** A suspect is declared *dead* after ``suspicion_timeout_s`` unless it
  refutes: a node that hears it is suspected raises its incarnation number and spreads
  ALIVE with it. Incarnations order every claim about a member (see :func:`supersedes`).
  The timeout grows with log N because dissemination does.
* **Push-pull on join.** A member heard from for the first time (or back from the dead,
  or speaking under a higher incarnation than we hold: restarted before we declared it
  dead, it remembers nobody; once per incarnation) gets a :class:`Sync`: a window of up
  to ``MAX_SYNC_UPDATES`` alive members, taken like piggybacked claims (what is news to the receiver it spreads on), so a newcomer knows
  much of the mesh after one exchange (cold start of 256 nodes: 74 % of the full view at
  10 s instead of 31 %, docs/SCALING.md).
* **Out-of-round probes.** The shell may probe a member outside the round: a direct
  :meth:`Membership.ping` (its link check: the ACK proves *our* link works, the machine
  ignores it), and :meth:`Membership.probe_failed` when a direct contact of its own failed
  (a forward could not open a stream): the probe's direct part counts as failed, PING-REQs
  go out at once, and no ACK by the end of the period makes the member *suspect*, so the
  mesh learns of a lost peer from the first node that tried it, not a round later.
* **Lifeguard** (Dadgar, Phillips, Currey: "Lifeguard: Local Health Awareness for More
  Accurate Failure Detection", 2018; the ideas of HashiCorp memberlist's awareness and
  suspicion, no code). A node starved of CPU reads ACKs and runs its timers late, so it
  times out probes of healthy peers and suspects them (32 real processes on 2 cores: 758
  false suspicions per node-hour, docs/SCALING.md). Three remedies, all pure:

  - *Local health multiplier* (:attr:`Membership.local_health`, 0..``MAX_LHM``): raised
    when a probe of ours gets no ACK at all (direct or relayed), when we must refute a
    suspicion about ourselves, and when the shell reports that a tick ran late by more
    than ``LATE_TICK_FRACTION`` of the current probe timeout (:meth:`Membership.tick`'s
    ``late_by_s``: the shell knows when it meant to run and when it ran); lowered by a
    probe period with an answered probe and no late tick. The probe interval and the probe
    timeout are multiplied by ``local_health + 1``: a slow node probes less often and
    waits longer instead of accusing others of its own slowness.
  - *Dynamic suspicion timeout*: a suspicion names its accuser
    (:attr:`Update.suspector`, an 8-byte tag); it starts at ``SUSPICION_MAX_MULT`` times the classic
    timeout and falls logarithmically to it as independent confirmations arrive (other
    members suspecting the same member at the same incarnation, each counted once), so a
    lone slow accuser cannot kill anyone before the accused refutes, while a real crash,
    which every prober sees, is still declared dead in about the old time.
  - *Buddy system*: a PING to a suspected member carries the suspicion first, so it learns
    it at once and refutes.

  No NACKs (Lifeguard's third health signal, an indirect probe's helper saying "no answer
  from the target"): they would be a new message type that nodes before them log as bad,
  and up to three more messages per failed probe; the shell's timer lateness measures our
  own slowness directly, which is what missing NACKs were Lifeguard's proxy for.
* **Dissemination.** State changes are queued and piggybacked on PING/PING-REQ/ACK, at most
  ``MAX_PIGGYBACK`` per message, fewest-sent first and newest first among those, each ``RETRANSMIT_MULT * ceil(log10(N+1))``
  times: O(log N) periods to reach everyone, no extra messages.

The node's start incarnation comes from outside (the shell passes its wall-clock epoch, as
it does for digest records), so a restarted node outranks what the mesh remembers of its
previous run. Dead members are remembered for ``DEAD_RETAIN_S`` to outrank stale ALIVE
claims, then forgotten (bounded memory; ``MAX_MEMBERS`` bounds the table).

The state machine is pure, in the style of h11: :meth:`Membership.tick` and
:meth:`Membership.receive` take ``now`` and return the messages to send as
:class:`Send` values; :meth:`next_deadline` says when ``tick`` must run next; state
changes are collected as :class:`MemberEvent` values (:meth:`drain_events`). The node
(trio + libp2p streams) and the simulator (``bench/membership.py``) drive this same class.

Wire form (:func:`encode_message` / :func:`decode_message`): one CBOR array
``[type, seq, incarnation, target, updates]``, updates ``[peer, incarnation, state, addrs]``
(a SUSPECT claim adds its accuser's 8-byte :func:`accuser_tag` as a fifth element, for
Lifeguard's confirmations). A direct ACK (its target is its sender) sends an empty target,
which the receiver fills in with the stream's authenticated peer. An ACK the target sends
itself may add a sixth element, :class:`AckInfo` ``[queue_depth, active, n_ctx,
summary_hash, model, model_name]`` (what the node's routing reads about a peer; the state
machine ignores it, the shell fills and reads it). Decoding is bounded
(:data:`MAX_MESSAGE_BYTES`) and raises only :class:`MembershipError`. The accuser tag and
the empty ACK target came with protocol ``/prefixmesh/swim/1.1.0`` (``overlay/swim.py``):
nodes of 1.0.0 do not speak it, so a mesh runs one version, and a node of the other is
never a member (never up), rather than a source of malformed messages.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import cbor2

from .digest import DigestError, loads_bounded

__all__ = [
    "ALIVE", "SUSPECT", "DEAD", "PROBE_INTERVAL_S", "PROBE_TIMEOUT_S", "INDIRECT_PROBES",
    "MAX_PIGGYBACK", "MAX_MEMBERS", "MAX_MESSAGE_BYTES", "Update", "Ping", "PingReq", "Ack",
    "AckInfo", "Sync", "MAX_SYNC_UPDATES",
    "Message", "Send", "MemberEvent", "Membership", "MembershipError", "supersedes",
    "suspicion_timeout_s", "suspicion_max_timeout_s", "expected_confirmations",
    "dynamic_suspicion_timeout_s", "accuser_tag", "MAX_LHM", "LATE_TICK_FRACTION", "retransmits",
    "encode_message", "decode_message",
]

ALIVE, SUSPECT, DEAD = "alive", "suspect", "dead"
_STATE_CODES = {ALIVE: 0, SUSPECT: 1, DEAD: 2}
_STATE_NAMES = {v: k for k, v in _STATE_CODES.items()}

# SWIM's period; 1 s gives ~1.6 s to a first suspicion and ~4 messages/s per node.
PROBE_INTERVAL_S = 1.0
# Loopback and LAN RTTs are ms, a relayed or intercontinental one ~0.3 s: half a period
# leaves the indirect probes the other half.
PROBE_TIMEOUT_S = 0.5
INDIRECT_PROBES = 3  # SWIM's k: false-positive odds fall geometrically with it
SUSPICION_MULT = 4  # memberlist's default: timeout = 4 x log10(N) periods (>= 4 periods)
# Lifeguard. memberlist's SuspicionMaxTimeoutMult: an unconfirmed suspicion waits 6x the
# classic timeout (24 s at N=10, 43 s at N=64), long enough for a slow accused to hear of
# it and refute even when it is slow itself
SUSPICION_MAX_MULT = 6
# k: independent suspicions that bring the timeout down to the classic one; a crashed
# member is probed by ~1 member per period, so 3 arrive within a few periods
SUSPICION_CONFIRMATIONS = 3
# an accuser is named by a hash prefix, not its 38-byte id: confirmations only need to
# tell accusers apart (a collision costs one confirmation), and every suspicion carries one
ACCUSER_TAG_BYTES = 8
MAX_LHM = 7  # memberlist's 8 awareness levels (0..7): a starved node probes at most 8x slower
# a tick later than this share of the (scaled) probe timeout ate half of an ACK's
# allowance: our own slowness, not the network, would decide the probe
LATE_TICK_FRACTION = 0.5
RETRANSMIT_MULT = 4
MAX_PIGGYBACK = 8  # ~0.5 KB of updates at most per message
MAX_SYNC_UPDATES = 64  # members in one SYNC (a sample; the rest spread by piggyback)
DEAD_RETAIN_S = 120.0  # long enough to outrank a stale ALIVE still circulating
MAX_MEMBERS = 16_384
MAX_ADDRS = 4
MAX_ADDR_CHARS = 256
MAX_PEER_ID_BYTES = 64
MAX_MESSAGE_BYTES = 16 * 1024
MAX_INFO_BYTES = 64  # summary hash and model fingerprint (both 32 bytes today)
MAX_INFO_NAME_CHARS = 64  # a model name (core/models.py MAX_MODEL_NAME_CHARS)
_MAX_LOAD = 2**32
_MAX_INCARNATION = 2**53  # fits a float-free CBOR int and a JSON number

_PING, _PING_REQ, _ACK, _SYNC = 0, 1, 2, 3


class MembershipError(ValueError):
    """A membership message is malformed (the message says what was wrong)."""


@dataclass(frozen=True)
class Update:
    """One claim about a member: ``peer`` is in ``state`` as of ``incarnation``."""

    peer: bytes
    incarnation: int
    state: str
    addrs: tuple[str, ...] = ()
    # a SUSPECT claim's accuser, as its :func:`accuser_tag` (b"": unknown), so that
    # confirmations count distinct members
    suspector: bytes = b""


@dataclass(frozen=True)
class Ping:
    seq: int
    incarnation: int  # the sender's own incarnation
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True)
class PingReq:
    seq: int
    incarnation: int
    target: bytes  # ping this member for me and pass its ACK back
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True)
class AckInfo:
    """What a member says about itself on the ACKs it sends (b"" / "": unchanged since its
    previous ACK on this stream, or not said)."""

    queue_depth: int = 0
    active: int = 0
    n_ctx: int = 0
    summary_hash: bytes = b""
    model: bytes = b""
    model_name: str = ""


@dataclass(frozen=True)
class Sync:
    """Push-pull on join: a window of the sender's alive members, sent to a member it has
    just heard from for the first time (or back from the dead), which learns the mesh at
    once instead of 8 members per probe (``--cold-start`` in the simulator)."""

    seq: int
    incarnation: int
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True)
class Ack:
    seq: int
    incarnation: int
    target: bytes  # the member whose liveness this ACK proves
    updates: tuple[Update, ...] = ()
    info: AckInfo | None = None  # the sender's own figures (only when target is the sender)


Message = Ping | PingReq | Ack | Sync


@dataclass(frozen=True)
class Send:
    to: bytes
    message: Message


@dataclass(frozen=True)
class MemberEvent:
    peer: bytes
    state: str  # ALIVE (joined or refuted), SUSPECT, DEAD, or "forgotten"
    addrs: tuple[str, ...] = ()
    incarnation: int = 0


def supersedes(new: Update, old: Update) -> bool:
    """Whether claim ``new`` replaces ``old`` about the same member (SWIM's ordering).

    A higher incarnation always wins; at the same incarnation DEAD beats SUSPECT beats ALIVE,
    so only the member itself (by raising its incarnation) can refute a suspicion.
    """
    if new.incarnation != old.incarnation:
        return new.incarnation > old.incarnation
    return _STATE_CODES[new.state] > _STATE_CODES[old.state]


def accuser_tag(peer: bytes) -> bytes:
    """How a SUSPECT claim names its accuser (:attr:`Update.suspector`)."""
    return hashlib.sha256(peer).digest()[:ACCUSER_TAG_BYTES]


def suspicion_timeout_s(n_members: int) -> float:
    """The classic SWIM timeout: Lifeguard's minimum (a suspicion fully confirmed)."""
    return SUSPICION_MULT * max(1.0, math.log10(max(n_members, 1))) * PROBE_INTERVAL_S


def suspicion_max_timeout_s(n_members: int) -> float:
    """Lifeguard's maximum: a suspicion nobody else has confirmed."""
    return SUSPICION_MAX_MULT * suspicion_timeout_s(n_members)


def expected_confirmations(n_members: int) -> int:
    """k, or 0 (no wait for confirmations) in a mesh too small to give k: the members
    other than the accused and the accuser (memberlist's rule)."""
    return SUSPICION_CONFIRMATIONS if n_members - 2 >= SUSPICION_CONFIRMATIONS else 0


def dynamic_suspicion_timeout_s(n_members: int, confirmations: int) -> float:
    """Lifeguard's suspicion timeout after ``confirmations`` independent confirmations:
    the maximum with none, falling logarithmically to the minimum at k (and below)."""
    lo = suspicion_timeout_s(n_members)
    k = expected_confirmations(n_members)
    if confirmations >= k:  # (k = 0 included: a mesh too small to wait for any)
        return lo
    hi = SUSPICION_MAX_MULT * lo
    frac = math.log(max(confirmations, 0) + 1) / math.log(k + 1)
    return max(lo, hi - frac * (hi - lo))


def retransmits(n_members: int) -> int:
    return RETRANSMIT_MULT * max(1, math.ceil(math.log10(n_members + 1)))


@dataclass
class _Member:
    update: Update
    since: float  # when it entered its current state (our clock)


@dataclass
class _Probe:
    target: bytes
    seq: int
    started: float
    timeout_at: float  # no ACK by then: PING-REQs (the scaled probe timeout)
    ends_at: float  # no ACK by then: SUSPECT (the scaled probe period)
    acked: bool = False
    indirect_sent: bool = False


@dataclass
class _Suspicion:
    started: float  # when the member entered SUSPECT at our end
    # who accused it at this incarnation: the first (who does not count) and then each
    # distinct confirmation, at most k of them (b"": an accuser we do not know)
    accusers: set[bytes]

    @property
    def confirmations(self) -> int:
        return len(self.accusers) - 1


class Membership:
    """One node's SWIM state machine (see the module docstring). ``lifeguard=False`` is
    SWIM as it was before Lifeguard, message for message: the simulator's baseline."""

    def __init__(self, self_id: bytes, *, now: float, incarnation: int, rng: random.Random,
                 addrs: Sequence[str] = (), lifeguard: bool = True):
        self.self_id = self_id
        self.lifeguard = lifeguard
        self._tag = accuser_tag(self_id) if lifeguard else b""  # our name as an accuser
        self._lhm = 0  # Lifeguard's local health multiplier, 0..MAX_LHM
        self._late = False  # a tick of this probe period ran late (LHM raised for it)
        self.incarnation = int(incarnation)
        self.addrs = tuple(addrs)[:MAX_ADDRS]
        self._rng = rng
        self._members: dict[bytes, _Member] = {}
        self._ids: list[bytes] = []  # the members' ids, for O(1) random choice
        self._index: dict[bytes, int] = {}
        self._suspects: dict[bytes, _Suspicion] = {}
        self._dead: deque[tuple[float, bytes]] = deque()  # (declared dead at, peer)
        # dissemination queue: bucket k holds the updates sent k times (fewest-sent first)
        self._buckets: list[dict[bytes, Update]] = [{}]
        self._bucket_of: dict[bytes, int] = {}
        self._order: list[bytes] = []  # this round's probe order
        self._probe: _Probe | None = None
        self._checks: dict[bytes, _Probe] = {}  # out-of-round probes (probe_failed), by target
        self._synced: dict[bytes, int] = {}  # the incarnation each member last got a SYNC at
        self._next_probe_at = now
        self._seq = 0
        self._relays: dict[int, tuple[bytes, int, float]] = {}  # our seq -> (asker, seq, t)
        self._events: list[MemberEvent] = []
        self._sync_offset = 0  # where the next SYNC's window of members starts
        self._enqueue(self._self_update())

    # --- what the shell reads --------------------------------------------------------

    def state_of(self, peer: bytes) -> str | None:
        m = self._members.get(peer)
        return m.update.state if m else None

    def alive(self) -> list[bytes]:
        """Members believed alive or merely suspected (still routable), not ourselves."""
        return [p for p, m in self._members.items() if m.update.state != DEAD]

    def incarnation_of(self, peer: bytes) -> int:
        m = self._members.get(peer)
        return m.update.incarnation if m else 0

    def addrs_of(self, peer: bytes) -> tuple[str, ...]:
        m = self._members.get(peer)
        return m.update.addrs if m else ()

    def __len__(self) -> int:
        return len(self._members)

    def drain_events(self) -> list[MemberEvent]:
        out, self._events = self._events, []
        return out

    @property
    def local_health(self) -> int:
        """Lifeguard's local health multiplier: 0 healthy, up to :data:`MAX_LHM`."""
        return self._lhm

    def probe_interval_s(self) -> float:
        """The probe period, scaled by our local health."""
        return PROBE_INTERVAL_S * (self._lhm + 1)

    def probe_timeout_s(self) -> float:
        """How long a probe waits for a direct ACK, scaled by our local health."""
        return PROBE_TIMEOUT_S * (self._lhm + 1)

    def suspicion_deadline(self, peer: bytes) -> float | None:
        """When the suspicion about ``peer`` expires as things stand (None: no suspicion)."""
        s = self._suspects.get(peer)
        return None if s is None else s.started + self._suspicion_timeout(s)

    def next_deadline(self) -> float:
        """The earliest ``now`` at which :meth:`tick` has something to do."""
        times = [self._next_probe_at]
        p = self._probe
        if p is not None and not p.acked and not p.indirect_sent:
            times.append(p.timeout_at)
        if self._suspects:
            times.append(min(s.started + self._suspicion_timeout(s)
                             for s in self._suspects.values()))
        if self._checks:
            times.append(min(c.ends_at for c in self._checks.values()))
        return min(times)

    # --- inputs -------------------------------------------------------------------------

    def learn_state(self, updates: Iterable[Update], now: float) -> None:
        """Take a full member list (a push-pull sync, or a snapshot at start) without
        gossiping it on: its members spread their own news."""
        for u in updates:
            self._apply(u, now, gossip=False)

    def snapshot(self) -> list[Update]:
        """Every member as we know it, ourselves included (what :meth:`learn_state` takes)."""
        return [self._self_update(), *(m.update for m in self._members.values())]

    def set_addrs(self, addrs: Sequence[str]) -> None:
        """Our own addresses changed (a relay, a port mapping): spread them under a new
        incarnation, so they outrank the old ones everywhere."""
        addrs = tuple(addrs)[:MAX_ADDRS]
        if addrs != self.addrs:
            self.addrs = addrs
            self.incarnation = min(self.incarnation + 1, _MAX_INCARNATION)
            self._enqueue(self._self_update())

    def forget(self, peer: bytes) -> None:
        """Drop ``peer`` without a claim about it (the shell gave up dialling a member it
        never reached: nothing to tell the mesh, whose own probes decide)."""
        if peer in self._members:
            self._remove(peer)
            self._order = [p for p in self._order if p != peer]
            p = self._probe
            if p is not None and p.target == peer:
                self._probe = None

    def ping(self, peer: bytes) -> Send | None:
        """A direct PING to ``peer`` outside the round (the shell's check of its own link
        to the member: the ACK answers it, the machine takes no decision on it); None when
        ``peer`` is not a live member."""
        m = self._members.get(peer)
        if m is None or m.update.state == DEAD:
            return None
        self._seq += 1
        return self._send(peer, Ping(self._seq, self.incarnation, self._piggyback_to(peer)))

    def probe_failed(self, peer: bytes, now: float) -> list[Send]:
        """A direct contact of ours with ``peer`` failed outside the protocol (a forward
        could not open a stream): probe it now as if our direct PING had gone unanswered,
        through :data:`INDIRECT_PROBES` others (and directly again: the shell re-dials);
        no ACK, nor any message from ``peer``, by the end of the period makes it SUSPECT.
        At most one such probe per member at a time."""
        m = self._members.get(peer)
        if m is None or m.update.state == DEAD or peer in self._checks:
            return []
        self._seq += 1
        check = _Probe(peer, self._seq, now, now, now + self.probe_interval_s())
        self._checks[peer] = check
        direct = self._send(peer, Ping(check.seq, self.incarnation, self._piggyback_to(peer)))
        return [direct, *self._indirect_probes(check)]

    def learn(self, update: Update, now: float, *, gossip: bool = True) -> None:
        """Apply one claim the shell held back from :meth:`receive` until it had checked
        the member (dialled it): as if it had arrived on a message now."""
        self._apply(update, now, gossip=gossip)

    def join(self, peer: bytes, now: float, addrs: Sequence[str] = ()) -> None:
        """Learn a member out of band (bootstrap peer, mDNS, a DHT record): assumed alive
        at incarnation 0, so any claim the mesh holds about it outranks this one."""
        if peer != self.self_id and peer not in self._members:
            # not gossiped: every member spreads its own ALIVE, with its real incarnation
            self._apply(Update(peer, 0, ALIVE, tuple(addrs)[:MAX_ADDRS]), now, gossip=False)

    def tick(self, now: float, *, late_by_s: float = 0.0) -> list[Send]:
        """Do what is due at ``now``. ``late_by_s``: how late this call runs after the
        deadline the shell meant to run it at (its timer fired late: a starved process, a
        frozen one thawing); later than :data:`LATE_TICK_FRACTION` of the probe timeout
        raises the local health multiplier, once per probe period."""
        if (self.lifeguard and not self._late
                and late_by_s > LATE_TICK_FRACTION * self.probe_timeout_s()):
            self._late = True
            self._health(+1)
        out: list[Send] = []
        self._expire_suspects(now)
        self._forget_dead(now)
        self._end_checks(now)
        p = self._probe
        if p is not None and not p.acked and not p.indirect_sent and now >= p.timeout_at:
            out.extend(self._indirect_probes(p))
        if now >= self._next_probe_at:
            self._end_probe(now)
            out.extend(self._start_probe(now))
            self._next_probe_at = now + self.probe_interval_s()
        return out

    def receive(self, sender: bytes, message: Message, now: float) -> list[Send]:
        """Handle one message from ``sender`` (the transport vouches for the sender's id)."""
        if sender == self.self_id:
            return []
        known = self._members.get(sender)
        stranger = known is None or known.update.state == DEAD
        if (not stranger and 0 < known.update.incarnation < message.incarnation
                and message.incarnation > self._synced.get(sender, -1)):
            # back under a new incarnation (not the 0 of a member joined out of band):
            # restarted, it knows nobody
            stranger = True
        check = self._checks.get(sender)
        if check is not None:
            check.acked = True  # it speaks to us: our failed contact was not its death
        for u in message.updates:
            self._apply(u, now)
        self._note_sender(sender, message.incarnation, now)
        out = []
        if stranger and sender in self._members:
            self._synced[sender] = message.incarnation  # one SYNC per incarnation
            out.append(self._sync_for(sender))
        return out + self._answer(sender, message, now)

    def _answer(self, sender: bytes, message: Message, now: float) -> list[Send]:
        if isinstance(message, Sync):
            return []
        if isinstance(message, Ping):
            return [self._send(sender, Ack(message.seq, self.incarnation, self.self_id,
                                          self._piggyback(prefer=sender)))]
        if isinstance(message, PingReq):
            if message.target == self.self_id:
                return [self._send(sender, Ack(message.seq, self.incarnation, self.self_id,
                                              self._piggyback()))]
            self._seq += 1
            self._relays[self._seq] = (sender, message.seq, now)
            return [self._send(message.target, Ping(self._seq, self.incarnation,
                                                    self._piggyback_to(message.target)))]
        return self._on_ack(sender, message, now)

    def _sync_for(self, peer: bytes) -> Send:
        """A SYNC for ``peer``: ourselves and a random sample of alive members, within
        :data:`MAX_MESSAGE_BYTES`."""
        # ALIVE only: a suspicion learned without its gossip would miss the refutation
        live = [p for p in self._ids if p != peer and self._members[p].update.state == ALIVE]
        # a rotating window, not a random sample: the probe order's random draws stay
        # those of a mesh without SYNCs (the simulator's runs stay comparable)
        start = self._sync_offset % max(len(live), 1)
        chosen = (live[start:] + live[:start])[:MAX_SYNC_UPDATES]
        self._sync_offset += MAX_SYNC_UPDATES
        while True:
            ups = (self._self_update(), *(self._members[p].update for p in chosen))
            message = Sync(0, self.incarnation, ups)
            if len(encode_message(message)) <= MAX_MESSAGE_BYTES or not chosen:
                return self._send(peer, message)
            chosen = chosen[: len(chosen) // 2]

    # --- probing ------------------------------------------------------------------------

    def _start_probe(self, now: float) -> list[Send]:
        target = self._next_target()
        if target is None:
            self._probe = None
            return []
        self._seq += 1
        self._probe = _Probe(target, self._seq, now, now + self.probe_timeout_s(),
                             now + self.probe_interval_s())
        return [self._send(target, Ping(self._seq, self.incarnation,
                                        self._piggyback_to(target)))]

    def _next_target(self) -> bytes | None:
        while True:
            if not self._order:
                self._order = [p for p, m in self._members.items() if m.update.state != DEAD]
                if not self._order:
                    return None
                self._rng.shuffle(self._order)
            peer = self._order.pop()
            m = self._members.get(peer)
            if m is not None and m.update.state != DEAD:
                return peer

    def _indirect_probes(self, p: _Probe) -> list[Send]:
        p.indirect_sent = True
        chosen: set[bytes] = set()
        for _ in range(4 * INDIRECT_PROBES):  # random tries: O(k), not O(N)
            if len(chosen) == INDIRECT_PROBES or len(self._ids) <= 1:
                break
            x = self._ids[self._rng.randrange(len(self._ids))]
            if x != p.target and self._members[x].update.state == ALIVE:
                chosen.add(x)
        return [self._send(h, PingReq(p.seq, self.incarnation, p.target, self._piggyback()))
                for h in sorted(chosen)]

    def _end_checks(self, now: float) -> None:
        for peer, check in list(self._checks.items()):
            if now >= check.ends_at:
                del self._checks[peer]
                self._suspect_unless_acked(check, now)

    def _end_probe(self, now: float) -> None:
        """The probe period is over: our local health learns from it (Lifeguard: no ACK
        at all, +1; an answered probe in a period without a late tick, -1), then the
        target is suspected unless it answered."""
        p = self._probe
        if p is not None and not p.acked:
            self._health(+1)
        elif not self._late:
            self._health(-1)
        self._late = False
        self._suspect_unless_acked(p, now)

    def _health(self, delta: int) -> None:
        if self.lifeguard:
            self._lhm = min(MAX_LHM, max(0, self._lhm + delta))

    def _suspect_unless_acked(self, p: _Probe | None, now: float) -> None:
        if p is None or p.acked:
            return
        m = self._members.get(p.target)
        if m is None or m.update.state == DEAD:
            return
        u = m.update
        claim = Update(u.peer, u.incarnation, SUSPECT, u.addrs, self._tag)
        if u.state == ALIVE:
            self._apply(claim, now)
        else:  # already suspected by others: ours is an independent confirmation
            self._confirm(claim, gossip=True)

    def _on_ack(self, sender: bytes, ack: Ack, now: float) -> list[Send]:
        relay = self._relays.pop(ack.seq, None)
        if relay is not None:
            asker, seq, _ = relay
            return [self._send(asker, Ack(seq, self.incarnation, ack.target,
                                          self._piggyback()))]
        p = self._probe
        if p is not None and ack.seq == p.seq and ack.target == p.target:
            p.acked = True
        check = self._checks.get(ack.target)
        if check is not None and ack.seq == check.seq:
            check.acked = True
        return []

    # --- state --------------------------------------------------------------------------

    def _self_update(self) -> Update:
        return Update(self.self_id, self.incarnation, ALIVE, self.addrs)

    def _note_sender(self, sender: bytes, incarnation: int, now: float) -> None:
        m = self._members.get(sender)
        if m is None or (m.update.state == DEAD and incarnation > m.update.incarnation):
            # a direct message proves the sender is up at the incarnation it states
            self._apply(Update(sender, incarnation, ALIVE, m.update.addrs if m else ()), now)

    def _apply(self, u: Update, now: float, *, gossip: bool = True) -> None:
        if u.peer == self.self_id:
            if u.state != ALIVE and u.incarnation >= self.incarnation:
                self.incarnation = min(u.incarnation + 1, _MAX_INCARNATION)  # refute
                self._enqueue(self._self_update())
                self._health(+1)  # accused: we may be the slow one (Lifeguard)
            return
        m = self._members.get(u.peer)
        if m is not None:
            if (u.state == SUSPECT and m.update.state == SUSPECT
                    and u.incarnation == m.update.incarnation):
                self._confirm(u, gossip=gossip)
                return
            if not supersedes(u, m.update):
                return
            if not u.addrs and m.update.addrs:
                u = replace(u, addrs=m.update.addrs)
        elif u.state == DEAD or not self._room_for_one(now):
            return  # nothing to forget about a stranger; a full table keeps what it has
        else:
            self._index[u.peer] = len(self._ids)
            self._ids.append(u.peer)
        changed = m is None or m.update.state != u.state
        since = now if changed else m.since
        self._members[u.peer] = _Member(u, since)
        self._suspects.pop(u.peer, None)
        if u.state == SUSPECT:
            self._suspects[u.peer] = _Suspicion(since, {u.suspector})
        elif u.state == DEAD and changed:
            self._dead.append((now, u.peer))
        if gossip:
            self._enqueue(u)
        if changed:
            self._events.append(MemberEvent(u.peer, u.state, u.addrs, u.incarnation))

    def _remove(self, peer: bytes) -> None:
        del self._members[peer]
        self._suspects.pop(peer, None)
        self._checks.pop(peer, None)
        self._synced.pop(peer, None)
        i = self._index.pop(peer)
        last = self._ids.pop()
        if last != peer:  # swap-remove keeps random choice O(1)
            self._ids[i] = last
            self._index[last] = i
        self._dequeue(peer)
        self._events.append(MemberEvent(peer, "forgotten"))

    def _room_for_one(self, now: float) -> bool:
        if len(self._members) < MAX_MEMBERS:
            return True
        self._forget_dead(now + DEAD_RETAIN_S)  # a full table forgets its dead early
        return len(self._members) < MAX_MEMBERS

    def _confirm(self, u: Update, *, gossip: bool) -> None:
        """Another accuser of a member we hold SUSPECT at ``u``'s incarnation: one more
        confirmation (Lifeguard) if it is a member we have not counted yet, spread on (news
        to those who have not heard this accuser); at most k are counted."""
        s = self._suspects.get(u.peer)
        if (not self.lifeguard or s is None or not u.suspector or u.suspector in s.accusers
                or s.confirmations >= expected_confirmations(len(self._members) + 1)):
            return
        s.accusers.add(u.suspector)
        if gossip:
            self._enqueue(u)

    def _suspicion_timeout(self, s: _Suspicion) -> float:
        n = len(self._members) + 1
        if not self.lifeguard:
            return suspicion_timeout_s(n)
        return dynamic_suspicion_timeout_s(n, s.confirmations)

    def _expire_suspects(self, now: float) -> None:
        for peer, s in list(self._suspects.items()):
            if now >= s.started + self._suspicion_timeout(s):
                u = self._members[peer].update
                self._apply(Update(u.peer, u.incarnation, DEAD, u.addrs), now)

    def _forget_dead(self, now: float) -> None:
        while self._dead and now >= self._dead[0][0] + DEAD_RETAIN_S:
            t, peer = self._dead.popleft()
            m = self._members.get(peer)
            if m is not None and m.update.state == DEAD and m.since == t:
                self._remove(peer)
        # a relay lives as long as the slowest asker's probe may (Lifeguard scales it)
        keep = (MAX_LHM + 1) * PROBE_INTERVAL_S if self.lifeguard else PROBE_INTERVAL_S
        for seq, (_, _, t) in list(self._relays.items()):
            if now >= t + keep:
                del self._relays[seq]

    # --- dissemination ------------------------------------------------------------------

    def _enqueue(self, u: Update) -> None:
        self._dequeue(u.peer)
        self._buckets[0][u.peer] = u
        self._bucket_of[u.peer] = 0

    def _dequeue(self, peer: bytes) -> None:
        k = self._bucket_of.pop(peer, None)
        if k is not None:
            del self._buckets[k][peer]

    def _piggyback_to(self, target: bytes) -> tuple[Update, ...]:
        """A PING's piggyback: Lifeguard's buddy system puts a claim about the target
        itself first, so a suspected member learns it from whoever probes it."""
        return self._piggyback(prefer=target if self.lifeguard else None)

    def _piggyback(self, prefer: bytes | None = None) -> tuple[Update, ...]:
        """Up to MAX_PIGGYBACK queued updates, fewest-sent first; a claim about the
        receiver itself goes first, so a wrongly suspected member learns it and refutes."""
        chosen: list[Update] = []
        m = self._members.get(prefer) if prefer is not None else None
        if m is not None and m.update.state != ALIVE:
            chosen.append(m.update)
        for bucket in self._buckets:
            for u in reversed(bucket.values()):  # newest first: fresh news outruns old
                if len(chosen) == MAX_PIGGYBACK:
                    break
                if u.peer != prefer or m is None or m.update.state == ALIVE:
                    chosen.append(u)
            if len(chosen) == MAX_PIGGYBACK:
                break
        limit = retransmits(len(self._members) + 1)
        for u in chosen:
            k = self._bucket_of.get(u.peer)
            if k is None or self._buckets[k].get(u.peer) is not u:
                continue  # the preferred claim was not (or no longer) queued
            del self._buckets[k][u.peer]
            if k + 1 >= limit:
                del self._bucket_of[u.peer]
                continue
            if k + 1 == len(self._buckets):
                self._buckets.append({})
            self._buckets[k + 1][u.peer] = u
            self._bucket_of[u.peer] = k + 1
        return tuple(chosen)

    def _send(self, to: bytes, message: Message) -> Send:
        return Send(to, message)


# --- codec -----------------------------------------------------------------------------


def _update_obj(u: Update) -> list:
    obj = [u.peer, u.incarnation, _STATE_CODES[u.state], list(u.addrs)]
    if u.state == SUSPECT and u.suspector:
        obj.append(u.suspector)
    return obj


def encode_message(message: Message, sender: bytes = b"") -> bytes:
    """``sender``: who sends it (b"": unknown). An ACK for the sender itself, the usual
    direct ACK, leaves its target empty: the receiver knows who sent it (the stream's
    authenticated peer; :func:`decode_message`'s ``sender``), and a peer id is 38 of a
    direct ACK's ~97 bytes."""
    kind = (_PING if isinstance(message, Ping) else _PING_REQ if isinstance(message, PingReq)
            else _SYNC if isinstance(message, Sync) else _ACK)
    target = b"" if isinstance(message, Ping | Sync) else message.target
    if kind == _ACK and sender and target == sender:
        target = b""
    obj = [kind, message.seq, message.incarnation, target,
           [_update_obj(u) for u in message.updates]]
    info = message.info if isinstance(message, Ack) else None
    if info is not None:
        obj.append([info.queue_depth, info.active, info.n_ctx, info.summary_hash, info.model,
                    info.model_name])
    return cbor2.dumps(obj)


def _decode_info(obj: object) -> AckInfo:
    if not isinstance(obj, list) or len(obj) != 6:
        raise MembershipError("ack info must be [queue_depth, active, n_ctx, summary_hash, "
                              "model, model_name]")
    q = _int(obj[0], "ack queue_depth", _MAX_LOAD)
    a = _int(obj[1], "ack active", _MAX_LOAD)
    n_ctx = _int(obj[2], "ack n_ctx", _MAX_LOAD)
    for what, x in (("summary_hash", obj[3]), ("model", obj[4])):
        if not isinstance(x, bytes) or len(x) > MAX_INFO_BYTES:
            raise MembershipError(f"ack {what} must be at most {MAX_INFO_BYTES} bytes")
    name = obj[5]
    if not isinstance(name, str) or len(name) > MAX_INFO_NAME_CHARS:
        raise MembershipError(f"ack model_name must be at most {MAX_INFO_NAME_CHARS} chars")
    return AckInfo(q, a, n_ctx, obj[3], obj[4], name)


def _int(x: object, what: str, hi: int = _MAX_INCARNATION) -> int:
    if type(x) is not int or not 0 <= x <= hi:
        raise MembershipError(f"{what} must be an integer in 0..{hi}")
    return x


def _peer(x: object, what: str, *, empty_ok: bool = False) -> bytes:
    if not isinstance(x, bytes) or len(x) > MAX_PEER_ID_BYTES or (not x and not empty_ok):
        raise MembershipError(f"{what} must be a peer id of 1..{MAX_PEER_ID_BYTES} bytes")
    return x


def _decode_update(obj: object) -> Update:
    if not isinstance(obj, list) or len(obj) not in (4, 5):
        raise MembershipError("an update must be [peer, incarnation, state, addrs"
                              "(, suspector)]")
    peer = _peer(obj[0], "update peer")
    inc = _int(obj[1], "update incarnation")
    state = _STATE_NAMES.get(obj[2]) if type(obj[2]) is int else None
    if state is None:
        raise MembershipError(f"unknown member state {obj[2]!r}")
    addrs = obj[3]
    if (not isinstance(addrs, list) or len(addrs) > MAX_ADDRS
            or not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDR_CHARS for a in addrs)):
        raise MembershipError(f"update addrs must be at most {MAX_ADDRS} short strings")
    if len(obj) == 5:
        if state != SUSPECT:
            raise MembershipError("only a SUSPECT claim names its suspector")
        tag = obj[4]
        if not isinstance(tag, bytes) or len(tag) != ACCUSER_TAG_BYTES:
            raise MembershipError(f"a suspector is a {ACCUSER_TAG_BYTES}-byte tag")
        return Update(peer, inc, state, tuple(addrs), tag)
    return Update(peer, inc, state, tuple(addrs))


def decode_message(data: bytes, sender: bytes = b"") -> Message:
    """Decode one membership message from ``sender`` (b"": unknown), or raise
    :class:`MembershipError`. An ACK with an empty target is the sender's own."""
    try:
        obj = loads_bounded(data, max_bytes=MAX_MESSAGE_BYTES, max_items=4096)
    except DigestError as exc:
        raise MembershipError(f"membership message: {exc}") from None
    if not isinstance(obj, list) or len(obj) not in (5, 6):
        raise MembershipError("a membership message must be [type, seq, inc, target, updates"
                              "(, ack info)]")
    kind, seq, inc, target, updates = obj[:5]
    if len(obj) == 6 and kind != _ACK:
        raise MembershipError("only an ACK carries info")
    seq = _int(seq, "seq")
    inc = _int(inc, "incarnation")
    limit = MAX_SYNC_UPDATES + 1 if kind == _SYNC else MAX_PIGGYBACK * 2
    if not isinstance(updates, list) or len(updates) > limit:
        raise MembershipError(f"at most {limit} updates in this message")
    ups = tuple(_decode_update(u) for u in updates)
    if kind in (_PING, _SYNC):
        _peer(target, "ping target", empty_ok=True)
        return Ping(seq, inc, ups) if kind == _PING else Sync(seq, inc, ups)
    if kind == _PING_REQ:
        return PingReq(seq, inc, _peer(target, "target"), ups)
    if kind == _ACK:
        tgt = _peer(target or sender, "ACK target (empty: the sender's own, if known)")
        return Ack(seq, inc, tgt, ups, _decode_info(obj[5]) if len(obj) == 6 else None)
    raise MembershipError(f"unknown membership message type {kind!r}")
