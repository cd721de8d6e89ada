"""A dead writer's waiting spool is named on the dashboard: a real writer process logs steps
that stay in its spool, is killed with SIGKILL, and the read-only Runs page (which cannot
recover it) says how many records wait and which command ingests them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rampwatch import store
from tests import seed
from tests.procs import child_env, kill_group
from tests.store_child import metric
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(180)

STEPS, METRICS = 50, 4


def _killed_with_a_waiting_spool(procs, db) -> str:
    child = procs.spawn(
        [
            "tests/store_child.py",
            "log",
            str(db),
            "--run-id",
            "lost-tail",
            "--last",
            str(STEPS - 1),
            "--metrics",
            str(METRICS),
            "--flush-interval",
            "3600",  # nothing after the start reaches the database
            "--exit-mode",
            "wait",
        ],
        stdout=subprocess.PIPE,
    )
    out = Lines(child)
    out.wait_for("WAITING")
    kill_group(child, signal.SIGKILL)
    return "lost-tail"


def test_read_only_runs_page_names_a_dead_writers_waiting_spool(procs, db_path, monkeypatch):
    run_id = _killed_with_a_waiting_spool(procs, db_path)
    before = {p: os.stat(db_path.parent / p).st_mtime_ns for p in os.listdir(db_path.parent)}
    [dead] = store.dead_writers(db_path, read_only=True)
    assert (dead.run_id, dead.records) == (run_id, STEPS * METRICS)
    at = seed.app(monkeypatch, db_path, read_only=True, page="views/runs.py")
    assert not at.exception, [e.message for e in at.exception]
    note = (
        f"run {run_id}: its writer died with {STEPS * METRICS} records not yet in the "
        f"database; run `rampwatch recover {db_path}` to ingest them"
    )
    assert note in seed.texts(at)
    at.switch_page("views/live.py").run()  # that run's own page says it too
    assert note in seed.texts(at)
    after = {p: os.stat(db_path.parent / p).st_mtime_ns for p in os.listdir(db_path.parent)}
    assert after == before  # read-only: looking did not recover anything
    r = subprocess.run(  # what the note says to run (this process stays read-only)
        [sys.executable, "-m", "rampwatch", "recover", str(db_path)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert store.dead_writers(db_path, read_only=True) == []
    assert store.export(db_path, run_id, read_only=True).num_rows == STEPS * METRICS
    names = store.metric_names(db_path, run_id, read_only=True)
    assert {metric(j) for j in range(METRICS)} <= set(names)
