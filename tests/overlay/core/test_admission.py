"""MeritTable (overlay/core/admission.py): subnet counts stay exact, and victim() names the
least valuable entry, and only one the newcomer is worth at least as much as (hypothesis,
against a brute-force model)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.admission import Merit, MeritTable

merits = st.builds(Merit, st.integers(0, 2), st.sampled_from([None, "a", "b", "c"]),
                   st.floats(0, 100, allow_nan=False))
ops = st.lists(st.tuples(st.integers(0, 9), st.one_of(st.none(), merits)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, merits, st.sampled_from([None, "a", "b"]))
def test_merit_table_against_a_model(steps, newcomer, subnet):
    t = MeritTable(max_per_subnet=3)
    model: dict[int, Merit] = {}
    for key, m in steps:
        if m is None:
            t.remove(key)
            model.pop(key, None)
        else:
            t.put(key, m)
            model[key] = m
        counts = Counter(v.subnet for v in model.values() if v.subnet is not None)
        assert t.per_subnet == counts
        assert len(t) == len(model)
    counts = Counter(v.subnet for v in model.values() if v.subnet is not None)

    def value(m: Merit):
        return (m.merit, -(counts[m.subnet] if m.subnet else 0), m.since)

    pool = {k: m for k, m in model.items() if subnet is None or m.subnet == subnet}
    got = t.victim(newcomer, subnet=subnet)
    mine = (newcomer.merit, -(counts[newcomer.subnet] if newcomer.subnet else 0),
            newcomer.since)
    if not pool or min(value(m) for m in pool.values()) > mine:
        assert got is None
    else:
        assert got in pool and value(pool[got]) == min(value(m) for m in pool.values())
        assert mine >= value(pool[got])
    assert t.subnet_full(subnet) == (subnet is not None and counts[subnet] >= 3)
