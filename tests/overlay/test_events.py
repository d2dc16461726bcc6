"""overlay/events.py: the observer fan-out delivers every event and contains observer bugs."""

from __future__ import annotations

import logging
import math

from prefixmesh.overlay.events import NullObserver, ObserverFanout, RequestDone


def _done(**kw) -> RequestDone:
    base = dict(
        request_id=b"\x01" * 16, entry=True, action="serve", reason="local cache",
        served_by=b"me", route=("me: serve (local cache)",), prompt_tokens=10,
        cached_tokens=8, completion_tokens=3, ttft_s=0.1, total_s=0.2,
    )
    base.update(kw)
    return RequestDone(**base)


class Recorder:
    def __init__(self):
        self.calls = []

    def request_started(self, request_id, entry):
        self.calls.append(("started", request_id, entry))

    def request_done(self, event):
        self.calls.append(("done", event))

    def forwarded(self, decision, reason):
        self.calls.append(("forwarded", decision, reason))

    def fallback(self, reason):
        self.calls.append(("fallback", reason))


class Broken(NullObserver):
    def request_done(self, event):
        raise RuntimeError("observer bug")


def test_fanout_calls_every_observer_in_order():
    a, b = Recorder(), Recorder()
    fan = ObserverFanout([a])
    fan.add(b)
    ev = _done()
    fan.request_started(ev.request_id, True)
    fan.forwarded("forward", "peer cache")
    fan.fallback("peer failed")
    fan.request_done(ev)
    expected = [
        ("started", ev.request_id, True), ("forwarded", "forward", "peer cache"),
        ("fallback", "peer failed"), ("done", ev),
    ]
    assert a.calls == expected and b.calls == expected


def test_a_failing_observer_never_fails_the_request_and_is_logged_once(caplog):
    rec = Recorder()
    fan = ObserverFanout([Broken(), rec])
    with caplog.at_level(logging.ERROR, logger="prefixmesh.overlay.events"):
        for _ in range(3):
            fan.request_done(_done(error="no_route", served_by=b"", ttft_s=math.nan))
    assert len(rec.calls) == 3  # the later observer still got every event
    assert sum("observer" in r.getMessage() for r in caplog.records) == 1


def test_null_observer_accepts_everything():
    obs = NullObserver()
    obs.request_started(b"x", False)
    obs.request_done(_done())
    obs.forwarded("forward", "r")
    obs.fallback("r")
