"""One INFO line per request: an :class:`~prefixmesh.overlay.events.InferObserver`.

The daemon hands it to ``InferService`` (``observer=``), so the line describes exactly
the events that the metrics count. Text::

    request 3f2a9c01 entry: served here (prefix_hit), served by …Qm7x, cached 512/540
    prompt tokens, 32 tokens, TTFT 0.21 s, total 0.95 s

and with ``--log-format json`` the same facts as fields (``request_id``, ``entry``,
``action``, ``reason``, ``served_by``, ``route``, ``prompt_tokens``, ``cached_tokens``,
``completion_tokens``, ``ttft_s``, ``total_s``, ``error``). A request a peer forwarded
here is logged as ``from peer``; one this node forwarded shows the route it took.
"""

from __future__ import annotations

import logging
import math

from prefixmesh.overlay.core.identity import peer_id_to_b58
from prefixmesh.overlay.events import RequestDone

__all__ = ["RequestLog", "describe_request"]

_MAX_ROUTE_CHARS = 400


def _b58(peer: bytes) -> str:
    if not peer:
        return ""
    try:
        return peer_id_to_b58(peer)
    except Exception:  # not a peer id we can print: still one line, never an error
        return peer.hex()


def _peer(peer: bytes, self_id: bytes) -> str:
    if not peer:
        return "nobody"
    if peer == self_id:
        return "this node"
    return "…" + _b58(peer)[-8:]


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if isinstance(x, int | float) and math.isfinite(x) else "-"


def describe_request(ev: RequestDone, self_id: bytes = b"") -> tuple[str, dict]:
    """The line (text) and its fields (JSON) for one finished request."""
    rid = ev.request_id.hex()[:8]
    where = "entry" if ev.entry else "from peer"
    did = {"serve": "served here", "forward": "forwarded", "fallback": "fell back to local",
           "reject": "rejected"}.get(ev.action, ev.action)
    parts = [f"request {rid} {where}: {did}" + (f" ({ev.reason})" if ev.reason else "")]
    if ev.error:
        parts.append(f"error {ev.error}")
    if ev.served_by:
        parts.append(f"served by {_peer(ev.served_by, self_id)}")
    parts.append(f"cached {ev.cached_tokens}/{ev.prompt_tokens} prompt tokens")
    parts.append(f"{ev.completion_tokens} tokens")
    parts.append(f"TTFT {_seconds(ev.ttft_s)}")
    parts.append(f"total {_seconds(ev.total_s)}")
    route = " -> ".join(ev.route)
    if len(ev.route) > 1:
        parts.append(f"route {route[:_MAX_ROUTE_CHARS]}")
    fields = {
        "request_id": ev.request_id.hex(),
        "entry": ev.entry,
        "action": ev.action,
        "reason": ev.reason,
        "served_by": _b58(ev.served_by),
        "route": list(ev.route),
        "prompt_tokens": ev.prompt_tokens,
        "cached_tokens": ev.cached_tokens,
        "completion_tokens": ev.completion_tokens,
        "ttft_s": ev.ttft_s if math.isfinite(ev.ttft_s) else None,
        "total_s": ev.total_s if math.isfinite(ev.total_s) else None,
        "error": ev.error,
    }
    return ", ".join(parts), fields


class RequestLog:
    """Logs each finished request at INFO on ``logger`` (default ``prefixmesh.requests``)."""

    def __init__(self, self_id: bytes = b"", logger: logging.Logger | None = None):
        self.self_id = self_id
        self.log = logger or logging.getLogger("prefixmesh.requests")

    def request_started(self, request_id: bytes, entry: bool) -> None:
        pass

    def request_done(self, event: RequestDone) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        try:
            text, fields = describe_request(event, self.self_id)
        except Exception:  # a malformed event: say so on one line, never fail the request
            self.log.info("request %r finished (undescribable event)", event)
            return
        self.log.info("%s", text, extra={"fields": fields})

    def forwarded(self, decision: str, reason: str) -> None:
        pass

    def fallback(self, reason: str) -> None:
        pass
