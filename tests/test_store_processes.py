"""The store across real processes: live writer + reader, SIGKILL at random moments, resume."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rampwatch import store
from tests.procs import kill_group
from tests.store_child import metric, value
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(180)  # pytest.ini says 300 s; these are far shorter

CHILD = "tests/store_child.py"


def _spawn(procs, *args):
    return procs.spawn([CHILD, *map(str, args)], stdout=subprocess.PIPE)


def _rows(db, run_id):
    t = store.export(db, run_id)
    return t.column("step").to_numpy(), t.column("name").to_pylist(), t.column("value").to_numpy()


def test_live_writer_and_polling_reader(procs, db_path):
    """50 steps/s x 20 metrics for 20 s while another process polls at 5 Hz."""
    steps, n_metrics = 1000, 20
    writer = _spawn(
        procs,
        "log",
        db_path,
        "--run-id",
        "live",
        "--last",
        steps - 1,
        "--metrics",
        n_metrics,
        "--rate",
        50,
        "--exit-mode",
        "close",
    )
    wlines = Lines(writer)
    wlines.wait_for("STARTED")
    reader = _spawn(
        procs,
        "read",
        db_path,
        "--run-id",
        "live",
        "--duration",
        60,
        "--hz",
        5,
        "--expect",
        steps * n_metrics,
    )
    rlines = Lines(reader)
    assert writer.wait(timeout=90) == 0, wlines.finish()[-10:]
    assert reader.wait(timeout=90) == 0, rlines.finish()[-10:]
    wout, rout = wlines.finish(), rlines.finish()
    stats = json.loads(next(x for x in wout if x.startswith("STATS "))[6:])
    assert stats["errors"] == 0 and stats["last_error"] is None, stats
    assert any(x.startswith("CLOSED True errors=0") for x in wout), wout[-5:]
    polls = [json.loads(x) for x in rout if x.startswith("{")]
    # ~100 polls at 5 Hz over the writer's 20 s on an idle machine; what matters is that reads
    # went on while the writer wrote (the run seen growing), not the rate a loaded box allows
    growing = {p["rows"] for p in polls if p["rows"] and p["rows"] < steps * n_metrics}
    assert len(growing) >= 5, f"the reader saw only {sorted(growing)} rows while the run ran"
    assert not any("Traceback" in x or "Error" in x for x in rout), rout
    assert {p["status"] for p in polls[:-1]} == {"running"}, "a live run looked stale"
    for key in ("rows", "series_count", "last_step"):
        seen = [p[key] for p in polls if p[key] is not None]
        assert seen == sorted(seen), f"{key} went backwards: {seen}"
    assert polls[-1]["rows"] == steps * n_metrics
    assert polls[-1]["series_count"] == steps
    assert polls[-1]["latest_m00"] == [steps - 1, value(1, steps - 1, 0)]
    # every row arrived once, with its value
    step, name, val = _rows(db_path, "live")
    assert len(step) == steps * n_metrics
    got = {(int(s), n): v for s, n, v in zip(step, name, val, strict=True)}
    assert got == {(s, metric(j)): value(1, s, j) for s in range(steps) for j in range(n_metrics)}
    assert store.get_run(db_path, "live").status == "finished"


def test_sigkill_at_random_moments_loses_no_acknowledged_step(procs, db_path):
    """One run, killed 10 times (flushing nearly continuously), each time resumed from the
    last acknowledged step: every acknowledged step is present exactly once, with the value
    of the generation that acknowledged it; the run ends 'killed'."""
    rng = random.Random(1234)
    n_metrics, acked_by = 4, {}  # step -> generation whose log() returned for it
    last_acked = None
    for gen in range(1, 11):
        args = [
            "log",
            db_path,
            "--run-id",
            "k",
            "--gen",
            gen,
            "--metrics",
            n_metrics,
            "--first",
            0 if last_acked is None else last_acked + 1,
            "--last",
            10**9,
            "--rate",
            400,
            "--flush-interval",
            0.005,
            "--exit-mode",
            "wait",
            "--rotate-bytes",
            8192,
        ]  # a new spool every 64 steps: kills hit rotations too
        if gen > 1:  # resume from the last acknowledged step: nothing acknowledged is discarded
            args += ["--resume", -1 if last_acked is None else last_acked]
        child = _spawn(procs, *args)
        lines = Lines(child)
        lines.wait_for("STARTED")
        time.sleep(rng.uniform(0.05, 0.7))
        kill_group(child, signal.SIGKILL)
        for line in lines.finish():  # what reached the pipe was acknowledged before the kill
            if line.startswith("ACK "):
                step = int(line[4:])
                acked_by[step] = gen
                last_acked = step
    assert len(acked_by) > 50, "the children hardly logged; the test proves nothing"
    rec = subprocess.run(
        [sys.executable, "-m", "rampwatch", "recover", str(db_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rec.returncode == 0, rec.stderr
    step, name, val = _rows(db_path, "k")
    pairs = list(zip(step.tolist(), name, strict=True))
    assert len(pairs) == len(set(pairs)), "a (step, metric) row is present twice"
    got = {(s, n): v for (s, n), v in zip(pairs, val, strict=True)}
    for s, gen in acked_by.items():
        for j in range(n_metrics):
            assert got.get((s, metric(j))) == value(gen, s, j), (s, j, gen)
    # beyond the last acknowledged step at most the one step written but not acknowledged
    assert set(s for s, _ in pairs) - set(acked_by) <= {max(acked_by) + 1}
    run = store.get_run(db_path, "k")
    assert run.stored_status == "killed" and run.last_step == int(step.max())
    resumes = store.events(db_path, "k", kinds=["resume"])
    assert len(resumes) >= 1 and all(e.data["purge_step"] == e.step + 1 for e in resumes)
    assert not list(store.db.spool_root(db_path).iterdir())  # dead spools ingested and removed


def test_resume_discards_steps_after_the_checkpoint(procs, db_path):
    """Killed at step 50 (45 ingested, 46-50 only in its spool), resumed from a checkpoint at
    step 40: steps 41-50 carry the new values only, in raw rows, series and latest."""
    n_metrics = 3
    first = _spawn(
        procs,
        "log",
        db_path,
        "--run-id",
        "r",
        "--gen",
        1,
        "--metrics",
        n_metrics,
        "--last",
        50,
        "--flush-interval",
        1000,
        "--flush-at",
        45,
        "--exit-mode",
        "wait",
    )
    lines = Lines(first)
    assert lines.wait_for("FLUSHED") == "FLUSHED True"
    lines.wait_for("WAITING")
    kill_group(first, signal.SIGKILL)
    step, _, _ = _rows(db_path, "r")
    assert step.max() == 45  # 46..50 are only in the dead writer's spool

    second = _spawn(
        procs,
        "log",
        db_path,
        "--run-id",
        "r",
        "--gen",
        2,
        "--resume",
        40,
        "--first",
        41,
        "--last",
        60,
        "--metrics",
        n_metrics,
        "--exit-mode",
        "close",
    )
    out = Lines(second)
    assert second.wait(timeout=60) == 0, out.finish()[-10:]
    step, name, val = _rows(db_path, "r")
    got = {}
    for s, n, v in zip(step.tolist(), name, val, strict=True):
        got.setdefault((s, n), []).append(v)
    assert sorted(got) == sorted((s, metric(j)) for s in range(61) for j in range(n_metrics))
    for (s, n), vs in got.items():
        assert vs == [value(1 if s <= 40 else 2, s, int(n[1:]))], (s, n, vs)
    (ev,) = store.events(db_path, "r", kinds=["resume"])
    assert ev.step == 40 and ev.data["purge_step"] == 41
    assert ev.data["previous_status"] == "killed" and ev.data["previous_last_step"] == 50
    assert ev.data["deleted_metric_rows"] == 10 * n_metrics  # 41..50, 46..50 recovered first
    run = store.get_run(db_path, "r")
    assert run.stored_status == "finished" and run.last_step == 60
    # the rollup forgot the discarded values too
    full = store.series(db_path, "r", metric(1), width=64)
    expect = np.array([value(1 if s <= 40 else 2, s, 1) for s in range(61)])
    assert (full.min[0], full.max[0], full.last[0], full.count[0]) == (
        expect.min(),
        expect.max(),
        expect[-1],
        61,
    )
    assert store.latest(db_path, "r")[metric(2)] == (60, value(2, 60, 2))


def test_recovery_leaves_live_writers_alone(procs, db_path):
    """Recovery from another process, and from this one, never touches a live writer's spool;
    once a writer is killed, only its run is marked killed (and its open command refused)."""
    kids = {}
    for run_id in ("a", "b"):
        kids[run_id] = _spawn(
            procs,
            "log",
            db_path,
            "--run-id",
            run_id,
            "--last",
            10**9,
            "--rate",
            100,
            "--flush-interval",
            0.2,
            "--exit-mode",
            "wait",
        )
    outs = {k: Lines(p) for k, p in kids.items()}
    for out in outs.values():
        out.wait_for("ACK 20")
    cid = store.commands.submit(db_path, "b", "ramp", {"per_device_batch": 2, "accum": 4}, "op")
    rec = subprocess.run(
        [sys.executable, "-m", "rampwatch", "recover", str(db_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rec.returncode == 0 and "nothing to recover" in rec.stdout, rec
    assert not store.recover(db_path).spools
    assert {r.run_id: r.status for r in store.list_runs(db_path)} == {
        "a": "running",
        "b": "running",
    }
    kill_group(kids["b"], signal.SIGKILL)
    report = store.recover(db_path)
    assert report.killed_runs == ["b"] and report.refused_commands == 1
    assert [s.run_id for s in report.spools] == ["b"]
    runs = {r.run_id: r for r in store.list_runs(db_path)}
    assert runs["a"].status == "running" and runs["b"].status == "killed"
    assert store.commands.get(db_path, cid).reason == "run killed"
    kill_group(kids["a"], signal.SIGKILL)
    assert {r.status for r in store.list_runs(db_path) if r.run_id == "a"} == {"stale"}


@pytest.mark.parametrize(
    "mode,status", [("exit", "finished"), ("raise", "failed"), ("sigterm-self", "killed")]
)
def test_exit_paths_flush_everything(procs, db_path, mode, status):
    """No close(): atexit finishes the run (failed on an uncaught exception); SIGTERM with the
    default disposition flushes, marks it killed, and still terminates the process."""
    child = _spawn(
        procs,
        "log",
        db_path,
        "--run-id",
        "x",
        "--last",
        199,
        "--flush-interval",
        1000,
        "--exit-mode",
        mode,
    )
    out = Lines(child)
    rc = child.wait(timeout=60)
    out.finish()
    assert rc == {"exit": 0, "raise": 1, "sigterm-self": -signal.SIGTERM}[mode], out.lines[-5:]
    run = store.get_run(db_path, "x")
    assert run.stored_status == status and run.last_step == 199
    assert store.export(db_path, "x").num_rows == 200 * 4
    assert not list(store.db.spool_root(db_path).iterdir())


def test_sigterm_chains_to_the_programs_own_handler(procs, db_path):
    """A handler installed before the writer still runs (after the writer flushed), and the
    run is not marked killed: the program handles SIGTERM itself and exits normally."""
    child = _spawn(
        procs,
        "log",
        db_path,
        "--run-id",
        "u",
        "--last",
        99,
        "--flush-interval",
        1000,
        "--exit-mode",
        "sigterm-user",
    )
    out = Lines(child)
    assert child.wait(timeout=60) == 0
    lines = out.finish()
    assert "USER HANDLER ingested=400" in lines and "GRACEFUL EXIT" in lines, lines[-5:]
    run = store.get_run(db_path, "u")
    assert run.stored_status == "finished" and store.export(db_path, "u").num_rows == 400
