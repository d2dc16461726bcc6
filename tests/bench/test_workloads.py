"""bench/workloads.py: workload loaders and the ideal-hit computation of the simulator. (The
proxy tokenizer, bench/tokenizer.py, is tests/bench/test_tokenizer.py.)"""

from __future__ import annotations

import gzip
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.bench.tokenizer import ProxyTokenizer
from prefixmesh.bench.workloads import (
    WorkloadError,
    generate_mmlu_trace,
    ideal_hits,
    load_workload,
    synthetic_workload,
)


def brute_ideal(seqs):
    out = []
    for i, s in enumerate(seqs):
        best = 0
        for t in seqs[:i]:
            k = 0
            while k < min(len(s), len(t)) and s[k] == t[k]:
                k += 1
            best = max(best, k)
        out.append(best)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=25))
def test_ideal_hits_matches_brute_force(seqs):
    assert ideal_hits(seqs) == brute_ideal(seqs)


def test_synthetic_is_deterministic_and_has_reuse():
    a = synthetic_workload(300, seed=3)
    b = synthetic_workload(300, seed=3)
    assert [r.tokens for r in a.requests] == [r.tokens for r in b.requests]
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a.requests, a.requests[1:], strict=False))
    assert 0.3 < a.ideal_hit_ratio() < 1.0
    assert synthetic_workload(300, seed=4).requests[0].tokens != a.requests[0].tokens


def test_generic_jsonl_prompt_and_messages(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "w.jsonl.gz"
    lines = [
        {"arrival_s": 0.5, "prompt": "You are helpful. Question one?"},
        {"arrival_s": 0.1, "messages": [{"role": "user", "content": "hello there"}],
         "max_tokens": 7},
        {"arrival_s": 0.9, "prompt": "You are helpful. Question two?"},
    ]  # fmt: skip
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(json.dumps(x) for x in lines) + "\n")
    wl = load_workload(str(path), tokenizer="proxy")
    assert [r.arrival_s for r in wl.requests] == [0.1, 0.5, 0.9]
    assert wl.requests[0].max_tokens == 7 and wl.requests[1].max_tokens == 16
    assert wl.ideal_per_request()[2] > 0
    again = load_workload(str(path), tokenizer="proxy")  # from the on-disk cache
    assert [r.tokens for r in again.requests] == [r.tokens for r in wl.requests]


def test_generic_rejects_bad_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival_s": 1.0}) + "\n")
    with pytest.raises(WorkloadError, match="bad request line"):
        load_workload(str(path), tokenizer="proxy")
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(str(tmp_path / "missing.jsonl"), tokenizer="proxy")


def test_mmlu_generation_from_csv(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXMESH_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "mmlu"
    rng = random.Random(0)
    for split in ("dev", "test"):
        (root / "data" / split).mkdir(parents=True)
        for subj in ("algebra", "history", "law"):
            rows = [
                f"q{rng.random():.6f} {subj},a,b,c,d,{'ABCD'[i % 4]}" for i in range(6)
            ]
            (root / "data" / split / f"{subj}_{split}.csv").write_text("\n".join(rows) + "\n")
    tok = ProxyTokenizer()
    wl = generate_mmlu_trace(root, tok, n_requests=200, alpha=1.5, rate=10.0, seed=1)
    assert len(wl) == 200
    groups = [r.group for r in wl.requests]
    top = max(set(groups), key=groups.count)
    assert groups.count(top) > 100  # Zipf(1.5) over 3 subjects: the top one dominates
    assert wl.ideal_hit_ratio() > 0.5
    again = generate_mmlu_trace(root, tok, n_requests=200, alpha=1.5, rate=10.0, seed=1)
    assert [r.tokens for r in again.requests] == [r.tokens for r in wl.requests]
