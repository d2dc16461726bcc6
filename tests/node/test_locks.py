"""node/locks.py in one process: flock locks are per open file, so a second lock on the
same key file or cache directory conflicts even here (the real two-process case is in
tests/node/test_daemon_lifecycle.py)."""

from __future__ import annotations

import os

import pytest

from prefixmesh.node.locks import LockError, lock_cache_dir, lock_key_file


def test_second_lock_on_a_key_file_names_the_holder(tmp_path):
    key = tmp_path / "keys" / "node.key"
    first = lock_key_file(key)  # the key itself need not exist yet
    try:
        with pytest.raises(LockError) as info:
            lock_key_file(tmp_path / "keys" / ".." / "keys" / "node.key")  # same file
        msg = str(info.value)
        assert f"key file {key}" in msg and f"process {os.getpid()}" in msg
        assert "\n" not in msg
    finally:
        first.release()
    lock_key_file(key).release()  # released: free again


def test_cache_dir_lock_and_a_cache_dir_that_is_a_file(tmp_path):
    lock = lock_cache_dir(tmp_path / "kv")
    try:
        with pytest.raises(LockError, match="in use by another node"):
            lock_cache_dir(tmp_path / "kv")
    finally:
        lock.release()
    (tmp_path / "file").write_text("x")
    with pytest.raises(LockError, match="exists but is not a directory"):
        lock_cache_dir(tmp_path / "file")
    with pytest.raises(LockError, match="a parent of it is a file"):
        lock_cache_dir(tmp_path / "file" / "kv")


def test_undo_removes_what_a_failed_start_created(tmp_path):
    lock = lock_cache_dir(tmp_path / "a" / "b")
    key = lock_key_file(tmp_path / "k" / "node.key")
    lock.undo()
    key.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # an existing folder and lock file are kept
    (tmp_path / "kv").mkdir()
    lock_cache_dir(tmp_path / "kv").release()
    again = lock_cache_dir(tmp_path / "kv")
    again.undo()
    assert (tmp_path / "kv" / "node.lock").exists()
