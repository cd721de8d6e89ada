"""How long the live page's refresh takes on a long run: the store queries of one refresh tick,
and optionally the whole page rendered by Streamlit's AppTest. Prints markdown tables.

    python bench/dashboard_bench.py            # 1M steps x 20 metrics (built once, ~minutes)
    python bench/dashboard_bench.py --quick    # 100K steps x 20 metrics
    python bench/dashboard_bench.py --no-page  # store queries only

The database is written through the real store (RunWriter: spool, ingest, rollup), as a
trainer would, and kept at --db for later runs (rebuilt if its run is missing or short).

What is timed (target: a refresh tick under 100 ms):
  first load   one read connection, every live chart's series at the chart's bucket width from
               step 0, the raw noise-scale window, events, memory plan; then the commands table.
  refresh      the same after `--append` new steps arrived: each series refetched only from the
               start of its last (partial) bucket, the noise-scale window from its last step.
The query plan is dashboard/live_data.py's (LiveState.refresh + live_snapshot), timed without
Streamlit: its constants are imported from there, and tests/test_dashboard_bench.py checks that the
fetches stay in step.
`page` renders the live page with AppTest (the real app.py and pages, figures serialized), first
run and reruns (a rerun is one refresh of an open session).

A team's database, many runs of 2,000 steps x 20 metrics (issue 29), before and after a change:

    python -m bench.dashboard_bench --runs 10,100,1000 --before ../old-checkout --reps 5

builds out/dashboard-runs/runs-NxS.duckdb once per size (each a copy of the smaller one topped
up, written by the --before checkout so both can read it) and measures each version in its own
process on its own copy: the store's query patterns (a connect; one run's series; 10 runs'
curves a connect each and in one session, with series_many where the version has it; the
latest loss of every run), the Runs page and the compare page with 10 runs (one of them live:
resumed, 5 new steps before each refresh) rendered by AppTest after a warm-up on a one-run file
(first load with empty caches, then reruns), and
the live page's query plan on the live run. The first open of the copy is timed too (a newer
version upgrades the file there).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rampwatch.dashboard.buckets import width_for
from rampwatch.dashboard.live_data import (
    COMMANDS_EVERY,
    GNS_WINDOW,
    LIVE_METRICS,
    NAMES_EVERY,
    TARGET_BUCKETS,
)
from rampwatch.store import Reader, RunWriter, commands
from rampwatch.store import names as M

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "rampwatch" / "dashboard" / "app.py"

METRICS_20 = (
    M.LOSS,
    M.GRAD_NORM,
    M.LR,
    M.PER_DEVICE_BATCH,
    M.ACCUM,
    M.BATCH_SEQS,
    M.BATCH_TOKENS,
    M.TOKENS_SEEN,
    M.STEP_TIME,
    M.TOKENS_PER_S,
    M.MFU,
    M.MEM_ALLOCATED,
    M.MEM_RESERVED,
    M.MEM_PEAK,
    M.MEM_CAPACITY,
    M.GNS_G2,
    M.GNS_TRACE,
    M.GNS_RAW,
    M.GNS,
    M.GNS_TOKENS,
)
assert len(METRICS_20) == 20


def _values(steps: np.ndarray) -> dict[str, np.ndarray]:
    s = steps.astype(np.float64)
    loss = 2.0 + 3.0 * np.exp(-s / 2e5) + 0.02 * np.sin(s)
    loss[steps % 99_991 == 5] = np.nan
    gns = 10 * np.exp(s / 3e5)
    return {
        M.LOSS: loss,
        M.GRAD_NORM: 1 + 0.1 * np.cos(s),
        M.LR: np.full(len(s), 3e-4),
        M.PER_DEVICE_BATCH: np.full(len(s), 16.0),
        M.ACCUM: np.full(len(s), 16.0),
        M.BATCH_SEQS: np.full(len(s), 256.0),
        M.BATCH_TOKENS: np.full(len(s), 524288.0),
        M.TOKENS_SEEN: (s + 1) * 524288,
        M.STEP_TIME: np.full(len(s), 1.2),
        M.TOKENS_PER_S: 4.3e5 + s % 1000,
        M.MFU: np.full(len(s), 0.41),
        M.MEM_ALLOCATED: np.full(len(s), 6e10),
        M.MEM_RESERVED: np.full(len(s), 9e10),
        M.MEM_PEAK: 9.1e10 + s % 7,
        M.MEM_CAPACITY: np.full(len(s), 1.41e11),
        M.GNS_G2: np.full(len(s), 1e-3),
        M.GNS_TRACE: gns * 1e-3,
        M.GNS_RAW: gns,
        M.GNS: gns,
        M.GNS_TOKENS: gns * 2048,
    }


def _log(w: RunWriter, first: int, last: int) -> None:
    chunk = 10_000
    for lo in range(first, last, chunk):
        steps = np.arange(lo, min(last, lo + chunk))
        vals = _values(steps)
        cols = [vals[n] for n in METRICS_20]
        for i, s in enumerate(steps.tolist()):
            w.log(s, {n: c[i] for n, c in zip(METRICS_20, cols, strict=True)})
        if lo // chunk % 10 == 9:
            print(f"  logged {min(last, lo + chunk):,} steps", file=sys.stderr, flush=True)


def build(db: Path, steps: int) -> tuple[RunWriter, str]:
    """A live run of `steps` steps x 20 metrics, written through RunWriter (kept open)."""
    db.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", ".wal", ".lock"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    import shutil

    shutil.rmtree(str(db) + ".spool", ignore_errors=True)
    t0 = time.perf_counter()
    w = RunWriter.start(
        db,
        name=f"bench-{steps}",
        config={
            "per_device_batch": 16,
            "accum": 16,
            "world_size": 1,
            "seq_len": 2048,
            "optimizer": "adamw",
            "lr": 3e-4,
        },
        device="NVIDIA H200",
        capacity_bytes=141_000_000_000,
        world_size=1,
        handle_sigterm=False,
    )
    _log(w, 0, steps)
    for s in range(0, steps, 1000):
        w.log(s + 999, {M.VAL_LOSS: 2.0 + 3.0 * math.exp(-s / 2e5)})
    for s in range(0, steps, max(1, steps // 20)):
        w.event(M.EVENT_CHECKPOINT, f"checkpoint at {s}", step=s)
    for b in (8, 16, 32, 64):
        w.memory_plan(b, predicted_bytes=int(3e10 + 3.8e9 * b), source="plan", step=0)
    t_log = time.perf_counter() - t0
    while not w.flush(timeout=60):
        pass
    print(
        f"built {steps:,} steps x 20 metrics in {time.perf_counter() - t0:.0f} s "
        f"(log() {t_log:.0f} s, {os.path.getsize(db) / 1e9:.2f} GB)",
        file=sys.stderr,
    )
    return w, w.run_id


class LiveMirror:
    """dashboard/live_data.py LiveState.refresh + live_snapshot's query plan, timed."""

    def __init__(self):
        self.kept: dict[str, tuple[int, int]] = {}  # name -> (width, last bucket start)
        self.gns_last: dict[str, int] = {}
        self.ticks = 0
        self.open_command = False

    def tick(self, db: Path, run_id: str) -> int:
        r = Reader(db)
        rows = 0
        with r.session():
            run = r.get_run(run_id)
            if self.ticks % NAMES_EVERY == 0:  # the "More charts" names
                r.metric_names(run_id)
            r.events(run_id)
            width = width_for(run.last_step, TARGET_BUCKETS)
            for name in LIVE_METRICS:
                w0, since = self.kept.get(name, (width, 0))
                if w0 != width:  # coarsened locally in dashboard/buckets.py
                    since = since - since % width
                s = r.series(run_id, name, width=width, since_step=since)
                rows += len(s.step)
                self.kept[name] = (width, int(s.step[-1]) if len(s.step) else since)
            lo = max(0, run.last_step - GNS_WINDOW + 1)
            for name in (M.GNS, M.GNS_LOW):  # the card's raw window: points and bounds
                last = self.gns_last.get(name)
                since = lo if last is None else max(lo, last)
                g = r.series(run_id, name, width=1, since_step=since)
                rows += len(g.step)
                if len(g.step):
                    self.gns_last[name] = int(g.last_step[-1])
            r.memory_plan(run_id)
        # commands: every tick while one is open, else every COMMANDS_EVERY ticks
        if self.ticks % COMMANDS_EVERY == 0 or self.open_command:
            cmds = commands.list_commands(db, run_id)
            self.open_command = any(c.status in ("pending", "claimed") for c in cmds)
        self.ticks += 1
        return rows


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    return f"{statistics.median(xs) * 1e3:.1f} | {p90 * 1e3:.1f} | {xs[0] * 1e3:.1f} | {len(xs)}"


def _ticks(
    m: LiveMirror, w: RunWriter, db: Path, run_id: str, last: int, reps: int, append: int
) -> tuple[list[float], int, int]:
    times, rows = [], 0
    for _ in range(reps):
        _log(w, last, last + append)
        last += append
        w.flush(timeout=60)
        t = time.perf_counter()
        rows = m.tick(db, run_id)
        times.append(time.perf_counter() - t)
    return times, rows, last


def bench_queries(db: Path, run_id: str, w: RunWriter, steps: int, reps: int, append: int) -> None:
    """steps: the run's length now (new steps are appended from there)."""
    first, rows_first = [], 0
    for _ in range(reps):
        m = LiveMirror()
        t = time.perf_counter()
        rows_first = m.tick(db, run_id)
        first.append(time.perf_counter() - t)
    m = LiveMirror()
    m.tick(db, run_id)
    refresh, rows_refresh, last = _ticks(m, w, db, run_id, steps, reps, append)
    cid = commands.submit(db, run_id, "ramp", {"per_device_batch": 16, "accum": 32}, actor="bench")
    m.open_command = True
    open_, rows_open, last = _ticks(m, w, db, run_id, last, reps, append)
    commands.cancel(db, cid, actor="bench")
    print(
        f"\n### Live page refresh queries, {steps:,} steps x 20 metrics "
        f"({len(LIVE_METRICS)} series at width {width_for(last, TARGET_BUCKETS)} + noise-scale window)\n"
    )
    print("| what | median ms | p90 ms | min ms | n | buckets read |")
    print("|---|---|---|---|---|---|")
    print(f"| first load (with commands) | {_stats(first)} | {rows_first:,} |")
    print(f"| refresh after {append} new steps | {_stats(refresh)} | {rows_refresh:,} |")
    print(f"| refresh while a ramp command is open | {_stats(open_)} | {rows_open:,} |")
    med = statistics.median(refresh) * 1e3
    print(
        f"\nrefresh median {med:.1f} ms: {'within' if med < 100 else 'OVER'} the 100 ms target"
        f" (commands read every {COMMANDS_EVERY} ticks unless one is open: a connection of "
        "their own)"
    )


def bench_page(db: Path, reps: int) -> None:
    os.environ["RAMPWATCH_DB"] = str(db)
    os.environ.pop("RAMPWATCH_READ_ONLY", None)
    sys.argv = ["app.py"]  # what Streamlit gives the app when nothing follows `--`
    from streamlit.testing.v1 import AppTest

    firsts, reruns = [], []
    for _ in range(max(1, reps // 3)):
        t = time.perf_counter()
        at = AppTest.from_file(str(APP), default_timeout=120).run()
        firsts.append(time.perf_counter() - t)
        assert not at.exception, [e.message for e in at.exception]
        for _ in range(3):
            t = time.perf_counter()
            at.run()
            reruns.append(time.perf_counter() - t)
    print("\n### Whole live page (AppTest: queries + advisor + 5 plotly figures serialized)\n")
    print("| what | median ms | p90 ms | min ms | n |")
    print("|---|---|---|---|---|")
    print(f"| first run of a session | {_stats(firsts)} |")
    print(f"| rerun (one refresh) | {_stats(reruns)} |")


# ------------------------------------------------------------ a team's database: many runs

RUN_STEPS = 2000  # the shape: 2,000 steps x 20 metrics per run
RUNS_DIR = REPO / "out" / "dashboard-runs"
COMPARED = 10  # runs on the compare page


def _team_run(db: Path, i: int, steps: int) -> None:
    """Run i of a team's database: `steps` steps x 20 metrics through RunWriter, then finished.
    Every 7th run has an alert that counts lost records (the Runs page's 'lost records')."""
    w = RunWriter.start(
        db,
        name=f"run-{i:04d}",
        config={"per_device_batch": 8 << (i % 4), "accum": 2, "lr": 3e-4 * (1 + i % 5), "seed": i},
        device="NVIDIA H200",
        capacity_bytes=141_000_000_000,
        world_size=1,
        handle_sigterm=False,
        flush_interval=3600,  # one ingest at close
    )
    vals = _values(np.arange(steps))
    vals[M.LOSS] = vals[M.LOSS] * (1 + 0.001 * i)
    cols = [vals[n] for n in METRICS_20]
    for j in range(steps):
        w.log(j, {n: c[j] for n, c in zip(METRICS_20, cols, strict=True)})
    for s in range(0, steps, 500):
        w.event(M.EVENT_CHECKPOINT, f"checkpoint at {s}", step=s)
    if i % 7 == 3:
        w.event(M.EVENT_ALERT, "records dropped", step=steps // 2, data={"dropped": i})
    w.close("finished")


def _remove(db: Path) -> None:
    import shutil

    for suffix in ("", ".wal", ".lock"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    shutil.rmtree(str(db) + ".spool", ignore_errors=True)


def build_team(db: Path, n_runs: int, steps: int, smaller: Path | None) -> None:
    """db: n_runs runs, a copy of `smaller` (fewer runs built the same way) topped up."""
    import shutil

    _remove(db)
    db.parent.mkdir(parents=True, exist_ok=True)
    first = 0
    if smaller is not None:
        shutil.copyfile(smaller, db)
        first = _file_facts(db)[0]
    t0 = time.perf_counter()
    for i in range(first, n_runs):
        _team_run(db, i, steps)
        if (i + 1) % 100 == 0:
            print(f"  {db.name}: {i + 1} runs, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(
        f"built {db.name}: runs {first}..{n_runs - 1} in {time.perf_counter() - t0:.0f} s "
        f"({os.path.getsize(db) / 1e6:.0f} MB)",
        file=sys.stderr,
        flush=True,
    )


def _file_facts(db: Path) -> tuple[int, int]:
    """(runs, schema version) read with duckdb itself: looking upgrades nothing."""
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        [(runs,)] = con.execute("SELECT count(*) FROM runs").fetchall()
        [(version,)] = con.execute("SELECT max(version) FROM rampwatch_schema").fetchall()
    return int(runs), int(version)


def _python(code: Path, *args: str, timeout: float = 7200) -> str:
    """This file run on the rampwatch of checkout `code`; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} on {code} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def team_base(root: Path, n_runs: int, steps: int, code: Path, smaller: Path | None) -> Path:
    """root/runs-NxS.duckdb, written by checkout `code` (the oldest compared, so that every
    version reads it; a newer one upgrades its copy when it first opens it). Built once."""
    db = root / f"runs-{n_runs}x{steps}.duckdb"
    version = int(_python(code, "--code-version").strip())
    if not (db.exists() and _file_facts(db) == (n_runs, version)):
        _python(
            code,
            "--build-team",
            str(n_runs),
            "--run-steps",
            str(steps),
            "--into",
            str(db),
            *(["--smaller", str(smaller)] if smaller else []),
        )
    return db


def _connect_only(db: Path) -> None:
    from rampwatch.store import read_connection

    with read_connection(db):
        pass


def _page_env(db: Path):
    """Streamlit's AppTest set up on `db`, with what a running server has done once already
    (imports, the first script runs of both pages) done on a one-run database beside it."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    import rampwatch

    app = str(Path(rampwatch.__file__).parent / "dashboard" / "app.py")
    sys.argv = ["app.py"]
    os.environ.pop("RAMPWATCH_READ_ONLY", None)
    warm = db.parent / "warm-up.duckdb"
    _remove(warm)
    _team_run(warm, 0, 50)
    os.environ["RAMPWATCH_DB"] = str(warm)
    for page in ("views/runs.py", "views/compare.py"):
        AppTest.from_file(app, default_timeout=120).switch_page(page).run()
    _remove(warm)
    st.cache_data.clear()
    os.environ["RAMPWATCH_DB"] = str(db)
    return st, AppTest, app


def measure_team(db: Path, reps: int, page_reps: int) -> dict[str, list[float]]:
    """Every figure of the team bench on `db`, with the rampwatch this process imports."""
    out: dict[str, list[float]] = {}

    def timed(what, fn, n=reps):
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out.setdefault(what, []).append(time.perf_counter() - t)

    r = Reader(db)
    timed("first open (a newer version upgrades the file)", r.list_runs, n=1)
    runs = r.list_runs()
    ids = [x.run_id for x in runs]
    compared = ids[:COMPARED]
    timed("connect alone (store.read_connection)", lambda: _connect_only(db))
    timed("series() of one run, 2,000 buckets", lambda: r.series(compared[1], M.LOSS))
    timed("10 runs' loss curves, a connect each", lambda: [r.series(i, M.LOSS) for i in compared])

    def one_session():  # as the compare page reads them: series_many where there is one
        with r.session():
            if hasattr(r, "series_many"):
                r.series_many([(i, M.LOSS) for i in compared])
            else:
                [r.series(i, M.LOSS) for i in compared]

    timed("10 runs' loss curves, one session", one_session)
    if hasattr(r, "metric_stats"):
        timed("latest loss of every run", lambda: r.metric_stats([M.LOSS]))
    else:  # one call per run, the only way there is
        timed("latest loss of every run", lambda: [r.latest(i, [M.LOSS]) for i in ids], n=1)

    st, AppTest, app = _page_env(db)
    for _ in range(page_reps):
        st.cache_data.clear()
        at = AppTest.from_file(app, default_timeout=1800).switch_page("views/runs.py")
        timed("Runs page, first load", at.run, n=1)
        assert not at.exception, [e.message for e in at.exception]
        [table] = [d.value for d in at.dataframe if "status" in d.value.columns]
        assert len(table) == len(runs), (len(table), len(runs))
        timed("Runs page, second load", at.run, n=1)

    live = runs[0]  # resumed at its last step: new steps arrive while the pages refresh
    w = RunWriter.start(
        db,
        run_id=live.run_id,
        resume_step=live.last_step,
        flush_interval=3600,
        handle_sigterm=False,
    )
    last = live.last_step + 1

    def append():
        nonlocal last
        _log(w, last, last + 5)
        last += 5
        w.flush(timeout=60)

    try:
        w.flush(timeout=60)
        for _ in range(page_reps):
            st.cache_data.clear()
            at = AppTest.from_file(app, default_timeout=1800).switch_page("views/compare.py")
            at.session_state["compare_runs"] = compared
            timed("Compare, 10 runs (one live), first load", at.run, n=1)
            assert not at.exception, [e.message for e in at.exception]
            timed("Compare, rerun, nothing new", at.run, n=1)
            for _ in range(reps):
                append()
                timed("Compare, rerun after 5 new steps of the live run", at.run, n=1)
        for _ in range(reps):
            timed("live page's series, first load", lambda: LiveMirror().tick(db, live.run_id), 1)
        m = LiveMirror()
        m.tick(db, live.run_id)
        for _ in range(reps):
            append()
            timed(
                "live page's series, refresh after 5 new steps", lambda: m.tick(db, live.run_id), 1
            )
    finally:
        w.close("finished")
    return out


def _cell(xs: list[float] | None) -> str:
    if not xs:
        return "—"
    return f"{statistics.median(xs) * 1e3:,.0f} ({len(xs)})"


def bench_team(
    root: Path, sizes: list[int], steps: int, before: Path | None, reps: int, page_reps: int
):
    """The team's database at each size: before (checkout `before`) and after (this checkout),
    each on its own copy of the same file, in one run. Prints one markdown table."""
    import json
    import shutil

    codes = [("before", before)] if before else []
    codes.append(("after", REPO))
    load0 = os.getloadavg()
    results, smaller = {}, None
    for n in sizes:
        base = team_base(root, n, steps, codes[0][1], smaller)
        smaller = base
        for label, code in codes:
            copy = root / f"{base.stem}.{label}.duckdb"
            _remove(copy)
            shutil.copyfile(base, copy)
            print(f"measuring {label} on {copy.name}", file=sys.stderr, flush=True)
            raw = _python(
                code,
                "--measure-team",
                str(copy),
                "--reps",
                str(reps),
                "--page-reps",
                str(page_reps),
            )
            results[(n, label)] = json.loads(raw.strip().splitlines()[-1])
            _remove(copy)
    load1 = os.getloadavg()
    rows = list(dict.fromkeys(k for res in results.values() for k in res))
    cols = [(n, label) for n in sizes for label, _ in codes]
    print(
        f"\n### A team's database: runs of {steps:,} steps x 20 metrics "
        f"(median ms, (n); {os.cpu_count()} cores, load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} after)\n"
    )
    print("| what | " + " | ".join(f"{n:,} runs {label}" for n, label in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for what in rows:
        print(f"| {what} | " + " | ".join(_cell(results[c].get(what)) for c in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100K steps instead of 1M")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--db", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--append", type=int, default=5, help="new steps between refreshes")
    ap.add_argument("--no-page", action="store_true", help="skip the AppTest page timing")
    ap.add_argument("--runs", help="a team's database instead: run counts, e.g. 10,100,1000")
    ap.add_argument("--run-steps", type=int, default=RUN_STEPS, help="steps of each such run")
    ap.add_argument("--before", type=Path, help="with --runs: a checkout to measure too")
    ap.add_argument("--dir", type=Path, default=RUNS_DIR, help="with --runs: where files go")
    ap.add_argument("--page-reps", type=int, default=2, help="with --runs: cold page loads")
    ap.add_argument("--build-team", type=int, help=argparse.SUPPRESS)  # the subprocesses'
    ap.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--smaller", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--measure-team", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--code-version", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.code_version:
        from rampwatch.store.schema import CURRENT_VERSION

        return print(CURRENT_VERSION)
    if a.build_team:
        return build_team(a.into, a.build_team, a.run_steps, a.smaller)
    if a.measure_team:
        import json

        return print(json.dumps(measure_team(a.measure_team, a.reps, a.page_reps)))
    if a.runs:
        sizes = [int(x) for x in a.runs.split(",")]
        before = a.before.resolve() if a.before else None
        return bench_team(a.dir, sizes, a.run_steps, before, a.reps, a.page_reps)
    steps = a.steps or (100_000 if a.quick else 1_000_000)
    db = a.db or Path(f"/tmp/rampwatch-bench/dashboard-{steps}.duckdb")
    found = None
    if db.exists():
        try:
            found = next(
                (
                    r
                    for r in Reader(db).list_runs()
                    if r.name == f"bench-{steps}" and (r.last_step or 0) >= steps - 1
                ),
                None,
            )
        except Exception as e:  # noqa: BLE001 - rebuild anything unreadable
            print(f"rebuilding {db}: {e}", file=sys.stderr)
    if found is None:
        w, run_id = build(db, steps)
        last = steps
    else:  # reuse: resume the run at its last step and append to it (nothing is deleted)
        run_id, last = found.run_id, found.last_step + 1
        w = RunWriter.start(db, run_id=run_id, resume_step=found.last_step, handle_sigterm=False)
        w.flush(timeout=60)
        print(f"reusing {db} ({os.path.getsize(db) / 1e9:.2f} GB, {last:,} steps)", file=sys.stderr)
    try:
        bench_queries(db, run_id, w, last, a.reps, a.append)
        if not a.no_page:
            bench_page(db, a.reps)
    finally:
        w.close("finished")


if __name__ == "__main__":
    main()
