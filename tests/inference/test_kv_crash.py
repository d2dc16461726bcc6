"""Persistence under ``kill -9``, with the REAL model in a real child process.

The child caches prompt prefixes one after another (write-behind to disk) and prints a line
after each ``put``; the parent kills it with SIGKILL in the middle of that work, then starts
an engine on the same folder. What must hold: every state file left behind is valid (or
gone: interrupted temp files are removed at start, never loaded), and every prefix put more
than ``write_delay_s`` before the kill is a disk hit whose greedy output equals a cold run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.engine import Engine, SamplingParams
from prefixmesh.inference.kvstore import read_state_file

DELAY_S = 1.0
N_CTX = 512
ONE = SamplingParams(max_tokens=1)

# Every other prompt continues one shared prefix, so the cache holds whole states, segments
# on branch points and rebased states (a file replaced by a newer version) when it is killed.
PROMPTS = textwrap.dedent(
    """
    import random

    def prompt(i):
        rng = random.Random(i)
        own = [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 120))]
        if i % 2:
            return own
        shared = random.Random(-1)
        return [shared.randrange(100, 40000) for _ in range(80)] + own
    """
)
CHILD = PROMPTS + textwrap.dedent(
    """
    import sys
    from prefixmesh.inference.engine import Engine, SamplingParams
    model, kv_dir, delay, threads, n_ctx = sys.argv[1:6]
    eng = Engine(model_path=model, n_ctx=int(n_ctx), n_threads=int(threads), kv_dir=kv_dir,
                 ram_budget_bytes=256 << 20, disk_budget_bytes=1 << 30,
                 write_delay_s=float(delay))
    for i in range(10_000):
        c = eng.complete_tokens(prompt(i), params=SamplingParams(max_tokens=1))
        assert c.stats.snapshots_saved >= 1
        print(f"put {i}", flush=True)  # the puts happened before this line
    """
)
_ns: dict = {}
exec(PROMPTS, _ns)  # the parent's copy of prompt(i)
prompt = _ns["prompt"]


def make_engine(kv_dir, **kw) -> Engine:
    return Engine(model_path=default_model_path(), n_ctx=N_CTX, n_threads=TEST_THREADS,
                  kv_dir=kv_dir, **kw)


def test_kill_9_under_load_loses_at_most_the_write_behind_window(tmp_path):
    kv_dir = tmp_path / "kv"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(default_model_path()), str(kv_dir), str(DELAY_S),
         str(TEST_THREADS), str(N_CTX)],
        stdout=subprocess.PIPE, text=True,
    )
    seen: dict[int, float] = {}  # prompt index -> when its "put" line arrived
    try:
        for line in child.stdout:
            seen[int(line.split()[1])] = time.monotonic()
            if len(seen) == 10:
                break
        # mid-work: the child is prefilling the next prompt or writing the last state
        time.sleep(random.Random(len(seen)).uniform(0.0, 0.4))
        killed_at = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL and len(seen) == 10

    # every state file under a final name is complete and valid (atomic rename + fsync)
    files = list(kv_dir.glob("*/*/*.kv"))
    bases = [read_state_file(path, max_payload=1 << 30, verify=True)[3] for path in files]
    assert any(bases)  # segments were on disk too

    eng = make_engine(kv_dir, ram_budget_bytes=256 << 20, disk_budget_bytes=1 << 30)
    cold = make_engine(None, ram_budget_bytes=0, disk_budget_bytes=0)
    try:
        st = eng.store.stats
        assert st.corrupt_files_removed == 0 and st.foreign_files_removed == 0
        assert list(kv_dir.glob("*/*/.tmp-*")) == []  # interrupted writes are gone
        ns = eng.default_namespace
        durable = [i for i, t in seen.items() if t < killed_at - DELAY_S]
        assert len(durable) >= 5
        for i in durable:
            assert eng.store.contains(ns.id, prompt(i)[:-1]) == "disk", i
        for i in (durable[0], durable[-1]):
            c = eng.complete_tokens(prompt(i), params=SamplingParams(max_tokens=8))
            assert c.stats.hit_tier == "disk" and c.stats.cached_tokens == len(prompt(i)) - 2
            assert c.tokens == cold.complete_tokens(
                prompt(i), params=SamplingParams(max_tokens=8)).tokens
        # nothing else is indexed than what the files hold (later puts may be there too)
        assert len(eng.store.prefixes()) == len(files)
        eng.store._check_invariants()
    finally:
        eng.close(flush=False)
        cold.close(flush=False)


def test_files_are_named_by_their_content(tmp_path):
    """A file copied under another name is refused at start (keeps the index honest)."""
    kv_dir = tmp_path / "kv"
    eng = make_engine(kv_dir, fsync=False)
    eng.complete_tokens(prompt(1), params=ONE)
    eng.close()
    (path,) = kv_dir.glob("*/*/*.kv")
    other = path.with_name("0" * 32 + ".kv")
    other.write_bytes(path.read_bytes())
    eng2 = make_engine(kv_dir, fsync=False)
    try:
        assert not other.exists() and path.exists()
        assert eng2.store.stats.corrupt_files_removed == 1
        assert Path(path).stat().st_size > 0
    finally:
        eng2.close(flush=False)
