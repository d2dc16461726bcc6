"""bench/attack_soak.py without the 10-minute run: its table from recorded figures and its
argument checks (the soak itself is a benchmark: docs/BENCHMARKS.md)."""

from __future__ import annotations

import argparse

from prefixmesh.bench import attack_soak


def test_the_table_has_one_row_per_phase_and_sample():
    fig = {
        "nodes": 2,
        "phases": {
            "unattacked": {"sent": 10, "answered": 10, "p50_s": 0.2, "p99_s": 0.4},
            "attacked": {"sent": 12, "answered": 12, "p50_s": 0.3, "p99_s": 0.9},
            "after": {"sent": 9, "answered": 9, "p50_s": 0.21, "p99_s": 0.3},
        },
        "samples": [{"t_s": 0.0, "foreign_dials": 0, "n0": (110.0, 13), "n1": (None, None)},
                    {"t_s": 10.0, "foreign_dials": 4, "n0": (120.4, 50), "n1": (111.0, 12)}],
    }
    table = attack_soak._table(fig)
    assert "| attacked | 12 / 12 | 0.3 | 0.9 | 1.50x |" in table
    assert "| 10.0 | 4 | 120 / 50 | 111 / 12 |" in table
    assert "| 0.0 | 0 | 110 / 13 | - |" in table


def test_bad_arguments_are_refused_with_a_message(capsys):
    ap = argparse.ArgumentParser()
    attack_soak.add_arguments(ap)
    assert attack_soak.run_bench_attack_soak(ap.parse_args(["--nodes", "0"])) == 2
    assert "--nodes must be >= 1" in capsys.readouterr().err
    assert attack_soak.run_bench_attack_soak(ap.parse_args(["--attacks", "sybil,nuke"])) == 2
    assert "(unknown: nuke)" in capsys.readouterr().err


def test_phase_figures():
    ph = attack_soak._phase([0.1, 0.3, "ConnectFailed: x", 0.2])
    assert ph == {"sent": 4, "answered": 3, "p50_s": 0.2, "p99_s": 0.3,
                  "failures": ["ConnectFailed: x"]}
