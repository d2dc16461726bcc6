"""bench/membership.py's CPU-starvation model and Lifeguard (issue 18), as seeded
simulator runs: starved nodes (each timer and message handled after an exponential wait)
flap the way 32 real node processes on 2 cores did without Lifeguard, and far less with
it; a crash is still declared dead by everyone; on a healthy network Lifeguard costs little
detection time or traffic. The assertions are ratios between two runs at one seed (the
simulator is deterministic), not wall-clock times; the figures are in docs/SCALING.md."""

from __future__ import annotations

from prefixmesh.bench.membership import Config, main, run

STARVED = dict(nodes=32, seconds=200, seed=1, starve_fraction=1.0, starve_delay_s=0.8)


def test_starved_nodes_flap_without_lifeguard_and_lifeguard_cuts_it():
    before = run(Config(**STARVED, lifeguard=False))
    after = run(Config(**STARVED))
    assert before.starved == after.starved == 32
    # the real 32-process run: 686 distinct suspicions per member-hour, 103 live members
    # declared dead per node-hour; seed 1 here: ~420 and ~90
    assert before.false_suspicions_per_node_hour > 200
    assert before.false_deaths_per_node_hour > 30
    # Lifeguard (seed 1): ~18x fewer false suspicions, ~70x fewer false deaths
    assert after.false_suspicions_per_node_hour * 8 < before.false_suspicions_per_node_hour
    assert after.false_deaths_per_node_hour * 20 < before.false_deaths_per_node_hour
    assert after.lhm_mean > 1.0  # the starved nodes noticed their own lateness
    assert before.lhm_mean == 0.0
    # and the flapping's own traffic (suspicions, refutations) is gone
    assert after.bytes_per_node_s * 4 < before.bytes_per_node_s


def test_a_starved_minority_no_longer_gets_healthy_members_suspected():
    cfg = dict(STARVED, starve_fraction=0.25)
    before = run(Config(**cfg, lifeguard=False))
    after = run(Config(**cfg))
    assert after.starved == 8
    # a starved prober accuses healthy members of its own slowness (seed 1: ~44/node-hour
    # before, none after); the starved ones themselves are still suspected at times (they
    # are slow), and refute
    assert before.false_suspicions_unstarved_per_node_hour > 10
    assert after.false_suspicions_unstarved_per_node_hour * 5 < (
        before.false_suspicions_unstarved_per_node_hour)
    assert after.false_suspicions_per_node_hour < before.false_suspicions_per_node_hour


def test_every_crash_is_still_declared_dead_by_everyone_in_a_starved_mesh():
    r = run(Config(**dict(STARVED, seconds=240), crash_every_s=50))
    # every crash but the last (at 230 s, too close to the end) is known dead by every
    # survivor; slower than on a healthy network (seed 1: median ~34 s), since a starved
    # node probes up to 8x less often
    assert r.crashes == 5 and len(r.detect_times) >= r.crashes - 1
    assert max(r.detect_times) < 90


def test_lifeguard_costs_little_detection_time_or_traffic_on_a_healthy_network():
    cfg = dict(nodes=64, seconds=300, seed=1, crash_every_s=20, loss=0.01, freeze_every_s=10,
               freeze_s=3)
    before = run(Config(**cfg, lifeguard=False))
    after = run(Config(**cfg))
    assert len(after.detect_times) >= after.crashes - 1
    # seed 1: median 11.0 -> 11.1 s; bytes 282 -> 295 per node per second (the accuser
    # tags and the spread confirmations)
    assert after.detect_all_median_s < 1.2 * before.detect_all_median_s
    assert after.detect_all_p99_s < 1.5 * before.detect_all_p99_s
    assert after.false_deaths_per_node_hour <= before.false_deaths_per_node_hour
    assert after.false_suspicions_per_node_hour <= 1.5 * before.false_suspicions_per_node_hour
    assert after.bytes_per_node_s < 1.15 * before.bytes_per_node_s
    assert after.lhm_mean < 0.2  # healthy nodes stay at (nearly) full speed


def test_no_starvation_draws_without_starvation():
    # a zero delay starves nobody, and leaves the run as it was
    a = run(Config(nodes=16, seconds=60, seed=4, starve_fraction=1.0, starve_delay_s=0.0))
    b = run(Config(nodes=16, seconds=60, seed=4))
    assert a.starved == 0
    assert (a.events, a.bytes_per_node_s) == (b.events, b.bytes_per_node_s)


def test_the_command_line_takes_the_starvation_and_baseline_flags(capsys):
    assert main(["--nodes", "8", "--seconds", "40", "--starve-fraction", "0.5",
                 "--starve-delay-ms", "300", "--no-lifeguard", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"starved": 4' in out and '"lhm_mean": 0.0' in out
