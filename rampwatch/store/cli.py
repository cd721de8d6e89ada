"""`rampwatch info|recover|upgrade|export|compact DB`: look at, repair, upgrade, export or compact
a database; `rampwatch info DIR`: each database under a directory (store/db_files.py), its runs or its problem.

Owns the command line: exit 0 on success, 1 when the database stays busy, 2 on anything else
that stops it (usage, a missing, foreign, too-new, too-old-to-read or damaged file, a file that
cannot be read), always with a one-line message naming the file and what to do, never a
traceback (report(): the same line and status for `rampwatch train`). `info` only reads: it
changes nothing in or beside the file, whatever its schema. `info DIR` lists every file, a
damaged, foreign or too-new one as one line in its place, and then exits as the worst file did
(2, or 1 when one stayed busy), so a script sees that something under DIR needs a look.
"""

from __future__ import annotations

import os
import sys
import time

import duckdb
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from rampwatch import store
from rampwatch.store import rollup
from rampwatch.store.compact import compact
from rampwatch.store.db_files import SUFFIX, database_files
from rampwatch.store.errors import StoreBusyError, StoreError
from rampwatch.store.naming import display_name


def _age(t: float | None) -> str:
    return "-" if t is None else f"{time.time() - t:.0f}s ago"


def _info(db: str) -> None:
    version = store.schema_version(db, read_only=True)
    runs = store.list_runs(db, read_only=True)
    print(f"database {db}: Rampwatch schema version {version}, {len(runs)} run(s)")
    if version < store.CURRENT_VERSION:
        print(
            f"(read as it is; this Rampwatch writes version {store.CURRENT_VERSION} and "
            f"upgrades the file when it next opens it for writing, or now with "
            f"`rampwatch upgrade {db}`)"
        )
    if runs:
        print(f"{'run_id':<28} {'status':<9} {'last_step':>10} {'heartbeat':>12}  name")
        for r in runs:
            last = "-" if r.last_step is None else str(r.last_step)
            run_id, name = display_name(r.run_id), display_name(r.name or "")
            print(f"{run_id:<28} {r.status:<9} {last:>10} {_age(r.heartbeat):>12}  {name}")


def _info_dir(root: str) -> int:
    """`rampwatch info DIR`: every database under root, each as `info DB` prints it, or its
    problem in one line; the status of the worst file."""
    try:
        files = database_files(root)
    except OSError as e:
        raise StoreError(f"cannot list the directory {root}: {e.strerror}") from None
    if not files:
        raise store.DatabaseMissingError(
            f"no Rampwatch databases (*{SUFFIX} files) under {root}; check the path, or point "
            "training runs' --db at files in it"
        )
    print(f"directory {root}: {len(files)} database file(s)")
    worst = 0
    for path in files:
        print()
        try:
            _info(str(path))
        except BrokenPipeError:
            raise
        except Exception as e:  # noqa: BLE001 - one file's problem is one line, never the end
            message, code = _problem(str(path), e)
            if code is None:
                raise
            print(f"database {path}: cannot be read: {_one_line(message)}")
            worst = max(worst, code)
    if worst:
        print(
            f"rampwatch info: error: some files under {root} could not be read (listed above)",
            file=sys.stderr,
        )
    return worst


def _recover(db: str) -> None:
    report = store.recover(db)
    for s in report.spools:
        state = f"set aside as corrupt: {s.corrupt}" if s.corrupt else "ingested and removed"
        print(f"spool {s.spool} (run {s.run_id}): {s.records} metric records {state}")
    for run_id in report.killed_runs:
        print(f"run {run_id}: marked killed")
    if report.refused_commands:
        print(f"{report.refused_commands} open command(s) refused: run killed")
    if not (report.spools or report.killed_runs):
        print("nothing to recover")


def _upgrade(db: str) -> None:
    t0 = time.time()
    with store.write_connection(db, create=False) as con:  # opening it for writing upgrades it
        now = [
            v
            for (v,) in con.execute(
                "SELECT version FROM rampwatch_schema WHERE applied_at >= ? ORDER BY 1", [t0]
            ).fetchall()
        ]
        [(version,)] = con.execute("SELECT max(version) FROM rampwatch_schema").fetchall()
    print(
        f"database {db}: Rampwatch schema version {version}"
        + (f" (applied now: {', '.join(map(str, now))})" if now else " (already current)")
    )


def pick_run(db: str, run_id: str | None, how: str = "after the database") -> str:
    """run_id when the file holds it, or the file's only run; else StoreError naming the runs
    (`how`: where the command takes a run id)."""
    runs = store.list_runs(db, read_only=True)
    if run_id is None:
        if len(runs) != 1:
            names = ", ".join(r.run_id for r in runs) or "none"
            raise store.StoreError(f"{db} holds {len(runs)} runs ({names}): name the one {how}")
        return runs[0].run_id
    if run_id not in {r.run_id for r in runs}:
        raise store.RunNotFoundError(
            f"no run {run_id!r} in {db}; `rampwatch info {db}` lists the runs"
        )
    return run_id


def _export(db: str, run_id: str | None, fmt: str, out: str | None) -> None:
    run_id = pick_run(db, run_id, "to export after the database")
    table = store.export(db, run_id, read_only=True)
    if out is None:
        if fmt == "parquet" and sys.stdout.isatty():
            raise store.StoreError("Parquet is binary: pass -o FILE (or redirect the output)")
        sink = pa.BufferOutputStream()
    else:
        sink = out
    if fmt == "parquet":
        pq.write_table(table, sink)
    else:
        pa_csv.write_csv(table, sink)
    if out is None:
        sys.stdout.buffer.write(sink.getvalue().to_pybytes())
        sys.stdout.flush()
    else:
        print(f"run {run_id}: {table.num_rows} metric rows written to {out}", file=sys.stderr)
    with store.read_connection(db, read_only=True) as con:
        start = rollup.raw_from(con, run_id)
    if start is not None:
        print(
            f"run {run_id}: compacted; its raw rows start at step {start} (the charts' "
            "rollups still cover the whole run)",
            file=sys.stderr,
        )


def _compact(db: str, keep: int | None, before: int | None, run_id: str | None, dry: bool):
    report = compact(db, keep_last_steps=keep, before_step=before, run_id=run_id, dry_run=dry)
    verb = "would drop" if dry else "dropped"
    for r in report.runs:
        print(f"run {r.run_id}: {verb} {r.dropped} raw metric rows before step {r.horizon}")
    for run_id in report.live:
        print(f"run {run_id}: left alone (its writer is alive)")
    per = report.bytes_before / max(1, report.rows_before)
    line = (
        f"database {db}: {report.rows_before} raw rows, {report.bytes_before} bytes "
        f"({per:.1f} B per logged value)"
    )
    if report.bytes_after is not None:
        kept = report.rows_before - report.dropped
        line += (
            f" -> {kept} raw rows, {report.bytes_after} bytes "
            f"({report.bytes_after / max(1, report.rows_before):.1f} B per logged value)"
        )
    elif not report.runs:
        line += ": nothing to drop, left as it was"
    else:
        line += f": {report.dropped} rows would go (dry run: nothing changed)"
    print(line)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


COMMANDS = {
    "info": "schema version and runs (reads only, changes nothing)",
    "recover": "ingest dead writers' spools; mark their runs killed",
    "upgrade": "bring an older file to this Rampwatch's schema",
    "export": "every raw metric row of a run as CSV (default) or Parquet (reads only)",
    "compact": "drop old raw metric rows (the rollups keep whole-run charts); shrink the file",
}


def add_commands(sub) -> None:
    """info, recover, upgrade and export as subcommands of the `rampwatch` parser."""
    for name, help_ in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument(
            "db",
            help="path of the Rampwatch DuckDB file"
            + (
                ", or a directory of them (each file's runs or its problem)"
                if name == "info"
                else ""
            ),
        )
        if name == "export":
            p.add_argument("run", nargs="?", help="run id (needed when the file holds several)")
            p.add_argument("--format", choices=("csv", "parquet"), default="csv")
            p.add_argument("-o", "--output", help="file to write (default: standard output)")
        if name == "compact":
            horizon = p.add_mutually_exclusive_group(required=True)
            horizon.add_argument(
                "--keep-last-steps",
                type=int,
                metavar="N",
                help="keep each run's raw rows of its last N steps (at least: from a multiple of "
                "64 on), drop those before; the dashboard's ramp advice reads the noise scale raw "
                "over a run's last 2048 steps, so keep N >= 2048 for runs you may resume",
            )
            horizon.add_argument(
                "--before-step",
                type=int,
                metavar="S",
                help="drop raw rows at steps before S (rounded down to a multiple of 64)",
            )
            p.add_argument("--run", help="only this run (default: every run without a live writer)")
            p.add_argument(
                "--dry-run", action="store_true", help="say what would be dropped; change nothing"
            )


def run(args) -> int:
    """Exit 0 on success, 1 while the database stays busy, 2 on anything else, in one line."""
    if args.command == "export":
        return guarded(args.command, args.db, _export, args.db, args.run, args.format, args.output)
    if args.command == "compact":
        return guarded(
            args.command,
            args.db,
            _compact,
            args.db,
            args.keep_last_steps,
            args.before_step,
            args.run,
            args.dry_run,
        )
    if args.command == "info" and os.path.isdir(args.db):
        return guarded(args.command, args.db, _info_dir, args.db)
    action = {"info": _info, "recover": _recover, "upgrade": _upgrade}[args.command]
    return guarded(args.command, args.db, action, args.db)


def guarded(command: str, db: str, action, *args) -> int:
    """action(*args) on the database db as `rampwatch COMMAND` runs it: its return status (0
    when it returns None), or a store error's one line and status (report), or one line for
    what the store did not foresee."""
    try:
        return action(*args) or 0
    except BrokenPipeError:  # stdout's reader left (`| head`): not the file's fault (../cli.py)
        raise
    except Exception as e:  # noqa: BLE001 - mapped to one line below, or raised again
        message, code = _problem(db, e)
        if code is None:
            raise
        return _fail(command, message, code)


def _problem(db: str, e: Exception) -> tuple[str, int | None]:
    """(one line, exit status) for what stopped a command on db; status None: not a problem of
    the file (a bug), to be raised. A store error says it all; the rest were not foreseen."""
    if isinstance(e, StoreError):
        return str(e), 1 if isinstance(e, StoreBusyError) else 2
    if isinstance(e, (duckdb.Error, OSError, pa.ArrowException)):
        return (
            f"could not read {db}: {e}. If the file is damaged, restore it "
            "from a backup or start a new database at another path.",
            2,
        )
    return str(e), None


def report(command: str, e: StoreError) -> int:
    """A store error met by `rampwatch COMMAND` as its one line on stderr; the exit status: 1
    while the database stays busy (try again), 2 for anything else."""
    return _fail(command, e, 1 if isinstance(e, StoreBusyError) else 2)


def _fail(command: str, message, code: int) -> int:
    print(f"rampwatch {command}: error: {_one_line(message)}", file=sys.stderr)
    return code
