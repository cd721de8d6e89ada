"""Recovery of dead writers: ingest what their spools still hold and mark their runs killed.

Owns what happens to a spool whose writer died (its fcntl lock is free): whoever next opens the
database for writing (RunWriter.start, commands.submit, `rampwatch recover DB`, and a live
writer now and then) ingests the spool's tail exactly once (the stored offsets say where to
start), deletes the fully ingested spool, and marks any run that is still 'running' with no
live spool left as 'killed' at its last step, refusing its open commands ('run killed'). A
spool that cannot be parsed is renamed `<session>.corrupt` and reported, not deleted.
`dead_writers` only looks: which spools wait for that, and how much they hold, for a reader
that cannot recover (the dashboard's read-only mode).

Deleting a run (`delete_run`: every row recorded for it, in every table, in one transaction)
lives here too, since it is refused while a writer is logging to the run and recovers dead
writers first: a dead writer's spool left on disk would otherwise bring the deleted run back
at the next recovery.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rampwatch.store import command_rows, ingest, spool
from rampwatch.store import spool_format as fmt
from rampwatch.store.db import DEFAULT_TIMEOUT, read_connection, spool_root, write_connection
from rampwatch.store.errors import StoreError
from rampwatch.store.schema import EVENTS, RUN_TABLES, first, transaction


@dataclass
class RecoveredSpool:
    spool: str
    run_id: str | None
    records: int
    corrupt: str | None = None  # why the spool was set aside (kept as <session>.corrupt)
    damaged_bytes: int = 0
    lost_records: int = 0


@dataclass
class RecoveryReport:
    spools: list[RecoveredSpool] = field(default_factory=list)
    killed_runs: list[str] = field(default_factory=list)
    refused_commands: int = 0


@dataclass(frozen=True)
class DeadWriter:
    """A dead writer's spool that recovery would ingest."""

    spool: str
    run_id: str | None  # None: not even its start record is readable
    records: int  # metric records and rare records beyond the stored offsets


def _waiting(path: Path, offsets: tuple | None) -> tuple[str | None, int]:
    """(run id, records not yet ingested) of one spool, from its sizes and stored offsets."""
    run_id, bin_off, js_off = offsets if offsets is not None else (None, 0, 0)
    record_size = fmt.LEGACY_RECORD.itemsize if spool.is_legacy(path) else fmt.SIZE
    bin_size, _ = spool.file_sizes(path)
    tail, _, _ = spool.read_json_records(path, js_off, final=True)
    if run_id is None:  # never ingested: its start record names the run
        run_id = next((r.get("run_id") for r in tail if isinstance(r, dict)), None)
    return run_id, max(0, bin_size - bin_off) // record_size + len(tail)


def dead_writers(db, timeout: float = DEFAULT_TIMEOUT, read_only: bool | None = None):
    """The spools of dead writers beside `db` and what each still holds (list[DeadWriter]).

    Only looks: a shared probe of each spool's lock and a read of the stored offsets, so it
    works read-only; `recover` ingests them.
    """
    root = spool_root(db)
    dead = [p for p in spool.list_spools(root) if not spool.is_live(p)]
    if not dead:
        return []
    with read_connection(db, timeout, read_only=read_only) as con:
        rows = con.execute(
            "SELECT spool, run_id, bin_offset, jsonl_offset FROM spool_offsets"
        ).fetchall()
    offsets = {r[0]: r[1:] for r in rows}
    return [DeadWriter(p.name, *_waiting(p, offsets.get(p.name))) for p in dead]


def live_spools(con, db, run_id: str) -> list[Path]:
    root = spool_root(db)
    rows = con.execute("SELECT spool FROM spool_offsets WHERE run_id = ?", [run_id]).fetchall()
    return [root / r[0] for r in rows if spool.is_live(root / r[0])]


def _recover_spool(con, path: Path, fd: int) -> tuple[RecoveredSpool, float | None]:
    total, run_id, max_t, damaged, lost, unusable = 0, None, None, 0, 0, 0
    while True:
        res = ingest.ingest_spool(con, path, final=True)
        run_id = res.run_id or run_id
        total += res.records
        damaged, lost, unusable = (
            damaged + res.damaged_bytes,
            lost + res.lost_records,
            unusable + res.unusable,
        )
        if res.max_t is not None:
            max_t = res.max_t if max_t is None else max(max_t, res.max_t)
        if not res.more:
            break
    sizes = spool.file_sizes(path)
    unread = (sizes[0] - res.bin_offset) + (sizes[1] - res.jsonl_offset)
    why = None
    if run_id is None and unread:
        why = f"{unread} bytes but no readable start record: they cannot be tied to a run"
    elif damaged or lost or unusable:
        why = (
            f"damaged: {damaged} bytes stepped over, about {lost} metric records lost, "
            f"{unusable} unusable records (an alert event on run {run_id} has the details)"
        )
    elif unread > 0:
        why = f"{unread} bytes could not be read"
    out = RecoveredSpool(path.name, run_id, total, damaged_bytes=damaged, lost_records=lost)
    if why is not None:  # never delete bytes that were not read back
        out.corrupt = f"{why}; kept at {spool.set_aside(path)}"
        return out, max_t
    spool.remove_dir(path)  # still under the dead writer's lock (fd), so nobody else races us
    return out, max_t


def _mark_killed(con, db, run_id: str, recovered: int, ended: float | None) -> int | None:
    """Mark a running run without a live writer as killed; returns refused commands or None."""
    with transaction(con):
        row = first(
            con.execute("SELECT status, last_step, heartbeat FROM runs WHERE run_id = ?", [run_id])
        )
        if row is None or row[0] != "running" or live_spools(con, db, run_id):
            return None
        _, last_step, heartbeat = row
        ended = max(x for x in (ended, heartbeat, 0.0) if x is not None) or time.time()
        con.execute(
            "UPDATE runs SET status = 'killed', ended_at = ? WHERE run_id = ?", [ended, run_id]
        )
        who = first(
            con.execute(
                "SELECT pid, host FROM spool_offsets WHERE run_id = ? "
                "ORDER BY updated_at DESC LIMIT 1",
                [run_id],
            )
        )
        writer = f"pid {who[0]} on {who[1]}" if who and who[0] is not None else "unknown"
        message = (
            f"the writer ({writer}) died without closing the run; {recovered} records were "
            f"recovered from its spool; marked killed at step {last_step}"
        )
        killed = dict(run_id=run_id, step=last_step, t=time.time(), kind="killed", message=message)
        con.execute(EVENTS.insert, EVENTS.params(killed))
        return command_rows.refuse_open(con, run_id, "run killed", "recovery")


def recover_dead(con, db) -> RecoveryReport:
    """Ingest and remove every dead writer's spool beside `db`; con is a write connection."""
    report = RecoveryReport()
    root = spool_root(db)
    recovered: dict[str, tuple[int, float | None]] = {}
    for path in spool.list_spools(root):
        fd = spool.lock_if_dead(path)
        if fd is None:
            continue
        try:
            done, max_t = _recover_spool(con, path, fd)
        finally:
            os.close(fd)
        report.spools.append(done)
        if done.run_id is not None:
            n, t = recovered.get(done.run_id, (0, None))
            recovered[done.run_id] = (n + done.records, max_t if t is None else max(t, max_t or t))
    for tmp in spool.stale_tmp_dirs(root):
        fd = spool.lock_if_dead(tmp)
        if fd is not None:  # a writer killed while creating its spool: nothing was logged yet
            spool.remove_dir(tmp)
            os.close(fd)
    running = [
        r[0]
        for r in con.execute(
            "SELECT run_id FROM runs WHERE status = 'running' ORDER BY created_at"
        ).fetchall()
    ]
    for run_id in running:
        n, t = recovered.get(run_id, (0, None))
        refused = _mark_killed(con, db, run_id, n, t)
        if refused is not None:
            report.killed_runs.append(run_id)
            report.refused_commands += refused
    return report


def recover(db, timeout: float = DEFAULT_TIMEOUT) -> RecoveryReport:
    """Ingest every dead writer's spool beside `db` and mark their runs killed. The file is made
    only for a spool to ingest: a mistyped path is DatabaseMissingError, not an empty database."""
    with write_connection(db, timeout, create=bool(spool.list_spools(spool_root(db)))) as con:
        return recover_dead(con, db)


def delete_run(db, run_id: str, timeout: float = 60.0) -> None:
    """Delete a run and everything recorded for it; refused while a writer is logging to it."""
    with write_connection(db, timeout, create=False) as con:
        recover_dead(con, db)
        if live_spools(con, db, run_id):
            raise StoreError(f"run {run_id!r} has a live writer; stop it before deleting the run")
        with transaction(con):
            con.execute(
                "DELETE FROM command_log WHERE command_id IN "
                "(SELECT command_id FROM commands WHERE run_id = ?)",
                [run_id],
            )
            for table in RUN_TABLES:  # our constants, never input
                con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
