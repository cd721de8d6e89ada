"""A damaged spool loses only its damaged records: a dead writer's spool (a real process,
SIGKILLed) is damaged byte by byte, then recovered; every good record lands, the damage is an
alert event on the run with counts, and the spool is kept, not deleted."""

from __future__ import annotations

import subprocess

import pytest

from rampwatch import store
from rampwatch.store import spool
from rampwatch.store.db import spool_root
from tests.procs import kill_group
from tests.store_child import metric, value
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(180)

STEPS, METRICS = 3000, 4  # 12,000 records: record 10,000 is step 2500, metric m00
SIZE = 40


def _dead_writer(procs, db):
    child = procs.spawn(
        [
            "tests/store_child.py",
            "log",
            str(db),
            "--run-id",
            "d",
            "--metrics",
            str(METRICS),
            "--last",
            str(STEPS - 1),
            "--flush-interval",
            "1000",
            "--exit-mode",
            "wait",
        ],
        stdout=subprocess.PIPE,
    )
    Lines(child).wait_for("WAITING")
    kill_group(child)
    (path,) = spool.list_spools(spool_root(db))
    return path


def _rows(db):
    return {(r["step"], r["name"]): r["value"] for r in store.export(db, "d").to_pylist()}


def _expected(skip=()):
    return {
        (s, metric(j)): value(1, s, j)
        for s in range(STEPS)
        for j in range(METRICS)
        if (s, metric(j)) not in skip
    }


def _mutate(path, fn):
    data = bytearray(path.read_bytes())
    fn(data)
    path.write_bytes(bytes(data))


def _flip(offset, mask=0xFF):
    def fn(data):
        data[offset] ^= mask

    return fn


def _insert(offset, junk):
    def fn(data):
        data[offset:offset] = junk

    return fn


R = 10_000 * SIZE  # where record 10,000 starts


@pytest.mark.parametrize(
    "damage",
    [
        _flip(R),  # one flipped magic byte
        _insert(R + 17, b"\x00\x01\x02\x03\x04"),  # 5 inserted bytes inside record 10,000
        _flip(R + 24 + 3, 0x10),  # one bit inside the value: never stored silently
        _flip(R + 8, 0x01),  # one bit inside the step
        _flip(R + 16 + 7, 0x80),  # the top bit of t
    ],
    ids=["magic", "insert5", "value-bit", "step-bit", "t-bit"],
)
def test_one_damaged_record_loses_that_record_only(procs, db_path, damage):
    path = _dead_writer(procs, db_path)
    _mutate(path / spool.BIN, damage)
    report = store.recover(db_path)
    rows = _rows(db_path)
    assert rows == _expected(skip={(2500, metric(0))}), len(rows)
    (rec,) = report.spools
    assert rec.records == STEPS * METRICS - 1 and rec.lost_records == 1, rec
    assert rec.corrupt and "kept at" in rec.corrupt
    kept = spool_root(db_path) / (path.name + ".corrupt")
    assert kept.is_dir() and (kept / spool.BIN).stat().st_size >= STEPS * METRICS * SIZE - SIZE
    (alert,) = store.events(db_path, "d", kinds=["alert"])
    assert alert.data["lost_metric_records"] == 1 and alert.data["damaged_metric_bytes"] > 0
    assert "damaged" in alert.message and path.name in alert.message
    assert store.get_run(db_path, "d").stored_status == "killed"


def test_a_damaged_names_line_loses_only_that_metric(procs, db_path):
    path = _dead_writer(procs, db_path)
    names = path / spool.NAMES
    at = names.read_bytes().index(metric(2).encode())
    _mutate(names, _flip(at + 2, 0x01))  # "m02" -> "m03": still JSON, but not what was written
    store.recover(db_path)
    rows = _rows(db_path)
    assert rows == _expected(skip={(s, metric(2)) for s in range(STEPS)})
    (alert,) = store.events(db_path, "d", kinds=["alert"])
    assert alert.data["lost_name_records"] == STEPS, alert.data
    assert "name line" in alert.message


def test_damaged_rare_records_lose_only_their_lines(procs, db_path):
    """An event line with a flipped byte is skipped; the ones after it (and the metrics) land."""
    child = procs.spawn(
        [
            "tests/store_child.py",
            "log",
            str(db_path),
            "--run-id",
            "d",
            "--metrics",
            "2",
            "--last",
            "9",
            "--events",
            "5",
            "--flush-interval",
            "1000",
            "--exit-mode",
            "wait",
        ],
        stdout=subprocess.PIPE,
    )
    Lines(child).wait_for("WAITING")
    kill_group(child)
    (path,) = spool.list_spools(spool_root(db_path))
    recs = path / spool.RECORDS
    at = recs.read_bytes().index(b"event 2")
    _mutate(recs, _flip(at + 3, 0x02))
    store.recover(db_path)
    got = [e.message for e in store.events(db_path, "d", kinds=["tick"])]
    assert got == ["event 0", "event 1", "event 3", "event 4"]
    assert len(store.export(db_path, "d")) == 20
    (alert,) = store.events(db_path, "d", kinds=["alert"])
    assert alert.data["damaged_lines"] == 1


def test_an_undamaged_spool_is_still_deleted(procs, db_path):
    path = _dead_writer(procs, db_path)
    report = store.recover(db_path)
    assert report.spools[0].corrupt is None and not path.exists()
    assert len(_rows(db_path)) == STEPS * METRICS
    assert store.events(db_path, "d", kinds=["alert"]) == []


def test_a_format_1_spool_left_by_an_older_writer_is_still_recovered(db_path):
    """Spools written before format 2 (32-byte records without a check, plain JSON lines)."""
    import json
    import os
    import struct

    store.RunWriter.start(db_path, "new").close()  # the database exists
    path = spool_root(db_path) / "oldsession"
    path.mkdir()
    (path / "lock").write_bytes(b"")
    (path / "names.jsonl").write_text('"loss"\n"acc"\n')
    start = {
        "k": "start",
        "run_id": "old",
        "name": "old",
        "config": None,
        "t": 1.0,
        "pid": os.getpid(),
        "host": "h",
        "resume_step": None,
    }
    (path / "records.jsonl").write_text(json.dumps(start) + "\n")
    recs = b"".join(struct.pack("<qddii", s, 1.0, s * 2.0, s % 2, 0x52570001) for s in range(10))
    (path / "metrics.bin").write_bytes(recs)
    report = store.recover(db_path)
    assert [s.records for s in report.spools] == [10] and report.spools[0].corrupt is None
    rows = sorted(
        (r["step"], r["name"], r["value"]) for r in store.export(db_path, "old").to_pylist()
    )
    assert rows == [(s, ("loss", "acc")[s % 2], s * 2.0) for s in range(10)]
    assert not path.exists()
