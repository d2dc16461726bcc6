"""inference/bench_shared.py through its entry point at the smallest size (the real default
model, two prompts behind a 32-token prefix, ~1 s): the store holds the shared prefix once
(bytes near the ideal), and the report's ratios are its own medians'. (The benchmark itself
asserts each timed request's path: cold, a RAM chain, a disk chain after a restart.)"""

from __future__ import annotations

import json

import pytest
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_shared


def test_tiny_run_stores_the_shared_prefix_once(capsys):
    argv = ["--k", "2", "--p", "32", "--s", "4", "--runs", "1",
            "--threads", str(TEST_THREADS), "--model", str(default_model_path())]
    assert bench_shared.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("bytes: ram ") and lines[1].startswith("cold 0: ")
    report = json.loads(out[out.index("{"):])
    assert (report["k"], report["p"], report["s"]) == (2, 32, 4)
    # prefix stored once: (P + K*S) tokens' worth, not K*(P+S) (that would be ~1.8x here)
    assert report["ram_over_ideal"] == pytest.approx(1.0, abs=0.05)
    assert report["disk_over_ideal"] == pytest.approx(1.0, abs=0.05)
    assert report["ram_over_cold"] == report["chain_ram_ttft_s"] / report["cold_ttft_s"]
    assert report["disk_over_cold"] == report["chain_disk_ttft_s"] / report["cold_ttft_s"]
