"""``prefixmesh bench swarm``: the summary arithmetic and trace building (fast), and the whole
harness at tiny scale on real node processes (slow: 2 nodes, 6 requests, one policy)."""

from __future__ import annotations

import argparse
import math
import os
import subprocess

import pytest
from _model_fixture import default_model_path

from prefixmesh.bench.swarm import (
    CTX_SLACK_TOKENS,
    SYNTHETIC_VOCAB,
    SwarmBenchConfig,
    SwarmBenchError,
    _percentile,
    add_swarm_arguments,
    build_trace,
    config_from_namespace,
    format_table,
    run_swarm_bench,
    summarise,
)


def _rec(i, entry, served, ttft, prompt, cached, hops=0, ok=True):
    if not ok:
        return {"i": i, "entry": entry, "ok": False, "error": "ClientTimeout: late"}
    return {"i": i, "entry": entry, "ok": True, "error": "", "ttft_s": ttft, "total_s": ttft + 1,
            "served_by": served, "prompt_tokens": prompt, "cached_tokens": cached,
            "forward_hops": hops}


def test_summary_counts_hits_forwards_and_errors():
    records = [
        _rec(0, 0, 0, 1.0, 100, 0),
        _rec(1, 1, 0, 0.5, 100, 80, hops=1),
        _rec(2, 0, 0, 0.2, 200, 160),
        _rec(3, 1, None, 0.0, 0, 0, ok=False),
    ]
    s = summarise(records, 2)
    assert s["requests"] == 4 and s["ok"] == 3
    assert s["errors"] == {"ClientTimeout": 1}
    assert s["token_hit_ratio"] == pytest.approx(240 / 400)
    assert s["forwarded_fraction"] == pytest.approx(1 / 3)
    assert s["mean_forward_hops"] == pytest.approx(1 / 3)
    assert s["served_per_node"] == [3, 0]
    assert s["ttft_mean_s"] == pytest.approx(1.7 / 3)
    assert s["ttft_p50_s"] == 0.5 and s["ttft_p99_s"] == 1.0


def test_summary_of_nothing_is_nan_not_an_error():
    s = summarise([], 3)
    assert s["ok"] == 0 and math.isnan(s["ttft_mean_s"]) and s["served_per_node"] == [0, 0, 0]


def test_percentile_is_nearest_rank():
    vals = list(range(1, 101))
    assert _percentile(vals, 50) == 50
    assert _percentile(vals, 99) == 99
    assert _percentile(vals, 100) == 100
    assert _percentile([7.0], 99) == 7.0
    assert math.isnan(_percentile([], 50))


def test_synthetic_trace_is_cut_to_the_context_and_paced_at_the_rate():
    cfg = SwarmBenchConfig(requests=40, workload="synthetic", n_ctx=256, max_tokens=4, rate=0.5)
    trace = build_trace(cfg)
    limit = 256 - 4 - CTX_SLACK_TOKENS
    assert len(trace.requests) == 40
    assert all(0 < len(r.tokens) <= limit for r in trace.requests)
    assert trace.truncated > 0
    assert all(0 <= t < SYNTHETIC_VOCAB for r in trace.requests for t in r.tokens)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(0.5)
    assert 0 <= trace.ideal_hit_ratio <= 1
    assert build_trace(cfg).requests == trace.requests  # deterministic


def test_config_from_cli_flags_and_validation():
    p = argparse.ArgumentParser()
    add_swarm_arguments(p)
    cfg = config_from_namespace(p.parse_args(
        ["--nodes", "3", "--policies", "paper, random", "--delay-ms", "5", "--no-netns"]))
    assert cfg.nodes == 3 and cfg.policies == ("paper", "random") and cfg.delay_ms == 5
    assert cfg.netns is False
    cfg.validate()
    for bad in (dict(policies=("nope",)), dict(nodes=0), dict(rate=0.0), dict(requests=0),
                dict(max_tokens=0), dict(workload="sharegpt")):
        with pytest.raises(SwarmBenchError):
            SwarmBenchConfig(**bad).validate()


@pytest.mark.slow
def test_tiny_swarm_run_serves_every_request_and_cleans_up(capfd):
    # n_ctx 256 cuts the MMLU prompts to ~240 tokens (from up to 1,000): the same harness,
    # a quarter of the prefill (what is asserted does not depend on the prompts' length)
    default_model_path()  # the bench asks for a fetched model; tests may run in any order
    cfg = SwarmBenchConfig(nodes=2, requests=6, policies=("prefixmesh",), max_tokens=2,
                           rate=2.0, n_ctx=256, drain_s=45.0, request_timeout_s=45.0)
    result = run_swarm_bench(cfg)
    [p] = result["policies"]
    assert p["policy"] == "prefixmesh"
    assert p["ok"] == p["requests"] == 6, p["errors"]
    assert sum(p["served_per_node"]) == 6
    assert p["prompt_tokens"] == result["trace"]["prompt_tokens"]
    assert 0 <= p["cached_tokens"] <= p["prompt_tokens"]
    assert all(r["ttft_s"] > 0 for r in p["records"])
    assert result["network"]["note"]
    if result["network"]["namespace"]:  # the namespace is gone afterwards
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in listing.splitlines() if line.strip()}
        assert f"pmbench{os.getpid()}" not in names
    assert "prefixmesh" in format_table(result)
    # the replay lasts > 2 s (6 requests at 2/s): it reported how far it was
    assert "requests answered or failed" in capfd.readouterr().err
