"""Unit tests of the log plumbing's pure logic (node/logsetup.py, node/requestlog.py):
folding, library demotion and rate limiting (with a fake clock), JSON lines, and the
per-request line. The real-process checks are in tests/node/test_node_logs.py."""

from __future__ import annotations

import io
import json
import logging
import math

import pytest

from prefixmesh.node.logsetup import (
    JsonFormatter,
    LibraryFilter,
    OneLineFormatter,
    configure_logging,
    fold,
)
from prefixmesh.node.requestlog import RequestLog, describe_request
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.events import ObserverFanout, RequestDone


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


def _event(**kw) -> RequestDone:
    me = Identity.from_seed(b"\x01" * 32).peer_id
    other = Identity.from_seed(b"\x02" * 32).peer_id
    base = dict(request_id=bytes.fromhex("3f2a9c01" + "00" * 12), entry=True,
                action="forward", reason="prefix_hit", served_by=other,
                route=(f"{me.hex()[:4]}: forward (prefix_hit)", "x: serve (local)"),
                prompt_tokens=540, cached_tokens=512, completion_tokens=32,
                ttft_s=0.214, total_s=0.95)
    base.update(kw)
    return RequestDone(**base), me


def test_request_line_has_every_fact():
    ev, me = _event()
    text, fields = describe_request(ev, me)
    assert text.startswith("request 3f2a9c01 entry: forwarded (prefix_hit)")
    for part in ("served by …", "cached 512/540 prompt tokens", "32 tokens", "TTFT 0.21 s",
                 "total 0.95 s", "route "):
        assert part in text, (part, text)
    assert fields["cached_tokens"] == 512 and fields["served_by"].startswith("12D3KooW")
    assert fields["request_id"] == ev.request_id.hex()


def test_request_line_for_an_error_and_no_token():
    ev, me = _event(action="reject", reason="unauthorized", served_by=b"", route=(),
                    completion_tokens=0, cached_tokens=0, ttft_s=math.nan,
                    error="unauthorized", entry=False)
    text, fields = describe_request(ev, me)
    assert "from peer: rejected (unauthorized)" in text and "error unauthorized" in text
    assert "TTFT -" in text and fields["ttft_s"] is None and fields["served_by"] == ""


def test_request_log_is_an_observer_logging_one_info_line(caplog):
    ev, me = _event(served_by=Identity.from_seed(b"\x01" * 32).peer_id, action="serve")
    fan = ObserverFanout([RequestLog(me)])
    with caplog.at_level(logging.INFO, logger="prefixmesh.requests"):
        fan.request_started(ev.request_id, True)
        fan.request_done(ev)
        fan.forwarded("forward", "prefix_hit")
        fan.fallback("peer_down")
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO and "served by this node" in rec.getMessage()
    assert rec.fields["action"] == "serve"
