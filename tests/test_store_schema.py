"""Schema and file identity: foreign, newer and missing files fail clearly and stay untouched;
older files are upgraded; the `rampwatch info|recover|upgrade` command line."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import duckdb
import pytest

from rampwatch import store
from rampwatch.store import commands, refusals, schema
from rampwatch.store.db import lock_path, spool_root

pytestmark = pytest.mark.timeout(120)  # pytest.ini says 300 s; these are far shorter


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rampwatch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _foreign_duckdb(path):
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE invoices (id INTEGER, amount DOUBLE)")
    con.execute("INSERT INTO invoices VALUES (1, 9.5)")
    con.close()


def _newer_rampwatch(path):
    w = store.RunWriter.start(path, "future")
    w.close()
    con = duckdb.connect(str(path))
    con.execute(
        "INSERT INTO rampwatch_schema VALUES (?, 0, 'from the future')",
        [schema.CURRENT_VERSION + 1],
    )
    con.close()


def _text_file(path):
    path.write_text("run,step,loss\n1,2,3.0\n" * 50)


OPENERS = {
    "writer": lambda db: store.RunWriter.start(db, "x"),
    "reader": lambda db: store.list_runs(db),
    "submit": lambda db: store.commands.submit(
        db, "r", "ramp", {"per_device_batch": 1, "accum": 1}, "op"
    ),
    "recover": lambda db: store.recover(db),
}


@pytest.mark.parametrize("opener", sorted(OPENERS))
@pytest.mark.parametrize(
    "make,error,words",
    [
        (_text_file, store.NotRampwatchError, "is not a DuckDB database"),
        (
            _foreign_duckdb,
            store.NotRampwatchError,
            "not a Rampwatch one: it has other tables (invoices)",
        ),
        (
            _newer_rampwatch,
            store.SchemaTooNewError,
            f"schema version {schema.CURRENT_VERSION + 1}, newer",
        ),
    ],
)
def test_foreign_or_newer_file_fails_clearly_and_is_untouched(tmp_path, make, error, words, opener):
    db = tmp_path / "other.duckdb"
    make(db)
    before = _digest(db)
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error) as e:
        OPENERS[opener](db)
    assert words in str(e.value)
    assert _digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no lock file, no spool


@pytest.mark.parametrize(
    "make,words",
    [
        (_text_file, "is not a DuckDB database"),
        (_foreign_duckdb, "not a Rampwatch one"),
        (_newer_rampwatch, "newer than this Rampwatch"),
    ],
)
@pytest.mark.parametrize("cmd", ["info", "recover"])
def test_cli_refuses_bad_files_with_exit_2(tmp_path, make, words, cmd):
    db = tmp_path / "x.duckdb"
    make(db)
    before = _digest(db)
    r = _cli(cmd, db)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r
    assert _digest(db) == before


@pytest.mark.parametrize(
    "cmd",
    [("info",), ("recover",), ("upgrade",), ("export",), ("compact", "--keep-last-steps", "1")],
)
def test_a_mistyped_path_makes_no_database(tmp_path, cmd):
    """A command on a file that is not there says so (exit 2) and creates nothing: a typo must
    not leave an empty database that the next command calls already current."""
    db = tmp_path / "nope.duckdb"
    r = _cli(cmd[0], db, *cmd[1:])
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr, r
    assert list(tmp_path.iterdir()) == []


def test_a_dead_writers_spool_without_its_database_is_still_recovered(tmp_path):
    """The one case where recover makes the file: a spool with rows to keep (here the
    database was deleted after its writer died)."""
    db = tmp_path / "r.duckdb"
    died = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from rampwatch import store; "
            "w = store.RunWriter.start(sys.argv[1], 'x', run_id='r1'); "
            "[w.log(s, {'loss': 1.0 / s}) for s in range(1, 50)]; os._exit(9)",
            str(db),
        ],
        timeout=60,
    )
    assert died.returncode == 9
    db.unlink()
    r = _cli("recover", db)
    assert r.returncode == 0 and "49 metric records ingested" in r.stdout, r
    [run] = store.list_runs(db)
    assert (run.run_id, run.status, run.last_step) == ("r1", "killed", 49)


def test_missing_file_for_reading(tmp_path):
    db = tmp_path / "nope.duckdb"
    with pytest.raises(store.DatabaseMissingError, match="does not exist"):
        store.list_runs(db)
    assert list(tmp_path.iterdir()) == []


def test_writes_to_a_missing_file_make_no_database(tmp_path):
    """A command, a cancel, a refusal's record or a delete at a mistyped path is refused; only
    RunWriter.start (and recover, with a spool to ingest) makes a database."""
    db = tmp_path / "nope.duckdb"
    writes = [
        lambda: commands.submit(db, "r1", "ramp", {"per_device_batch": 16, "accum": 1}, actor="op"),
        lambda: commands.cancel(db, 1, actor="op"),
        lambda: commands.refuse(db, 1, "no", actor="op"),
        lambda: store.delete_run(db, "r1"),
        lambda: refusals.record(
            db, run_id="r1", action="approve", detail=None, operator=None, client=None, reason="x"
        ),
    ]
    for write in writes:
        with pytest.raises(store.DatabaseMissingError, match="does not exist"):
            write()
        assert list(tmp_path.iterdir()) == []


def test_cli_usage_errors_exit_2(tmp_path):
    assert _cli().returncode == 2
    assert _cli("explode", tmp_path / "x.duckdb").returncode == 2


def test_cli_info_and_recover(db_path):
    w = store.RunWriter.start(db_path, "x'); DROP TABLE runs;--", run_id="r1")
    w.log(7, {"loss": 1.0})
    w.close()
    r = _cli("info", db_path)
    assert r.returncode == 0, r.stderr
    assert f"schema version {schema.CURRENT_VERSION}" in r.stdout
    assert "r1" in r.stdout and "finished" in r.stdout and "x'); DROP TABLE runs;--" in r.stdout
    r = _cli("recover", db_path)
    assert r.returncode == 0 and "nothing to recover" in r.stdout


def test_new_database_is_created_at_current_version(db_path):
    store.RunWriter.start(db_path, "a").close()
    assert store.schema_version(db_path) == schema.CURRENT_VERSION
    assert lock_path(db_path).exists() and spool_root(db_path).is_dir()


def _v1_database(db):
    """A file as version 1 wrote it: runs and tall metrics, nothing else."""
    schema.create_at_version(db, 1)
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO runs VALUES ('old', 'old run', 'finished', '{\"lr\": 0.1}', 1.0, 2.0)")
    con.execute("INSERT INTO runs VALUES ('live', NULL, 'running', NULL, 1.0, NULL)")
    con.execute("""INSERT INTO metrics SELECT 'old', i, i * 0.5, 'loss',
                   CASE WHEN i = 70 THEN 'NaN'::DOUBLE ELSE 1000 - i END FROM range(200) t(i)""")
    con.close()


def test_v1_file_is_upgraded_when_opened(db_path):
    _v1_database(db_path)
    assert store.schema_version(db_path) == schema.CURRENT_VERSION  # a read upgrades it
    con = duckdb.connect(str(db_path), read_only=True)
    versions = [
        r[0] for r in con.execute("SELECT version FROM rampwatch_schema ORDER BY 1").fetchall()
    ]
    con.close()
    assert versions == list(range(1, schema.CURRENT_VERSION + 1))
    old = store.get_run(db_path, "old")
    assert (old.config, old.last_step, old.stored_status) == ({"lr": 0.1}, 199, "finished")
    # the rollup was backfilled: a 64-step-wide series comes from it and matches the raw rows
    s = store.series(db_path, "old", "loss", width=64)
    assert s.step.tolist() == [0, 64, 128, 192]
    assert s.count.tolist() == [64, 64, 64, 8] and s.nonfinite.tolist() == [0, 1, 0, 0]
    assert s.min.tolist() == [1000 - 63, 1000 - 127, 1000 - 191, 1000 - 199]
    assert s.last.tolist() == [1000 - 63, 1000 - 127, 1000 - 191, 1000 - 199]
    s8 = store.series(db_path, "old", "loss", width=8)  # and the fine one
    assert s8.count.tolist() == [8] * 25 and s8.nonfinite.sum() == 1 and s8.last[-1] == 801.0
    assert store.latest(db_path, "old") == {"loss": (199, 801.0)}
    # and the upgraded file works for writing: the orphaned 'running' run is recovered as killed
    report = store.recover(db_path)
    assert report.killed_runs == ["live"]
    w = store.RunWriter.start(db_path, "new")
    w.log(0, {"loss": 2.0})
    w.event("ramp", "x")
    assert w.close()
    assert {r.run_id: r.stored_status for r in store.list_runs(db_path)} == {
        "old": "finished",
        "live": "killed",
        w.run_id: "finished",
    }


def test_failed_migration_leaves_the_file_at_its_old_version(db_path, monkeypatch):
    _v1_database(db_path)
    broken = list(schema.MIGRATIONS)
    v, note, stmts = broken[1]
    broken[1] = (v, note, stmts[:3] + ["THIS IS NOT SQL"])
    monkeypatch.setattr(schema, "MIGRATIONS", broken)
    with pytest.raises(duckdb.Error):
        store.RunWriter.start(db_path, "x")
    con = duckdb.connect(str(db_path), read_only=True)
    assert con.execute("SELECT max(version) FROM rampwatch_schema").fetchall() == [(1,)]
    cols = [r[0] for r in con.execute("DESCRIBE runs").fetchall()]
    con.close()
    assert "device" not in cols  # the half-applied ALTERs were rolled back with it


def test_v5_file_gains_the_refusals_table_and_reads_read_only_as_is(db_path):
    """v6 adds write_refusals: a v5 file is upgraded when opened for writing; read-only, it is
    read as it is, with no refusals."""
    schema.create_at_version(db_path, 5)
    con = duckdb.connect(str(db_path))
    con.execute(
        "INSERT INTO runs (run_id, name, status, created_at) VALUES ('r', 'v5', 'finished', 1.0)"
    )
    con.close()
    assert store.list_refusals(db_path, read_only=True) == []
    assert store.schema_version(db_path, read_only=True) == 5
    store.record_refusal(
        db_path, run_id="r", action="approve", detail="ramp", operator="al", client=None, reason="x"
    )
    assert store.schema_version(db_path, read_only=True) == schema.CURRENT_VERSION
    [r] = store.list_refusals(db_path, "r")
    assert (r.run_id, r.action, r.operator, r.client, r.reason) == ("r", "approve", "al", None, "x")
    assert store.refusal_counts(db_path) == {"r": 1}
    store.delete_run(db_path, "r")  # a run's refusals go with it, like its other rows
    assert store.list_refusals(db_path) == []
