"""Route execution for ``/prefixmesh/infer``: carry out a plan's targets in order.

:class:`RouteExecutor` takes the targets the planner chose (``overlay/core/planner.py``,
through ``InferService._plan``) and runs them one after the other until one answers:
a forward to a next hop (``remote_source``: one stream, the hop's patience and mid-stream
gap as one moving cancel-scope deadline, the heartbeat ending it at once when the peer
goes down), or local serving (``overlay/serving.py``). A target that fails before any
token went upstream is a ``fallback`` hop and the next one is tried. A failure *after*
tokens were relayed is resumed when sampling is deterministic: :class:`Relay` checks the
replacement's output against the text already sent and relays only the rest; otherwise
the requester gets ``upstream_failed``. Every path ends with FINAL+END or ERROR.

Admission, planning and the request pipeline stay in ``overlay/infer.py``; spot checks of
answered forwards are ``overlay/spotcheck.py`` (``on_answered``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import trio

from .core import wire
from .core.identity import peer_id_to_b58
from .core.limits import ForwardShareLimiter
from .core.routing import Candidate, RouteContext, candidate_cost_s
from .core.trust import TrustTracker
from .heartbeat import Heartbeat
from .host import FramedStream, HostError, OverlayHost
from .serving import LocalServer

__all__ = ["LOCAL", "RETRYABLE_CODES", "Observed", "Relay", "RouteExecutor"]

log = logging.getLogger(__name__)

#: ERROR codes from a next hop after which another node may still succeed ("duplicate":
#: that node is already handling this request id, e.g. it got the first attempt of a
#: fallback through another path; "unknown_namespace": the next hop does not serve the
#: tenant - digests only list namespaces a peer has cached something in, so a shedding
#: or baseline policy may pick a peer that does not; another node, or this one, can)
RETRYABLE_CODES = frozenset(
    {"overloaded", "no_route", "shutting_down", "internal", "upstream_failed", "duplicate",
     "unknown_namespace", "unknown_model"}
)
#: appended to a forward's reason in the route trace when the link to the next peer is
#: relayed (a /p2p-circuit connection)
RELAYED_MARK = " [relayed]"
#: how long a peer that answered "unknown_namespace" is not offered that namespace again
NOT_SERVING_TTL_S = 60.0
_MAX_NOT_SERVING = 4096
LOCAL = b""  # sentinel target: serve here


class HopFailed(Exception):
    """The next hop failed (reason in the message)."""


class Diverged(Exception):
    """A resumed source's output differs from what was already sent upstream."""


@dataclass
class Relay:
    """What has been sent upstream; filters a resumed source's repeated output."""

    emit: Callable[[wire.Frame], Awaitable[None]]
    sent_text: str = ""
    sent_frames: int = 0
    replay: str | None = None  # text a resumed source must reproduce before relaying
    finished: bool = False
    # what the observer's RequestDone reports (InferService._done_event)
    action: str = "pending"  # serve | forward | fallback | reject, once known
    reason: str = ""
    error: str = ""  # the code of the ERROR frame sent upstream, if one was
    final: wire.Final | None = None
    t_first: float | None = None  # when the first TOKENS/FINAL went upstream

    async def tokens(self, frame: wire.Tokens) -> None:
        if self.replay is not None:
            self.replay += frame.text
            if len(self.replay) < len(self.sent_text):
                if not self.sent_text.startswith(self.replay):
                    raise Diverged()
                return
            if not self.replay.startswith(self.sent_text):
                raise Diverged()
            rest = self.replay[len(self.sent_text) :]
            self.replay = None
            if not rest:
                return
            frame = wire.Tokens(rest, ())
        self.sent_text += frame.text
        self.sent_frames += 1
        await self.emit(frame)

    async def fail(self, code: str, message: str) -> None:
        """End the request with an ERROR frame upstream."""
        self.finished = True
        await self.emit(wire.Error(code, message[: wire.MAX_ERROR_CHARS]))


@dataclass
class Observed:
    """What one remote source returned (for spot checks): its text, token ids, FINAL."""

    text: list[str]
    ids: list[int]
    ids_complete: bool = True  # every TOKENS frame carried the ids of its text
    final: wire.Final | None = None


class RouteExecutor:
    """Runs a request's targets in order (forward, fallback, resume; see the module doc).

    ``settings`` is the service's ``InferSettings`` (hop patience, gap, stream and send
    timeouts); ``stats`` the service's counters, shared; ``observe(method, *args)`` tells
    the service's observer; ``on_answered(peer, req, observed)`` hears each forward a
    peer answered in full (spot checks)."""

    def __init__(self, *, me: bytes, host: OverlayHost, heartbeat: Heartbeat,
                 server: LocalServer, settings, clock: Callable[[], float],
                 stats: dict[str, int], observe: Callable[..., None],
                 on_answered: Callable[[bytes, wire.Request, Observed], None],
                 trust: TrustTracker | None = None,
                 share_limiter: ForwardShareLimiter | None = None):
        self.me = me
        self.host = host
        self.heartbeat = heartbeat
        self.server = server
        self.settings = settings
        self.clock = clock
        self.stats = stats
        self.observe = observe
        self.on_answered = on_answered
        self.trust = trust
        self.share_limiter = share_limiter
        # (peer, ns) -> until when: peers that said they do not serve a namespace
        self._not_serving: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()

    async def fail(self, relay: Relay, code: str, message: str) -> None:
        self.stats["errors"] += 1
        await relay.fail(code, message)

    # --- running the targets ---------------------------------------------------------

    async def run(self, req: wire.Request, relay: Relay, t_recv: float, targets: list[bytes],
                  decision, hop_base: wire.Hop,
                  claims: dict[bytes, Candidate] | None = None,
                  ctx: RouteContext | None = None) -> None:
        """Try ``targets`` (peer ids, or :data:`LOCAL`) until one answers; ``decision``
        and ``hop_base`` describe this node's hop in the trace, ``claims`` what each
        candidate claimed (trust and patience), ``ctx`` the planner's route context."""
        extra_hops: list[wire.Hop] = []
        failure: str | None = None
        failed: list[bytes] = []
        for i, target in enumerate(targets):
            if relay.sent_frames and req.sampling.temperature > 0.0:
                await self.fail(
                    relay, "upstream_failed",
                    "the serving node failed mid-stream (sampling is random: not resumable)")
                return
            if relay.sent_frames:
                relay.replay = ""
                self.stats["resumed"] += 1
            observed = Observed([], [])
            hop, source = self._source(req, t_recv, target, i, failed, extra_hops, decision,
                                       hop_base, (claims or {}).get(target), ctx, observed)
            relay.action = ("fallback" if failed else "serve" if target == LOCAL else "forward")
            relay.reason = hop.reason
            sent_before = relay.sent_frames
            failure = await self.pump(relay, source)
            if failure is None:
                if target != LOCAL and sent_before == 0 and observed.final is not None:
                    self.on_answered(target, req, observed)
                return
            self._hop_failed(req, target, hop, failure, failed, extra_hops)
        if relay.finished:
            return
        await self.fail(
            relay, "no_route",
            f"every candidate failed (last: {failure})" if targets
            else "no node may serve this request")

    def _source(self, req, t_recv, target, i, failed, extra_hops, decision, hop_base,
                claimed: Candidate | None, ctx: RouteContext | None, observed: Observed):
        """The hop record and frame producer for one target."""
        if target == LOCAL:
            reason = (
                hop_base.reason
                if (decision is None or decision.action == "serve") and not failed
                else f"fallback: {len(failed)} forward(s) failed"
            )
            hop = replace(hop_base, action="serve", reason=reason[: wire.MAX_SHORT_STRING])
            self.stats["served_local"] += 1
            return hop, self.server.source(req, t_recv, [*req.trace, *extra_hops], hop)
        reason = hop_base.reason if i == 0 else "fallback after a failed hop"
        if getattr(self.host, "link_kind", lambda p: None)(target) == "relayed":
            # the link goes through a relay (issue 16): the trace says so
            reason = reason[: wire.MAX_SHORT_STRING - len(RELAYED_MARK)] + RELAYED_MARK
        hop = replace(hop_base, action="forward", next_peer=target,
                      reason=reason[: wire.MAX_SHORT_STRING])
        visited = (*req.visited, self.me, *failed)[-wire.MAX_HOPS :]
        downstream = replace(
            req,
            hop_budget=max(0, req.hop_budget - 1),
            visited=tuple(dict.fromkeys(visited)),
            trace=(*req.trace, *extra_hops, hop)[-wire.MAX_HOPS :],
        )
        source = self.remote_source(target, downstream, t_recv, claimed, observed,
                                    self.patience_s(ctx, claimed))
        self.stats["forwarded"] += 1
        if self.share_limiter is not None:
            self.share_limiter.record(target, self.clock())
        self.observe("forwarded", "forward" if i == 0 and not failed else "fallback", hop.reason)
        return hop, source

    def _hop_failed(self, req: wire.Request, target: bytes, hop: wire.Hop, failure: str,
                    failed: list[bytes], extra_hops: list[wire.Hop]) -> None:
        self.stats["fallbacks"] += 1
        self.observe("fallback", failure)
        log.info("request %s: hop %s failed: %s", req.id.hex()[:8],
                 "local" if target == LOCAL else peer_id_to_b58(target)[-8:], failure)
        if target == LOCAL:
            return
        failed.append(target)
        if failure.startswith("unknown_namespace"):
            # not a fault: it just does not serve this tenant; skip it for a while
            self.mark_not_serving(target, req.ns)
        elif self.trust is not None:
            self.trust.observe_failure(target, self.clock())
        extra_hops.append(
            replace(hop, action="fallback", reason=f"failed: {failure}"[: wire.MAX_SHORT_STRING])
        )

    async def pump(
        self, relay: Relay, produce: Callable[[trio.MemorySendChannel], Awaitable[None]]
    ) -> str | None:
        """Relay the frames one source produces; None when the request is finished
        (FINAL+END or a final ERROR went upstream), else why this source failed (the
        caller tries the next one).

        The source runs as a task feeding a channel (never as an async generator, whose
        yields inside nurseries and cancel scopes trio does not allow)."""
        send, recv = trio.open_memory_channel[wire.Frame](16)
        failure: list[str] = []
        runner_done = trio.Event()

        async def runner() -> None:
            async with send, _set_on_exit(runner_done):
                try:
                    await produce(send)
                except HopFailed as exc:
                    failure.append(str(exc))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

        async def consume() -> str | None:
            async with recv:
                async for frame in recv:
                    outcome = await self._relay_frame(relay, frame)
                    if outcome != "more":
                        return outcome
            return failure[0] if failure else "stream ended without FINAL"

        # Exceptions are caught inside the nursery body and re-raised after it, so that
        # callers see plain exceptions, not ExceptionGroups.
        outcome: str | None = None
        raised: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner)
            try:
                outcome = await consume()
            except Exception as exc:
                raised = exc
            if raised is None and outcome is None:
                # finished: let the source read its END and close cleanly (bounded)
                with trio.move_on_after(1.0):
                    await runner_done.wait()
            nursery.cancel_scope.cancel()
        if isinstance(raised, Diverged):
            await self.fail(relay, "upstream_failed",
                            "the serving node failed mid-stream and the replacement's output "
                            "differs")
            return None
        if raised is not None:
            raise raised
        return outcome

    async def _relay_frame(self, relay: Relay, frame: wire.Frame) -> str | None:
        """Pass one source frame upstream: "more" to go on, None when the request is
        finished, else the retryable failure. (No cancel here: leaving ``async with recv``
        is a checkpoint, and a cancellation there would swallow the return value.)"""
        if isinstance(frame, wire.Tokens):
            await relay.tokens(frame)
        elif isinstance(frame, wire.Final):
            if relay.replay is not None:  # the replacement said less than we sent
                raise Diverged()
            relay.finished = True
            await relay.emit(frame)
            await relay.emit(wire.End())
            return None
        elif isinstance(frame, wire.Error):
            if frame.code in RETRYABLE_CODES:
                return f"{frame.code}: {frame.message}"[:200]
            relay.finished = True
            self.stats["errors"] += 1
            await relay.emit(frame)
            return None
        return "more"

    # --- one forward -----------------------------------------------------------------

    def remote_source(self, peer: bytes, req: wire.Request, t_recv: float,
                      claimed: Candidate | None = None, observed: Observed | None = None,
                      patience_s: float | None = None):
        """A frame producer that forwards ``req`` to ``peer`` and relays its answer."""
        s = self.settings
        patience_s = s.first_frame_timeout_s if patience_s is None else patience_s

        async def produce(out: trio.MemorySendChannel) -> None:
            if not self.heartbeat.is_up(peer):
                raise HopFailed("peer is down")
            fs = await self._send_request(peer, req)
            state = wire.InferStreamState()
            failure: list[str] = []
            try:
                state.request_sent(req)
                async with trio.open_nursery() as nursery:

                    async def down_watch() -> None:
                        await self.heartbeat.wait_down(peer)
                        failure.append("peer went down (heartbeat)")
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(down_watch)
                    # one cancel scope whose deadline moves: the hop's patience until its
                    # first frame, then max_frame_gap_s after every frame
                    first_seen: list[bool] = []
                    with trio.CancelScope(deadline=trio.current_time() + patience_s) as quiet:
                        await self._read_hop(fs, state, peer, out, t_recv, claimed, observed,
                                             quiet, failure, first_seen)
                    if quiet.cancelled_caught and not failure:
                        failure.append(
                            f"no first frame within {patience_s:.1f} s (patience)"
                            if not first_seen else
                            f"stalled for {s.max_frame_gap_s:.1f} s mid-stream")
                    nursery.cancel_scope.cancel()
                if failure:
                    raise HopFailed(failure[0])
            finally:
                with trio.CancelScope(shield=True):
                    if state.finished:
                        await fs.close()
                    else:
                        await fs.reset()

        return produce

    async def _send_request(self, peer: bytes, req: wire.Request) -> FramedStream:
        """Open a stream to ``peer`` (a pooled spare when there is one) and send ``req``."""
        s = self.settings
        for attempt in range(2):  # a pooled spare may be dead: retry once with a new one
            try:
                stream, pooled = await self.host.take_stream(peer, wire.INFER_PROTOCOL,
                                                             s.stream_timeout_s)
            except HostError as exc:
                self.heartbeat.mark_down(peer)
                self.host.drop_pool(peer)
                raise HopFailed(f"open stream: {exc}") from None
            fs = FramedStream(stream, timeout_s=s.send_timeout_s)
            try:
                await fs.send(req)
                return fs
            except HostError as exc:
                with trio.CancelScope(shield=True):
                    await fs.reset()
                if not pooled or attempt:
                    raise HopFailed(f"send request: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _read_hop(self, fs: FramedStream, state: wire.InferStreamState, peer: bytes,
                        out: trio.MemorySendChannel, t_recv: float, claimed: Candidate | None,
                        observed: Observed | None, quiet: trio.CancelScope,
                        failure: list[str], first_seen: list[bool]) -> None:
        """Relay a next hop's frames into ``out``; each frame moves ``quiet``'s deadline
        (the most silence tolerated mid-stream). Failures go to ``failure``;
        ``first_seen`` gets an entry at the first TOKENS or FINAL frame."""
        ttft_ms = -1.0
        try:
            while True:
                frame = await fs.receive(timeout_s=math.inf)
                if frame is None:
                    raise HopFailed("stream ended early")
                state.on_response(frame)
                quiet.deadline = trio.current_time() + self.settings.max_frame_gap_s
                if not first_seen and isinstance(frame, wire.Tokens | wire.Final):
                    first_seen.append(True)
                    ttft_ms = (self.clock() - t_recv) * 1000.0
                    # now, not earlier: see OverlayHost.take_stream
                    self.host.refill_pool(peer, wire.INFER_PROTOCOL)
                if observed is not None:
                    _note(observed, frame)
                if isinstance(frame, wire.Final):
                    frame = _patch_ttft(frame, self.me, ttft_ms)
                    if self.trust is not None:
                        self.observe_final(peer, claimed, frame)
                if isinstance(frame, wire.End):
                    return
                await out.send(frame)
                if isinstance(frame, wire.Error):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except (HostError, wire.WireError) as exc:
            failure.append(f"{type(exc).__name__}: {exc}")
        except HopFailed as exc:
            failure.append(str(exc))

    def patience_s(self, ctx: RouteContext | None, c: Candidate | None) -> float:
        """How long to wait for a next hop's first frame: ``first_frame_factor`` x the
        policy's estimate for it (its claimed cache taken at face value, so a peer that
        claims much and delivers slowly is dropped early), within [floor, timeout]."""
        s = self.settings
        if ctx is None or c is None:
            return s.first_frame_timeout_s
        est = candidate_cost_s(ctx, c, use_trust=False)
        return min(s.first_frame_timeout_s, max(s.first_frame_floor_s, s.first_frame_factor * est))

    def observe_final(self, peer: bytes, claimed: Candidate | None, final: wire.Final) -> None:
        """Trust rules (a) and (c) for the next hop ``peer`` we forwarded to.

        (a) is judged by the outcome, whoever served: we went to ``peer`` for the cache it
        claimed, and the FINAL frame says how much was reused. A peer that passes the
        request on is accountable for what its relay delivered, otherwise a liar escapes
        every penalty by relaying what it attracts (measured: 7 of 10 forwards to a lying
        node relayed, trust still 0.55). An honest relay to a longer holder is honoured;
        one to a shorter holder is a proportional miss, like any stale claim.
        (c) needs the peer's own prefill time, so only a FINAL it served counts."""
        assert self.trust is not None
        now = self.clock()
        self.trust.observe_cache(
            peer, now, claimed_tokens=claimed.matched_tokens if claimed else 0,
            cached_tokens=final.cached_tokens)
        if claimed is None or final.serving != peer or claimed.prefill_tps <= 0 \
                or final.ttft_ms < 0:
            return
        # its TTFT counts from its receipt of the request: minus the queue wait it
        # advertised, the rest is restore + prefill (the generous trust.CAPACITY_OK_RATIO
        # absorbs a stale queue figure)
        prefill_s = max(0.0, final.ttft_ms / 1000.0 - claimed.queue_wait_s)
        self.trust.observe_capacity(
            peer, now, claimed_prefill_tps=claimed.prefill_tps,
            uncached_tokens=max(0, final.prompt_tokens - final.cached_tokens),
            prefill_s=prefill_s)

    # --- peers that do not serve a namespace -----------------------------------------

    def mark_not_serving(self, peer: bytes, ns: bytes) -> None:
        key = (peer, ns)
        self._not_serving[key] = self.clock() + NOT_SERVING_TTL_S
        self._not_serving.move_to_end(key)
        while len(self._not_serving) > _MAX_NOT_SERVING:
            self._not_serving.popitem(last=False)

    def is_not_serving(self, peer: bytes, ns: bytes) -> bool:
        until = self._not_serving.get((peer, ns))
        if until is None:
            return False
        if self.clock() >= until:
            del self._not_serving[(peer, ns)]
            return False
        return True


def _note(observed: Observed, frame: wire.Frame) -> None:
    if isinstance(frame, wire.Tokens):
        observed.text.append(frame.text)
        observed.ids.extend(frame.token_ids)
        if frame.text and not frame.token_ids:
            observed.ids_complete = False
    elif isinstance(frame, wire.Final):
        observed.final = frame


@contextlib.asynccontextmanager
async def _set_on_exit(event: trio.Event):
    try:
        yield
    finally:
        event.set()


def _patch_ttft(final: wire.Final, me: bytes, ttft_ms: float) -> wire.Final:
    hops = list(final.hops)
    for i in range(len(hops) - 1, -1, -1):
        if hops[i].peer == me and hops[i].action == "forward":
            hops[i] = replace(hops[i], ttft_ms=ttft_ms)
            break
    return replace(final, hops=tuple(hops))
