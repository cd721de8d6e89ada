"""bench/monitor_cost_bench.py and store_bench's --log-only run: a quick run prints their tables.
No timing is asserted (the figures are the machine's), only that every row is measured."""

from __future__ import annotations

from tests.procs import bench_output


def test_monitor_cost_bench_runs_quick(tmp_path):
    out = bench_output(
        "monitor_cost_bench", "--quick", "--profile", "--dir", str(tmp_path), timeout=240
    )
    for model in ("nanogpt", "cpu-tiny"):
        assert f"### {model}: " in out, out
    for row in ("after_backward() x2", "after_backward() x4", "step()", "ramp_due()"):
        assert f"| {row} | " in out, out
    assert "| bare step (no monitor) | " in out
    assert out.count("Flusher thread: ") == 2
    assert "writer errors 0" in out
    assert "| NoiseScaleWindow.update | " in out  # step()'s parts, timed in the loop
    assert "gns_window.py" in out  # the profile names where step() spends its time


def test_store_bench_log_only_runs_small(tmp_path):
    out = bench_output(
        "store_bench", "--log-only", "--calls", "2000", "--dir", str(tmp_path), timeout=120
    )
    rows = [line for line in out.splitlines() if line.startswith("| log() 20 metrics")]
    assert len(rows) == 5, out  # with the flusher at the old switch interval, beside the new
    assert sum("switch interval (before)" in r for r in rows) == 1, out
    assert all("p99.9 " in r and "max " in r for r in rows), out
    assert "chart" not in out  # --log-only: no 1M-step file is built


def test_monitor_cost_bench_times_the_window_against_a_revision():
    out = bench_output("monitor_cost_bench", "--window-against", "HEAD", timeout=240)
    rows = [
        line for line in out.splitlines() if line.startswith("| ") and " in the window) | " in line
    ]
    assert len(rows) == 6, out  # three window lengths, this code and HEAD's
    assert sum("| this code |" in r for r in rows) == 3 and sum("| HEAD |" in r for r in rows) == 3
