"""PeerRateLimiter (overlay/core/trust.py): per-peer token buckets, checked against a brute-force
exact-arithmetic reference and against the window bound itself."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.limits import PeerRateLimiter
from prefixmesh.overlay.core.trust import InvalidObservation, InvalidTrustConfig

PEERS = [bytes([i]) * 4 for i in range(6)]

# dyadic rates, bursts and times: float arithmetic on them is exact, so the float limiter
# and the Fraction reference must agree call for call
rates = st.integers(1, 40).map(lambda k: k / 4)
bursts = st.integers(1, 10).map(float)
times = st.integers(0, 800).map(lambda k: k / 8)
costs = st.sampled_from([1.0, 1.0, 1.0, 0.5, 2.0, 0.0])


class ReferenceBucket:
    """The definition, in exact arithmetic: refill by elapsed time past the watermark."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = Fraction(rate), Fraction(burst)
        self.buckets: dict[bytes, tuple[Fraction, Fraction]] = {}

    def allow(self, peer: bytes, now: float, cost: float) -> bool:
        now_f, cost_f = Fraction(now), Fraction(cost)
        if cost_f > self.burst:
            return False  # can never pass; the limiter keeps no state for it
        tokens, mark = self.buckets.get(peer, (self.burst, now_f))
        if now_f > mark:
            tokens, mark = min(self.burst, tokens + (now_f - mark) * self.rate), now_f
        ok = tokens >= cost_f
        self.buckets[peer] = (tokens - cost_f if ok else tokens, mark)
        return ok


def _window_violations(allowed_times: list[float], rate: float, burst: float) -> list:
    """Brute force over every pair of allowed calls: count in [t_i, t_j] vs the bound."""
    ts = sorted(allowed_times)
    bad = []
    for i in range(len(ts)):
        for j in range(i, len(ts)):
            n = j - i + 1  # ties: the pair (first, last) of equal times is examined too
            if n > burst + rate * (ts[j] - ts[i]) + 1e-6:
                bad.append((ts[i], ts[j], n))
    return bad


# --- construction and arguments --------------------------------------------------------


@pytest.mark.parametrize("rate", [0, 0.0, -1.0, math.nan, math.inf, "2", None])
def test_bad_rate_is_refused(rate):
    with pytest.raises(InvalidTrustConfig, match="rate_per_s"):
        PeerRateLimiter(rate, 5.0)


@pytest.mark.parametrize("burst", [0, 0.5, -1.0, math.nan, math.inf, "5", None])
def test_bad_burst_is_refused(burst):
    with pytest.raises(InvalidTrustConfig, match="burst"):
        PeerRateLimiter(1.0, burst)


@pytest.mark.parametrize("max_peers", [0, -3, 1.5, True, None])
def test_bad_max_peers_is_refused(max_peers):
    with pytest.raises(InvalidTrustConfig, match="max_peers"):
        PeerRateLimiter(1.0, 2.0, max_peers=max_peers)


def test_bad_now_and_cost_are_invalid_observations():
    lim = PeerRateLimiter(1.0, 2.0)
    for now in (math.nan, math.inf, -math.inf, "1"):
        with pytest.raises(InvalidObservation):
            lim.allow(b"p", now)
        with pytest.raises(InvalidObservation):
            lim.retry_after_s(b"p", now)
    for cost in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidObservation):
            lim.allow(b"p", 0.0, cost)
    assert len(lim) == 0


# --- behaviour -----------------------------------------------------------------------


def test_burst_then_refill_at_rate():
    lim = PeerRateLimiter(2.0, 3.0)
    assert [lim.allow(b"a", 10.0) for _ in range(4)] == [True, True, True, False]
    assert lim.retry_after_s(b"a", 10.0) == pytest.approx(0.5)
    assert not lim.allow(b"a", 10.4)
    assert lim.allow(b"a", 10.5)
    assert not lim.allow(b"a", 10.5)
    # a long silence refills to the burst, never beyond
    assert [lim.allow(b"a", 1000.0) for _ in range(4)] == [True, True, True, False]


def test_refused_calls_take_nothing():
    lim = PeerRateLimiter(1.0, 1.0)
    assert lim.allow(b"a", 0.0)
    for k in range(1, 100):  # knocking every 10 ms does not delay the refill
        assert not lim.allow(b"a", k / 100)
    assert lim.allow(b"a", 1.0)


def test_unknown_peer_is_full_and_queries_change_nothing():
    lim = PeerRateLimiter(1.0, 4.0)
    assert lim.retry_after_s(b"new", 5.0) == 0.0
    assert lim.tokens(b"new", 5.0) == 4.0
    assert len(lim) == 0 and b"new" not in lim


def test_cost_over_burst_is_never_allowed_and_stores_nothing():
    lim = PeerRateLimiter(1.0, 2.0)
    assert not lim.allow(b"a", 0.0, cost=3.0)
    assert lim.retry_after_s(b"a", 0.0, cost=3.0) == math.inf
    assert len(lim) == 0
    assert lim.allow(b"a", 0.0, cost=2.0) and not lim.allow(b"a", 0.0, cost=0.5)


def test_clock_stepping_back_creates_no_tokens():
    lim = PeerRateLimiter(1.0, 2.0)
    assert lim.allow(b"a", 100.0) and lim.allow(b"a", 100.0)
    assert not lim.allow(b"a", 50.0)  # 50 s "earlier": nothing refilled
    assert not lim.allow(b"a", 99.0)
    assert not lim.allow(b"a", 100.0)  # back at the watermark: still nothing
    # refill resumes only past the watermark; the wait includes the way back to it
    assert lim.retry_after_s(b"a", 50.0) == pytest.approx(51.0)
    assert lim.allow(b"a", 101.0)


def test_eviction_is_lru_and_only_partial_buckets_count():
    lim = PeerRateLimiter(1.0, 2.0, max_peers=2)
    assert lim.allow(b"a", 0.0) and lim.allow(b"a", 0.0)  # a: empty
    assert lim.allow(b"b", 0.0)  # b: 1 token
    assert lim.allow(b"c", 0.5)  # evicts a (least recently used) while not yet refilled
    assert len(lim) == 2 and b"a" not in lim and lim.evictions == 1
    # a forgotten peer starts full again (documented); this evicts b (1.5 tokens)
    assert lim.allow(b"a", 0.5) and lim.allow(b"a", 0.5)
    assert b"b" not in lim and lim.evictions == 2
    # c has refilled completely by t=10: evicting it changes no answer and is not counted
    assert lim.allow(b"d", 10.0)
    assert b"c" not in lim and b"a" in lim and b"d" in lim and lim.evictions == 2


# --- properties -------------------------------------------------------------------------

calls = st.lists(st.tuples(st.sampled_from(PEERS), times, costs), max_size=120)


@settings(max_examples=100, deadline=None)
@given(rates, bursts, calls)
def test_matches_exact_reference(rate, burst, seq):
    lim = PeerRateLimiter(rate, burst)
    ref = ReferenceBucket(rate, burst)
    for peer, now, cost in seq:
        assert lim.allow(peer, now, cost) == ref.allow(peer, now, cost), (peer, now, cost)


@settings(max_examples=200, deadline=None)
@given(rates, bursts, st.lists(st.tuples(st.sampled_from(PEERS[:3]), times), max_size=120))
def test_window_bound_for_non_decreasing_time(rate, burst, seq):
    seq = sorted(seq, key=lambda c: c[1])
    lim = PeerRateLimiter(rate, burst)
    allowed: dict[bytes, list[float]] = {}
    for peer, now in seq:
        if lim.allow(peer, now):
            allowed.setdefault(peer, []).append(now)
    for ts in allowed.values():
        assert _window_violations(ts, rate, burst) == []
    assert len(lim) <= len(PEERS)


@settings(max_examples=200, deadline=None)
@given(rates, bursts, st.lists(st.tuples(st.sampled_from(PEERS[:2]), times), max_size=100))
def test_window_bound_holds_at_the_watermark_for_any_time_order(rate, burst, seq):
    lim = PeerRateLimiter(rate, burst)
    allowed: dict[bytes, list[float]] = {}
    mark: dict[bytes, float] = {}
    for peer, now in seq:
        mark[peer] = max(mark.get(peer, now), now)
        if lim.allow(peer, now):
            allowed.setdefault(peer, []).append(mark[peer])
    for ts in allowed.values():
        assert _window_violations(ts, rate, burst) == []


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.1, 100.0),
    st.floats(1.0, 20.0),
    st.floats(0.0, 2e9),  # up to Unix time
    st.lists(st.floats(0.0, 5.0), max_size=100),
)
def test_peer_at_or_under_the_rate_is_never_refused(rate, burst, t0, extra_gaps):
    """Calls at least 1/rate apart (any float rate, any start) always pass."""
    lim = PeerRateLimiter(rate, burst)
    now = t0
    for gap in extra_gaps:
        assert lim.allow(b"honest", now)
        now += 1.0 / rate + gap


@settings(max_examples=200, deadline=None)
@given(rates, bursts, st.lists(st.tuples(st.sampled_from(PEERS[1:]), times), max_size=200),
       st.data())
def test_one_peers_flood_never_changes_anothers_answers(rate, burst, flood, data):
    victim_times = sorted(data.draw(st.lists(times, max_size=60)))
    alone = PeerRateLimiter(rate, burst, max_peers=len(PEERS))
    mixed = PeerRateLimiter(rate, burst, max_peers=len(PEERS))
    # interleave the flood (other peers, arbitrary times) with the victim's calls
    flood_iter = iter(flood)
    for now in victim_times:
        for peer, t in [next(flood_iter, (None, 0.0)) for _ in range(3)]:
            if peer is not None:
                mixed.allow(peer, t)
        assert alone.allow(PEERS[0], now) == mixed.allow(PEERS[0], now)
    assert mixed.evictions == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.binary(min_size=1, max_size=2), times),
                                     max_size=200))
def test_memory_is_bounded(max_peers, seq):
    lim = PeerRateLimiter(1.0, 2.0, max_peers=max_peers)
    for peer, now in seq:
        lim.allow(peer, now)
        assert len(lim) <= max_peers


@settings(max_examples=200, deadline=None)
@given(rates, bursts, st.lists(st.tuples(times, costs), max_size=40), times, costs)
def test_retry_after_is_exact(rate, burst, history, now, cost):
    lim = PeerRateLimiter(rate, burst)
    for t, c in history:
        lim.allow(b"p", t, c)
    wait = lim.retry_after_s(b"p", now, cost)
    if cost > burst:
        assert wait == math.inf
        return
    later = copy.deepcopy(lim)
    assert later.allow(b"p", now + wait, cost)
    if wait > 1e-6:
        sooner = copy.deepcopy(lim)
        assert not sooner.allow(b"p", now + wait - 1e-6, cost)
