"""Simulator digest-rate knobs (issue 6, T7): bucketed summaries and batched deltas."""

from __future__ import annotations

import pytest

from prefixmesh.bench.sim import (
    SimConfig,
    Simulator,
    measure_idle_digest,
    simulate,
)
from prefixmesh.bench.workloads import synthetic_workload


@pytest.fixture(scope="module")
def wl():
    return synthetic_workload(300, rate=6.0, n_docs=30, n_system=4, seed=1)


def test_min_record_interval_issues_fewer_records(wl):
    base = Simulator(wl, SimConfig(nodes=4, policy="prefixmesh", seed=1))
    base.run()
    batched = Simulator(wl, SimConfig(nodes=4, policy="prefixmesh", seed=1,
                                      min_record_interval_s=5.0))  # fmt: skip
    batched.run()
    issued = [sum(n.ae.stats["records_issued"] for n in s.nodes) for s in (base, batched)]
    assert issued[1] < issued[0]


def test_bucket_summaries_in_the_simulator_decode_identically_and_save_bytes(wl):
    kw = dict(nodes=6, policy="prefixmesh", seed=2)
    # full summaries named explicitly: the simulator's default follows the node's (buckets on)
    base = simulate(wl, SimConfig(**kw, bucket_summaries=False)).metrics
    fast = simulate(wl, SimConfig(**kw, bucket_summaries=True)).metrics
    slow = simulate(wl, SimConfig(**kw, bucket_summaries=True, decode_messages=True)).metrics
    for key in ("digest_bytes_per_node_s", "latency_s", "hit_ratio", "gossip_messages"):
        assert fast[key] == slow[key]
    assert fast["digest_bytes_per_node_s"] < base["digest_bytes_per_node_s"]
    assert abs(fast["hit_ratio"] - base["hit_ratio"]) < 0.02


def test_idle_digest_harness_and_t7_sweep(tmp_path):
    from prefixmesh.bench import sweep

    # refreshes every 20 s: idle traffic is what they cost (the node's default, 300 s,
    # issues none in a 40 s window)
    old_refresh = {"refresh_interval_s": 20.0, "digest_ttl_s": 60.0}
    full = measure_idle_digest(8, duration_s=40.0, **old_refresh)
    buck = measure_idle_digest(8, duration_s=40.0, bucket_summaries=True, **old_refresh)
    assert 0 < buck["digest_bytes_per_node_s"] < full["digest_bytes_per_node_s"]
    out = tmp_path / "bench"
    rc = sweep.main(["--quick", "--out", str(out), "--plots", str(tmp_path / "p"),
                     "--experiments", "t7", "--no-plots"])  # fmt: skip
    assert rc == 0
    rows = sweep.read_csv(out / "sim_t7.csv")
    assert {r["mode"] for r in rows} == {"idle", "load"}
    assert "T7: digest traffic" in (out / "sim.md").read_text()
