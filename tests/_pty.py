"""A child process on a pseudo-terminal that is its controlling terminal (``pty.fork``):
the program sees a tty (prompt, colours) and Ctrl-C written to it is a real SIGINT to
the terminal's foreground process group. Shared by the chat and example-script tests."""

from __future__ import annotations

import os
import pty
import select
import signal
import time
from collections.abc import Callable, Mapping


class Terminal:
    def __init__(self, argv: list[str], env: Mapping[str, str] | None = None, *,
                 wait_s: float = 30.0, exit_s: float = 15.0):
        self.wait_s, self.exit_s = wait_s, exit_s
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            if env is None:
                os.execv(argv[0], argv)
            os.execve(argv[0], argv, dict(env))
        self.out = b""

    def _read(self, wait_s: float) -> bool:
        """Append what the terminal has within ``wait_s``; False once it is closed."""
        try:
            if select.select([self.fd], [], [], wait_s)[0]:
                self.out += os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        return True

    def wait_until(self, predicate: Callable[[bytes], bool], timeout: float | None = None,
                   what: str = "condition") -> None:
        deadline = time.monotonic() + (self.wait_s if timeout is None else timeout)
        while not predicate(self.out):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not met; output: {self.out[-3000:]!r}")
            if not self._read(0.2) and not predicate(self.out):
                raise AssertionError(
                    f"{what} not met (terminal closed); output: {self.out[-3000:]!r}")

    def wait_for(self, needle: bytes, start: int = 0, timeout: float | None = None) -> int:
        """Position just after the first ``needle`` at or after ``start``."""
        self.wait_until(lambda out: out.find(needle, start) >= 0, timeout, f"{needle!r} seen")
        return self.out.find(needle, start) + len(needle)

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def exit_code(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (self.exit_s if timeout is None else timeout)
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if not self._read(0.2):
                time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the program did not exit; output: {self.out[-3000:]!r}")
