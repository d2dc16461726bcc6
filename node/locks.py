"""One node per key file and per cache directory: advisory ``fcntl.flock`` locks.

Two processes on one key file run as the same peer id (peers cannot tell them apart, and
one's shutdown deleted the other's ``node.addrs``); two on one cache directory write each
other's KV files. A running node therefore holds, for its whole life:

- ``<key file>.lock`` (next to the key file; taken *before* the key is read or created, so
  two nodes started at once cannot both create an identity), and
- ``<cache dir>/node.lock``.

Each lock file holds the holder's PID, so the refusal names the process. ``flock`` locks
belong to the open file and vanish when the process dies (even by SIGKILL): a stale lock
file never blocks a later start. Paths are resolved first, so a symlink or a relative
path to the same file is the same lock.

A start that fails (a bad key file, a port in use, ...) calls :meth:`NodeLock.undo`:
the lock files and folders that this start created are removed again, so a refused
configuration leaves nothing behind. A normal stop keeps the lock files (unlinking a
lock file that another process may be opening at that moment could let two processes
hold "the" lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

__all__ = ["LockError", "NodeLock", "lock_key_file", "lock_cache_dir", "check_cache_dir"]


class LockError(OSError):
    """A key file or cache directory is in use, or is not usable as one."""


class NodeLock:
    """An exclusive flock on ``path`` (created mode 0600) holding our PID; ``what`` names
    the protected thing in messages (e.g. "key file /x/node.key")."""

    def __init__(self, path: Path, what: str, hint: str, made_dirs: list[Path] | None = None):
        self.path = path
        self.what = what
        self.hint = hint
        self.made_dirs = made_dirs or []  # folders created for this lock, outermost first
        self.created = False  # the lock file did not exist before
        self._fd: int | None = None

    def acquire(self) -> NodeLock:
        self.created = not self.path.exists()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            raise LockError(f"{self.what}: cannot create its lock file {self.path}: "
                            f"{exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"process {holder}" if holder else "another process"
                raise LockError(f"{self.what} is in use by another node ({who}, lock "
                                f"{self.path}); stop it or {self.hint}") from None
            raise LockError(f"{self.what}: cannot lock {self.path}: {exc.strerror}") from None
        with contextlib.suppress(OSError):  # the PID is only for messages
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no stale PID for the next reader
            os.close(fd)  # closing drops the flock

    def undo(self) -> None:
        """Release, and remove what this start created (a start that failed)."""
        held = self.held
        self.release()
        if held and self.created:
            with contextlib.suppress(OSError):
                self.path.unlink()
        for d in reversed(self.made_dirs):
            with contextlib.suppress(OSError):  # only if empty
                d.rmdir()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> NodeLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_key_file(path: Path) -> NodeLock:
    """Lock the key file at ``path`` (which may not exist yet); raises :class:`LockError`."""
    path = Path(path).expanduser().resolve()
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise LockError(f"key file {path}: {parent} is not a directory")
    made = _missing_dirs(parent)
    if made:  # like save_identity: directories holding keys are private
        try:
            for d in made:
                d.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise LockError(f"key file {path}: cannot create {parent}: {exc.strerror}") from None
    return NodeLock(parent / f"{path.name}.lock", f"key file {path}",
                    "give this node its own key ([node].key_file, --key-file)",
                    made).acquire()


def _missing_dirs(path: Path) -> list[Path]:
    """The folders that creating ``path`` would create, outermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing[::-1]


def check_cache_dir(path: Path, made: list[Path] | None = None) -> Path:
    """``path`` resolved and created if missing (the folders created are appended to
    ``made``); :class:`LockError` if it is not a folder."""
    path = Path(path).expanduser().absolute()
    if made is not None:
        made.extend(_missing_dirs(path))
    if path.exists() and not path.is_dir():
        raise LockError(f"cache directory {path} exists but is not a directory; "
                        "remove it or choose another ([node].cache_dir, --cache-dir)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a component of the path is a file
        raise LockError(f"cache directory {path}: a parent of it is a file, not a "
                        "directory ([node].cache_dir, --cache-dir)") from None
    except NotADirectoryError:
        raise LockError(f"cache directory {path}: a parent of it is a file, not a "
                        "directory ([node].cache_dir, --cache-dir)") from None
    except OSError as exc:
        raise LockError(f"cache directory {path}: cannot create it: {exc.strerror}") from None
    return path.resolve()


def lock_cache_dir(path: Path) -> NodeLock:
    """Lock the cache directory (created if missing); raises :class:`LockError`."""
    made: list[Path] = []
    path = check_cache_dir(path, made)
    return NodeLock(path / "node.lock", f"cache directory {path}",
                    "give this node its own cache directory ([node].cache_dir, "
                    "--cache-dir)", made).acquire()
