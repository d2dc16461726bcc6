"""Prometheus metrics of a node (``GET /metrics`` on the HTTP gateway or ``[metrics] listen``).

Two sources, so that nothing is counted twice:

* **Request events** (``overlay/events.py``): :class:`NodeMetrics` is an
  :class:`~prefixmesh.overlay.events.InferObserver`; ``InferService`` reports every request's
  start and end, each forward decision and each fallback. These feed counters and histograms,
  and :class:`NodeMetrics.recent` (a bounded ring of the last :class:`RequestDone` events,
  the dashboard's route traces).
* **Node state, read at scrape time** (:class:`NodeCollector`): engine load and KV usage,
  peers (up, RTT, load, trust), digest traffic and rejections are read from the node's
  objects when Prometheus scrapes, so gauges are never stale and nothing polls.

Names follow vLLM's where the meaning matches (``prefixmesh:num_requests_running``,
``prefixmesh:num_requests_waiting``, ``prefixmesh:kv_cache_usage_perc`` (0..1, as vLLM),
``prefixmesh:prefix_cache_queries_total`` / ``prefixmesh:prefix_cache_hits_total`` (prompt
tokens looked up / found in this node's KV cache, for requests this node served),
``prefixmesh:time_to_first_token_seconds`` and ``prefixmesh:e2e_request_latency_seconds``
(for requests that entered the mesh here: what a client sees), ``prefixmesh:prompt_tokens_total``,
``prefixmesh:generation_tokens_total``, ``prefixmesh:request_success_total``). Mesh metrics
use the same prefix (the full list: README.md, "Watching a node").

Each node has its own :class:`~prometheus_client.CollectorRegistry` (several nodes may run in
one test process; the library's global registry would mix them).
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from prefixmesh.overlay.events import RequestDone

__all__ = ["NodeMetrics", "NodeCollector", "CONTENT_TYPE_LATEST", "reason_label", "PREFIX"]

PREFIX = "prefixmesh:"
#: the route traces the dashboard shows (newest last)
RECENT_REQUESTS = 50
#: label values per label of a free-text source (reasons): beyond, "other" (bounded series)
MAX_LABEL_VALUES = 32
#: peers listed one by one in per-peer gauges (bounded series)
MAX_PEERS_LABELLED = 64
#: namespaces whose served requests are tallied for the dashboard (then no new ones)
MAX_NAMESPACES = 64

# TTFT on the default CPU model runs from ~0.1 s (cached prefix) to seconds (cold 2k prompt)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
                120.0)

def reason_label(reason: str) -> str:
    """A planner's free-text reason as a short label (no numbers or peer names), so that a
    counter keeps a handful of series: ``"prefixmesh: forward to 1a2b3c4d, est 0.1s ..."``
    -> ``"forward"``; ``"prefixmesh: serve, hop budget exhausted"`` -> ``"serve_hop_budget"``."""
    text = reason.lower()
    if ":" in text.split(",")[0] and not text.startswith(("serve", "forward")):
        text = text.split(":", 1)[1]  # drop the policy name
    text = text.strip()
    for key, label in (("ski rental", "ski_rental"), ("shedding", "shedding"),
                       ("hop budget", "hop_budget"), ("visited", "visited"),
                       ("no whole block", "no_whole_block"), ("always", "always"),
                       ("picked self", "picked_self"), ("minimum", "minimum")):
        if key in text:
            head = "forward" if text.startswith("forward") else "serve"
            return f"{head}_{label}"
    head = re.split(r"[,(;]| to | est ", text, maxsplit=1)[0]
    head = re.sub(r"[0-9a-f]{8,}|[\d.]+s?", "", head)
    head = re.sub(r"[^a-z]+", "_", head).strip("_")
    return head[:40] or "unknown"


class _Bounded:
    """Label values of one free-text source, capped at :data:`MAX_LABEL_VALUES`."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) >= MAX_LABEL_VALUES:
            return "other"
        self.seen.add(value)
        return value


class NodeMetrics:
    """The node's metrics registry and its request observer (one per node).

    ``node`` is the daemon's ``Node`` (or anything with the attributes
    :class:`NodeCollector` reads; missing ones are skipped); ``None`` gives only the request
    metrics (unit tests)."""

    def __init__(self, node: Any = None, *, self_id: bytes = b"",
                 recent: int = RECENT_REQUESTS, registry: CollectorRegistry | None = None):
        self.node = node
        self.self_id = self_id or (node.identity.peer_id if node is not None else b"")
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.recent: deque[tuple[float, RequestDone]] = deque(maxlen=recent)  # (wall time, ev)
        self.started_at = time.time()
        self.in_flight = 0
        # per namespace id, requests served here: [requests, prompt tokens, cached tokens]
        self.by_ns: dict[bytes, list[int]] = {}
        self._reasons = _Bounded()
        self._fallback_reasons = _Bounded()
        self._errors = _Bounded()
        r, p = self.registry, PREFIX
        self.requests = Counter(p + "requests", "requests that ended at this node, by whether "
                                "a client sent it here (entry) and outcome", ["entry", "outcome"],
                                registry=r)
        self.success = Counter(p + "request_success", "answered requests, by this node's "
                               "action (serve, forward, fallback)", ["action"], registry=r)
        self.errors = Counter(p + "request_errors", "failed requests, by stable error code",
                              ["code"], registry=r)
        self.started = Counter(p + "requests_started", "requests this node began handling",
                               ["entry"], registry=r)
        self.queries = Counter(p + "prefix_cache_queries", "prompt tokens of requests served "
                               "here, looked up in this node's KV cache", registry=r)
        self.hits = Counter(p + "prefix_cache_hits", "prompt tokens of requests served here "
                            "whose KV came from this node's cache", registry=r)
        self.mesh_queries = Counter(p + "mesh_prefix_cache_queries", "prompt tokens of requests "
                                    "that entered here, wherever they were served", registry=r)
        self.mesh_hits = Counter(p + "mesh_prefix_cache_hits", "cached prompt tokens of requests "
                                 "that entered here, at whichever node served them", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of requests served here",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated here",
                                         registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token of "
                              "answered requests that entered here (from receipt)",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "receipt to end of requests "
                             "that entered here (answered or not)", buckets=_E2E_BUCKETS,
                             registry=r)
        self.forwards = Counter(p + "forwards", "routing decisions to forward, by decision "
                                "and reason", ["decision", "reason"], registry=r)
        self.fallbacks = Counter(p + "fallbacks", "next hops given up for a fallback, by reason",
                                 ["reason"], registry=r)
        self.in_flight_gauge = Gauge(p + "requests_in_flight", "requests this node is handling "
                                     "now (entry, relayed and served)", registry=r)
        self.in_flight_gauge.set_function(lambda: self.in_flight)
        if node is not None:
            self.registry.register(NodeCollector(node, self))

    # --- InferObserver -----------------------------------------------------------------

    def request_started(self, request_id: bytes, entry: bool) -> None:
        self.in_flight += 1
        self.started.labels(entry=_yn(entry)).inc()

    def request_done(self, event: RequestDone) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        answered = not event.error
        self.requests.labels(entry=_yn(event.entry),
                             outcome="answered" if answered else "error").inc()
        if answered:
            self.success.labels(action=_action(event.action)).inc()
        else:
            self.errors.labels(code=self._errors(event.error)).inc()
        if self.self_id and event.served_by == self.self_id and answered:
            self.queries.inc(max(0, event.prompt_tokens))
            self.hits.inc(max(0, min(event.cached_tokens, event.prompt_tokens)))
            self.prompt_tokens.inc(max(0, event.prompt_tokens))
            self.generation_tokens.inc(max(0, event.completion_tokens))
            ns = getattr(event, "ns", b"")
            if ns and (ns in self.by_ns or len(self.by_ns) < MAX_NAMESPACES):
                row = self.by_ns.setdefault(ns, [0, 0, 0])
                row[0] += 1
                row[1] += max(0, event.prompt_tokens)
                row[2] += max(0, min(event.cached_tokens, event.prompt_tokens))
        if event.entry:
            if answered:
                self.mesh_queries.inc(max(0, event.prompt_tokens))
                self.mesh_hits.inc(max(0, min(event.cached_tokens, event.prompt_tokens)))
                if _finite(event.ttft_s):
                    self.ttft.observe(event.ttft_s)
            if _finite(event.total_s):
                self.e2e.observe(event.total_s)
        self.recent.append((time.time(), event))

    def forwarded(self, decision: str, reason: str) -> None:
        self.forwards.labels(decision=self._reasons(_word(decision)),
                             reason=self._reasons(reason_label(reason))).inc()

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason=self._fallback_reasons(reason_label(reason))).inc()

    # --- exposition --------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


def _action(action: str) -> str:
    return action if action in ("serve", "forward", "fallback", "reject") else "other"


def _word(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:40] or "unknown"


def _yn(flag: bool) -> str:
    return "true" if flag else "false"


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


class NodeCollector:
    """Gauges and counters read from a running node when Prometheus scrapes.

    Reads only what the node's objects already expose (engine load, heartbeat health,
    trust tracker, gossip and anti-entropy stats); an object that is absent (digests off,
    engine not loaded yet) leaves its metrics out rather than reporting zeros."""

    def __init__(self, node: Any, metrics: NodeMetrics | None = None):
        self.node = node
        self.metrics = metrics

    def describe(self) -> Iterable:
        return []  # families vary with the node's state; never checked at registration

    def collect(self) -> Iterable:
        n, p = self.node, PREFIX
        info = GaugeMetricFamily(p + "node_info", "this node (value 1)",
                                 labels=["peer_id", "model"])
        info.add_metric([getattr(n.identity, "peer_id_b58", ""),
                         bytes(getattr(n, "model_fp", b"")).hex()[:16]], 1)
        yield info
        backend = getattr(n, "backend", None)
        if backend is not None:
            yield from self._engine(backend)
        yield from self._peers()
        yield from self._reachability()
        yield from self._digest()
        yield from self._rejected()

    def _engine(self, backend) -> Iterable:
        p = PREFIX
        try:
            load = backend.load_figures()
        except Exception:  # engine not loaded or closing: no engine figures this scrape
            return
        yield GaugeMetricFamily(p + "num_requests_running", "requests the engine is running",
                                value=load.active)
        yield GaugeMetricFamily(p + "num_requests_waiting", "requests queued for the engine",
                                value=load.queue_depth)
        cap, used = load.kv_capacity_bytes, load.kv_used_bytes
        yield GaugeMetricFamily(p + "kv_cache_usage_perc", "KV cache (RAM tier) used, 0..1",
                                value=(used / cap) if cap > 0 else 0.0)
        yield GaugeMetricFamily(p + "kv_cache_used_bytes", "KV cache bytes used (RAM tier)",
                                value=used)
        yield GaugeMetricFamily(p + "kv_cache_capacity_bytes", "KV cache budget (RAM tier)",
                                value=cap)
        yield GaugeMetricFamily(p + "prefill_tokens_per_second", "measured prefill rate (EWMA)",
                                value=load.prefill_tps if load.prefill_measured else 0.0)
        yield GaugeMetricFamily(p + "decode_tokens_per_second", "measured decode rate (EWMA)",
                                value=load.decode_tps)
        store = getattr(getattr(backend, "engine", None), "store", None)
        st = getattr(store, "stats", None)
        if st is not None:
            lookups = CounterMetricFamily(p + "kv_store_lookups", "KV store lookups by result",
                                          labels=["result"])
            lookups.add_metric(["hit_ram"], st.hits_ram)
            lookups.add_metric(["hit_disk"], st.hits_disk)
            lookups.add_metric(["miss"], st.misses)
            yield lookups
            entries = GaugeMetricFamily(p + "kv_store_entries", "cached prefixes by tier",
                                        labels=["tier"])
            entries.add_metric(["ram"], st.ram_entries)
            entries.add_metric(["disk"], st.disk_entries)
            yield entries
            size = GaugeMetricFamily(p + "kv_store_bytes", "cached prefix bytes by tier",
                                     labels=["tier"])
            size.add_metric(["ram"], st.ram_bytes)
            size.add_metric(["disk"], st.disk_bytes)
            yield size
        batching = getattr(getattr(backend, "engine", None), "batch_counters", None)
        if getattr(backend, "batched", False) and batching is not None:
            # throughput mode: sequences / steps is the mean batch (how much batching pays)
            yield CounterMetricFamily(p + "engine_batch_steps", "shared llama_decode calls "
                                      "(batch_mode throughput)", value=batching["steps"])
            yield CounterMetricFamily(p + "engine_batch_sequences", "sequences in those "
                                      "calls, summed over calls", value=batching["sequences"])
            yield CounterMetricFamily(p + "engine_batch_tokens", "tokens evaluated in those "
                                      "calls (prompt and generated)", value=batching["tokens"])

    def _peers(self) -> Iterable:
        p = PREFIX
        hb = getattr(self.node, "heartbeat", None)
        if hb is None:
            return
        health = dict(hb.health)
        yield GaugeMetricFamily(p + "peers_up", "peers answering heartbeats",
                                value=sum(1 for h in health.values() if h.up))
        directory = getattr(self.node, "directory", None)
        if directory is not None:
            yield GaugeMetricFamily(p + "peers_known", "peers this node knows an address of",
                                    value=len(directory.peers))
        up = GaugeMetricFamily(p + "peer_up", "1 if the peer answers heartbeats",
                               labels=["peer"])
        rtt = GaugeMetricFamily(p + "peer_rtt_seconds", "smoothed heartbeat round trip",
                                labels=["peer"])
        queue = GaugeMetricFamily(p + "peer_queue_depth", "the peer's engine queue (heartbeat)",
                                  labels=["peer"])
        active = GaugeMetricFamily(p + "peer_active", "the peer's running requests (heartbeat)",
                                   labels=["peer"])
        from prefixmesh.overlay.core.identity import peer_id_to_b58

        for peer in sorted(health)[:MAX_PEERS_LABELLED]:
            h = health[peer]
            label = [peer_id_to_b58(peer)]
            up.add_metric(label, 1 if h.up else 0)
            if h.rtt_s is not None:
                rtt.add_metric(label, h.rtt_s)
            queue.add_metric(label, h.queue_depth)
            active.add_metric(label, h.active)
        yield from (up, rtt, queue, active)
        trust = getattr(getattr(self.node, "infer", None), "trust", None)
        if trust is not None:
            fam = GaugeMetricFamily(p + "peer_trust", "observed honesty of the peer, 0..1 "
                                    "(overlay/core/trust.py)", labels=["peer"])
            mono = time.monotonic()
            for peer in sorted(trust.peers())[:MAX_PEERS_LABELLED]:
                fam.add_metric([peer_id_to_b58(peer)], trust.trust(peer, mono))
            yield fam
        infer = getattr(self.node, "infer", None)
        if infer is not None and getattr(infer, "spot_checker", None) is not None:
            fam = CounterMetricFamily(p + "spot_checks", "forwarded answers re-executed here "
                                      "(overlay/spotcheck.py), by outcome", labels=["outcome"])
            for outcome, key in (("match", "spot_matches"), ("drift", "spot_drifts"),
                                 ("mismatch", "spot_mismatches"), ("failed", "spot_failed"),
                                 ("dropped", "spot_dropped")):
                fam.add_metric([outcome], infer.stats.get(key, 0))
            yield fam

    def _reachability(self) -> Iterable:
        """Issue 16: the status line as labels (value 1), dial-back and hole-punch counts."""
        if getattr(self.node, "reachability", None) is None:
            return
        from prefixmesh.overlay.dialback import reachability_report

        p = PREFIX
        rep = reachability_report(self.node)
        fam = GaugeMetricFamily(p + "reachability", "reachability verdict (value 1): "
                                "kind public/private/unknown, NAT kind, the status line",
                                labels=["kind", "nat", "status"])
        fam.add_metric([rep["kind"], rep["nat"], rep["line"][:200]], 1)
        yield fam
        yield GaugeMetricFamily(p + "relay_reservations", "relays holding our reservation",
                                value=len(rep["relays"]))
        server = getattr(self.node, "dialback", None)
        if server is not None:
            db = CounterMetricFamily(p + "dialback_requests", "peers' dial-back requests",
                                     labels=["result"])
            db.add_metric(["answered"], server.answered)
            db.add_metric(["refused"], server.refused)
            yield db
        punch = rep.get("hole_punch")
        if punch:
            hp = CounterMetricFamily(p + "hole_punch_attempts", "DCUtR hole punches to "
                                     "relayed peers, by result", labels=["result"])
            hp.add_metric(["success"], punch["successes"])
            hp.add_metric(["failure"], punch["attempts"] - punch["successes"])
            yield hp
            yield GaugeMetricFamily(p + "direct_punched_peers", "peers reached directly after "
                                    "a hole punch", value=punch["direct_peers"])

    def _digest(self) -> Iterable:
        p = PREFIX
        fam = CounterMetricFamily(p + "digest_bytes", "cache-digest exchange bytes on the wire",
                                  labels=["direction", "protocol"])
        records = CounterMetricFamily(p + "digest_records_applied", "peers' digest records "
                                      "applied", labels=["protocol"])
        g = getattr(self.node, "exchange", None)  # the DigestExchange (None: digests off)
        if g is not None:
            proto = "partitioned" if getattr(self.node, "pd", None) is not None else "full"
            fam.add_metric(["in", proto], g.stats.get("bytes_in", 0))
            fam.add_metric(["out", proto], g.stats.get("bytes_out", 0))
            records.add_metric([proto], g.stats.get("records_applied", 0))
            yield fam
            yield records

    def _rejected(self) -> Iterable:
        """Frames and records refused, by what refused them and why."""
        p = PREFIX
        fam = CounterMetricFamily(p + "rejected_frames", "input refused from peers, by "
                                  "protocol and reason", labels=["protocol", "reason"])
        n = self.node
        counts: dict[tuple[str, str], int] = {}

        def add(proto: str, reason: str, value) -> None:
            if value:
                counts[(proto, reason)] = counts.get((proto, reason), 0) + int(value)

        ae = getattr(n, "ae", None)
        if ae is not None:
            for cls, v in ae.stats["rejected"].items():
                add("digest", cls, v)
        pd = getattr(n, "pd", None)
        if pd is not None:
            for stream in pd.streams.values():
                for cls, v in stream.stats["rejected"].items():
                    add("digest", cls, v)
        g = getattr(n, "exchange", None)
        if g is not None:
            for key in ("malformed_messages", "oversize_messages", "malformed",
                        "exchanges_rate_limited", "exchanges_concurrency_limited",
                        "rate_limited", "over_budget", "refused", "records_rate_limited"):
                add("digest", key, g.stats.get(key, 0))
        infer = getattr(n, "infer", None)
        if infer is not None:
            for key in ("rate_limited", "subnet_limited", "duplicates"):
                add("infer", key, infer.stats.get(key, 0))
        host = getattr(n, "host", None)
        if host is not None and getattr(host, "inbound_cap", None) is not None:
            add("connection", "inbound_subnet_cap", getattr(host, "inbound_refused", 0))
        for (proto, reason), v in sorted(counts.items()):
            fam.add_metric([proto, reason], v)
        yield fam
