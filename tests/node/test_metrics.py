"""node/metrics.py without a node: request events -> counters and histograms (parsed back
with prometheus_client's own parser), bounded labels, the recent-request ring, and the
scrape-time collector over a stand-in node (plain objects: pure logic only)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from prefixmesh.inference.backend import BackendLoad
from prefixmesh.node.metrics import MAX_LABEL_VALUES, NodeCollector, NodeMetrics, reason_label
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.events import ObserverFanout, RequestDone

ME = Identity.from_seed(b"\1" * 32)
PEER = Identity.from_seed(b"\2" * 32)


def done(rid: int, *, entry=True, action="serve", served_by=ME.peer_id, prompt=100, cached=64,
         completion=5, ttft=0.2, total=0.5, error="") -> RequestDone:
    return RequestDone(request_id=rid.to_bytes(16, "big"), entry=entry, action=action,
                       reason="prefixmesh: serve, local est 0.100s", served_by=served_by,
                       route=(f"{ME.peer_id_b58[-8:]}: {action} (why)",), prompt_tokens=prompt,
                       cached_tokens=cached, completion_tokens=completion, ttft_s=ttft,
                       total_s=total, error=error)


def samples(m: NodeMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samp, name: str) -> float:
    return sum(v for (n, _), v in samp.items() if n == name)


def test_events_make_consistent_counts():
    m = NodeMetrics(self_id=ME.peer_id)
    fan = ObserverFanout([m])
    for i in range(3):
        fan.request_started(bytes([i]), True)
        fan.request_done(done(i))
    fan.request_started(b"f", True)
    fan.request_done(done(9, action="forward", served_by=PEER.peer_id, cached=90))
    fan.request_started(b"e", False)
    fan.request_done(done(10, entry=False, error="unauthorized", ttft=math.nan, cached=0,
                          served_by=b"", completion=0))
    fan.forwarded("forward", "prefixmesh: forward to 1a2b3c4d, est 0.1s vs local 0.3s")
    fan.fallback("peer 1a2b3c4d timed out")
    s = samples(m)
    assert total(s, "prefixmesh:requests_total") == 5
    assert total(s, "prefixmesh:request_success_total") == 4
    assert total(s, "prefixmesh:request_errors_total") == 1
    assert s[("prefixmesh:request_errors_total", (("code", "unauthorized"),))] == 1
    # served here: 3 requests x 100 prompt tokens, 64 cached each; the forwarded one is not
    assert s[("prefixmesh:prefix_cache_queries_total", ())] == 300
    assert s[("prefixmesh:prefix_cache_hits_total", ())] == 192
    # the mesh view counts the forwarded one's cache at the peer that served it
    assert s[("prefixmesh:mesh_prefix_cache_hits_total", ())] == 192 + 90
    assert s[("prefixmesh:time_to_first_token_seconds_count", ())] == 4
    assert s[("prefixmesh:e2e_request_latency_seconds_count", ())] == 4  # entry requests only
    assert s[("prefixmesh:forwards_total", (("decision", "forward"), ("reason", "forward")))] == 1
    assert s[("prefixmesh:fallbacks_total", (("reason", "peer_timed_out"),))] == 1
    assert s[("prefixmesh:requests_in_flight", ())] == 0
    assert len(m.recent) == 5 and m.recent[-1][1].error == "unauthorized"


def test_recent_ring_is_bounded():
    m = NodeMetrics(self_id=ME.peer_id, recent=4)
    for i in range(10):
        m.request_done(done(i))
    assert [int.from_bytes(ev.request_id, "big") for _, ev in m.recent] == [6, 7, 8, 9]


def test_two_nodes_in_one_process_keep_separate_registries():
    a, b = NodeMetrics(self_id=ME.peer_id), NodeMetrics(self_id=PEER.peer_id)
    a.request_done(done(1))
    assert total(samples(a), "prefixmesh:requests_total") == 1
    assert total(samples(b), "prefixmesh:requests_total") == 0


def test_reason_labels_have_no_numbers_or_peer_names():
    assert reason_label("prefixmesh: forward to 1a2b3c4d, est 0.100s vs local 0.300s (saves "
                        "0.2s > required 0.1s; match 10 tok)") == "forward"
    assert reason_label("prefixmesh: serve, hop budget exhausted") == "serve_hop_budget"
    assert reason_label("prefixmesh: serve (ski rental: rent 0.1s paid)") == "serve_ski_rental"
    assert reason_label("local: always serve") == "serve_always"
    assert reason_label("stream reset by 1a2b3c4d9f after 12 tokens") == \
        "stream_reset_by_after_tokens"


def test_free_text_labels_are_capped():
    m = NodeMetrics(self_id=ME.peer_id)
    for i in range(MAX_LABEL_VALUES + 10):
        m.fallback("reason " + "abcdefghijklmnopqrstuvwxyz"[i % 26] * (1 + i // 26))
    reasons = {dict(k[1])["reason"] for k in samples(m) if k[0] == "prefixmesh:fallbacks_total"}
    assert len(reasons) == MAX_LABEL_VALUES + 1 and "other" in reasons


class _Trust:
    def peers(self):
        return [PEER.peer_id]

    def trust(self, peer, now):
        return 0.75


def _fake_node():
    load = BackendLoad(queue_depth=2, active=1, prefill_tps=400.0, decode_tps=100.0,
                       kv_capacity_bytes=1000, kv_used_bytes=250, avg_request_s=1.0)
    store_stats = SimpleNamespace(hits_ram=3, hits_disk=1, misses=2, ram_entries=2,
                                  disk_entries=1, ram_bytes=200, disk_bytes=100)
    health = {PEER.peer_id: SimpleNamespace(up=True, rtt_s=0.002, queue_depth=0, active=1)}
    return SimpleNamespace(
        identity=ME, model_fp=b"\7" * 32,
        backend=SimpleNamespace(load_figures=lambda: load,
                                engine=SimpleNamespace(store=SimpleNamespace(stats=store_stats))),
        heartbeat=SimpleNamespace(health=health),
        directory=SimpleNamespace(peers={PEER.peer_id: None}),
        infer=SimpleNamespace(trust=_Trust(), stats={"rate_limited": 4, "subnet_limited": 0,
                                                      "duplicates": 1}),
        exchange=SimpleNamespace(stats={"bytes_in": 1234, "bytes_out": 567, "records_applied": 9,
                                      "malformed_messages": 2}),
        pd=None,
        ae=SimpleNamespace(stats={"rejected": {"BadSignature": 5}}),
        host=SimpleNamespace(inbound_cap=None),
    )


def test_collector_reads_the_node_at_scrape_time():
    node = _fake_node()
    m = NodeMetrics(node)
    s = samples(m)
    peer = (("peer", PEER.peer_id_b58),)
    assert s[("prefixmesh:num_requests_running", ())] == 1
    assert s[("prefixmesh:num_requests_waiting", ())] == 2
    assert s[("prefixmesh:kv_cache_usage_perc", ())] == 0.25
    assert s[("prefixmesh:peers_up", ())] == 1
    assert s[("prefixmesh:peer_rtt_seconds", peer)] == 0.002
    assert s[("prefixmesh:peer_trust", peer)] == 0.75
    assert s[("prefixmesh:digest_bytes_total", (("direction", "in"), ("protocol", "full")))] == 1234
    rej = {dict(k[1])["reason"]: v for k, v in s.items()
           if k[0] == "prefixmesh:rejected_frames_total"}
    assert rej == {"BadSignature": 5, "malformed_messages": 2, "rate_limited": 4,
                   "duplicates": 1}
    assert s[("prefixmesh:kv_store_lookups_total", (("result", "hit_ram"),))] == 3
    # read live: a change shows at the next scrape
    node.heartbeat.health[PEER.peer_id].up = False
    assert samples(m)[("prefixmesh:peers_up", ())] == 0


def test_collector_skips_what_the_node_lacks():
    node = SimpleNamespace(identity=ME, model_fp=b"")
    s = samples(NodeMetrics(node))
    assert s[("prefixmesh:node_info", (("model", ""), ("peer_id", ME.peer_id_b58)))] == 1
    assert not any(k[0] == "prefixmesh:peers_up" for k in s)
    assert isinstance(NodeCollector(node).describe(), list)


def test_grafana_dashboard_uses_only_metrics_that_exist():
    import json
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json"
    dash = json.loads(path.read_text())
    used = set(re.findall(r"prefixmesh:[a-z0-9_]+", json.dumps(dash)))
    m = NodeMetrics(_fake_node())
    m.request_done(done(1))
    m.forwarded("forward", "x")
    m.fallback("y")
    m.request_done(done(2, error="no_route"))
    exported = {name for name, _ in samples(m)}
    assert used and used <= exported, used - exported
