"""inference/bench_residents.py through its entry point at the smallest size (the real
default model, two 16-token prefixes, ~1 s): an engine that keeps one sequence resident
restores the cycled prefixes from RAM, one that keeps them all serves them live."""

from __future__ import annotations

import json

from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_residents


def test_tiny_run_one_resident_restores_and_all_residents_stay_live(capsys):
    argv = ["--p", "16", "--prefixes", "2", "--passes", "1", "--n-ctx", "512",
            "--threads", str(TEST_THREADS), "--model", str(default_model_path())]
    assert bench_residents.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["p"], report["prefixes"], report["passes"]) == (16, 2, 1)
    one, every = report["engines"]["residents=1"], report["engines"]["residents=2"]
    assert one["tiers"] == {"ram": 2}  # each prefix evicted the other from the context
    assert every["tiers"] == {"live": 2}  # both kept resident
    assert every["restore_ms"] == 0.0 and one["ttft_ms"] > 0 and every["ttft_ms"] > 0
