"""inference/bench_restart.py, its cheap parts only: a run with the real model builds a
cache of at least one real 1,024-token state plus synthetic files of 300-1,500 tokens
(~10 s at the smallest size that terminates on this machine), so it is a benchmark
(docs/BENCHMARKS.md), not a test. Checked here: the page-cache eviction it times restarts
with (on real files, which stay intact), and its command line."""

from __future__ import annotations

import os

import pytest

from prefixmesh.inference import bench_restart


def test_drop_page_cache_touches_only_cache_files_and_keeps_them(tmp_path):
    (tmp_path / "ns").mkdir()
    kv = tmp_path / "ns" / "a.kv"
    kv.write_bytes(os.urandom(64 * 1024))
    other = tmp_path / "notes.txt"
    other.write_text("not a cache file")
    before = kv.read_bytes()
    bench_restart.drop_page_cache(tmp_path)
    assert kv.read_bytes() == before and other.read_text() == "not a cache file"
    bench_restart.drop_page_cache(tmp_path / "empty-or-missing")  # nothing to drop: no error


def test_command_line(capsys):
    with pytest.raises(SystemExit) as info:
        bench_restart.main(["--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--cache-gb", "--runs", "--threads", "--model", "--kv-dir"):
        assert flag in usage
    with pytest.raises(SystemExit) as info:
        bench_restart.main(["--cache-gb", "lots"])
    assert info.value.code == 2 and "--cache-gb" in capsys.readouterr().err


def test_a_cache_too_small_for_any_state_is_refused_not_filled_forever(capsys):
    # before: --cache-gb 0.002 held none of the 7-35 MB states and the fill loop never ended
    with pytest.raises(SystemExit) as info:
        bench_restart.main(["--cache-gb", "0.002"])
    assert info.value.code == 2 and "at least" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least"):
        bench_restart.bench_restart(cache_gb=0.0)
