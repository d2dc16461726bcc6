"""Spot checks of batched answers on the real model: continuous batching is not
bit-identical to a single-sequence run, so a divergence at a near-tie is a drift; a FINAL
that says "batched" must not excuse a token the re-execution chose by a clear margin."""

from __future__ import annotations

import collections
import dataclasses
import random
import types

import pytest
import trio
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.backend import LlamaBackend
from prefixmesh.inference.bench_kvtype import chat_prompts
from prefixmesh.inference.engine import Engine, SamplingParams
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_from_public_key
from prefixmesh.overlay.core.trust import BATCHED_TIE_NATS, SpotChecker, TrustTracker
from prefixmesh.overlay.forwarding import Observed
from prefixmesh.overlay.spotcheck import SpotCheckRunner

pytestmark = pytest.mark.slow

PEER = peer_id_from_public_key(b"\x03" * 32)
NS = b"s" * 8
MAX_TOKENS = 32
PROMPTS = 16


class _Index:
    def __init__(self, model: bytes) -> None:
        self.model = model

    def estimate(self, peer: bytes):
        return types.SimpleNamespace(model=self.model)


def test_honest_batched_answers_drift_and_a_clear_wrong_token_is_a_mismatch():
    # the honest batched answers: one throughput-mode engine, every prompt submitted at once
    thr = Engine(model_path=default_model_path(), n_threads=TEST_THREADS, n_ctx=4096,
                 kv_dir=None, ram_budget_bytes=0, disk_budget_bytes=0,
                 batch_mode="throughput", max_batch=8, max_queue=64)
    try:
        prompts = [tuple(thr.render_chat(p).tokens) for p in chat_prompts(PROMPTS)]
        handles = [thr.submit_tokens(t, params=SamplingParams(max_tokens=MAX_TOKENS))
                   for t in prompts]
        batched = [h.result() for h in handles]
    finally:
        thr.close(flush=False)
    assert max(c.stats.max_batch_seen for c in batched) > 1

    def jobs(det):
        # the deterministic answer to prompt 0 with each token's lead over the runner-up
        handle = det.engine.submit_tokens(
            prompts[0], params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=2))
        pieces = list(handle)
        leads = [p.top[0][1] - p.top[1][1] for p in pieces]
        clear = next(i for i, lead in enumerate(leads) if lead > 2 * BATCHED_TIE_NATS)
        lie = [p.token for p in pieces]
        lie[clear] = (lie[clear] + 1) % det.vocab_size
        out = []
        for i, (tokens, c) in enumerate(zip(prompts, batched, strict=True)):
            req = _request(i, tokens)
            out.append((req, Observed([c.text], list(c.tokens), final=_final(req, True))))
        req = _request(PROMPTS, prompts[0])
        out.append((req, Observed(["x"], lie, final=_final(req, True))))
        return out, clear

    log, stats, clear = _spot_checked(jobs, n_ctx=2048)
    verdicts = {e["request_id"]: e for e in log}
    honest = [verdicts[_request(i, ()).id.hex()] for i in range(PROMPTS)]
    # batching changed some answers (measured: about half within 32 tokens), none is
    # judged a lie
    assert any(e["kind"] == "drift" for e in honest), [e["kind"] for e in honest]
    assert all(e["kind"] in ("match", "drift") for e in honest)
    lied = verdicts[_request(PROMPTS, ()).id.hex()]
    assert lied["kind"] == "mismatch" and lied["first_mismatch"] == clear
    assert stats["spot_mismatches"] == 1


def test_an_answer_that_goes_on_past_a_clear_end_is_a_mismatch():
    """A batched answer that continues where the re-execution chose to stop is judged by
    how clearly it stopped: past a clear end it is a mismatch (by tokens or, text only, by
    characters), past a near-tie a drift; the honest answer matches."""

    def jobs(det):
        ends = {}  # "clear" / "tie": (prompt, tokens, text) of a greedy answer the model ended
        for messages in chat_prompts(24):
            prompt = tuple(det.engine.render_chat(messages).tokens)
            c = det.engine.submit_tokens(
                prompt, params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=2)).result()
            if c.finish_reason != "stop":
                continue
            lead = c.end.top[0][1] - c.end.top[1][1]
            kind = ("clear" if lead > 2 * BATCHED_TIE_NATS
                    else "tie" if lead < BATCHED_TIE_NATS / 2 else None)
            if kind is not None:
                ends.setdefault(kind, (prompt, list(c.tokens), c.text))
            if len(ends) == 2:
                break
        more = det.engine.tokenize(" It is also known for much more.")
        out = []
        for i, (_, (prompt, tokens, text)) in enumerate(sorted(ends.items())):
            answers = ((tokens, [text], True), (tokens + more, [text], True),
                       ([], [text, " It is"], False))  # the same, text only
            for j, (ids, pieces, complete) in enumerate(answers):
                req = _request(10 * i + j, prompt)
                out.append((req, Observed(pieces, ids, ids_complete=complete,
                                          final=_final(req, True))))
        return out, {kind: (len(tokens), len(text)) for kind, (_, tokens, text) in ends.items()}

    log, _, ends = _spot_checked(jobs, n_ctx=2048)
    assert set(ends) == {"clear", "tie"}, ends
    verdicts = [(e["kind"], e["unit"], e["first_mismatch"])
                for e in sorted(log, key=lambda e: e["request_id"])]
    (clear_tokens, clear_chars), (tie_tokens, tie_chars) = ends["clear"], ends["tie"]
    assert verdicts == [("match", "token", None), ("mismatch", "token", clear_tokens),
                        ("mismatch", "char", clear_chars),
                        ("match", "token", None), ("drift", "token", tie_tokens),
                        ("drift", "char", tie_chars)], verdicts


def _spot_checked(jobs_of, n_ctx: int):
    """Spot-check what ``jobs_of(backend)`` returns, ``([(request, observed)], extra)``, on
    a deterministic node's real engine; the runner's log, its counters and ``extra``."""

    async def main():
        det = LlamaBackend(model_path=default_model_path(), n_threads=TEST_THREADS,
                           n_ctx=n_ctx, kv_dir=None, ram_budget_bytes=0, disk_budget_bytes=0)
        await det.load()
        try:
            det.register_namespace("t", b"k" * 32, NS)
            jobs, extra = jobs_of(det)
            stats: collections.Counter = collections.Counter()
            runner = SpotCheckRunner(
                checker=SpotChecker(rng=random.Random(0), fraction=1.0), backend=det,
                index=_Index(det.model_fingerprint), trust=TrustTracker(),
                clock=lambda: 100.0, stats=stats, max_pending=len(jobs), timeout_s=120.0)
            async with trio.open_nursery() as nursery:
                await nursery.start(runner.run)
                for req, observed in jobs:
                    runner.answered(PEER, req, observed)
                with trio.fail_after(300):
                    while stats["spot_checks"] < len(jobs):
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        finally:
            await det.aclose()
        return runner.log, stats, extra

    return trio.run(main)


def _request(i: int, tokens: tuple[int, ...]) -> wire.Request:
    return wire.Request(id=i.to_bytes(16, "big"), ns=NS, tokens=tokens,
                        sampling=wire.Sampling(max_tokens=MAX_TOKENS), deadline=1e12)


def _final(req: wire.Request, batched: bool) -> wire.Final:
    return wire.Final(id=req.id, entry=PEER, serving=PEER, prompt_tokens=len(req.tokens),
                      cached_tokens=0, completion_tokens=MAX_TOKENS, ttft_ms=1.0,
                      total_ms=2.0, finish_reason="length", hops=(), batched=batched)


def test_a_constrained_answer_is_re_executed_under_its_grammar():
    """A greedy request with an output constraint (response_format, a forced tool call)
    is re-executed under the same grammar: an honest peer's answer matches."""
    grammar = 'root ::= "yes" | "no" | "maybe"'

    def jobs(det):
        tokens = tuple(det.engine.render_chat(chat_prompts(1)[0]).tokens)
        handle = det.engine.submit_tokens(
            tokens, params=SamplingParams(max_tokens=8, grammar=grammar))
        honest = handle.result()
        assert honest.text in ("yes", "no", "maybe")
        req = dataclasses.replace(_request(0, tokens), grammar=grammar)
        return [(req, Observed([honest.text], list(honest.tokens),
                               final=_final(req, batched=False)))], None

    log, _, _ = _spot_checked(jobs, n_ctx=1024)
    assert [e["kind"] for e in log] == ["match"], log
