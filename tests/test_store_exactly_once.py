"""Exactly-once ingest: the stored spool offsets are the only thing between a spool and duplicate
rows, so a stale, missing or duplicated offsets row must stop an ingest loudly, never re-ingest.

Seen once in tests/test_dist.py (not reproduced since): rank 0's writer ingested steps 1-4 eight
times and re-applied one command result six times, as if the stored offsets had been read stale.
These tests put the database into such states on purpose and check that nothing is ingested
twice and that the writer says why; plus the schema's primary key on spool_offsets, and that a
thread of the writer's process cannot drop DuckDB's own file lock under an open connection.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import duckdb
import pytest

from rampwatch import store
from rampwatch.store import commands, ingest, schema
from rampwatch.store.db import spool_root, write_connection
from rampwatch.store.errors import StoreBusyError

pytestmark = pytest.mark.timeout(120)

RAMP = {"per_device_batch": 8, "accum": 4}


def _counts(db, run_id):
    with store.read_connection(db) as con:
        dup = con.execute(
            "SELECT step, name, count(*) FROM metrics WHERE run_id = ? "
            "GROUP BY ALL HAVING count(*) > 1",
            [run_id],
        ).fetchall()
        errors = [
            r[0]
            for r in con.execute(
                "SELECT message FROM events WHERE run_id = ? AND kind = 'error'", [run_id]
            ).fetchall()
        ]
        ramps = con.execute(
            "SELECT count(*) FROM events WHERE run_id = ? AND kind = 'ramp'", [run_id]
        ).fetchall()[0][0]
        rows = con.execute("SELECT count(*) FROM metrics WHERE run_id = ?", [run_id]).fetchall()[0][
            0
        ]
    return dup, errors, ramps, rows


def _offsets(db, spool_name):
    with store.read_connection(db) as con:
        return con.execute(
            "SELECT bin_offset, jsonl_offset FROM spool_offsets WHERE spool = ?", [spool_name]
        ).fetchall()


def _ramped_writer(db):
    """The dist test's shape in one process: steps 1-4, a command submitted, claimed, applied."""
    w = store.RunWriter.start(db, "r", run_id="r", flush_interval=3600, handle_sigterm=False)
    start_offsets = _offsets(db, w._flusher.files.path.name)[0]
    for s in (1, 2):
        w.log(s, {"loss": 1.0 / s, "accum": 2})
    assert w.flush()
    w.take_claimed_commands()  # the trainer's way: the next visit claims
    cid = commands.submit(db, "r", "ramp", RAMP, actor="test")
    assert w.flush() and [c.command_id for c in w.take_claimed_commands()] == [cid]
    for s in (3, 4):
        w.log(s, {"loss": 1.0 / s, "accum": 2 if s < 4 else 4})
    w.command_applied(cid, 3)
    w.event("ramp", "8 x 2 -> 8 x 4", step=3)
    assert w.flush()
    assert _counts(db, "r") == ([], [], 1, 8)
    return w, cid, start_offsets


@pytest.mark.parametrize("damage", ["rewound", "missing"])
def test_stale_or_missing_offsets_stop_the_writer_instead_of_duplicating(db_path, damage):
    w, cid, (bin0, js0) = _ramped_writer(db_path)
    name = w._flusher.files.path.name
    # What the failing run looked like from the writer's side: the offsets it stored are read
    # back older than what it committed (or not at all), while the rows it inserted are there.
    with write_connection(db_path) as con:
        if damage == "rewound":
            con.execute(
                "UPDATE spool_offsets SET bin_offset = ?, jsonl_offset = ? WHERE spool = ?",
                [bin0, js0, name],
            )
        else:
            con.execute("DELETE FROM spool_offsets WHERE spool = ?", [name])
    w.log(5, {"loss": 0.2, "accum": 4})
    for _ in range(3):  # every later visit refuses too: not once, then duplicates
        assert not w.flush()
    dup, errors, ramps, rows = _counts(db_path, "r")
    assert dup == [] and errors == [] and ramps == 1 and rows == 8  # nothing ingested twice
    assert w.errors >= 3 and "behind" in w.last_error and name in w.last_error, w.last_error
    assert commands.get(db_path, cid).status == "applied"
    assert not w.close(timeout=0.5)  # still refused
    # the spool is set aside for a person, not left to recovery, which has only the database's
    # offsets to go by and would ingest it again from them
    root = spool_root(db_path)
    assert sorted(p.name for p in root.iterdir()) == [name + ".corrupt"]
    store.recover(db_path)
    dup, errors, ramps, rows = _counts(db_path, "r")
    assert dup == [] and errors == [] and ramps == 1 and rows == 8


def test_a_stale_read_inside_the_transaction_cannot_commit(db_path, monkeypatch):
    """Recovery has no memory of its own: the offsets UPDATE itself must prove that the row it
    read is the row it changes (compare-and-set on the old offsets, exactly one row)."""
    w, _, (bin0, js0) = _ramped_writer(db_path)
    w.log(5, {"loss": 0.2, "accum": 4})
    real_first = ingest.first
    calls = []

    def stale_first(result):
        row = real_first(result)
        if not calls and row is not None and len(row) == 4:  # the offsets row (and its count)
            calls.append(row)
            return (row[0], bin0, js0, row[3])  # as if the SELECT saw an old version of it
        return row

    monkeypatch.setattr(ingest, "first", stale_first)
    with write_connection(db_path) as con:
        with pytest.raises(store.StoreError, match="offsets"):
            ingest.ingest_spool(con, w._flusher.files.path)
    monkeypatch.setattr(ingest, "first", real_first)
    dup, errors, ramps, rows = _counts(db_path, "r")
    assert calls and dup == [] and errors == [] and ramps == 1 and rows == 8  # rolled back
    assert w.close()  # and the writer carries on from the real offsets: step 5 once
    dup, errors, ramps, rows = _counts(db_path, "r")
    assert dup == [] and errors == [] and ramps == 1 and rows == 10


def _v3_with_duplicate_offsets(db):
    schema.create_at_version(db, 3)
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO runs (run_id, status, created_at) VALUES ('r', 'finished', 1)")
    con.execute(
        "INSERT INTO spool_offsets VALUES "
        "('s1', 'r', 320, 900, 7, 'h', 10.0), ('s1', 'r', 640, 1200, 7, 'h', 11.0), "
        "('s1', 'r', 96, 300, 7, 'h', 9.0), ('s2', 'r', 32, 100, 8, 'h', 5.0)"
    )
    con.close()


def test_spool_offsets_get_a_primary_key_keeping_the_furthest_row(db_path):
    _v3_with_duplicate_offsets(db_path)
    assert store.schema_version(db_path) == schema.CURRENT_VERSION  # upgraded on opening
    con = duckdb.connect(str(db_path))
    try:
        rows = con.execute(
            "SELECT spool, bin_offset, jsonl_offset, updated_at FROM spool_offsets ORDER BY spool"
        ).fetchall()
        assert rows == [("s1", 640, 1200, 11.0), ("s2", 32, 100, 5.0)]
        keys = con.execute(
            "SELECT constraint_column_names FROM duckdb_constraints() "
            "WHERE table_name = 'spool_offsets' AND constraint_type = "
            "'PRIMARY KEY'"
        ).fetchall()
        assert keys == [(["spool"],)]
        with pytest.raises(duckdb.ConstraintException):
            con.execute("INSERT INTO spool_offsets VALUES ('s2', 'r', 0, 0, 1, 'h', 1.0)")
    finally:
        con.close()
    w = store.RunWriter.start(db_path, "after")  # and the upgraded file works
    w.log(1, {"loss": 1.0})
    assert w.close()


def test_a_second_thread_cannot_drop_duckdbs_file_lock(db_path):
    """fcntl locks belong to the process: closing *any* descriptor of the database file drops
    DuckDB's lock on it. Another thread's first look at the file (its header) must wait for the
    connection that is open, or a program that trusts DuckDB's lock (our own lock-free
    read-only precheck, a duckdb shell) could open the file while it is being written."""
    store.RunWriter.start(db_path, "x", handle_sigterm=False).close()
    probe = [
        sys.executable,
        "-c",
        "import duckdb, sys\n"
        "try:\n"
        "    duckdb.connect(sys.argv[1], read_only=True).close(); print('OPENED')\n"
        "except duckdb.IOException as e:\n"
        "    print('LOCKED' if 'lock' in str(e).lower() else repr(e))\n",
        str(db_path),
    ]
    holding, release = threading.Event(), threading.Event()
    outcome = []

    def hold():
        with write_connection(db_path) as con:
            con.execute("SELECT count(*) FROM runs").fetchall()
            holding.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert holding.wait(30)
        assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "LOCKED"
        try:  # the writer's main thread calling claim() while the flusher is in its visit
            commands.claim(db_path, 1, "trainer", timeout=0.3)
        except StoreBusyError:
            outcome.append("busy")
        out = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
        assert out == "LOCKED", f"{out}: DuckDB's lock was dropped under an open connection"
    finally:
        release.set()
        t.join(30)
    assert outcome == ["busy"]
