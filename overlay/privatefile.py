"""Reading a private file (a key or a secret) without trusting what sits at the path.

:func:`read_private_file` is the one way node key files (:mod:`.identity`) and tenant
secret files (:mod:`prefixmesh.node.tenants`) are read. It

- opens with ``O_NOFOLLOW`` (a symlink at the path is refused, not followed) and
  ``O_NONBLOCK`` (a FIFO at the path would otherwise block ``open`` until some writer
  shows up; the flag has no effect on reading a regular file);
- checks the *opened* file with ``fstat`` (no race between a check and the open): it must
  be a regular file that grants group and others no access at all (mode 0600 or
  stricter);
- reads at most ``max_bytes + 1`` bytes, so a wrong path (a huge log, a device) costs at
  most that much memory; a file larger than ``max_bytes`` (by its size, or by what could
  be read, since it may grow after the check) is refused.

Errors are typed (:class:`PrivateFileError` and one subclass per failure, each carrying
the path and the facts), so that each caller translates them into its own error types
and messages. Pure code: standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = [
    "PrivateFileError",
    "PrivateFileNotFound",
    "PrivateFileUnreadable",
    "NotARegularFile",
    "InsecureFileMode",
    "OversizeFile",
    "read_private_file",
]

_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class PrivateFileError(ValueError):
    """A private file could not be used. ``path`` is the path as given."""

    def __init__(self, path: Path, message: str):
        self.path = path
        super().__init__(f"{path}: {message}")


class PrivateFileNotFound(PrivateFileError):
    """Nothing exists at the path."""

    def __init__(self, path: Path):
        super().__init__(path, "file not found")


class PrivateFileUnreadable(PrivateFileError):
    """``open`` failed for another reason (permissions, a symlink, a loop...)."""

    def __init__(self, path: Path, strerror: str):
        self.strerror = strerror
        super().__init__(path, f"cannot open ({strerror})")


class NotARegularFile(PrivateFileError):
    """The path names a directory, FIFO, socket or device."""

    def __init__(self, path: Path):
        super().__init__(path, "not a regular file")


class InsecureFileMode(PrivateFileError):
    """Group or others have some access. ``mode`` is the permission bits (e.g. 0o640)."""

    def __init__(self, path: Path, mode: int):
        self.mode = mode
        super().__init__(path, f"accessible by group or others (mode {mode:04o}); "
                               f"fix with: chmod 600 {path}")


class OversizeFile(PrivateFileError):
    """More than ``max_bytes``. ``size`` is the size ``fstat`` reported, or None when the
    file grew past the limit while being read."""

    def __init__(self, path: Path, max_bytes: int, size: int | None):
        self.max_bytes = max_bytes
        self.size = size
        what = f"{size} bytes" if size is not None else "grew"
        super().__init__(path, f"{what}, more than the {max_bytes}-byte limit")


def read_private_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole content of the private file at ``path`` (at most ``max_bytes`` bytes).

    Raises a :class:`PrivateFileError` subclass (see the module docstring); never
    follows a symlink, never blocks on a FIFO.
    """
    if max_bytes < 0:
        raise ValueError("max_bytes must be >= 0")
    path = Path(path)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise PrivateFileNotFound(path) from None
    except OSError as exc:
        raise PrivateFileUnreadable(path, exc.strerror or type(exc).__name__) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(path)
        if st.st_mode & 0o077:
            raise InsecureFileMode(path, stat.S_IMODE(st.st_mode))
        if st.st_size > max_bytes:
            raise OversizeFile(path, max_bytes, st.st_size)
        chunks: list[bytes] = []
        remaining = max_bytes + 1  # the file may have grown since fstat
        while remaining > 0:
            chunk = os.read(fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    content = b"".join(chunks)
    if len(content) > max_bytes:
        raise OversizeFile(path, max_bytes, None)
    return content
