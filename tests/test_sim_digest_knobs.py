"""Simulator digest-rate knobs (issue 6, T7): per-peer delta summaries and batched deltas."""

from __future__ import annotations

import pytest

from prefixmesh.bench import gossip as sim_gossip
from prefixmesh.bench.sim import (
    SimConfig,
    Simulator,
    measure_convergence,
    measure_idle_digest,
    simulate,
)
from prefixmesh.bench.workloads import synthetic_workload


@pytest.fixture(scope="module")
def wl():
    return synthetic_workload(300, rate=6.0, n_docs=30, n_system=4, seed=1)


def test_delta_summaries_decoded_or_not_give_the_same_run(wl):
    # the delta messages round-trip through their codecs exactly (as message 1-3 do)
    kw = dict(nodes=5, policy="prefixmesh", delta_summaries=True, seed=3)
    fast = simulate(wl, SimConfig(**kw, decode_messages=False)).metrics
    slow = simulate(wl, SimConfig(**kw, decode_messages=True)).metrics
    for key in ("digest_bytes_per_node_s", "latency_s", "hit_ratio", "gossip_messages"):
        assert fast[key] == slow[key]


def test_delta_summaries_cut_summary_bytes_and_change_nothing_else(wl):
    full = Simulator(wl, SimConfig(nodes=6, policy="prefixmesh", seed=2))
    rf = full.run()
    delta = Simulator(wl, SimConfig(nodes=6, policy="prefixmesh", seed=2, delta_summaries=True))
    rd = delta.run()
    assert rd.metrics["digest_bytes_per_node_s"] < rf.metrics["digest_bytes_per_node_s"]
    # the same records flow: the same hits (routing sees the same peer indexes)
    assert abs(rd.metrics["hit_ratio"] - rf.metrics["hit_ratio"]) < 0.02
    # no base check failed in a lossless run: every delta was applied to the right view
    assert sum(n.ae.stats["records_applied"] for n in delta.nodes) == sum(
        n.ae.stats["records_applied"] for n in full.nodes
    )


def test_min_record_interval_issues_fewer_records(wl):
    base = Simulator(wl, SimConfig(nodes=4, policy="prefixmesh", seed=1))
    base.run()
    batched = Simulator(wl, SimConfig(nodes=4, policy="prefixmesh", seed=1,
                                      min_record_interval_s=5.0))  # fmt: skip
    batched.run()
    issued = [sum(n.ae.stats["records_issued"] for n in s.nodes) for s in (base, batched)]
    assert issued[1] < issued[0]


def test_convergence_with_delta_summaries_stays_within_the_bound():
    r = measure_convergence(16, fanout=2, interval_s=1.0, seed=3, delta_summaries=True)
    assert r["warmup_complete"] and r["converged"] and r["within_bound"]


def test_need_summary_round_trip_in_the_driver():
    from prefixmesh.overlay.core.identity import Identity

    a = sim_gossip.make_antientropy(Identity.from_seed(b"a" * 32), b"m", now=0.0, ttl=60.0,
                                    refresh_interval=20.0)  # fmt: skip
    b = sim_gossip.make_antientropy(Identity.from_seed(b"b" * 32), b"m", now=0.0, ttl=60.0,
                                    refresh_interval=20.0)  # fmt: skip
    # a has told b a summary b never got: b answers need-summary, a sends it whole
    a.delta_summary_for(b.peer_id)
    msg = sim_gossip.open_exchange(a, hash_check=False, peer=b.peer_id, delta=True)
    need, _, _ = sim_gossip.handle(b, msg, 1.0, 1 << 20, peer=a.peer_id, delta=True)
    assert need.kind == sim_gossip.NEED_SUMMARY
    full, _, _ = sim_gossip.handle(a, need, 1.0, 1 << 20, peer=b.peer_id, delta=True)
    reply, _, _ = sim_gossip.handle(b, full, 1.0, 1 << 20, peer=a.peer_id, delta=True)
    assert reply.kind == sim_gossip.DELTA_REPLY
    records, applied, _ = sim_gossip.handle(a, reply, 1.0, 1 << 20, peer=b.peer_id, delta=True)
    assert [r.origin for r in applied] == [b.peer_id]
    _, applied_b, _ = sim_gossip.handle(b, records, 1.0, 1 << 20, peer=a.peer_id, delta=True)
    assert [r.origin for r in applied_b] == [a.peer_id]
    assert a.summary() == b.summary()


def test_bucket_summaries_in_the_simulator_decode_identically_and_save_bytes(wl):
    kw = dict(nodes=6, policy="prefixmesh", seed=2)
    base = simulate(wl, SimConfig(**kw)).metrics
    fast = simulate(wl, SimConfig(**kw, bucket_summaries=True)).metrics
    slow = simulate(wl, SimConfig(**kw, bucket_summaries=True, decode_messages=True)).metrics
    for key in ("digest_bytes_per_node_s", "latency_s", "hit_ratio", "gossip_messages"):
        assert fast[key] == slow[key]
    assert fast["digest_bytes_per_node_s"] < base["digest_bytes_per_node_s"]
    assert abs(fast["hit_ratio"] - base["hit_ratio"]) < 0.02


def test_idle_digest_harness_and_t7_sweep(tmp_path):
    from prefixmesh.bench import sweep

    full = measure_idle_digest(8, duration_s=40.0)
    buck = measure_idle_digest(8, duration_s=40.0, bucket_summaries=True)
    assert 0 < buck["digest_bytes_per_node_s"] < full["digest_bytes_per_node_s"]
    out = tmp_path / "bench"
    rc = sweep.main(["--quick", "--out", str(out), "--plots", str(tmp_path / "p"),
                     "--experiments", "t7", "--no-plots"])  # fmt: skip
    assert rc == 0
    rows = sweep.read_csv(out / "sim_t7.csv")
    assert {r["mode"] for r in rows} == {"idle", "load"}
    assert "T7: digest traffic" in (out / "sim.md").read_text()
