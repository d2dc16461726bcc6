"""bench/micro_core_digest.py through ``main`` at a tiny size (20 prefixes, one virtual
minute per phase, 50 ms per crypto figure, ~0.4 s): every section is printed, and the
figures hold together (a churning node issues more than a quiet one; sharing prefixes
advertises fewer hashes than not)."""

from __future__ import annotations

import re

from prefixmesh.bench import micro_core_digest


def test_tiny_run(capsys):
    micro_core_digest.main(["--seconds", "0.05", "--prefixes", "20", "--duration", "60"])
    out = capsys.readouterr().out
    assert out.startswith("digest sign / verify:")
    assert "snapshot, 4096 hashes" in out and "summary message for 64 origins" in out
    issued = [float(x) for x in re.findall(r"churn +[\d.]+ prefixes/s: +([\d.]+) B/s", out)]
    assert len(issued) == 4  # (churn, no churn) x (sharing, no sharing)
    assert issued[0] > issued[1] and issued[2] > issued[3]
    hashes = [int(x) for x in re.findall(r"(\d+) advertised hashes", out)]
    assert len(hashes) == 2 and hashes[0] < hashes[1]  # MMLU-like sharing, then none
