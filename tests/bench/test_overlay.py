"""bench/overlay.py: its percentile helper, its command line, and the ``convergence``
benchmark through ``main`` at the smallest size (two in-process nodes on loopback,
simulated engine, one trial, ~3 s): a new prefix spreads to the other node within the
round bound the report names. (``hop``, ``digest-bytes`` and ``digest-load`` start node
processes or swarms for tens of seconds: benchmarks, docs/bench/overlay.md.)"""

from __future__ import annotations

import json

import pytest

from prefixmesh.bench import overlay


def test_percentile_is_nearest_rank_from_below():
    values = [5, 1, 4, 2, 3]
    assert overlay._pct(values, 0.0) == 1 and overlay._pct(values, 0.5) == 3
    assert overlay._pct(values, 0.99) == 5 and overlay._pct(values, 1.0) == 5


def test_command_line_needs_a_benchmark(capsys):
    with pytest.raises(SystemExit) as info:
        overlay.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        overlay.main(["warp-speed"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_convergence_at_the_smallest_size(capsys):
    assert overlay.main(["convergence", "--nodes", "2", "--trials", "1",
                         "--interval", "0.3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["nodes"], report["trials"], report["interval_s"]) == (2, 1, 0.3)
    assert 1 <= report["rounds_max"] <= report["target_rounds"]
    assert 0 < report["seconds_median"] <= report["seconds_max"] < 30
