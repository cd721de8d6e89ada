"""`rampwatch compact`: old raw rows dropped, whole-run charts and everything else kept, the file
smaller; a live writer left alone and logging on; a SIGKILL at any moment leaves the old file or
the new one; bad input is one line, exit 2, nothing changed."""

from __future__ import annotations

import hashlib
import random
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store.compact import ALIGN, compact
from rampwatch.store.compact import tmp_path as copy_path
from rampwatch.store.schema import RAW_AGGREGATES, ROLLUP_LEVELS
from tests import seed
from tests.procs import kill_group, rampwatch_command
from tests.store_child import metric, value
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(240)

SERIES_FIELDS = ("step", "min", "max", "last", "last_step", "count", "nonfinite")


def _same_series(a: store.Series, b: store.Series) -> None:
    assert a.width == b.width
    for f in SERIES_FIELDS:
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


def _snapshot(db, run_id: str) -> dict:
    """Everything but raw rows that a page reads of a run."""
    return {
        "runs": store.list_runs(db),
        "names": store.metric_names(db, run_id),
        "latest": store.latest(db, run_id),
        "stats": store.metric_stats(db),
        "events": store.events(db, run_id),
        "plan": store.memory_plan(db, run_id),
        "trials": store.trials(db, run_id),
        "commands": commands.list_commands(db),
        "log": commands.log(db),
    }


def _raw(db, run_id: str):
    """The run's raw rows (step, name, value), NaN as "nan" so that rows compare equal."""
    t = store.export(db, run_id)
    values = [v if v == v else "nan" for v in t.column("value").to_pylist()]
    return list(
        zip(t.column("step").to_pylist(), t.column("name").to_pylist(), values, strict=True)
    )


def _seed(db, steps: int = 1500) -> tuple[str, str]:
    """A finished run with events, a memory plan, non-finite losses and an applied ramp
    command, and a plain finished run."""
    run = seed.with_command(db, "applied")
    run.close()
    other = seed.finished_run(db, 32, steps=steps)
    return run.run_id, other


def test_compaction_keeps_the_whole_run_drawn(db_path):
    """Drops raw rows before each run's horizon only; series at the rollup widths, latest
    values, events, plans, commands and their log are as before; raw rows from the horizon on
    are intact; the file shrinks; the command sequence and a resume after it still work."""
    live, other = _seed(db_path)
    names = store.metric_names(db_path, other)
    widths = (8, 16, 64, 256)
    before = {
        (r, n, w): store.series(db_path, r, n, width=w)
        for r in (live, other)
        for n in store.metric_names(db_path, r)
        for w in widths
    }
    raw_from = (other, names[0])  # from its horizon (1500 - 200, down to a multiple of 64)
    for w in (1, 4):
        before[(other, names[0], -w)] = store.series(db_path, *raw_from, width=w, since_step=1280)
    snap = {r: _snapshot(db_path, r) for r in (live, other)}
    reference = db_path.with_name("reference.duckdb")
    shutil.copy(db_path, reference)
    raw = {r: _raw(db_path, r) for r in (live, other)}
    size = db_path.stat().st_size

    dry = compact(db_path, keep_last_steps=200, dry_run=True)
    assert db_path.stat().st_size == size and dry.bytes_after is None and dry.dropped > 0
    assert {r: _raw(db_path, r) for r in (live, other)} == raw  # a dry run changes nothing

    report = compact(db_path, keep_last_steps=200)
    horizons = {p.run_id: p.horizon for p in report.runs}
    assert horizons == {live: (400 - 200) // ALIGN * ALIGN, other: (1500 - 200) // ALIGN * ALIGN}
    assert report.bytes_after < size and not copy_path(db_path).exists()
    for (r, n, w), s in before.items():
        if w > 0:
            _same_series(s, store.series(db_path, r, n, width=w))
    for r in (live, other):  # the default draw (2000 buckets): the rollups, the whole run
        for n in store.metric_names(db_path, r):
            got = store.series(db_path, r, n)
            assert got.width == 8, "a short run is drawn from its raw rows, which are gone"
            _same_series(before[(r, n, 8)], got)
    wanted = [(r, n) for r in (live, other) for n in store.metric_names(db_path, r)]
    for (r, n), got in zip(wanted, store.Reader(db_path).series_many(wanted), strict=True):
        _same_series(before[(r, n, 8)], got)  # many at once: chosen from the rollups too
    for r in (live, other):
        assert _snapshot(db_path, r) == snap[r]
        kept = [row for row in raw[r] if row[0] >= horizons[r]]
        assert _raw(db_path, r) == kept, "a raw row from the horizon on changed or went"
        assert report.dropped == sum(
            len(raw[x]) - len([row for row in raw[x] if row[0] >= horizons[x]]) for x in raw
        )
    # widths 1-4 read raw rows: from the horizon on, as before
    for w in (1, 4):
        _same_series(
            before[(other, names[0], -w)],
            store.series(db_path, *raw_from, width=w, since_step=1280),
        )
    # a second compaction finds nothing more to drop and leaves the file as it is
    digest = hashlib.sha256(db_path.read_bytes()).hexdigest()
    again = compact(db_path, keep_last_steps=200)
    assert not again.runs and again.bytes_after is None
    assert hashlib.sha256(db_path.read_bytes()).hexdigest() == digest
    # the command ids go on where they were
    ids = []
    for db in (db_path, reference):
        with store.write_connection(db) as con:
            ids.append(con.execute("SELECT nextval('command_ids')").fetchone()[0])
    assert ids[0] == ids[1] > max(c.command_id for c in snap[live]["commands"])
    # a resume from a step after the horizon rebuilds the rollups exactly as without compaction
    for db in (db_path, reference):
        store.RunWriter.start(db, run_id=other, resume_step=1400, handle_sigterm=False).close()
    for n in names:
        for w in (8, 64, 512):
            _same_series(
                store.series(reference, other, n, width=w), store.series(db_path, other, n, width=w)
            )


@pytest.mark.parametrize("resume", [1007, 1000, 150])
def test_resume_from_before_the_horizon(db_path, resume):
    """A compacted run resumed from a step S below its horizon: its raw rows there are gone, so
    the rollups are rebuilt from the finer rollup instead. Every bucket up to S's 8-step bucket
    is as it would be without compaction; that bucket too when it ends at S (S = 8m + 7), and
    when it does not only its rows up to S are lost (at most 8 steps). Steps logged after the
    resume are drawn as usual."""
    other = seed.finished_run(db_path, 32, steps=1500)
    reference = db_path.with_name("reference.duckdb")
    shutil.copy(db_path, reference)
    assert compact(db_path, keep_last_steps=200).runs[0].horizon == 1280
    for db in (db_path, reference):
        w = store.RunWriter.start(db, run_id=other, resume_step=resume, handle_sigterm=False)
        for s in range(resume + 1, resume + 100):
            w.log(s, {"loss": float(s)})
        w.close("finished")
    exact = resume % 8 == 7
    for n in store.metric_names(reference, other):
        for width in (8, 64, 512, None):
            got = store.series(db_path, other, n, width=width)
            assert got.width >= 8  # raw rows are gone before the horizon: never drawn raw
            ref = store.series(reference, other, n, width=got.width)
            if exact:
                _same_series(ref, got)
                continue
            # the buckets holding S's 8-step bucket (its start b0 .. S) may miss those rows
            b0 = resume - resume % 8
            lost = (ref.step <= resume) & (ref.step + ref.width > b0)
            pairs = zip(got.count.tolist(), got.last.tolist(), strict=True)
            mine = dict(zip(got.step.tolist(), pairs, strict=True))
            assert set(mine) <= set(ref.step.tolist()), (n, width)
            for i, b in enumerate(ref.step.tolist()):
                count, last = mine.get(b, (0, None))
                if lost[i]:
                    assert 0 <= ref.count[i] - count <= 8, (n, width, b)
                else:
                    assert count == ref.count[i] and last == ref.last[i], (n, width, b)


def _rollups_match_raw(db, run_id: str) -> None:
    """Each level's buckets (complete and open) are the aggregates of the run's raw rows."""
    with store.read_connection(db) as con:
        for shift, complete, partial in ROLLUP_LEVELS:
            cols = "name, bucket, vmin, vmax, last_step, last_value, n, n_nonfinite"
            got = con.execute(
                f"SELECT {cols} FROM (SELECT * FROM {complete} UNION ALL SELECT * FROM {partial}) "
                "WHERE run_id = ? ORDER BY name, bucket",
                [run_id],
            ).fetchall()
            want = con.execute(
                f"SELECT name, step >> {shift} AS bucket, {RAW_AGGREGATES} FROM metrics "
                "WHERE run_id = ? GROUP BY name, bucket ORDER BY name, bucket",
                [run_id],
            ).fetchall()
            nan = [tuple(v if v == v else "nan" for v in r) for r in (*got, *want)]
            assert nan[: len(got)] == nan[len(got) :], shift


@pytest.mark.parametrize("resume", [0, 64, 1007])
def test_resume_without_compaction_rebuilds_exactly(db_path, resume):
    """The coarse level is rebuilt from the fine one after a resume: still exactly the raw
    rows' aggregates (with non-finite values and a row logged out of order)."""
    with store.RunWriter.start(db_path, run_id="r", handle_sigterm=False) as w:
        for s in range(1200):
            w.log(s, {"a": float(s % 7) if s % 97 else float("nan"), "b": -float(s)})
        w.log(5, {"late": 1.0})
    w = store.RunWriter.start(db_path, run_id="r", resume_step=resume, handle_sigterm=False)
    for s in range(resume + 1, resume + 150):
        w.log(s, {"a": 1.0})
    w.close("finished")
    _rollups_match_raw(db_path, "r")


def test_before_step_and_one_run(db_path):
    live, other = _seed(db_path, steps=700)
    raw_live = _raw(db_path, live)
    report = compact(db_path, before_step=300, run_id=other)
    assert [(p.run_id, p.horizon) for p in report.runs] == [(other, 256)]
    assert _raw(db_path, live) == raw_live
    assert min(s for s, _, _ in _raw(db_path, other)) == 256


def test_a_live_writer_is_left_alone_and_logs_on(procs, db_path):
    """A writer logging in another process while the file is compacted under it: its run is
    skipped (named with --run: refused, nothing changed), and every step it acknowledged, before
    and after the file was replaced, is there exactly once."""
    ended = set(_seed(db_path, steps=900))
    child = procs.spawn(
        [
            "tests/store_child.py",
            "log",
            str(db_path),
            "--run-id",
            "live",
            "--last",
            "1500",
            "--rate",
            "300",
            "--flush-interval",
            "0.02",
            "--exit-mode",
            "close",
        ],
        stdout=subprocess.PIPE,
    )
    lines = Lines(child)
    lines.wait_for("ACK 300")
    with pytest.raises(store.StoreError, match="live writer"):
        compact(db_path, keep_last_steps=100, run_id="live")
    report = compact(db_path, keep_last_steps=100)
    assert report.live == ["live"] and {p.run_id for p in report.runs} == ended
    lines.wait_for("CLOSED True")
    acked = [int(x[4:]) for x in lines.finish() if x.startswith("ACK ")]
    assert child.wait(30) == 0
    rows = _raw(db_path, "live")
    assert len(rows) == len({(s, n) for s, n, _ in rows}) == len(acked) * 4
    assert {(s, n): v for s, n, v in rows} == {
        (s, metric(j)): value(1, s, j) for s in acked for j in range(4)
    }
    assert store.get_run(db_path, "live").stored_status == "finished"


def _counts(db) -> dict[str, int]:
    with store.read_connection(db) as con:
        tables = [
            r[0]
            for r in con.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_catalog = current_database() ORDER BY 1"
            ).fetchall()
        ]
        return {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


@pytest.mark.timeout(480)
def test_sigkill_at_random_moments_leaves_old_or_new(procs, tmp_path):
    """`rampwatch compact` in its own process, SIGKILLed at random moments: the file then reads
    as the old one or as the compacted one (same rows in every table as one of the two), and
    the next compaction finishes the job."""
    origin = tmp_path / "origin.duckdb"
    with store.RunWriter.start(
        origin, "big", run_id="big", handle_sigterm=False, flush_interval=3600, lock_timeout=60
    ) as w:
        for s in range(6000):
            w.log(s, {f"m{j:02d}": float(s * j) for j in range(20)})
    old = _counts(origin)
    probe = tmp_path / "probe.duckdb"
    shutil.copy(origin, probe)
    t0 = time.monotonic()
    r = rampwatch_command("compact", str(probe), "--keep-last-steps", "500")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    new = _counts(probe)
    assert new["metrics"] < old["metrics"]
    raw_new = _raw(probe, "big")
    rng = random.Random(29)
    seen = set()
    for i in range(6):
        db = tmp_path / f"k{i}.duckdb"
        shutil.copy(origin, db)
        child = procs.spawn(
            ["-m", "rampwatch", "compact", str(db), "--keep-last-steps", "500"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        if i % 2:  # any moment, start-up included
            time.sleep(rng.uniform(0.2, took * 1.1))
        else:  # once the copy is being written: the copy, its checkpoint, fsync, the rename
            end = time.monotonic() + 2 * took
            while not copy_path(db).exists() and child.poll() is None and time.monotonic() < end:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.15))
        kill_group(child, signal.SIGKILL)
        if copy_path(db).exists():
            seen.add("copy left behind")
        got = _counts(db)
        assert got in (old, new), got
        seen.add("new" if got == new else "old")
        if got == new:
            assert _raw(db, "big") == raw_new
        r = rampwatch_command("compact", str(db), "--keep-last-steps", "500")
        assert r.returncode == 0, r.stderr
        assert _counts(db) == new and _raw(db, "big") == raw_new
        assert not copy_path(db).exists()
    print(f"compaction took {took:.2f} s; kills left: {sorted(seen)}")


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("missing", ["--keep-last-steps", "10"], "does not exist"),
        ("text", ["--keep-last-steps", "10"], "not a DuckDB database"),
        ("foreign", ["--keep-last-steps", "10"], "not a Rampwatch one"),
        ("newer", ["--keep-last-steps", "10"], "newer than this Rampwatch"),
        ("good", ["--keep-last-steps", "-1"], "--keep-last-steps must be an integer >= 0"),
        ("good", ["--before-step", "-5"], "--before-step must be an integer >= 0"),
        ("good", ["--keep-last-steps", "10", "--run", "nope"], "no run 'nope'"),
        ("good", ["--keep-last-steps", "ten"], "invalid int value"),
        ("good", [], "one of the arguments --keep-last-steps --before-step is required"),
        ("good", ["--keep-last-steps", "1", "--before-step", "1"], "not allowed with"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, case, args, message):
    db = tmp_path / "x.duckdb"
    if case == "text":
        seed.text_file(db)
    elif case == "foreign":
        seed.foreign_duckdb(db)
    elif case == "newer":
        seed.newer_schema(db)
    elif case == "good":
        with store.RunWriter.start(db, "r", run_id="r", handle_sigterm=False) as w:
            for s in range(300):
                w.log(s, {"loss": 1.0 / (s + 1)})
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = rampwatch_command("compact", str(db), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert message in lines[0] and lines[0].startswith("rampwatch compact: "), lines[0]
    after = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before, "a refused compaction wrote something"


def test_cli_says_what_it_did(db_path):
    _seed(db_path, steps=700)
    r = rampwatch_command("compact", str(db_path), "--keep-last-steps", "100", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would drop" in r.stdout and "dry run: nothing changed" in r.stdout
    r = rampwatch_command("compact", str(db_path), "--keep-last-steps", "100")
    assert r.returncode == 0, r.stderr
    assert "dropped" in r.stdout and "B per logged value" in r.stdout, r.stdout
    run = store.list_runs(db_path)[0].run_id
    r = rampwatch_command("export", str(db_path), run)
    assert r.returncode == 0 and f"run {run}: compacted; its raw rows start at step" in r.stderr
    steps = [int(line.split(",")[1]) for line in r.stdout.splitlines()[1:]]
    assert min(steps) == int(r.stderr.split("start at step ")[1].split()[0])
