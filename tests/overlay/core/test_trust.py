"""Tests of overlay/core/trust.py: trust scores and spot checks, and (simulation) how trust and
the forwarded-share cap together bound what a lying peer attracts. The limits alone:
test_limits.py, test_ratelimit.py."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.limits import (
    ForwardShareLimiter,
)
from prefixmesh.overlay.core.routing import (
    FORWARD,
    Candidate,
    RouteContext,
    RoutingConfig,
    make_policy,
)
from prefixmesh.overlay.core.trust import (
    BATCHED_TIE_NATS,
    DRIFT,
    INITIAL_TRUST,
    MATCH,
    MISMATCH,
    RECOVERY_DELAY_S,
    RECOVERY_HALF_LIFE_S,
    InvalidObservation,
    InvalidTrustConfig,
    SpotChecker,
    SpotCheckVerdict,
    TrustTracker,
    judge_batched,
    observations_to_floor,
)

FLOOR = RoutingConfig().trust_floor  # 0.2
P = b"peer-A"


def _verdict(kind: str) -> SpotCheckVerdict:
    return SpotCheckVerdict(P, b"rid", kind, None if kind == MATCH else 3, (), (), 8, 8, "")


# ---------------------------------------------------------------------------- TrustTracker


def test_unknown_peer_starts_at_initial_and_is_routable():
    t = TrustTracker()
    assert t.trust(P, 0.0) == INITIAL_TRUST == 0.8
    assert t.trust(P, 0.0) >= FLOOR
    assert P not in t


@pytest.mark.parametrize("max_peers", [0, -1, 1.5, True, "8"])
def test_max_peers_validation(max_peers):
    with pytest.raises(InvalidTrustConfig):
        TrustTracker(max_peers=max_peers)


def test_observation_validation():
    t = TrustTracker()
    with pytest.raises(InvalidObservation):
        t.observe_cache(P, 0.0, claimed_tokens=-1, cached_tokens=0)
    with pytest.raises(InvalidObservation):
        t.observe_cache(P, math.nan, claimed_tokens=10, cached_tokens=0)
    with pytest.raises(InvalidObservation):
        t.observe_capacity(P, 0.0, claimed_prefill_tps=math.inf, uncached_tokens=100, prefill_s=1)
    with pytest.raises(InvalidObservation):
        t.observe_failure("not-bytes", 0.0)  # type: ignore[arg-type]
    assert len(t) == 0  # rejected observations leave no trace


def test_honoured_claim_raises_slowly_miss_lowers_proportionally():
    t = TrustTracker()
    up = t.observe_cache(P, 0.0, claimed_tokens=1000, cached_tokens=1000)
    assert up == pytest.approx(0.8 + 0.05 * 0.2)
    t2 = TrustTracker()
    full_miss = t2.observe_cache(P, 0.0, claimed_tokens=1000, cached_tokens=0)
    assert full_miss == pytest.approx(0.8 * 0.88)
    t3 = TrustTracker()
    half_miss = t3.observe_cache(P, 0.0, claimed_tokens=1000, cached_tokens=500)
    assert half_miss == pytest.approx(0.8 * (1 - 0.12 * 0.5))
    # within the honour tolerance (90 %): not a miss
    t4 = TrustTracker()
    assert t4.observe_cache(P, 0.0, claimed_tokens=1000, cached_tokens=950) > 0.8
    # more than claimed is honoured too
    assert TrustTracker().observe_cache(P, 0.0, claimed_tokens=100, cached_tokens=400) > 0.8


def test_claims_under_one_block_are_not_judged():
    t = TrustTracker()
    assert t.observe_cache(P, 0.0, claimed_tokens=15, cached_tokens=0) == 0.8
    assert t.record(P).misses == 0


def test_one_stale_miss_does_not_ban():
    t = TrustTracker()
    for i in range(50):
        t.observe_cache(P, float(i), claimed_tokens=512, cached_tokens=512)
    after = t.observe_cache(P, 50.0, claimed_tokens=512, cached_tokens=0)
    assert after > 0.7


def test_spot_check_mismatch_drops_under_floor_at_once_and_slows_recovery():
    t = TrustTracker()
    after = t.observe_spot_check(P, 0.0, _verdict(MISMATCH))
    assert after == pytest.approx(0.08)
    assert after < FLOOR
    rec = t.record(P)
    assert rec.strikes == 1
    # no recovery during the delay after the penalty
    assert t.trust(P, RECOVERY_DELAY_S) == pytest.approx(0.08)
    # with one strike the half-life doubles: after one base half-life past the delay,
    # the gap to `initial` has closed by only 1 - 2**-0.5
    later = t.trust(P, RECOVERY_DELAY_S + RECOVERY_HALF_LIFE_S)
    gap = 0.8 - 0.08
    assert later == pytest.approx(0.8 - gap * 2**-0.5)
    # an honest peer with a failure instead recovers at the base rate
    t2 = TrustTracker()
    low = t2.observe_failure(P, 0.0)
    at = t2.trust(P, RECOVERY_DELAY_S + RECOVERY_HALF_LIFE_S)
    assert at == pytest.approx(0.8 - (0.8 - low) * 0.5)


def test_spot_check_match_and_drift():
    t = TrustTracker()
    assert t.observe_spot_check(P, 0.0, _verdict(MATCH)) == pytest.approx(0.8 + 0.05 * 0.2)
    t2 = TrustTracker()
    assert t2.observe_spot_check(P, 0.0, _verdict(DRIFT)) == pytest.approx(0.8 * 0.95)
    assert t2.record(P).strikes == 0


def test_capacity_inflation_lowers_trust_honest_capacity_does_not():
    t = TrustTracker()
    # claims 1000 tok/s, prefilled 1000 tokens in 10 s: 100 tok/s, 10 % of the claim
    low = t.observe_capacity(P, 0.0, claimed_prefill_tps=1000, uncached_tokens=1000, prefill_s=10)
    assert low < 0.8
    assert t.record(P).capacity_flags == 1
    honest = TrustTracker()
    # 50 % of the claim: within the 1/3 tolerance (load, measurement noise)
    same = honest.observe_capacity(
        P, 0.0, claimed_prefill_tps=1000, uncached_tokens=1000, prefill_s=2
    )
    assert same == 0.8
    # tiny prefills are dominated by fixed overhead: not judged
    tiny = TrustTracker().observe_capacity(
        P, 0.0, claimed_prefill_tps=1e6, uncached_tokens=10, prefill_s=5
    )
    assert tiny == 0.8


def test_recovery_toward_initial_both_ways():
    t = TrustTracker()
    for i in range(300):
        t.observe_cache(P, float(i), claimed_tokens=100, cached_tokens=100)
    high = t.trust(P, 299.0)
    assert high > 0.95
    # with no penalty ever, recovery (toward 0.8) starts right away
    assert t.trust(P, 299.0 + RECOVERY_HALF_LIFE_S) == pytest.approx(0.8 + (high - 0.8) * 0.5)
    # a clock that goes backwards changes nothing
    assert t.trust(P, 0.0) == pytest.approx(high)


def test_eviction_keeps_peers_with_strikes():
    t = TrustTracker(max_peers=3)
    t.observe_spot_check(b"liar", 0.0, _verdict(MISMATCH))
    for i in range(10):
        t.observe_failure(bytes([i]), float(i + 1))
    assert len(t) == 3
    assert b"liar" in t
    assert t.trust(b"liar", 11.0) < FLOOR


_EVENT = st.one_of(
    st.tuples(st.just("cache"), st.integers(0, 10_000), st.integers(0, 10_000)),
    st.tuples(st.just("spot"), st.sampled_from([MATCH, MISMATCH, DRIFT]), st.just(0)),
    st.tuples(st.just("fail"), st.just(0), st.just(0)),
    st.tuples(
        st.just("cap"),
        st.floats(0, 1e7, allow_nan=False),
        st.tuples(st.integers(0, 100_000), st.floats(0, 1e4, allow_nan=False)),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.floats(-100, 5000, allow_nan=False), st.sampled_from([b"a", b"b"]), _EVENT),
        max_size=60,
    )
)
def test_trust_always_in_unit_interval(events):
    t = TrustTracker(max_peers=1)
    now = 0.0
    for dt, peer, (kind, x, y) in events:
        now += dt  # may go backwards
        if kind == "cache":
            v = t.observe_cache(peer, now, claimed_tokens=x, cached_tokens=y)
        elif kind == "spot":
            v = t.observe_spot_check(peer, now, _verdict(x))
        elif kind == "fail":
            v = t.observe_failure(peer, now)
        else:
            v = t.observe_capacity(
                peer, now, claimed_prefill_tps=x, uncached_tokens=y[0], prefill_s=y[1]
            )
        assert 0.0 <= v <= 1.0
        for p in (b"a", b"b"):
            assert 0.0 <= t.trust(p, now) <= 1.0
            assert 0.0 <= t.trust(p, now + 1e6) <= 1.0


def test_lying_bound_is_small_and_exact():
    assert observations_to_floor(FLOOR) == 11  # 0.8 * 0.88**11 = 0.197 < 0.2 < 0.8 * 0.88**10
    assert 0.8 * 0.88**11 < FLOOR < 0.8 * 0.88**10
    # the bound holds with gaps up to the recovery delay (no recovery between penalties)
    assert observations_to_floor(FLOOR, max_gap_s=RECOVERY_DELAY_S) == 11
    assert observations_to_floor(FLOOR, max_gap_s=300, severity=0.9) == 13
    with pytest.raises(InvalidTrustConfig):
        observations_to_floor(FLOOR, max_gap_s=3600)  # recovery outpaces a slow liar


MAX_GAP = RECOVERY_DELAY_S


@settings(max_examples=200, deadline=None)
@given(
    obs=st.lists(
        st.tuples(
            st.floats(0, MAX_GAP, allow_nan=False),  # gap to the previous observation
            st.integers(16, 32_768),  # claimed tokens
            st.floats(0.0, 0.1),  # fraction actually reused: at most 10 %
        ),
        min_size=observations_to_floor(FLOOR, max_gap_s=MAX_GAP, severity=0.9),
        max_size=40,
    ),
    start=st.floats(0, 1e6, allow_nan=False),
)
def test_always_lying_peer_falls_under_floor_within_bound(obs, start):
    bound = observations_to_floor(FLOOR, max_gap_s=MAX_GAP, severity=0.9)
    assert bound <= 13
    t = TrustTracker()
    now = start
    for i, (gap, claimed, frac) in enumerate(obs):
        now += gap
        value = t.observe_cache(P, now, claimed_tokens=claimed, cached_tokens=int(claimed * frac))
        if i + 1 >= bound:
            assert value < FLOOR
            assert t.trust(P, now) < FLOOR


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, 9)),  # position of this block's miss, if any
            st.floats(0.0, 0.89),  # the miss's reuse fraction (0: nothing reused)
            st.floats(0.0, 120.0, allow_nan=False),  # gap between observations
        ),
        min_size=1,
        max_size=80,
    )
)
def test_honest_peer_with_occasional_stale_misses_stays_above_floor(blocks):
    """At most one stale miss in every 10 claims (10 %), wherever it falls."""
    t = TrustTracker()
    now = 0.0
    for miss_at, frac, gap in blocks:
        for i in range(10):
            now += gap
            cached = int(1000 * frac) if i == miss_at else 1000
            value = t.observe_cache(P, now, claimed_tokens=1000, cached_tokens=cached)
            assert value > FLOOR


def test_honest_peer_with_random_ten_percent_misses_stays_above_floor():
    """Independent 10 % full misses (clusters happen) over 5 seeds x 20,000 claims."""
    for seed in range(5):
        rng = random.Random(seed)
        t = TrustTracker()
        values = []
        for i in range(20_000):
            cached = 0 if rng.random() < 0.10 else 2048
            values.append(t.observe_cache(P, i * 2.0, claimed_tokens=2048, cached_tokens=cached))
        assert min(values) > FLOOR
        # it hovers near the predicted equilibrium g(1-m) / (g(1-m) + p m) = 0.79
        mean = sum(values[1000:]) / len(values[1000:])
        assert abs(mean - 0.045 / 0.057) < 0.1


# ---------------------------------------------------------------------------- spot checks


def test_spot_checker_draws_only_for_eligible_requests():
    sc = SpotChecker(random.Random(1), fraction=1.0)
    assert not sc.should_check(temperature=0.7, local_model=b"m", peer_model=b"m")
    assert not sc.should_check(temperature=0.0, local_model=b"m", peer_model=b"other")
    assert not sc.should_check(temperature=0.0, local_model=b"", peer_model=b"")
    assert sc.eligible_seen == 0
    assert sc.should_check(temperature=0.0, local_model=b"m", peer_model=b"m")


def test_spot_checker_fraction_and_determinism():
    def draws(seed):
        sc = SpotChecker(random.Random(seed), fraction=0.1)
        return [
            sc.should_check(temperature=0, local_model=b"m", peer_model=b"m") for _ in range(5000)
        ]

    a = draws(3)
    assert a == draws(3)
    assert 400 <= sum(a) <= 600


def test_spot_checker_verdicts():
    sc = SpotChecker(random.Random(0), context=4)
    ok = sc.compare(P, b"r", [1, 2, 3], [1, 2, 3])
    assert ok.kind == MATCH and ok.ok and ok.first_mismatch is None
    bad = sc.compare(P, b"r", [1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 4, 5, 6, 7])
    assert bad.kind == MISMATCH and not bad.ok
    assert bad.first_mismatch == 2
    assert bad.expected == (3, 4, 5, 6) and bad.got == (9, 4, 5, 6)
    short = sc.compare(P, b"r", [1, 2, 3], [1, 2])
    assert short.kind == MISMATCH and short.first_mismatch == 2
    assert short.expected == (3,) and short.got == ()
    longer = sc.compare(P, b"r", [1], [1, 5])
    assert longer.kind == MISMATCH and longer.first_mismatch == 1
    lenient = SpotChecker(random.Random(0), strict_prefix_tokens=2)
    assert lenient.compare(P, b"r", [1, 2, 3], [1, 2, 4]).kind == DRIFT
    assert lenient.compare(P, b"r", [1, 2, 3], [1, 7, 3]).kind == MISMATCH


@given(
    a=st.lists(st.integers(0, 5), max_size=20),
    b=st.lists(st.integers(0, 5), max_size=20),
)
def test_spot_checker_compare_properties(a, b):
    v = SpotChecker(random.Random(0)).compare(P, b"r", a, b)
    assert v.ok == (a == b)
    if not v.ok:
        i = v.first_mismatch
        assert a[:i] == b[:i]
        assert i == min(len(a), len(b)) or a[i] != b[i]


# ---------------------------------------------------------------------------- simulation


def _simulate(n_requests: int, *, liar_answers_honestly: bool = False):
    """One entry node, four candidates advertising matches of a 2048-token prompt; the liar
    advertises nearly all of it and reuses nothing. Trust comes from a TrustTracker fed the
    FINAL frames; the ForwardShareLimiter filters candidates; prefixmesh decides."""
    liar, honest = b"L-liar", [b"H-one", b"H-two", b"H-three"]
    advertised = {liar: 2000, honest[0]: 1024, honest[1]: 960, honest[2]: 896}
    tracker = TrustTracker()
    limiter = ForwardShareLimiter(max_share=0.5, window=100, min_count=20)
    policy = make_policy("prefixmesh", rng=random.Random(5), self_id=b"self")
    forwards: list[bytes] = []
    for i in range(n_requests):
        now = float(i)
        candidates = [
            Candidate(
                peer=p,
                matched_tokens=m,
                prefill_tps=400.0,
                queue_wait_s=0.0,
                load=0.0,
                rtt_s=0.003,
                trust=tracker.trust(p, now),
            )
            for p, m in advertised.items()
        ]
        ctx = RouteContext(
            prompt_tokens=2048,
            local_matched_tokens=0,
            local_prefill_tps=400.0,
            local_queue_wait_s=0.0,
            local_load=0.0,
            candidates=tuple(limiter.filter(candidates, now)),
            hop_budget=2,
            visited=frozenset(),
            first_block=b"h1",
        )
        decision = policy.decide(ctx)
        if decision.action != FORWARD:
            continue
        peer = decision.peer
        limiter.record(peer, now)
        forwards.append(peer)
        cached = advertised[peer] if (peer != liar or liar_answers_honestly) else 0
        tracker.observe_cache(peer, now, claimed_tokens=advertised[peer], cached_tokens=cached)
    return liar, forwards, tracker


def test_lying_peer_loses_its_forwarded_share_within_bound():
    liar, forwards, tracker = _simulate(3000)
    assert len(forwards) == 3000  # every request is worth forwarding (local has no cache)
    bound = observations_to_floor(FLOOR)
    # the liar wins the first requests (it advertises the longest match), but each one is
    # caught; the discount matched * trust makes it lose to honest peers after a few,
    # before it even reaches the floor
    first = [i for i, p in enumerate(forwards[:100]) if p == liar]
    assert first == list(range(len(first)))
    assert 1 <= len(first) <= bound
    # so its share of every window of (up to) 100 forwards is under the cap from request
    # 2 * bound on
    for j in range(2 * bound, len(forwards)):
        window = forwards[max(0, j - 99) : j + 1]
        assert window.count(liar) / len(window) < 0.5
    # later it is only retried on parole, when recovery (after the 300 s delay) lifts its
    # discounted claim above the honest ones: each retry is caught again
    assert forwards.count(liar) <= len(first) + 3000 // int(RECOVERY_DELAY_S)
    assert forwards.count(liar) / len(forwards) < 0.01
    assert tracker.record(liar).honoured == 0
    assert (
        tracker.trust(liar, 3000.0)
        < 0.5
        < min(tracker.trust(p, 3000.0) for p in tracker.peers() if p != liar)
    )


def test_convincing_peer_is_capped_by_share_limiter():
    # a peer that honours its (long) claims would win every request; the cap holds it to 50 %
    liar, forwards, tracker = _simulate(400, liar_answers_honestly=True)
    assert tracker.trust(liar, 400.0) > 0.8
    for j in range(20, len(forwards)):
        window = forwards[max(0, j - 99) : j + 1]
        assert window.count(liar) / len(window) <= 0.5
    assert forwards[-100:].count(liar) == 50


def _compared(expected, got) -> SpotCheckVerdict:
    return SpotChecker(rng=random.Random(0)).compare(P, b"r", expected, got)


def test_a_batched_mismatch_is_a_drift_only_at_a_near_tie():
    wrong = _compared([1, 2, 3], [1, 9, 3])
    assert wrong.kind == MISMATCH and wrong.first_mismatch == 1
    near = judge_batched(wrong, 0.25)
    assert near.kind == DRIFT and "near-tie" in near.reason
    assert judge_batched(wrong, BATCHED_TIE_NATS).kind == DRIFT  # the bound itself: a tie
    clear = judge_batched(wrong, 3.0)
    assert clear.kind == MISMATCH and "3.00 nats" in clear.reason
    assert clear.first_mismatch == 1 and clear.got == wrong.got  # the evidence stays
    assert judge_batched(wrong, None).kind == DRIFT  # margin not known: no proof


@given(st.lists(st.integers(0, 5), max_size=6), st.lists(st.integers(0, 5), max_size=6),
       st.none() | st.floats(0, 50))
def test_judging_a_batched_answer_only_ever_softens_a_mismatch(expected, got, lead):
    before = _compared(expected, got)
    after = judge_batched(before, lead)
    if before.kind != MISMATCH:
        assert after == before
    else:
        assert after.kind == (MISMATCH if lead is not None and lead > BATCHED_TIE_NATS
                              else DRIFT)
        assert (after.first_mismatch, after.expected, after.got) == \
            (before.first_mismatch, before.expected, before.got)
