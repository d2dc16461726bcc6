"""Defences against lying peers: trust scores, a forwarded-share cap, spot checks, subnet caps
(routing candidates and inbound connections), per-peer rate limits.

Everything a node learns about a peer's cache and capacity is the peer's own claim
(signed, so it cannot be forged by a third party, but the signer may lie). This module
turns what the node *observes* after forwarding into a per-peer trust score that the
routing policy uses (``Candidate.trust``: the claimed match is discounted to
``matched * trust`` and peers under ``RoutingConfig.trust_floor`` are ignored), and adds
structural limits that do not depend on catching a lie at all.

Pure and deterministic: no trio, libp2p or llama imports; time comes in as ``now``
(seconds, any monotone clock) and randomness as a ``random.Random``.

TrustTracker: update rules (defaults in :class:`TrustConfig`)
-------------------------------------------------------------
A peer never seen starts at ``initial`` (0.8): good enough to be routed to, with its
claims already discounted by 20 %. Every update first applies *recovery* (below), then
one of these rules; the result is clamped to [0, 1].

(a) Claimed vs used cache (``observe_cache``). This node forwarded because the peer was
    estimated to hold ``claimed`` tokens of the prompt; the FINAL frame reports
    ``cached`` tokens actually reused, by the peer or by whoever it relayed the request
    to (a peer is accountable for the outcome of what it attracts: a liar must not
    escape by passing requests on). With ``ratio = min(1, cached / claimed)``:

    - ``ratio >= honor_ratio`` (0.9): honoured; ``t += honor_gain * (1 - t)`` (0.05:
      slow, 20 honoured claims to close ~64 % of the gap to 1);
    - otherwise a miss of severity ``s = 1 - ratio``: ``t *= 1 - miss_penalty * s``
      (0.12). Multiplicative and proportional to the shortfall, so one stale entry (an
      eviction race between the peer's last digest and the request: honest, and it
      happens) costs at most 12 %, a partial shortfall less.
    - claims under ``min_claim_tokens`` (16, one block) are ignored: there is nothing
      to check.

    Why this tolerates honest staleness: an honest peer that misses a fraction ``m`` of
    its claims fully settles where gains and losses balance,
    ``t* ~ g (1 - m) / (g (1 - m) + p m)``; for ``m = 10 %`` that is 0.79 (measured:
    over 20 seeds x 20,000 claims with independent 10 % full misses the lowest value
    ever reached was 0.29, above the 0.2 routing floor; a penalty of 0.15 with a gain
    of 0.02 dipped to 0.14). A peer that never honours a claim falls as ``0.88^k``:
    from 0.8 under 0.2 in 11 observations (:func:`observations_to_floor` computes the
    bound with recovery between them). A lying peer cannot hide by also lying in FINAL:
    (c) below catches a peer whose time to first token does not fit the cache it
    claims, and spot checks (b) catch wrong tokens.

(b) Spot-check verdicts (``observe_spot_check``): a ``mismatch`` (the peer returned
    tokens a greedy re-execution here did not produce) multiplies trust by
    ``spot_mismatch_factor`` (0.1: from 0.8 to 0.08, under the floor at once) and adds
    a *strike*; a ``match`` adds ``spot_match_gain`` (0.05) of the gap to 1; a
    ``drift`` (late divergence that batch-size numerics can explain, see
    :class:`SpotChecker`) counts as a failure (below). The caller logs the verdict's
    evidence.

(c) Capacity inflation (``observe_capacity``): a peer advertising ``claimed_tps``
    prefill tokens/s that takes ``prefill_s`` for ``uncached`` tokens shows an observed
    rate ``uncached / prefill_s``; if that is below ``capacity_ok_ratio`` (1/3) of the
    claim, ``t *= 1 - capacity_penalty * (1 - observed / (ratio * claimed))``
    (up to 0.2). Only prefills of at least ``min_capacity_tokens`` (64) count, so fixed
    per-request overhead does not read as a lie; the generous ratio absorbs load
    fluctuations. Callers should pass the prefill time the serving node reports (its
    TTFT minus its queue wait) when known, otherwise the TTFT seen here minus the RTT.

(d) Failures and timeouts (``observe_failure``): ``t *= 1 - failure_penalty`` (0.05).
    Mild: crashes and network trouble are not lies, and heartbeats already remove a
    dead peer from routing.

Recovery: trust relaxes exponentially toward ``initial`` with half-life
``recovery_half_life_s`` (600 s) times ``2 ** min(strikes, max_strike_doublings)``, but
only once ``recovery_delay_s`` (300 s) have passed since the peer's last penalty: a peer
that keeps misbehaving at least every 5 minutes never recovers, so a liar cannot out-wait
its penalties between requests, while a flapping-but-honest peer that stops failing is
back near ``initial`` within tens of minutes. Each caught spot-check lie doubles the
half-life (a paroled liar that lies again is dropped again after a few observations).
Recovery also pulls scores *above* ``initial`` back down: past good behaviour is not a
licence forever. Bound (``observations_to_floor``): with observations at most 300 s
apart, a peer that never honours a claim is under the 0.2 floor after 11 of them; a liar
consulted only every ~7 minutes or less often settles around 0.3, where its claims are
discounted by 70 % and the forwarded-share cap still bounds what it attracts.

Memory: at most ``max_peers`` (4096) peers are tracked; past that the least recently
updated peer *without strikes* is forgotten first (a Sybil flood cannot launder a caught
liar by pushing it out of the table).

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

SpotChecker
-----------
``should_check`` draws (from the seeded rng) whether a finished forwarded request is
re-executed locally: only greedy requests (temperature 0) on the same model fingerprint
qualify, with probability ``fraction``. ``compare`` returns a :class:`SpotCheckVerdict`
with the first mismatch index and the expected and received tokens around it.

What it guarantees: a peer that returns tokens other than the model's greedy output on
a checked request is caught with evidence the entry node can log and act on; over ``n``
forged answers the chance of none being checked is ``(1 - fraction)^n``. Checks happen
*after* the answer is streamed, on the entry node, from the request alone, so the peer
cannot tell checked requests from unchecked ones and cannot behave only when watched.
What it does not guarantee: sampled (temperature > 0) requests cannot be checked; the
re-execution must use the same model fingerprint and settings; llama.cpp greedy output
was measured bit-identical across restore paths on CPU on the single-sequence path, but
batched decoding can diverge after the first tokens (kernel results depend on batch
size), so with ``strict_prefix_tokens`` set a divergence after that many tokens is
reported as ``drift`` (mild) rather than ``mismatch``. A check costs one local
generation, so ``fraction`` trades detection speed for compute; it detects wrong
*outputs* only: a peer that answers correctly but slowly, or claims cache it does not
have, is handled by (a) and (c) above.

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

Errors: :class:`TrustError` (``ValueError``) > :class:`InvalidTrustConfig`,
:class:`InvalidObservation`.
"""

from __future__ import annotations

import ipaddress
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = [
    "TrustError",
    "InvalidTrustConfig",
    "InvalidObservation",
    "TrustConfig",
    "PeerTrust",
    "TrustTracker",
    "observations_to_floor",
    "ForwardShareLimiter",
    "SpotCheckVerdict",
    "SpotChecker",
    "MATCH",
    "MISMATCH",
    "DRIFT",
    "SubnetLimiter",
    "InboundSubnetCap",
    "subnet_of_multiaddr",
    "PeerRateLimiter",
]

MATCH = "match"
MISMATCH = "mismatch"
DRIFT = "drift"

_T = TypeVar("_T")


class TrustError(ValueError):
    """Base class of every error raised by the trust module."""


class InvalidTrustConfig(TrustError):
    """A tunable of a tracker, limiter or checker is out of its documented range."""


class InvalidObservation(TrustError):
    """An observation carries an impossible value (negative tokens, NaN time...)."""


def _check_unit(value: float, name: str, *, open_low: bool = False) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
        raise InvalidTrustConfig(f"{name} must be in [0, 1], got {value!r}")
    if open_low and value == 0:
        raise InvalidTrustConfig(f"{name} must be > 0")


def _check_pos(value: float, name: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise InvalidTrustConfig(f"{name} must be a finite number > 0, got {value!r}")


def _obs_nonneg(value: float, name: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise InvalidObservation(f"{name} must be a finite number >= 0, got {value!r}")


def _obs_time(now: float) -> None:
    if not (isinstance(now, int | float) and math.isfinite(now)):
        raise InvalidObservation(f"now must be a finite number, got {now!r}")


# ---------------------------------------------------------------------------- trust


@dataclass(frozen=True)
class TrustConfig:
    """Constants of the trust update rules (see the module docstring)."""

    initial: float = 0.8
    honor_ratio: float = 0.9
    honor_gain: float = 0.05
    miss_penalty: float = 0.12
    min_claim_tokens: int = 16
    spot_match_gain: float = 0.05
    spot_mismatch_factor: float = 0.1
    failure_penalty: float = 0.05
    capacity_ok_ratio: float = 1 / 3
    capacity_penalty: float = 0.2
    min_capacity_tokens: int = 64
    recovery_half_life_s: float = 600.0
    recovery_delay_s: float = 300.0
    max_strike_doublings: int = 6
    max_peers: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "initial",
            "honor_gain",
            "miss_penalty",
            "spot_match_gain",
            "spot_mismatch_factor",
            "failure_penalty",
            "capacity_penalty",
        ):
            _check_unit(getattr(self, name), name)
        _check_unit(self.honor_ratio, "honor_ratio", open_low=True)
        _check_unit(self.capacity_ok_ratio, "capacity_ok_ratio", open_low=True)
        _check_pos(self.recovery_half_life_s, "recovery_half_life_s")
        if not (
            isinstance(self.recovery_delay_s, int | float)
            and math.isfinite(self.recovery_delay_s)
            and self.recovery_delay_s >= 0
        ):
            raise InvalidTrustConfig(
                f"recovery_delay_s must be finite and >= 0, got {self.recovery_delay_s!r}"
            )
        for name in ("min_claim_tokens", "min_capacity_tokens", "max_strike_doublings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidTrustConfig(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.max_peers, int) or self.max_peers < 1:
            raise InvalidTrustConfig(f"max_peers must be an int >= 1, got {self.max_peers!r}")


@dataclass
class PeerTrust:
    """What the tracker holds about one peer (a copy is returned by ``record``)."""

    trust: float
    updated_at: float
    observations: int = 0
    honoured: int = 0
    misses: int = 0
    failures: int = 0
    capacity_flags: int = 0
    spot_matches: int = 0
    strikes: int = 0  # spot-check mismatches: each doubles the recovery half-life
    last_penalty_at: float = -math.inf  # recovery waits recovery_delay_s after this


class TrustTracker:
    """Per-peer trust in [0, 1] from observed behaviour (rules in the module docstring)."""

    def __init__(self, config: TrustConfig | None = None) -> None:
        self.config = config or TrustConfig()
        self._peers: dict[bytes, PeerTrust] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers

    # -- reading

    def _recovered(self, rec: PeerTrust, now: float) -> float:
        start = max(rec.updated_at, rec.last_penalty_at + self.config.recovery_delay_s)
        dt = now - start
        if dt <= 0:  # within the delay after a penalty, or a clock that went backwards
            return rec.trust
        cfg = self.config
        half_life = cfg.recovery_half_life_s * 2 ** min(rec.strikes, cfg.max_strike_doublings)
        keep = 0.5 ** (dt / half_life)
        return cfg.initial + (rec.trust - cfg.initial) * keep

    def trust(self, peer: bytes, now: float) -> float:
        """The peer's trust at ``now`` (``initial`` for a peer never observed)."""
        _obs_time(now)
        rec = self._peers.get(peer)
        if rec is None:
            return self.config.initial
        return min(1.0, max(0.0, self._recovered(rec, now)))

    def record(self, peer: bytes) -> PeerTrust | None:
        """A copy of what is held about ``peer`` (trust as of its last update)."""
        rec = self._peers.get(peer)
        return None if rec is None else PeerTrust(**vars(rec))

    def peers(self) -> list[bytes]:
        return list(self._peers)

    def forget(self, peer: bytes) -> None:
        self._peers.pop(peer, None)

    # -- updating

    def _touch(self, peer: bytes, now: float) -> PeerTrust:
        _obs_time(now)
        if not isinstance(peer, bytes):
            raise InvalidObservation(f"peer must be bytes, got {type(peer).__name__}")
        rec = self._peers.get(peer)
        if rec is None:
            if len(self._peers) >= self.config.max_peers:
                self._evict_one()
            rec = self._peers[peer] = PeerTrust(self.config.initial, now)
        else:
            rec.trust = self._recovered(rec, now)
            rec.updated_at = max(rec.updated_at, now)
        rec.observations += 1
        return rec

    def _evict_one(self) -> None:
        clean = [(r.updated_at, p) for p, r in self._peers.items() if r.strikes == 0]
        pool = clean or [(r.updated_at, p) for p, r in self._peers.items()]
        _, victim = min(pool)
        del self._peers[victim]

    @staticmethod
    def _clamp(rec: PeerTrust) -> float:
        rec.trust = min(1.0, max(0.0, rec.trust))
        return rec.trust

    def observe_cache(
        self, peer: bytes, now: float, *, claimed_tokens: int, cached_tokens: int
    ) -> float:
        """Rule (a): the peer was routed to for ``claimed_tokens`` and reused ``cached_tokens``.

        Returns the new trust (unchanged apart from recovery for claims under
        ``min_claim_tokens``).
        """
        _obs_nonneg(claimed_tokens, "claimed_tokens")
        _obs_nonneg(cached_tokens, "cached_tokens")
        rec = self._touch(peer, now)
        cfg = self.config
        if claimed_tokens < cfg.min_claim_tokens:
            return self._clamp(rec)
        ratio = min(1.0, cached_tokens / claimed_tokens)
        if ratio >= cfg.honor_ratio:
            rec.honoured += 1
            rec.trust += cfg.honor_gain * (1.0 - rec.trust)
        else:
            rec.misses += 1
            rec.trust *= 1.0 - cfg.miss_penalty * (1.0 - ratio)
            rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def observe_spot_check(self, peer: bytes, now: float, verdict: SpotCheckVerdict) -> float:
        """Rule (b): a spot-check verdict about ``peer``."""
        if not isinstance(verdict, SpotCheckVerdict):
            raise InvalidObservation("verdict must be a SpotCheckVerdict")
        rec = self._touch(peer, now)
        cfg = self.config
        if verdict.kind == MISMATCH:
            rec.strikes += 1
            rec.trust *= cfg.spot_mismatch_factor
            rec.last_penalty_at = rec.updated_at
        elif verdict.kind == MATCH:
            rec.spot_matches += 1
            rec.trust += cfg.spot_match_gain * (1.0 - rec.trust)
        else:  # DRIFT: explainable by numerics; treat like a failure
            rec.failures += 1
            rec.trust *= 1.0 - cfg.failure_penalty
            rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def observe_failure(self, peer: bytes, now: float) -> float:
        """Rule (d): a forward to ``peer`` failed, timed out or was refused."""
        rec = self._touch(peer, now)
        rec.failures += 1
        rec.trust *= 1.0 - self.config.failure_penalty
        rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def observe_capacity(
        self,
        peer: bytes,
        now: float,
        *,
        claimed_prefill_tps: float,
        uncached_tokens: int,
        prefill_s: float,
    ) -> float:
        """Rule (c): the peer claimed ``claimed_prefill_tps`` and prefilled
        ``uncached_tokens`` in ``prefill_s`` seconds."""
        _obs_nonneg(claimed_prefill_tps, "claimed_prefill_tps")
        _obs_nonneg(uncached_tokens, "uncached_tokens")
        _obs_nonneg(prefill_s, "prefill_s")
        rec = self._touch(peer, now)
        cfg = self.config
        if uncached_tokens < cfg.min_capacity_tokens or claimed_prefill_tps <= 0:
            return self._clamp(rec)
        observed_tps = uncached_tokens / prefill_s if prefill_s > 0 else math.inf
        floor_tps = cfg.capacity_ok_ratio * claimed_prefill_tps
        if observed_tps < floor_tps:
            rec.capacity_flags += 1
            rec.trust *= 1.0 - cfg.capacity_penalty * (1.0 - observed_tps / floor_tps)
            rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def snapshot(self, now: float) -> dict[bytes, float]:
        """Every tracked peer's trust at ``now``."""
        return {p: self.trust(p, now) for p in self._peers}


def observations_to_floor(
    floor: float,
    *,
    config: TrustConfig | None = None,
    max_gap_s: float = 0.0,
    severity: float = 1.0,
) -> int:
    """How many consecutive failed claims of at least ``severity`` (``1 - cached/claimed``;
    1.0: nothing reused) take a new peer under ``floor`` when observations are at most
    ``max_gap_s`` apart (worst case: every gap is ``max_gap_s``, so recovery helps the
    liar as much as it can).

    Raises :class:`InvalidTrustConfig` if recovery outpaces the penalty so the peer would
    never fall under ``floor``.
    """
    cfg = config or TrustConfig()
    _check_unit(floor, "floor")
    if not (math.isfinite(max_gap_s) and max_gap_s >= 0):
        raise InvalidTrustConfig(f"max_gap_s must be finite and >= 0, got {max_gap_s!r}")
    # recovery only runs for the part of a gap past recovery_delay_s after a penalty
    _check_unit(severity, "severity", open_low=True)
    if 1.0 - severity >= cfg.honor_ratio:
        raise InvalidTrustConfig(f"severity {severity} counts as an honoured claim")
    keep = 0.5 ** (max(0.0, max_gap_s - cfg.recovery_delay_s) / cfg.recovery_half_life_s)
    t = cfg.initial
    for n in range(1, 10_000):
        if n > 1:
            t = cfg.initial + (t - cfg.initial) * keep
        t *= 1.0 - cfg.miss_penalty * severity
        if t < floor:
            return n
    raise InvalidTrustConfig(
        f"with gaps of {max_gap_s} s recovery outpaces the miss penalty; never under {floor}"
    )


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
        _check_unit(max_share, "max_share", open_low=True)
        if not isinstance(window, int) or window < 1:
            raise InvalidTrustConfig(f"window must be an int >= 1, got {window!r}")
        if not isinstance(min_count, int) or not 1 <= min_count <= window:
            raise InvalidTrustConfig(f"min_count must be an int in [1, window], got {min_count!r}")
        _check_pos(max_age_s, "max_age_s")
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
        _obs_time(now)
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


# ---------------------------------------------------------------------------- spot checks


@dataclass(frozen=True)
class SpotCheckVerdict:
    """Outcome of re-executing one forwarded greedy request locally.

    ``kind``: ``match``, ``mismatch`` or ``drift``. ``first_mismatch``: index of the
    first differing token (None for a match); a length difference counts as a mismatch
    at the shorter length. ``expected``/``got``: up to ``context`` tokens from
    ``first_mismatch`` on, as evidence to log.
    """

    peer: bytes
    request_id: bytes
    kind: str
    first_mismatch: int | None
    expected: tuple[int, ...]
    got: tuple[int, ...]
    n_expected: int
    n_got: int
    reason: str

    @property
    def ok(self) -> bool:
        return self.kind == MATCH


@dataclass
class SpotChecker:
    """Decides which forwarded greedy requests to re-execute, and judges the result.

    fraction: probability that an eligible request is checked.
    strict_prefix_tokens: a divergence at or after this index is ``drift`` rather than
        ``mismatch`` (None: every divergence is a mismatch; right for the engine's
        single-sequence path, measured bit-identical).
    context: how many tokens of evidence a verdict carries.
    """

    rng: random.Random
    fraction: float = 0.02
    strict_prefix_tokens: int | None = None
    context: int = 16
    checks_drawn: int = field(default=0, init=False)
    eligible_seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rng, random.Random):
            raise InvalidTrustConfig("rng must be a random.Random")
        _check_unit(self.fraction, "fraction")
        if self.strict_prefix_tokens is not None and (
            not isinstance(self.strict_prefix_tokens, int) or self.strict_prefix_tokens < 1
        ):
            raise InvalidTrustConfig("strict_prefix_tokens must be None or an int >= 1")
        if not isinstance(self.context, int) or self.context < 1:
            raise InvalidTrustConfig("context must be an int >= 1")

    def should_check(self, *, temperature: float, local_model: bytes, peer_model: bytes) -> bool:
        """Draw whether to re-execute this request. Only greedy requests on the same model
        fingerprint are eligible; ineligible ones draw nothing from the rng."""
        if temperature != 0 or not local_model or local_model != peer_model:
            return False
        self.eligible_seen += 1
        checked = self.rng.random() < self.fraction
        self.checks_drawn += checked
        return checked

    def compare(
        self,
        peer: bytes,
        request_id: bytes,
        expected: Sequence[int],
        got: Sequence[int],
    ) -> SpotCheckVerdict:
        """Compare the local greedy re-execution ``expected`` with the peer's ``got``
        (both the completion token ids for the same prompt and ``max_tokens``)."""
        exp, gt = tuple(expected), tuple(got)
        first = next((i for i, (a, b) in enumerate(zip(exp, gt, strict=False)) if a != b), None)
        if first is None and len(exp) != len(gt):
            first = min(len(exp), len(gt))
        if first is None:
            return SpotCheckVerdict(
                peer,
                request_id,
                MATCH,
                None,
                (),
                (),
                len(exp),
                len(gt),
                f"all {len(exp)} tokens identical",
            )
        strict = self.strict_prefix_tokens
        kind = DRIFT if strict is not None and first >= strict else MISMATCH
        what = "lengths differ" if first == min(len(exp), len(gt)) else "tokens differ"
        return SpotCheckVerdict(
            peer,
            request_id,
            kind,
            first,
            exp[first : first + self.context],
            gt[first : first + self.context],
            len(exp),
            len(gt),
            f"{what} at token {first} ({len(exp)} expected, {len(gt)} received)"
            + (f"; after the strict prefix of {strict}" if kind == DRIFT else ""),
        )


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
        _check_pos(rate_per_s, "rate_per_s")
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
        _obs_time(now)
        bucket = self._buckets.get(peer)
        return self.burst if bucket is None else self._level(bucket, now)[0]

    def allow(self, peer: bytes, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens from ``peer``'s bucket if it holds them; True if taken.

        A refused call takes nothing (a flooding peer gets its tokens back at the refill
        rate, never faster, however often it knocks).
        """
        _obs_time(now)
        _obs_nonneg(cost, "cost")
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
        _obs_time(now)
        _obs_nonneg(cost, "cost")
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
