"""``/prefixmesh/infer/1.0.0``: hop-by-hop routing, forwarding and serving of requests.

Every node on a request's path decides for itself (no coordinator):

1. check the request (deadline, loop, duplicate id, namespace credential);
2. turn messages (or a raw prompt's text) into prompt token ids once (the entry node, or
   the first node of the request's model; later hops get token ids);
3. build a :class:`~prefixmesh.overlay.core.routing.RouteContext` (through the node's
   :class:`~prefixmesh.overlay.core.routing.RouterMemory`: ski-rental rent and smoothed
   placements, the same code the simulator drives) from its own radix-tree
   match (``backend.match_length``), the :class:`PeerCacheIndex` estimates for the
   request's chained block hashes, load figures (digests, fresher PONGs), heartbeat RTTs,
   the hop budget and the visited set, and ask the policy (under partial replication,
   ``[digest].partitions > 0``, the holders come from the node's own partition index when
   it is a home of the request's partition, else from a home's lookup answer, cached, or
   asked for by the entry node when :func:`~.partition.lookup_pays`; see
   ``_partition_matches``);
4. serve locally, or forward to the chosen peer with the hop appended to the route trace.

Failure handling (the requester never hangs, no request is silently lost): a forward
that fails before any token came back (dial or stream error, ERROR frame with a
retryable code, the peer's heartbeat going down, no first frame within the hop's
*patience* (``first_frame_factor`` x the policy's estimate for that peer, at least
``first_frame_floor_s``, at most ``first_frame_timeout_s``: a slow or lying peer is
abandoned early enough to serve elsewhere), or a gap of ``max_frame_gap_s`` mid-stream)
is recorded as a ``fallback`` hop and the next fallback peer is tried, then local
serving. A failure *after* tokens were relayed (e.g. ``kill -9`` of the serving node
mid-stream) is resumed the same way when the request is deterministic (temperature
0): the replacement's output is checked against the text already sent and only the
rest is relayed; if it differs, or sampling is random, the requester gets an
``upstream_failed`` ERROR. The whole request runs under its absolute deadline; on
expiry the requester gets a ``deadline`` ERROR. Every path ends with FINAL+END or ERROR.

The serving node always re-matches the token ids against its own radix tree (the
engine does); digests only ever steer routing, never select KV data.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import trio

from prefixmesh.inference.backend import (
    Backend,
    BackendError,
)
from prefixmesh.inference.core.blocks import BLOCK_TOKENS, chain_hashes

from .core import replay as replaymem
from .core import wire
from .core.identity import peer_id_to_b58
from .core.limits import (
    MAX_PEERS_PER_SUBNET,
    PEER_REQUEST_BURST,
    PEER_REQUEST_RATE,
    ForwardShareLimiter,
    PeerRateLimiter,
    SubnetLimiter,
)
from .core.models import relay_affinity
from .core.peerindex import PeerCacheIndex
from .core.planner import (
    FullView,
    LookUp,
    PartitionedView,
    PeerLink,
    Plan,
    PlanInput,
    Planner,
    Reject,
    fits_context,
)
from .core.routing import Policy
from .core.streamslots import StreamSlots
from .core.trust import SpotChecker, TrustTracker
from .events import InferObserver, NullObserver, RequestDone
from .forwarding import RETRYABLE_CODES, Relay, RouteExecutor
from .heartbeat import Heartbeat
from .host import FramedStream, FrameTimeout, HostError, OverlayHost, PeerTimeout, remote_peer
from .partgossip import PartitionGossip
from .serving import LocalServer
from .spotcheck import SpotCheckRunner

__all__ = ["InferSettings", "InferService", "RETRYABLE_CODES"]

log = logging.getLogger(__name__)

RELAY_RTT_STEP_S = 0.05  # a model relay treats peers within one step of RTT as equally near

@dataclass
class InferSettings:
    hop_budget: int = 2  # most further forwards this node allows (caps the request's budget)
    first_frame_timeout_s: float = 60.0  # a next hop silent this long (but "up") is abandoned
    # ... or sooner: after first_frame_factor x its estimated time to first token (the
    # policy's cost for it, claimed cache at face value), but never under the floor
    first_frame_factor: float = 5.0
    first_frame_floor_s: float = 10.0
    max_frame_gap_s: float = 30.0  # a next hop silent this long mid-stream is abandoned
    stream_timeout_s: float = 3.0  # dial + new stream to the next hop
    send_timeout_s: float = 10.0
    max_shed_candidates: int = 2  # unmatched, lightly loaded peers offered to the policy
    max_seen_ids: int = 8192  # duplicate-request-id memory
    max_open_streams: int = 256  # concurrent infer streams (incl. idle pooled ones) we accept
    # ... and from any one remote peer: one peer cannot take all the slots (an entry node
    # forwarding heavily holds its requests + a few pooled spares); over it: "overloaded"
    max_streams_per_peer: int = 64
    # requests any one remote peer may send (token bucket); over it: "overloaded" with a
    # retry-after hint. Defaults in overlay/core/limits.py (node/config.py shares them)
    peer_request_rate: float = PEER_REQUEST_RATE
    peer_request_burst: float = PEER_REQUEST_BURST
    # candidates per subnet, by the address of our live connection to the peer (not what
    # it claims); 0 turns it off
    max_peers_per_subnet: int = MAX_PEERS_PER_SUBNET
    clock_skew_s: float = 5.0
    max_pending_spot_checks: int = 8  # queued re-executions; more are dropped and counted
    spot_check_timeout_s: float = 120.0  # one local re-execution
    # partial replication: the most an entry node waits for a home's lookup answer (on
    # expiry: no candidates, decided as if no peer held the prefix)
    lookup_timeout_s: float = 1.0


#: the refusals of a tenant request the replay memory did not admit
_REPLAY_ERRORS = {
    replaymem.REPLAY: ("duplicate", "this node already accepted this request (a replay)"),
    replaymem.FULL: ("overloaded", "too many accepted requests whose deadlines have not passed "
                     "(replay memory full); retry later"),
}

class InferService:
    def __init__(
        self,
        *,
        host: OverlayHost,
        backend: Backend,
        tenants,  # node.tenants.TenantRegistry
        index: PeerCacheIndex,
        heartbeat: Heartbeat,
        policy: Policy,
        settings: InferSettings | None = None,
        clock: Callable[[], float] = time.time,
        trust: TrustTracker | None = None,
        share_limiter: ForwardShareLimiter | None = None,
        spot_checker: SpotChecker | None = None,
        partition: PartitionGossip | None = None,
        observer: InferObserver | None = None,
    ):
        self.host = host
        self.me = host.peer_id
        self.backend = backend
        self.tenants = tenants
        self.index = index
        self.heartbeat = heartbeat
        self.policy = policy
        self.settings = settings or InferSettings()
        self.clock = clock
        self.server = LocalServer(backend, self.me, clock)  # serving (overlay/serving.py)
        # request events for the log line, metrics and dashboard (overlay/events.py)
        self.observer: InferObserver = observer if observer is not None else NullObserver()
        # the one planner the simulator drives too (overlay/core/planner.py): it keeps the
        # ski-rental rent and smoothed placements (RouterMemory) and reads the cache view
        self._rng = random.Random(int.from_bytes(os.urandom(8), "big"))
        self.planner = Planner(self.me, policy, FullView(index, backend.model_fingerprint),
                               rng=self._rng)
        self.memory = self.planner.memory
        s = self.settings
        self._request_limiter = PeerRateLimiter(s.peer_request_rate, s.peer_request_burst)
        self._subnets = (  # Sybil basics: candidates per subnet (0: off)
            SubnetLimiter(max_per_subnet=s.max_peers_per_subnet)
            if s.max_peers_per_subnet > 0
            else None
        )
        # observed honesty of next hops (overlay/core/trust.py): discounts their claimed cache
        # in routing; fed with FINAL frames (claimed vs reused tokens) and hop failures
        self.trust = trust
        # partial replication ([digest].partitions > 0; the daemon sets it once its
        # PartitionGossip exists): the planner's view becomes the partitioned one
        self._partition: PartitionGossip | None = None
        self.partition = partition
        self.closing = False
        self._inflight: set[trio.CancelScope] = set()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._replay = replaymem.ReplayWindow()  # accepted tenant requests, until their deadline
        # request streams answered at once (overlay/core/streamslots.py): peers without
        # history get a smaller budget; a full budget sheds its oldest incomplete stream
        cap = max(1, s.max_open_streams)
        new_cap = max(1, cap * 3 // 4)
        self._slots = StreamSlots(cap, min(cap, max(1, s.max_streams_per_peer)),
                                  max(1, min(new_cap, s.max_streams_per_peer // 2)), new_cap)
        self._slot_scopes: dict[int, trio.CancelScope] = {}  # incomplete slots' first reads
        self.stats = {
            "requests": 0,
            "served_local": 0,
            "forwarded": 0,
            "fallbacks": 0,
            "resumed": 0,
            "errors": 0,
            "spot_checks": 0,
            "spot_matches": 0,
            "spot_mismatches": 0,
            "spot_drifts": 0,
            "spot_dropped": 0,
            "spot_failed": 0,
            "rate_limited": 0,
            "subnet_limited": 0,
            "duplicates": 0,
        }
        # optional re-execution of forwarded greedy requests (overlay/core/trust.py
        # SpotChecker); jobs queue for :meth:`run_spot_checks`, run in the daemon's nursery
        self.spot = SpotCheckRunner(
            checker=spot_checker, backend=backend, index=index, trust=trust, clock=clock,
            stats=self.stats, max_pending=s.max_pending_spot_checks,
            timeout_s=s.spot_check_timeout_s)
        # route execution: forward, fallback, resume (overlay/forwarding.py)
        self.routes = RouteExecutor(
            me=self.me, host=host, heartbeat=heartbeat, server=self.server, settings=s,
            clock=clock, stats=self.stats, observe=self._observe,
            on_answered=self.spot.answered, trust=trust,
            # optional cap on any one peer's share of our forwards (overlay/core/limits.py);
            # off by default: in swarms of 2-3 nodes it halves legitimate forwarding
            share_limiter=share_limiter)

    @property
    def share_limiter(self) -> ForwardShareLimiter | None:
        return self.routes.share_limiter

    @share_limiter.setter
    def share_limiter(self, limiter: ForwardShareLimiter | None) -> None:
        self.routes.share_limiter = limiter

    @property
    def spot_checker(self) -> SpotChecker | None:
        return self.spot.checker

    @property
    def spot_log(self) -> list[dict]:
        return self.spot.log

    async def run_spot_checks(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run queued spot checks (overlay/spotcheck.py); the daemon starts it."""
        await self.spot.run(task_status=task_status)

    @property
    def partition(self) -> PartitionGossip | None:
        return self._partition

    @partition.setter
    def partition(self, pg: PartitionGossip | None) -> None:
        """Switch the cache view: partition homes + carried holders + lookup cache."""
        self._partition = pg
        if pg is not None:
            self.planner.view = PartitionedView(pg.pd, pg.members)

    # --- stream handler --------------------------------------------------------------

    async def handle(self, stream) -> None:
        fs = FramedStream(stream, timeout_s=self.settings.send_timeout_s)
        try:
            peer = remote_peer(stream)
        except Exception:  # a stream object without a connection (tests): one bucket
            peer = b""
        is_known = getattr(self.heartbeat, "is_known", None)
        known = bool(is_known(peer)) if is_known is not None and peer else False
        admission = self._slots.open(peer, known, self.clock())
        for victim in admission.shed:  # the oldest incomplete streams of a full budget
            scope = self._slot_scopes.pop(victim.id, None)
            if scope is not None:
                scope.cancel()
            self.stats["streams_shed"] = self.stats.get("streams_shed", 0) + 1
        if admission.slot is None:
            await self._refuse(fs, "overloaded", admission.refusal)
            return
        try:
            await self._handle(fs, peer, admission.slot)
        finally:
            self._slot_scopes.pop(admission.slot.id, None)
            self._slots.close(admission.slot)

    async def _handle(self, fs: FramedStream, peer: bytes, slot) -> None:
        try:
            # a pooled stream (host.take_stream) may idle up to POOL_MAX_IDLE_S first;
            # a frame that began must be complete within its whole-frame budget (host.py)
            with trio.CancelScope() as first_read:
                self._slot_scopes[slot.id] = first_read  # cancelled if the slot is shed
                frame = await fs.receive(timeout_s=self.host.POOL_MAX_IDLE_S + 15.0)
            self._slot_scopes.pop(slot.id, None)
            if first_read.cancelled_caught:  # shed for a newcomer while still incomplete
                await fs.reset()
                return
            self._slots.complete(slot)
        except FrameTimeout:  # a trickling peer: the slot is freed, nothing to answer
            self.stats["slow_frames"] = self.stats.get("slow_frames", 0) + 1
            await fs.reset()
            return
        except PeerTimeout:  # an idle stream nobody used: not an error worth a frame
            await fs.reset()
            return
        except (HostError, wire.WireError) as exc:
            await self._refuse(fs, "bad_request", f"could not read a request: {exc}")
            return
        t_recv = self.clock()  # timings start at the request, not the stream
        if frame is None:  # an unused pooled stream closed by its opener
            await fs.close()
            return
        if not isinstance(frame, wire.Request):
            await self._refuse(fs, "bad_request", "expected a REQUEST frame")
            return
        now_m = self.clock()
        if not self._request_limiter.allow(peer, now_m):
            self.stats["rate_limited"] += 1
            wait = self._request_limiter.retry_after_s(peer, now_m)
            await self._refuse(
                fs, "overloaded", f"request rate limit for this peer: retry in {wait:.2f} s"
            )
            return
        state = wire.InferStreamState()
        state.request_received(frame)

        async def emit(f: wire.Frame) -> None:
            state.response_sent(f)
            await fs.send(f, timeout_s=self.settings.send_timeout_s)

        try:
            await self.process(frame, emit, t_recv)
        except (HostError, wire.WireError) as exc:
            # the requester went away or broke the protocol: nothing left to tell it
            log.debug("requester of %s gone: %s", frame.id.hex(), exc)
        finally:
            with trio.CancelScope(shield=True):
                await fs.close()

    async def _refuse(self, fs: FramedStream, code: str, message: str) -> None:
        self.stats["errors"] += 1
        with contextlib.suppress(HostError, wire.WireError):
            await fs.send(wire.Error(code, message[: wire.MAX_ERROR_CHARS]), timeout_s=2.0)
        await fs.close()

    # --- shutdown --------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Refuse new requests and cancel in-flight ones (each ends with an ERROR frame)."""
        self.closing = True
        for scope in list(self._inflight):
            scope.cancel()

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # --- the request pipeline --------------------------------------------------------

    async def process(self, req: wire.Request, emit, t_recv: float | None = None) -> None:
        """Handle one request; always ends by emitting FINAL+END or ERROR (unless
        ``emit`` itself fails, which means the requester is gone). ``t_recv``: when it
        arrived, on ``self.clock`` (default: now). The observer hears one
        ``request_started`` and one ``request_done`` per call."""
        t_recv = self.clock() if t_recv is None else t_recv
        entry = not req.trace
        self.stats["requests"] += 1
        relay = Relay(emit)
        relay.emit = functools.partial(self._emit_observed, relay, emit)
        self._observe("request_started", req.id, entry)
        try:
            await self._process(req, relay, t_recv)
        finally:
            self._observe("request_done", self._done_event(req, relay, entry, t_recv))

    async def _emit_observed(self, relay: Relay, emit, frame: wire.Frame) -> None:
        """``emit``, noting what the observer's RequestDone reports."""
        if relay.t_first is None and isinstance(frame, wire.Tokens | wire.Final):
            relay.t_first = self.clock()
        if isinstance(frame, wire.Final):
            relay.final = frame
        elif isinstance(frame, wire.Error):
            relay.error = frame.code
            relay.action = relay.action if relay.action != "pending" else "reject"
            relay.reason = relay.reason or frame.code
        await emit(frame)

    def _observe(self, method: str, *args) -> None:
        try:
            getattr(self.observer, method)(*args)
        except Exception:  # an observer bug must never fail a request
            log.exception("observer failed in %s", method)

    def _done_event(self, req: wire.Request, relay: Relay, entry: bool, t_recv: float
                    ) -> RequestDone:
        final = relay.final
        hops = final.hops if final is not None else req.trace
        now = self.clock()
        return RequestDone(
            request_id=req.id,
            entry=entry,
            action=relay.action if relay.action != "pending" else "reject",
            reason=relay.reason or relay.error,
            served_by=final.serving if final is not None else b"",
            route=tuple(
                f"{peer_id_to_b58(h.peer)[-8:]}: {h.action} ({h.reason})" for h in hops
            ),
            prompt_tokens=final.prompt_tokens if final is not None else len(req.tokens),
            cached_tokens=final.cached_tokens if final is not None else 0,
            completion_tokens=final.completion_tokens if final is not None else 0,
            ttft_s=relay.t_first - t_recv if relay.t_first is not None else math.nan,
            total_s=now - t_recv,
            error=relay.error if final is None else "",
            ns=req.ns,
        )

    async def _process(self, req: wire.Request, relay: Relay, t_recv: float) -> None:
        now = self.clock()
        error: tuple[str, str] | None = None
        if self.closing:
            error = ("shutting_down", "node is shutting down")
        elif now > req.deadline:
            error = ("deadline", f"deadline passed {now - req.deadline:.2f} s ago")
        elif self.me in req.visited:
            error = ("bad_request", "request already visited this node (loop)")
        elif req.id in self._seen:
            # a resend (a fallback that reached us by another path, or a replay): the
            # sender may try elsewhere; serving it twice could double-charge a tenant
            error = ("duplicate", "this node already handled a request with this id")
            self.stats["duplicates"] += 1
        if error is not None:
            self.stats["errors"] += 1
            await relay.emit(wire.Error(*error))
            return
        self._seen[req.id] = None
        while len(self._seen) > self.settings.max_seen_ids:
            self._seen.popitem(last=False)

        with trio.CancelScope() as scope:
            self._inflight.add(scope)
            try:
                with trio.move_on_after(max(0.0, req.deadline - self.clock())) as deadline_scope:
                    await self._route(req, relay, t_recv)
            finally:
                self._inflight.discard(scope)
        if relay.finished:
            return
        if scope.cancelled_caught:
            code, msg = "shutting_down", "node shut down during the request"
        elif deadline_scope.cancelled_caught:
            code, msg = "deadline", "request deadline expired"
        else:  # pragma: no cover - _route always finishes or raises
            code, msg = "internal", "request ended without an answer"
        self.stats["errors"] += 1
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            await relay.emit(wire.Error(code, msg))
        relay.finished = True

    async def _finish_error(self, relay: Relay, code: str, message: str) -> None:
        await self.routes.fail(relay, code, message)

    async def _route(self, req: wire.Request, relay: Relay, t_recv: float) -> None:
        try:
            await self._route_checked(req, relay, t_recv)
        except (HostError, wire.WireError):
            raise  # the requester is gone: nobody to tell
        except Exception as exc:  # a bug must not leave the requester without an answer
            log.exception("request %s failed", req.id.hex()[:8])
            if not relay.finished:
                await self._finish_error(relay, "internal", f"{type(exc).__name__}: {exc}")

    async def _route_checked(self, req: wire.Request, relay: Relay, t_recv: float) -> None:
        if req.hop_budget > self.settings.hop_budget:
            req = replace(req, hop_budget=self.settings.hop_budget)
        if req.model and req.model != self.backend.model_fingerprint:
            await self._relay_to_model(req, relay, t_recv)
            return
        # the first node of the request's model plans it as its entry (looks up, checks the
        # context), also when a node of another model passed it on (still in messages or
        # raw text)
        first_planner = not req.trace or bool(req.messages) or bool(req.prompt)
        tenant = self.tenants.lookup(req.ns)
        if tenant is not None:
            try:  # the credential binds id, deadline and content (overlay/core/reqdigest.py)
                tenant.check_request(req, now=self.clock(), clock_skew_s=self.settings.clock_skew_s)
            except ValueError as exc:
                await self._finish_error(relay, "unauthorized", str(exc))
                return
            if tenant.visibility != "public":  # anyone signs public requests: no replays
                verdict = self._replay.admit(req.ns + req.id,
                                             req.deadline + self.settings.clock_skew_s, self.clock())
                if verdict != replaymem.NEW:
                    await self._finish_error(relay, *_REPLAY_ERRORS[verdict])
                    return
        else:
            await self._relay_only(req, relay, t_recv)
            return

        # prompt tokens: computed once, at the entry node
        tokens = req.tokens
        if not tokens:
            try:
                tokens = (await self.backend.tokenize_text(req.prompt) if req.prompt else
                          await self.backend.tokenize([(m.role, m.content) for m in req.messages]))
            except (BackendError, ValueError) as exc:
                await self._finish_error(relay, "bad_request", f"cannot render the prompt: {exc}")
                return
            if not tokens:
                await self._finish_error(relay, "bad_request", "the prompt is empty after "
                                         "tokenization")
                return
            if len(tokens) > wire.MAX_PROMPT_TOKENS:
                await self._finish_error(relay, "context_length_exceeded",
                                         f"the prompt has {len(tokens)} tokens, more than "
                                         f"{wire.MAX_PROMPT_TOKENS}")
                return
        if req.messages or req.prompt:  # tokenized here (we hold the secret): sign the new form
            req = tenant.sign(replace(req, tokens=tuple(tokens), messages=(), prompt=""))

        plan, hop_base = await self._plan(req, tenant, first_planner)
        if isinstance(plan, Reject):
            relay.action, relay.reason = "reject", plan.code
            await self._finish_error(relay, plan.code, plan.reason)
            return
        if plan.carry is not None:  # the holder list the next hop decides with (partitioned)
            req = replace(req, holders=plan.carry)
        claims = {c.peer: c for c in plan.ctx.candidates}
        await self.routes.run(req, relay, t_recv, list(plan.targets), plan.decision, hop_base,
                              claims, plan.ctx)

    async def _plan(self, req: wire.Request, tenant, first_planner: bool | None = None
                    ) -> tuple[Plan, wire.Hop | None]:
        """Ask the planner (overlay/core/planner.py) what to do, carrying out its lookups;
        returns the final plan and the hop record this node adds to the trace."""
        t0 = self.clock()
        chain = chain_hashes(tenant.namespace_key, req.tokens, BLOCK_TOKENS)
        local_matched = await self.backend.match_length(req.ns, req.tokens)
        inp = self._plan_input(req, tenant, chain, local_matched, self.backend.load_figures(),
                               first_planner=first_planner)
        plan = self._planned(inp)
        if isinstance(plan, LookUp):
            inp = replace(inp, answer=await self._look_up(plan.homes, req.ns, chain),
                          may_look_up=False)
            plan = self._planned(inp)
        if isinstance(plan, Reject):
            return plan, None
        decision, ctx = plan.decision, plan.ctx
        hop_base = wire.Hop(
            peer=self.me,
            action="serve",
            reason=decision.reason[: wire.MAX_SHORT_STRING],
            local_matched_tokens=ctx.local_matched_tokens,
            est_local_s=_finite(decision.est_local_s),
            est_peer_s=_finite(decision.est_peer_s),
            decide_ms=(self.clock() - t0) * 1000.0,
        )
        return plan, hop_base

    def _planned(self, inp: PlanInput) -> Plan:
        plan = self.planner.plan(inp, self.clock())
        for name in plan.counters:
            self._count(name)
        return plan

    def _plan_input(self, req: wire.Request, tenant, chain: list[bytes], local_matched: int,
                    load, *, first_planner: bool | None = None) -> PlanInput:
        """What this node knows at decision time, as values (the simulator fills the same
        ``PlanInput`` from its model; tests/overlay/core/test_planner_differential.py holds them equal)."""
        now = self.clock()
        entry = not req.trace if first_planner is None else first_planner
        visited = frozenset(req.visited) | {self.me}
        health = self.heartbeat.health
        fresh_load = getattr(self.heartbeat, "fresh_load", lambda peer: None)
        own_model = self.backend.model_fingerprint
        peers: dict[bytes, PeerLink] = {}
        for peer in self.heartbeat.up_peers():
            if peer in visited or not tenant.may_serve(peer) or self.routes.is_not_serving(peer, req.ns):
                continue
            h = health.get(peer)
            if getattr(h, "model", b"") not in (b"", own_model):
                continue  # a node of another model: its caches and tokens are not ours
            peers[peer] = PeerLink(
                rtt_s=h.rtt_s if h is not None else None,
                # figures the peer gave us (PONG/ACK), while fresher than its digest's
                load=fresh_load(peer) if h is not None else None,
                addrs=tuple(self.host.remote_addrs(peer)) if self._subnets is not None else (),
                context_tokens=h.n_ctx or None if h is not None else None,
                # through a relay (issue 16): the planner charges the relay's extra RTT
                relayed=getattr(self.host, "link_kind", lambda p: None)(peer) == "relayed",
            )
        if self.share_limiter is not None:
            kept = set(self.share_limiter.filter(sorted(peers), now, key=lambda p: p))
            peers = {p: link for p, link in peers.items() if p in kept}
        trust = ({p: self.trust.trust(p, now) for p in peers} if self.trust is not None
                 else {})  # fmt: skip
        avg_s = max(load.avg_request_s, 0.01)
        own_ctx = _context_tokens(self.backend)
        return PlanInput(
            ns=req.ns,
            chain=tuple(chain),
            prompt_tokens=len(req.tokens),
            local_matched_tokens=min(local_matched, len(req.tokens)),
            local_prefill_tps=load.prefill_tps,
            local_prefill_measured=load.prefill_measured,
            local_queue_wait_s=(load.queue_depth + load.active) * avg_s,
            local_load=float(load.queue_depth + load.active),
            avg_request_s=avg_s,
            hop_budget=req.hop_budget,
            visited=visited,
            # a request a node of another model passed on came from a client as far as
            # this model's nodes go: it must not make the first of them shed (routing.is_hot)
            forwarded_in=bool(req.trace) and not entry,
            peers=peers,
            may_serve_here=tenant.may_serve(self.me) and fits_context(len(req.tokens), own_ctx),
            carried=dict(req.holders) if req.holders else None,
            may_look_up=entry,  # forwarded in: the entry node already looked
            trust=trust,
            subnets=self._subnets,
            # decided where the request enters, before routing (a forwarding hop must not
            # refuse what its sender may still serve): the largest context known, ours or
            # a peer's from its PONGs; peers too small for the prompt are not candidates
            context_tokens=_largest_context(own_ctx, peers) if entry else None,
        )

    async def _look_up(self, homes: tuple[bytes, ...], ns: bytes, chain: list[bytes]
                       ) -> dict[bytes, int] | None:
        """Ask the planner's homes in turn; the first answer, or None when all failed (the
        request is then decided as if no peer held the prefix)."""
        assert self._partition is not None  # the planner asks only a partitioned view
        for home in homes:
            self._count("partition_lookups")
            answer = await self._partition.lookup(home, ns, chain, self.settings.lookup_timeout_s)
            if answer is not None:
                return {h.peer: h.blocks for h in answer}
            self._count("partition_lookups_failed")
        return None

    def _count(self, key: str) -> None:
        """A counter that exists only once it is used (partitioned mode's counters must
        not appear in a full-replication node's stats)."""
        self.stats[key] = self.stats.get(key, 0) + 1

    async def _relay_to_model(self, req: wire.Request, relay: Relay, t_recv: float) -> None:
        """A request for another model than ours: never matched or served here (our caches
        and tokenizer are our model's); passed on as it is to up peers that announced
        that model (heartbeat PONGs), least loaded first, which plan it among themselves."""
        visited = set(req.visited) | {self.me}
        head = req.messages[0].content if req.messages else req.prompt
        # least loaded first (one request running is free: a PONG taken while our last
        # request ran there must not send the next one away from its cache); among peers
        # alike in load and distance (RTT in 50 ms steps) the same prompt head goes to the
        # same peer, which then has its prefix cached
        ranked = sorted(
            ((max(0, h.queue_depth + h.active - 1),
              round((h.rtt_s if h.rtt_s is not None else 1.0) / RELAY_RTT_STEP_S),
              relay_affinity(req.ns, head, p), p)
             for p, h in self.heartbeat.health.items()
             if h.up and p not in visited and getattr(h, "model", b"") == req.model))
        if not ranked or req.hop_budget <= 0:
            self._count("unknown_model" if not ranked else "model_relay_no_budget")
            await self._finish_error(
                relay, "unknown_model" if not ranked else "no_route",
                f"no node this node knows serves model {req.model.hex()} (GET /v1/models "
                "or `prefixmesh peers` lists the models of the mesh)" if not ranked
                else "no hop left to reach a node of the requested model")
            return
        self._count("model_relayed")
        hop = wire.Hop(peer=self.me, action="serve", reason="model relay: not this node's model")
        await self.routes.run(req, relay, t_recv, [p for *_, p in ranked[:4]], None, hop)

    async def _relay_only(self, req: wire.Request, relay: Relay, t_recv: float) -> None:
        """A namespace this node is not configured for: pass it to a peer that holds it.

        It cannot compute the namespace's chains (they are keyed by the tenant secret), so
        it relays to peers estimated to hold anything in the namespace: from the full index,
        or under partial replication from the partitions it homes and the holder list the
        previous hop carried (``Request.holders``)."""
        visited = set(req.visited) | {self.me}
        known = {p for p, _ in req.holders} | self.planner.view.namespace_holders(req.ns)
        holders = [p for p in self.heartbeat.up_peers() if p not in visited and p in known]
        if not holders:
            if not req.trace:
                # from a client: a namespace no node we know serves is, in practice, a
                # wrong tenant secret (the namespace id is derived from it)
                await self._finish_error(
                    relay, "unauthorized",
                    "no node serves this namespace: is the tenant's secret right?")
                return
            await self._finish_error(
                relay,
                "unknown_namespace",
                "this node does not serve the namespace and knows no peer that does",
            )
            return
        self._rng.shuffle(holders)
        hop = wire.Hop(peer=self.me, action="serve", reason="relay: namespace not configured here")
        await self.routes.run(req, relay, t_recv, holders[:4], None, hop)


def _largest_context(own: int | None, peers: Mapping[bytes, PeerLink]) -> int | None:
    if own is None:
        return None
    return max([own, *(link.context_tokens for link in peers.values() if link.context_tokens)])


def _context_tokens(backend: Backend) -> int | None:
    """The engine's context length, when the backend says (decides context_length_exceeded)."""
    n = getattr(backend, "context_tokens", None)
    return n if isinstance(n, int) and n > 0 else None


def _finite(x: float | None) -> float:
    if x is None or not math.isfinite(x):
        return -1.0
    return min(max(x, -1.0), 1e12)
