"""What the inference service tells the world about its requests: one observer interface.

``InferService`` reports each request it handles to an :class:`InferObserver`: the
Prometheus metrics (``node/metrics.py``), the dashboard's recent route traces and the
one-INFO-line-per-request log all consume these same events, so nothing counts a request
twice or in two ways. Observers are called on the trio thread and must not block; an
observer that raises is a bug in the observer and is logged, never allowed to fail a
request (``ObserverFanout`` contains it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["RequestDone", "InferObserver", "NullObserver", "ObserverFanout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestDone:
    """One request as this node saw it, once it ended (answered or failed)."""

    request_id: bytes
    entry: bool  # True: a client sent it to this node; False: a peer forwarded it here
    action: str  # this node's decision: "serve" | "forward" | "fallback" | "reject"
    reason: str  # why (the planner's reason, or the error code for a rejection)
    served_by: bytes  # peer id of the node that ran the model (b"" if none did)
    route: tuple[str, ...]  # one "peer: action (reason)" line per hop, entry first
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a cache at the serving node
    completion_tokens: int
    ttft_s: float  # at this node, from receipt of the request (nan if no token came)
    total_s: float  # at this node, from receipt to the end
    error: str = ""  # stable error code ("" if answered): unauthorized, no_route, ...
    ns: bytes = b""  # the request's namespace id (the dashboard's hits per namespace)


class InferObserver(Protocol):
    def request_started(self, request_id: bytes, entry: bool) -> None: ...

    def request_done(self, event: RequestDone) -> None: ...

    def forwarded(self, decision: str, reason: str) -> None: ...

    def fallback(self, reason: str) -> None: ...


class NullObserver:
    def request_started(self, request_id: bytes, entry: bool) -> None:
        pass

    def request_done(self, event: RequestDone) -> None:
        pass

    def forwarded(self, decision: str, reason: str) -> None:
        pass

    def fallback(self, reason: str) -> None:
        pass


class ObserverFanout:
    """Several observers as one; a failing observer is logged once per method, not raised."""

    def __init__(self, observers: Sequence[InferObserver] = ()):
        self.observers = list(observers)
        self._logged: set[tuple[int, str]] = set()

    def add(self, observer: InferObserver) -> None:
        self.observers.append(observer)

    def _call(self, method: str, *args) -> None:
        for obs in self.observers:
            try:
                getattr(obs, method)(*args)
            except Exception:  # an observer bug must never fail a request
                key = (id(obs), method)
                if key not in self._logged:
                    self._logged.add(key)
                    log.exception("observer %r failed in %s", obs, method)

    def request_started(self, request_id: bytes, entry: bool) -> None:
        self._call("request_started", request_id, entry)

    def request_done(self, event: RequestDone) -> None:
        self._call("request_done", event)

    def forwarded(self, decision: str, reason: str) -> None:
        self._call("forwarded", decision, reason)

    def fallback(self, reason: str) -> None:
        self._call("fallback", reason)
