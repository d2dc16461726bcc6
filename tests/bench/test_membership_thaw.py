"""The membership simulator's rejoin figure: after a SIGSTOP-like freeze, how long until the
thawed node and every other live node hold each other ALIVE again."""

from __future__ import annotations

from prefixmesh.bench.membership import Config, run


def test_a_node_thawed_after_a_long_freeze_is_back_in_every_view_within_seconds():
    # 20 s frozen: longer than the suspicion timeout at N=32, so the others declare it
    # dead; it reads that claim from its queued messages when it thaws and refutes
    r = run(Config(nodes=32, seconds=300, seed=3, freeze_every_s=30, freeze_s=20))
    assert r.false_deaths_per_node_hour > 0  # the frozen nodes were declared dead
    assert r.rejoin_median_s is not None and r.rejoin_max_s is not None
    assert r.rejoin_max_s < 10.0, r
    assert r.rejoins_unfinished <= 1  # only a thaw in the run's last seconds may be open


def test_short_freezes_rejoin_too_and_the_figure_is_in_the_json():
    r = run(Config(nodes=16, seconds=200, seed=1, freeze_every_s=20, freeze_s=3))
    d = r.to_json()
    assert {"rejoin_median_s", "rejoin_max_s", "rejoins_unfinished"} <= d.keys()
    assert d["rejoin_median_s"] is not None and d["rejoin_max_s"] < 10.0
