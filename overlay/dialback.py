"""Our reachability check, ``/prefixmesh/dialback/1`` (issue 16): both sides, on trio.

:class:`DialbackServer` answers: for each claimed address at the IP it sees the asker at
(at most :data:`~.core.reachability.MAX_CLAIMED_ADDRS`, one request per asking peer per
:data:`~.core.reachability.ANSWER_INTERVAL_S`, :data:`MAX_ANSWERING` at once and
:data:`MAX_ANSWERS_PER_MINUTE` in all) it dials a
*fresh* connection (``swarm.dial_addr``: TCP + Noise, whose handshake checks the asker's
peer id; :data:`~.core.reachability.DIALBACK_TIMEOUT_S` each, all in parallel), closes it
and answers ``{seen, results}``. The library's AutoNAT v1 would instead reuse the
connection the request came over and say "reachable" to any NATed node
(docs/bench/nat.md, bug 2).

:class:`ReachabilityService` asks: up to :data:`~.core.reachability.PEERS_TO_ASK` peers
we hold a *direct* connection to, one per /24 first, one after another (the IP the first
answerer sees us at adds the predicted address ``/ip4/<seen>/tcp/<listen port>`` to what
the next ones try: that is how a volunteer's manual port forward or a UPnP mapping is
confirmed), and keeps :attr:`ReachabilityService.reachability`
(:class:`~.core.reachability.Reachability`: ``.kind`` unknown/public/private, ``.nat``
unknown/port-preserving/symmetric). It re-checks every 10 minutes and as soon as our
addresses change; ``on_change`` hooks run on every change of kind or NAT kind (the relay
keeper, hole punching and the status line read it).

The verdict rules and the wire codec are pure: ``overlay/core/reachability.py``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import trio

from .core import reachability as rb
from .core.identity import peer_id_to_b58
from .host import FramedStream, HostError, OverlayHost, remote_peer

__all__ = ["DialbackServer", "ReachabilityService", "local_port", "direct_remote_ips", "is_relayed",
           "reachability_report", "MAX_ANSWERING"]

log = logging.getLogger(__name__)

#: dial-back requests answered at once (each holds up to 4 dials for 3 s)
MAX_ANSWERING = 8
#: and per minute over all askers: many identities must not multiply the per-peer limit
#: into a dialing service (an honest node asks 3 peers every 10 minutes)
MAX_ANSWERS_PER_MINUTE = 60
#: askers remembered for the per-peer rate limit (oldest forgotten first past this)
_MAX_REMEMBERED = 4096
#: the asker's wait for an answer: the answerer's parallel dials plus two round trips
_ANSWER_WAIT_S = rb.DIALBACK_TIMEOUT_S + 4.0
#: how often the service looks for address changes between timed checks
_POLL_S = 5.0
#: the same while there is no verdict yet (peers to ask may connect any moment)
_POLL_UNKNOWN_S = 1.0


def local_port(stream) -> int | None:
    """Our end's TCP port of the connection ``stream`` runs on (None if not readable).

    py-libp2p exposes only the remote end; the local one sits on the trio socket at the
    bottom of stream -> muxer -> security session -> raw connection."""
    obj = stream
    for _ in range(10):
        sock = getattr(obj, "socket", None)
        if sock is not None and hasattr(sock, "getsockname"):
            try:
                return int(sock.getsockname()[1])
            except Exception:
                return None
        for attr in ("muxed_stream", "muxed_conn", "conn", "secured_conn", "read_writer",
                     "stream", "_wrapped"):
            nxt = getattr(obj, attr, None)
            if nxt is not None and nxt is not obj:
                obj = nxt
                break
        else:
            return None
    return None


def is_relayed(conn) -> bool:
    with contextlib.suppress(Exception):
        if "RELAYED" in str(conn.get_connection_type()):
            return True
    with contextlib.suppress(Exception):
        return any("p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    return False


def direct_remote_ips(host: OverlayHost, peer: bytes) -> list[str]:
    """The IPs of our direct (not relayed) connections to ``peer``."""
    out = []
    for conn in host.links(peer):
        if is_relayed(conn):
            continue
        with contextlib.suppress(Exception):
            got = conn.muxed_conn.get_remote_address()
            if got:
                out.append(str(got[0]))
    return out


class DialbackServer:
    """The answering side (see the module docstring)."""

    def __init__(self, host: OverlayHost, *, clock: Callable[[], float] = time.monotonic):
        self.host = host
        self.clock = clock
        self._asked_at: dict[bytes, float] = {}
        self._recent: collections.deque[float] = collections.deque()  # admitted, last minute
        self._answering = 0
        self.answered = 0
        self.refused = 0
        self.dials_ok = 0
        self.dials_failed = 0

    def _admit(self, peer: bytes) -> bool:
        now = self.clock()
        last = self._asked_at.get(peer)
        if last is not None and now - last < rb.ANSWER_INTERVAL_S:
            return False
        if self._answering >= MAX_ANSWERING:
            return False
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) >= MAX_ANSWERS_PER_MINUTE:
            return False
        self._recent.append(now)
        self._asked_at.pop(peer, None)
        self._asked_at[peer] = now
        while len(self._asked_at) > _MAX_REMEMBERED:  # dicts keep insertion order
            del self._asked_at[next(iter(self._asked_at))]
        return True

    async def handle(self, stream) -> None:
        peer = remote_peer(stream)
        fs = FramedStream(stream, timeout_s=5.0)
        if not self._admit(peer):
            self.refused += 1
            await fs.reset()
            return
        self._answering += 1
        try:
            req = rb.decode_request(await fs.receive_raw(max_bytes=rb.MAX_MESSAGE_BYTES))
            remote = stream.get_remote_address()
            seen_ip, seen_port = (str(remote[0]), int(remote[1])) if remote else ("", 0)
            to_dial, refused = rb.dialable_claims(req.addrs, seen_ip)
            dialled: dict[str, rb.DialResult] = {}
            async with trio.open_nursery() as nursery:
                for a in to_dial:
                    nursery.start_soon(self._dial_back, peer, a, dialled)
            by_addr = {r.addr: r for r in refused} | dialled
            results = tuple(by_addr[a] for a in req.addrs[: rb.MAX_CLAIMED_ADDRS] if a in by_addr)
            await fs.send_raw(rb.encode_answer(rb.DialbackAnswer(seen_ip, seen_port, results)))
            self.answered += 1
            await fs.close()
        except rb.DialbackError as exc:
            self.refused += 1
            log.debug("dial-back request from %s refused: %s", peer_id_to_b58(peer)[:16], exc)
            await fs.reset()
        finally:
            self._answering -= 1

    async def _dial_back(self, peer: bytes, addr: str, out: dict[str, rb.DialResult]) -> None:
        # a second connection to the peer: py-libp2p (max_connections_per_peer=1) trims the
        # one with fewer streams, which is this fresh one, never the one carrying the
        # request (tests/overlay/test_dialback.py checks it with no grace period)
        import multiaddr
        from libp2p.peer.id import ID

        network = self.host.libp2p.get_network()
        why = "timeout"
        ok = False
        with trio.move_on_after(rb.DIALBACK_TIMEOUT_S):
            try:
                conn = await network.dial_addr(multiaddr.Multiaddr(addr), ID(peer))
            except trio.Cancelled:
                raise
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"[: rb.MAX_WHY_CHARS]
            else:
                ok, why = True, "dialed"
                with contextlib.suppress(Exception), trio.move_on_after(1):
                    await conn.close()
        if ok:
            self.dials_ok += 1
        else:
            self.dials_failed += 1
        out[addr] = rb.DialResult(addr, ok, why)


class ReachabilityService:
    """The asking side: keeps :attr:`reachability` current (see the module docstring)."""

    def __init__(
        self,
        host: OverlayHost,
        *,
        peers: Callable[[], Sequence[bytes]],
        claimed_addrs: Callable[[], Sequence[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.peers = peers
        self.claimed_addrs = claimed_addrs
        self.clock = clock
        self.reachability: rb.Reachability = rb.UNKNOWN
        self.schedule = rb.RecheckSchedule()
        #: hooks ``fn(old, new)`` run when ``kind`` or ``nat`` changes
        self.on_change: list[Callable[[rb.Reachability, rb.Reachability], None]] = []
        self.checks = 0
        self._asked_at: dict[bytes, float] = {}
        self._observations: dict[bytes, tuple[float, rb.Observation]] = {}
        self._base: frozenset[str] = frozenset()
        self._logged_first = False

    # --- what we claim -----------------------------------------------------------------

    def _claims(self, seen_ip: str) -> list[str]:
        """Addresses to have dialled: a predicted WAN address first, then ours, non-LAN
        before LAN, at most 4."""
        own = self._base_addrs()
        ports = [p for p in (rb.addr_port(a) for a in own) if p]
        predicted = []
        if seen_ip and not rb.is_lan_ip(seen_ip) and ports:
            fam = "ip6" if ":" in seen_ip else "ip4"
            predicted = [f"/{fam}/{seen_ip}/tcp/{ports[0]}"]
        ranked = predicted + sorted((a for a in own if a not in predicted),
                                    key=lambda a: rb.is_lan_ip(rb.addr_ip(a) or ""))
        return [a for a in ranked if rb.addr_ip(a)][: rb.MAX_CLAIMED_ADDRS]

    # --- asking ------------------------------------------------------------------------

    async def _ask(self, peer: bytes, claims: list[str]) -> rb.Observation | None:
        try:
            stream = await self.host.open_stream(peer, rb.PROTOCOL)
        except HostError as exc:
            log.debug("dial-back ask %s: %s", peer_id_to_b58(peer)[:16], exc)
            return None
        fs = FramedStream(stream, timeout_s=_ANSWER_WAIT_S)
        try:
            await fs.send_raw(rb.encode_request(rb.DialbackRequest(tuple(claims))))
            answer = rb.decode_answer(await fs.receive_raw(max_bytes=rb.MAX_MESSAGE_BYTES))
        except (HostError, rb.DialbackError, ValueError) as exc:
            # a peer that refused (asked too often) or sent garbage: no answer
            log.debug("dial-back answer from %s: %s", peer_id_to_b58(peer)[:16], exc)
            await fs.reset()
            return None
        await fs.close()
        return rb.Observation(peer, local_port(stream), answer)

    def _base_addrs(self) -> list[str]:
        """Our claimed direct addresses (circuit addresses come and go with relays and
        are no news about our own reachability)."""
        return [a for a in dict.fromkeys(self.claimed_addrs()) if rb.addr_ip(a)]

    def _own_ips(self) -> list[str]:
        return [ip for ip in (rb.addr_ip(a) for a in self.host.transport_addrs()) if ip]

    def _candidates(self, now: float) -> list[tuple[bytes, str]]:
        """(peer, IP) of directly connected up peers we may ask now (not in the last
        :data:`~.core.reachability.ANSWER_INTERVAL_S`: they would refuse)."""
        return [(p, ip) for p in self.peers()
                if now - self._asked_at.get(p, -1e18) >= rb.ANSWER_INTERVAL_S
                for ip in direct_remote_ips(self.host, p)]

    def _worth_asking_now(self) -> bool:
        """Without a verdict, a newly connected peer is asked at once (the first verdict
        comes as soon as there are peers, not at the next timed retry)."""
        if self.reachability.kind != "unknown":
            return False
        return bool(rb.choose_askers(self._candidates(self.clock()), self._own_ips()))

    async def check_once(self) -> rb.Reachability:
        """Ask the peers due a question and recompute the verdict (bounded: each ask is
        under the host's stream timeout and :data:`_ANSWER_WAIT_S`)."""
        now = self.clock()
        base = frozenset(self._base_addrs())
        if base != self._base:  # our addresses changed: earlier answers are stale
            self._observations.clear()
            self._asked_at.clear()
            self._base = base
        for p, (t, _) in list(self._observations.items()):
            if now - t > rb.RECHECK_INTERVAL_S:
                del self._observations[p]
        candidates = self._candidates(now)
        seen_ip = self.reachability.seen_ip
        askers = rb.choose_askers(candidates, self._own_ips())
        for peer in askers:
            self._asked_at[peer] = self.clock()
            obs = await self._ask(peer, self._claims(seen_ip))
            if obs is not None:
                self._observations[peer] = (self.clock(), obs)
                seen_ip = seen_ip or obs.answer.seen_ip
        self.checks += 1
        new = rb.verdict([o for _, o in self._observations.values()])
        if not askers and not self._observations:
            # say why nothing happens: on loopback or a one-host LAN every peer is "us"
            new = dataclasses.replace(new, why="no peer at another IP address to ask yet")
        self._set(new)
        self.schedule.checked(self.clock(), sorted(base), new)
        return new

    def _set(self, new: rb.Reachability) -> None:
        old = self.reachability
        self.reachability = new
        changed = (old.kind, old.nat) != (new.kind, new.nat)
        if changed or (not self._logged_first and new.kind != "unknown"):
            self._logged_first = self._logged_first or new.kind != "unknown"
            log.info("reachability: %s, NAT %s (%s%s)", new.kind, new.nat, new.why,
                     f"; seen at {new.seen_ip}" if new.seen_ip else "")
        if changed:
            for hook in list(self.on_change):
                try:
                    hook(old, new)
                except Exception as exc:  # a hook's bug must not stop the checks
                    log.warning("reachability hook %r failed: %s", hook, exc)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        log.info("reachability: checking (dial-back by up to %d peers, %s)",
                 rb.PEERS_TO_ASK, rb.PROTOCOL)
        task_status.started()
        while True:
            if self.schedule.due(self.clock(), sorted(self._base_addrs())) \
                    or self._worth_asking_now():
                await self.check_once()
            poll = _POLL_UNKNOWN_S if self.reachability.kind == "unknown" else _POLL_S
            await trio.sleep(max(0.5, min(poll, self.schedule.next_in(self.clock()))))


def _relay_keeper(node):
    """The node's reservation keeper (overlay/relay.py), whichever name it is under."""
    for name in ("keeper", "relay_keeper", "reservations"):
        k = getattr(node, name, None)
        if k is not None and hasattr(k, "reserved_relays"):
            return k
    return None


def reachability_report(node) -> dict:
    """What ``prefixmesh status``, the dashboard and ``/metrics`` show about reachability:
    the status line (:func:`~.core.reachability.status_line`) and what it rests on. Reads
    the node's ``reachability`` service, its relay keeper and its hole puncher where they
    exist (each may be absent: a node without them is reported as such)."""
    svc = getattr(node, "reachability", None)
    r = getattr(svc, "reachability", rb.UNKNOWN)
    keeper = _relay_keeper(node)
    punch = getattr(node, "holepunch", None)
    reserved: list[str] = []
    tried: list[str] = []
    failure = None
    if keeper is not None:
        with contextlib.suppress(Exception):
            reserved = list(keeper.reserved_relays())
            tried = list(keeper.tried())
            failure = getattr(keeper, "last_failure", None)
    elif r.kind == "private":
        failure = "no relay reservation (relay client not running)"
    direct = int(punch.direct_peers()) if punch is not None else 0
    return {
        # relays by their peer id's last 8 characters, as the keeper's log lines name them
        "line": rb.status_line(r, reserved_relays=[x[-8:] for x in reserved],
                               tried_relays=[x[-8:] for x in tried],
                               relay_failure=failure, punched_peers=direct),
        "kind": r.kind,
        "nat": r.nat,
        "why": r.why,
        "seen_ip": r.seen_ip,
        "relays": reserved,
        "hole_punch": punch.counts() if punch is not None else None,
    }
