"""Every ``prefixmesh bench NAME --help`` prints its usage and exits at once (a real
``prefixmesh`` process each): ``bench engine --help`` once started the 10-minute
benchmark because the CLI did not find the module's argument table. The processes are
forked from the test session's fork server where they can be (tests/_forkserver.run: the
same ``main``, without ~0.5 s of imports each)."""

from __future__ import annotations

import sys
from pathlib import Path

import _forkserver
import pytest

_SCRIPT = Path(sys.executable).parent / "prefixmesh"
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "prefixmesh"]
HELP_BOUND_S = 30.0  # usage is printed in about a second; a benchmark would run minutes

# the flags each benchmark's usage must show (the ones users pass: docs/BENCHMARKS.md)
EXPECTED = {
    "engine": ("--json", "--runs", "--prefix-lengths"),
    "sim": ("--json",),
    "swarm": ("--json",),
    "attack-slowloris": ("--duration",),
    "attack-soak": ("--minutes", "--nodes"),
}


def test_every_registered_benchmark_is_checked():
    from prefixmesh import cli

    assert {b[0] for b in cli.BENCHMARKS} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bench_help_prints_usage_quickly(name):
    proc = _forkserver.run([*CLI, "bench", name, "--help"], timeout=HELP_BOUND_S,
                           stdin_devnull=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: prefixmesh bench {name}"), proc.stdout[:300]
    for flag in EXPECTED[name]:
        assert flag in proc.stdout, (flag, proc.stdout)


@pytest.mark.parametrize(("flag", "value"), [("--runs", "many"), ("--runs", "0"),
                                             ("--prefix-lengths", "512,abc"),
                                             ("--prefix-lengths", ",")])
def test_bench_engine_rejects_a_bad_flag_value_before_running(flag, value):
    proc = _forkserver.run([*CLI, "bench", "engine", flag, value], timeout=HELP_BOUND_S,
                           stdin_devnull=True)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
