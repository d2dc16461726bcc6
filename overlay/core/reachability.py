"""Reachability: is this node dialable from outside, and what NAT is it behind (issue 16).

The library's AutoNAT v1 gives false "public" verdicts (its dial-back reuses the asker's
existing connection, docs/bench/nat.md bug 2), so we run our own dial-back protocol,
``/prefixmesh/dialback/1``, over a connection we already have and trust:

* the asker sends the addresses it claims (:class:`DialbackRequest`, at most
  :data:`MAX_CLAIMED_ADDRS`);
* the answerer dials each claimed address whose IP is the one it sees the asker at (no
  amplification: it never dials a third party), on a *fresh* connection whose Noise
  handshake checks the asker's peer id, and answers what it saw
  (:class:`DialbackAnswer`: the asker's IP and port as seen, one :class:`DialResult` per
  claimed address).

This module is the pure part: the wire codec (bounded CBOR, typed
:class:`DialbackError`), whom to ask (:func:`choose_askers`), the verdict from the
answers (:func:`verdict`), when to ask again (:class:`RecheckSchedule`) and the one-line
status people read (:func:`status_line`). The trio service is ``overlay/dialback.py``.

Verdict rules
    ``public`` when at least :data:`CONFIRMATIONS` answerers dialled us back at a
    non-LAN address (a dial-back to 10.x/192.168.x/100.64.x/loopback proves only that a
    neighbour reaches us); ``private`` when some answerer could not (or would not: the IP
    it sees is not one we claim, which is what a NAT looks like); ``unknown`` with no
    answer yet, or one success only.

NAT kind
    The port an answerer sees for our connection to it, compared with our own end of that
    connection: equal at every answerer, ``port-preserving`` (the NAT keeps source ports,
    as Linux ``masquerade`` and most home routers do: DCUtR hole punching can work,
    10/10 in the lab); different at any, ``symmetric`` (ports are rewritten per
    connection: relay only; 0/10 in the lab). Known only for connections whose local port
    the shell could read.

Pure code: ``cbor2`` (through :mod:`.cbor`) and ``ipaddress``; no clock (times are
arguments).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

import cbor2

from . import cbor
from .relaying import PRIVATE_NETS, ip_in_nets

__all__ = [
    "PROTOCOL",
    "MAX_CLAIMED_ADDRS",
    "MAX_MESSAGE_BYTES",
    "CONFIRMATIONS",
    "PEERS_TO_ASK",
    "RECHECK_INTERVAL_S",
    "ANSWER_INTERVAL_S",
    "DIALBACK_TIMEOUT_S",
    "KINDS",
    "NAT_KINDS",
    "DialbackError",
    "DialbackRequest",
    "DialResult",
    "DialbackAnswer",
    "Observation",
    "Reachability",
    "UNKNOWN",
    "encode_request",
    "decode_request",
    "encode_answer",
    "decode_answer",
    "addr_ip",
    "addr_port",
    "is_lan_ip",
    "subnet_key",
    "dialable_claims",
    "choose_askers",
    "nat_kind",
    "verdict",
    "RecheckSchedule",
    "status_line",
]

PROTOCOL = "/prefixmesh/dialback/1"
#: addresses an answerer dials per request (more are refused, not truncated)
MAX_CLAIMED_ADDRS = 4
#: one multiaddr's text, as the node writes them (``/ip6/<39>/tcp/<5>`` is ~55)
MAX_ADDR_CHARS = 200
#: a result's reason text
MAX_WHY_CHARS = 160
#: largest request or answer, whole (4 addresses and 4 results fit in well under this)
MAX_MESSAGE_BYTES = 4096
#: answerers that must dial us back for ``public``
CONFIRMATIONS = 2
#: answerers asked per check (different /24s where we know enough peers)
PEERS_TO_ASK = 3
#: a settled verdict is checked again after this long (and at once when addresses change)
RECHECK_INTERVAL_S = 600.0
#: an ``unknown`` verdict (no peer, or too few answers) is retried this soon
RETRY_UNKNOWN_S = 15.0
#: an answerer serves one request per asking peer per this many seconds
ANSWER_INTERVAL_S = 60.0
#: one dial-back (TCP + Noise + Yamux to the claimed address)
DIALBACK_TIMEOUT_S = 3.0

KINDS = ("unknown", "public", "private")
NAT_KINDS = ("unknown", "port-preserving", "symmetric")

_MSG_REQUEST = 1
_MSG_ANSWER = 2
_MAX_ITEMS = 64  # CBOR items in the largest valid message: 4 results of 4 items plus heads
# the NAT'd ranges (relaying.PRIVATE_NETS) plus loopback and "this network"
_LAN_NETS = PRIVATE_NETS + tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "0.0.0.0/8", "::1/128", "::/128"))


class DialbackError(ValueError):
    """A dial-back message is malformed or outside the limits (the message says which)."""


@dataclass(frozen=True)
class DialbackRequest:
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class DialResult:
    addr: str
    ok: bool
    why: str  # "dialed", "timeout", "not the IP you are seen at", an error's text...


@dataclass(frozen=True)
class DialbackAnswer:
    seen_ip: str  # the asker's IP as the answerer's transport saw it ("" unknown)
    seen_port: int  # 0 unknown
    results: tuple[DialResult, ...]


# ---------------------------------------------------------------------------- codec


def _dump(obj: object) -> bytes:
    data = cbor2.dumps(obj)
    if len(data) > MAX_MESSAGE_BYTES:
        raise DialbackError(f"dial-back message of {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def _load(data: bytes, msg_type: int, n_fields: int) -> list:
    if type(data) is not bytes:
        raise DialbackError("dial-back message must be bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise DialbackError(f"dial-back message of {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        m = cbor.loads(data, max_depth=4, max_items=_MAX_ITEMS)
    except cbor.CborError as exc:
        raise DialbackError(f"dial-back message: {exc}") from None
    if type(m) is not list or len(m) != n_fields:
        raise DialbackError(f"dial-back message must be an array of {n_fields} items")
    if m[0] != msg_type or type(m[0]) is not int:
        raise DialbackError(f"dial-back message type {m[0]!r}, expected {msg_type}")
    return m


def _check_addr(a: object) -> str:
    if type(a) is not str or not a or len(a) > MAX_ADDR_CHARS:
        raise DialbackError(f"an address must be a non-empty string of at most {MAX_ADDR_CHARS} characters")
    if not a.startswith("/"):
        raise DialbackError(f"address {a[:40]!r} is not a multiaddr")
    return a


def _check_addr_list(addrs: object) -> tuple[str, ...]:
    if type(addrs) is not list:
        raise DialbackError("addresses must be an array")
    if len(addrs) > MAX_CLAIMED_ADDRS:
        raise DialbackError(f"{len(addrs)} addresses claimed, at most {MAX_CLAIMED_ADDRS}")
    return tuple(_check_addr(a) for a in addrs)


def encode_request(req: DialbackRequest) -> bytes:
    return _dump([_MSG_REQUEST, list(_check_addr_list(list(req.addrs)))])


def decode_request(data: bytes) -> DialbackRequest:
    m = _load(data, _MSG_REQUEST, 2)
    return DialbackRequest(_check_addr_list(m[1]))


def encode_answer(ans: DialbackAnswer) -> bytes:
    results = [[r.addr, r.ok, r.why[:MAX_WHY_CHARS]] for r in ans.results]
    return _dump([_MSG_ANSWER, ans.seen_ip, ans.seen_port, results])


def _check_result(item: object) -> DialResult:
    if type(item) is not list or len(item) != 3:
        raise DialbackError("a result must be an array [addr, ok, why]")
    addr, ok, why = item
    if type(ok) is not bool:
        raise DialbackError("a result's ok must be a boolean")
    if type(why) is not str or len(why) > MAX_WHY_CHARS:
        raise DialbackError(f"a result's why must be a string of at most {MAX_WHY_CHARS} characters")
    return DialResult(_check_addr(addr), ok, why)


def decode_answer(data: bytes) -> DialbackAnswer:
    m = _load(data, _MSG_ANSWER, 4)
    seen_ip, seen_port, results = m[1], m[2], m[3]
    if type(seen_ip) is not str or len(seen_ip) > 45:
        raise DialbackError("seen IP must be a string of at most 45 characters")
    if seen_ip:
        try:
            ipaddress.ip_address(seen_ip)
        except ValueError:
            raise DialbackError(f"seen IP {seen_ip[:45]!r} is not an IP address") from None
    if type(seen_port) is not int or not 0 <= seen_port <= 65535:
        raise DialbackError("seen port must be an integer 0..65535")
    if type(results) is not list or len(results) > MAX_CLAIMED_ADDRS:
        raise DialbackError(f"results must be an array of at most {MAX_CLAIMED_ADDRS}")
    return DialbackAnswer(seen_ip, seen_port, tuple(_check_result(r) for r in results))


# ---------------------------------------------------------------------------- addresses


def addr_ip(addr: str) -> str | None:
    """The IP of an ``/ip4|ip6/<ip>/...`` multiaddr's text (None for anything else)."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6") or "p2p-circuit" in parts:
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def addr_port(addr: str) -> int | None:
    """The TCP port of an ``/ip4|ip6/<ip>/tcp/<port>`` multiaddr's text."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[3] != "tcp" or not parts[4].isdigit():
        return None
    port = int(parts[4])
    return port if 0 < port <= 65535 else None


def is_lan_ip(ip: str) -> bool:
    """True for addresses only neighbours can reach (RFC 1918, CGNAT, loopback, link-local)."""
    return ip_in_nets(ip, _LAN_NETS, invalid=True)


def subnet_key(ip: str) -> str:
    """The /24 (IPv4) or /48 (IPv6) an address is in: one vote per subnet."""
    a = ipaddress.ip_address(ip)
    prefix = 24 if a.version == 4 else 48
    return str(ipaddress.ip_network(f"{a}/{prefix}", strict=False))


def dialable_claims(addrs: Sequence[str], seen_ip: str) -> tuple[list[str], list[DialResult]]:
    """The answerer's split of claimed addresses: (to dial, refused without dialing).

    Only addresses at ``seen_ip``, the IP the asker's connection comes from, are dialled:
    an answerer never dials a third party on someone's word (no amplification)."""
    to_dial: list[str] = []
    refused: list[DialResult] = []
    for a in addrs[:MAX_CLAIMED_ADDRS]:
        ip = addr_ip(a)
        if ip is None or addr_port(a) is None:
            refused.append(DialResult(a, False, "not a TCP address"))
        elif not seen_ip or ip != seen_ip:
            refused.append(DialResult(a, False, "not the IP you are seen at"))
        else:
            to_dial.append(a)
    return to_dial, refused


def choose_askers(candidates: Sequence[tuple[bytes, str]], own_ips: Sequence[str],
                  k: int = PEERS_TO_ASK) -> list[bytes]:
    """Up to ``k`` of ``(peer, ip seen on our direct connection)`` to ask, each at its own
    IP (never ours), one per /24 first, then the others in the given order (a mesh whose
    public nodes share one subnet still gets its two answers)."""
    own = set(own_ips)
    picked: list[bytes] = []
    ips: set[str] = set()
    subnets: set[str] = set()
    later: list[tuple[bytes, str]] = []
    for peer, ip in candidates:
        try:
            net = subnet_key(ip)
        except ValueError:
            continue
        if ip in own or ip in ips or peer in picked:
            continue
        if net in subnets:
            later.append((peer, ip))
            continue
        picked.append(peer)
        ips.add(ip)
        subnets.add(net)
        if len(picked) == k:
            return picked
    for peer, ip in later:
        if ip not in ips and peer not in picked:
            picked.append(peer)
            ips.add(ip)
            if len(picked) == k:
                break
    return picked


# ---------------------------------------------------------------------------- verdict


@dataclass(frozen=True)
class Observation:
    """One answer, with what the asker knows about the connection it asked over."""

    answerer: bytes
    local_port: int | None  # our end of that connection (None: unknown)
    answer: DialbackAnswer


@dataclass(frozen=True)
class Reachability:
    kind: str  # one of KINDS
    nat: str  # one of NAT_KINDS
    why: str  # for people: what the verdict rests on
    seen_ip: str = ""  # the IP answerers see us at (our WAN address behind a NAT)
    confirmations: int = 0  # answerers that dialled us back at a non-LAN address


UNKNOWN = Reachability("unknown", "unknown", "not checked yet")


def nat_kind(observations: Sequence[Observation]) -> str:
    """``port-preserving`` / ``symmetric`` / ``unknown`` from seen vs local ports."""
    pairs = [(o.local_port, o.answer.seen_port) for o in observations
             if o.local_port and o.answer.seen_port]
    if not pairs:
        return "unknown"
    if any(local != seen for local, seen in pairs):
        return "symmetric"
    return "port-preserving"


def verdict(observations: Sequence[Observation]) -> Reachability:
    """The reachability the answers show (rules in the module docstring)."""
    nat = nat_kind(observations)
    seen = [o.answer.seen_ip for o in observations if o.answer.seen_ip]
    seen_ip = max(set(seen), key=seen.count) if seen else ""
    confirmed: set[bytes] = set()
    failed: list[str] = []
    for o in observations:
        ok = [r for r in o.answer.results if r.ok and not is_lan_ip(addr_ip(r.addr) or "")]
        if ok:
            confirmed.add(o.answerer)
        elif any(r.ok for r in o.answer.results):
            failed.append("dialled back only at a LAN address")
        else:
            reasons = sorted({r.why for r in o.answer.results}) or ["no address to dial"]
            failed.append(reasons[0])
    n = len(confirmed)
    if n >= CONFIRMATIONS:
        return Reachability("public", nat, f"dialled back by {n} peers", seen_ip, n)
    if failed:
        return Reachability("private", nat,
                            f"{len(failed)} of {len(observations)} peers could not dial us back"
                            f" ({failed[0]})", seen_ip, n)
    if not observations:
        return Reachability("unknown", nat, "no peer answered a dial-back request", seen_ip, 0)
    return Reachability("unknown", nat, f"dialled back by {n} peer, {CONFIRMATIONS} needed",
                        seen_ip, n)


class RecheckSchedule:
    """When to check again: every :data:`RECHECK_INTERVAL_S` once settled, every
    :data:`RETRY_UNKNOWN_S` while unknown, and at once when our addresses change."""

    def __init__(self, interval_s: float = RECHECK_INTERVAL_S,
                 retry_s: float = RETRY_UNKNOWN_S) -> None:
        self.interval_s = interval_s
        self.retry_s = retry_s
        self._last: float | None = None
        self._addrs: frozenset[str] | None = None
        self._settled = False

    def due(self, now: float, addrs: Sequence[str]) -> bool:
        if self._last is None or frozenset(addrs) != self._addrs:
            return True
        wait = self.interval_s if self._settled else self.retry_s
        # the deadline as next_in computes it ((t + w) - t may round below w)
        return now >= self._last + wait

    def checked(self, now: float, addrs: Sequence[str], result: Reachability) -> None:
        self._last = now
        self._addrs = frozenset(addrs)
        self._settled = result.kind != "unknown"

    def next_in(self, now: float) -> float:
        """Seconds until the next timed check (address changes aside)."""
        if self._last is None:
            return 0.0
        wait = self.interval_s if self._settled else self.retry_s
        return max(0.0, self._last + wait - now)


# ---------------------------------------------------------------------------- status


def status_line(reach: Reachability, *, reserved_relays: Sequence[str] = (),
                tried_relays: Sequence[str] = (), relay_failure: str | None = None,
                punched_peers: int = 0) -> str:
    """The one line ``prefixmesh status``, ``/metrics`` and the start-up log show.

    ``public``; ``private (direct via hole punching with N peers)`` once hole punching
    gave direct links to N peers; ``private (reachable via relay R)`` while a relay holds
    our reservation; ``private, not reachable: <why>`` otherwise; ``unknown: <why>``
    before the first verdict."""
    if reach.kind == "public":
        return "public"
    if reach.kind == "unknown":
        return f"unknown: {reach.why}"
    if punched_peers > 0:
        return f"private (direct via hole punching with {punched_peers} peers)"
    if reserved_relays:
        return f"private (reachable via relay {reserved_relays[0]})"
    if tried_relays:
        why = f"no relay accepted a reservation (tried {', '.join(tried_relays)})"
        if relay_failure:
            why += f"; last: {relay_failure}"
    elif relay_failure:
        why = relay_failure
    else:
        why = "no relay known yet"
    return f"private, not reachable: {why}"
