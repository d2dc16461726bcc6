"""Defences against lying peers, part one: trust scores and spot checks.

Everything a node learns about a peer's cache and capacity is the peer's own claim
(signed, so it cannot be forged by a third party, but the signer may lie). This module
turns what the node *observes* after forwarding into a per-peer trust score that the
routing policy uses (``Candidate.trust``: the claimed match is discounted to
``matched * trust`` and peers under ``RoutingConfig.trust_floor`` are ignored). The
structural limits that do not depend on catching a lie at all (forwarded-share cap,
subnet caps, per-peer rate limits) are in :mod:`.limits`.

Pure and deterministic: no trio, libp2p or llama imports; time comes in as ``now``
(seconds, any monotone clock) and randomness as a ``random.Random``.

TrustTracker: update rules (constants: ``INITIAL_TRUST``, ``HONOR_RATIO``, ... below)
-------------------------------------------------------------------------------------
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
batched decoding diverges at near-ties (kernel results depend on the batch), so
:func:`judge_batched` makes a divergence of a batched answer a ``drift`` (no penalty) only
where the re-execution's choice was a near-tie (and with ``strict_prefix_tokens`` set, a
divergence after that many tokens is a ``drift`` too). A check costs one local
generation, so ``fraction`` trades detection speed for compute; it detects wrong
*outputs* only: a peer that answers correctly but slowly, or claims cache it does not
have, is handled by (a) and (c) above.

Errors: :class:`TrustError` (``ValueError``) > :class:`InvalidTrustConfig`,
:class:`InvalidObservation` (also raised by :mod:`.limits`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "TrustError",
    "InvalidTrustConfig",
    "InvalidObservation",
    "PeerTrust",
    "TrustTracker",
    "observations_to_floor",
    "SpotCheckVerdict",
    "SpotChecker",
    "MATCH",
    "MISMATCH",
    "DRIFT",
    "BATCHED_TIE_NATS",
    "judge_batched",
]

MATCH = "match"
MISMATCH = "mismatch"
DRIFT = "drift"

#: How far (in nats of log probability) the re-execution's token may lead its runner-up
#: where an answer decoded in shared batches still honestly picked another: batched
#: kernels move logits a little, so they flip only near-ties. Measured on the default model
#: (docs/bench/engine.md section 5): 47 of 96 greedy answers diverged between the two
#: batch modes, every one where the lead was 0.0007-0.28 nats; 62 % of greedy steps lead
#: by more than 1 nat.
BATCHED_TIE_NATS = 1.0

class TrustError(ValueError):
    """Base class of every error raised by the trust module."""


class InvalidTrustConfig(TrustError):
    """A tunable of a tracker, limiter or checker is out of its documented range."""


class InvalidObservation(TrustError):
    """An observation carries an impossible value (negative tokens, NaN time...)."""


def check_unit(value: float, name: str, *, open_low: bool = False) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
        raise InvalidTrustConfig(f"{name} must be in [0, 1], got {value!r}")
    if open_low and value == 0:
        raise InvalidTrustConfig(f"{name} must be > 0")


def check_pos(value: float, name: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise InvalidTrustConfig(f"{name} must be a finite number > 0, got {value!r}")


def check_observed(value: float, name: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise InvalidObservation(f"{name} must be a finite number >= 0, got {value!r}")


def check_time(now: float) -> None:
    if not (isinstance(now, int | float) and math.isfinite(now)):
        raise InvalidObservation(f"now must be a finite number, got {now!r}")


# ---------------------------------------------------------------------------- trust


# The trust rules' constants (the module docstring calls them by lower-case names: ``initial``
# is INITIAL_TRUST). No operator sets them: they are the rules' design (each argued there).
INITIAL_TRUST = 0.8  # a new peer is routable (over the 0.2 floor), its claims discounted 20 %
HONOR_RATIO = 0.9  # a claim 90 % reused is honoured: block rounding and races are honest
HONOR_GAIN = 0.05  # slow: trust is earned over ~20 honoured claims, not one
MISS_PENALTY = 0.12  # one stale miss costs <= 12 %; an honest peer missing 10 % settles at 0.79
MIN_CLAIM_TOKENS = 16  # one block: a smaller claim has nothing to check
SPOT_MATCH_GAIN = 0.05  # a checked correct answer counts like an honoured claim
SPOT_MISMATCH_FACTOR = 0.1  # wrong tokens are proof: 0.8 -> 0.08, under the floor at once
FAILURE_PENALTY = 0.05  # mild: crashes and network trouble are not lies (heartbeats drop the dead)
CAPACITY_OK_RATIO = 1 / 3  # down to a third of the claimed prefill rate is load and noise
CAPACITY_PENALTY = 0.2  # the most one inflated-capacity observation costs
MIN_CAPACITY_TOKENS = 64  # shorter prefills are dominated by fixed per-request overhead
RECOVERY_HALF_LIFE_S = 600.0  # a flapping honest peer is back near INITIAL in tens of minutes
RECOVERY_DELAY_S = 300.0  # no recovery within 5 min of a penalty: a liar cannot out-wait it
MAX_STRIKE_DOUBLINGS = 6  # each caught lie doubles the half-life, up to 64x (~11 h)
MAX_PEERS = 4096  # tracked peers (a memory bound; peers with strikes are evicted last)


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

    def __init__(self, *, max_peers: int = MAX_PEERS) -> None:
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
            raise InvalidTrustConfig(f"max_peers must be an int >= 1, got {max_peers!r}")
        self.max_peers = max_peers
        self._peers: dict[bytes, PeerTrust] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers

    # -- reading

    def _recovered(self, rec: PeerTrust, now: float) -> float:
        start = max(rec.updated_at, rec.last_penalty_at + RECOVERY_DELAY_S)
        dt = now - start
        if dt <= 0:  # within the delay after a penalty, or a clock that went backwards
            return rec.trust
        half_life = RECOVERY_HALF_LIFE_S * 2 ** min(rec.strikes, MAX_STRIKE_DOUBLINGS)
        keep = 0.5 ** (dt / half_life)
        return INITIAL_TRUST + (rec.trust - INITIAL_TRUST) * keep

    def trust(self, peer: bytes, now: float) -> float:
        """The peer's trust at ``now`` (``initial`` for a peer never observed)."""
        check_time(now)
        rec = self._peers.get(peer)
        if rec is None:
            return INITIAL_TRUST
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
        check_time(now)
        if not isinstance(peer, bytes):
            raise InvalidObservation(f"peer must be bytes, got {type(peer).__name__}")
        rec = self._peers.get(peer)
        if rec is None:
            if len(self._peers) >= self.max_peers:
                self._evict_one()
            rec = self._peers[peer] = PeerTrust(INITIAL_TRUST, now)
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
        ``MIN_CLAIM_TOKENS``).
        """
        check_observed(claimed_tokens, "claimed_tokens")
        check_observed(cached_tokens, "cached_tokens")
        rec = self._touch(peer, now)
        if claimed_tokens < MIN_CLAIM_TOKENS:
            return self._clamp(rec)
        ratio = min(1.0, cached_tokens / claimed_tokens)
        if ratio >= HONOR_RATIO:
            rec.honoured += 1
            rec.trust += HONOR_GAIN * (1.0 - rec.trust)
        else:
            rec.misses += 1
            rec.trust *= 1.0 - MISS_PENALTY * (1.0 - ratio)
            rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def observe_spot_check(self, peer: bytes, now: float, verdict: SpotCheckVerdict) -> float:
        """Rule (b): a spot-check verdict about ``peer``."""
        if not isinstance(verdict, SpotCheckVerdict):
            raise InvalidObservation("verdict must be a SpotCheckVerdict")
        rec = self._touch(peer, now)
        if verdict.kind == MISMATCH:
            rec.strikes += 1
            rec.trust *= SPOT_MISMATCH_FACTOR
            rec.last_penalty_at = rec.updated_at
        elif verdict.kind == MATCH:
            rec.spot_matches += 1
            rec.trust += SPOT_MATCH_GAIN * (1.0 - rec.trust)
        else:  # DRIFT: explainable by numerics; treat like a failure
            rec.failures += 1
            rec.trust *= 1.0 - FAILURE_PENALTY
            rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def observe_failure(self, peer: bytes, now: float) -> float:
        """Rule (d): a forward to ``peer`` failed, timed out or was refused."""
        rec = self._touch(peer, now)
        rec.failures += 1
        rec.trust *= 1.0 - FAILURE_PENALTY
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
        check_observed(claimed_prefill_tps, "claimed_prefill_tps")
        check_observed(uncached_tokens, "uncached_tokens")
        check_observed(prefill_s, "prefill_s")
        rec = self._touch(peer, now)
        if uncached_tokens < MIN_CAPACITY_TOKENS or claimed_prefill_tps <= 0:
            return self._clamp(rec)
        observed_tps = uncached_tokens / prefill_s if prefill_s > 0 else math.inf
        floor_tps = CAPACITY_OK_RATIO * claimed_prefill_tps
        if observed_tps < floor_tps:
            rec.capacity_flags += 1
            rec.trust *= 1.0 - CAPACITY_PENALTY * (1.0 - observed_tps / floor_tps)
            rec.last_penalty_at = rec.updated_at
        return self._clamp(rec)

    def snapshot(self, now: float) -> dict[bytes, float]:
        """Every tracked peer's trust at ``now``."""
        return {p: self.trust(p, now) for p in self._peers}


def observations_to_floor(
    floor: float,
    *,
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
    check_unit(floor, "floor")
    if not (math.isfinite(max_gap_s) and max_gap_s >= 0):
        raise InvalidTrustConfig(f"max_gap_s must be finite and >= 0, got {max_gap_s!r}")
    # recovery only runs for the part of a gap past RECOVERY_DELAY_S after a penalty
    check_unit(severity, "severity", open_low=True)
    if 1.0 - severity >= HONOR_RATIO:
        raise InvalidTrustConfig(f"severity {severity} counts as an honoured claim")
    keep = 0.5 ** (max(0.0, max_gap_s - RECOVERY_DELAY_S) / RECOVERY_HALF_LIFE_S)
    t = INITIAL_TRUST
    for n in range(1, 10_000):
        if n > 1:
            t = INITIAL_TRUST + (t - INITIAL_TRUST) * keep
        t *= 1.0 - MISS_PENALTY * severity
        if t < floor:
            return n
    raise InvalidTrustConfig(
        f"with gaps of {max_gap_s} s recovery outpaces the miss penalty; never under {floor}"
    )


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
        check_unit(self.fraction, "fraction")
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


def judge_batched(verdict: SpotCheckVerdict, lead: float | None) -> SpotCheckVerdict:
    """The verdict on an answer decoded in shared batches (by the peer or by us).

    ``lead``: how far the re-execution's token at the first difference led its runner-up
    (log probabilities, nats); None where it is not known (no logprobs, or the difference
    is past the re-execution's end). A mismatch at a near-tie, or where the lead is not
    known, is a ``drift``: batched numerics explain it, no penalty. A mismatch where the
    re-execution's choice was clear (lead > :data:`BATCHED_TIE_NATS`) stays a
    ``mismatch``: no kernel difference makes a clear choice flip, so claiming a batched
    answer does not excuse a wrong one."""
    if verdict.kind != MISMATCH:
        return verdict
    if lead is not None and lead > BATCHED_TIE_NATS:
        return replace(verdict, reason=f"{verdict.reason}; batched, but the re-execution "
                       f"chose that token by {lead:.2f} nats (batching flips only choices "
                       f"within {BATCHED_TIE_NATS})")
    why = f"a near-tie ({lead:.3f} nats)" if lead is not None else "a margin not known"
    return replace(verdict, kind=DRIFT,
                   reason=f"{verdict.reason}; batched answer, {why}: judged as drift")
