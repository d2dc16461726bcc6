"""node/turnstats.py: what a client learned about one answer, and its JSON form (what
``prefixmesh ask --json`` prints as ``stats``): every field, the route as a list, and an
unmeasured time (NaN) as null, never as a non-JSON ``NaN``."""

from __future__ import annotations

import dataclasses
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.node.turnstats import TurnStats


def test_defaults_are_an_unmeasured_answer_served_by_the_entry_node():
    s = TurnStats(served_by="12D3KooWA")
    assert (s.hops, s.prompt_tokens, s.cached_tokens, s.completion_tokens) == (0, 0, 0, 0)
    assert math.isnan(s.ttft_s) and math.isnan(s.total_s) and s.route == ()
    d = s.to_json()
    assert d["ttft_s"] is None and d["total_s"] is None and d["route"] == []
    json.dumps(d, allow_nan=False)  # strict JSON


def test_to_json_carries_every_field():
    s = TurnStats(served_by="B", entry="A", hops=1, prompt_tokens=540, cached_tokens=512,
                  completion_tokens=32, ttft_s=0.25, total_s=1.5, finish_reason="length",
                  route=("A: forward (prefix_hit)", "B: serve (local)"), batched=True)
    d = s.to_json()
    assert set(d) == {f.name for f in dataclasses.fields(TurnStats)}
    assert d == {"served_by": "B", "entry": "A", "hops": 1, "prompt_tokens": 540,
                 "cached_tokens": 512, "completion_tokens": 32, "ttft_s": 0.25,
                 "total_s": 1.5, "finish_reason": "length",
                 "route": ["A: forward (prefix_hit)", "B: serve (local)"], "batched": True}


def test_stats_are_immutable():
    s = TurnStats(served_by="B")
    try:
        s.hops = 3  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("TurnStats is frozen")


@settings(max_examples=50)
@given(ttft=st.floats(allow_nan=True, allow_infinity=True),
       total=st.floats(allow_nan=True, allow_infinity=True),
       route=st.lists(st.text(max_size=20), max_size=4))
def test_to_json_is_always_strict_json_and_keeps_finite_times(ttft, total, route):
    d = TurnStats(served_by="B", ttft_s=ttft, total_s=total, route=tuple(route)).to_json()
    back = json.loads(json.dumps(d, allow_nan=False))
    for key, value in (("ttft_s", ttft), ("total_s", total)):
        assert back[key] == (value if math.isfinite(value) else None)
    assert back["route"] == route
