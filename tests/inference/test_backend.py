"""inference/backend.py's LlamaBackend with the REAL model: every Completion says whether
it was decoded in a shared batch (the FINAL frame's ``batched``, which spot checks read),
and the backend says which mode its engine runs."""

from __future__ import annotations

import contextlib

import pytest
import trio
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.backend import Completion, GenerateRequest, LlamaBackend

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
