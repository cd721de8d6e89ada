"""bench/dashboard_bench.py (which takes the live page's query plan from dashboard/live_data.py itself)
runs: a quick run prints its tables."""

from __future__ import annotations

from tests.procs import bench_output


def test_bench_runs_small(tmp_path):
    args = ("--steps", "3000", "--reps", "3", "--no-page", "--db", str(tmp_path / "b.duckdb"))
    out = bench_output("dashboard_bench", *args, timeout=120)
    assert "| refresh after 5 new steps |" in out
    assert "| refresh while a ramp command is open |" in out


def test_team_bench_runs_small(tmp_path):
    """--runs: a team's database built through RunWriter, every figure measured in a child."""
    args = ("--runs", "2", "--run-steps", "40", "--reps", "1", "--page-reps", "1")
    out = bench_output("dashboard_bench", *args, "--dir", str(tmp_path), timeout=240)
    for row in ("Runs page, first load", "Compare, rerun after 5 new steps of the live run"):
        assert f"| {row} | " in out, out
    assert "| 2 runs after |" in out
