"""inference/bench_warm_path.py through its entry point at the smallest size (the real
default model, 32-token prefix, one run, two cycled prefixes, both batch modes, ~3 s):
the report's shape, the RAM path restored from RAM in both modes, the throughput engine's
live path served live, and the kernels' floor. (Not asserted: the deterministic engine's
``live`` path; it was served from RAM here, at P = 32, 48 and 533 alike, although the
module's docstring says the prefix is still live in sequence 0 there.)"""

from __future__ import annotations

import json
import math

from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_warm_path


def test_median_ms():
    assert bench_warm_path._median_ms([0.001, 0.003, 0.002]) == 2.0
    assert math.isnan(bench_warm_path._median_ms([]))


def test_tiny_run_times_each_path_on_its_tier(capsys):
    argv = ["--p", "32", "--suffix", "4", "--runs", "1", "--cycle", "2", "--n-ctx", "256",
            "--threads", str(TEST_THREADS), "--model", str(default_model_path())]
    assert bench_warm_path.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["p"], report["suffix"], report["cycle"]) == (32, 4, 2)
    assert set(report["modes"]) == {"deterministic", "throughput"}
    for mode, paths in report["modes"].items():
        assert set(paths) == {"live", "ram", "cycle"}, mode
        assert paths["ram"]["tiers"] == ["ram"], (mode, paths)
        assert all(p["ttft_ms"] > 0 for p in paths.values())
    assert report["modes"]["throughput"]["live"]["tiers"] == ["live"]
    assert set(report["kernel_floor_ms"]) == {"one_token", "one_batch", "two_passes"}
    assert all(v > 0 for v in report["kernel_floor_ms"].values())
