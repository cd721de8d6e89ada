"""Runs page (AppTest on seeded databases): every run with its status and summary, and the
export as CSV or Parquet (the bytes the download button serves)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from rampwatch.dashboard import store_access
from rampwatch.store import RunWriter
from tests import seed
from tests.procs import REPO, child_env


def _runs_table(at):
    return next(d.value for d in at.dataframe if "status" in d.value.columns).set_index("name")


def _killed_writer(db, name):
    """A writer process killed with SIGKILL: its run stays 'running' in the file, writer gone."""
    code = (
        "import sys, time; from rampwatch.store import RunWriter\n"
        "w = RunWriter.start(sys.argv[1], name=sys.argv[2], handle_sigterm=False)\n"
        "[w.log(s, {'loss': 3.0 - s * 0.01}) for s in range(50)]\n"
        "assert w.flush(); print('ready', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(db), name],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


@pytest.fixture
def many(db_path):
    b32 = seed.finished_run(db_path, 32, name="done")
    _killed_writer(db_path, "killed")  # the next writer's start recovers it: killed
    live = seed.live_run(db_path, name="live")
    RunWriter.start(db_path, name="four ranks", world_size=4, handle_sigterm=False).close()
    _killed_writer(db_path, "crashed")  # nobody has opened the file for writing since: stale
    yield db_path, live, b32
    live.close()


def test_every_run_with_status_and_summary(many, monkeypatch):
    db, live, _ = many
    at = seed.app(monkeypatch, db, page="views/runs.py")
    assert not at.exception, [e.message for e in at.exception]
    t = _runs_table(at)
    assert set(t.index) == {"done", "killed", "crashed", "live", "four ranks"}
    assert t.loc["killed", "status"] == "killed" and t.loc["killed", "steps"] == 49
    assert t.loc["live", "status"] == "running"
    assert t.loc["done", "status"] == "finished"
    assert t.loc["crashed", "status"] == "stale"  # writer gone, nobody has recovered it yet
    assert t.loc["done", "steps"] == 599 and t.loc["done", "tokens"] == 600 * 32 * 128
    assert t.loc["done", "best loss (raw)"] == pytest.approx(
        2.0 + 3.0 * 2.718281828 ** (-599 / (seed.S_MIN * (1 + seed.B_CRIT / 32) / 1.791759469)),
        abs=1e-3,
    )
    assert t.loc["done", "peak memory (GB)"] == pytest.approx(18.0)
    assert t.loc["live", "peak memory (GB)"] == pytest.approx(25.6, abs=0.11)
    assert t.loc["live", "best loss (raw)"] < 2.5  # NaN losses do not poison the best
    assert t.loc["live", "device"] == "NVIDIA H200"
    assert t.loc["four ranks", "world size"] == 4 and t.loc["live", "world size"] == 1
    assert "stale: marked running but no heartbeat" in seed.texts(at)


def test_export_csv_and_parquet(many, monkeypatch):
    db, live, b32 = many
    at = seed.app(monkeypatch, db, page="views/runs.py")
    assert at.get("download_button"), "no download button"
    at.selectbox(key="export_run").set_value(b32).run()
    assert not at.exception
    raw = store_access.export_bytes(db, b32, "csv")
    table = pa_csv.read_csv(io.BytesIO(raw))
    assert table.column_names == ["run_id", "step", "t", "name", "value"]
    assert table.num_rows == 600 * 7  # 7 metrics per step
    pq_table = pq.read_table(io.BytesIO(store_access.export_bytes(db, b32, "parquet")))
    assert pq_table.num_rows == table.num_rows
    assert set(pq_table.column("run_id").to_pylist()) == {b32}
    at.radio(key="export_format").set_value("Parquet").run()
    assert not at.exception


def test_read_only_serves_runs_without_writing(many, monkeypatch):
    db, live, _ = many
    before = {p: os.stat(db.parent / p).st_mtime_ns for p in os.listdir(db.parent)}
    time.sleep(0.01)
    live.writer._flusher.end()  # nothing else may touch the file during this look
    at = seed.app(monkeypatch, db, read_only=True, page="views/runs.py")
    assert not at.exception
    at.switch_page("views/compare.py").run()
    assert not at.exception
    after = {p: os.stat(db.parent / p).st_mtime_ns for p in os.listdir(db.parent)}
    assert after == before


def test_runs_page_sessions_do_not_grow_with_the_runs(tmp_path, monkeypatch):
    """A first load of the Runs page opens the store as often for 30 runs as for 3: every
    summary comes from one read session (not two connections per run)."""
    calls = seed.count_connects(monkeypatch)
    opened = {}
    for n in (3, 30):
        db = tmp_path / f"team-{n}.duckdb"
        ids = seed.team(db, n)
        before = len(calls)
        at = seed.app(monkeypatch, db, first="views/runs.py")
        assert not at.exception, [e.message for e in at.exception]
        opened[n] = calls[before:]
        assert set(opened[n]) == {str(db)}
        t = _runs_table(at)
        assert sorted(t.index) == [f"r{i:02d}" for i in range(n)]
        assert sorted(t["run id"]) == sorted(ids)
        assert (t["steps"] == 19).all() and (t["alerts"] == 0).all()
        assert t.loc["r01", "tokens"] == 20 * 32 * seed.SEQ_LEN
        assert t.loc["r01", "peak memory (GB)"] == pytest.approx((10 + 32 / 4) * seed.GB / 1e9)
    # the runs, their summaries, the refused writes (+ a first look at a file new to the process)
    assert len(opened[30]) == len(opened[3]) <= 4, opened
