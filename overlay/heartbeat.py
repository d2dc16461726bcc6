"""Liveness: the table of who is up that the node reads, and the all-to-all heartbeat.

:class:`Liveness` holds :class:`PeerHealth` per peer and answers the node's questions
(up peers, of a model, RTT, fresh load, merit, ``wait_down``); :class:`~.swim.Swim` (the
default, docs/SCALING.md) and :class:`Heartbeat` (below: the measured baseline, kept as
a fallback, ``NodeOptions.membership = "heartbeat"``) fill it.

Keep-alives on ``/prefixmesh/ping/1.0.0``: notice frozen peers, measure RTT.

Why our own ping: a peer frozen with SIGSTOP (or a wedged process) keeps its TCP
connection open; reads from it block forever, writes "succeed", and py-libp2p notices
nothing. A forwarded request to such a peer would hang. So every known peer gets one
long-lived ping stream; each ``interval_s`` we send PING and expect the matching PONG
within ``timeout_s``. ``misses_to_down`` consecutive failures mark the peer *down*:
routing stops choosing it and in-flight forwards to it are abandoned for a fallback
(``infer.py`` watches :meth:`Heartbeat.is_up`). A down peer is re-dialed with
exponential backoff (``backoff_min_s`` .. ``backoff_max_s``) and is marked up again by
its first PONG; after ``forget_after_s`` down it is no longer monitored.

RTT is an EWMA (weight ``rtt_alpha``) of PING->PONG times; PONG also carries the peer's
queue depth and active requests, fresher than its last digest, and its digest summary
hash whenever that changed since the previous PONG on the stream (``gossip`` skips digest
exchanges with peers whose hash equals its own). The first PONG of each stream names the
responder's model (fingerprint and name, ``core/models.py``): routing offers a peer only
requests of its model, and the mesh's model catalog is the up peers' announcements.

The PING handler answers each PING at once and closes an idle stream after
``idle_close_s`` without PING.

Bounded dialing (issue 14, finding 1): addresses learned from digests, the DHT, PEERS
replies or mDNS are hints. :meth:`Heartbeat.watch` monitors at once a peer we are
connected to (it dialled us, or bootstrap reached it) and at most
:data:`~.core.dialing.MAX_HINT_PEERS` others; further hint peers wait in a bounded queue
(:data:`MAX_PENDING_HINTS`, oldest dropped) and take a slot when one frees. Every dial of
a peer we are not connected to passes a :class:`~.core.dialing.DialGate` (global rate and
concurrency, per-address and per-/24 buckets, at most two addresses per dial); a refused
dial waits and counts as no miss. A peer that never answered is forgotten after
:data:`~.core.dialing.NEVER_UP_ATTEMPTS` failed dials (its health entry goes too, and
``on_forget`` tells the directory), so fresh identities cost a bounded number of dials
each and a bounded number at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from .core import wire
from .core.admission import LONG_STANDING, NEVER_UP, SEEN_UP
from .core.dialing import MAX_HINT_PEERS, NEVER_UP_ATTEMPTS, DialGate, give_up
from .core.identity import peer_id_to_b58
from .host import FramedStream, HostError, OverlayHost

__all__ = ["PeerHealth", "Liveness", "Heartbeat"]

log = logging.getLogger(__name__)

#: seconds of answered PINGs after which a peer counts as long-standing (admission by merit:
#: what a new origin it delivers costs, how hard it is to evict): longer than a flood
#: identity bothers to stay, short enough that a restarted honest peer regains it soon
LONG_STANDING_S = 30.0

#: seconds a peer's own load figures (PONG/ACK) count as fresher than its digest's: the
#: heartbeat brings them every 0.5 s, SWIM once per probe round (N periods at N members)
FRESH_LOAD_S = 5.0

#: hint peers waiting for a monitoring slot; beyond this the oldest is dropped (a flood of
#: fresh identities costs this much memory at most, and a hint that is dropped comes back
#: with the next record naming it)
MAX_PENDING_HINTS = 1024


@dataclass
class PeerHealth:
    up: bool = False
    rtt_s: float | None = None
    last_pong: float = 0.0  # monotonic
    misses: int = 0
    queue_depth: int = 0
    active: int = 0
    down_since: float | None = None  # monotonic
    pongs: int = 0
    failed_dials: int = 0  # failed attempts (dial or first PING) while never up
    summary_hash: bytes = b""  # the peer's digest summary hash, as last reported
    n_ctx: int = 0  # the peer's context length from its PONGs (0: not said)
    model: bytes = b""  # the model fingerprint it announced (b"": not said)
    model_name: str = ""
    # SWIM (overlay/swim.py; "up" for us is core/links.py's): first and last ACK to our
    # own PINGs in its current life (merit); the incarnation the mesh holds for it
    acked_since: float | None = None  # monotonic
    incarnation: int = 0
    figures_at: float | None = None  # monotonic: when queue_depth/active last arrived

    def take_figures(self, f, now: float) -> None:
        """What the peer says of itself on a PONG or an ACK (``f``: its queue_depth, active,
        n_ctx, summary_hash, model, model_name); empty fields keep what we had."""
        self.queue_depth, self.active = f.queue_depth, f.active
        self.figures_at = now
        if f.summary_hash:
            self.summary_hash = f.summary_hash
        if f.n_ctx:
            self.n_ctx = f.n_ctx
        if f.model:
            self.model, self.model_name = f.model, f.model_name


class Liveness:
    """Who is up, as the rest of the node reads it (routing, forwarding, partition homes,
    status, metrics, the model catalog): a table of :class:`PeerHealth` and the queries
    on it. Two implementations fill it: :class:`~.swim.Swim` (SWIM probes, O(1) messages
    per node per period; the default) and :class:`Heartbeat` (all-to-all pings, the
    measured baseline: ``NodeOptions.membership = "heartbeat"``, docs/SCALING.md)."""

    def __init__(self, host: OverlayHost, *, on_change: Callable[[bytes, bool], None] | None):
        self.host = host
        self.on_change = on_change
        self.health: dict[bytes, PeerHealth] = {}
        self.pings_answered = 0
        self._down_waiters: dict[bytes, set[trio.Event]] = {}  # wait_down
        # the host's one gate (py-libp2p's own dials pass it too); a stand-in host: our own
        self.gate = getattr(host, "dial_gate", None) or DialGate()
        self.max_hint_peers = MAX_HINT_PEERS
        self.hints_dropped = 0
        self.forgotten = 0
        # called with a peer given up on (never answered): the daemon's directory forgets it
        self.on_forget: Callable[[bytes], None] | None = None
        # peers never given up for want of an answer (the daemon: bootstrap peers)
        self.persistent: Callable[[bytes], bool] = lambda peer: False
        # ours, reported to peers (the daemon sets it once the digest exchange exists)
        self.summary_hash: Callable[[], bytes] | None = None

    # --- queries ---------------------------------------------------------------------

    def is_down(self, peer: bytes) -> bool:
        """Seen, then lost (missed answers): not merely not yet answered."""
        h = self.health.get(peer)
        return h is not None and h.down_since is not None

    def is_up(self, peer: bytes) -> bool:
        h = self.health.get(peer)
        return h is not None and h.up

    def up_peers(self) -> list[bytes]:
        return [p for p, h in self.health.items() if h.up]

    def up_peers_of(self, model: bytes) -> list[bytes]:
        """Up peers serving ``model`` (or that never said which model they serve)."""
        return [p for p, h in self.health.items() if h.up and h.model in (b"", model)]

    def up_models(self) -> list[tuple[bytes, str]]:
        """(fingerprint, name) of every up peer that announced its model."""
        return [(h.model, h.model_name) for h in self.health.values() if h.up and h.model]

    def rtt_s(self, peer: bytes) -> float | None:
        h = self.health.get(peer)
        return h.rtt_s if h else None

    def fresh_load(self, peer: bytes, now: float | None = None) -> float | None:
        """The peer's queue depth + running requests as it last told us, if within
        :data:`FRESH_LOAD_S`; None: older or never (routing then reads the digest's)."""
        h = self.health.get(peer)
        if h is None or h.figures_at is None:
            return None
        now = time.monotonic() if now is None else now
        return float(h.queue_depth + h.active) if now - h.figures_at <= FRESH_LOAD_S else None

    def merit(self, peer: bytes) -> int:
        """Admission merit (core/admission.py): never up, seen up, or long-standing."""
        h = self.health.get(peer)
        if h is None or h.pongs == 0:
            return NEVER_UP
        return LONG_STANDING if self.is_known(peer) else SEEN_UP

    def is_known(self, peer: bytes) -> bool:
        """Up, and answering our own direct probes for :data:`LONG_STANDING_S`."""
        raise NotImplementedError

    # --- state changes ---------------------------------------------------------------

    def _set(self, peer: bytes, up: bool, detail: str = "") -> None:
        h = self.health.setdefault(peer, PeerHealth())
        if h.up == up:
            return
        h.up = up
        h.down_since = None if up else time.monotonic()
        if not up:
            self.host.drop_pool(peer)
            for event in self._down_waiters.pop(peer, ()):
                event.set()
        log.info("peer %s is %s%s", peer_id_to_b58(peer)[-8:], "up" if up else "DOWN", detail)
        if self.on_change is not None:
            self.on_change(peer, up)

    async def wait_down(self, peer: bytes) -> None:
        """Return once ``peer`` is not up (at once if it is not up now)."""
        if not self.is_up(peer):
            return
        event = trio.Event()
        self._down_waiters.setdefault(peer, set()).add(event)
        try:
            await event.wait()
        finally:
            waiters = self._down_waiters.get(peer)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._down_waiters[peer]

    def mark_down(self, peer: bytes) -> None:
        """Called by forwarding code that saw ``peer`` fail; the monitor re-checks it."""
        self._set(peer, False)

    def _outbound_room(self) -> bool:
        """False once our own dials hold all but the inbound reserve (libp2p_guard)."""
        from .libp2p_guard import outbound_room  # with py-libp2p (host.py, "imported when")

        try:
            conns = self.host.libp2p.get_network().get_connections()
        except Exception:  # no swarm (unit tests) or one closing
            return True
        return outbound_room(sum(str(getattr(c, "direction", "")) != "inbound" for c in conns))


class Heartbeat(Liveness):
    """All-to-all pings (module docstring)."""

    def __init__(
        self,
        host: OverlayHost,
        *,
        addrs_of: Callable[[bytes], Sequence[str]],
        local_load: Callable[[], tuple[int, int]],
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        misses_to_down: int = 1,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 10.0,
        forget_after_s: float = 300.0,
        rtt_alpha: float = 0.3,
        idle_close_s: float = 30.0,
        on_change: Callable[[bytes, bool], None] | None = None,
        summary_hash: Callable[[], bytes] | None = None,
        context_tokens: Callable[[], int | None] | None = None,
        model: tuple[bytes, str] | None = None,
    ):
        super().__init__(host, on_change=on_change)
        self.addrs_of = addrs_of
        self.local_load = local_load
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.misses_to_down = misses_to_down
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.forget_after_s = forget_after_s
        self.rtt_alpha = rtt_alpha
        self.idle_close_s = idle_close_s
        self.summary_hash = summary_hash  # ours, reported in PONGs when it changes
        self.context_tokens = context_tokens  # ours, reported in every PONG
        self.model = model  # ours (fingerprint, name), in the first PONG of each stream
        self._nursery: trio.Nursery | None = None
        self._monitored: set[bytes] = set()
        self._nonce = 0
        self._hints: set[bytes] = set()  # monitored peers that hold a hint slot
        self._pending: dict[bytes, None] = {}  # hint peers waiting for a slot, oldest first

    def monitored(self) -> set[bytes]:
        return set(self._monitored)

    def is_known(self, peer: bytes) -> bool:
        """Up, with :data:`LONG_STANDING_S` of answered PINGs."""
        h = self.health.get(peer)
        return h is not None and h.up and h.pongs * self.interval_s >= LONG_STANDING_S

    # --- running ---------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.host.set_handler(wire.PING_PROTOCOL, self.handle)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def watch(self, peer: bytes) -> None:
        """Start monitoring ``peer`` (idempotent): at once if we are connected to it,
        else when a hint slot is free (module docstring, *Bounded dialing*)."""
        if peer == self.host.peer_id or peer in self._monitored or self._nursery is None:
            return
        connected = self.host.is_connected(peer)
        if not connected and len(self._hints) >= self.max_hint_peers:
            self._pending.pop(peer, None)
            self._pending[peer] = None
            if len(self._pending) > MAX_PENDING_HINTS:
                del self._pending[next(iter(self._pending))]
                self.hints_dropped += 1
            return
        self._pending.pop(peer, None)
        if not connected:
            self._hints.add(peer)
        self._monitored.add(peer)
        self.health.setdefault(peer, PeerHealth())
        self._nursery.start_soon(self._monitor, peer)

    def _release_hint(self, peer: bytes) -> None:
        """``peer`` stopped being monitored: its hint slot goes to the oldest waiting."""
        self._hints.discard(peer)
        while self._pending and len(self._hints) < self.max_hint_peers:
            nxt = next(iter(self._pending))
            del self._pending[nxt]
            self.watch(nxt)

    async def _dial(self, peer: bytes, h: PeerHealth) -> None:
        """Connect to ``peer`` through the dial gate (no dial if connected already);
        waits while the gate refuses, without counting a miss."""
        while not self.host.is_connected(peer):
            addrs = list(self.addrs_of(peer))
            if not addrs:
                raise HostError("no address known to dial")
            now = time.monotonic()
            ticket = self.gate.admit(addrs, now) if self._outbound_room() else None
            if ticket is None and h.pongs == 0 and not self.persistent(peer) and (
                    self.gate.saturated(addrs, now)):
                # a hint naming only addresses already knocked at to their budget: give it
                # up now instead of holding a monitoring slot while it waits for tokens
                h.failed_dials = max(h.failed_dials, NEVER_UP_ATTEMPTS - 1)
                raise HostError("every address of this peer is over its dial budget")
            if ticket is None:
                wait = self.gate.retry_after_s(addrs, now)
                await trio.sleep(min(max(wait, 0.1), self.backoff_max_s))
                continue
            ok = False
            try:
                await self.host.connect(peer, ticket.addrs, self.timeout_s * 2)
                ok = True
            finally:
                self.gate.done(ticket, ok)
            return

    async def _monitor(self, peer: bytes) -> None:
        backoff = self.backoff_min_s
        h = self.health[peer]
        try:
            while True:
                fs: FramedStream | None = None
                try:
                    await self._dial(peer, h)
                    stream = await self.host.open_stream(
                        peer, wire.PING_PROTOCOL, self.timeout_s * 2
                    )
                    fs = FramedStream(stream, timeout_s=self.timeout_s)
                    while True:
                        await self._ping_once(peer, fs, h)
                        backoff = self.backoff_min_s
                        await trio.sleep(self.interval_s)
                except Exception as exc:  # HostError, WireError or a library surprise: keep monitoring
                    h.misses += 1
                    if h.pongs == 0:
                        h.failed_dials += 1
                    log.debug("ping %s failed: %s", peer_id_to_b58(peer)[-8:], exc)
                    if h.misses >= self.misses_to_down:
                        self._set(peer, False)
                finally:
                    if fs is not None:
                        with trio.CancelScope(shield=True):
                            await fs.reset()
                down_for = None if h.down_since is None else time.monotonic() - h.down_since
                if give_up(ever_up=h.pongs > 0 or self.persistent(peer),
                           failed_attempts=h.failed_dials,
                           down_for_s=down_for, forget_after_s=self.forget_after_s):
                    self._forget(peer, h)
                    return
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
        finally:
            self._monitored.discard(peer)
            self._release_hint(peer)

    def _forget(self, peer: bytes, h: PeerHealth) -> None:
        self.forgotten += 1
        if h.pongs == 0:  # never answered: nothing worth keeping about it
            log.debug("forgetting peer %s (never answered %d dials)",
                      peer_id_to_b58(peer)[-8:], h.failed_dials)
            if self.health.get(peer) is h:
                del self.health[peer]
            if self.on_forget is not None:
                self.on_forget(peer)
        else:
            log.info("forgetting peer %s (down too long)", peer_id_to_b58(peer)[-8:])

    async def _ping_once(self, peer: bytes, fs: FramedStream, h: PeerHealth) -> None:
        self._nonce += 1
        nonce = self._nonce
        t0 = time.perf_counter()
        await fs.send(wire.Ping(nonce))
        frame = await fs.receive()
        if not isinstance(frame, wire.Pong) or frame.nonce != nonce:
            raise HostError(f"expected PONG {nonce}, got {frame!r}"[:120])
        rtt = time.perf_counter() - t0
        h.rtt_s = rtt if h.rtt_s is None else (1 - self.rtt_alpha) * h.rtt_s + self.rtt_alpha * rtt
        h.last_pong = time.monotonic()
        h.misses = 0
        h.pongs += 1
        h.take_figures(frame, h.last_pong)
        self._set(peer, True)

    async def handle(self, stream) -> None:
        fs = FramedStream(stream, timeout_s=self.idle_close_s)
        peer = fs.peer
        last_hash = b""  # what this stream's reader already knows
        model = self.model  # announced once per stream
        try:
            while True:
                frame = await fs.receive()
                if frame is None:
                    return
                if not isinstance(frame, wire.Ping):
                    raise wire.ProtocolViolation(
                        f"ping protocol: unexpected {type(frame).__name__}"
                    )
                q, a = self.local_load()
                current = self.summary_hash() if self.summary_hash is not None else b""
                changed = current if current != last_hash else b""
                n_ctx = (self.context_tokens() if self.context_tokens is not None else 0) or 0
                fp, name = model if model is not None else (b"", "")
                await fs.send(wire.Pong(frame.nonce, q, a, changed, n_ctx, fp, name),
                              timeout_s=self.timeout_s)
                last_hash, model = current, None
                self.pings_answered += 1
                # a peer that pings us is alive and reachable: monitor it too
                if peer not in self._monitored:
                    self.watch(peer)
        except (HostError, wire.WireError):
            pass
        finally:
            with contextlib.suppress(Exception), trio.CancelScope(shield=True):
                await fs.close()
