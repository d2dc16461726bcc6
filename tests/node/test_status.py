"""node/status.py's pure parts: the terminal screen of an overview and the URL rules.
``prefixmesh status`` against real nodes: tests/swarm/test_dashboard_swarm.py."""

from __future__ import annotations

import io
from types import SimpleNamespace

from prefixmesh.node.status import cli_status, render_text, status_url

OV = {
    "generated_at": 1.0,
    "node": {"peer_id": "12D3KooWSelfSelfSelf", "addrs": ["/ip4/127.0.0.1/tcp/1/p2p/x"],
             "model": "abcd", "policy": "prefixmesh", "uptime_s": 12.0,
             "requests_in_flight": 0,
             "engine": {"active": 1, "queue_depth": 0, "kv_used_bytes": 512 << 20,
                        "kv_capacity_bytes": 1 << 30, "prefill_tps": 400.0, "decode_tps": 90.0},
             "infer": {"requests": 3, "served_local": 2, "forwarded": 1, "fallbacks": 0,
                       "errors": 0, "rate_limited": 0}},
    "peers": [{"peer_id": "12D3KooWPeerAAAA1111", "addrs": [], "up": True, "rtt_ms": 0.8,
               "queue_depth": 0, "active": 0, "cached_blocks": 40, "kv_used_bytes": 0,
               "digest_age_s": 1.0, "trust": 0.93},
              {"peer_id": "12D3KooWPeerBBBB2222", "addrs": [], "up": False, "rtt_ms": None,
               "queue_depth": 0, "active": 0, "cached_blocks": 0, "kv_used_bytes": None,
               "digest_age_s": None, "trust": None}],
    "namespaces": [{"name": "public", "ns_id": "00", "visibility": "public", "prefixes": 2,
                    "tokens": 700, "ram_bytes": 3 << 20, "disk_bytes": 0, "largest": []}],
    "cache": {"hits_ram": 4, "hits_disk": 1, "misses": 2},
    "recent": [{"at": 1.0, "id": "0123456789ab", "entry": True, "action": "forward",
                "reason": "r", "served_by": "12D3KooWPeerAAAA1111",
                "route": ["Self: forward (r)", "AAAA1111: serve (cached)"],
                "prompt_tokens": 300, "cached_tokens": 288, "completion_tokens": 4,
                "ttft_ms": 120.0, "total_ms": 300.0, "error": ""},
               {"at": 1.0, "id": "ffffffffffff", "entry": False, "action": "reject",
                "reason": "unauthorized", "served_by": "", "route": [], "prompt_tokens": 0,
                "cached_tokens": 0, "completion_tokens": 0, "ttft_ms": None,
                "total_ms": 1.0, "error": "unauthorized"}],
    "spot_checks": {"fraction": 0.05, "counts": {"checks": 3, "matches": 1, "drifts": 1,
                                                 "mismatches": 1, "failed": 1, "dropped": 0},
                    "last": [{"request_id": "77aa" * 8, "peer": "12D3KooWPeerBBBB2222",
                              "serving": "", "kind": "mismatch", "unit": "token",
                              "first_mismatch": 4, "trust_before": 0.9, "trust_after": 0.1},
                             {"request_id": "88bb" * 8, "peer": "12D3KooWPeerAAAA1111",
                              "serving": "", "kind": "match", "unit": "token",
                              "first_mismatch": None, "trust_before": None,
                              "trust_after": None}]},
}


def test_render_text_is_one_screen_with_the_facts():
    text = render_text(OV, width=100, height=40)
    lines = text.splitlines()
    assert len(lines) <= 40 and all(len(line) <= 100 for line in lines)
    assert "12D3KooWSelfSelfSelf" in lines[0]
    assert "peers (1 up of 2)" in text
    assert "AAAA1111" in text and "0.93" in text and "BBBB2222" in text
    assert "public" in text and "700 tokens" in text and "4 RAM" in text
    assert "hits 0/0 tok in 0 req" in text
    assert "288/300 cached" in text and "AAAA1111: serve (cached)" in text
    assert "error unauthorized" in text
    assert "50%" in text  # KV usage
    assert ("spot checks (5% of forwarded answers): 3 run, 1 match, 1 drift, 1 mismatch, "
            "1 not run") in text
    assert "MISMATCH 77aa77aa peer BBBB2222 at token 4, trust 0.90 -> 0.10" in text
    assert "88bb" not in text  # matches are counted, not listed


def test_render_text_fits_a_small_terminal():
    text = render_text(OV, width=60, height=12)
    assert len(text.splitlines()) <= 12 and max(map(len, text.splitlines())) <= 60


def test_render_text_of_a_sparse_overview():
    text = render_text({"node": {"peer_id": "x"}, "peers": [], "namespaces": [], "recent": []})
    assert "peers (0 up of 0)" in text and "last requests (0)" in text


def test_status_url_forms():
    assert status_url("127.0.0.1:8080") == "http://127.0.0.1:8080/prefixmesh/overview"
    assert status_url("http://h:1/") == "http://h:1/prefixmesh/overview"
    assert status_url("https://h") == "https://h/prefixmesh/overview"


def test_cli_status_unreachable_is_one_line_and_exit_1(capsys):
    args = SimpleNamespace(peer="127.0.0.1:1", api_key="", watch=False, interval=1.0,
                           json=False, rounds=None)
    assert cli_status(args, out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert err.startswith("prefixmesh status: error: http://127.0.0.1:1/") and \
        len(err.splitlines()) == 1


def test_overview_of_a_node_lists_prefix_sizes_never_tokens():
    from prefixmesh.inference.backend import BackendLoad
    from prefixmesh.inference.kvstore import FINGERPRINT_BYTES, KVStore
    from prefixmesh.node.metrics import NodeMetrics
    from prefixmesh.node.status import overview
    from prefixmesh.node.tenants import TenantRegistry, default_tenant_specs
    from prefixmesh.overlay.core.identity import Identity
    from prefixmesh.overlay.events import RequestDone

    me = Identity.from_seed(b"\5" * 32)
    tenants = TenantRegistry.from_specs(default_tenant_specs(), b"\1" * 32)
    ns = next(iter(tenants)).ns_id
    store = KVStore(fingerprint=b"\2" * FINGERPRINT_BYTES, ram_budget_bytes=1 << 20)
    store.put(ns, [7001, 7002, 7003], b"x" * 300)
    store.put(ns, [7001, 7002, 7003, 7004, 7005], b"y" * 500)
    load = BackendLoad(0, 0, 400.0, 100.0, 1 << 20, 800, 1.0)
    node = SimpleNamespace(
        identity=me, model_fp=b"\1" * 32, tenants=tenants, full_addrs=lambda: ["/ip4/x"],
        backend=SimpleNamespace(load_figures=lambda: load, engine=SimpleNamespace(store=store)))
    metrics = NodeMetrics(self_id=me.peer_id)
    metrics.request_done(RequestDone(
        request_id=b"\1" * 16, entry=True, action="serve", reason="", served_by=me.peer_id,
        route=(), prompt_tokens=10, cached_tokens=8, completion_tokens=1, ttft_s=0.1,
        total_s=0.2, ns=ns))
    ov = overview(node, metrics, now=100.0)
    (public,) = ov["namespaces"]
    assert public["prefixes"] == 2 and public["tokens"] == 8
    assert public["ram_bytes"] >= 800
    assert [e["tokens"] for e in public["largest"]] == [5, 3]
    assert "7001" not in str(ov)  # token ids never leave the node
    assert (public["served_requests"], public["prompt_tokens"], public["cached_tokens"]) == \
        (1, 10, 8)
    assert ov["node"]["peer_id"] == me.peer_id_b58 and ov["peers"] == []
    assert ov["recent"][0]["cached_tokens"] == 8 and "\\x" not in str(ov["recent"])
    assert ov["cache"]["misses"] == 0


def test_render_text_says_when_the_engine_batches():
    engine = {**OV["node"]["engine"], "batch_mode": "throughput", "batch_steps": 40,
              "sequences_per_step": 3.5}
    text = render_text({**OV, "node": {**OV["node"], "engine": engine}}, width=200)
    assert "batched, 3.5 sequences a step" in text
    assert "batched" not in render_text(OV, width=200).split("spot checks")[0]
