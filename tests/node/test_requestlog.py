"""node/requestlog.py: the one INFO line per request (its facts, an error, no token) and
the observer that logs it. The log plumbing itself is tests/node/test_logsetup.py."""

from __future__ import annotations

import logging
import math

from prefixmesh.node.requestlog import RequestLog, describe_request
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.events import ObserverFanout, RequestDone


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
