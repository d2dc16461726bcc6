"""``prefixmesh bench engine`` (inference/bench_engine.py): its argument checks (a bad list
or count is a usage error), and a run at the smallest size through ``run_bench_engine``
(the real default model, a 16-token prefix, one run per path, ~1 s), as a table and as
JSON. (``--against-llama-server``: tests/inference/test_bench_llama_server.py.)"""

from __future__ import annotations

import argparse
import json

import pytest
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_engine


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixmesh bench engine")
    bench_engine.add_arguments(p)
    return p


def test_arguments_and_usage_errors(capsys):
    ns = _parser().parse_args(["--prefix-lengths", "16, 32", "--runs", "2"])
    assert ns.prefix_lengths == [16, 32] and ns.runs == 2 and ns.suffix_tokens == 64
    for bad in (["--prefix-lengths", "16,x"], ["--prefix-lengths", ","],
                ["--prefix-lengths", "0"], ["--runs", "0"], ["--suffix-tokens", "-3"]):
        with pytest.raises(SystemExit) as info:
            _parser().parse_args(bad)
        assert info.value.code == 2, bad
        assert bad[0] in capsys.readouterr().err


def test_tiny_run_as_table_and_as_json(capsys):
    args = ["--prefix-lengths", "16", "--runs", "1", "--suffix-tokens", "4",
            "--threads", str(TEST_THREADS), "--model", str(default_model_path())]
    assert bench_engine.run_bench_engine(_parser().parse_args(args + ["--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["results"]
    assert row["prefix_tokens"] == 16 and row["suffix_tokens"] == 4
    assert row["ram_over_cold"] == pytest.approx(row["ram_ttft_s"] / row["cold_ttft_s"])
    assert row["disk_over_cold"] == pytest.approx(row["disk_ttft_s"] / row["cold_ttft_s"])
    assert row["ram_bytes_per_token"] > 0 and row["disk_bytes_per_token"] > 0
    # the table is the same report, one line per prefix length
    table = bench_engine._table(report).splitlines()
    assert table[0].startswith(f"model {default_model_path().name}  threads={TEST_THREADS}")
    assert table[2].split()[0] == "16" and float(table[2].split()[1]) == pytest.approx(
        row["cold_ttft_s"] * 1000, abs=0.05)
    assert bench_engine.run_bench_engine(_parser().parse_args(args)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == table[:2] and out[2].split()[0] == "16"
