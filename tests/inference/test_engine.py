"""The engine with the REAL default model (SmolLM2-135M-Instruct Q4_1).

Correctness is judged against a cold run in a separate engine that caches nothing: greedy
outputs through every restore path (RAM, disk, a longer entry truncated, after a restart)
must be token-for-token identical. Prompts are short and n_ctx small to keep this fast.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.core.blocks import chain_hashes
from prefixmesh.inference.engine import (
    CacheEvent,
    ContextOverflowError,
    EmptyPromptError,
    Engine,
    EngineBusy,
    EngineClosed,
    InvalidRequestError,
    ModelLoadError,
    SamplingParams,
    UnknownRoleError,
)
from prefixmesh.inference.kvstore import encode_state_file

N_CTX = 512
GREEDY = SamplingParams(max_tokens=12)
# where only the cache's behaviour is checked, not the output (the default is 128 tokens)
SHORT = SamplingParams(max_tokens=4)


def make_engine(kv_dir, **kw) -> Engine:
    kw.setdefault("ram_budget_bytes", 256 << 20)
    kw.setdefault("disk_budget_bytes", 1 << 30)
    return Engine(model_path=default_model_path(), n_ctx=N_CTX, n_threads=TEST_THREADS,
                  kv_dir=kv_dir, fsync=False, **kw)


@pytest.fixture(scope="module")
def cold():
    """An engine that caches nothing: every request is a cold run."""
    eng = make_engine(None, ram_budget_bytes=0, disk_budget_bytes=0)
    yield eng
    eng.close(flush=False)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = make_engine(tmp_path_factory.mktemp("kv"))
    yield e
    e.close(flush=False)


_cold_memo: dict = {}


def cold_tokens(cold, messages, params=GREEDY) -> list[int]:
    key = (repr(messages), params)
    if key not in _cold_memo:
        c = cold.chat(messages, params=params)
        assert c.stats.cached_tokens == 0 and c.stats.hit_tier == "none"
        _cold_memo[key] = c.tokens
    return _cold_memo[key]


SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
PROMPTS = [
    [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "Name a primary color."}],
    [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "What do bees make?"}],
    [{"role": "user", "content": "Give me a synonym for big."}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Greet me."}],
    [SYSTEM, {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "What is the largest ocean?"}],
    [{"role": "user", "content": "Complete: the quick brown fox"}],
    [SYSTEM, {"role": "user", "content": "Translate 'cat' to French."}],
]


def test_prompts_ram_path_matches_cold(eng, cold):
    ns = eng.namespace("ram-path")
    for msgs in PROMPTS:
        want = cold_tokens(cold, msgs)
        first = eng.chat(msgs, ns, GREEDY)
        assert first.tokens == want
        second = eng.chat(msgs, ns, GREEDY)
        n = len(eng.render_chat(msgs).tokens)
        assert second.stats.hit_tier == "ram"
        # the batch discipline evaluates the last 2 prompt tokens together
        assert second.stats.cached_tokens == n - 2
        assert second.stats.prefill_tokens == 2
        assert second.tokens == want
        assert first.stats.prompt_tokens == n


def test_prompts_disk_path_matches_cold(eng, cold):
    ns = eng.namespace("disk-path")
    for msgs in PROMPTS:
        eng.chat(msgs, ns, GREEDY)
    ram_budget = eng.store.stats.ram_budget_bytes
    eng.store.set_budgets(ram_bytes=0)  # demote everything to disk
    try:
        assert eng.store.stats.ram_entries == 0
        for msgs in PROMPTS:
            eng.store.set_budgets(ram_bytes=0)  # the previous hit was promoted: drop it again
            c = eng.chat(msgs, ns, GREEDY)
            assert c.stats.hit_tier == "disk"
            assert c.stats.cached_tokens == len(eng.render_chat(msgs).tokens) - 2
            assert c.tokens == cold_tokens(cold, msgs)
    finally:
        eng.store.set_budgets(ram_bytes=ram_budget)


def test_truncated_longer_entry_matches_cold(eng, cold):
    ns = eng.namespace("truncate")
    long_q = [SYSTEM, {"role": "user", "content": "Describe the moon in detail, please."}]
    eng.chat(long_q, ns, GREEDY)
    for question in ["Describe the sun.", "Describe the moon briefly."]:
        msgs = [SYSTEM, {"role": "user", "content": question}]
        toks = eng.render_chat(msgs).tokens
        long_toks = eng.render_chat(long_q).tokens
        common = next(i for i, (a, b) in enumerate(zip(toks, long_toks, strict=False)) if a != b)
        c = eng.chat(msgs, ns, GREEDY)
        # restored from the longer entry, cut back to the common prefix
        assert c.stats.hit_tier == "ram"
        assert c.stats.cached_tokens == common < len(long_toks)
        assert c.tokens == cold_tokens(cold, msgs)


def test_growing_conversation_matches_cold(eng, cold):
    ns = eng.namespace("conversation")
    msgs = [SYSTEM]
    questions = ["Hi, who are you?", "What is water made of?", "And ice?", "Thanks!"]
    prev_len = 0
    for i, q in enumerate(questions):
        msgs = msgs + [{"role": "user", "content": q}]
        want = cold_tokens(cold, msgs)
        c = eng.chat(msgs, ns, GREEDY)
        assert c.tokens == want
        if i > 0:  # the previous turn's prompt is a prefix of this one
            assert c.stats.hit_tier == "ram"
            assert c.stats.cached_tokens >= prev_len - 1  # the previous body: all but its last token
        prev_len = c.stats.prompt_tokens
        msgs = msgs + [{"role": "assistant", "content": c.text}]


def test_boundary_snapshots_share_the_system_prompt(tmp_path, cold):
    e = make_engine(tmp_path, snapshot_policy="boundaries", min_snapshot_tokens=8)
    try:
        msgs = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
        r = e.render_chat(msgs)
        c = e.chat(msgs, params=GREEDY)
        assert c.stats.snapshots_saved == 2  # the system-prompt boundary and the prompt end
        assert e.store.contains(e.default_namespace.id, r.tokens[: r.boundaries[0]]) == "ram"
        other = [SYSTEM, {"role": "user", "content": "Name a vegetable."}]
        c2 = e.chat(other, params=GREEDY)
        assert c2.stats.cached_tokens >= r.boundaries[0]
        assert c2.tokens == cold_tokens(cold, other)
    finally:
        e.close(flush=False)


def test_seeded_sampling_is_reproducible_through_the_cache(eng, cold):
    msgs = PROMPTS[0]
    p = SamplingParams(max_tokens=12, temperature=0.9, seed=1234)
    want = cold.chat(msgs, params=p).tokens
    ns = eng.namespace("seeded")
    assert eng.chat(msgs, ns, p).tokens == want
    again = eng.chat(msgs, ns, p)
    assert again.stats.hit_tier == "ram" and again.tokens == want


def test_streaming_pieces_and_stats(eng):
    seen = []
    h = eng.submit_chat(PROMPTS[3], params=SamplingParams(max_tokens=8), on_token=seen.append)
    pieces = list(h)
    c = h.result()
    assert [p.token for p in pieces] == c.tokens == [p.token for p in seen]
    assert "".join(p.text for p in pieces) == c.text
    assert c.finish_reason in ("stop", "length")
    s = c.stats
    assert s.completion_tokens == len(c.tokens)
    assert 0 < s.ttft_s <= s.total_s
    load = eng.load()
    assert load.prefill_tps > 0 and load.decode_tps > 0
    assert load.queue_depth == 0 and load.active == 0


def test_on_finish_runs_once_after_the_last_piece(eng):
    events = []
    h = eng.submit_chat(PROMPTS[3], params=SamplingParams(max_tokens=4),
                        on_token=lambda piece: events.append(piece.token),
                        on_finish=lambda: events.append(("done", h.done)))
    c = h.result(timeout=120)
    for _ in range(100):  # on_finish runs just after result() can return
        if events and isinstance(events[-1], tuple):
            break
        time.sleep(0.05)
    assert events == [*c.tokens, ("done", True)]


def test_max_tokens_and_eos(eng):
    c = eng.chat(PROMPTS[4], params=SamplingParams(max_tokens=3))
    assert c.finish_reason == "length" and len(c.tokens) == 3
    c = eng.chat(PROMPTS[3], params=SamplingParams(max_tokens=200))
    assert c.finish_reason == "stop"  # the model ends its answer with <|im_end|>
    assert 2 not in c.tokens


def test_namespaces_are_isolated_in_ram_and_on_disk(tmp_path):
    e = make_engine(tmp_path)
    a, b = e.namespace("tenant-a", b"secret-a"), e.namespace("tenant-b", b"secret-b")
    msgs = PROMPTS[1]
    try:
        e.chat(msgs, a, SHORT)
        assert e.chat(msgs, a, SHORT).stats.hit_tier == "ram"
        first_b = e.chat(msgs, b, SHORT)
        assert first_b.stats.cached_tokens == 0 and first_b.stats.hit_tier == "none"
        assert e.store.remove(b.id, e.render_chat(msgs).tokens[:-1])  # entries hold bodies
    finally:
        e.close()  # flushes a's entry to disk
    e2 = make_engine(tmp_path)
    try:
        c = e2.chat(msgs, b, SHORT)
        assert c.stats.cached_tokens == 0 and c.stats.hit_tier == "none"
        assert e2.chat(msgs, a, SHORT).stats.hit_tier == "disk"
    finally:
        e2.close(flush=False)


def test_persistence_and_corrupt_files(tmp_path, cold):
    e = make_engine(tmp_path)
    for msgs in PROMPTS[:5]:
        e.chat(msgs, params=GREEDY)
    e.close()  # RAM entries are flushed to disk
    e2 = make_engine(tmp_path)
    bodies = [e2.render_chat(msgs).tokens[:-1] for msgs in PROMPTS[1:4]]  # what entries hold
    ns_id = e2.default_namespace.id
    c = e2.chat(PROMPTS[0], params=GREEDY)
    assert c.stats.hit_tier == "disk" and c.stats.cached_tokens > 0
    assert c.tokens == cold_tokens(cold, PROMPTS[0])
    e2.close(flush=False)

    truncated, flipped, foreign = (e2.store._path_for(ns_id, (-1, *b)) for b in bodies)
    assert truncated.exists() and flipped.exists() and foreign.exists()
    truncated.write_bytes(truncated.read_bytes()[:-100])
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    flipped.write_bytes(bytes(raw))
    # a valid file of another model (other fingerprint), in place of a real one
    raw = foreign.read_bytes()
    n_tok = int.from_bytes(raw[48:52], "little")
    tokens = [int.from_bytes(raw[60 + 4 * i: 64 + 4 * i], "little") for i in range(n_tok)]
    payload = raw[60 + 4 * n_tok: -32]
    head, chk = encode_state_file(b"\x07" * 32, raw[40:48], tokens, payload)
    foreign.write_bytes(head + payload + chk)

    e3 = make_engine(tmp_path)
    try:
        # start-up reads headers only: the truncated file (size disagrees with its header)
        # and the foreign one go at once; the flipped payload is found when first loaded
        assert e3.store.stats.corrupt_files_removed == 1
        assert e3.store.stats.foreign_files_removed == 1
        assert not truncated.exists() and flipped.exists() and not foreign.exists()
        for msgs, body in zip(PROMPTS[1:4], bodies, strict=True):
            c = e3.chat(msgs, params=GREEDY)
            # never restored from the removed files; at most a shorter shared prefix (e.g. the
            # system prompt) from an intact entry of another prompt
            assert c.stats.cached_tokens < len(body) - 1
            assert c.tokens == cold_tokens(cold, msgs)
        # the flipped file went on first load (its prompt's cold run then stored a fresh one)
        assert e3.store.stats.corrupt_files_removed == 2
        intact = e3.chat(PROMPTS[4], params=GREEDY)  # its intact file still serves it
        assert intact.stats.cached_tokens == len(e3.render_chat(PROMPTS[4]).tokens) - 2
        assert intact.tokens == cold_tokens(cold, PROMPTS[4])
    finally:
        e3.close(flush=False)


def test_budgets_hold_for_200_prefixes_and_pins_survive(tmp_path):
    rng = random.Random(7)
    probe = make_engine(None, disk_budget_bytes=0)
    toks = [rng.randrange(100, 40000) for _ in range(6)]
    probe.complete_tokens(toks, params=SamplingParams(max_tokens=1))
    per_entry = probe.store.stats.ram_bytes
    probe.close(flush=False)
    ram_budget, disk_budget = 5 * per_entry, 12 * per_entry
    e = make_engine(tmp_path, ram_budget_bytes=ram_budget, disk_budget_bytes=disk_budget)
    events: list[CacheEvent] = []
    e.set_event_callback(events.append)
    ns = e.default_namespace
    try:
        e.complete_tokens(toks, params=SamplingParams(max_tokens=1))
        lease = e.lease_prefix(ns, toks)
        assert lease is not None and lease.length == len(toks) - 1  # the body is stored
        for _ in range(200):
            prompt = [rng.randrange(100, 40000) for _ in range(6)]
            e.complete_tokens(prompt, params=SamplingParams(max_tokens=1))
            assert e.store.ram_used_bytes <= ram_budget
            assert e.store.disk_used_bytes <= disk_budget
            assert e.store.contains(ns.id, toks[:-1]) == "ram"  # pinned: never evicted
        lease.release()
        e.store._check_invariants()
        live = {(nid, t) for nid, t, _ in e.store.prefixes()}
        cached = set()
        for ev in events:
            assert ev.ns == ns.id
            (cached.add if ev.kind == "add" else cached.discard)(ev.tokens_len)
        assert len(live) <= 5 + 12
        assert sum(1 for ev in events if ev.kind == "remove") >= 200 - 17
    finally:
        e.close(flush=False)


def test_cache_events_carry_chains(tmp_path):
    e = make_engine(tmp_path)
    events: list[CacheEvent] = []
    e.set_event_callback(events.append)
    ns = e.namespace("events", b"k")
    try:
        msgs = PROMPTS[7]
        toks = e.render_chat(msgs).tokens
        e.chat(msgs, ns, SHORT)
        (ev,) = events
        body = toks[:-1]  # snapshots hold all prompt tokens but the last
        assert ev.kind == "add" and ev.ns == ns.id and ev.tokens_len == len(body)
        assert ev.chain == chain_hashes(ns.key, body) and len(ev.chain) == len(body) // 16
        assert e.cached_prefixes() == [ev]
        # the body is stored; a request evaluates at least its last 2 prompt tokens
        assert e.cached_tokens(ns, toks) == (len(body) - 1, "ram")
        e.store.remove(ns.id, body)
        assert events[-1].kind == "remove" and events[-1].chain == ev.chain
    finally:
        e.close(flush=False)


def test_loading_the_model_leaves_the_process_s_stdout_and_stderr_alone():
    """llama-cpp-python's ``verbose=False`` pointed fds 1 and 2 at /dev/null for the whole
    load: what the node's main thread logged meanwhile was lost (a start's warnings). A
    fresh process prints numbered lines on stderr and stdout while an engine loads in a
    thread: every one arrives, and nothing else (llama.cpp's own output stays silent)."""
    script = (
        "import sys, threading, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from _model_fixture import default_model_path\n"
        "from prefixmesh.inference.engine import Engine\n"
        "loaded = threading.Event()\n"
        "def load():\n"
        "    Engine(model_path=default_model_path(), n_ctx=256, n_threads=1, kv_dir=None,\n"
        "           ram_budget_bytes=0, disk_budget_bytes=0).close(flush=False)\n"
        "    loaded.set()\n"
        "threading.Thread(target=load).start()\n"
        "n = 0\n"
        "while not loaded.is_set():\n"
        "    print(n, file=sys.stderr, flush=True); print(n, flush=True); n += 1\n"
        "    time.sleep(0.001)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split()
    assert len(printed) > 10  # the load took a while: lines were printed during it
    assert printed == [str(i) for i in range(len(printed))]
    assert done.stderr.split() == printed, done.stderr[:2000]


def test_bad_input_is_refused_and_engine_keeps_serving(eng, tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Engine(model_path=tmp_path / "missing.gguf", kv_dir=tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Engine(model_path=junk, kv_dir=tmp_path)
    with pytest.raises(ContextOverflowError):
        eng.chat(PROMPTS[0], params=SamplingParams(max_tokens=N_CTX))
    with pytest.raises(ContextOverflowError):
        eng.complete_tokens([100] * (N_CTX - 3), params=SamplingParams(max_tokens=4))
    with pytest.raises(EmptyPromptError):
        eng.chat([])
    with pytest.raises(EmptyPromptError):
        eng.complete_tokens([])
    with pytest.raises(UnknownRoleError):
        eng.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidRequestError):
        eng.complete_tokens([10**9])
    with pytest.raises(InvalidRequestError):
        eng.chat(PROMPTS[0], params=SamplingParams(max_tokens=0))
    assert eng.chat(PROMPTS[3], params=SamplingParams(max_tokens=2)).finish_reason == "length"


def test_queue_backpressure_and_cancellation(tmp_path):
    e = make_engine(tmp_path, max_queue=2)
    try:
        started = threading.Event()
        release = threading.Event()

        def block(piece):
            started.set()
            release.wait(30)

        running = e.submit_chat(PROMPTS[3], params=SamplingParams(max_tokens=50), on_token=block)
        assert started.wait(60)
        assert e.load().active == 1
        q1 = e.submit_chat(PROMPTS[4], params=SHORT)
        q2 = e.submit_chat(PROMPTS[5], params=SHORT)
        assert e.load().queue_depth == 2
        with pytest.raises(EngineBusy):
            e.submit_chat(PROMPTS[6])
        q1.cancel()
        running.cancel()
        release.set()
        r = running.result(60)
        assert r.finish_reason == "cancelled" and len(r.tokens) == 1
        assert q1.result(60).finish_reason == "cancelled" and q1.result().tokens == []
        assert q2.result(60).finish_reason in ("stop", "length")
    finally:
        release.set()
        e.close(flush=False)


def test_close_cancels_running_request_and_refuses_new_ones(tmp_path):
    e = make_engine(tmp_path)
    started = threading.Event()
    h = e.submit_chat(PROMPTS[3], params=SamplingParams(max_tokens=100),
                      on_token=lambda piece: started.set())
    assert started.wait(60)
    e.close()
    assert h.result(60).finish_reason in ("cancelled", "stop")
    with pytest.raises(EngineClosed):
        e.submit_chat(PROMPTS[3])
    with pytest.raises(EngineClosed):
        e.render_chat(PROMPTS[3])
