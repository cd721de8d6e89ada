"""Compaction: drop old raw metric rows that the rollups already hold, and give the space back.

Owns `compact(db, keep_last_steps=N | before_step=S, run_id=None, dry_run=False)`. For each
run it picks a horizon: the first step whose raw rows are kept (last step - N + 1, or S),
rounded down to a multiple of the coarse rollup's 64 steps, so every dropped row lies in
buckets the rollups hold whole and a resume from a step at or after the horizon rebuilds its
buckets from raw rows that are still there (rollup.truncate). Charts at widths >= 8 read the
rollups (store/reader.py) and still draw the whole run; widths 1-4 read raw rows, which remain
from the horizon on. Latest values come from the rollups; events, commands, trials, plans and
spool offsets are copied unchanged.

Why a new file: DuckDB 2.0.1 does not shrink a file after DELETE, CHECKPOINT or VACUUM (measured:
a 22.6 MB table with 97% of its rows deleted left a 23.3 MB file), so the kept rows are copied
into `<db>.compact.tmp` (schema, constraints and sequences by COPY FROM DATABASE … (SCHEMA), then
every table's rows, metrics in their stored order so the t zone maps stay tight), the old
connection is closed (its WAL checkpointed into it), the new file is fsynced and renamed over
the old one, all under the exclusive lock every ingest takes (db.write_lock). So ingest and
compaction never interleave, and a SIGKILL at any moment leaves the old file (and a stale
`.compact.tmp`, removed by the next compaction) or the new one. Runs whose writer is alive are
left alone (named with --run: refused).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from rampwatch.store.db import DEFAULT_TIMEOUT, read_connection, resolve, write_lock
from rampwatch.store.errors import DatabaseMissingError, RunNotFoundError, StoreError
from rampwatch.store.recovery import live_spools, recover_dead
from rampwatch.store.rollup import RAW_SHIFT
from rampwatch.store.schema import ROLLUP_SHIFT

ALIGN = 1 << ROLLUP_SHIFT  # horizons are multiples of the coarse rollup's bucket
TMP_SUFFIX = ".compact.tmp"


@dataclass(frozen=True)
class RunPlan:
    run_id: str
    horizon: int  # raw rows at steps below it are dropped
    dropped: int  # raw rows below the horizon


@dataclass
class CompactReport:
    runs: list[RunPlan] = field(default_factory=list)  # runs with rows to drop
    live: list[str] = field(default_factory=list)  # runs left alone: a writer is alive
    rows_before: int = 0  # raw metric rows in the file
    bytes_before: int = 0
    bytes_after: int | None = None  # None: nothing was rewritten (dry run, nothing to drop)
    dry_run: bool = False

    @property
    def dropped(self) -> int:
        return sum(r.dropped for r in self.runs)


def tmp_path(db) -> Path:
    return Path(str(resolve(db)) + TMP_SUFFIX)


def horizon(last_step: int, keep_last_steps: int | None, before_step: int | None) -> int:
    """The first step whose raw rows are kept, a multiple of ALIGN (Python's >> floors)."""
    h = last_step - keep_last_steps + 1 if keep_last_steps is not None else before_step
    return (h // ALIGN) * ALIGN


def _check_args(keep_last_steps, before_step) -> None:
    if (keep_last_steps is None) == (before_step is None):
        raise StoreError("give exactly one of --keep-last-steps N and --before-step S")
    for flag, v in (("--keep-last-steps", keep_last_steps), ("--before-step", before_step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise StoreError(f"{flag} must be an integer >= 0, got {v!r}")


def _plan(con, db, run_id, keep_last_steps, before_step, report: CompactReport) -> pa.Table:
    """The runs to compact and their horizons (an Arrow table run_id, horizon); fills report."""
    rows = con.execute(
        "SELECT run_id, last_step FROM runs WHERE ($r::VARCHAR IS NULL OR run_id = $r) "
        "ORDER BY created_at, run_id",
        {"r": run_id},
    ).fetchall()
    if run_id is not None and not rows:
        raise RunNotFoundError(f"no run {run_id!r} in {db}; `rampwatch info {db}` lists the runs")
    ids, hs = [], []
    for rid, last in rows:
        if live_spools(con, db, rid):
            if run_id is not None:
                raise StoreError(
                    f"run {rid!r} has a live writer; compact it once its training has ended"
                )
            report.live.append(rid)
        elif last is not None:
            ids.append(rid)
            hs.append(horizon(int(last), keep_last_steps, before_step))
    plan = pa.table({"run_id": pa.array(ids, pa.string()), "horizon": pa.array(hs, pa.int64())})
    con.register("rw_plan", plan)
    try:
        counts = dict(
            con.execute(
                "SELECT m.run_id, count(*) FROM metrics m JOIN rw_plan p ON m.run_id = p.run_id "
                "WHERE m.step < p.horizon GROUP BY m.run_id"
            ).fetchall()
        )
        [(report.rows_before,)] = con.execute("SELECT count(*) FROM metrics").fetchall()
    finally:
        con.unregister("rw_plan")
    report.runs = [
        RunPlan(rid, h, int(counts[rid])) for rid, h in zip(ids, hs, strict=True) if counts.get(rid)
    ]
    return pa.table(
        {
            "run_id": pa.array([r.run_id for r in report.runs], pa.string()),
            "horizon": pa.array([r.horizon for r in report.runs], pa.int64()),
        }
    )


def _copy(con, tmp: Path, plan: pa.Table) -> None:
    """Write every row but the dropped ones into a new database file at tmp."""
    [(old,)] = con.execute("SELECT current_database()").fetchall()
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
            "AND table_catalog = current_database() AND table_type = 'BASE TABLE' "
            "ORDER BY table_name"
        ).fetchall()
    ]
    con.execute("ATTACH ? AS rw_new", [str(tmp)])
    try:
        quoted = '"' + old.replace('"', '""') + '"'
        con.execute(f"COPY FROM DATABASE {quoted} TO rw_new (SCHEMA)")
        con.register("rw_plan", plan)
        for t in tables:  # names from the catalog of a file whose schema was checked
            if t == "metrics":  # stored order kept (ORDER BY rowid: a join does not keep it)
                con.execute(
                    "INSERT INTO rw_new.main.metrics SELECT m.* FROM main.metrics m "
                    "LEFT JOIN rw_plan p ON m.run_id = p.run_id "
                    "WHERE p.horizon IS NULL OR m.step >= p.horizon ORDER BY m.rowid"
                )
            else:
                con.execute(f'INSERT INTO rw_new.main."{t}" SELECT * FROM main."{t}"')
        # Where the raw rows now start (rollup.RAW_SHIFT): the reader draws from the rollups
        # there, and a resume below it rebuilds from them. Rows exist below each horizon and
        # none below an earlier one, so a horizon is always past the run's earlier mark.
        con.execute(
            "DELETE FROM rw_new.main.rollup_state WHERE shift = ? "
            "AND run_id IN (SELECT run_id FROM rw_plan)",
            [RAW_SHIFT],
        )
        con.execute(
            "INSERT INTO rw_new.main.rollup_state SELECT run_id, ?, horizon FROM rw_plan",
            [RAW_SHIFT],
        )
        con.unregister("rw_plan")
    finally:
        con.execute("DETACH rw_new")  # checkpoints the new file: no WAL is left beside it


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(tmp: Path) -> None:
    for p in (tmp, Path(str(tmp) + ".wal")):
        p.unlink(missing_ok=True)


def compact(
    db,
    keep_last_steps: int | None = None,
    before_step: int | None = None,
    run_id: str | None = None,
    dry_run: bool = False,
    timeout: float = DEFAULT_TIMEOUT * 6,
) -> CompactReport:
    """Drop raw metric rows below each run's horizon and rewrite the file without them.

    A bad argument, a missing, foreign or newer file, an unknown run or a run with a live
    writer raise StoreError before anything is written. dry_run: only report what would go.
    """
    _check_args(keep_last_steps, before_step)
    path = resolve(db)
    if not path.exists():
        raise DatabaseMissingError(f"no Rampwatch database at {db}: the file does not exist")
    report = CompactReport(dry_run=dry_run, bytes_before=path.stat().st_size)
    # A look first, read-only: bad input is refused with nothing written (no recovery, no
    # upgrade); a dry run stops here.
    with read_connection(path, timeout, read_only=True) as con:
        _plan(con, path, run_id, keep_last_steps, before_step, report)
    if dry_run or not report.runs:
        return report
    tmp = tmp_path(path)
    with write_lock(path, timeout) as held:
        _remove_stale(tmp)  # a compaction killed before its rename
        with held.connection(threads=None) as con:
            recover_dead(con, path)  # a dead writer's tail belongs in the copy
            report = CompactReport(
                bytes_before=report.bytes_before
            )  # planned again, under the lock
            plan = _plan(con, path, run_id, keep_last_steps, before_step, report)
            if not report.runs:
                return report
            try:
                _copy(con, tmp, plan)
            except duckdb.Error as e:  # a full disk, most likely: the old file is untouched
                _remove_stale(tmp)
                raise StoreError(
                    f"could not write the compacted copy {tmp} ({str(e).splitlines()[0]}); "
                    f"{path} is as it was. It needs room for a copy of the kept rows."
                ) from None
            except BaseException:
                _remove_stale(tmp)
                raise
        # The old connection is closed: its WAL is checkpointed into the old file. A WAL left
        # there would be replayed onto the new file, so none may be.
        wal = Path(str(path) + ".wal")
        if wal.exists() or Path(str(tmp) + ".wal").exists():
            _remove_stale(tmp)
            raise StoreError(f"{path}: a WAL file is still beside it; compaction left it as it was")
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))  # a team's shared file stays shared
        _fsync(tmp)
        os.replace(tmp, path)  # atomic: the old file or the new one, never a half
        _fsync(path.parent, directory=True)
        report.bytes_after = path.stat().st_size
    return report
