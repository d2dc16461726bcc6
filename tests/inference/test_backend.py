"""inference/backend.py's LlamaBackend with the REAL model: every Completion says whether
it was decoded in a shared batch (the FINAL frame's ``batched``, which spot checks read),
and the backend says which mode its engine runs."""

from __future__ import annotations

import contextlib

import pytest
import trio
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.backend import Completion, GenerateRequest, LlamaBackend
from prefixmesh.inference.engine import SamplingParams

NS = b"n" * 8


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_completions_say_whether_they_were_batched(mode):
    async def main():
        backend = LlamaBackend(model_path=default_model_path(), n_threads=TEST_THREADS,
                               kv_dir=None, disk_budget_bytes=0, n_ctx=512, batch_mode=mode)
        await backend.load()
        try:
            backend.register_namespace("t", b"k" * 32, NS)
            tokens = tuple(await backend.tokenize([("user", "Say hi.")]))
            req = GenerateRequest(ns=NS, tokens=tokens, max_tokens=2)
            async with contextlib.aclosing(backend.generate(req)) as events:
                done = [ev async for ev in events if isinstance(ev, Completion)]
            return backend.batched, done
        finally:
            await backend.aclose()

    batched, done = trio.run(main)
    assert batched == (mode == "throughput")
    assert len(done) == 1 and done[0].batched == (mode == "throughput")


def test_generate_streams_every_piece_in_order_and_a_stopped_consumer_cancels():
    """Pieces reach the trio loop straight from the engine's worker (no thread per token):
    all of them, in order, then the Completion; a consumer that stops early cancels the
    engine request, and the engine serves the next one."""
    async def main():
        backend = LlamaBackend(model_path=default_model_path(), n_threads=TEST_THREADS,
                               kv_dir=None, disk_budget_bytes=0, n_ctx=512)
        await backend.load()
        try:
            backend.register_namespace("t", b"k" * 32, NS)
            tokens = tuple(await backend.tokenize([("user", "Count from one to twenty.")]))
            assert await backend.tokenize_text("Hello world") == tuple(
                backend.engine.tokenize("Hello world"))
            want = backend.engine.complete_tokens(tokens, backend._namespaces[NS],
                                                  SamplingParams(max_tokens=12))
            req = GenerateRequest(ns=NS, tokens=tokens, max_tokens=12)
            async with contextlib.aclosing(backend.generate(req)) as events:
                got = [ev async for ev in events]
            long_req = GenerateRequest(ns=NS, tokens=tokens, max_tokens=400)
            async with contextlib.aclosing(backend.generate(long_req)) as events:
                async for _ in events:
                    break  # the client went away after the first piece
            with trio.fail_after(60):
                while backend.engine.load().active:
                    await trio.sleep(0.05)
            async with contextlib.aclosing(backend.generate(req)) as events:
                again = [ev async for ev in events]
            return want, got, again
        finally:
            await backend.aclose()

    want, got, again = trio.run(main)
    for events in (got, again):
        assert isinstance(events[-1], Completion)
        chunks = events[:-1]
        assert [t for c in chunks for t in c.token_ids] == want.tokens
        assert "".join(c.text for c in chunks) == want.text
        assert events[-1].completion_tokens == len(want.tokens)


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_the_first_chunk_says_the_cached_count_of_the_completion(mode):
    """The first TokenChunk carries the cached count the Completion later reports (decided
    before prefill), so a consumer that stops early still knows it; later chunks say
    nothing (-1). The second run of a prompt finds it cached."""
    async def main():
        backend = LlamaBackend(model_path=default_model_path(), n_threads=TEST_THREADS,
                               kv_dir=None, disk_budget_bytes=0, n_ctx=512, batch_mode=mode)
        await backend.load()
        try:
            backend.register_namespace("t", b"k" * 32, NS)
            text = "The lighthouse keeper counts the ships that pass at night. " * 6
            tokens = tuple(await backend.tokenize([("user", text)]))
            req = GenerateRequest(ns=NS, tokens=tokens, max_tokens=3)
            runs = []
            for _ in range(2):
                async with contextlib.aclosing(backend.generate(req)) as events:
                    runs.append([ev async for ev in events])
            return runs
        finally:
            await backend.aclose()

    runs = trio.run(main)
    for events in runs:
        done, chunks = events[-1], events[:-1]
        assert isinstance(done, Completion) and len(chunks) >= 2
        assert chunks[0].cached_tokens == done.cached_tokens
        assert all(c.cached_tokens == -1 for c in chunks[1:])
    assert runs[1][-1].cached_tokens > 0


def test_a_load_begun_early_is_the_load_that_load_waits_for():
    """The launcher's begin_load (node/launch.py): the engine is built in a thread while
    the caller does other work; load() then only waits for it, and an aclose() of a
    backend whose load was begun but never awaited closes what the thread built."""
    kw = dict(model_path=default_model_path(), n_threads=TEST_THREADS, kv_dir=None,
              disk_budget_bytes=0, n_ctx=512)

    async def main():
        backend = LlamaBackend(**kw)
        assert backend.load_began is None
        backend.begin_load()
        began, loader = backend.load_began, backend._loader
        backend.begin_load()  # idempotent: one load
        assert backend._loader is loader and backend.load_began == began
        await backend.load()
        assert backend.engine is not None and backend.context_tokens == 512
        await backend.aclose()
        assert backend.engine is None

        abandoned = LlamaBackend(**kw)  # begun, never awaited: a start that failed
        abandoned.begin_load()
        await abandoned.aclose()
        assert not abandoned._loader.is_alive() and abandoned.engine is None
        assert abandoned._built is None

    trio.run(main)


def test_an_early_load_that_fails_raises_in_load(tmp_path):
    from prefixmesh.inference.engine import ModelLoadError
    from prefixmesh.inference.model import read_gguf_info

    src = default_model_path()
    cut = tmp_path / "cut.gguf"  # a whole header (fingerprint readable), no weights
    with open(src, "rb") as f:
        cut.write_bytes(f.read(read_gguf_info(src).header_bytes + 1000))
    backend = LlamaBackend(model_path=cut, n_threads=TEST_THREADS, kv_dir=None,
                           disk_budget_bytes=0, n_ctx=512)
    backend.begin_load()
    with pytest.raises(ModelLoadError, match="could not load"):
        trio.run(backend.load)
    assert backend.engine is None
    trio.run(backend.aclose)  # nothing to close, nothing raised
