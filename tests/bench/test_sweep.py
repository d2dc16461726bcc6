"""bench/sweep.py: the benchmark sweep harness at its --quick scale (two experiments, no
plots): its CSVs, the summary it writes, and that a regenerated summary keeps the
hand-written analysis."""

from __future__ import annotations

from prefixmesh.bench import sweep


def test_sweep_quick_harness(tmp_path):
    out, plots = tmp_path / "bench", tmp_path / "plots"
    rc = sweep.main(["--quick", "--out", str(out), "--plots", str(plots),
                     "--experiments", "delay,convergence", "--no-plots"])  # fmt: skip
    assert rc == 0
    rows = sweep.read_csv(out / "sim_delay.csv")
    assert {r["label"] for r in rows} >= {"paper", "prefixmesh", "round-robin", "oracle"}
    assert all(0 <= r["hit_ratio"] <= 1 for r in rows)
    md = (out / "sim.md").read_text()
    assert "sim_delay.csv" in md and "sim_convergence.csv" in md
    # the hand-written analysis section survives a regeneration
    (out / "sim.md").write_text(md + "\nmy analysis\n")
    sweep.write_summary(out, plots, "cmd")
    assert "my analysis" in (out / "sim.md").read_text()
