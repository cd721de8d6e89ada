"""bench/dashboard_bench.py mirrors the live page's query plan (bench/ may not import dashboard/):
the same series, bucket target, noise-scale window and command polling, and a quick run works."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from rampwatch.dashboard import data
from rampwatch.dashboard.buckets import width_for
from tests.procs import REPO, child_env

_spec = importlib.util.spec_from_file_location("dashboard_bench", REPO / "bench" / "dashboard_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_bench_mirrors_the_live_page():
    assert bench.LIVE_METRICS == data.LIVE_METRICS
    assert bench.TARGET_BUCKETS == data.TARGET_BUCKETS
    assert bench.GNS_WINDOW == data.GNS_WINDOW
    assert bench.COMMANDS_EVERY == data.COMMANDS_EVERY
    for last in (None, 0, 999, 1000, 65_535, 1_000_000):
        assert bench.width_for(last) == width_for(last, data.TARGET_BUCKETS)


def test_bench_runs_small(tmp_path):
    out = subprocess.run(
        [sys.executable, "bench/dashboard_bench.py", "--steps", "3000", "--reps", "3", "--no-page",
         "--db", str(tmp_path / "b.duckdb")],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| refresh after 5 new steps |" in out.stdout
    assert "| refresh while a ramp command is open |" in out.stdout
