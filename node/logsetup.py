"""Logs for people: one line per record, libraries' noise at DEBUG, text or JSON.

:func:`configure_logging` (the node calls it once at start, ``[node].log_level`` /
``--log-level`` and ``[node].log_format`` / ``--log-format``):

- Every record is one line: multi-line messages and tracebacks are folded (`` | ``
  between the original lines). ``text``: ``TIME LEVEL LOGGER: MESSAGE``. ``json``: one
  object per line, ``{"ts", "level", "logger", "msg"}`` plus the record's structured
  ``fields`` (``extra={"fields": {...}}``, e.g. the per-request line of
  ``node/requestlog.py``) and ``exc`` for a traceback.
- py-libp2p turns its own loggers off by default (``propagate = False``, no handler), so
  its warnings reached stderr through Python's last-resort handler: raw, without time or
  level, often seven lines each (one chat produced 16 ``Failed to open stream ...
  /ipfs/kad/1.0.0`` blocks; a bootstrap peer that is down, 44 ``Failed to open TCP
  stream`` lines in 17 s). Its loggers (and those of multiaddr, zeroconf, async_service,
  anyio) now propagate to our handler, where :class:`LibraryFilter` shows them at DEBUG
  only (our own code logs what an operator can act on: an unreachable bootstrap peer,
  discovery that stopped, ...), except CRITICAL, and at most :data:`BURST` lines per
  logger and message per :data:`WINDOW_S` seconds; the next line after a quiet spell says
  how many were suppressed.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import IO

__all__ = ["LIBRARIES", "LOG_FORMATS", "LibraryFilter", "OneLineFormatter", "JsonFormatter",
           "configure_logging", "fold"]

LIBRARIES = ("libp2p", "multiaddr", "zeroconf", "async_service", "anyio")
LOG_FORMATS = ("text", "json")
WINDOW_S = 60.0
BURST = 5
_MAX_KEYS = 1024
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def fold(text: str) -> str:
    """Several lines as one (blank lines dropped, `` | `` between the others)."""
    if "\n" not in text and "\r" not in text:
        return text
    return " | ".join(s for s in (ln.strip() for ln in text.splitlines()) if s)


def _is_library(name: str) -> bool:
    return name.split(".", 1)[0] in LIBRARIES


class LibraryFilter(logging.Filter):
    """Demotes library records to DEBUG (CRITICAL stays), drops what is below ``level``,
    and rate-limits each (logger, message) to ``burst`` records per ``window_s``."""

    def __init__(self, level: int, *, window_s: float = WINDOW_S, burst: int = BURST,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.level = level
        self.window_s = window_s
        self.burst = burst
        self.clock = clock
        self._windows: dict[tuple[str, str], list[float | int]] = {}  # start, shown, dropped
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_library(record.name):
            return True
        if record.levelno < logging.CRITICAL:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        if record.levelno < self.level:
            return False
        # f-strings are common in these libraries: the first words stand for the message
        key = (record.name, str(record.msg)[:48])
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.window_s:
            dropped = int(window[2]) if window is not None else 0
            if len(self._windows) >= _MAX_KEYS:
                self._windows.clear()
            self._windows[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} similar lines suppressed before this)"
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        self.suppressed += 1
        return False


class OneLineFormatter(logging.Formatter):
    """The text format, every record on one line."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return fold(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line (the module docstring lists the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": fold(record.getMessage()),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                doc.setdefault(str(k), v)
        if record.exc_info:
            doc["exc"] = fold(self.formatException(record.exc_info))
        return json.dumps(doc, ensure_ascii=False, default=str)


def configure_logging(level: str = "info", fmt: str = "text",
                      stream: IO[str] | None = None) -> logging.Handler:
    """Route every log record of the process to one handler on ``stream`` (stderr);
    returns the handler. py-libp2p's import resets its logger; a node imports it after
    this set-up, and ``overlay/host.py`` keeps the set-up through that import."""
    numeric = getattr(logging, str(level).upper(), logging.INFO)
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else OneLineFormatter())
    handler.addFilter(LibraryFilter(numeric))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # the libraries' loggers go to our handler, where LibraryFilter keeps them at DEBUG
    for name in LIBRARIES:
        lib = logging.getLogger(name)
        lib.handlers.clear()
        lib.propagate = True
        # below WARNING a library record is not even created unless we show DEBUG
        lib.setLevel(logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING)
    return handler
