"""overlay/serving.py: LocalServer turns one engine run into the infer protocol's frames.

Against the deterministic SimulatedBackend: a streamed answer is one TOKENS frame per
chunk (the first with the prompt counts) then FINAL with the route and the times on the
service's clock; a non-streamed one holds the same text back for one frame. Against
engines written here (what a real engine may yield or raise): long held answers and
logprobs split and clamped to the wire's bounds, the route trace capped, and each engine
error mapped to its ERROR code. (Routing to LocalServer: tests/overlay/test_forwarding.py.)"""

from __future__ import annotations

import trio

from prefixmesh.inference.backend import (
    BackendError,
    BackendInvalidRequest,
    BackendOverloaded,
    Completion,
    SimulatedBackend,
    TokenChunk,
)
from prefixmesh.inference.backend import TokenLogprob as EngineLogprob
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_from_public_key
from prefixmesh.overlay.serving import LocalServer

ME = peer_id_from_public_key(b"\x01" * 32)
ENTRY = peer_id_from_public_key(b"\x02" * 32)
NS = b"n" * 8
T_RECV = 100.0


class Clock:
    """The service's clock: each read returns the next of ``times``."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]


class ScriptedEngine:
    """An engine that yields ``events`` in order, then raises ``error`` if given."""

    model_fingerprint = b"scripted"

    def __init__(self, *events, error: Exception | None = None) -> None:
        self.events, self.error = events, error

    async def generate(self, request):
        for ev in self.events:
            yield ev
        if self.error is not None:
            raise self.error


def _request(tokens=(1, 2, 3, 4), *, stream=True, max_tokens=5, **kw) -> wire.Request:
    return wire.Request(id=b"r" * 16, ns=NS, tokens=tuple(tokens), stream=stream,
                        sampling=wire.Sampling(max_tokens=max_tokens), deadline=1e12, **kw)


def _serve(backend, req, hops=(), clock=None) -> list:
    """Every frame LocalServer's producer sends for ``req``."""
    server = LocalServer(backend, ME, clock or Clock(T_RECV + 0.25, T_RECV + 1.0))
    hop = wire.Hop(ME, "serve", "local")
    produce = server.source(req, T_RECV, list(hops), hop)
    frames: list = []

    async def main():
        send, recv = trio.open_memory_channel(1000)
        async with send:
            await produce(send)
        async with recv:
            frames.extend([f async for f in recv])

    trio.run(main)
    return frames


def test_a_streamed_answer_is_tokens_frames_then_final_with_the_route_and_times():
    req = _request(max_tokens=5)
    frames = _serve(SimulatedBackend(), req, hops=[wire.Hop(ENTRY, "forward", "prefix_hit")])
    tokens, final = frames[:-1], frames[-1]
    assert len(tokens) == 5 and all(isinstance(f, wire.Tokens) for f in tokens)
    assert all(f.text and len(f.token_ids) == 1 for f in tokens)
    # the first frame says the prompt counts (nothing cached yet); the others do not
    assert (tokens[0].prompt_tokens, tokens[0].cached_tokens) == (4, 0)
    assert all((f.prompt_tokens, f.cached_tokens) == (0, -1) for f in tokens[1:])
    assert isinstance(final, wire.Final)
    assert (final.id, final.entry, final.serving) == (req.id, ENTRY, ME)
    assert (final.prompt_tokens, final.cached_tokens, final.completion_tokens) == (4, 0, 5)
    assert (final.ttft_ms, final.total_ms) == (250.0, 1000.0)
    assert final.finish_reason == "length"
    assert [(h.peer, h.action) for h in final.hops] == [(ENTRY, "forward"), (ME, "serve")]
    assert final.hops[-1].ttft_ms == 250.0  # this node's hop carries its TTFT


def test_the_second_run_of_a_prompt_reports_its_cached_tokens():
    backend = SimulatedBackend()
    _serve(backend, _request())
    frames = _serve(backend, _request())
    assert frames[0].cached_tokens == frames[-1].cached_tokens > 0
    assert frames[-1].cached_tokens <= frames[-1].prompt_tokens


def test_a_non_streamed_answer_holds_the_same_text_for_one_frame():
    streamed = _serve(SimulatedBackend(), _request(max_tokens=6))
    held = _serve(SimulatedBackend(), _request(max_tokens=6, stream=False))
    assert [type(f).__name__ for f in held] == ["Tokens", "Final"]
    assert held[0].text == "".join(f.text for f in streamed[:-1])
    assert held[1].completion_tokens == 6


def test_a_long_held_answer_and_its_logprobs_are_split_to_the_wire_bounds():
    big = "x" * (wire.MAX_TEXT_CHARS + 10)
    lps = tuple(EngineLogprob(b"x", -0.5) for _ in range(wire.MAX_LOGPROB_ENTRIES + 1))
    engine = ScriptedEngine(TokenChunk(big, (7,), lps),
                            Completion(4, 0, 1, 0.1, 0.2, "stop"))
    frames = _serve(engine, _request(stream=False, logprobs=0))
    texts = [f for f in frames[:-1] if f.text]
    assert [len(f.text) for f in texts] == [wire.MAX_TEXT_CHARS, 10]
    lp_frames = [f for f in frames[:-1] if f.logprobs]
    assert [len(f.logprobs) for f in lp_frames] == [wire.MAX_LOGPROB_ENTRIES, 1]
    assert isinstance(frames[-1], wire.Final) and frames[-1].finish_reason == "stop"


def test_logprobs_and_chunks_are_clamped_to_the_wire_bounds():
    entry = EngineLogprob(b"p" * (wire.MAX_PIECE_BYTES + 5), -1e9,
                          tuple((b"t", -float(i)) for i in range(wire.MAX_TOP_LOGPROBS + 3)))
    ids = tuple(range(wire.MAX_CHUNK_TOKENS + 7))
    engine = ScriptedEngine(TokenChunk("a", ids, (entry,), cached_tokens=99),
                            Completion(4, 99, 1, 0.1, 0.2, "stop"))
    tokens, final = _serve(engine, _request(logprobs=wire.MAX_TOP_LOGPROBS))
    (lp,) = tokens.logprobs
    assert len(lp.piece) == wire.MAX_PIECE_BYTES and lp.logprob == wire.MIN_LOGPROB
    assert len(lp.top) == wire.MAX_TOP_LOGPROBS
    assert len(tokens.token_ids) == wire.MAX_CHUNK_TOKENS
    # an engine claiming more cached tokens than the prompt has is held to the prompt
    assert tokens.cached_tokens == 4 and final.cached_tokens == 4


def test_the_route_trace_keeps_the_last_max_hops():
    hops = [wire.Hop(ENTRY, "forward", f"h{i}") for i in range(wire.MAX_HOPS + 3)]
    final = _serve(SimulatedBackend(), _request(max_tokens=1), hops=hops)[-1]
    assert len(final.hops) == wire.MAX_HOPS and final.hops[-1].peer == ME
    assert final.hops[0].reason == f"h{4}"


def test_engine_errors_become_error_frames_with_their_codes():
    cases = [(BackendOverloaded("queue full"), "overloaded"),
             (BackendInvalidRequest("prompt too long"), "bad_request"),
             (BackendError("llama failed"), "internal")]
    for exc, code in cases:
        frames = _serve(ScriptedEngine(TokenChunk("a", (1,)), error=exc), _request())
        assert isinstance(frames[-1], wire.Error), frames
        assert frames[-1].code == code and str(exc) in frames[-1].message


def test_an_engine_that_ends_without_a_completion_is_an_internal_error():
    frames = _serve(ScriptedEngine(TokenChunk("a", (1,))), _request())
    assert frames[-1] == wire.Error("internal", "engine ended without a completion")
