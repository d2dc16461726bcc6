"""overlay/core/membership.py, Lifeguard (issue 18): the local health multiplier (bounds,
what raises and lowers it, the probe interval and timeout it scales, ``next_deadline``),
the dynamic suspicion timeout (within [min, max], monotone in confirmations, each distinct
accuser counted once, a refutation cancels), the accuser tag on the wire and the buddy
system. The simulator's starvation runs are in tests/bench/test_membership_starvation.py."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import membership as mb
from prefixmesh.overlay.core.membership import (
    ALIVE,
    DEAD,
    MAX_LHM,
    PROBE_INTERVAL_S,
    PROBE_TIMEOUT_S,
    SUSPECT,
    Ack,
    Membership,
    MembershipError,
    Ping,
    PingReq,
    Update,
    accuser_tag,
    decode_message,
    dynamic_suspicion_timeout_s,
    encode_message,
    expected_confirmations,
    suspicion_max_timeout_s,
    suspicion_timeout_s,
)

OTHERS = [b"t", b"h1", b"h2", b"h3", b"h4", b"h5"]


def _mesh(me: bytes = b"a", others=OTHERS, *, lifeguard: bool = True) -> Membership:
    m = Membership(me, now=0.0, incarnation=1, rng=random.Random(7), lifeguard=lifeguard)
    for p in others:
        m.join(p, 0.0)
    m.drain_events()
    return m


def _round(m: Membership, now: float, *, answer: bool, late_by_s: float = 0.0) -> float:
    """Start the round's next probe at ``now`` (answered at once or never); returns when
    the probe period ends (the next probe is due)."""
    sends = m.tick(now, late_by_s=late_by_s)
    pings = [s for s in sends if isinstance(s.message, Ping)]
    assert len(pings) == 1, sends
    if answer:
        m.receive(pings[0].to, Ack(pings[0].message.seq, 1, pings[0].to), now + 0.01)
    return m.next_deadline() if answer else now + m.probe_interval_s()


# --- the dynamic suspicion timeout ------------------------------------------------------


@given(st.integers(1, 20_000), st.integers(0, 12))
def test_the_suspicion_timeout_stays_within_min_and_max_and_falls_with_confirmations(n, c):
    lo, hi = suspicion_timeout_s(n), suspicion_max_timeout_s(n)
    t = dynamic_suspicion_timeout_s(n, c)
    assert lo <= t <= hi
    assert dynamic_suspicion_timeout_s(n, c + 1) <= t  # monotone in confirmations
    k = expected_confirmations(n)
    if k == 0:  # too small a mesh to expect k: the classic timeout
        assert t == lo
    else:
        assert dynamic_suspicion_timeout_s(n, 0) == hi
        if c >= k:
            assert t == lo
        else:
            assert t > lo


def test_the_suspicion_bounds_follow_memberlist():
    # min: 4 x log10(N) periods (>= 4); max: 6 x min; k = 3, 0 when fewer than 3 could confirm
    assert suspicion_timeout_s(64) == 4 * 1.0 * __import__("math").log10(64)
    assert suspicion_max_timeout_s(64) == 6 * suspicion_timeout_s(64)
    assert expected_confirmations(5) == 3 and expected_confirmations(4) == 0


# --- confirmations ------------------------------------------------------------------------


def _accused(lifeguard: bool = True) -> Membership:
    """``a`` holds ``t`` SUSPECT at incarnation 1, accused by h1 (received at t=10)."""
    a = _mesh(lifeguard=lifeguard)
    a.learn(Update(b"t", 1, ALIVE), 0.0)
    a.receive(b"h1", Ping(1, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(b"h1")),)), 10.0)
    assert a.state_of(b"t") == SUSPECT
    return a


def test_each_distinct_accuser_counts_once_and_brings_the_deadline_down_to_the_min():
    a = _accused()
    n = len(a) + 1
    assert a.suspicion_deadline(b"t") == 10.0 + suspicion_max_timeout_s(n)
    deadlines = []
    for i, accuser in enumerate([b"h1", b"h2", b"h2", b"h3", b"h3", b"h4", b"h5"]):
        # the same claim, relayed by anyone, names its accuser: the relay does not count
        relay = OTHERS[i % len(OTHERS)]
        a.receive(relay, Ping(10 + i, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(accuser)),)),
                  11.0 + i)
        deadlines.append(a.suspicion_deadline(b"t"))
    want = [dynamic_suspicion_timeout_s(n, c) + 10.0 for c in (0, 1, 1, 2, 2, 3, 3)]
    assert deadlines == want  # h1 (the first) and repeats never count; k = 3 at most
    assert deadlines[-1] == 10.0 + suspicion_timeout_s(n)
    assert all(x >= y for x, y in zip(deadlines, deadlines[1:], strict=False))
    a.tick(deadlines[-1] - 0.01)
    assert a.state_of(b"t") == SUSPECT
    a.tick(deadlines[-1])
    assert a.state_of(b"t") == DEAD


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(OTHERS[1:] + [b"x", b""]), max_size=20))
def test_confirmations_are_the_distinct_named_accusers_beyond_the_first(accusers):
    a = _accused()
    for i, who in enumerate(accusers):
        tag = accuser_tag(who) if who else b""  # b"": an accuser we are not told
        a.receive(b"h2", Ping(i, 1, (Update(b"t", 1, SUSPECT, (), tag),)), 11.0)
    n = len(a) + 1
    distinct = len({w for w in accusers if w and w != b"h1"})
    c = min(distinct, expected_confirmations(n))
    assert a.suspicion_deadline(b"t") == 10.0 + dynamic_suspicion_timeout_s(n, c)


def test_a_new_confirmation_is_spread_on_and_a_repeat_is_not():
    a = _accused()
    while a.tick(0.0) or a._piggyback():  # drain what is queued (our join news etc.)
        pass
    a.receive(b"h2", Ping(5, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(b"h2")),)), 11.0)
    spread = a._piggyback()
    assert [(u.peer, u.suspector) for u in spread] == [(b"t", accuser_tag(b"h2"))]
    while a._piggyback():
        pass
    a.receive(b"h3", Ping(6, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(b"h2")),)), 12.0)
    assert a._piggyback() == ()


def test_our_own_failed_probe_of_a_suspect_is_a_confirmation():
    a = _accused()
    n = len(a) + 1
    t = 10.0
    while True:  # rounds until a probes t (the others answer)
        sends = a.tick(t)
        if sends and sends[0].to == b"t":
            break
        a.receive(sends[0].to, Ack(sends[0].message.seq, 1, sends[0].to), t + 0.01)
        t = a.next_deadline()
    a.tick(t + a.probe_interval_s())  # unanswered: we accuse it too
    assert a.suspicion_deadline(b"t") == 10.0 + dynamic_suspicion_timeout_s(n, 1)


def test_a_refutation_cancels_the_suspicion_and_its_confirmations():
    a = _accused()
    a.receive(b"h2", Ping(5, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(b"h2")),)), 11.0)
    a.receive(b"t", Ping(6, 2, (Update(b"t", 2, ALIVE),)), 12.0)  # t refutes
    assert a.state_of(b"t") == ALIVE and a.suspicion_deadline(b"t") is None
    # old accusations at the refuted incarnation change nothing
    a.receive(b"h3", Ping(7, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(b"h3")),)), 13.0)
    assert a.state_of(b"t") == ALIVE
    a.tick(100.0)
    assert a.state_of(b"t") != DEAD
    # a new suspicion starts from scratch: the maximum, no confirmations carried over
    a.receive(b"h3", Ping(8, 1, (Update(b"t", 2, SUSPECT, (), accuser_tag(b"h3")),)), 200.0)
    assert a.suspicion_deadline(b"t") == 200.0 + suspicion_max_timeout_s(len(a) + 1)


def test_without_lifeguard_the_classic_timeout_and_no_tag():
    a = _accused(lifeguard=False)
    n = len(a) + 1
    assert a.suspicion_deadline(b"t") == 10.0 + suspicion_timeout_s(n)
    a.receive(b"h2", Ping(5, 1, (Update(b"t", 1, SUSPECT, (), accuser_tag(b"h2")),)), 11.0)
    assert a.suspicion_deadline(b"t") == 10.0 + suspicion_timeout_s(n)
    b = _mesh(lifeguard=False)
    now = 0.0
    for _ in range(len(OTHERS)):
        now = _round(b, now, answer=False, late_by_s=5.0)
    assert b.local_health == 0 and b.probe_interval_s() == PROBE_INTERVAL_S
    assert all(not u.suspector for u in b.snapshot())


# --- the local health multiplier ----------------------------------------------------------


def test_local_health_rises_on_unanswered_probes_and_falls_on_answered_ones():
    a = _mesh()
    now = 0.0
    for i in range(3):
        now = _round(a, now, answer=False)
        a.tick(now - 1e-9)  # (the period's own deadlines)
        assert a.local_health == i  # raised when the period ends (below: at its next tick)
    now = _round(a, now, answer=True)
    assert a.local_health == 3  # the third unanswered period ended as this probe started
    now = _round(a, now, answer=True)
    assert a.local_health == 2  # one answered, on-time period
    now = _round(a, now, answer=True)
    assert a.local_health == 1


def test_the_scaled_probe_interval_and_timeout_are_honoured_by_next_deadline():
    a = _mesh()
    now = 0.0
    for _ in range(3):
        now = _round(a, now, answer=False)
    sends = a.tick(now)  # the third unanswered period ends: LHM 3, the new probe scaled x4
    assert a.local_health == 3
    assert a.probe_interval_s() == 4 * PROBE_INTERVAL_S
    assert a.probe_timeout_s() == 4 * PROBE_TIMEOUT_S
    [ping] = [s for s in sends if isinstance(s.message, Ping)]
    assert a.next_deadline() == now + 4 * PROBE_TIMEOUT_S  # the direct ACK's wait
    assert not [s for s in a.tick(now + 4 * PROBE_TIMEOUT_S - 0.01)
                if isinstance(s.message, PingReq)]
    reqs = a.tick(now + 4 * PROBE_TIMEOUT_S)
    assert reqs and all(isinstance(s.message, PingReq) for s in reqs)
    a.receive(b"h1", Ack(ping.message.seq, 1, ping.to), now + 2.5)  # relayed: reached
    assert a.next_deadline() == now + 4 * PROBE_INTERVAL_S
    assert not [s for s in a.tick(now + 4 * PROBE_INTERVAL_S - 0.01)
                if isinstance(s.message, Ping)]  # no new probe before the scaled period
    assert [s for s in a.tick(now + 4 * PROBE_INTERVAL_S) if isinstance(s.message, Ping)]
    assert a.state_of(ping.to) == ALIVE and a.local_health == 2


def test_a_late_tick_raises_local_health_once_per_period_and_blocks_the_fall():
    a = _mesh()
    now = _round(a, 0.0, answer=True)
    late = 0.6 * PROBE_TIMEOUT_S  # beyond LATE_TICK_FRACTION (a half) of the timeout
    a.tick(now - 0.5, late_by_s=late)
    assert a.local_health == 1
    a.tick(now - 0.4, late_by_s=late)
    assert a.local_health == 1  # once per period
    now = _round(a, now, answer=True)  # answered, but the period was late: no fall
    assert a.local_health == 1
    # the threshold scales too: at LHM 1 (timeout 1 s) a 0.4 s lateness is on time
    a.tick(now - 0.5, late_by_s=0.4 * PROBE_TIMEOUT_S * 2)
    assert a.local_health == 1
    _round(a, now, answer=True)
    assert a.local_health == 0


def test_refuting_a_suspicion_about_ourselves_raises_local_health():
    a = _mesh()
    a.receive(b"h1", Ping(1, 1, (Update(b"a", 1, SUSPECT, (), accuser_tag(b"h1")),)), 0.0)
    assert a.incarnation == 2 and a.local_health == 1
    a.receive(b"h2", Ping(2, 1, (Update(b"a", 1, SUSPECT, (), accuser_tag(b"h2")),)), 0.1)
    assert a.local_health == 1  # an old accusation, already refuted


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["answer", "silence", "late", "accused", "wait"]),
                          st.floats(0.0, 3.0)), max_size=40))
def test_local_health_stays_in_bounds_and_scales_the_period(ops):
    a = _mesh()
    now = 0.0
    for op, x in ops:
        lhm = a.local_health
        assert 0 <= lhm <= MAX_LHM
        assert a.probe_interval_s() == PROBE_INTERVAL_S * (lhm + 1)
        assert a.probe_timeout_s() == PROBE_TIMEOUT_S * (lhm + 1)
        assert a.next_deadline() <= a._next_probe_at
        if op == "accused":
            a.receive(b"h1", Ping(1, 0, (Update(b"a", a.incarnation, SUSPECT),)), now)
            assert a.local_health == min(MAX_LHM, lhm + 1)
            continue
        if op == "wait":  # a tick inside the period: the next probe is not moved
            due = a._next_probe_at
            now = min(now + x, due - 1e-6)
            a.tick(now)
            assert a._next_probe_at == due
            continue
        now = max(now, a._next_probe_at)  # the period ends: a new probe, a scaled period
        sends = a.tick(now, late_by_s=x if op == "late" else 0.0)
        assert a._next_probe_at == now + PROBE_INTERVAL_S * (a.local_health + 1)
        for s in sends:
            if op == "answer" and isinstance(s.message, Ping):
                a.receive(s.to, Ack(s.message.seq, 1, s.to), now + 0.01)


# --- wire, buddy system -------------------------------------------------------------------

tags = st.binary(min_size=mb.ACCUSER_TAG_BYTES, max_size=mb.ACCUSER_TAG_BYTES)


@given(st.lists(st.builds(Update, st.binary(min_size=1, max_size=64), st.integers(0, 2**53),
                          st.just(SUSPECT), st.just(()), tags), max_size=8))
def test_a_suspicion_s_accuser_tag_round_trips(ups):
    msg = Ping(1, 1, tuple(ups))
    assert decode_message(encode_message(msg)) == msg


def test_only_a_suspicion_names_an_accuser_and_only_as_a_tag():
    import cbor2
    import pytest
    for bad in ([b"p", 1, 0, [], b"\x01" * 8],       # an ALIVE claim with an accuser
                [b"p", 1, 1, [], b"\x01" * 7],       # a short tag
                [b"p", 1, 1, [], "tag-as-text"]):
        with pytest.raises(MembershipError):
            decode_message(cbor2.dumps([0, 1, 1, b"", [bad]]))
    u = decode_message(cbor2.dumps([0, 1, 1, b"", [[b"p", 1, 1, [], b"\x01" * 8]]])).updates[0]
    assert u.state == SUSPECT and u.suspector == b"\x01" * 8


def test_a_ping_to_a_suspect_carries_its_suspicion_first_buddy_system():
    a = _accused()
    for _ in range(60):  # fill the queue with other news, so the claim about t is not first
        a.receive(b"h2", Ping(9, 1, tuple(Update(bytes([7, i]), 1, ALIVE) for i in range(8))),
                  10.0)
    send = a.ping(b"t")
    first = send.message.updates[0]
    assert (first.peer, first.state) == (b"t", SUSPECT)
