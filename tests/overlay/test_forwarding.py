"""overlay/forwarding.py: the route executor's fallback, resume and error rules.

Sources here are frame producers written in the test (what a next hop or the local
engine would send); forwarding over real libp2p streams is covered by
tests/overlay/test_infer.py and the swarm tests."""

from __future__ import annotations

import collections

import pytest
import trio

from prefixmesh.inference.backend import SimulatedBackend
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_from_public_key
from prefixmesh.overlay.core.routing import Candidate, RouteContext
from prefixmesh.overlay.forwarding import (
    LOCAL,
    NOT_SERVING_TTL_S,
    HopFailed,
    Relay,
    RouteExecutor,
)
from prefixmesh.overlay.infer import InferSettings
from prefixmesh.overlay.serving import LocalServer

ME = peer_id_from_public_key(b"\x01" * 32)
PEER = peer_id_from_public_key(b"\x02" * 32)
PEER_C = peer_id_from_public_key(b"\x03" * 32)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _executor(clock=None, backend=None):
    clock = clock or _Clock()
    stats: collections.Counter = collections.Counter()
    events: list[tuple] = []
    answered: list[tuple] = []
    backend = backend or SimulatedBackend()
    ex = RouteExecutor(
        me=ME, host=None, heartbeat=None, server=LocalServer(backend, ME, clock),
        settings=InferSettings(), clock=clock, stats=stats,
        observe=lambda method, *a: events.append((method, *a)),
        on_answered=lambda *a: answered.append(a))
    return ex, stats, events, answered


def _source(*frames, fail: str | None = None):
    async def produce(out):
        for f in frames:
            await out.send(f)
        if fail is not None:
            raise HopFailed(fail)

    return produce


def _collect():
    sent: list[wire.Frame] = []

    async def emit(frame):
        sent.append(frame)

    return Relay(emit), sent


FINAL = wire.Final(id=b"r" * 16, entry=ME, serving=PEER, prompt_tokens=3, cached_tokens=0,
                   completion_tokens=2, ttft_ms=5.0, total_ms=9.0, finish_reason="stop",
                   hops=())


def test_pump_relays_tokens_then_final_and_end():
    ex, stats, _, _ = _executor()
    relay, sent = _collect()
    outcome = trio.run(ex.pump, relay, _source(wire.Tokens("he"), wire.Tokens("llo"), FINAL))
    assert outcome is None and relay.finished
    assert [type(f).__name__ for f in sent] == ["Tokens", "Tokens", "Final", "End"]
    assert relay.sent_text == "hello"


@pytest.mark.parametrize("code", sorted(["overloaded", "duplicate", "unknown_namespace"]))
def test_pump_returns_a_retryable_error_instead_of_relaying_it(code):
    ex, stats, _, _ = _executor()
    relay, sent = _collect()
    outcome = trio.run(ex.pump, relay, _source(wire.Error(code, "busy")))
    assert outcome.startswith(code) and not relay.finished and sent == []


def test_pump_relays_a_final_error():
    ex, stats, _, _ = _executor()
    relay, sent = _collect()
    outcome = trio.run(ex.pump, relay, _source(wire.Error("bad_request", "no")))
    assert outcome is None and relay.finished
    assert sent == [wire.Error("bad_request", "no")] and stats["errors"] == 1


def test_pump_reports_a_source_that_ends_without_final():
    ex, _, _, _ = _executor()
    relay, _ = _collect()
    assert trio.run(ex.pump, relay, _source(wire.Tokens("x"))) == "stream ended without FINAL"
    relay2, _ = _collect()
    assert trio.run(ex.pump, relay2, _source(fail="peer went down")) == "peer went down"


def test_a_failed_forward_falls_back_to_local_serving_and_records_the_hop():
    backend = SimulatedBackend()
    ex, stats, events, answered = _executor(backend=backend)
    relay, sent = _collect()
    req = wire.Request(id=b"r" * 16, ns=b"n" * 8, tokens=(1, 2, 3),
                       sampling=wire.Sampling(max_tokens=4), deadline=2000.0)
    ex.remote_source = lambda *a, **k: _source(wire.Error("overloaded", "full"))
    hop = wire.Hop(peer=ME, action="serve", reason="best")
    trio.run(ex.run, req, relay, 1000.0, [PEER, LOCAL], None, hop)
    final = next(f for f in sent if isinstance(f, wire.Final))
    assert final.serving == ME
    assert [h.action for h in final.hops] == ["fallback", "serve"]
    assert final.hops[-1].reason == "fallback: 1 forward(s) failed"
    assert stats["forwarded"] == 1 and stats["fallbacks"] == 1 and stats["served_local"] == 1
    assert ("forwarded", "forward", "best") in events
    assert answered == []  # served locally: nothing to spot-check
    assert relay.action == "fallback"


def test_every_target_failing_ends_with_no_route():
    ex, stats, _, _ = _executor()
    relay, sent = _collect()
    req = wire.Request(id=b"r" * 16, ns=b"n" * 8, tokens=(1,), deadline=2000.0)
    ex.remote_source = lambda *a, **k: _source(fail="open stream: refused")
    trio.run(ex.run, req, relay, 1000.0, [PEER, PEER_C], None,
             wire.Hop(peer=ME, action="serve", reason="x"))
    assert sent[-1].code == "no_route" and "open stream: refused" in sent[-1].message
    relay2, sent2 = _collect()
    trio.run(ex.run, req, relay2, 1000.0, [], None, wire.Hop(peer=ME, action="serve", reason="x"))
    assert sent2 == [wire.Error("no_route", "no node may serve this request")]


def _resume_case(temperature: float, replacement: str):
    ex, stats, _, _ = _executor()
    relay, sent = _collect()
    req = wire.Request(id=b"r" * 16, ns=b"n" * 8, tokens=(1,), deadline=2000.0,
                       sampling=wire.Sampling(temperature=temperature))
    sources = iter([_source(wire.Tokens("Hello "), fail="peer went down (heartbeat)"),
                    _source(wire.Tokens(replacement), FINAL)])
    ex.remote_source = lambda *a, **k: next(sources)
    trio.run(ex.run, req, relay, 1000.0, [PEER, PEER_C], None,
             wire.Hop(peer=ME, action="serve", reason="x"))
    return stats, sent


def test_a_greedy_request_resumes_and_the_requester_gets_the_text_once():
    stats, sent = _resume_case(0.0, "Hello world")
    assert "".join(f.text for f in sent if isinstance(f, wire.Tokens)) == "Hello world"
    assert isinstance(sent[-1], wire.End) and stats["resumed"] == 1


def test_a_resumed_source_that_diverges_is_upstream_failed():
    _, sent = _resume_case(0.0, "Goodbye")
    assert sent[-1].code == "upstream_failed" and "differs" in sent[-1].message


def test_a_sampled_request_is_not_resumed():
    _, sent = _resume_case(0.7, "Hello world")
    assert sent[-1].code == "upstream_failed" and "not resumable" in sent[-1].message


def test_not_serving_memory_expires():
    clock = _Clock()
    ex, _, _, _ = _executor(clock)
    ex.mark_not_serving(PEER, b"ns")
    assert ex.is_not_serving(PEER, b"ns") and not ex.is_not_serving(PEER, b"other")
    clock.now += NOT_SERVING_TTL_S
    assert not ex.is_not_serving(PEER, b"ns")


def test_patience_is_the_factor_times_the_estimate_within_floor_and_timeout():
    ex, _, _, _ = _executor()
    s = ex.settings
    assert ex.patience_s(None, None) == s.first_frame_timeout_s
    ctx = RouteContext(prompt_tokens=1000, local_matched_tokens=0, local_prefill_tps=100.0,
                       local_queue_wait_s=0.0, local_load=0.0, candidates=(), hop_budget=2,
                       visited=frozenset(), first_block=None)
    fast = Candidate(peer=PEER, matched_tokens=1000, prefill_tps=1e6, queue_wait_s=0.0,
                     load=0.0, rtt_s=0.001)
    slow = Candidate(peer=PEER, matched_tokens=0, prefill_tps=1.0, queue_wait_s=0.0,
                     load=0.0, rtt_s=0.001)
    assert ex.patience_s(ctx, fast) == s.first_frame_floor_s
    assert ex.patience_s(ctx, slow) == s.first_frame_timeout_s
