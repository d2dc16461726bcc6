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


# --- room for inbound newcomers (inbound_victim) ---------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefixmesh.overlay.core.admission import (  # noqa: E402
    INBOUND_HEADROOM,
    INBOUND_LIMIT,
    InboundConn,
    inbound_victim,
)

FULL = INBOUND_LIMIT - INBOUND_HEADROOM


def _conns(n: int, **kw) -> list[InboundConn]:
    return [InboundConn(bytes([i % 256, i // 256]), kw.get("known", False),
                        kw.get("streams", 0), float(i)) for i in range(n)]


def test_below_the_threshold_nobody_is_closed():
    assert inbound_victim(_conns(FULL - 1), b"new") is None


def test_at_the_threshold_the_oldest_idle_stranger_goes():
    conns = _conns(FULL)
    busy_old = InboundConn(b"busy", False, 3, -10.0)
    known_old = InboundConn(b"known", True, 0, -20.0)
    assert inbound_victim([busy_old, known_old, *conns], b"new") == conns[0].peer
    # only busy strangers left: the oldest busy one
    assert inbound_victim([busy_old, *_conns(FULL, streams=1)], b"new") == b"busy"
    # known peers and the newcomer itself are never chosen
    assert inbound_victim(_conns(FULL, known=True), b"new") is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.floats(0, 1e6)),
                min_size=FULL, max_size=FULL + 20))
def test_the_victim_is_never_known_and_never_the_newcomer(rows):
    conns = [InboundConn(i.to_bytes(2, "big"), k, s, t) for i, (k, s, t) in enumerate(rows)]
    newcomer = conns[-1].peer
    v = inbound_victim(conns, newcomer)
    strangers = [c for c in conns if not c.known and c.peer != newcomer]
    if not strangers:
        assert v is None
    else:
        chosen = next(c for c in conns if c.peer == v)
        assert not chosen.known and v != newcomer
        assert (chosen.streams > 0, chosen.since) == min((c.streams > 0, c.since)
                                                         for c in strangers)
