"""Serving: one request run on this node's engine, as the frames of the infer protocol.

The route execution (``overlay/infer.py``) asks :class:`LocalServer` for a frame producer
when its plan's target is this node (``planner.LOCAL``); the engine re-matches the prompt
against its own radix tree, so what routing estimated never selects KV data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import trio

from prefixmesh.inference.backend import (
    Backend,
    BackendError,
    BackendInvalidRequest,
    BackendOverloaded,
    Completion,
    GenerateRequest,
    TokenChunk,
)

from .core import wire

__all__ = ["LocalServer"]


class LocalServer:
    """Runs requests on ``backend`` for peer ``me``; times on ``clock`` (the service's)."""

    def __init__(self, backend: Backend, me: bytes, clock: Callable[[], float]) -> None:
        self.backend = backend
        self.me = me
        self.clock = clock

    def source(self, req: wire.Request, t_recv: float, hops: list[wire.Hop], hop: wire.Hop):
        """A frame producer for ``RouteExecutor.pump`` (overlay/forwarding.py): runs ``req``
        on the engine and sends TOKENS frames, then FINAL (with ``hops`` + this node's
        ``hop``), or ERROR."""
        gen_req = GenerateRequest(
            ns=req.ns,
            tokens=req.tokens,
            max_tokens=req.sampling.max_tokens,
            temperature=req.sampling.temperature,
            top_p=req.sampling.top_p,
            seed=req.sampling.seed,
            deadline=req.deadline,
            grammar=req.grammar,
            logprobs=req.logprobs,
        )

        async def produce(out: trio.MemorySendChannel) -> None:
            ttft_ms = -1.0
            first = True  # the next TOKENS frame is the first
            held: list[str] = []  # stream=False: the text goes in one TOKENS frame
            held_lp: list[wire.TokenLogprob] = []  # ... and its logprobs (when asked for)
            try:
                async with contextlib.aclosing(self.backend.generate(gen_req)) as events:
                    async for ev in events:
                        if ttft_ms < 0:
                            ttft_ms = (self.clock() - t_recv) * 1000.0
                        if isinstance(ev, TokenChunk):
                            lp = _wire_logprobs(ev)
                            if not req.stream:
                                held.append(ev.text)
                                held_lp.extend(lp)
                                continue
                            frame = wire.Tokens(
                                ev.text[: wire.MAX_TEXT_CHARS],
                                tuple(ev.token_ids[: wire.MAX_CHUNK_TOKENS]),
                                lp,
                            )
                            if first:  # the counts, for an entry that stops before FINAL
                                first = False
                                frame = replace(frame, **_prompt_counts(req, ev))
                            await out.send(frame)
                        elif isinstance(ev, Completion):
                            for frame in _held_frames("".join(held), held_lp):
                                await out.send(frame)
                            trace = (*hops, replace(hop, ttft_ms=ttft_ms))[-wire.MAX_HOPS :]
                            await out.send(
                                wire.Final(
                                    id=req.id,
                                    entry=trace[0].peer,
                                    serving=self.me,
                                    prompt_tokens=min(ev.prompt_tokens, wire.MAX_PROMPT_TOKENS),
                                    cached_tokens=min(
                                        ev.cached_tokens, ev.prompt_tokens, wire.MAX_PROMPT_TOKENS
                                    ),
                                    completion_tokens=min(
                                        ev.completion_tokens, wire.MAX_MAX_TOKENS
                                    ),
                                    ttft_ms=ttft_ms,
                                    total_ms=(self.clock() - t_recv) * 1000.0,
                                    finish_reason=ev.finish_reason[: wire.MAX_SHORT_STRING],
                                    hops=trace,
                                    batched=ev.batched,
                                )
                            )
                            return
            except BackendOverloaded as exc:
                await out.send(wire.Error("overloaded", f"engine: {exc}"[:500]))
                return
            except BackendInvalidRequest as exc:
                await out.send(wire.Error("bad_request", f"engine: {exc}"[:500]))
                return
            except BackendError as exc:
                await out.send(wire.Error("internal", f"engine: {exc}"[:500]))
                return
            await out.send(wire.Error("internal", "engine ended without a completion"))

        return produce


def _prompt_counts(req: wire.Request, ev: TokenChunk) -> dict[str, int]:
    """The first TOKENS frame's prompt count (and cached count, when the engine said it
    on its first chunk), within the wire's bounds."""
    prompt = min(len(req.tokens), wire.MAX_PROMPT_TOKENS)
    if not prompt:
        return {}
    cached = ev.cached_tokens
    return {"prompt_tokens": prompt, "cached_tokens": min(cached, prompt) if cached >= 0 else -1}


def _wire_logprobs(ev: TokenChunk) -> tuple[wire.TokenLogprob, ...]:
    return tuple(
        wire.TokenLogprob(
            e.piece[: wire.MAX_PIECE_BYTES],
            max(e.logprob, wire.MIN_LOGPROB),
            tuple((b[: wire.MAX_PIECE_BYTES], max(lp, wire.MIN_LOGPROB))
                  for b, lp in e.top[: wire.MAX_TOP_LOGPROBS]),
        )
        for e in ev.logprobs
    )


def _held_frames(text: str, logprobs: list[wire.TokenLogprob]) -> list[wire.Tokens]:
    """A non-streamed answer as TOKENS frames: the text in MAX_TEXT_CHARS pieces, the
    logprobs in MAX_LOGPROB_ENTRIES pieces (the entry gateway joins them again)."""
    frames = [wire.Tokens(text[i : i + wire.MAX_TEXT_CHARS])
              for i in range(0, len(text), wire.MAX_TEXT_CHARS)]
    for i in range(0, len(logprobs), wire.MAX_LOGPROB_ENTRIES):
        frames.append(wire.Tokens("", (), tuple(logprobs[i : i + wire.MAX_LOGPROB_ENTRIES])))
    return frames
