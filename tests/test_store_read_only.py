"""Read-only means read-only: the dashboard's read-only mode and `python -m rampwatch info` never
change the database (same bytes, same mtime, no lock file or anything else beside it), read an
older schema as it is, and say how to upgrade one too old to read; on read-only media (a real
read-only bind mount, where the machine allows one) a v3 file can be viewed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import duckdb
import pytest

from rampwatch import store
from rampwatch.store import schema
from rampwatch.store.db import read_connection
from tests.procs import REPO, child_env

pytestmark = pytest.mark.timeout(120)


def _state(folder):
    return {
        p.name: (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.iterdir())
    }


def _v3_file(db):
    """A v3 database with one finished run, as Rampwatch before schema 4 left it."""
    schema.create_at_version(db, 2)
    con = duckdb.connect(str(db))
    con.execute(
        "INSERT INTO runs (run_id, name, status, created_at, last_step) "
        "VALUES ('old', 'v3 run', 'finished', 1.0, 70)"
    )
    con.execute("INSERT INTO metrics SELECT 'old', i, i, 'loss', 100 - i FROM range(71) t(i)")
    schema.upgrade(con, 2, 3)  # v3's migration backfills the rollups from these rows
    con.close()


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rampwatch", *map(str, args)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_read_only_reads_change_nothing_and_read_an_older_schema_as_is(tmp_path):
    db = tmp_path / "v3.duckdb"
    _v3_file(db)
    before = _state(tmp_path)
    assert store.schema_version(db, read_only=True) == 3
    (run,) = store.list_runs(db, read_only=True)
    assert (run.run_id, run.stored_status, run.last_step) == ("old", "finished", 70)
    s = store.series(db, "old", "loss", buckets=2000, read_only=True)
    assert int(s.count.sum()) == 71
    assert store.latest(db, "old", read_only=True) == {"loss": (70, 30.0)}
    assert store.export(db, "old", read_only=True).num_rows == 71
    r = _cli("info", db)
    assert r.returncode == 0, r.stderr
    assert "schema version 3" in r.stdout and "upgrade" in r.stdout and "old" in r.stdout
    assert _state(tmp_path) == before  # same bytes, same mtime, nothing new beside it


def test_process_wide_read_only_mode_for_the_dashboard(tmp_path):
    db = tmp_path / "v3.duckdb"
    _v3_file(db)
    before = _state(tmp_path)
    code = (
        "import sys\nfrom rampwatch import store\n"
        "store.set_read_only(True)\n"
        "print([r.run_id for r in store.list_runs(sys.argv[1])],\n"
        "      store.commands.list_commands(sys.argv[1]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(db)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "['old'] []" in out.stdout, out.stderr
    assert _state(tmp_path) == before


def test_a_file_too_old_to_read_as_is_says_how_to_upgrade(tmp_path):
    db = tmp_path / "v1.duckdb"
    schema.create_at_version(db, 1)
    before = _state(tmp_path)
    with pytest.raises(store.SchemaUpgradeNeededError, match="rampwatch upgrade"):
        store.list_runs(db, read_only=True)
    r = _cli("info", db)
    assert r.returncode == 2 and "upgrade" in r.stderr and "Traceback" not in r.stderr, r
    assert _state(tmp_path) == before
    r = _cli("upgrade", db)  # and the command it names works
    assert r.returncode == 0 and f"version {schema.CURRENT_VERSION}" in r.stdout, r
    assert store.schema_version(db, read_only=True) == schema.CURRENT_VERSION


def test_a_default_read_still_upgrades_a_writable_file(tmp_path):
    db = tmp_path / "v3.duckdb"
    _v3_file(db)
    assert store.schema_version(db) == schema.CURRENT_VERSION


def _ro_mount_works(folder) -> bool:
    probe = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f"mount --bind {folder} {folder} && "
            f"mount -o remount,bind,ro {folder} && "
            f"! touch {folder}/probe 2>/dev/null",
        ],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0 and not (folder / "probe").exists()


def test_a_v3_file_on_read_only_media_can_be_viewed(tmp_path):
    if shutil.which("unshare") is None or not _ro_mount_works(tmp_path):
        pytest.skip("this machine does not allow a read-only bind mount (unshare -rm)")
    db = tmp_path / "v3.duckdb"
    _v3_file(db)
    before = _state(tmp_path)
    script = (
        f"mount --bind {tmp_path} {tmp_path} && mount -o remount,bind,ro {tmp_path} && "
        f"{sys.executable} -m rampwatch info {db} && "
        f"{sys.executable} -c 'import sys; from rampwatch import store; "
        f'print("ROWS", store.export(sys.argv[1], "old").num_rows)\' {db}'
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "schema version 3" in out.stdout and "ROWS 71" in out.stdout
    assert "Traceback" not in out.stderr
    assert _state(tmp_path) == before


def test_read_connection_in_read_only_mode_refuses_nothing_it_can_read(tmp_path):
    db = tmp_path / "cur.duckdb"
    store.RunWriter.start(db, "x", run_id="x").close()
    before = _state(tmp_path)
    with read_connection(db, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]
    assert _state(tmp_path) == before
    os.remove(str(db) + ".lock")  # no lock file: read-only mode does not create one
    after = _state(tmp_path)
    store.list_runs(db, read_only=True)
    assert _state(tmp_path) == after


def test_a_read_only_read_then_a_write_in_one_process(tmp_path):
    """A process whose first access read with read_only=True (the lock file opened for reading
    only) can still write afterwards: the write reopens the lock file for writing."""
    db = tmp_path / "runs.duckdb"
    store.RunWriter.start(db, name="first", handle_sigterm=False).close("finished")
    code = (
        "import sys\n"
        "from rampwatch import store\n"
        "[run] = store.list_runs(sys.argv[1], read_only=True)\n"
        "store.RunWriter.start(sys.argv[1], name='second', handle_sigterm=False).close('finished')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(db)], env=child_env(), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert {r.name for r in store.list_runs(db)} == {"first", "second"}
