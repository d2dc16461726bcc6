"""bench/micro_core_index.py through ``main`` at a tiny size (5 peers, 5 prefixes each,
~0.1 s): the index it builds and its report lines; and the Zipf weights it draws
system-prompt popularity from."""

from __future__ import annotations

import re
import sys

import pytest

from prefixmesh.bench import micro_core_index


def test_zipf_weights_fall_with_rank():
    w = micro_core_index.zipf_weights(5)
    assert len(w) == 5 and all(a > b for a, b in zip(w, w[1:], strict=False))
    assert w[0] / w[1] == pytest.approx(2.0)  # alpha 1: weight 1/rank


def test_tiny_run(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["micro_core_index", "--peers", "5", "--prefixes", "5",
                                      "--requests", "5", "--rounds", "1", "--naive", "2",
                                      "--blocks", "20"])
    micro_core_index.main()
    out = capsys.readouterr().out
    m = re.search(r"index: (\d+) peers, (\d+) \(peer, hash\) postings, (\d+) distinct", out)
    assert m and int(m.group(1)) == 5 and int(m.group(3)) <= int(m.group(2))
    assert "longest_matches, 20-block request:" in out
    assert "naive scan of all 5 peers" in out
