"""A damaged database is checked before it is trusted: a truncated DuckDB file is refused by
RunWriter.start (and left as it is), a writer whose database is cut under it keeps its spool
instead of deleting records it cannot read back, and `python -m rampwatch info` says in one line
what is wrong and what to do (exit 2, no traceback)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from rampwatch import store
from rampwatch.store import spool
from rampwatch.store.db import spool_root
from tests import seed
from tests.procs import REPO, child_env

pytestmark = pytest.mark.timeout(120)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _big_db(db):
    w = store.RunWriter.start(db, "big", run_id="big", handle_sigterm=False)
    for s in range(20_000):
        w.log(s, {f"m{j}": s * j for j in range(5)})
    assert w.close()


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.2])
def test_a_truncated_database_is_refused_and_left_alone(tmp_path, keep):
    db = tmp_path / "t.duckdb"
    _big_db(db)
    os.truncate(db, int(db.stat().st_size * keep))
    before = _digest(db)
    with pytest.raises(store.DatabaseCorruptError, match="damaged") as e:
        store.RunWriter.start(db, "after")
    assert str(db) in str(e.value) and "backup" in str(e.value)
    assert _digest(db) == before
    assert not spool.list_spools(spool_root(db))  # nothing was spooled for it
    with pytest.raises(store.DatabaseCorruptError):
        store.list_runs(db)


@pytest.mark.parametrize("how", ["truncated", "garbage-blocks"])
def test_cli_info_on_a_corrupt_file_is_one_line_and_exit_2(tmp_path, how):
    db = tmp_path / "c.duckdb"
    _big_db(db)
    if how == "truncated":
        os.truncate(db, db.stat().st_size // 2)
    else:  # the header is intact, the data blocks are not
        with open(db, "r+b") as f:
            f.seek(3 * 4096 + 100)
            f.write(os.urandom(db.stat().st_size - 3 * 4096 - 100))
    r = subprocess.run(
        [sys.executable, "-m", "rampwatch", "info", str(db)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(db) in r.stderr and ("backup" in r.stderr or "new database" in r.stderr)


def test_a_writer_keeps_its_spool_when_the_database_is_cut_under_it(db_path):
    _big_db(db_path)
    w = store.RunWriter.start(
        db_path, "live", run_id="live", flush_interval=1000, handle_sigterm=False
    )
    for s in range(100):
        w.log(s, {"loss": 1.0 / (s + 1)})
    os.truncate(db_path, db_path.stat().st_size // 2)  # a full disk, a bad copy, a bad block
    assert w.close(timeout=1) is False
    assert "damaged" in (w.last_error or ""), w.last_error
    kept = spool.list_spools(spool_root(db_path)) + list(spool_root(db_path).glob("*.corrupt"))
    assert kept, "the only readable copy of the records was deleted"
    (path,) = kept
    recs, _, _, _, _ = spool.read_records(path, 0, 10_000, final=True)
    assert len(recs) == 100


def test_a_read_that_meets_a_damaged_block_says_the_file_is_damaged(tmp_path):
    """DuckDB's checksum error names the block ("... in block at location N"): it is damage,
    not a lock, and reads raise DatabaseCorruptError naming the file and what to do."""
    db = tmp_path / "d.duckdb"
    _big_db(db)
    seed.damage_data_blocks(db)
    assert [r.run_id for r in store.list_runs(db)] == ["big"]  # the catalog reads fine
    reader = store.Reader(db)
    with pytest.raises(store.DatabaseCorruptError) as e:
        reader.series("big", "m1", buckets=20_000)
    assert str(db) in str(e.value) and "damaged" in str(e.value)
