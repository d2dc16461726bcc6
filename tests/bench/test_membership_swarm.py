"""bench/membership_swarm.py, its pure parts only: every run starts real node processes
and waits for their mesh (one node alone took ~7 s wall on this 2-core machine under load,
two ~9 s, and a useful swarm is 8+ nodes for minutes: docs/SCALING.md), so its windows are
a benchmark, not a test. Checked here: the seeded prompts (distinct per node and request
from the first block, reproducible, past the partition key's blocks), the command line,
and one small real run of the thaw mode (4 nodes, a 3 s freeze)."""

from __future__ import annotations

import pytest

from prefixmesh.bench import membership_swarm
from prefixmesh.inference.core.blocks import BLOCK_TOKENS


def test_prompts_are_seeded_distinct_from_the_first_token_and_long_enough():
    prompts = {(n, k): membership_swarm._prompt(n, k) for n in range(4) for k in range(5)}
    assert all(p == membership_swarm._prompt(n, k) for (n, k), p in prompts.items())
    # no two share even their first block: each is its own cached prefix
    assert len({tuple(p[:BLOCK_TOKENS]) for p in prompts.values()}) == len(prompts)
    assert all(len(p) == membership_swarm.PROMPT_TOKENS for p in prompts.values())
    assert membership_swarm.PROMPT_TOKENS // BLOCK_TOKENS > 4  # past the 4-block key


def test_command_line(capsys):
    with pytest.raises(SystemExit) as info:
        membership_swarm.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--nodes", "--membership", "--idle", "--digests", "--partitions", "--rate",
                 "--thaw", "--watch"):
        assert flag in out
    with pytest.raises(SystemExit) as info:
        membership_swarm.main(["--nodes", "many"])
    assert info.value.code == 2 and "--nodes" in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_thaw_run_reports_the_thawed_nodes_rejoin():
    rows = membership_swarm.measure(4, "swim", 1.0, 120.0, start_batch=3, thaw_s=3.0,
                                    watch_s=90.0)
    row = rows[-1]
    assert row["mesh_formed"] and row["thaw_freeze_s"] == 3.0
    assert row["thaw_up_at_end"] == 3  # the thawed node holds the other three up again
    assert 0 <= row["thaw_min_up"] <= 3
    assert row["thaw_rejoin_s"] is not None and row["thaw_rejoin_s"] <= 90.0
