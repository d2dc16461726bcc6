"""Continuous batching (``batch_mode="throughput"``) with the REAL model: concurrent requests
share llama_decode batches, a request that arrives mid-stream joins, a prefix wanted by
several concurrent requests is computed once (cells shared with llama_memory_seq_cp),
max_tokens / cancellation / close work per request, and every answer says its mode.

Outputs are NOT compared for equality with the deterministic engine: batched kernels may
change a greedy continuation (measured in docs/bench/engine.md, section 5). What is
asserted of the tokens: each stays the same under the same batch composition (a rerun),
and the first token equals the deterministic engine's (the last prompt token's logits:
24 of 24 prompts agreed in the measurement)."""

from __future__ import annotations

import random
import time

import pytest
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.engine import Engine, EngineError, SamplingParams

P, S, K = 120, 8, 4
EIGHT = SamplingParams(max_tokens=8)


def make_engine(mode="throughput", **kw) -> Engine:
    kw.setdefault("ram_budget_bytes", 256 << 20)
    kw.setdefault("n_ctx", 1024)
    return Engine(model_path=default_model_path(), n_threads=TEST_THREADS, kv_dir=None,
                  disk_budget_bytes=0, batch_mode=mode, max_batch=4, **kw)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    prefix = [rng.randrange(100, 40000) for _ in range(P)]
    return [prefix + [rng.randrange(100, 40000) for _ in range(S + 1)] for _ in range(K)]


@pytest.fixture(scope="module")
def deterministic(prompts):
    eng = make_engine("deterministic", ram_budget_bytes=0)
    try:
        out = [eng.complete_tokens(p, params=EIGHT) for p in prompts]
    finally:
        eng.close(flush=False)
    assert all(c.stats.batch_mode == "deterministic" for c in out)
    assert all(c.stats.max_batch_seen == 1 for c in out)
    return [c.tokens for c in out]


@pytest.fixture(scope="module")
def eng():
    e = make_engine()
    yield e
    e.close(flush=False)


def test_concurrent_requests_share_batches_and_the_new_prefix_once(prompts, deterministic):
    e = make_engine(ram_budget_bytes=0)  # no store: whatever is shared comes from live cells
    try:
        handles = [e.submit_tokens(p, params=EIGHT) for p in prompts]
        done = [h.result(300) for h in handles]
    finally:
        e.close(flush=False)
    for c, want in zip(done, deterministic, strict=True):
        assert c.finish_reason == "length" and len(c.tokens) == 8
        assert c.stats.batch_mode == "throughput"
        assert c.stats.max_batch_seen >= 2  # decoded alongside the others
        assert c.tokens[0] == want[0]
    # the shared prefix was prefilled once: the others copied its cells
    followers = [c for c in done if c.stats.hit_tier == "live"]
    assert len(followers) == K - 1
    assert all(c.stats.cached_tokens == P for c in followers)
    assert sum(c.stats.prefill_tokens for c in done) == P + K * (S + 1)


def test_rerun_of_the_same_batch_gives_the_same_tokens(prompts):
    runs = []
    for _ in range(2):
        e = make_engine(ram_budget_bytes=0)
        try:
            # submitted together: the worker admits them at once into the same first batch
            handles = [e.submit_tokens(p, params=EIGHT) for p in prompts]
            runs.append([h.result(300).tokens for h in handles])
        finally:
            e.close(flush=False)
    assert runs[0] == runs[1]


def test_store_hits_and_snapshots_in_throughput_mode(eng, prompts):
    first = eng.complete_tokens(prompts[0], params=EIGHT)
    assert first.stats.snapshots_saved >= 1
    ns = eng.default_namespace
    assert eng.store.lookup_length(ns.id, prompts[0][:-1]) == (P + S, "ram")
    # the finished request's cells are still resident in its sequence: copied, not restored
    again = eng.complete_tokens(prompts[0], params=EIGHT)
    assert again.stats.hit_tier == "live" and again.stats.cached_tokens == P + S
    assert again.stats.restore_s == 0.0
    assert again.tokens[0] == first.tokens[0]


def test_resident_sequences_serve_later_requests_and_give_way():
    # no RAM tier: only resident cells can serve a returning prefix
    rng = random.Random(31)
    prefix = [rng.randrange(100, 40000) for _ in range(100)]
    e = make_engine(ram_budget_bytes=0, n_ctx=512)  # 4 sequences, 512 cells
    try:
        first = e.complete_tokens(prefix + [7, 8, 9], params=EIGHT)
        assert first.stats.hit_tier == "none"
        second = e.complete_tokens(prefix + [10, 11, 12], params=EIGHT)
        assert second.stats.hit_tier == "live" and second.stats.cached_tokens == 100
        # more unrelated prompts than sequences and than free cells, one after the other:
        # resident sequences are given up for them, every request completes
        others = [[rng.randrange(100, 40000) for _ in range(150)] for _ in range(6)]
        got = [e.complete_tokens(p, params=EIGHT) for p in others]
        assert all(g.finish_reason == "length" and len(g.tokens) == 8 for g in got)
        # the same prompts at once, while resident cells fill the context
        hs = [e.submit_tokens(p, params=EIGHT) for p in others]
        assert all(h.result(600).finish_reason == "length" for h in hs)
    finally:
        e.close(flush=False)


def test_cycled_prefixes_stay_resident_when_the_engine_keeps_several():
    # the resident-sequence bound raised (as bench_residents does): 3 prefixes cycled with
    # new suffixes each come back as live cells, because a finished request supersedes
    # the resident it copied its prefix from instead of crowding out the other prefixes
    rng = random.Random(43)
    prefixes = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(3)]
    e = make_engine(ram_budget_bytes=0, n_ctx=1024)
    e._resident_max = 3
    one = SamplingParams(max_tokens=1)
    try:
        for p in prefixes:
            assert e.complete_tokens(p + [7, 8, 9], params=one).stats.hit_tier == "none"
        for k in range(2):
            for p in prefixes:
                s = e.complete_tokens(p + [20 + k, 30 + k, 40 + k], params=one).stats
                assert s.hit_tier == "live" and s.cached_tokens == 40
        for _ in range(100):  # the last one becomes resident just after its result
            if len(e._idle) == 3:
                break
            time.sleep(0.05)
        assert len(e._idle) == 3
    finally:
        e.close(flush=False)


def test_long_prefill_is_capped_per_step_while_others_decode():
    rng = random.Random(41)
    e = make_engine(ram_budget_bytes=0, n_ctx=1024, n_batch=512)
    try:
        a = e.submit_tokens([rng.randrange(100, 40000) for _ in range(20)],
                            params=SamplingParams(max_tokens=60))
        it = iter(a)
        next(it)  # a is decoding
        b = e.submit_tokens([rng.randrange(100, 40000) for _ in range(400)], params=EIGHT)
        rb, ra = b.result(600), a.result(600)
    finally:
        e.close(flush=False)
    assert rb.finish_reason == "length" and ra.finish_reason == "length"
    # b's 400 prompt tokens went in several steps next to a's decode tokens
    assert 0 < e.batch_counters["max_prefill_while_decoding"] <= 128


def test_late_request_joins_a_running_decode(eng, prompts):
    long = SamplingParams(max_tokens=40)
    a = eng.submit_tokens(prompts[1], params=long)
    it = iter(a)
    next(it)  # a is decoding
    b = eng.submit_tokens(prompts[2], params=EIGHT)
    rb = b.result(300)
    ra = a.result(300)
    assert ra.finish_reason == "length" and len(ra.tokens) == 40
    assert rb.finish_reason == "length" and len(rb.tokens) == 8
    assert rb.stats.max_batch_seen >= 2 and ra.stats.max_batch_seen >= 2
    assert rb.stats.cached_tokens >= P  # from a's live cells or the stored prefix


def test_cancel_one_of_several(eng, prompts):
    long = SamplingParams(max_tokens=60)
    hs = [eng.submit_tokens(p, params=long) for p in prompts[:3]]
    it = iter(hs[1])
    next(it)
    hs[1].cancel()
    got = [h.result(300) for h in hs]
    assert got[1].finish_reason == "cancelled" and len(got[1].tokens) < 60
    assert [g.finish_reason for g in (got[0], got[2])] == ["length", "length"]
    assert len(got[0].tokens) == len(got[2].tokens) == 60
    # a cancelled queued request is dropped
    q = eng.submit_tokens(prompts[3], params=EIGHT)
    q.cancel()
    assert q.result(300).finish_reason in ("cancelled", "length")


def test_kv_cells_bound_admission(prompts):
    # 6 unrelated prompts of 70 tokens + 20 generated = 90 cells each in a 256-cell
    # context: two fit (180), three do not (270): at most two run at once, the rest wait
    # for cells, all complete
    rng = random.Random(8)
    e = make_engine(n_ctx=256, ram_budget_bytes=0)
    try:
        ps = [[rng.randrange(100, 40000) for _ in range(70)] for _ in range(6)]
        hs = [e.submit_tokens(p, params=SamplingParams(max_tokens=20)) for p in ps]
        got = [h.result(600) for h in hs]
    finally:
        e.close(flush=False)
    assert all(g.finish_reason == "length" and len(g.tokens) == 20 for g in got)
    assert max(g.stats.max_batch_seen for g in got) <= 2


def test_modes_never_share_states_and_close_cancels(prompts):
    det = make_engine("deterministic")
    thr = make_engine()
    try:
        assert det.state_fingerprint != thr.state_fingerprint
        hs = [thr.submit_tokens(p, params=SamplingParams(max_tokens=200)) for p in prompts[:2]]
        next(iter(hs[0]))
    finally:
        thr.close(flush=False)
        det.close(flush=False)
    assert all(h.result(60).finish_reason == "cancelled" for h in hs)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError):
        Engine(model_path=default_model_path(), batch_mode="fast")


def test_followers_survive_their_prefix_source_being_cancelled():
    # three requests wait for (or copy) the new prefix a fourth one is prefilling; that
    # one is cancelled: the others fall back to the store or a cold prefill and complete
    rng = random.Random(21)
    prefix = [rng.randrange(100, 40000) for _ in range(200)]
    ps = [prefix + [rng.randrange(100, 40000) for _ in range(5)] for _ in range(4)]
    e = make_engine(ram_budget_bytes=0, n_batch=64)  # the leader prefills in 4 steps
    try:
        lead = e.submit_tokens(ps[0], params=SamplingParams(max_tokens=100))
        rest = [e.submit_tokens(p, params=EIGHT) for p in ps[1:]]
        while e.batch_counters["steps"] < 2:  # the others are admitted and waiting
            time.sleep(0.005)
        lead.cancel()
        got = [h.result(300) for h in rest]
        assert lead.result(300).finish_reason == "cancelled"
    finally:
        e.close(flush=False)
    assert all(g.finish_reason == "length" and len(g.tokens) == 8 for g in got)
    assert all(g.stats.cached_tokens + g.stats.prefill_tokens == len(ps[1]) for g in got)


def test_cells_copied_from_a_finished_request_still_count_for_admission():
    # A runs; B copies A's 200-token prefix from A's sequence (shared cells); A ends, its
    # sequence stays resident; C (unrelated, 340 cells) arrives while B runs. Admitting C
    # means giving up A's resident sequence, but B still holds the shared cells: counted
    # per request, they were forgotten, C was let in, and llama_decode failed for B and C
    # at once. Counted by the cells themselves, C waits for B, and everything completes.
    rng = random.Random(11)
    prefix = [rng.randrange(100, 40000) for _ in range(200)]
    e = make_engine(n_ctx=512, ram_budget_bytes=0)
    try:
        a = e.submit_tokens(prefix + [rng.randrange(100, 40000) for _ in range(10)],
                            params=SamplingParams(max_tokens=60))
        next(iter(a))  # A is decoding: its prefix is computed
        b = e.submit_tokens(prefix + [rng.randrange(100, 40000) for _ in range(10)],
                            params=SamplingParams(max_tokens=120))
        a.result(600)
        c = e.submit_tokens([rng.randrange(100, 40000) for _ in range(300)],
                            params=SamplingParams(max_tokens=40))
        got = [h.result(600) for h in (a, b, c)]
    finally:
        e.close(flush=False)
    assert [g.finish_reason for g in got] == ["length"] * 3
    assert [len(g.tokens) for g in got] == [60, 120, 40]
    assert got[1].stats.hit_tier == "live"  # B did share A's cells
    assert got[2].stats.max_batch_seen == 1  # C ran after B, not beside it
    assert e.batch_counters["preempted"] == 0  # the estimate alone kept it safe


class _DecodeFindsNoRoom:
    """Test-only fault: ``llama_decode`` answers "no free KV cells" (its code 1, nothing
    applied) on the given calls; every other call goes to llama.cpp."""

    def __init__(self, lib, refused_calls) -> None:
        self._lib, self._refused, self.calls = lib, set(refused_calls), 0

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def llama_decode(self, ctx, batch):
        self.calls += 1
        return 1 if self.calls in self._refused else self._lib.llama_decode(ctx, batch)


def test_a_full_kv_cache_puts_a_request_that_produced_nothing_back_in_the_queue(prompts):
    e = make_engine()
    try:
        e._lib = _DecodeFindsNoRoom(e._lib, {1})  # the first step: all three prefilling
        hs = [e.submit_tokens(p, params=SamplingParams(max_tokens=12)) for p in prompts[:3]]
        got = [h.result(600) for h in hs]
    finally:
        e.close(flush=False)
    assert [g.finish_reason for g in got] == ["length"] * 3
    assert all(len(g.tokens) == 12 for g in got)
    assert e.batch_counters["preempted"] == 1


def test_a_full_kv_cache_with_every_request_streaming_ends_only_the_newest(prompts):
    e = make_engine()
    try:
        hs = []
        for p in prompts[:3]:  # admitted one after the other, each decoding before the next
            hs.append(e.submit_tokens(p, params=SamplingParams(max_tokens=40)))
            next(iter(hs[-1]))
        e._lib = _DecodeFindsNoRoom(e._lib, {2})
        outcomes = []
        for h in hs:
            try:
                outcomes.append(h.result(600).finish_reason)
            except EngineError as exc:
                outcomes.append(str(exc))
    finally:
        e.close(flush=False)
    assert outcomes[:2] == ["length", "length"]
    assert "KV cache is full" in outcomes[2] and "n_ctx" in outcomes[2]
    assert e.batch_counters["preempted"] == 0


def test_a_prefix_a_running_request_holds_is_copied_unless_the_store_has_much_more():
    # R1's body is stored; R2 runs, sharing 201 tokens with it. A newcomer sharing 203 with
    # the stored state copies R2's 201 cells (2 tokens to evaluate beat 203 new cells and a
    # restore); one sharing 230 restores the stored state
    rng = random.Random(21)
    new = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    prefix, body = new(200), new(40)
    e = make_engine()
    try:
        e.submit_tokens(prefix + body + new(2), params=SamplingParams(max_tokens=1)).result(600)
        e.submit_tokens(new(50), params=SamplingParams(max_tokens=1)).result(600)  # resident
        r2 = e.submit_tokens(prefix + body[:1] + new(5), params=SamplingParams(max_tokens=80))
        next(iter(r2))  # R2 is decoding
        near = e.submit_tokens(prefix + body[:3] + new(5), params=SamplingParams(max_tokens=4))
        far = e.submit_tokens(prefix + body[:30] + new(5), params=SamplingParams(max_tokens=4))
        got_near, got_far = near.result(600), far.result(600)
        assert r2.result(600).stats.hit_tier == "ram"
    finally:
        e.close(flush=False)
    assert (got_near.stats.hit_tier, got_near.stats.cached_tokens) == ("live", 201)
    assert (got_far.stats.hit_tier, got_far.stats.cached_tokens) == ("ram", 230)
