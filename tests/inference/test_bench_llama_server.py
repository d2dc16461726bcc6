"""``prefixmesh bench engine --against-llama-server``: argument parsing, the dispatch and the
report's table, without a llama-server binary (the comparison itself is not part of CI)."""

import argparse
import json

import pytest

from prefixmesh.cli import main
from prefixmesh.inference import bench_engine, bench_llama_server
from prefixmesh.inference.bench_llama_server import format_report, ratios


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixmesh bench engine", exit_on_error=False)
    bench_engine.add_arguments(p)
    return p


@pytest.fixture
def fake_binary(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


def test_a_missing_binary_is_a_clear_usage_error(tmp_path, capsys):
    missing = tmp_path / "no" / "llama-server"
    code = main(["bench", "engine", "--against-llama-server", str(missing)])
    err = capsys.readouterr().err
    assert code == 2
    assert str(missing) in err and "no such file" in err and "make llama-server" in err


def test_a_file_that_is_not_executable_is_refused(tmp_path, capsys):
    plain = tmp_path / "llama-server"
    plain.write_text("not a program")
    plain.chmod(0o644)
    assert main(["bench", "engine", "--against-llama-server", str(plain)]) == 2
    assert "not an executable file" in capsys.readouterr().err


def test_defaults_and_choices(fake_binary):
    ns = _parser().parse_args(["--against-llama-server", str(fake_binary)])
    assert ns.against_llama_server == fake_binary.resolve()
    assert ns.workloads == ["warm", "concurrent", "cycle", "restart"]
    assert ns.modes == ["deterministic", "throughput"]
    assert ns.threads is None  # the comparison then uses 1 llama thread each
    ns = _parser().parse_args(["--against-llama-server", str(fake_binary), "--workloads",
                               "warm,cycle", "--modes", "throughput", "--rounds", "3"])
    assert ns.workloads == ["warm", "cycle"] and ns.modes == ["throughput"] and ns.rounds == 3
    for bad in (["--workloads", "warm,nap"], ["--modes", "fast"], ["--rounds", "0"],
                ["--cache-gb", "-1"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            _parser().parse_args(["--against-llama-server", str(fake_binary), *bad])
    # without the flag the engine benchmark keeps its own default of 2 threads
    assert _parser().parse_args([]).against_llama_server is None


def _report() -> dict:
    ls, det, thr = "llama-server", "prefixmesh-deterministic", "prefixmesh-throughput"
    return {
        "model": "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "threads": 1, "n_ctx": 8192,
        "machine": {"cpu": "Test CPU", "cores": 2},
        "uptime_start": "load average: 1.00, 1.00, 1.00",
        "uptime_end": "load average: 2.00, 2.00, 2.00",
        "llama_server": {"argv": ["-m", "x", "-fa", "off", "--parallel", "4", "--kv-unified",
                                  "--no-repack"]},
        "workloads": {
            "warm": {"servers": {ls: {"ttft_s": 0.200}, det: {"ttft_s": 0.100},
                                 thr: {"ttft_s": 0.180}},
                     "load_before": [1.0, 1.0, 1.0], "load_after": [1.5, 1.0, 1.0],
                     "seconds": 3.0},
            "concurrent": {"servers": {
                ls: {"tok_per_s": 40.0, "p99_latency_s": 10.0},
                thr: {"tok_per_s": 80.0, "p99_latency_s": 12.0}}},
            "cycle": {"servers": {ls: {"ttft_s": 1.0, "cold_ttft_s": 1.2},
                                  det: {"ttft_s": 0.3, "cold_ttft_s": 1.3}}},
            "restart": {"servers": {ls: {"ready_s": 0.5, "ttft_s": 1.2},
                                    det: {"ready_s": 2.0, "ttft_s": 0.3}},
                        "cache": {det: {"bytes": 1_600_000_000, "files": 80}}},
        },
        "prompt_token_mismatches": 0,
    }


def test_ratios_and_targets():
    rows = {(r["workload"], r["metric"], r["server"]): r for r in ratios(_report())}
    warm = rows[("warm", "ttft_s", "prefixmesh-deterministic")]
    assert warm["ratio"] == pytest.approx(0.5) and warm["met"] is True
    assert rows[("warm", "ttft_s", "prefixmesh-throughput")]["met"] is False  # 0.9 > 0.8
    assert rows[("concurrent", "tok_per_s", "prefixmesh-throughput")]["ratio"] == 2.0
    assert rows[("concurrent", "tok_per_s", "prefixmesh-throughput")]["met"] is True
    assert rows[("concurrent", "p99_latency_s", "prefixmesh-throughput")]["met"] is False
    assert rows[("cycle", "ttft_s", "prefixmesh-deterministic")]["met"] is True
    assert rows[("restart", "ready_s", "prefixmesh-deterministic")]["met"] is None  # no target
    assert ("warm", "ttft_s", "llama-server") not in rows


def test_table_names_machine_load_ratios_and_verdicts():
    report = _report()
    report["ratios"] = ratios(report)
    text = format_report(report)
    assert "Test CPU" in text and "load average: 1.00" in text and "load average: 2.00" in text
    assert "--no-repack" in text
    line = next(x for x in text.splitlines() if x.startswith("warm") and "deterministic" in x)
    assert "0.50" in line and "<= 0.8" in line and line.rstrip().endswith("yes")
    line = next(x for x in text.splitlines() if "p99_latency_s" in x)
    assert "1.20" in line and line.rstrip().endswith("NO")
    assert "1.60 GB in 80 files" in text
    assert "warm: load [1.0, 1.0, 1.0] -> [1.5, 1.0, 1.0]" in text


def test_cli_dispatches_to_the_comparison(fake_binary, monkeypatch, capsys):
    seen = {}

    def fake(binary, **kw):
        seen.update(kw, binary=binary)
        report = _report()
        report["ratios"] = ratios(report)
        return report

    monkeypatch.setattr(bench_llama_server, "bench_against_llama_server", fake)
    code = main(["bench", "engine", "--against-llama-server", str(fake_binary),
                 "--workloads", "warm", "--modes", "deterministic", "--json"])
    assert code == 0
    assert seen["binary"] == fake_binary.resolve() and seen["threads"] == 1
    assert seen["workloads"] == ["warm"] and seen["modes"] == ["deterministic"]
    out = json.loads(capsys.readouterr().out)
    assert out["ratios"][0]["workload"] == "warm"
