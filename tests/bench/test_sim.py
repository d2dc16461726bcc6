"""The discrete-event simulator (small synthetic runs, seconds). The sweep harness,
bench/sweep.py, is tests/bench/test_sweep.py."""

from __future__ import annotations

import argparse
import json

import pytest

from prefixmesh.bench.sim import (
    SimConfig,
    Simulator,
    add_sim_arguments,
    measure_convergence,
    percentile,
    run_bench_sim,
    simulate,
)
from prefixmesh.bench.workloads import Request, Workload, synthetic_workload

BIG = 1 << 40


@pytest.fixture(scope="module")
def small_wl() -> Workload:
    return synthetic_workload(300, rate=6.0, n_docs=30, n_system=4, seed=1)


def test_percentile_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    assert percentile([5.0], 1) == 5.0


def test_same_seed_same_result(small_wl):
    cfg = SimConfig(nodes=4, policy="prefixmesh", jitter_ms=1.0, seed=7)
    a = simulate(small_wl, cfg).metrics
    b = simulate(small_wl, cfg).metrics
    for key in ("hit_ratio", "latency_s", "forwarded_fraction", "digest_bytes_per_node_s"):
        assert a[key] == b[key]


def test_single_node_unlimited_cache_reaches_the_ideal(small_wl):
    # One node, unlimited capacity, every match reused: the hit ratio is exactly the
    # ideal one, except that the last prompt token is always recomputed.
    cfg = SimConfig(nodes=1, policy="local", kv_capacity_bytes=BIG, min_reuse_tokens=1)
    res = simulate(small_wl, cfg)
    ideal = small_wl.ideal_per_request()
    expect = sum(
        min(i, len(r.tokens) - 1) for i, r in zip(ideal, small_wl.requests, strict=True)
    ) / sum(len(r.tokens) for r in small_wl.requests)
    assert res.metrics["hit_ratio"] == pytest.approx(expect)
    assert res.requests == len(small_wl)


def test_service_model_latencies():
    # Two identical prompts far apart in time on one node: the second reuses all but the
    # last token: restore + 1 token of prefill + decode.
    toks = tuple(range(1, 1001))
    wl = Workload("two", [Request(0, 0.0, toks, 12), Request(1, 100.0, toks, 12)], "ids")
    cfg = SimConfig(nodes=1, policy="local", prefill_tps=500.0, decode_tps=100.0,
                    restore_s=0.25, kv_capacity_bytes=BIG)  # fmt: skip
    sim = Simulator(wl, cfg)
    res = sim.run()
    cold = 1000 / 500.0 + 12 / 100.0
    warm = 0.25 + 1 / 500.0 + 12 / 100.0
    assert sim.m_e2e == pytest.approx([cold, warm])
    assert sim.m_ttft == pytest.approx([cold - 0.12, warm - 0.12])
    assert res.metrics["hit_ratio"] == pytest.approx(999 / 2000)


def test_fifo_queue_wait_counts():
    toks_a, toks_b = tuple(range(1, 401)), tuple(range(1001, 1401))
    wl = Workload("q", [Request(0, 0.0, toks_a, 1), Request(1, 0.1, toks_b, 1)], "ids")
    cfg = SimConfig(nodes=1, policy="local", prefill_tps=400.0, decode_tps=100.0)
    sim = Simulator(wl, cfg)
    sim.run()
    assert sim.m_e2e[0] == pytest.approx(1.01)
    assert sim.m_e2e[1] == pytest.approx(1.01 - 0.1 + 1.01)  # waited for the first


def test_capacity_limits_hits(small_wl):
    big = simulate(small_wl, SimConfig(nodes=1, policy="local", kv_capacity_bytes=BIG))
    tiny = simulate(
        small_wl, SimConfig(nodes=1, policy="local", kv_capacity_bytes=2000 * 23_052)
    )
    assert tiny.metrics["hit_ratio"] < big.metrics["hit_ratio"]


def test_gossip_is_real_and_routing_uses_it(small_wl):
    cfg = SimConfig(nodes=4, policy="paper", kv_capacity_bytes=30_000 * 23_052)
    sim = Simulator(small_wl, cfg)
    res = sim.run()
    m = res.metrics
    assert m["digest_bytes_per_node_s"] > 0
    # every node learned every other node from signed records
    for node in sim.nodes:
        assert len(node.index) == 3
        assert node.ae.stats["records_received"] > 0
    assert 0 < m["forwarded_fraction"] < 1
    assert m["forwards_with_estimate"] > 0
    assert m["hit_ratio"] <= m["ideal_hit_ratio"] + 1e-9


def test_cache_aware_routing_beats_local_only(small_wl):
    cap = 12_000 * 23_052  # a few prompts per node: affinity matters
    local = simulate(small_wl, SimConfig(nodes=4, policy="local", kv_capacity_bytes=cap))
    mesh = simulate(small_wl, SimConfig(nodes=4, policy="prefixmesh", kv_capacity_bytes=cap))
    oracle = simulate(small_wl, SimConfig(nodes=4, policy="oracle", kv_capacity_bytes=cap))
    assert mesh.metrics["hit_ratio"] > local.metrics["hit_ratio"]
    assert oracle.metrics["hit_ratio"] > local.metrics["hit_ratio"]


def test_baselines_run_and_forward_once(small_wl):
    for pol in ("round-robin", "random", "consistent-hash"):
        res = simulate(small_wl, SimConfig(nodes=4, policy=pol))
        assert res.metrics["mean_hops_forwarded"] in (0.0, 1.0)
        assert res.metrics["forwarded_fraction"] > 0.5  # 3 of 4 targets are remote


def test_lying_peers_cause_false_hits(small_wl):
    honest = simulate(small_wl, SimConfig(nodes=8, policy="paper", seed=2))
    lying = simulate(small_wl, SimConfig(nodes=8, policy="paper", liar_fraction=0.25, seed=2))
    assert lying.metrics["liars"] == 2
    assert lying.metrics["forwarded_to_liars"] > 0
    assert lying.metrics["false_hit_rate"] > honest.metrics["false_hit_rate"]


def test_convergence_of_a_new_prefix():
    r = measure_convergence(12, fanout=2, interval_s=1.0, seed=3)
    assert r["warmup_complete"] and r["converged"]
    assert 0 < r["convergence_s"] < 30
    assert r["digest_bytes_per_node_s"] > 0


def _cli(argv):
    p = argparse.ArgumentParser()
    add_sim_arguments(p)
    return p.parse_args(argv)


def test_bench_sim_cli_json(capsys):
    ns = _cli(["--workload", "synthetic", "--requests", "150", "--nodes", "3", "--json"])
    assert run_bench_sim(ns) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 150
    assert 0 <= out["metrics"]["hit_ratio"] <= 1


def test_the_workload_seed_keeps_the_workload_while_the_simulation_seed_changes(capsys):
    """``--seed`` alone draws another workload too (a regenerated one: for mmlu, any seed
    but 0 leaves the shared trace); ``--workload-seed`` pins the workload."""
    def run(*argv: str) -> dict:
        ns = _cli(["--workload", "synthetic", "--requests", "300", "--nodes", "3", "--json",
                   *argv])
        assert run_bench_sim(ns) == 0
        out = json.loads(capsys.readouterr().out)
        return {"ideal": out["metrics"]["ideal_hit_ratio"], "seed": out["config"]["seed"],
                "latencies": out["metrics"]["latency_s"]}

    base, other, pinned = run(), run("--seed", "1"), run("--seed", "1", "--workload-seed", "0")
    assert other["ideal"] != base["ideal"]  # another workload
    assert pinned["ideal"] == base["ideal"] and pinned["seed"] == 1  # same workload
    assert pinned["latencies"] != base["latencies"]  # another simulation of it


def test_bench_sim_cli_bad_workload(capsys, tmp_path):
    ns = _cli(["--workload", str(tmp_path / "nope.jsonl")])
    assert run_bench_sim(ns) == 2
    assert "not found" in capsys.readouterr().err


def test_skipping_message_decoding_changes_nothing(small_wl):
    wl = small_wl.head(150)
    fast = simulate(wl, SimConfig(nodes=4, policy="prefixmesh", decode_messages=False))
    slow = simulate(wl, SimConfig(nodes=4, policy="prefixmesh", decode_messages=True))
    assert fast.metrics["digest_bytes_per_node_s"] == slow.metrics["digest_bytes_per_node_s"]
    assert fast.metrics["latency_s"] == slow.metrics["latency_s"]
    assert fast.metrics["hit_ratio"] == slow.metrics["hit_ratio"]


def test_trust_feedback_steers_away_from_liars():
    wl = synthetic_workload(1200, rate=4.0, n_docs=60, n_system=4, seed=1)
    base = SimConfig(nodes=8, policy="prefixmesh", liar_fraction=0.25, seed=2)
    blind = simulate(wl, base).metrics
    base.trust_feedback = True
    wary = simulate(wl, base).metrics
    assert wary["forwarded_to_liars"] < blind["forwarded_to_liars"]
    assert wary["false_hit_rate"] < blind["false_hit_rate"]


def test_ski_rental_stops_paying_rtt_for_the_same_prefix(small_wl):
    light = synthetic_workload(300, rate=0.5, n_docs=10, n_system=2, followup_p=0.0, seed=4)
    base = SimConfig(nodes=4, policy="prefixmesh", delay_ms=250, kv_capacity_bytes=BIG,
                     ski_rental=False)  # fmt: skip
    plain = simulate(light, base).metrics
    base.ski_rental = True
    ski = simulate(light, base).metrics
    assert ski["forwarded_fraction"] < plain["forwarded_fraction"]
    # at 1 ms RTT the rent never reaches the price of a miss: no change at all
    near = SimConfig(nodes=4, policy="prefixmesh", delay_ms=0.5, kv_capacity_bytes=BIG,
                     ski_rental=False)  # fmt: skip
    a = simulate(small_wl, near).metrics
    near.ski_rental = True
    assert simulate(small_wl, near).metrics["latency_s"] == a["latency_s"]


# ------------------------------------------------------- routing improvements (ledgers)


def test_prefixmesh_nodes_feed_their_routing_ledgers(small_wl):
    from prefixmesh.bench.sim import Simulator as Sim  # noqa: PLC0415

    sim = Sim(small_wl.head(150), SimConfig(nodes=4, policy="prefixmesh", seed=3))
    sim.run()
    now = sim.now
    placed = sum(n.placements.total(now) for n in sim.nodes)
    assert placed > 0
    # every decision is booked once at the node that made it: forwards add inbound counts
    # at their targets, so some node has inbound requests iff anything was forwarded
    assert (sum(n.placements.inbound(now) for n in sim.nodes) > 0) == (sim.m_forwarded > 0)
    for n in sim.nodes:
        assert len(n.rent) <= n.rent.max_entries
        assert n.placements.total(now) == pytest.approx(
            sum(n.placements.recent(m.pid, now) for m in sim.nodes)
        )
    local = Sim(small_wl.head(50), SimConfig(nodes=4, policy="local"))
    local.run()
    assert all(len(n.placements) == 0 and len(n.rent) == 0 for n in local.nodes)


def test_ski_rental_setting_follows_routing_unless_overridden(small_wl):
    from prefixmesh.overlay.core.routing import RoutingConfig  # noqa: PLC0415

    wl = small_wl.head(20)
    assert simulate(wl, SimConfig(nodes=2)).config["routing"]["ski_rental"] is True
    assert simulate(wl, SimConfig(nodes=2, ski_rental=False)).config["routing"]["ski_rental"] is False
    off = SimConfig(nodes=2, routing=RoutingConfig(ski_rental=False), ski_rental=True)
    assert simulate(wl, off).config["routing"]["ski_rental"] is True


def test_bench_sim_cli_routing_switches():
    from prefixmesh.bench.sim import config_from_args  # noqa: PLC0415

    cfg = config_from_args(_cli([]))
    assert cfg.ski_rental is None and cfg.routing.bound_placements and cfg.routing.load_slack == 1.0
    cfg = config_from_args(
        _cli(["--no-ski-rental", "--no-placement-bound", "--load-slack", "0"])
    )
    assert cfg.ski_rental is False
    assert not cfg.routing.bound_placements and cfg.routing.load_slack == 0.0
    assert config_from_args(_cli(["--ski-rental"])).ski_rental is True


def test_routing_improvements_do_not_cost_latency_or_hits_on_a_skewed_workload():
    # Zipf 1.5 over documents, 8 nodes at 0.5 req/s each, unlimited caches: the new
    # defaults (ski rental, load slack, placement bound and shedding) against the old
    # rule. Deterministic (one seed); the multi-seed figures are in docs/bench/sim.md.
    from prefixmesh.overlay.core.routing import RoutingConfig  # noqa: PLC0415

    wl = synthetic_workload(800, rate=4.0, alpha=1.5, n_docs=40, n_system=2, seed=3)
    old = RoutingConfig(ski_rental=False, bound_placements=False, load_slack=0.0)
    before = simulate(wl, SimConfig(nodes=8, kv_capacity_bytes=BIG, routing=old)).metrics
    after = simulate(wl, SimConfig(nodes=8, kv_capacity_bytes=BIG)).metrics
    assert after["latency_s"]["mean"] <= before["latency_s"]["mean"]
    assert after["hit_ratio"] >= before["hit_ratio"]
    assert after["load_imbalance_requests"] <= before["load_imbalance_requests"]


def test_trust_feedback_drives_the_nodes_trust_tracker():
    """The simulator's routers keep the node's own TrustTracker (one brain): liars end
    up with misses charged and lower trust than honest peers."""
    from prefixmesh.overlay.core.trust import TrustTracker

    wl = synthetic_workload(600, rate=4.0, n_docs=60, n_system=4, seed=1)
    sim = Simulator(wl, SimConfig(nodes=8, policy="prefixmesh", liar_fraction=0.25, seed=2,
                                  trust_feedback=True))
    sim.run()
    liars = {n.pid for n in sim.nodes if n.liar}
    liar_trust, honest_trust, liar_misses = [], [], 0
    for router in sim.nodes:
        assert isinstance(router.trust, TrustTracker)
        for peer in router.trust.peers():
            rec = router.trust.record(peer)
            (liar_trust if peer in liars else honest_trust).append(rec.trust)
            liar_misses += rec.misses if peer in liars else 0
    assert liar_trust and honest_trust and liar_misses > 0
    assert sum(liar_trust) / len(liar_trust) < sum(honest_trust) / len(honest_trust)
    # without feedback nobody keeps trust and every claim counts in full
    blind = Simulator(wl, SimConfig(nodes=8, policy="prefixmesh", liar_fraction=0.25, seed=2))
    assert all(n.trust is None for n in blind.nodes)


def test_progress_is_reported_and_changes_nothing(small_wl, monkeypatch):
    import prefixmesh.bench.sim as sim_mod

    monkeypatch.setattr(sim_mod, "PROGRESS_EVERY_S", 0.0)  # report at every check
    cfg = SimConfig(nodes=4, policy="prefixmesh")
    seen: list[tuple[int, int]] = []
    with_progress = simulate(small_wl, cfg, progress=lambda d, t: seen.append((d, t)))
    assert seen and all(0 <= d <= t == len(small_wl.requests) for d, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    def simulated(m):  # the wall-clock and CPU speed figures differ between any two runs
        return {k: v for k, v in m.items() if "wall" not in k and "cpu" not in k}

    assert simulated(with_progress.metrics) == simulated(simulate(small_wl, cfg).metrics)


def test_record_memo_answers_as_the_real_decoder():
    """Inside ``memoised_record_decoding`` a record the run signed decodes (from the memo)
    to what the real decoder yields, and altered bytes still fail the real checks."""
    from prefixmesh.bench.gossip import make_antientropy
    from prefixmesh.bench.sim import memoised_record_decoding
    from prefixmesh.overlay.core import antientropy as ae_mod
    from prefixmesh.overlay.core import digest as dg
    from prefixmesh.overlay.core.identity import Identity

    real_decode, real_sign = dg.decode_record, Identity.sign
    ident = Identity.from_seed(bytes(range(32)))
    with memoised_record_decoding():
        ae = make_antientropy(ident, b"m" * 32, now=0.0, ttl=900.0, refresh_interval=300.0)
        ae.local_add_prefix(b"n" * 8, [bytes([i]) * 8 for i in range(1, 6)])
        signed = [*ae.held_records(ident.peer_id), *ae.restate(1.0)]
        assert len(signed) >= 2
        for s in signed:
            memo_answer = ae_mod.decode_record(s.raw, now=2.0, check_expiry=False)
            assert memo_answer == real_decode(s.raw, now=2.0, check_expiry=False)
            assert memo_answer == s
            forged = s.raw[:-1] + bytes([s.raw[-1] ^ 1])  # the signature's last byte
            with pytest.raises(dg.BadSignature):
                ae_mod.decode_record(forged, now=2.0, check_expiry=False)
            # the verdict memo: True for what the run signed, the real check otherwise
            message, sig = dg.SIGNATURE_LABEL + dg.encode_body(s.record), s.raw[-64:]
            assert dg.verify_with_public_key(ident.public_bytes, message, sig)
            assert not dg.verify_with_public_key(ident.public_bytes, message + b"x", sig)
    assert ae_mod.decode_record is real_decode
    assert ae_mod.sign_record is dg.sign_record
    assert Identity.sign is real_sign
