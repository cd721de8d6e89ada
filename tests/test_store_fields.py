"""store.schema's field tables: each names every column of its table, and drives the rows the store writes and reads back (events and commands through real files)."""

from __future__ import annotations

import duckdb
import pytest

from rampwatch import store
from rampwatch.store import commands, reader, schema


@pytest.mark.parametrize("table", ["RUNS", "MEMORY_PLAN", "EVENTS", "COMMANDS"])
def test_a_field_table_names_every_column_of_its_table(tmp_path, table):
    fields = getattr(schema, table)
    db = tmp_path / "new.duckdb"
    schema.create_at_version(db, schema.CURRENT_VERSION)
    with duckdb.connect(str(db), read_only=True) as con:
        stored = [r[1] for r in con.execute(f"PRAGMA table_info('{fields.table}')").fetchall()]
    assert sorted(fields.columns) == sorted(stored)  # every statement names its columns


def test_events_and_commands_come_back_as_written(tmp_path):
    db = tmp_path / "runs.duckdb"
    with store.RunWriter.start(db, "r", run_id="r", config={"lr": 1.0}, handle_sigterm=False) as w:
        w.log(3, {"loss": 1.0})
        w.event("checkpoint", "saved", data={"path": "ck/r.pt", "ü": [1, 2]})
        w.flush()
        cid = commands.submit(db, "r", "ramp", {"per_device_batch": 2, "accum": 1}, "op", key="k1")
    (ev,) = reader.events(db, "r", kinds=["checkpoint"])
    assert ev == schema.Event("r", 3, ev.t, "checkpoint", "saved", {"path": "ck/r.pt", "ü": [1, 2]})
    cmd = commands.get(db, cid)
    assert (cmd.command_id, cmd.run_id, cmd.kind, cmd.status, cmd.actor) == (
        cid,
        "r",
        "ramp",
        "pending",
        "op",
    )
    assert cmd.payload == {"per_device_batch": 2, "accum": 1}
    assert (cmd.applied_step, cmd.reason) == (None, None)
    # the key is written, never read back (v3-v4 files have no such column): its submit finds it
    assert (
        commands.submit(db, "r", "ramp", {"per_device_batch": 2, "accum": 1}, "op", key="k1") == cid
    )
