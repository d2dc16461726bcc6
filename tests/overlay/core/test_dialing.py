"""DialGate and give_up (overlay/core/dialing.py): the dial limits hold for any sequence of
dial requests (hypothesis), and a flood of peers naming the same addresses is bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import dialing
from prefixmesh.overlay.core.dialing import DialGate, give_up

ADDRS = [f"/ip4/10.0.{i // 4}.{i}/tcp/4001" for i in range(12)]

steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=5.0),  # time step
        st.lists(st.sampled_from(ADDRS), min_size=0, max_size=8),  # addrs of the dial
        st.booleans(),  # does the dial end now?
        st.booleans(),  # did it connect?
    ),
    max_size=150,
)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_limits_hold_for_any_sequence(seq):
    gate = DialGate()
    now = 0.0
    open_tickets = []
    per_addr: dict[str, list[float]] = {}
    total: list[float] = []
    refunded: set[str] = set()
    for dt, addrs, end, ok in seq:
        now += dt
        ticket = gate.admit(addrs, now)
        if ticket is not None:
            assert 1 <= len(ticket.addrs) <= dialing.MAX_ADDRS_PER_DIAL
            assert set(ticket.addrs) <= set(addrs)
            total.append(now)
            for a in ticket.addrs:
                per_addr.setdefault(a, []).append(now)
            open_tickets.append(ticket)
        assert gate.in_flight == len(open_tickets) <= dialing.MAX_CONCURRENT_DIALS
        if end and open_tickets:
            t = open_tickets.pop(0)
            gate.done(t, ok)
            if ok:
                refunded.update(t.addrs)
    # global bucket: any window [t0, t1] holds at most burst + rate * (t1 - t0) dials
    for i, t0 in enumerate(total):
        for j in range(i, len(total)):
            assert j - i + 1 <= dialing.DIAL_BURST + dialing.DIAL_RATE_PER_S * (total[j] - t0) + 1e-6
    for a, times in per_addr.items():
        if a in refunded:
            continue  # a connected dial gives its tokens back (documented)
        for i, t0 in enumerate(times):
            for j in range(i, len(times)):
                bound = dialing.ADDR_BURST + dialing.ADDR_RATE_PER_S * (times[j] - t0)
                assert j - i + 1 <= bound + 1e-6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(ADDRS), min_size=1, max_size=8))
def test_a_refused_dial_charges_nothing(addrs):
    gate = DialGate(max_in_flight=1)
    first = gate.admit(addrs, 0.0)
    assert first is not None
    before = gate.retry_after_s(addrs, 0.0)
    for _ in range(50):
        assert gate.admit(addrs, 0.0) is None  # one in flight already
    assert gate.retry_after_s(addrs, 0.0) == before


def test_a_flood_naming_the_same_addresses_is_bounded_per_minute():
    """Finding 1: 1,100 identities, each naming the same 8 foreign addresses, dialled as
    fast as the gate allows for a minute: attempts at those addresses stay under the
    per-address bound (ADDR_BURST + 60 s x ADDR_RATE_PER_S each)."""
    foreign = [f"/ip4/127.0.0.{i}/tcp/4001" for i in range(2, 10)]
    gate = DialGate()
    attempts = 0
    t = 0.0
    while t < 60.0:
        for _ in range(20):  # many monitors knocking at once
            ticket = gate.admit(foreign, t)
            if ticket is not None:
                attempts += len(ticket.addrs)
                gate.done(ticket, ok=False)
        t += 0.1
    bound = len(foreign) * (dialing.ADDR_BURST + 60 * dialing.ADDR_RATE_PER_S)
    assert 0 < attempts <= bound


def test_give_up_ends_never_answered_peers_and_long_down_ones():
    n = dialing.NEVER_UP_ATTEMPTS
    assert not give_up(ever_up=False, failed_attempts=n - 1, down_for_s=None, forget_after_s=300)
    assert give_up(ever_up=False, failed_attempts=n, down_for_s=None, forget_after_s=300)
    assert not give_up(ever_up=True, failed_attempts=99, down_for_s=299.0, forget_after_s=300)
    assert give_up(ever_up=True, failed_attempts=0, down_for_s=301.0, forget_after_s=300)
    assert not give_up(ever_up=True, failed_attempts=0, down_for_s=None, forget_after_s=300)


def test_saturated_means_no_address_has_a_token():
    gate = DialGate(max_in_flight=100)
    addrs = ["/ip4/10.9.9.9/tcp/1"]
    assert not gate.saturated(addrs, 0.0)
    for _ in range(int(dialing.ADDR_BURST)):
        t = gate.admit(addrs, 0.0)
        assert t is not None
        gate.done(t, ok=False)
    assert gate.saturated(addrs, 0.0) and gate.admit(addrs, 0.0) is None
    assert not gate.saturated(addrs + ["/ip4/10.9.9.8/tcp/1"], 0.0)
    assert not gate.saturated(addrs, 1.0 / dialing.ADDR_RATE_PER_S)  # refilled
