"""``prefixmesh bench swarm --churn``: the churn schedule, the phase bookkeeping and the
per-phase / detection summaries (pure: no node process is started)."""

from __future__ import annotations

import argparse
import math

import pytest

from prefixmesh.bench.swarm import (
    CHURN_FIELDS,
    SwarmBenchConfig,
    SwarmBenchError,
    add_swarm_arguments,
    churn_schedule,
    churn_victims,
    config_from_namespace,
    format_churn_table,
    phase_of,
    summarise_detection,
    summarise_phases,
)


def test_victims_are_a_fifth_never_node_zero_half_killed_half_frozen():
    v = churn_victims(32, 0.2)
    assert len(v) == 6 and len({n for n, _ in v}) == 6
    assert all(1 <= n < 32 for n, _ in v)
    assert [k for _, k in v].count("kill") == 3 and [k for _, k in v].count("stop") == 3
    assert churn_victims(32, 0.2) == v  # deterministic
    assert churn_victims(5, 0.0) == []
    assert len(churn_victims(3, 0.9)) == 2  # never more than the nodes besides node 0


def test_schedule_round_robin_within_the_churn_phase():
    ev = churn_schedule(32, 0.2, churn_s=600.0, interval_s=15.0, down_s=20.0)
    assert len(ev) == 39  # at 7.5, 22.5, ..., 577.5: the last one back by 600 s
    assert all(e.at_s + e.down_s <= 600.0 for e in ev)
    assert [e.at_s for e in ev[:3]] == [7.5, 22.5, 37.5]
    victims = churn_victims(32, 0.2)
    assert [(e.node, e.kind) for e in ev[:6]] == victims
    assert [(e.node, e.kind) for e in ev[6:12]] == victims
    # a victim's next cycle starts after its pause ended
    last: dict[int, float] = {}
    for e in ev:
        if e.node in last:
            assert e.at_s >= last[e.node] + e.down_s
        last[e.node] = e.at_s
    assert churn_schedule(32, 0.0, 600.0, 15.0, 20.0) == []


def test_phase_boundaries():
    assert phase_of(0.0, 60, 240) == "before"
    assert phase_of(59.99, 60, 240) == "before"
    assert phase_of(60.0, 60, 240) == "during"
    assert phase_of(299.9, 60, 240) == "during"
    assert phase_of(300.0, 60, 240) == "after"


def _ok(i, phase, ttft, prompt, cached, attempts=1, errors=()):
    return {"i": i, "phase": phase, "ok": True, "ttft_s": ttft, "prompt_tokens": prompt,
            "cached_tokens": cached, "attempts": attempts, "attempt_errors": list(errors)}


def test_phase_summary_counts_answered_lost_retries_and_hits():
    recs = [
        _ok(0, "before", 1.0, 100, 0),
        _ok(1, "before", 0.5, 100, 50),
        _ok(2, "during", 21.0, 100, 80, attempts=2, errors=["AttemptTimeout"]),
        {"i": 3, "phase": "during", "ok": False, "attempts": 6,
         "attempt_errors": ["NotConnected"] * 6},
        _ok(4, "after", 0.2, 200, 200),
    ]
    s = summarise_phases(recs)
    assert (s["before"]["sent"], s["before"]["answered"], s["before"]["lost"]) == (2, 2, 0)
    assert s["before"]["token_hit_ratio"] == pytest.approx(0.25)
    assert s["before"]["ttft_p50_s"] == 0.5 and s["before"]["ttft_p99_s"] == 1.0
    assert (s["during"]["sent"], s["during"]["answered"], s["during"]["lost"]) == (2, 1, 1)
    assert s["during"]["retried"] == 2
    assert s["during"]["attempt_errors"] == {"AttemptTimeout": 1, "NotConnected": 6}
    assert s["after"]["token_hit_ratio"] == 1.0
    assert s["all"]["sent"] == 5 and s["all"]["answered"] == 4
    assert s["all"]["cached_tokens"] == 330 and s["all"]["prompt_tokens"] == 500


def test_detection_summary_uses_complete_events_only():
    dets = [
        {"kind": "kill", "per_node_s": {"1": 1.0, "2": 2.0}, "all_s": 2.0},
        {"kind": "kill", "per_node_s": {"1": 1.5, "2": 3.0}, "all_s": 3.0},
        {"kind": "kill", "per_node_s": {"1": 1.0}, "all_s": None},  # an observer never saw it
        {"kind": "stop", "per_node_s": {"1": 2.5}, "all_s": 2.5},
    ]
    d = summarise_detection(dets)
    assert d["kill"]["events"] == 3 and d["kill"]["complete"] == 2
    assert d["kill"]["all_median_s"] == 2.0 and d["kill"]["all_p99_s"] == 3.0
    assert d["kill"]["observations"] == 5 and d["kill"]["node_median_s"] == 1.5
    assert d["stop"]["all_median_s"] == 2.5
    assert math.isnan(summarise_detection([])["kill"]["all_median_s"])


def _ns(*argv):
    p = argparse.ArgumentParser()
    add_swarm_arguments(p)
    return p.parse_args(list(argv))


def test_cli_churn_options_and_limits():
    plain = config_from_namespace(_ns())
    d = SwarmBenchConfig()
    assert plain.churn == 0 and all(getattr(plain, f) == getattr(d, f) for f in CHURN_FIELDS)
    cfg = config_from_namespace(_ns("--nodes", "32", "--churn", "0.2", "--churn-minutes", "4",
                                    "--no-churn-baseline", "--churn-attempt-timeout", "9"))
    assert (cfg.churn, cfg.churn_minutes, cfg.churn_baseline) == (0.2, 4.0, False)
    assert cfg.churn_attempt_timeout_s == 9.0 and cfg.churn_minutes == 4.0
    assert SwarmBenchConfig().churn_minutes == 10.0  # the 10 minutes by default
    cfg.validate()  # 32 nodes are allowed in churn mode ...
    with pytest.raises(SwarmBenchError):
        SwarmBenchConfig(nodes=32).validate()  # ... the policy comparison keeps 1..16
    with pytest.raises(SwarmBenchError):
        SwarmBenchConfig(nodes=32, churn=1.5).validate()
    with pytest.raises(SwarmBenchError):
        SwarmBenchConfig(nodes=8, churn=0.2, churn_minutes=0.1, churn_down_s=20).validate()
    assert "churn" in CHURN_FIELDS and "start_batch" in CHURN_FIELDS


def test_churn_table_renders():
    run = {"run": "churn", "phases": summarise_phases([_ok(0, "before", 1.0, 10, 5)]),
           "idle": {"window_s": 30.0, "nodes_alive": 4, "lo_bytes_per_node_s": 1234.0,
                    "lo_packets_per_node_s": 20.0,
                    "pss_total_mib": 800.0, "tcp_payload_per_node_s_median": 900.0},
           "startup_s": 12.0, "events": [{"node": 1, "kind": "kill", "at_s": 1.0}],
           "detection": summarise_detection([{"kind": "kill", "per_node_s": {"2": 1.0},
                                              "all_s": 1.0}])}
    cfg = {**SwarmBenchConfig(nodes=4, churn=0.5).__dict__, "policies": ["prefixmesh"]}
    text = format_churn_table({"config": cfg, "network": {"note": "netns"},
                               "trace": {"source": "synthetic"}, "churn": {"runs": [run]},
                               "wall_s": 100.0})
    assert "1/1" in text and "1,234 on the wire" in text and "kill detection" in text
