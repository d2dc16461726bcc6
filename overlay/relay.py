"""Circuit relay v2 for volunteers behind NAT (issue 16): the relay service a public node
offers, and the reservations a private node keeps.

What is the library's and what is ours (measured in docs/bench/nat.md)
    py-libp2p 0.8.1's ``CircuitV2Protocol`` speaks the hop/stop protocols, keeps
    reservations (``RelayLimits``: count, TTL, circuits per destination) and caps each
    circuit's bytes and duration. Ours, in :class:`FixedHop`: the splice (each circuit
    resets only its own two streams, the duration cap is a deadline on the whole splice,
    a circuit over a connection that closed is cut at once, no relay STATUS written into
    the peers' end-to-end session), the global limits the library's ``HopConfig``
    declares but never applies (:class:`~.core.relaying.CircuitBook`: 64 circuits, 8 per
    source /24, 4 per destination; pacing at 4 MB/s over all circuits and 1 MB/s per
    circuit) and the byte counts for ``stats()``.

    :class:`ReservationKeeper` is ours (the library's refresher only runs under its relay
    discovery, which reserves at every relay it finds): reserve at
    :data:`~.core.relaying.RESERVE_AT` relays, bootstrap peers first, then other public
    peers; renew at 80 % of the TTL; probe each relay every 5 s (3 s timeout: a frozen
    relay keeps its TCP connection); on loss reserve at the next one and tell the node,
    which republishes its addresses (``/ip4/R/tcp/P/p2p/R/p2p-circuit``).

Public API read by ``node/status.py``: ``keeper.reserved_relays()``, ``keeper.tried()``,
``keeper.last_failure``, ``relay_service.stats()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeer
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from libp2p.tools.constants import MAX_READ_LEN

from .core import relaying as rl
from .core.limits import subnet_of_multiaddr
from .libp2p_guard import QuietNotifee

__all__ = ["FixedHop", "RelayService", "ReservationKeeper", "relay_limits", "HOP_PROTOCOL"]

log = logging.getLogger(__name__)

class _Circuit:
    """What both directions of one circuit share: its pacing bucket, its last activity."""

    def __init__(self) -> None:
        self.bucket = rl.ByteBucket(rl.CIRCUIT_RATE_BPS, _CIRCUIT_BURST)
        self.last = trio.current_time()


#: the circuit a splice task belongs to (set before the library starts both directions)
_CIRCUIT: contextvars.ContextVar[_Circuit | None] = contextvars.ContextVar(
    "circuit", default=None)
#: pacing credit: a 256 KiB answer leaves at once, a 32 MiB stream is paced
_CIRCUIT_BURST = 256 * 1024
_RELAY_BURST = 1024 * 1024


def relay_limits() -> RelayLimits:
    """The library's limits, ours in value (docs/bench/nat.md, "Recommended design")."""
    return RelayLimits(duration=rl.CIRCUIT_DURATION_S, data=rl.CIRCUIT_DATA_BYTES,
                       max_circuit_conns=rl.MAX_CIRCUITS_PER_DEST,
                       max_reservations=rl.MAX_RESERVATIONS,
                       reservation_ttl=rl.RESERVATION_TTL_S)


class _ConnGone(QuietNotifee):
    """A connection that closes cuts every circuit spliced over it: the streams of a dead
    connection neither fail reads nor writes at the relay (measured), so without this
    the far end is never told."""

    def __init__(self, hop: FixedHop) -> None:
        self.hop = hop

    async def disconnected(self, network, conn) -> None:
        gone = conn.muxed_conn
        for src, dst, scope in list(self.hop.circuits):
            if getattr(src, "muxed_conn", None) is gone or \
                    getattr(dst, "muxed_conn", None) is gone:
                scope.cancel()


def _stream_subnet(stream) -> str:
    with contextlib.suppress(Exception):
        got = stream.muxed_conn.get_remote_address()
        if got:
            ip = got[0]
            return subnet_of_multiaddr(f"/{'ip6' if ':' in ip else 'ip4'}/{ip}") or "none"
    return "none"


class FixedHop(CircuitV2Protocol):
    """``CircuitV2Protocol`` with our splice, admission and pacing (module docstring).
    With ``allow_hop=False`` it is the stop side only (every node runs one)."""

    def __init__(self, host, *args, **kw) -> None:
        super().__init__(host, *args, **kw)
        self.circuits: set = set()
        self.book = rl.CircuitBook()
        self.bucket = rl.ByteBucket(rl.RELAY_RATE_BPS, _RELAY_BURST)
        self.bytes_carried = 0
        self.circuits_cut = 0
        self.circuits_idle_cut = 0
        host.get_network().register_notifee(_ConnGone(self))

    async def _handle_connect(self, stream, msg) -> None:
        dest = "?"
        with contextlib.suppress(Exception):
            dest = ID(msg.peer.id).to_base58()
        ticket = self.book.admit(dest, _stream_subnet(stream))
        if isinstance(ticket, str):
            log.debug("relay: circuit to %s refused (%s)", dest[-8:], ticket)
            with contextlib.suppress(Exception), trio.move_on_after(2):
                await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, ticket)
                await trio.sleep(0.2)  # let the STATUS leave before the reset
                await stream.reset()
            return
        token = _CIRCUIT.set(_Circuit())
        try:
            await super()._handle_connect(stream, msg)
        finally:
            _CIRCUIT.reset(token)
            self.book.release(ticket)

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None,
                          circuit_data_limit=None) -> None:
        scope = trio.CancelScope()
        if deadline is not None:  # the library's deadline is on time.monotonic()
            scope.deadline = trio.current_time() + max(0.0, deadline - time.monotonic())
        entry = (src_stream, dst_stream, scope)
        self.circuits.add(entry)
        circuit = _CIRCUIT.get()
        try:
            with scope:
                while True:
                    try:
                        with trio.move_on_after(rl.CIRCUIT_IDLE_S) as waited:
                            data = await src_stream.read(MAX_READ_LEN)
                    except Exception:
                        break
                    if waited.cancelled_caught:
                        if circuit is None or \
                                trio.current_time() - circuit.last >= rl.CIRCUIT_IDLE_S:
                            self.circuits_idle_cut += 1
                            break
                        continue  # the other direction is busy
                    if not data:
                        break
                    if circuit is not None:
                        circuit.last = trio.current_time()
                    if circuit_data_limit is not None:
                        if len(data) > circuit_data_limit[0]:
                            self.circuits_cut += 1
                            break
                        circuit_data_limit[0] -= len(data)
                    now = trio.current_time()
                    wait = self.bucket.take(len(data), now)
                    if circuit is not None:
                        wait = max(wait, circuit.bucket.take(len(data), now))
                    if wait > 0:
                        await trio.sleep(wait)
                    # shielded: a cancelled write can desync the connection's Noise
                    # session (overlay/host.py write_whole says how)
                    with trio.CancelScope(shield=True), trio.fail_after(self.write_timeout):
                        await dst_stream.write(data)
                    self.bytes_carried += len(data)
            if scope.cancelled_caught:
                self.circuits_cut += 1
        except Exception:
            pass
        finally:
            self.circuits.discard(entry)
            for s in (src_stream, dst_stream):
                with contextlib.suppress(Exception), trio.move_on_after(1) as cs:
                    cs.shield = True
                    await s.reset()
            for key, pair in list(self._active_relays.items()):
                if src_stream in pair or dst_stream in pair:
                    del self._active_relays[key]

    def reservations(self) -> int:
        rm = self.resource_manager
        with contextlib.suppress(Exception):
            rm._clean_expired()
        return len(getattr(rm, "_reservations", {}))


class RelayService:
    """The bounded relay a public node offers (``[nat].relay_service``)."""

    def __init__(self, host) -> None:
        self.host = host  # an OverlayHost
        self.hop = FixedHop(host.libp2p, limits=relay_limits(), allow_hop=True)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.hop):
            await self.hop.event_started.wait()
            log.info("relay service on: up to %d reservations, %d circuits, %d s / %d MiB "
                     "per circuit", rl.MAX_RESERVATIONS, rl.MAX_CIRCUITS,
                     rl.CIRCUIT_DURATION_S, rl.CIRCUIT_DATA_BYTES >> 20)
            task_status.started(self)
            await trio.sleep_forever()

    def stats(self) -> dict[str, int]:
        book = self.hop.book
        return {
            "circuits_open": len(book.open),
            "circuits_total": book.total,
            "bytes_relayed": self.hop.bytes_carried,
            "reservations": self.hop.reservations(),
            "refused": sum(book.refused.values()),
            "idle_cut": self.hop.circuits_idle_cut,
        }


@dataclass
class _Held:
    addr: str  # the relay's full multiaddr, /p2p/R included
    circuit: str  # our transport address through it
    expires_at: float  # wall clock, from the relay's answer
    renew_at: float  # monotonic
    probe_at: float  # monotonic
    # the connections the reservation was made over: the relay drops a reservation when
    # its connection closes, even if one is dialled again before the keeper looks
    links: tuple[object, ...] = ()


class ReservationKeeper:
    """Reservations of a private node (module docstring). ``bootstrap()`` and ``known()``
    give relay candidates as full multiaddrs (``.../p2p/R``), best first; ``on_change()``
    is called whenever the set of held relays changes."""

    #: how often the keeper looks at its relays (a killed relay's connection closes at once)
    LOOP_S = 0.5

    def __init__(self, host, *, bootstrap: Callable[[], Sequence[str]],
                 known: Callable[[], Sequence[str]] = list,
                 on_change: Callable[[], None] = lambda: None,
                 want: int = rl.RESERVE_AT, clock: Callable[[], float] = time.monotonic):
        self.host = host  # an OverlayHost
        self.bootstrap, self.known, self.on_change = bootstrap, known, on_change
        self.want = want
        self.clock = clock
        self.chooser = rl.RelayChooser()
        self.held: dict[str, _Held] = {}
        self._tried: list[str] = []
        self.last_failure: str | None = None
        self.reserved_total = 0
        self.lost_total = 0
        self._said_unreachable = False

    # --- what status reads ----------------------------------------------------------

    def reserved_relays(self) -> list[str]:
        return list(self.held)

    def tried(self) -> list[str]:
        return list(self._tried)

    def circuit_addrs(self) -> list[str]:
        return [h.circuit for h in self.held.values()]

    # --- the loop -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        while True:
            try:
                await self._fill()
                await self._check()
            except (trio.Cancelled, KeyboardInterrupt):
                raise
            except Exception:  # a bug here must not stop the node
                log.exception("reservation keeper")
            await trio.sleep(self.LOOP_S)

    @staticmethod
    def _pairs(addrs: Sequence[str]) -> list[tuple[str, str]]:
        out = []
        for a in addrs:
            if rl.is_circuit(a) or "/p2p/" not in a:
                continue
            out.append((a.rsplit("/p2p/", 1)[1], a))
        return out

    async def _fill(self) -> None:
        missing = self.want - len(self.held)
        if missing <= 0:
            return
        me = self.host.identity.peer_id_b58
        boot = [p for p in self._pairs(self.bootstrap()) if p[0] != me]
        known = [p for p in self._pairs(self.known()) if p[0] != me]
        picks = self.chooser.next(boot, known, self.held, self.clock(), missing)
        changed = False
        for relay, addr in picks:
            if relay not in self._tried:
                self._tried.append(relay)
            try:
                expires_at = await self._reserve(relay, addr)
            except Exception as exc:  # noqa: BLE001 - any failure moves us on
                why = str(exc) or type(exc).__name__
                self.last_failure = f"relay {relay[-8:]}: {why[:160]}"
                self.chooser.failed(relay, self.clock())
                log.debug("reservation at %s failed: %s", relay[-8:], why)
                continue
            self.chooser.succeeded(relay)
            now = self.clock()
            ttl = max(1.0, expires_at - time.time())
            self.held[relay] = _Held(addr, rl.circuit_addr(addr, relay), expires_at,
                                     now + rl.RENEW_FRACTION * ttl, now + rl.PROBE_EVERY_S,
                                     self.host.links(ID.from_base58(relay).to_bytes()))
            self.reserved_total += 1
            changed = True
            log.info("reachable via relay %s (reservation for %.0f s)", relay[-8:], ttl)
        if changed:
            self.on_change()
            self._said_unreachable = False
        elif not self.held and not self._said_unreachable:
            self._said_unreachable = True
            log.warning("not reachable from outside our NAT: no relay accepted a reservation "
                        "(tried %s; %s); we keep asking and serve as an entry node meanwhile",
                        ", ".join(r[-8:] for r in self._tried) or "none", self.last_failure)

    async def _check(self) -> None:
        now = self.clock()
        lost: dict[str, str] = {}

        async def look(relay: str, h: _Held) -> None:
            pid = ID.from_base58(relay).to_bytes()
            links = self.host.links(pid)
            if not links:
                lost[relay] = "connection closed"
                return
            if not any(c in h.links for c in links):
                lost[relay] = "connection closed and dialled again (the reservation went with it)"
                return
            try:
                if now >= h.renew_at:
                    h.expires_at = await self._reserve(relay, h.addr)
                    h.links = self.host.links(pid)
                    ttl = max(1.0, h.expires_at - time.time())
                    h.renew_at = self.clock() + rl.RENEW_FRACTION * ttl
                    h.probe_at = self.clock() + rl.PROBE_EVERY_S
                elif now >= h.probe_at:
                    with trio.fail_after(rl.PROBE_TIMEOUT_S):
                        stream = await self.host.open_stream(pid, HOP_PROTOCOL,
                                                             rl.PROBE_TIMEOUT_S)
                    with contextlib.suppress(Exception), trio.move_on_after(1):
                        await stream.close()
                    h.probe_at = self.clock() + rl.PROBE_EVERY_S
            except Exception as exc:  # noqa: BLE001
                lost[relay] = (f"no answer to a probe in {rl.PROBE_TIMEOUT_S:.0f} s"
                               if isinstance(exc, trio.TooSlowError) else
                               str(exc) or type(exc).__name__)

        async with trio.open_nursery() as nursery:
            for relay, h in list(self.held.items()):
                nursery.start_soon(look, relay, h)
        if not lost:
            return
        for relay, why in lost.items():
            self.held.pop(relay, None)
            self.lost_total += 1
            self.last_failure = f"relay {relay[-8:]} lost: {why[:160]}"
            self.chooser.failed(relay, self.clock())
            log.warning("lost relay %s (%s): looking for another", relay[-8:], why)
        self.on_change()  # withdraw the circuit addresses before anything else waits
        for relay in lost:
            with contextlib.suppress(Exception):
                await self.host.disconnect(ID.from_base58(relay).to_bytes())
        await self._fill()

    async def _reserve(self, relay: str, addr: str) -> float:
        """RESERVE at ``relay``; returns the reservation's expiry (wall clock). Our own
        client over the library's messages (its transport's reserve is private and
        starts its own refresher)."""
        pid = ID.from_base58(relay).to_bytes()
        await self.host.connect(pid, [rl.transport_part(addr)])
        stream = await self.host.open_stream(pid, HOP_PROTOCOL)
        try:
            with trio.fail_after(rl.PROBE_TIMEOUT_S * 2):
                await write_delimited_msg(stream, HopMessage(
                    type=HopMessage.RESERVE,
                    peer=CircuitPeer(id=self.host.peer_id)))
                resp = await read_delimited_msg(stream, HopMessage)
        except trio.TooSlowError:
            raise TimeoutError("no answer to RESERVE") from None
        finally:
            with contextlib.suppress(Exception), trio.move_on_after(1):
                await stream.close()
        status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
        if status != StatusCode.OK:
            raise RuntimeError(f"refused: {status.name}")
        expire = resp.reservation.expire if resp.HasField("reservation") else 0
        return float(expire) if expire else time.time() + rl.RESERVATION_TTL_S
