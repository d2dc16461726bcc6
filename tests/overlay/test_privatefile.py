"""read_private_file: the one safe reader of key and secret files (overlay/privatefile.py).
Its two callers' own messages are tested in test_identity.py and test_tenants.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.node.tenants import read_secret_file
from prefixmesh.overlay.core.identity import InsecureKeyFile
from prefixmesh.overlay.keyfile import load_identity
from prefixmesh.overlay.privatefile import (
    InsecureFileMode,
    NotARegularFile,
    OversizeFile,
    PrivateFileError,
    PrivateFileNotFound,
    PrivateFileUnreadable,
    read_private_file,
)


def _write(path: Path, content: bytes, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    os.chmod(path, mode)
    return path


@settings(max_examples=200, deadline=None)
@given(content=st.binary(max_size=64), max_bytes=st.integers(0, 64))
def test_reads_exactly_the_content_up_to_the_limit(content, max_bytes):
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d) / "f", content)
        if len(content) <= max_bytes:
            assert read_private_file(path, max_bytes) == content
        else:
            with pytest.raises(OversizeFile) as info:
                read_private_file(path, max_bytes)
            assert info.value.size == len(content) and info.value.max_bytes == max_bytes


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o610, 0o601, 0o620])
def test_any_group_or_other_access_is_refused(tmp_path, mode):
    path = _write(tmp_path / "f", b"secret", mode)
    with pytest.raises(InsecureFileMode) as info:
        read_private_file(path, 100)
    assert info.value.mode == mode and info.value.path == path
    assert f"chmod 600 {path}" in str(info.value)


def test_stricter_modes_are_fine(tmp_path):
    for mode in (0o600, 0o400, 0o700):
        assert read_private_file(_write(tmp_path / f"f{mode:o}", b"ok", mode), 2) == b"ok"


def test_missing_directory_symlink_and_fifo(tmp_path):
    with pytest.raises(PrivateFileNotFound):
        read_private_file(tmp_path / "nope", 10)
    with pytest.raises(NotARegularFile):
        read_private_file(tmp_path, 10)
    real = _write(tmp_path / "real", b"secret")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(PrivateFileUnreadable):  # O_NOFOLLOW: ELOOP, never followed
        read_private_file(tmp_path / "link", 10)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(NotARegularFile):  # O_NONBLOCK: open returns, fstat refuses
        read_private_file(fifo, 10)
    for cls in (PrivateFileNotFound, PrivateFileUnreadable, NotARegularFile,
                InsecureFileMode, OversizeFile):
        assert issubclass(cls, PrivateFileError) and issubclass(cls, ValueError)


def test_a_fifo_never_blocks_either_caller(tmp_path):
    """Before the shared reader, ``open`` of a FIFO blocked until a writer appeared: a
    key_file or secret_file pointing at one hung the node at start."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)

    async def main():
        with trio.fail_after(5):
            with pytest.raises(InsecureKeyFile, match="not a regular file"):
                await trio.to_thread.run_sync(load_identity, fifo, abandon_on_cancel=True)
            with pytest.raises(ValueError, match="not a regular file"):
                await trio.to_thread.run_sync(read_secret_file, fifo, abandon_on_cancel=True)

    trio.run(main)


def test_negative_limit_is_a_caller_bug(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        read_private_file(_write(tmp_path / "f", b""), -1)
