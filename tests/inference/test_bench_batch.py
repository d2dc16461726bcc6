"""inference/bench_batch.py through its entry point at the smallest size (the real default
model, two prompts and two clients of one request, three tokens, ~4 s): the agreement
report (continuous batching against the deterministic engine, greedy) and the load report's
own arithmetic (ratios of its medians, the throughput engine's step counters)."""

from __future__ import annotations

import json

from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_batch


def test_tiny_run_reports_agreement_and_load(capsys):
    argv = ["--prompts", "2", "--clients", "2", "--requests", "1", "--rounds", "1",
            "--prefix", "16", "--max-tokens", "3", "--threads", str(TEST_THREADS),
            "--model", str(default_model_path())]
    assert bench_batch.main(argv) == 0
    out = capsys.readouterr().out
    first, rest = out.split("\n", 1)
    agreement = json.loads(first)
    report = json.loads(rest)
    assert report["agreement"] == agreement
    assert agreement["prompts"] == 2 and 0 <= agreement["identical"] <= 2
    assert agreement["identical"] <= agreement["first_token_agree"] <= 2
    assert 0.0 <= agreement["mean_common_prefix"] <= 1.0
    diverged = 2 - agreement["identical"]
    assert len(agreement["first_divergence_tokens"]) == diverged
    assert all(0 <= k <= 3 for k in agreement["first_divergence_tokens"])
    assert len(agreement["lead_at_divergence_nats"]) <= diverged
    assert all(x >= 0 for x in agreement["lead_at_divergence_nats"])
    assert 0.0 <= agreement["steps_leading_by_more_than_1_nat"] <= 1.0
    load = report["load"]
    det, thr = load["deterministic"], load["throughput"]
    # every request found the shared prefix cached (it was, before timing)
    assert sum(det["hit_tiers"].values()) == sum(thr["hit_tiers"].values()) == 2
    assert load["throughput_ratio"] == thr["tok_s_median"] / det["tok_s_median"]
    assert load["p99_ratio"] == thr["latency_p99_s"] / det["latency_p99_s"]
    steps = load["throughput_steps"]
    assert steps["steps"] >= 1 and steps["sequences"] >= steps["steps"]
    assert load["mean_sequences_per_step"] == steps["sequences"] / steps["steps"]


def test_skip_runs_only_the_other_part(capsys):
    argv = ["--skip", "load", "--prompts", "1", "--clients", "1", "--max-tokens", "2",
            "--threads", str(TEST_THREADS), "--model", str(default_model_path())]
    assert bench_batch.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("\n") + 1:])
    assert set(report) == {"agreement"} and report["agreement"]["prompts"] == 1
