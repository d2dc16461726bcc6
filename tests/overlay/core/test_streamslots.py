"""Stream slots and whole-frame budgets (overlay/core/streamslots.py), against a model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.streamslots import (
    FRAME_BASE_S,
    FRAME_MAX_S,
    FRAME_MIN_RATE,
    StreamSlots,
    frame_budget_s,
)


def test_frame_budget_grows_with_the_announced_size_and_is_capped():
    assert frame_budget_s(0, 512 * 1024) == FRAME_BASE_S
    assert frame_budget_s(FRAME_MIN_RATE, 512 * 1024) == FRAME_BASE_S + 1
    assert frame_budget_s(None, 512 * 1024) == frame_budget_s(512 * 1024, 512 * 1024)
    assert frame_budget_s(10**9, 10**9) == FRAME_MAX_S
    assert frame_budget_s(10**9, 1024) == frame_budget_s(1024, 1024)  # clamped to the limit


@settings(max_examples=300, deadline=None)
@given(a=st.integers(0, 2**32 - 1), b=st.integers(0, 2**32 - 1))
def test_frame_budget_is_monotonic_and_bounded(a, b):
    lo, hi = sorted((a, b))
    limit = 8 * 1024 * 1024
    assert FRAME_BASE_S <= frame_budget_s(lo, limit) <= frame_budget_s(hi, limit) <= FRAME_MAX_S


ops = st.lists(st.tuples(st.sampled_from(["open", "complete", "close"]),
                         st.integers(0, 7), st.booleans(), st.integers(0, 30)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=ops, cap=st.integers(2, 12), per=st.integers(1, 6), data=st.data())
def test_budgets_hold_and_a_newcomer_is_admitted_while_any_slot_is_incomplete(ops, cap, per,
                                                                              data):
    per = min(per, cap)
    new_cap = data.draw(st.integers(1, cap))
    per_new = data.draw(st.integers(1, min(per, new_cap)))
    slots = StreamSlots(cap, per, per_new, new_cap)
    live = []  # slots we hold (the model)
    now = 0.0
    for op, peer_n, known, pick in ops:
        now += 1.0
        peer = bytes([peer_n])
        if op == "open":
            held = sum(1 for s in live if s.peer == peer)
            incomplete = [s for s in live if not s.complete]
            incomplete_new = [s for s in incomplete if not s.known]
            new_held = sum(1 for s in live if not s.known)
            adm = slots.open(peer, known, now)
            for victim in adm.shed:
                assert not victim.complete  # a request being served is never shed
                assert victim in live
                # the oldest incomplete one: of peers without history when there is one
                pool = incomplete_new if incomplete_new or not known else incomplete
                assert victim is min(pool or incomplete, key=lambda s: s.id)
                live.remove(victim)
            assert len(adm.shed) <= 1
            if adm.slot is not None:
                live.append(adm.slot)
            else:
                assert adm.refusal
                # refused only over its own cap, or with nothing incomplete to shed
                over_own = held >= (per if known else per_new)
                class_full = not known and new_held >= new_cap and not incomplete_new
                all_full = len(live) >= cap and not incomplete
                assert over_own or class_full or all_full, adm.refusal
        elif live:
            s = live[pick % len(live)]
            if op == "complete":
                slots.complete(s)
            else:
                slots.close(s)
                live.remove(s)
        assert len(slots) == len(live) <= cap
        assert sum(1 for s in live if not s.known) == slots.new_peer_slots <= new_cap
        for s in live:
            mine = sum(1 for x in live if x.peer == s.peer)
            assert mine == slots.held_by(s.peer)


def test_trickling_peers_cannot_lock_out_a_newcomer():
    """Issue 14, finding 2: identities x 64 streams that never complete (5 of them held
    160 slots, under the new-peer budget of 192; 8 fill it)."""
    slots = StreamSlots(256, 64, 32, 192)
    t = 0.0
    for attacker in range(8):
        for _ in range(64):
            t += 0.01
            slots.open(b"attacker%d" % attacker, False, t)
    assert slots.new_peer_slots == 192 and len(slots) == 192
    honest = slots.open(b"honest", False, t + 1)
    assert honest.slot is not None and honest.shed and honest.shed[0].peer.startswith(b"att")
    slots.complete(honest.slot)
    known = slots.open(b"mesh-peer", True, t + 2)  # a peer with history: the reserve
    assert known.slot is not None and not known.shed
    # the attackers' churn sheds only their own incomplete slots, never the honest one
    for i in range(1000):
        slots.open(b"attacker%d" % (i % 8), False, t + 3 + i)
    assert honest.slot.id in {s.id for s in slots._slots.values()}


def test_bad_parameters():
    with pytest.raises(ValueError):
        StreamSlots(4, 2, 3, 2)
    with pytest.raises(ValueError):
        StreamSlots(4, 5, 1, 2)
