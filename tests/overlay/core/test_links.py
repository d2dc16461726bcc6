"""overlay/core/links.py: who is up *for us* (our own link to each member) and which
members get a direct check, against a small model of the rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.links import (
    FRESH_CONNECTION_EVERY,
    MAX_CHECK_BACKOFF,
    MAX_CHECKS_PER_TICK,
    LinkView,
)
from prefixmesh.overlay.core.membership import ALIVE, DEAD, PROBE_INTERVAL_S, SUSPECT

PEERS = [bytes([i]) for i in range(8)]


def test_a_member_is_up_only_after_it_answers_us_and_until_a_failure():
    v = LinkView()
    v.track(b"p")
    assert not v.is_up(b"p", ALIVE)
    assert v.due(0.0, lambda p: ALIVE) == [b"p"]  # checked at once
    v.answered(b"p")
    assert v.is_up(b"p", ALIVE)
    v.failed(b"p", 1.0)
    assert not v.is_up(b"p", ALIVE)  # alive for the mesh, not reachable by us
    assert v.due(1.0, lambda p: ALIVE) == [b"p"]
    # failing again while failed is no news: the backoff holds (no dial loop)
    assert v.failed(b"p", 1.1) is False
    assert v.due(1.1, lambda p: ALIVE) == []
    v.answered(b"p")
    assert v.is_up(b"p", ALIVE)
    assert v.failed(b"p", 5.0) is True
    v.answered(b"p")
    assert not v.is_up(b"p", DEAD) and not v.is_up(b"p", None)


def test_flap_rule_a_suspect_that_answers_us_is_up_again_at_once():
    v = LinkView()
    v.track(b"p")
    v.answered(b"p")
    v.state_changed(b"p", SUSPECT, 2.0)
    assert not v.is_up(b"p", SUSPECT)  # not answered since the suspicion reached us
    assert v.due(2.0, lambda p: SUSPECT) == [b"p"]
    assert v.due(2.5, lambda p: SUSPECT) == []  # once per period
    assert v.due(2.0 + PROBE_INTERVAL_S, lambda p: SUSPECT) == [b"p"]
    v.answered(b"p")
    assert v.is_up(b"p", SUSPECT)
    v.state_changed(b"p", ALIVE, 3.5)  # its refutation
    assert v.is_up(b"p", ALIVE)
    v.state_changed(b"p", DEAD, 9.0)
    v.state_changed(b"p", ALIVE, 10.0)  # a new life starts unanswered
    assert not v.is_up(b"p", ALIVE)


def test_an_alive_member_that_stays_silent_is_checked_with_backoff():
    v = LinkView()
    v.track(b"p")
    times = [t * 0.5 for t in range(200) if v.due(t * 0.5, lambda p: ALIVE)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps[0] == PROBE_INTERVAL_S
    assert max(gaps) == MAX_CHECK_BACKOFF * PROBE_INTERVAL_S
    assert gaps == sorted(gaps)


ops = st.lists(st.tuples(st.sampled_from(["track", "forget", "answered", "failed",
                                          "alive", "suspect", "dead", "due"]),
                         st.sampled_from(PEERS)), max_size=60)


def test_every_second_unanswered_check_goes_over_a_fresh_connection():
    v = LinkView()
    v.track(b"p")
    fresh = []
    for t in range(200):
        for peer in v.due(t * 0.5, lambda p: ALIVE):
            fresh.append(v.wants_fresh_connection(peer))
    n = FRESH_CONNECTION_EVERY
    assert n >= 2  # the first check after a failure goes over the connection we have
    assert fresh[: 3 * n] == ([False] * (n - 1) + [True]) * 3
    v.answered(b"p")  # an answer resets the count: the connection works
    v.failed(b"p", 200.0)
    assert v.due(200.0, lambda p: ALIVE) == [b"p"] and not v.wants_fresh_connection(b"p")
    assert not v.wants_fresh_connection(b"unknown")


@settings(max_examples=400, deadline=None)
@given(ops)
def test_links_follow_the_rules_of_a_simple_model(seq):
    """Up for us == ALIVE, or SUSPECT answered since suspected, with the latest link event
    an answer; due() is bounded, never names a peer that is up, dead or untracked."""
    v = LinkView()
    state: dict[bytes, str] = {}
    ok: dict[bytes, bool] = {}
    answered_since: dict[bytes, bool] = {}
    now = 0.0
    for op, p in seq:
        now += 0.25
        if op == "track":  # as the shell does: a member, with its state
            v.track(p)
            state.setdefault(p, ALIVE)
            v.state_changed(p, state[p], now)
            if p not in ok:
                ok[p], answered_since[p] = False, False
        elif op == "forget":
            v.forget(p)
            ok.pop(p, None)
            answered_since.pop(p, None)
        elif op in ("alive", "suspect", "dead"):
            new = {"alive": ALIVE, "suspect": SUSPECT, "dead": DEAD}[op]
            old = state.get(p)
            state[p] = new
            if old != new:
                v.state_changed(p, new, now)
                if p in ok:
                    if new == SUSPECT:
                        answered_since[p] = False
                    elif new == DEAD:
                        ok[p] = False
        elif op == "answered":
            v.answered(p)
            if p in ok:
                ok[p] = True
                answered_since[p] = True
        elif op == "failed":
            v.failed(p, now)
            if p in ok:
                ok[p] = False
        else:
            due = v.due(now, state.get)
            assert len(due) <= MAX_CHECKS_PER_TICK
            for q in due:
                assert q in ok and state.get(q) in (ALIVE, SUSPECT)
                assert not v.is_up(q, state.get(q))
        for q in PEERS:
            s = state.get(q)
            want = q in ok and ok[q] and (s == ALIVE or (s == SUSPECT and answered_since[q]))
            assert v.is_up(q, s) == want, (q, s)
