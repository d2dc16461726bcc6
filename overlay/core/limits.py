"""Defences against lying peers, part two: structural limits that hold whatever a peer claims.

A forwarded-share cap, subnet caps (routing candidates and inbound connections) and
per-peer rate limits. None of them depends on catching a lie (that is :mod:`.trust`):
they bound what any one peer, address block or identity can attract or cost.

Pure and deterministic: no trio, libp2p or llama imports; time comes in as ``now``
(seconds, any monotone clock).

ForwardShareLimiter
-------------------
No peer may receive more than ``max_share`` (0.5) of this node's forwards over the last
``window`` (100) forwards: ``allowed(peer)`` is true iff after one more forward to it the
peer would hold at most ``max_share * max(n, min_count)`` of the ``n`` forwards in the
window (``min_count`` = 20). Invariant (property-tested): once the window holds at
least ``min_count`` forwards, no peer's share of it exceeds ``max_share``; before that,
no peer holds more than ``max_share * min_count`` entries. Entries older than
``max_age_s`` (600 s) also leave the window, so a small network where the cap cannot be
met (fewer than ``1 / max_share`` good peers) forwards again after a quiet spell instead
of being locked out. Even a perfectly convincing liar therefore attracts at most half of
a node's forwarded traffic; the daemon drops over-cap peers from the candidate list
(:meth:`ForwardShareLimiter.filter`) and records every forward it makes.

SubnetLimiter
-------------
Sybil basics: at most ``max_per_subnet`` (4) peers per IPv4 /24 or IPv6 /48 take part in
one routing decision, in the caller's preference order. A peer's subnets come from its
multiaddrs (``/ip4/A/...``, ``/ip6/A/...``); a peer is admitted only if every subnet it
announces has room, and then counts in each. DNS addresses bucket by lower-cased name;
a peer with no usable address goes to one shared ``"none"`` bucket. Loopback addresses
are exempt by default (local test clusters). This bounds what one cheap address block
can contribute; it does not stop an attacker with many subnets.

InboundSubnetCap
----------------
The same buckets for connections: at most ``max_per_subnet`` (32) peers per subnet may be
connected to us by their own dial; the host closes a connection past that as libp2p
registers it. A dead connection can linger unnoticed by the transport, so a full bucket
first gives up the slots of peers the caller calls stale (no live connection, or down by
the heartbeat). Our own dials are not counted.

PeerRateLimiter
---------------
Per-peer token buckets for input hardening (request rate on ``/prefixmesh/infer``,
digest-exchange rate on ``/prefixmesh/digest``): ``rate_per_s`` tokens per second refill a
bucket of capacity ``burst``; a call costs ``cost`` tokens (1 by default) and is refused,
taking nothing, when the bucket holds fewer. Guarantees (property-tested against a
brute-force check): for non-decreasing ``now``, a peer is allowed at most
``burst + rate_per_s * (t1 - t0)`` calls with ``now`` in any window ``[t0, t1]``; a peer
whose calls are at least ``1 / rate_per_s`` apart is never refused; one peer's calls never
change another peer's answers while at most ``max_peers`` peers are tracked. Time that
goes backwards creates no tokens: each bucket refills only when ``now`` passes the latest
time it has seen, so over any sequence the bound holds with each call counted at that
watermark. Callers should still use a monotonic clock (a backwards step freezes refills
until the clock catches up).

Memory: at most ``max_peers`` (4096) buckets, least recently used evicted first. A
forgotten peer starts again with a full bucket, which is safe: a full bucket is exactly
what any new peer id gets, and peer ids cost nothing to make, so eviction grants a peer
nothing it could not get by reconnecting under a fresh identity; to be evicted at all it
must stay silent while ``max_peers`` other peers call. A bucket that has refilled
completely is indistinguishable from no bucket, so evicting it changes no answer; only
evictions of partly empty buckets count in ``evictions``. The limiter bounds each
identity, not an attacker with many identities: that is the job of connection limits and
:class:`SubnetLimiter`.

Errors: :class:`~.trust.InvalidTrustConfig` for a tunable out of range,
:class:`~.trust.InvalidObservation` for an impossible ``now`` or cost.
"""

from __future__ import annotations

import ipaddress
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .trust import InvalidTrustConfig, check_observed, check_pos, check_time, check_unit

__all__ = [
    "ForwardShareLimiter",
    "SubnetLimiter",
    "InboundSubnetCap",
    "subnet_of_multiaddr",
    "PeerRateLimiter",
]

_T = TypeVar("_T")

# The per-peer input limits' defaults, one place for InferSettings (overlay/infer.py) and
# node/config.py's [limits]: requests one remote peer may send (token bucket: rate per
# second, burst; generous, a CPU node serves a few per second), and candidates per /24
# (IPv4) or /48 (IPv6) subnet in one routing decision (Sybil basics; 0 turns it off).
PEER_REQUEST_RATE = 50.0
PEER_REQUEST_BURST = 100.0
MAX_PEERS_PER_SUBNET = 4


# ---------------------------------------------------------------------------- share cap


class ForwardShareLimiter:
    """Caps any one peer's share of this node's recent forwards (see the module docstring)."""

    def __init__(
        self,
        max_share: float = 0.5,
        window: int = 100,
        min_count: int = 20,
        max_age_s: float = 600.0,
    ) -> None:
        check_unit(max_share, "max_share", open_low=True)
        if not isinstance(window, int) or window < 1:
            raise InvalidTrustConfig(f"window must be an int >= 1, got {window!r}")
        if not isinstance(min_count, int) or not 1 <= min_count <= window:
            raise InvalidTrustConfig(f"min_count must be an int in [1, window], got {min_count!r}")
        check_pos(max_age_s, "max_age_s")
        self.max_share = float(max_share)
        self.window = window
        self.min_count = min_count
        self.max_age_s = float(max_age_s)
        self._recent: deque[tuple[float, bytes]] = deque()
        self._counts: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._recent)

    def _drop_oldest(self) -> None:
        _, peer = self._recent.popleft()
        self._counts[peer] -= 1
        if not self._counts[peer]:
            del self._counts[peer]

    def _age(self, now: float) -> None:
        check_time(now)
        while self._recent and self._recent[0][0] <= now - self.max_age_s:
            self._drop_oldest()

    def count(self, peer: bytes) -> int:
        return self._counts.get(peer, 0)

    def share(self, peer: bytes) -> float:
        """The peer's share of the forwards now in the window (0 when empty)."""
        return self._counts.get(peer, 0) / len(self._recent) if self._recent else 0.0

    def allowed(self, peer: bytes, now: float) -> bool:
        """Whether one more forward to ``peer`` keeps it within the cap."""
        self._age(now)
        n = len(self._recent)
        count = self._counts.get(peer, 0) + 1
        if n >= self.window:  # the oldest entry leaves as this one enters
            if self._recent[0][1] == peer:
                count -= 1
        else:
            n += 1
        # tiny tolerance: 0.5 * 20 must allow exactly 10
        return count <= self.max_share * max(n, self.min_count) + 1e-9

    def record(self, peer: bytes, now: float) -> None:
        """This node forwarded a request to ``peer`` (call it for every forward made)."""
        self._age(now)
        if self._recent and now < self._recent[-1][0]:
            now = self._recent[-1][0]  # keep the window ordered under clock jitter
        if len(self._recent) >= self.window:
            self._drop_oldest()
        self._recent.append((now, peer))
        self._counts[peer] += 1

    def filter(
        self, items: Iterable[_T], now: float, *, key: Callable[[_T], bytes] | None = None
    ) -> list[_T]:
        """The items (e.g. routing ``Candidate``s) whose peer is ``allowed`` now."""
        get = key or (lambda item: item.peer)  # type: ignore[attr-defined]
        return [item for item in items if self.allowed(get(item), now)]


# ---------------------------------------------------------------------------- subnets


def subnet_of_multiaddr(addr: str, *, prefix_v4: int = 24, prefix_v6: int = 48) -> str | None:
    """The subnet bucket of a multiaddr: ``"10.1.2.0/24"``, ``"2001:db8:1::/48"``,
    ``"dns:example.org"``; None when the address names no host we understand."""
    if not isinstance(addr, str):
        return None
    parts = addr.split("/")
    if len(parts) < 3 or parts[0] != "":
        return None
    proto, host = parts[1], parts[2]
    try:
        if proto == "ip4":
            return str(ipaddress.IPv4Network(f"{host}/{prefix_v4}", strict=False))
        if proto == "ip6":
            return str(ipaddress.IPv6Network(f"{host}/{prefix_v6}", strict=False))
    except ValueError:
        return None
    if proto in ("dns", "dns4", "dns6") and host:
        return "dns:" + host.lower().rstrip(".")
    return None


def _is_loopback(addr: str) -> bool:
    parts = addr.split("/") if isinstance(addr, str) else []
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


@dataclass
class SubnetLimiter:
    """At most ``max_per_subnet`` peers per /24 (IPv4) or /48 (IPv6) in one decision."""

    max_per_subnet: int = 4
    prefix_v4: int = 24
    prefix_v6: int = 48
    exempt_loopback: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_per_subnet, int) or self.max_per_subnet < 1:
            raise InvalidTrustConfig("max_per_subnet must be an int >= 1")
        if not isinstance(self.prefix_v4, int) or not 0 <= self.prefix_v4 <= 32:
            raise InvalidTrustConfig("prefix_v4 must be an int in [0, 32]")
        if not isinstance(self.prefix_v6, int) or not 0 <= self.prefix_v6 <= 128:
            raise InvalidTrustConfig("prefix_v6 must be an int in [0, 128]")

    def subnets(self, addrs: Iterable[str]) -> frozenset[str]:
        """The buckets a peer with these addrs counts in (empty: exempt)."""
        addrs = list(addrs)
        out: set[str] = set()
        n_exempt = 0
        for a in addrs:
            if self.exempt_loopback and _is_loopback(a):
                n_exempt += 1
                continue
            s = subnet_of_multiaddr(a, prefix_v4=self.prefix_v4, prefix_v6=self.prefix_v6)
            if s is not None:
                out.add(s)
        if not out and not (addrs and n_exempt == len(addrs)):
            return frozenset({"none"})  # no usable address: one shared bucket
        return frozenset(out)

    def select(self, peers: Iterable[tuple[_T, Sequence[str]]]) -> list[_T]:
        """Keep, in the given (preference) order, the items whose subnets all have room.

        ``peers``: ``(item, addrs)`` pairs; ``item`` is returned as is (a peer id or a
        routing ``Candidate``).
        """
        used: Counter[str] = Counter()
        kept: list[_T] = []
        for item, addrs in peers:
            addrs = list(addrs)
            buckets = self.subnets(addrs)
            if all(used[b] < self.max_per_subnet for b in buckets):
                used.update(buckets)
                kept.append(item)
        return kept


class InboundSubnetCap:
    """At most ``max_per_subnet`` peers connected to us *inbound* (they dialled us) per
    /24 (IPv4) or /48 (IPv6), by the address the transport saw: one cheap address block
    cannot fill a node's connections (an eclipse needs many). Buckets come from
    :meth:`SubnetLimiter.subnets` (loopback exempt by default; an address we cannot read
    goes to one shared ``"none"`` bucket). Connections we dial ourselves are not counted:
    we chose those peers.

    ``admit(peer, addr, is_stale)`` is ``(True, evicted)`` when the peer counts in its
    bucket (it had room, the peer is already counted, or the address is exempt), else
    ``(False, [])``. A dead connection may linger unnoticed by the transport, so a full
    bucket is first purged of the peers ``is_stale`` names (the caller: no live connection,
    or the heartbeat says down); they are returned so the caller can close what is left
    of their connections. ``release(peer)`` when a counted peer's last connection closes.
    Invariant (property-tested): no bucket ever counts more than ``max_per_subnet``
    peers, and a released or evicted peer frees its slot. Memory: one entry per counted
    peer.
    """

    def __init__(self, max_per_subnet: int = 32, *, prefix_v4: int = 24, prefix_v6: int = 48,
                 exempt_loopback: bool = True) -> None:
        self._buckets = SubnetLimiter(max_per_subnet, prefix_v4, prefix_v6, exempt_loopback)
        self._peer_bucket: dict[bytes, str] = {}
        self._members: dict[str, set[bytes]] = {}
        self.refused = 0

    @property
    def max_per_subnet(self) -> int:
        return self._buckets.max_per_subnet

    def admit(
        self, peer: bytes, addr: str, is_stale: Callable[[bytes], bool] = lambda p: False
    ) -> tuple[bool, list[bytes]]:
        if peer in self._peer_bucket:
            return True, []
        buckets = self._buckets.subnets([addr])
        if not buckets:
            return True, []  # exempt (loopback)
        (bucket,) = buckets
        members = self._members.setdefault(bucket, set())
        evicted: list[bytes] = []
        if len(members) >= self.max_per_subnet:
            evicted = sorted(p for p in members if is_stale(p))
            for p in evicted:
                self.release(p)
            members = self._members.setdefault(bucket, set())
        if len(members) >= self.max_per_subnet:
            self.refused += 1
            return False, evicted
        self._peer_bucket[peer] = bucket
        members.add(peer)
        return True, evicted

    def release(self, peer: bytes) -> None:
        bucket = self._peer_bucket.pop(peer, None)
        if bucket is not None:
            members = self._members[bucket]
            members.discard(peer)
            if not members:
                del self._members[bucket]

    def counts(self) -> dict[str, int]:
        return {b: len(m) for b, m in self._members.items()}


# ---------------------------------------------------------------------------- rate limits


class PeerRateLimiter:
    """Token bucket per peer: ``rate_per_s`` tokens/s refill, capacity ``burst``; at most
    ``max_peers`` buckets kept (least recently used evicted: a forgotten peer starts full,
    which is safe because a fresh peer id starts full anyway; see the module docstring).

    A peer never seen (or forgotten) has a full bucket. ``allow`` refills the bucket for
    the time since its last refill, then takes ``cost`` tokens if it holds that many.
    ``rate_per_s`` must be > 0 (a limiter that never refills would be a lifetime quota;
    callers that want no limit pass no limiter) and ``burst`` >= 1 (a cost-1 call must be
    possible at all); both finite. ``cost`` may exceed ``burst``: such a call is never
    allowed (``retry_after_s`` is ``inf``).

    Time: each bucket keeps the latest ``now`` it has seen (its watermark) and refills
    only when ``now`` passes it, so a clock that steps back creates no tokens: the bucket
    is frozen until the clock catches up (a monotonic clock avoids the freeze).
    Floating-point rounding is absorbed by a tolerance of 1e-9 tokens per unit of cost plus
    ``2 * rate_per_s * ulp(now)`` (so a peer calling every ``1 / rate_per_s`` seconds by a
    large clock is not refused by a rounding error; the slack is under 1e-4 tokens).
    """

    _EPS = 1e-9

    def __init__(self, rate_per_s: float, burst: float, max_peers: int = 4096) -> None:
        check_pos(rate_per_s, "rate_per_s")
        if not (isinstance(burst, int | float) and math.isfinite(burst) and burst >= 1):
            raise InvalidTrustConfig(f"burst must be a finite number >= 1, got {burst!r}")
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
            raise InvalidTrustConfig(f"max_peers must be an int >= 1, got {max_peers!r}")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self.max_peers = max_peers
        # peer -> [tokens, watermark]; order = least recently used first
        self._buckets: OrderedDict[bytes, list[float]] = OrderedDict()
        self.evictions = 0  # buckets dropped while not yet full again (documented leak)

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, peer: object) -> bool:
        return peer in self._buckets

    def _level(self, bucket: list[float], now: float) -> tuple[float, float]:
        """(tokens, watermark) of ``bucket`` refilled up to ``now`` (never backwards)."""
        tokens, mark = bucket
        if now > mark:
            tokens = min(self.burst, tokens + (now - mark) * self.rate_per_s)
            mark = now
        return tokens, mark

    def _tolerance(self, now: float, cost: float) -> float:
        """Rounding slack in tokens: 1e-9 per token of cost, plus what one rounding of a
        large ``now`` (e.g. Unix time, ulp 2.4e-7 s) is worth at the refill rate."""
        return self._EPS * max(1.0, cost) + 2.0 * self.rate_per_s * math.ulp(max(1.0, abs(now)))

    def tokens(self, peer: bytes, now: float) -> float:
        """Tokens ``peer`` holds at ``now`` (a query: nothing changes)."""
        check_time(now)
        bucket = self._buckets.get(peer)
        return self.burst if bucket is None else self._level(bucket, now)[0]

    def allow(self, peer: bytes, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens from ``peer``'s bucket if it holds them; True if taken.

        A refused call takes nothing (a flooding peer gets its tokens back at the refill
        rate, never faster, however often it knocks).
        """
        check_time(now)
        check_observed(cost, "cost")
        if cost > self.burst + self._EPS:
            return False  # can never be allowed: changes nothing, spends no memory
        bucket = self._buckets.get(peer)
        if bucket is None:
            self._make_room(now)
            bucket = self._buckets[peer] = [self.burst, now]
        else:
            self._buckets.move_to_end(peer)
        tokens, mark = self._level(bucket, now)
        bucket[1] = mark
        if tokens + self._tolerance(now, cost) >= cost:
            bucket[0] = max(0.0, tokens - cost)
            return True
        bucket[0] = tokens
        return False

    def retry_after_s(self, peer: bytes, now: float, cost: float = 1.0) -> float:
        """Seconds from ``now`` until ``allow(peer, ., cost)`` would succeed (0.0: now);
        ``inf`` if ``cost`` exceeds the burst. A query: nothing changes."""
        check_time(now)
        check_observed(cost, "cost")
        if cost > self.burst + self._EPS:
            return math.inf
        bucket = self._buckets.get(peer)
        if bucket is None:
            return 0.0
        tokens, mark = self._level(bucket, now)
        if tokens + self._tolerance(now, cost) >= cost:
            return 0.0
        # refills start only once the clock passes the watermark again
        return max(0.0, mark - now) + (cost - tokens) / self.rate_per_s

    def forget(self, peer: bytes) -> None:
        self._buckets.pop(peer, None)

    def _make_room(self, now: float) -> None:
        while len(self._buckets) >= self.max_peers:
            _peer, bucket = self._buckets.popitem(last=False)
            if self._level(bucket, now)[0] < self.burst:
                self.evictions += 1  # it restarts full: an early refill for that peer
