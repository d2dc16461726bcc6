"""inference/bench_live.py through its entry point at the smallest size (the real default
model, 32-token prefix, one run, ~1 s): the JSON report, and that each run really took the
path it is timed as (a RAM restore, then the live sequence; the benchmark asserts both)."""

from __future__ import annotations

import json

from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_live


def test_tiny_run_reports_both_paths(capsys):
    argv = ["--p", "32", "--suffix", "4", "--runs", "2", "--threads", str(TEST_THREADS),
            "--model", str(default_model_path())]
    assert bench_live.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["p"], report["suffix"], report["runs"]) == (32, 4, 2)
    assert len(report["samples"]["ram"]) == len(report["samples"]["live"]) == 2
    assert all(t > 0 for t in report["samples"]["ram"] + report["samples"]["live"])
    assert report["live_over_ram"] == report["live_ttft_s"] / report["ram_ttft_s"]
