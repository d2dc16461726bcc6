"""Prefix-shared KV storage with the REAL model: prompts behind one shared prefix store it
once (segments on a branch point, the first prompt's state rebased onto it), and greedy
outputs through these chains, from RAM and from disk, equal cold runs token for token."""

from __future__ import annotations

import random

import pytest
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.engine import Engine, SamplingParams

P, S, K = 160, 16, 5
EIGHT = SamplingParams(max_tokens=8)


def make_engine(kv_dir, **kw) -> Engine:
    kw.setdefault("ram_budget_bytes", 256 << 20)
    kw.setdefault("disk_budget_bytes", 1 << 30 if kv_dir is not None else 0)
    return Engine(model_path=default_model_path(), n_ctx=512, n_threads=TEST_THREADS,
                  kv_dir=kv_dir, fsync=False, **kw)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    prefix = [rng.randrange(100, 40000) for _ in range(P)]
    # body = prefix + S suffix tokens; the last prompt token is evaluated on its own
    return [prefix + [rng.randrange(100, 40000) for _ in range(S + 1)] for _ in range(K)]


@pytest.fixture(scope="module")
def cold_outputs(prompts):
    cold = make_engine(None, ram_budget_bytes=0)
    try:
        return [cold.complete_tokens(p, params=EIGHT).tokens for p in prompts]
    finally:
        cold.close(flush=False)


def test_shared_prefix_is_stored_once_and_outputs_match_cold(tmp_path, prompts, cold_outputs):
    eng = make_engine(tmp_path)
    ns = eng.default_namespace
    try:
        first = eng.complete_tokens(prompts[0], params=EIGHT)
        per_token = eng.store.ram_used_bytes / (P + S)
        assert first.tokens == cold_outputs[0]
        for p, want in zip(prompts[1:], cold_outputs[1:], strict=True):
            c = eng.complete_tokens(p, params=EIGHT)
            assert c.stats.cached_tokens == P  # the shared prefix, restored
            assert c.tokens == want
        # the second prompt made the prefix a branch point and rebased the first onto it
        key = eng.store._key(ns.id, prompts[0][: P + S])
        assert eng.store._ram.get(key).payload.base == P
        ideal = (P + K * S) * per_token
        assert abs(eng.store.ram_used_bytes - ideal) <= 0.10 * ideal
        assert eng.store.wait_written()
        assert abs(eng.store.disk_used_bytes - ideal) <= 0.10 * ideal
        # each prompt again, now through its two-segment chain
        for p, want in zip(prompts, cold_outputs, strict=True):
            c = eng.complete_tokens(p, params=EIGHT)
            # the same prompt: all but its last 2 tokens (evaluated together) restored
            assert c.stats.hit_tier == "ram" and c.stats.cached_tokens == P + S - 1
            assert c.tokens == want
        eng.store._check_invariants()
    finally:
        eng.close()
    # after a restart the chains come from disk, file by file
    eng2 = make_engine(tmp_path)
    try:
        for p, want in zip(prompts, cold_outputs, strict=True):
            c = eng2.complete_tokens(p, params=EIGHT)
            assert c.stats.cached_tokens == P + S - 1 and c.tokens == want
        assert eng2.store.stats.hits_disk >= 1
        eng2.store._check_invariants()
    finally:
        eng2.close(flush=False)


def test_truncating_a_chain_inside_its_first_segment_matches_cold(tmp_path, prompts,
                                                                   cold_outputs):
    eng = make_engine(tmp_path)
    cold = make_engine(None, ram_budget_bytes=0)
    try:
        for p in prompts[:2]:
            eng.complete_tokens(p, params=EIGHT)
        # a prompt sharing only 100 tokens: served from the chain cut back inside the prefix
        rng = random.Random(5)
        q = prompts[0][:100] + [rng.randrange(100, 40000) for _ in range(30)]
        c = eng.complete_tokens(q, params=EIGHT)
        assert c.stats.cached_tokens == 100
        assert c.tokens == cold.complete_tokens(q, params=EIGHT).tokens
        # and the branch at 100 tokens is now shared by all three
        again = eng.complete_tokens(prompts[1], params=EIGHT)
        assert again.stats.cached_tokens == P + S - 1
        assert again.tokens == cold_outputs[1]
        eng.store._check_invariants()
    finally:
        eng.close(flush=False)
        cold.close(flush=False)


def test_live_sequence_serves_the_next_turn_without_a_restore(tmp_path, prompts, cold_outputs):
    eng = make_engine(tmp_path, live_sequence=True)
    cold = make_engine(None, ram_budget_bytes=0)
    try:
        c = eng.complete_tokens(prompts[0], params=EIGHT)
        # the same prompt again: it is still live in sequence 0 (the last 2 tokens are
        # evaluated again, together)
        again = eng.complete_tokens(prompts[0], params=EIGHT)
        assert again.stats.hit_tier == "live" and again.stats.cached_tokens == P + S - 1
        assert again.tokens == c.tokens == cold_outputs[0]
        # a next turn extending it: the whole previous prompt kept live, only the new
        # tokens evaluated (the answer's tokens were computed alone: evaluated again)
        turn = prompts[0] + c.tokens + prompts[1][P:]
        t = eng.complete_tokens(turn, params=EIGHT)
        assert t.stats.hit_tier == "live" and t.stats.cached_tokens == P + S + 1
        assert t.tokens == cold.complete_tokens(turn, params=EIGHT).tokens
        # another namespace never sees it
        other = eng.complete_tokens(prompts[0], eng.namespace("other"), EIGHT)
        assert other.stats.cached_tokens == 0 and other.tokens == cold_outputs[0]
        # a prompt that branches off makes a rebase, which takes the context: from the store
        b = eng.complete_tokens(prompts[1], eng.namespace("other"), EIGHT)
        assert b.stats.hit_tier == "live" and b.stats.cached_tokens == P
        assert b.tokens == cold_outputs[1]
        after = eng.complete_tokens(prompts[0], eng.namespace("other"), EIGHT)
        assert after.stats.hit_tier == "ram" and after.tokens == cold_outputs[0]
        eng.store._check_invariants()
    finally:
        eng.close(flush=False)
        cold.close(flush=False)


def test_quantized_kv_cache_keeps_restores_exact_and_never_mixes(tmp_path, prompts):
    """type_k=q8_0: outputs through chains equal cold runs with the same setting, and the
    states live apart from f16 ones (another fingerprint: another folder)."""
    f16 = make_engine(tmp_path)
    try:
        f16.complete_tokens(prompts[0], params=EIGHT)
    finally:
        f16.close()
    q8 = make_engine(tmp_path, type_k="q8_0")
    cold = make_engine(None, ram_budget_bytes=0, type_k="q8_0")
    try:
        assert q8.state_fingerprint != f16.state_fingerprint
        assert q8.store.prefixes() == []  # the f16 state is not offered to a q8_0 engine
        # each prompt's cold q8_0 output once (greedy: a second cold run is the same)
        cold_q8 = [cold.complete_tokens(p, params=EIGHT).tokens for p in prompts[:3]]
        for p, want in zip(prompts[:3] + prompts[:3], cold_q8 + cold_q8, strict=True):
            c = q8.complete_tokens(p, params=EIGHT)
            assert c.tokens == want
        assert c.stats.cached_tokens == P + S - 1
        q8.store._check_invariants()
    finally:
        q8.close(flush=False)
        cold.close(flush=False)
    with pytest.raises(ValueError, match="flash_attn"):
        make_engine(None, type_v="q8_0")


def test_short_extensions_are_evaluated_in_one_pass_and_match_cold(tmp_path, prompts):
    """A prompt extending a live or stored one by 1, 2 or 3 tokens: the rest (the last
    token included) is evaluated as one chunk of >= 2 tokens, never a token alone, and the
    greedy output equals a cold run."""
    eng = make_engine(tmp_path, live_sequence=True)
    cold = make_engine(None, ram_budget_bytes=0)
    try:
        base = prompts[2]
        eng.complete_tokens(base, params=EIGHT)
        for extra in ([5], [6, 7], [8, 9, 10]):
            # the cold output of q, once for both tiers (greedy: a second cold run is the same)
            want = cold.complete_tokens(base + extra, params=EIGHT).tokens
            for tier in ("live", "ram"):
                if tier == "ram":  # another namespace takes the context first
                    eng.complete_tokens(prompts[3], eng.namespace("x"), EIGHT)
                q = base + extra
                c = eng.complete_tokens(q, params=EIGHT)
                assert c.stats.hit_tier == tier, (extra, c.stats)
                assert c.stats.prefill_tokens >= 2
                # live: what q shares with the previous prompt (base + another extension);
                # ram: the body of q itself was stored by the live request before
                shared = len(base) if tier == "live" else len(q) - 1
                assert c.stats.cached_tokens == min(shared, len(q) - 2)
                assert c.tokens == want
    finally:
        eng.close(flush=False)
        cold.close(flush=False)
