"""The node daemon: identity + libp2p host + discovery + digests + heartbeat + routing +
the inference engine, in one trio process.

Wiring
    engine cache events (polled each digest tick) -> ``AntiEntropy.local_add_prefix`` /
    ``local_remove_prefix``; engine load -> ``AntiEntropy.set_local_load``; applied
    digest records -> ``PeerCacheIndex``; origins' addrs in records, bootstrap, mDNS and
    DHT -> ``PeerDirectory`` -> heartbeat (which connects and keeps RTT/up state);
    ``/prefixmesh/infer`` -> :class:`~prefixmesh.overlay.infer.InferService`;
    ``/prefixmesh/peers`` -> a report of known peers for ``prefixmesh peers``;
    ``[http].listen`` -> the OpenAI-compatible gateway (``node/http_gateway.py``), which
    feeds its requests into the same ``InferService.process``; forward outcomes ->
    ``overlay.trust.TrustTracker`` -> ``Candidate.trust``.

Partial replication (``[digest].partitions > 0``): cache events and load go to a
``overlay.partition.PartitionedDigest`` instead (one AntiEntropy stream per partition,
built like the full one but with the partition's fingerprint and
``[digest].partition_refresh_s``/``partition_ttl_s``), ``overlay.partgossip.PartitionGossip``
runs instead of ``Gossip`` (pushes to homes, answers lookups; stats as ``part_*``), and the
infer service takes candidates from it; ``self.index`` then stays empty.

Per-peer input limits come from ``[limits]`` (``node/config.py``): the request rate and
subnet cap go to ``InferSettings``, the digest-exchange rate to ``Gossip``; refusals are
counted in ``stats`` (``digest_exchanges_rate_limited``,
``digest_exchanges_concurrency_limited``, and the infer service's own counters).

Start-up, in two steps: the engine loads (begun by the launcher, ``node/launch.py``), then
the HTTP gateway answers on it at once, and only then the host imports py-libp2p (in a
worker thread, ~0.5 s of Python: ``overlay/host.py``) and the node joins the overlay. A
request in between is served here, as by a node that knows no peer yet; a signal from
then on stops the node gracefully. Joined, it prints one line per dialable address on
stdout (``/ip4/127.0.0.1/tcp/PORT/p2p/ID``) and then ``ready``; tests and scripts read them.

Shutdown (SIGINT/SIGTERM), within :data:`SHUTDOWN_BUDGET_S` (3 s) in every configuration:
new requests are refused, in-flight ones are cancelled and end with an ERROR frame
(``shutting_down``; at most 1 s), the services stop, the engine flushes its RAM-only KV
states to disk, then the host closes. A watchdog thread exits the process when the budget
is spent, whatever still runs (a library's blocking call, zeroconf's thread): KV files are
written to a temporary name, fsynced and renamed, and the next start deletes leftover
temporary files, so a flush cut short only loses the states it had not written yet. A
second SIGINT/SIGTERM exits at once (status 130).

Spot checks (``[routing].spot_check_fraction``, default 0): that fraction of the forwarded
greedy requests a peer answered in full is re-executed here after the answer was
delivered, one at a time; a mismatch lowers the peer's trust and is logged with evidence
(``spot check MISMATCH``). Counters are in ``stats`` (``infer_spot_*``) and per-peer trust
in per-mille as ``trust_<last 8 chars of peer id>``. The forwarded-share cap
(``[routing].share_cap``, default off): ``overlay.core.limits.ForwardShareLimiter``.

Start: ``prefixmesh node --config FILE`` (``prefixmesh/cli.py``) loads the config and calls
``node/launch.py``'s ``run_node``, which begins the engine's load before it imports this
module; so do the benchmark and test entry points (``bench/node_entry.py``,
``tests/_fault_node.py``), with a config file too, adding only harness switches
(:class:`NodeOptions`: a simulated engine, a baseline policy, a benchmark link delay,
test-only fault injection that wraps the engine in a misbehaving Backend).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from prefixmesh.inference.backend import Backend
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.digest import LoadFigures
from prefixmesh.overlay.core.identity import Identity, peer_id_to_b58
from prefixmesh.overlay.core.limits import ForwardShareLimiter, InboundSubnetCap
from prefixmesh.overlay.core.models import ModelEntry, catalog, model_name_from_path
from prefixmesh.overlay.core.partition import PartitionConfig, PartitionedDigest
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.core.reachability import PROTOCOL as DIALBACK_PROTOCOL
from prefixmesh.overlay.core.relaying import reachability_from_addrs
from prefixmesh.overlay.core.replication import FullReplication, PartialReplication, Replication
from prefixmesh.overlay.core.routing import RoutingConfig, make_policy
from prefixmesh.overlay.core.trust import SpotChecker, TrustTracker
from prefixmesh.overlay.dialback import DialbackServer, ReachabilityService
from prefixmesh.overlay.digestexchange import DigestExchange, ExchangeSettings
from prefixmesh.overlay.discovery import PeerDirectory, bootstrap_loop
from prefixmesh.overlay.events import ObserverFanout
from prefixmesh.overlay.gossip import Gossip
from prefixmesh.overlay.heartbeat import Heartbeat, Liveness
from prefixmesh.overlay.holepunch import HolePunchService
from prefixmesh.overlay.host import OverlayHost, check_listen_addrs_free, unwrapping_lone_exception
from prefixmesh.overlay.infer import InferService, InferSettings
from prefixmesh.overlay.natroles import NatRoles, known_public_peers
from prefixmesh.overlay.partgossip import PartitionGossip
from prefixmesh.overlay.swim import Swim
from prefixmesh.overlay.upnp import PortMapper

from . import process
from .http_gateway import serve_node_http
from .peers_service import PeersService
from .process import NodeOptions, exit_now
from .requestlog import RequestLog
from .tenants import TenantRegistry

if TYPE_CHECKING:
    from prefixmesh.overlay.relay import RelayService, ReservationKeeper

__all__ = ["NodeOptions", "Node"]

log = logging.getLogger("prefixmesh.node")

#: seconds from SIGINT/SIGTERM to the process's exit, at most (module docstring)
SHUTDOWN_BUDGET_S = 3.0
_INFLIGHT_GRACE_S = 1.0  # of the budget: for in-flight requests to send their ERROR frame


def _start_exit_watchdog(armed: threading.Event, budget_s: float) -> None:
    """A daemon thread that ends the process ``budget_s`` after ``armed`` is set (a stop
    that hangs). Started in advance: the signal handler only sets an Event, which is
    safe there (starting a thread from a signal handler could deadlock on threading's
    own locks, and waiting for the trio loop to do it fails when the loop is stuck)."""

    def watch() -> None:
        armed.wait()
        time.sleep(budget_s)
        exit_now(0, f"shutdown did not finish within {budget_s:.1f} s: exiting now")

    threading.Thread(target=watch, name="prefixmesh-exit-watchdog", daemon=True).start()


def _warn_cpu_only_offload(n_gpu_layers: int, backend: str) -> None:
    """A WARNING when GPU offload is asked of a llama.cpp built without a GPU backend
    (it silently runs everything on the CPU otherwise)."""
    if n_gpu_layers == 0 or backend != "llama":
        return
    from prefixmesh.inference.gpu import cpu_only_warning, gpu_report

    warning = cpu_only_warning(n_gpu_layers, gpu_report())
    if warning:
        log.warning("%s", warning)


@contextlib.asynccontextmanager
async def _progress(what: str, logger: logging.Logger, every_s: float = 2.0,
                    already_s: float = 0.0):
    """Log ``what ...`` and, while it lasts, ``still WHAT (N s)`` every ``every_s``; the
    operator of a node that is slow to start sees why (model load, KV file checks).
    ``already_s``: how long the step ran before this wait began (the times count it)."""
    t0 = trio.current_time() - already_s
    logger.info("%s ...", what)

    async def tick() -> None:
        while True:
            await trio.sleep(every_s)
            logger.info("still %s (%.0f s)", what, trio.current_time() - t0)

    # the step's own error, not the group the ticker's nursery wraps it in: a model that
    # fails to load is then a one-line error, not an "internal error"
    with unwrapping_lone_exception():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()
    logger.info("%s: done in %.1f s", what, trio.current_time() - t0)


class Node:
    def __init__(self, config, options: NodeOptions | None = None, *,
                 identity: Identity | None = None, backend: Backend | None = None):
        self.config = config
        self.options = options or NodeOptions()
        self.identity = identity or process.load_or_create_identity(config.node.key_file)
        self.backend = backend or process.make_backend(config, self.options)
        self.model_fp = self.backend.model_fingerprint
        # the name this node announces for its model (core/models.py: the file's stem)
        self.model_name = model_name_from_path(getattr(self.backend, "model_path", None),
                                               self.model_fp)
        self.tenants = TenantRegistry.from_specs(config.tenant_specs(), self.model_fp)
        # PEERS answers share one reply a second and are rate-limited per peer
        self.peers_service = PeersService(self.peers_reply)
        n_inbound = config.limits.max_inbound_per_subnet
        self.host = OverlayHost(
            self.identity, [config.node.listen],
            inbound_cap=InboundSubnetCap(n_inbound) if n_inbound > 0 else None,
            observe_addrs=config.nat.hole_punching,  # DCUtR needs our observed WAN address
        )
        self.index = PeerCacheIndex()
        self.directory = PeerDirectory(self.identity.peer_id,
                                       self_addrs=lambda: self.advertised_addrs())
        # the liveness table every part of the node reads (overlay/heartbeat.py Liveness)
        self.heartbeat = self._liveness()
        self.directory.on_new_peer = self.heartbeat.watch
        self.heartbeat.on_forget = self.directory.forget  # bounded dialing (issue 14)
        self.directory.merit = self.heartbeat.merit
        self.heartbeat.persistent = lambda p: "bootstrap" in self.directory.sources_of(p)
        self.host.peer_is_down = self.heartbeat.is_down
        self.host.peer_is_known = self.heartbeat.is_known
        # reachability (issue 16): answer peers' dial-back requests, ask our own
        self.dialback = DialbackServer(self.host)
        self.reachability = ReachabilityService(
            self.host, peers=self.heartbeat.up_peers,
            claimed_addrs=lambda: [*self.advertised_addrs(), *self.host.transport_addrs()])
        # relay service while public, reservations at relays while private (issue 16)
        self.nat = NatRoles(
            self._reachability_kind,
            relay=self._relay_service if config.nat.relay_service else None,
            keeper=self._reservation_keeper,
            on_keeper_stop=self._republish_addrs)
        self.holepunch = HolePunchService(self.host, self.reachability,
                                          enabled=config.nat.hole_punching)
        # opt-in port mapping at the home router; its address is advertised once mapped
        self.upnp = PortMapper(self.host, enabled=config.nat.upnp,
                               on_change=lambda: self._republish_addrs())
        rc = config.routing
        self.policy = make_policy(
            rc.policy,
            RoutingConfig(**rc.knobs) if rc.knobs else RoutingConfig(),
            random.Random(self.options.seed),
            self.identity.peer_id,
        )
        # every consumer of request events (the per-request log line, metrics, dashboard)
        # hangs off this one fan-out (overlay/events.py)
        self.observers = ObserverFanout([RequestLog(self.identity.peer_id)])
        self.infer = InferService(
            host=self.host,
            backend=self.backend,
            tenants=self.tenants,
            index=self.index,
            heartbeat=self.heartbeat,
            policy=self.policy,
            settings=InferSettings(
                hop_budget=rc.hop_budget,
                peer_request_rate=config.limits.peer_request_rate,
                peer_request_burst=config.limits.peer_request_burst,
                max_peers_per_subnet=config.limits.max_peers_per_subnet,
            ),
            trust=TrustTracker(),
            share_limiter=ForwardShareLimiter() if rc.share_cap else None,
            spot_checker=(
                SpotChecker(random.Random(self.options.seed), fraction=rc.spot_check_fraction)
                if rc.spot_check_fraction > 0 else None
            ),
            observer=self.observers,
        )
        self.ae: AntiEntropy | None = None
        # the digest exchange, whichever variant runs (Gossip, or PartitionGossip with
        # [digest].partitions > 0); None with the digest off
        self.exchange: DigestExchange | None = None
        # partial replication: the partitioned digest state replaces ae's role
        self.pd: PartitionedDigest | None = None
        self.replication: Replication | None = None  # set with the digest exchange
        self.dht = None
        self.mdns = None
        self.started = trio.Event()  # everything runs (the overlay too)
        # since when the engine is loaded and the HTTP gateway (when configured) serves;
        # from then on a signal stops the node gracefully instead of exiting at once
        self._answering_since: float | None = None
        self._cancel: trio.CancelScope | None = None
        self._stopping = False
        self._stop_t0: float | None = None  # when shutdown() began
        self.signalled = False  # a SIGINT/SIGTERM asked us to stop
        self._signals: list[int] = []  # the signals received
        self._stop_requested = trio.Event()
        self._old_handlers: dict = {}
        self._written_addrs: list[str] = []

    # --- helpers ---------------------------------------------------------------------

    def _liveness(self) -> Liveness:
        """SWIM by default; the all-to-all heartbeat with ``NodeOptions.membership``."""
        # our context length on every ACK/PONG: entry nodes refuse a prompt no node fits;
        # our model on the first of each stream: the mesh's model catalog (issue 18)
        context_tokens = lambda: getattr(self.backend, "context_tokens", None)  # noqa: E731
        if self.options.membership == "heartbeat":
            return Heartbeat(
                self.host,
                addrs_of=self.directory.addrs_of,
                local_load=self._queue_and_active,
                interval_s=self.options.heartbeat_interval_s,
                timeout_s=self.options.heartbeat_timeout_s,
                context_tokens=context_tokens,
                model=(self.model_fp, self.model_name),
            )
        if self.options.membership != "swim":
            raise ValueError(f"membership must be 'swim' or 'heartbeat', got "
                             f"{self.options.membership!r}")
        return Swim(
            self.host,
            addrs_of=self.directory.addrs_of,
            local_load=self._queue_and_active,
            self_addrs=self.advertised_addrs,
            # members' addresses from dissemination: hints, in the directory like others
            learn=lambda peer, addrs: self.directory.learn(peer, addrs, "swim"),
            context_tokens=context_tokens,
            model=(self.model_fp, self.model_name),
            rng=random.Random(self.options.seed),
        )

    def _queue_and_active(self) -> tuple[int, int]:
        load = self.backend.load_figures()
        return load.queue_depth, load.active

    def _model_peers(self) -> list[bytes]:
        """Up peers of our model: the digest exchange's (other models' records are refused)."""
        return self.heartbeat.up_peers_of(self.model_fp)

    def models(self) -> tuple[ModelEntry, ...]:
        """The models the mesh serves now, as this node sees it (ours first)."""
        return catalog((self.model_fp, self.model_name), self.heartbeat.up_models())

    def _peer_summary_hash(self, peer: bytes) -> bytes:
        h = self.heartbeat.health.get(peer)
        return h.summary_hash if h is not None else b""

    def advertised_addrs(self) -> list[str]:
        adv = [a.split("/p2p/")[0] for a in self.config.node.advertise]
        return adv or [*self.upnp.external_addrs, *self.host.listen_addrs()]

    def full_addrs(self) -> list[str]:
        return [f"{a}/p2p/{self.identity.peer_id_b58}" for a in self.advertised_addrs()]

    @property
    def keeper(self) -> ReservationKeeper | None:
        """Our relay reservations while private (status reads it)."""
        return self.nat.keeper

    @property
    def relay_service(self) -> RelayService | None:
        return self.nat.relay

    def _relay_service(self) -> RelayService:
        from prefixmesh.overlay.relay import RelayService  # with py-libp2p (host.py)

        return RelayService(self.host)

    def _reservation_keeper(self) -> ReservationKeeper:
        from prefixmesh.overlay.relay import ReservationKeeper

        return ReservationKeeper(self.host, bootstrap=lambda: list(self.config.node.bootstrap),
                                 known=lambda: known_public_peers(self.directory),
                                 on_change=self._republish_addrs)

    def _reachability_kind(self) -> str:
        """The dial-back verdict once it has one; until then a guess from our own
        addresses (a global IP: public; RFC 1918: private; loopback: unknown)."""
        kind = self.reachability.reachability.kind
        if kind != "unknown":
            return kind
        return reachability_from_addrs([*self.advertised_addrs(), *self.host.transport_addrs()])

    def _republish_addrs(self) -> None:
        """Our relays changed: advertise the circuit addresses (or the listen ones again)
        in a fresh digest record now; the DHT record takes them at its next round."""
        keeper = self.nat.keeper
        self.host.set_circuit_addrs(keeper.circuit_addrs() if keeper is not None else [])
        addrs = self.advertised_addrs()
        log.info("advertising %s", ", ".join(addrs) or "no address")
        if self.ae is not None:
            self.ae.set_local_addrs(addrs)
        if self.replication is not None:  # full: one fresh record; partial: every stream
            self.replication.set_local_addrs(addrs, time.time())

    def _before_tick(self, now: float) -> None:
        repl = self.replication
        assert repl is not None
        for ev in self.backend.drain_cache_events():
            (repl.add if ev.kind == "add" else repl.remove)(ev.ns, ev.chain, now)
        load = self.backend.load_figures()
        repl.set_local_load(
            # an unmeasured rate is advertised as 0 ("unknown": peers then assume their own)
            LoadFigures(load.queue_depth, load.active,
                        load.prefill_tps if load.prefill_measured else 0.0, load.decode_tps),
            load.kv_capacity_bytes,
            load.kv_used_bytes,
        )

    # --- running ---------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # a Node run without the launcher (tests) fails here before the model load; host.run
        # checks again right before binding
        check_listen_addrs_free([self.config.node.listen])
        self._install_signal_handlers()
        try:
            await self._run(task_status)
        finally:
            self._restore_signal_handlers()

    async def _run(self, task_status) -> None:
        _warn_cpu_only_offload(self.config.model.n_gpu_layers, self.options.backend)
        began = self.backend.load_began  # the launcher began it before the imports
        async with _progress("loading the model and checking the KV cache", log,
                             already_s=time.monotonic() - began if began is not None else 0.0):
            await self.backend.load()
        for tenant in self.tenants:
            self.backend.register_namespace(tenant.name, tenant.namespace_key, tenant.ns_id)
        try:
            async with trio.open_nursery() as serving:
                self._cancel = serving.cancel_scope  # until the services take it over
                # the engine answers HTTP from here on, the overlay joins below (module
                # docstring, "Start-up")
                await serving.start(serve_node_http, self)  # [http].listen, [metrics].listen
                serving.start_soon(self._watch_signals)
                self._answering_since = time.monotonic()
                async with self.host.run():  # loads py-libp2p, in a thread
                    await self._run_services(task_status)
                    # services stopped: flush the KV cache while the host still closes
                    # below (a host that hangs on close cannot cost us the flush)
                    self._stop_phase("services stopped")
                    with trio.CancelScope(shield=True):
                        await self.backend.aclose()
                    self._stop_phase("KV cache flushed")
                serving.cancel_scope.cancel()  # the HTTP gateway, last
        finally:
            self._remove_addr_file()
            with trio.CancelScope(shield=True):
                await self.backend.aclose()
        self._stop_phase("host closed")

    @property
    def stop_took_s(self) -> float:
        """Seconds since :meth:`shutdown` began (0 before)."""
        return time.monotonic() - self._stop_t0 if self._stop_t0 is not None else 0.0

    def _stop_phase(self, what: str) -> None:
        """DEBUG: how far into the stop each phase ended (the budget is 3 s)."""
        if self._stop_t0 is not None:
            log.debug("stop: %s after %.2f s", what, self.stop_took_s)

    async def _run_services(self, task_status) -> None:
        opts, cfg = self.options, self.config
        now = time.time()
        # epoch: a new incarnation per start (ms clock), so peers never confuse our streams
        self.ae = AntiEntropy(
            self.identity,
            self.model_fp,
            epoch=int(now * 1000),
            now=now,
            ttl=cfg.digest.ttl_s,
            refresh_interval=(refresh := min(cfg.digest.refresh_interval_s, cfg.digest.ttl_s / 2)),
            addrs=self.advertised_addrs(),
            compaction_ratio=cfg.digest.compaction_ratio,
            min_record_interval=min(cfg.digest.min_record_interval_s, refresh / 2),
        )
        self.ae.origin_merit, self.ae.sender_known = self.heartbeat.merit, self.heartbeat.is_known
        if opts.digest and cfg.digest.partitions > 0:
            self.pd = self._partitioned_digest(now)
        self.host.set_handler(wire.INFER_PROTOCOL, self.infer.handle)
        self.host.set_handler(wire.PEERS_PROTOCOL, self.peers_service.handle)
        self.host.set_handler(DIALBACK_PROTOCOL, self.dialback.handle)
        # one settings value for whichever digest exchange runs (overlay/digestexchange.py)
        exchange = ExchangeSettings(
            interval_s=cfg.digest.interval_s,
            fanout=cfg.digest.fanout,
            byte_budget=cfg.digest.byte_budget,
            bucket_summaries=cfg.digest.bucket_summaries,
            exchange_rate_per_s=cfg.limits.digest_exchange_rate,
            exchange_burst=cfg.limits.digest_exchange_burst,
        )
        if self.pd is not None:
            pgossip = PartitionGossip(
                self.host,
                self.pd,
                peers=self._model_peers,
                on_learn=lambda peer, addrs: self.directory.learn(peer, addrs, "gossip"),
                before_tick=self._before_tick,
                settings=exchange,
            )
            self.infer.partition = pgossip
            self.exchange = pgossip
            self.replication = PartialReplication(self.pd, pgossip.members)
        elif opts.digest:
            self.replication = FullReplication(self.ae, self.index, self.model_fp)
            self.exchange = Gossip(
                self.host,
                self.ae,
                self.index,
                peers=self._model_peers,
                on_learn=lambda peer, addrs: self.directory.learn(peer, addrs, "gossip"),
                before_tick=self._before_tick,
                settings=exchange,
                rng=random.Random(opts.seed),
                peer_hash=self._peer_summary_hash,
            )
            if cfg.limits.digest_exchange_rate * cfg.digest.interval_s < 1.0:
                # peers configured like us open ~1 exchange per interval with us: we
                # would refuse some of them (they retry, but converge more slowly)
                log.warning(
                    "[limits].digest_exchange_rate %.3g/s is below the %.3g exchanges/s "
                    "that peers with [digest].interval_s = %.3g open; raise it",
                    cfg.limits.digest_exchange_rate, 1.0 / cfg.digest.interval_s,
                    cfg.digest.interval_s,
                )
        if self.exchange is not None:
            self.heartbeat.summary_hash = self.exchange.advertised_hash
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            await nursery.start(self.heartbeat.run)
            if self.infer.spot_checker is not None:
                await nursery.start(self.infer.run_spot_checks)
            if self.exchange is not None:
                await nursery.start(self.exchange.run)
            nursery.start_soon(bootstrap_loop, self.host, self.directory, list(cfg.node.bootstrap))
            await nursery.start(self.reachability.run)
            await nursery.start(self.nat.run)
            await nursery.start(self.holepunch.run)
            await nursery.start(self.upnp.run)
            if opts.dht:
                from prefixmesh.overlay.discovery import DhtDiscovery

                self.dht = DhtDiscovery(self.host, self.directory, self.model_fp,
                                        connected=self.heartbeat.up_peers)
                nursery.start_soon(self.dht.run)
            if cfg.node.mdns:
                from prefixmesh.overlay.discovery import MdnsDiscovery

                self.mdns = MdnsDiscovery(self.host, self.directory, self.advertised_addrs())
                nursery.start_soon(self.mdns.run)
            self._write_addr_file()
            log.info("joined the overlay as %s, listening on %s (%.1f s after the engine "
                     "began answering)", self.identity.peer_id_b58,
                     ", ".join(self.advertised_addrs()) or "no address",
                     time.monotonic() - self._answering_since)
            # started before "ready": a supervisor that signals on "ready" gets a graceful stop
            self.started.set()
            if opts.print_addrs:
                for a in self.full_addrs():
                    print(a, flush=True)
                print("ready", flush=True)
            task_status.started(self)

    def _partitioned_digest(self, now: float) -> PartitionedDigest:
        """Partial replication: one AntiEntropy stream per partition, built like the
        full-replication stream but with the partition's model fingerprint and the long
        partition refresh/TTL (``[digest].partition_refresh_s`` / ``partition_ttl_s``)."""
        dc = self.config.digest
        identity = self.identity

        def make_stream(fp: bytes, at: float) -> AntiEntropy:
            # epoch: the stream's creation time (ms), later than any earlier incarnation's
            stream = AntiEntropy(
                identity,
                fp,
                epoch=int(at * 1000),
                now=at,
                ttl=dc.partition_ttl_s,
                refresh_interval=(refresh := min(dc.partition_refresh_s, dc.partition_ttl_s / 2)),
                addrs=self.advertised_addrs(),  # now: relays may have changed them
                compaction_ratio=dc.compaction_ratio,
                min_record_interval=min(dc.min_record_interval_s, refresh / 2),
            )
            stream.origin_merit = self.heartbeat.merit  # admission by merit (issue 14)
            return stream

        return PartitionedDigest(
            identity,
            self.model_fp,
            config=PartitionConfig(n_partitions=dc.partitions, replicas=dc.replicas),
            make_stream=make_stream,
        )

    def _write_addr_file(self) -> None:
        """Tell local clients where we are (``prefixmesh ask`` without --peer)."""
        from .client import LOCAL_NODE_FILE

        try:
            d = Path(self.config.node.cache_dir)
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{LOCAL_NODE_FILE}.{os.getpid()}"
            self._written_addrs = self.full_addrs()
            tmp.write_text("".join(a + "\n" for a in self._written_addrs))
            os.replace(tmp, d / LOCAL_NODE_FILE)
        except OSError as exc:
            log.warning("cannot write the local address file: %s", exc)

    def _remove_addr_file(self) -> None:
        from .client import LOCAL_NODE_FILE

        path = Path(self.config.node.cache_dir) / LOCAL_NODE_FILE
        try:
            if self._written_addrs and path.read_text().split() == self._written_addrs:
                path.unlink()
        except (OSError, IndexError):
            pass

    def _install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM from the very start of :meth:`run`: during start-up (model load,
        KV index) the process exits at once, since nothing needs a graceful stop yet;
        once started, the first signal starts the graceful stop and arms the watchdog, a
        second exits at once. Plain Python handlers, not ``trio.open_signal_receiver``:
        they run within milliseconds even while the trio loop is busy, so two signals
        are two (a receiver whose task had not run yet merged them into one), and
        ``TrioToken.run_sync_soon`` is documented as safe to call from a handler."""
        if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only (a node run in a test's thread)
        token = trio.lowlevel.current_trio_token()
        armed = threading.Event()
        received = self._signals
        _start_exit_watchdog(armed, SHUTDOWN_BUDGET_S - 0.2)  # margin: the teardown

        def on_signal(signum: int, _frame) -> None:
            self.signalled = True
            received.append(signum)
            if self._answering_since is None:
                exit_now(130, f"signal {signum} during start-up: exiting now")
            if len(received) > 1:
                exit_now(130, f"signal {signum} again: exiting now")
            armed.set()
            token.run_sync_soon(self._stop_requested.set)

        self._old_handlers = {
            sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _restore_signal_handlers(self) -> None:
        if not self._signals:  # stopped for another reason: leave them as they were
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
        self._old_handlers = {}

    async def _watch_signals(self) -> None:
        await self._stop_requested.wait()
        log.info("signal %s: shutting down (at most %.0f s; signal again to exit at once)",
                 self._signals[0], SHUTDOWN_BUDGET_S)
        await self.shutdown()

    async def shutdown(self, grace_s: float = _INFLIGHT_GRACE_S) -> None:
        """Refuse new work, end in-flight requests with ERROR frames, then stop."""
        if self._stopping:
            return
        self._stopping = True
        self._stop_t0 = time.monotonic()
        self._remove_addr_file()  # local clients stop picking this node now
        self.infer.begin_shutdown()
        with trio.move_on_after(grace_s):
            while self.infer.inflight:
                await trio.sleep(0.02)
        await trio.sleep(0.05)  # let the ERROR frames leave
        self._stop_phase("requests ended")
        if self._cancel is not None:
            self._cancel.cancel()

    # --- peers protocol --------------------------------------------------------------

    def peers_reply(self) -> wire.PeersReply:
        now = time.time()
        known = set(self.directory.peers) | set(self.index.peers()) | set(self.heartbeat.health)
        known.discard(self.identity.peer_id)
        rows = []
        for peer in sorted(known)[: wire.MAX_PEERS_LISTED]:
            h = self.heartbeat.health.get(peer)
            est = self.index.estimate(peer)
            # partitioned: only the origins of records we are home of
            heard = self.exchange.last_heard.get(peer) if self.exchange else None
            addrs = self.directory.addrs_of(peer) or (list(est.addrs) if est else [])
            rows.append(wire.PeerInfo(
                peer=peer,
                addrs=tuple(a[: wire.MAX_SHORT_STRING] for a in addrs[: wire.MAX_ADDRS]),
                connected=self.host.is_connected(peer),
                up=bool(h and h.up),
                rtt_ms=(h.rtt_s * 1000.0) if h and h.rtt_s is not None else -1.0,
                queue_depth=(h.queue_depth if h else (est.load.queue_depth if est else 0)),
                active=(h.active if h else (est.load.active if est else 0)),
                n_hashes=est.n_hashes if est else 0,
                digest_age_s=max(0.0, now - heard) if heard else -1.0,
                sources=tuple(sorted(self.directory.sources_of(peer)))[:8],
                model=h.model if h is not None else b"",
            ))
        return wire.PeersReply(
            self_peer=self.identity.peer_id,
            model=self.model_fp,
            addrs=tuple(self.full_addrs()[: wire.MAX_ADDRS]),
            peers=tuple(rows),
            stats=self.stats(),
            models=self.models(),
        )

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {f"infer_{k}": int(v) for k, v in self.infer.stats.items()}
        if self.exchange is not None:
            out.update(self.exchange.node_stats())
        if self.ae is not None:
            for k, v in self.ae.stats["rejected"].items():
                out[f"rejected_{k}"] = int(v)
            for k in ("records_applied", "duplicates", "gaps", "records_issued", "bytes_issued"):
                out[f"ae_{k}"] = int(self.ae.stats[k])
        out["heartbeat_pings_answered"] = self.heartbeat.pings_answered
        if isinstance(self.heartbeat, Swim):
            out.update(self.heartbeat.node_stats())
        ps = self.peers_service
        out.update(peers_answered=ps.answered, peers_refused=ps.refused, peers_built=ps.builds)
        if self.host.inbound_cap is not None:
            out["inbound_refused"] = self.host.inbound_refused
        out["inbound_evicted"] = self.host.inbound_evicted
        if self.nat.relay is not None:  # the relay service we offer (issue 16)
            out.update({f"relay_{k}": v for k, v in self.nat.relay.stats().items()})
        if self.nat.keeper is not None:
            out["relays_reserved"] = len(self.nat.keeper.reserved_relays())
        if self.dht is not None:  # DHT upkeep: announces and lookups done, peers found
            out.update(dht_announces=self.dht.announces, dht_finds=self.dht.finds,
                       dht_found=self.dht.found)
        trust = self.infer.trust
        if trust is not None:  # observed peers' trust, per mille (overlay/core/trust.py)
            mono = time.monotonic()
            for peer in sorted(trust.peers())[:32]:
                out[f"trust_{peer_id_to_b58(peer)[-8:]}"] = round(1000 * trust.trust(peer, mono))
        return {k[: wire.MAX_SHORT_STRING]: max(0, v) for k, v in list(out.items())[:256]}
