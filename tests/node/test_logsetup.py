"""Unit tests of the log plumbing's pure logic (node/logsetup.py): folding, library demotion
and rate limiting (with a fake clock), JSON lines. The per-request line (node/requestlog.py)
is tests/node/test_requestlog.py; the real-process checks are in tests/node/test_node_logs.py."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from prefixmesh.node.logsetup import (
    JsonFormatter,
    LibraryFilter,
    OneLineFormatter,
    configure_logging,
    fold,
)


def _record(name: str, level: int, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_fold_joins_lines():
    assert fold("one") == "one"
    assert fold("Failed to open stream to peer X:\n  Error: boom\n\n  tried: /ipfs/kad/1.0.0") \
        == "Failed to open stream to peer X: | Error: boom | tried: /ipfs/kad/1.0.0"


def test_library_records_are_debug_and_rate_limited():
    now = [0.0]
    f = LibraryFilter(logging.DEBUG, window_s=60.0, burst=3, clock=lambda: now[0])
    shown = [f.filter(_record("libp2p.transport.tcp", logging.ERROR,
                              "Failed to open TCP stream: %s", i)) for i in range(10)]
    assert shown == [True] * 3 + [False] * 7
    assert f.suppressed == 7
    now[0] = 61.0  # a new window: the next line says how many were dropped
    rec = _record("libp2p.transport.tcp", logging.ERROR, "Failed to open TCP stream: %s", 11)
    assert f.filter(rec)
    assert rec.levelname == "DEBUG" and "7 similar lines suppressed" in rec.getMessage()
    # another message of the same logger has its own budget
    assert f.filter(_record("libp2p.transport.tcp", logging.WARNING, "something else"))


def test_library_records_are_hidden_at_info_but_ours_are_not():
    f = LibraryFilter(logging.INFO)
    assert not f.filter(_record("libp2p.kad_dht.peer_routing", logging.WARNING,
                                "Failed to open stream to X"))
    assert f.filter(_record("libp2p", logging.CRITICAL, "the host cannot listen"))
    ours = _record("prefixmesh.overlay.discovery", logging.WARNING, "bootstrap down")
    assert f.filter(ours) and ours.levelname == "WARNING"


def test_text_format_is_one_line_even_with_a_traceback():
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        import sys

        rec = logging.LogRecord("prefixmesh.x", logging.ERROR, __file__, 1, "failed:\n%s",
                                ("detail",), sys.exc_info())
    line = OneLineFormatter().format(rec)
    assert "\n" not in line and "ERROR prefixmesh.x: failed: | detail" in line
    assert "ValueError: bad | thing" in line


def test_json_format_carries_fields():
    rec = _record("prefixmesh.requests", logging.INFO, "request %s done", "ab")
    rec.fields = {"request_id": "ab", "ttft_s": 0.5, "level": "ignored: base keys win"}
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["msg"] == "request ab done" and doc["level"] == "info"
    assert doc["logger"] == "prefixmesh.requests" and doc["request_id"] == "ab"
    assert doc["ttft_s"] == 0.5 and doc["ts"].endswith("+00:00")


def test_configure_logging_routes_libp2p_through_our_handler():
    out = io.StringIO()
    try:
        configure_logging("debug", "text", stream=out)
        logging.getLogger("libp2p.transport.tcp").error("Failed to open TCP stream: x\ny")
        logging.getLogger("prefixmesh.test").info("hello")
        lines = out.getvalue().splitlines()
        assert any("DEBUG libp2p.transport.tcp: Failed to open TCP stream: x | y" in ln
                   for ln in lines), lines
        assert any("INFO prefixmesh.test: hello" in ln for ln in lines), lines
        out = io.StringIO()
        configure_logging("info", "json", stream=out)
        logging.getLogger("libp2p.transport.tcp").error("Failed to open TCP stream: z")
        logging.getLogger("prefixmesh.test").warning("careful")
        docs = [json.loads(ln) for ln in out.getvalue().splitlines() if ln.strip()]
        assert [d["msg"] for d in docs] == ["careful"]
        with pytest.raises(ValueError):
            configure_logging("info", "xml", stream=out)
    finally:
        for h in list(logging.getLogger().handlers):
            logging.getLogger().removeHandler(h)


def test_the_set_up_survives_py_libp2p_s_import_by_the_host():
    """py-libp2p's first import turns its logger off (no handler, no propagation); a node
    sets up logging before the host imports it (overlay/host.py keeps that set-up). A
    fresh process: the import must really be the first."""
    done = subprocess.run([sys.executable, "-c",
                           "import logging, sys\n"
                           "from prefixmesh.node.logsetup import configure_logging\n"
                           "from prefixmesh.overlay import host\n"
                           "configure_logging('debug', 'text', stream=sys.stdout)\n"
                           "assert 'libp2p' not in sys.modules\n"
                           "host._import_libp2p()\n"
                           "logging.getLogger('libp2p.swarm').warning('kept after the import')\n"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "DEBUG libp2p.swarm: kept after the import" in done.stdout, done.stdout
