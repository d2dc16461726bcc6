"""Replay memory (overlay/core/replay.py), against a brute-force model: an id is refused
as a replay exactly while it is remembered, remembered until its expiry, and memory never
exceeds the capacity (FULL instead of forgetting a live id)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.replay import FULL, NEW, REPLAY, ReplayWindow


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 6),
       ops=st.lists(st.tuples(st.integers(0, 8), st.floats(0, 50), st.floats(0, 5)),
                    max_size=60))
def test_matches_a_model(cap, ops):
    w = ReplayWindow(cap)
    model: dict[bytes, float] = {}
    now = 0.0
    for key_n, ttl, step in ops:
        now += step
        key = bytes([key_n])
        model = {k: e for k, e in model.items() if e >= now}
        got = w.admit(key, now + ttl, now)
        if key in model:
            assert got == REPLAY
        elif len(model) >= cap:
            assert got == FULL and key not in w
        else:
            assert got == NEW
            model[key] = now + ttl
        assert len(w) == len(model) <= cap


def test_remembered_until_the_deadline_however_many_came_after():
    w = ReplayWindow(100_000)
    assert w.admit(b"victim", 3600.0, 0.0) == NEW
    for i in range(20_000):  # far more than the old 8,192-id memory
        assert w.admit(i.to_bytes(4, "big"), 3600.0, 1.0) == NEW
    assert w.admit(b"victim", 3600.0, 3599.0) == REPLAY
    assert w.admit(b"victim", 7200.0, 3600.5) == NEW  # its deadline passed: a new request


def test_full_until_something_expires():
    w = ReplayWindow(2)
    assert w.admit(b"a", 10.0, 0.0) == NEW and w.admit(b"b", 20.0, 0.0) == NEW
    assert w.admit(b"c", 30.0, 5.0) == FULL
    assert w.admit(b"c", 30.0, 10.5) == NEW  # a expired
    with pytest.raises(ValueError):
        ReplayWindow(0)
