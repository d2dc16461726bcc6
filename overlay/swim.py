"""SWIM membership on ``/prefixmesh/swim/1.1.0``: the node's default source of "who is up".

The protocol is the pure state machine of :mod:`.core.membership` (probing, indirect
probes, suspicion, incarnations, piggybacked dissemination); this module is its shell:
trio tasks, libp2p streams, the node's clock, and the :class:`~.heartbeat.Liveness` table
the rest of the node reads (routing, forwarding, partition homes, status, metrics).

Transport. Each message is one length-prefixed frame (``FramedStream.send_raw``) on a
long-lived *one-way* stream from sender to receiver; a reply (an ACK) travels on the
receiver's own stream back. So every :class:`~.core.membership.Send` is "deliver this to
that peer", as the state machine means it, and a frozen peer only ever costs a write
deadline. One outbox per peer (:data:`OUTBOX_SIZE` messages, further ones dropped: SWIM
tolerates loss) and one task draining it; a message older than a probe period when its
turn comes is dropped too (its probe is over). Every dial, stream open and write runs
under a deadline; an idle stream is closed after :data:`IDLE_CLOSE_S`. Inbound: at most
:data:`MAX_STREAMS_PER_PEER` streams per peer and a stream-open rate
(:class:`~.host.ResponderGate`), a per-peer message rate, :data:`~.core.membership.MAX_MESSAGE_BYTES`
per frame; a frame that does not decode is logged and dropped, the node carries on.

Up, for routing (:class:`~.core.links.LinkView`): a member is *up* when the state machine
holds it ALIVE and our own link to it is good: its latest answer to a direct PING of ours
came after our latest failure with it. Failures: a forward that could not open a stream
(:meth:`Swim.mark_down`, which also counts as a failed direct probe in the state machine:
PING-REQs at once, SUSPECT by the end of the period unless someone reaches it), a probe of
ours it answered only through others (no direct ACK within :data:`DIRECT_GRACE_S` times
our local health multiplier plus one), a
message we could not send it, no connection left to it. A member that is not up for us is
PINGed directly (re-dialled with its newest addresses, the ones it spread itself first)
each period or with backoff, until it answers; every 4th such PING left unanswered goes
over a fresh connection (the old one may be wedged below the streams: docs/SCALING.md). Flap rule: a SUSPECT that answers such a
PING is up again at once (and an ALIVE one when its refutation arrives), so a peer that
freezes and thaws is used while it runs. A SUSPECT that has not answered us since it was
suspected is not up (routing stops choosing it, in-flight forwards to it are abandoned);
a DEAD one is down. Gossip alone never makes a peer up: it makes it a member we then
PING.

Lifeguard (docs/SCALING.md). The ticker tells the state machine how late it woke after
the deadline it slept to (``Membership.tick(now, late_by_s=...)``): a starved or blocked
event loop, or a thaw after SIGSTOP, raises the node's local health multiplier, which
stretches its own probe interval and timeouts instead of letting it accuse healthy peers
of its own slowness; stale-message drops and the direct-ACK grace scale with it.

Figures per peer. RTT: EWMA of our own PINGs' ACK times. Load, context length, model and
digest summary hash: on the ACKs a member sends about itself
(:class:`~.core.membership.AckInfo`; the hash and the model only when they changed since
that stream's previous ACK, as PONGs did); an up peer whose latest figures say it is busy
is PINGed again each period (:data:`BUSY_REFRESHES_PER_TICK` at most), so routing learns
when it is free without waiting a round. Merit (issue 14): a peer that has answered our
own direct PINGs for :data:`~.heartbeat.LONG_STANDING_S` is long-standing; gossip about a
peer never grants merit.

Bounded dialing (issue 14). Members come from the same sources as before (bootstrap, mDNS,
DHT, digest and PEERS hints, through the directory's ``on_new_peer``) and from
dissemination (piggybacked claims, SYNCs); the addresses in either are hints. A claim about
a peer that is not a member and not connected to us is held back from the state machine
and *checked* first: one task per such peer dials it through the host's
:class:`~.core.dialing.DialGate` (at most :data:`~.core.dialing.MAX_HINT_PEERS` at once;
further claims wait in a bounded queue, :data:`~.heartbeat.MAX_PENDING_HINTS`, oldest
dropped). Connected, the claim is applied (and gossiped on, if it came as gossip); never
reached after :data:`~.core.dialing.NEVER_UP_ATTEMPTS` failed dials, or naming only
addresses over their dial budget, the peer is forgotten (``on_forget`` tells the
directory) unless it is persistent (bootstrap: retried with backoff). So a flood of fresh
identities costs a bounded number of dials here and never enters the member table, is
never probed, and is never spread to the rest of the mesh.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import trio

from .core import membership as mb
from .core.dialing import NEVER_UP_ATTEMPTS
from .core.identity import peer_id_to_b58
from .core.limits import PeerRateLimiter
from .core.links import LinkView
from .heartbeat import LONG_STANDING_S, MAX_PENDING_HINTS, Liveness, PeerHealth
from .host import FramedStream, HostError, OverlayHost, ResponderGate

__all__ = ["SWIM_PROTOCOL", "Swim"]

log = logging.getLogger(__name__)

SWIM_PROTOCOL = "/prefixmesh/swim/1.1.0"

OUTBOX_SIZE = 16  # a probe period's worth of messages to one peer, with room to spare
IDLE_CLOSE_S = 30.0  # an outbound stream unused this long is closed (reopened on need)
DIAL_TIMEOUT_S = 2.0  # connect, and open a stream: a probe period and then some
WRITE_TIMEOUT_S = 1.0  # a frozen peer's window fills at last: a write must not wait longer
MAX_STREAMS_PER_PEER = 2  # its stream to us, and one being replaced
STREAM_OPEN_RATE_PER_S, STREAM_OPEN_BURST = 1.0, 4
# a peer sends us ~1 PING per round plus ACKs and PING-REQs: 20/s is far above honest use
MESSAGE_RATE_PER_S, MESSAGE_BURST = 20.0, 40
RTT_ALPHA = 0.3  # EWMA weight of a new ACK time
VET_BACKOFF_MIN_S, VET_BACKOFF_MAX_S = 0.5, 10.0  # between dials of a stranger being checked
_SENT_PINGS_MAX = 4096  # our PINGs awaiting an ACK, for RTT (pruned each period anyway)
# a probe of ours that went indirect and got no direct ACK this long after its PING: our
# link to the member is broken (a dead relay, a wedged connection) even if others reach
# it; two periods leave a busy peer's late ACK time to arrive (the heartbeat gave 1.5 s)
DIRECT_GRACE_S = 2 * mb.PROBE_INTERVAL_S
# up peers whose latest figures say "busy" that are PINGed again per tick for fresh ones:
# a round is N periods, so without this routing would avoid, for up to a round, a holder
# of the prompt's prefix that finished long ago (a cold prefill instead of a cache hit);
# the heartbeat's PONGs came every 0.5 s. Bounded: a few PINGs per period, whatever N.
BUSY_REFRESHES_PER_TICK = 2


class Swim(Liveness):
    """SWIM-driven :class:`~.heartbeat.Liveness` (module docstring)."""

    def __init__(
        self,
        host: OverlayHost,
        *,
        addrs_of: Callable[[bytes], Sequence[str]],
        local_load: Callable[[], tuple[int, int]],
        self_addrs: Callable[[], Sequence[str]] = list,
        learn: Callable[[bytes, Sequence[str]], None] | None = None,
        on_change: Callable[[bytes, bool], None] | None = None,
        context_tokens: Callable[[], int | None] | None = None,
        model: tuple[bytes, str] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(host, on_change=on_change)
        self.addrs_of = addrs_of  # the directory's addresses of a peer (tried first)
        self.local_load = local_load
        self.self_addrs = self_addrs
        self.learn = learn  # addresses dissemination taught us (the daemon: the directory)
        self.context_tokens = context_tokens
        self.model = model
        self.rng = rng or random.Random()
        self.clock = clock
        self.membership: mb.Membership | None = None
        self.stats: dict[str, int] = dict.fromkeys(
            ("sent", "received", "bytes_out", "bytes_in", "dropped_outbox", "dropped_stale",
             "dropped_rate", "bad_messages", "send_failed", "dial_refused", "dial_failed",
             "streams_refused_rate", "streams_refused_concurrency", "link_checks",
             "link_failures", "busy_refreshes", "fresh_connections"), 0)
        self._nursery: trio.Nursery | None = None
        self._outboxes: dict[bytes, trio.MemorySendChannel] = {}
        self._sent_pings: dict[int, tuple[bytes, float]] = {}  # seq -> (to, sent at)
        self.links = LinkView()  # our own link to each member: "up" for routing
        # our probes that went indirect: seq -> (target, when a direct ACK is overdue)
        self._awaiting_direct: dict[int, tuple[bytes, float]] = {}
        self._reopen: set[bytes] = set()  # members whose outbound stream is to be replaced
        # claims about strangers: being checked (peer -> newest claim, gossip it on?), and
        # waiting for a checking slot, oldest first
        self._vetting: dict[bytes, tuple[mb.Update, bool]] = {}
        self._pending: dict[bytes, tuple[mb.Update, bool]] = {}
        self._wake = trio.Event()
        self._inbound = ResponderGate(
            PeerRateLimiter(STREAM_OPEN_RATE_PER_S, STREAM_OPEN_BURST), MAX_STREAMS_PER_PEER,
            time.monotonic, self.stats, concurrency_key="streams_refused_concurrency",
            rate_key="streams_refused_rate")
        self._message_rate = PeerRateLimiter(MESSAGE_RATE_PER_S, MESSAGE_BURST)

    # --- queries ---------------------------------------------------------------------

    def is_known(self, peer: bytes) -> bool:
        h = self.health.get(peer)
        return (h is not None and h.up and h.acked_since is not None
                and h.last_pong - h.acked_since >= LONG_STANDING_S)

    def monitored(self) -> set[bytes]:
        """The members we probe (alive or suspect)."""
        return set(self.membership.alive()) if self.membership is not None else set()

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation if self.membership is not None else 0

    def node_stats(self) -> dict[str, int]:
        out = {f"swim_{k}": v for k, v in self.stats.items()}
        m = self.membership
        out.update(swim_members=len(m) if m else 0, swim_incarnation=self.incarnation,
                   swim_local_health=m.local_health if m is not None else 0,
                   swim_hints=len(self._vetting), swim_hints_pending=len(self._pending),
                   swim_hints_dropped=self.hints_dropped, swim_forgotten=self.forgotten)
        return out

    # --- running ---------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        now = self.clock()
        # wall-clock ms: a restarted node outranks what the mesh remembers of its last run
        self.membership = mb.Membership(
            self.host.peer_id, now=now, incarnation=int(time.time() * 1000), rng=self.rng,
            addrs=list(self.self_addrs()))
        self.host.set_handler(SWIM_PROTOCOL, self.handle)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for peer, (u, gossip) in list(self._pending.items()):  # watched before we ran
                del self._pending[peer]
                self._offer(u, gossip)
            task_status.started()
            await self._ticker()

    async def _ticker(self) -> None:
        m = self.membership
        due: float | None = None  # the deadline the last sleep was for
        while True:
            now = self.clock()
            # Lifeguard: how late we run after the deadline we slept to (a process starved
            # of CPU, or frozen, fires its timers late; woken early, we are not late)
            late = max(0.0, now - due) if due is not None else 0.0
            m.set_addrs(list(self.self_addrs()))
            self._dispatch(m.tick(now, late_by_s=late))
            self._check_links(now)
            self._after_change()
            self._prune_sent_pings(now)
            wait = max(0.01, min(m.next_deadline(), now + mb.PROBE_INTERVAL_S) - self.clock())
            due = self.clock() + wait
            with trio.move_on_after(wait):
                await self._wake.wait()
            self._wake = trio.Event()

    def watch(self, peer: bytes) -> None:
        """A peer learned out of band (bootstrap, mDNS, DHT, digest/PEERS hints): a member
        at incarnation 0 once reached (module docstring, *Bounded dialing*)."""
        if peer == self.host.peer_id:
            return
        m = self.membership
        if m is not None and m.state_of(peer) is not None:
            return
        addrs = tuple(self.addrs_of(peer))[: mb.MAX_ADDRS]
        self._offer(mb.Update(peer, 0, mb.ALIVE, addrs), gossip=False)

    def _offer(self, u: mb.Update, gossip: bool) -> None:
        """A claim about ``u.peer``: applied now if it is a member or connected to us,
        else held back while the peer is checked (or queued for a checking slot)."""
        m = self.membership
        peer = u.peer
        if m is not None and (m.state_of(peer) is not None or self.host.is_connected(peer)):
            self._apply_claim(u, gossip)
            return
        held = self._vetting.get(peer)
        if held is not None:
            if mb.supersedes(u, held[0]) or (u.addrs and not held[0].addrs):
                self._vetting[peer] = (u, gossip or held[1])
            return
        if m is None or len(self._vetting) >= self.max_hint_peers or self._nursery is None:
            self._pending.pop(peer, None)
            self._pending[peer] = (u, gossip)
            if len(self._pending) > MAX_PENDING_HINTS:
                del self._pending[next(iter(self._pending))]
                self.hints_dropped += 1
            return
        self._pending.pop(peer, None)
        self._vetting[peer] = (u, gossip)
        self._nursery.start_soon(self._vet, peer)

    def _apply_claim(self, u: mb.Update, gossip: bool) -> None:
        m = self.membership
        m.learn(u, self.clock(), gossip=gossip)
        if m.state_of(u.peer) is not None:
            self.health.setdefault(u.peer, PeerHealth())
            if self.learn is not None and u.addrs:
                self.learn(u.peer, u.addrs)
            self._wake.set()  # a first member: probe it now, not a period later
        self._after_change()

    async def _vet(self, peer: bytes) -> None:
        """Dial a stranger through the gate; connected: apply its claim; never reached:
        forget it (module docstring, *Bounded dialing*)."""
        failed, backoff = 0, VET_BACKOFF_MIN_S
        persistent = self.persistent(peer)
        reached = gave_up = False
        try:
            while not self.host.is_connected(peer):
                u, _ = self._vetting[peer]
                addrs = list(dict.fromkeys([*u.addrs, *self.addrs_of(peer)]))
                now = time.monotonic()
                ticket = self.gate.admit(addrs, now) if addrs and self._outbound_room() else None
                if ticket is None:
                    if not persistent and (not addrs or self.gate.saturated(addrs, now)):
                        gave_up = True  # only addresses knocked at to their budget
                        return
                    wait = self.gate.retry_after_s(addrs, now) if addrs else VET_BACKOFF_MAX_S
                    await trio.sleep(min(max(wait, 0.1), VET_BACKOFF_MAX_S))
                    continue
                if await self._dial(peer, ticket):
                    break
                failed += 1
                if not persistent and failed >= NEVER_UP_ATTEMPTS:
                    gave_up = True
                    return
                await trio.sleep(backoff)
                backoff = min(backoff * 2, VET_BACKOFF_MAX_S)
            reached = True
        finally:
            claim = self._vetting.pop(peer, None)
            if reached and claim is not None and self.membership is not None:
                self._apply_claim(*claim)
            elif gave_up:
                self.forgotten += 1
                log.debug("forgetting peer %s (never reached)", peer_id_to_b58(peer)[-8:])
                if self.on_forget is not None:
                    self.on_forget(peer)
            while self._pending and len(self._vetting) < self.max_hint_peers:
                nxt = next(iter(self._pending))
                self._offer(*self._pending.pop(nxt))

    # --- receiving -------------------------------------------------------------------

    async def handle(self, stream) -> None:
        await self._inbound.serve(stream, self._serve)

    async def _serve(self, stream, peer: bytes) -> None:
        fs = FramedStream(stream, timeout_s=IDLE_CLOSE_S + mb.PROBE_INTERVAL_S)
        try:
            while True:
                try:
                    data = await fs.receive_raw(max_bytes=mb.MAX_MESSAGE_BYTES)
                except HostError:  # the end of the stream, or idle past its deadline
                    return
                self.stats["bytes_in"] += len(data) + 4
                if not self._message_rate.allow(peer, time.monotonic()):
                    self.stats["dropped_rate"] += 1
                    continue
                try:
                    message = mb.decode_message(data, peer)
                except mb.MembershipError as exc:
                    self.stats["bad_messages"] += 1
                    log.info("bad membership message from %s dropped: %s",
                             peer_id_to_b58(peer)[-8:], exc)
                    continue
                self.on_message(peer, message)
        except Exception as exc:  # an oversize frame, a library surprise: drop the stream
            log.info("membership stream from %s closed: %s", peer_id_to_b58(peer)[-8:], exc)
            with trio.CancelScope(shield=True):
                await fs.reset()
            return
        finally:
            with contextlib.suppress(Exception), trio.CancelScope(shield=True):
                await fs.close()

    def on_message(self, sender: bytes, message: mb.Message) -> None:
        """One decoded message from ``sender`` (the transport vouched for its id)."""
        m = self.membership
        if m is None or sender == self.host.peer_id:
            return
        now = self.clock()
        self.stats["received"] += 1
        message = self._filter_updates(message)
        sends = m.receive(sender, message, now)
        h = self.health.setdefault(sender, PeerHealth())
        if isinstance(message, mb.Ping):
            self.pings_answered += 1
        elif isinstance(message, mb.Ack) and message.target == sender:
            self._on_direct_ack(sender, message, h, now)
        self._dispatch(sends)
        if self.learn is not None:
            for u in message.updates:
                if u.addrs and u.state == mb.ALIVE and m.state_of(u.peer) is not None:
                    self.learn(u.peer, u.addrs)
        self._after_change()

    def _filter_updates(self, message: mb.Message) -> mb.Message:
        """Hold back claims about strangers (not members, not connected): they are
        checked first (:meth:`_offer`), then applied and spread on like the others."""
        m = self.membership
        kept = []
        for u in message.updates:
            if (u.peer == self.host.peer_id or u.state == mb.DEAD
                    or m.state_of(u.peer) is not None or self.host.is_connected(u.peer)):
                kept.append(u)
            else:
                self._offer(u, gossip=True)
        if len(kept) == len(message.updates):
            return message
        return replace(message, updates=tuple(kept))

    def _on_direct_ack(self, peer: bytes, ack: mb.Ack, h: PeerHealth, now: float) -> None:
        sent = self._sent_pings.pop(ack.seq, None)
        if sent is not None and sent[0] == peer:
            # an answer to our own PING on its own stream: our link to it works both ways
            self._awaiting_direct.pop(ack.seq, None)
            self.links.answered(peer)
            rtt = max(0.0, now - sent[1])
            h.rtt_s = rtt if h.rtt_s is None else (1 - RTT_ALPHA) * h.rtt_s + RTT_ALPHA * rtt
            h.pongs += 1
            h.failed_dials = 0
            h.last_pong = now
            if h.acked_since is None:
                h.acked_since = now
        info = ack.info
        if info is not None:
            h.take_figures(info, now)

    # --- state -----------------------------------------------------------------------

    def mark_down(self, peer: bytes) -> None:
        """A forward to ``peer`` could not open a stream: not up for us until it answers a
        direct PING again (re-dialled at the next tick), and a failed direct probe for the
        state machine (module docstring, *Up*)."""
        self._link_failed(peer, "a forward failed")
        m = self.membership
        if m is not None:
            self._dispatch(m.probe_failed(peer, self.clock()))

    def _link_failed(self, peer: bytes, why: str) -> None:
        """A direct contact of ours with ``peer`` failed: not up for us, its outbound
        stream replaced, a direct check at once."""
        if peer not in self.links:  # not a member (yet): nothing is up about it
            if peer in self.health:
                self._set(peer, False)
            return
        was_up = self.is_up(peer)
        if self.links.failed(peer, self.clock()):  # news: a new stream, a check at once
            self._reopen.add(peer)
            self.stats["link_failures"] += 1
            self._wake.set()
        if was_up:
            self._set(peer, False, f" (our link failed: {why})")

    def _check_links(self, now: float) -> None:
        """Probes of ours that went indirect without a direct ACK in time, up peers we
        lost every connection to: link failures. Then the direct PINGs that are due."""
        for seq, (target, overdue_at) in list(self._awaiting_direct.items()):
            if now >= overdue_at:
                del self._awaiting_direct[seq]
                self._link_failed(target, "answered only through others")
        for peer in self.up_peers():
            if not self.host.is_connected(peer):
                self._link_failed(peer, "no connection left")
        m = self.membership
        for peer in self.links.due(now, m.state_of):
            if (self.links.wants_fresh_connection(peer) and self.host.is_connected(peer)
                    and self._nursery is not None):
                self._nursery.start_soon(self._check_over_fresh_connection, peer)
                continue
            self._ping(peer, "link_checks")
        busy = sorted((h.figures_at, p) for p, h in self.health.items()
                      if h.up and h.figures_at is not None and h.queue_depth + h.active > 0
                      and now - h.figures_at >= mb.PROBE_INTERVAL_S)
        for _, peer in busy[:BUSY_REFRESHES_PER_TICK]:
            self._ping(peer, "busy_refreshes")

    def _ping(self, peer: bytes, counter: str) -> bool:
        """A direct PING of ours to ``peer`` (counted under ``counter``); False when the
        state machine has none to send."""
        m = self.membership
        send = m.ping(peer) if m is not None else None
        if send is None:
            return False
        self.stats[counter] += 1
        self._dispatch([send])
        return True

    async def _check_over_fresh_connection(self, peer: bytes) -> None:
        """A direct check of a member that left our checks unanswered over the connection
        we have: drop that connection first, so the PING dials a new one (links.py,
        :data:`~.core.links.FRESH_CONNECTION_EVERY`)."""
        self.stats["fresh_connections"] += 1
        log.debug("member %s: no answer over our connection; dialling a fresh one",
                  peer_id_to_b58(peer)[-8:])
        await self.host.disconnect(peer)
        if self._ping(peer, "link_checks"):
            self._reopen.add(peer)  # the member's outbound stream went with the connection

    def _after_change(self) -> None:
        """Apply the state machine's events to the health table."""
        m = self.membership
        events = m.drain_events()
        if events:
            self._wake.set()  # a new or changed member may need a direct check now
        for ev in events:
            peer = ev.peer
            if ev.state == "forgotten":
                self._drop(peer)
                continue
            h = self.health.setdefault(peer, PeerHealth())
            h.incarnation = max(h.incarnation, ev.incarnation)
            self.links.track(peer)
            self.links.state_changed(peer, ev.state, self.clock())
            if ev.state == mb.DEAD:
                h.acked_since = None
            elif ev.state == mb.ALIVE and ev.incarnation:
                log.debug("member %s alive at incarnation %d", peer_id_to_b58(peer)[-8:],
                          ev.incarnation)
            self._refresh(peer)
        # answers and link failures change "up" without an event of the machine's
        for peer, h in self.health.items():
            if h.up != self._should_be_up(peer, h):
                self._refresh(peer)

    def _should_be_up(self, peer: bytes, h: PeerHealth) -> bool:
        return self.links.is_up(peer, self.membership.state_of(peer))

    def _refresh(self, peer: bytes) -> None:
        h = self.health.get(peer)
        if h is None:
            return
        up = self._should_be_up(peer, h)
        inc = self.membership.incarnation_of(peer)
        h.incarnation = max(h.incarnation, inc)
        state = self.membership.state_of(peer) or "forgotten"
        self._set(peer, up, f" (incarnation {inc}, {state})")

    def _drop(self, peer: bytes) -> None:
        """The state machine forgot ``peer`` (dead long enough, or given up by us)."""
        self.links.forget(peer)
        self._reopen.discard(peer)
        h = self.health.pop(peer, None)
        if h is not None and h.up:
            h.up = False
            for event in self._down_waiters.pop(peer, ()):
                event.set()
            if self.on_change is not None:
                self.on_change(peer, False)
        box = self._outboxes.pop(peer, None)
        if box is not None:
            box.close()
        if self.persistent(peer):
            # a bootstrap peer is dialled again (with backoff) and rejoins when it is back
            addrs = tuple(self.addrs_of(peer))[: mb.MAX_ADDRS]
            self._offer(mb.Update(peer, 0, mb.ALIVE, addrs), gossip=False)

    # --- sending ---------------------------------------------------------------------

    def _dispatch(self, sends: Sequence[mb.Send]) -> None:
        now = self.clock()
        for s in sends:
            if isinstance(s.message, mb.Ping):
                if len(self._sent_pings) < _SENT_PINGS_MAX:
                    self._sent_pings[s.message.seq] = (s.to, now)
            elif isinstance(s.message, mb.PingReq):
                # our direct PING of the target went unanswered so far (module docstring)
                sent = self._sent_pings.get(s.message.seq)
                if sent is not None and s.message.seq not in self._awaiting_direct:
                    # scaled like our probes by our local health: a starved node reads
                    # ACKs late and must not take its own slowness for a broken link
                    grace = DIRECT_GRACE_S * (self.membership.local_health + 1)
                    self._awaiting_direct[s.message.seq] = (s.message.target, sent[1] + grace)
            box = self._outboxes.get(s.to)
            if box is None:
                if self._nursery is None:
                    continue
                box, inbox = trio.open_memory_channel(OUTBOX_SIZE)
                self._outboxes[s.to] = box
                self._nursery.start_soon(self._sender, s.to, box, inbox)
            try:
                box.send_nowait((now, s.message))
            except (trio.WouldBlock, trio.ClosedResourceError):
                self.stats["dropped_outbox"] += 1

    def _prune_sent_pings(self, now: float) -> None:
        horizon = now - 2 * self.membership.probe_interval_s()
        for seq, (_, t) in list(self._sent_pings.items()):
            if t < horizon and seq not in self._awaiting_direct:
                del self._sent_pings[seq]

    def _own_info(self, stream_state: dict) -> mb.AckInfo:
        """Our figures for an ACK; the hash and the model only when new on this stream."""
        q, a = self.local_load()
        n_ctx = (self.context_tokens() if self.context_tokens is not None else 0) or 0
        current = self.summary_hash() if self.summary_hash is not None else b""
        changed = current if current != stream_state.get("hash") else b""
        stream_state["hash"] = current
        fp, name = (self.model or (b"", "")) if not stream_state.get("model_sent") else (b"", "")
        stream_state["model_sent"] = True
        return mb.AckInfo(q, a, n_ctx, changed, fp, name)

    async def _sender(self, peer: bytes, box, inbox) -> None:
        fs: FramedStream | None = None
        stream_state: dict = {}
        try:
            while True:
                got = None
                with trio.move_on_after(IDLE_CLOSE_S):
                    try:
                        got = await inbox.receive()
                    except trio.EndOfChannel:
                        return
                if got is None:
                    return  # idle: close; the next message opens a new stream
                queued_at, message = got
                if self.clock() - queued_at > self.membership.probe_interval_s():
                    self.stats["dropped_stale"] += 1  # its probe is over
                    continue
                if peer in self._reopen:  # our link failed: a new stream (and dial if need be)
                    self._reopen.discard(peer)
                    if fs is not None:
                        with trio.CancelScope(shield=True):
                            await fs.reset()
                        fs = None
                try:
                    if fs is None:
                        fs = await self._open(peer)
                        stream_state = {}
                        if fs is None:
                            continue
                    if isinstance(message, mb.Ack) and message.target == self.host.peer_id:
                        message = replace(message, info=self._own_info(stream_state))
                    data = mb.encode_message(message, self.host.peer_id)
                    await fs.send_raw(data, timeout_s=WRITE_TIMEOUT_S)
                    self.stats["sent"] += 1
                    self.stats["bytes_out"] += len(data) + 4
                except Exception as exc:  # HostError, or a library surprise: drop, reopen
                    self.stats["send_failed"] += 1
                    log.debug("membership send to %s failed: %s", peer_id_to_b58(peer)[-8:], exc)
                    if fs is not None:
                        with trio.CancelScope(shield=True):
                            await fs.reset()
                    fs = None
                    self._link_failed(peer, f"send failed: {exc}"[:80])
                    self._reopen.discard(peer)  # just replaced
        finally:
            if self._outboxes.get(peer) is box:
                del self._outboxes[peer]
            box.close()
            if fs is not None:
                with trio.CancelScope(shield=True):
                    await fs.close()

    async def _dial(self, peer: bytes, ticket) -> bool:
        """One dial the gate admitted; the ticket is returned to the gate either way."""
        ok = False
        try:
            await self.host.connect(peer, ticket.addrs, DIAL_TIMEOUT_S)
            ok = True
        except HostError as exc:
            self.stats["dial_failed"] += 1
            log.debug("membership dial %s failed: %s", peer_id_to_b58(peer)[-8:], exc)
        finally:
            self.gate.done(ticket, ok)
        return ok

    async def _open(self, peer: bytes) -> FramedStream | None:
        """A stream to a member, dialling through the gate if we are not connected; None
        (the message is dropped: SWIM takes it as lost) when the gate refuses or the dial
        fails."""
        if not self.host.is_connected(peer):
            # the addresses the member spread itself (newest incarnation: a new relay
            # circuit, a port mapping) first, then the directory's hints
            addrs = list(dict.fromkeys([*self.membership.addrs_of(peer), *self.addrs_of(peer)]))
            now = time.monotonic()
            ticket = self.gate.admit(addrs, now) if addrs and self._outbound_room() else None
            if ticket is None:
                self.stats["dial_refused"] += 1
                return None
            if not await self._dial(peer, ticket):
                self._link_failed(peer, "dial failed")
                self._reopen.discard(peer)
                return None
        stream = await self.host.open_stream(peer, SWIM_PROTOCOL, DIAL_TIMEOUT_S)
        return FramedStream(stream, timeout_s=WRITE_TIMEOUT_S)
