"""bench/micro_radix.py: its workload (prefixes share system prompts, queries are partial
hits or misses, all deterministic per seed) and one run through ``main`` at a tiny size."""

from __future__ import annotations

import random

from prefixmesh.bench import micro_radix


def test_prefixes_share_system_prompts_and_queries_are_deterministic():
    prefixes = micro_radix.make_prefixes(random.Random(1), 30, 3)
    assert len(prefixes) == 30 and prefixes == micro_radix.make_prefixes(random.Random(1), 30, 3)
    assert all(800 <= len(p) <= 1300 for p in prefixes)
    # a namespace pseudo-token first, then one of 3 shared system prompts
    heads = {tuple(p[1:300]) for p in prefixes}
    assert len(heads) <= 3
    queries = micro_radix.make_queries(random.Random(2), prefixes, 40)
    assert len(queries) == 40
    misses = [q for q in queries if q[0] == -9]  # every tenth query: a namespace nobody has
    assert len(misses) == 4
    starts = {tuple(p[:1]) for p in prefixes}
    assert all(tuple(q[:1]) in starts for q in queries if q[0] != -9)


def test_rate_formats_per_second_and_each():
    assert micro_radix.rate(1000, 0.5).split() == ["2,000/s", "(", "500.0", "us", "each)"]


def test_tiny_run_prints_every_phase(capsys):
    micro_radix.main(["--prefixes", "40", "--system-prompts", "3", "--queries", "50"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("40 prefixes") and "50 queries" in out[0]
    for phase in ("insert (no eviction)", "match", "get (exact)", "insert (LRU-evicting)",
                  "remove"):
        assert any(line.startswith(phase) for line in out[1:]), phase
    assert out[-1].rstrip().endswith("left 0")  # every prefix removed again
