"""Compaction benchmark: bytes per logged value before and after `rampwatch compact`.

Writes RUNS concurrent runs x STEPS steps x 20 metrics through the real RunWriter (every run's
writer open at once, all flushed every 250 steps, so the runs' rows interleave in the metrics
table as concurrent runs' do), then runs `compact(db, keep_last_steps=K)` and prints one
markdown table: file size and bytes per logged value before and after, the raw rows kept, the
seconds the compaction took and the load average around it. It checks that one run's chart at
64-step width is the same before and after. `--quick` shrinks everything for a smoke run.
Figures depend on the machine and its load: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rampwatch import store
from rampwatch.store.compact import compact

N_METRICS = 20
NAMES = [f"metric_{j:02d}" for j in range(N_METRICS)]


def build(db: Path, runs: int, steps: int) -> list[str]:
    writers = [
        store.RunWriter.start(
            db, f"run-{i}", flush_interval=10**6, lock_timeout=600, handle_sigterm=False
        )
        for i in range(runs)
    ]
    rng = np.random.default_rng(1)
    walks = np.cumsum(rng.standard_normal((runs, steps, N_METRICS)), axis=1).tolist()
    for step in range(steps):
        for w, walk in zip(writers, walks, strict=True):
            w.log(step, dict(zip(NAMES, walk[step], strict=True)))
        if step % 250 == 249:
            for w in writers:
                assert w.flush(timeout=600), w.last_error
    for w in writers:
        assert w.close(timeout=600)
    return [w.run_id for w in writers]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--keep-last-steps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="10 runs x 500 steps")
    p.add_argument("--dir", help="where to write the database (default: a temporary folder)")
    a = p.parse_args()
    if a.quick:
        a.runs, a.steps, a.keep_last_steps = 10, 500, 100
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        db = Path(tmp) / "bench.duckdb"
        t0 = time.perf_counter()
        run_ids = build(db, a.runs, a.steps)
        t_build = time.perf_counter() - t0
        values = a.runs * a.steps * N_METRICS
        size0 = db.stat().st_size
        chart0 = store.series(db, run_ids[0], NAMES[0], width=64)
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        report = compact(db, keep_last_steps=a.keep_last_steps)
        t_compact = time.perf_counter() - t0
        load1 = os.getloadavg()
        chart1 = store.series(db, run_ids[0], NAMES[0], width=64)
        for f in ("step", "min", "max", "last", "count"):
            assert np.array_equal(getattr(chart0, f), getattr(chart1, f)), f
        size1 = db.stat().st_size
        kept = report.rows_before - report.dropped
        assert report.rows_before == values, (report.rows_before, values)
        print(
            f"{a.runs} runs x {a.steps} steps x {N_METRICS} metrics = {values:,} values "
            f"(written in {t_build:.0f} s); `rampwatch compact DB --keep-last-steps "
            f"{a.keep_last_steps}`"
        )
        print()
        print("| | file bytes | bytes per logged value | raw rows |")
        print("|---|---:|---:|---:|")
        print(f"| before | {size0:,} | {size0 / values:.1f} | {values:,} |")
        print(f"| after | {size1:,} | {size1 / values:.1f} | {kept:,} |")
        print()
        print(
            f"compaction {t_compact:.1f} s; bytes per kept raw row after: "
            f"{size1 / max(1, kept):.1f} (rollups and other tables included); "
            f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
            f"{os.cpu_count()} CPUs; 64-step chart identical"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
