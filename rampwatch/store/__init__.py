"""Rampwatch's store: the one module through which every process reads and writes the DuckDB file.

Public API (see each module's docstring for the why):
  RunWriter.start(db, …) → writer.log(step, {name: value}), .event, .memory_plan, .update_run,
      .take_claimed_commands, .command_applied, .command_refused (never wait on the database),
      .pending_commands, .claim (older, blocking), .flush, .close, .stats (writer.py)
  Reader(db) and list_runs, get_run, metric_names, series, latest, events, memory_plan,
      export (reader.py)
  commands: submit, claim, apply, refuse, cancel, list_commands, get, log (commands.py)
  recover(db) (recovery.py), delete_run(db, run_id), schema_version(db); the errors
  (errors.py); `rampwatch info|recover|upgrade|export DB` (cli.py);
  read_connection / write_connection (db.py) for tools that need raw SQL under the lock;
  set_read_only() makes every read of the process write nothing (the dashboard's read-only
  mode; reads also pass read_only=True one by one).
No torch, streamlit or pandas here: stdlib, duckdb, numpy, pyarrow only.
"""

from __future__ import annotations

from rampwatch.store import commands
from rampwatch.store.commands import Command, LogEntry
from rampwatch.store.db import read_connection, set_read_only, write_connection
from rampwatch.store.errors import (
    CommandError,
    DatabaseCorruptError,
    DatabaseMissingError,
    DuckDBVersionError,
    NotRampwatchError,
    RunNotFoundError,
    SchemaTooNewError,
    SchemaUpgradeNeededError,
    SpoolCorruptError,
    SpoolOffsetsError,
    StoreBusyError,
    StoreError,
)
from rampwatch.store.reader import (
    Event,
    PlanRow,
    Reader,
    Run,
    Series,
    events,
    export,
    get_run,
    latest,
    list_runs,
    memory_plan,
    metric_names,
    series,
)
from rampwatch.store.recovery import RecoveryReport, recover_dead
from rampwatch.store.schema import CURRENT_VERSION
from rampwatch.store.writer import RunWriter


def recover(db, timeout: float = 10.0) -> RecoveryReport:
    """Ingest every dead writer's spool beside `db` and mark their runs killed."""
    with write_connection(db, timeout) as con:
        return recover_dead(con, db)


def delete_run(db, run_id: str, timeout: float = 60.0) -> None:
    """Delete a run and everything recorded for it; refused while a writer is logging to it."""
    from rampwatch.store.db import transaction
    from rampwatch.store.recovery import live_spools
    from rampwatch.store.schema import RUN_TABLES

    with write_connection(db, timeout) as con:
        recover_dead(con, db)  # else a dead writer's spool could bring the run back later
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


def schema_version(db, timeout: float = 10.0, read_only: bool | None = None) -> int:
    """The schema version of an existing database (after any upgrade opening it performs;
    read_only: none, the version as the file has it)."""
    with read_connection(db, timeout, read_only=read_only) as con:
        [(v,)] = con.execute("SELECT max(version) FROM rampwatch_schema").fetchall()
    return int(v)


__all__ = [
    "RunWriter",
    "Reader",
    "Run",
    "Series",
    "Event",
    "PlanRow",
    "Command",
    "LogEntry",
    "RecoveryReport",
    "list_runs",
    "get_run",
    "metric_names",
    "series",
    "latest",
    "events",
    "memory_plan",
    "export",
    "commands",
    "recover",
    "delete_run",
    "schema_version",
    "CURRENT_VERSION",
    "StoreError",
    "StoreBusyError",
    "DatabaseMissingError",
    "NotRampwatchError",
    "SchemaTooNewError",
    "RunNotFoundError",
    "CommandError",
    "SpoolCorruptError",
    "SpoolOffsetsError",
    "DatabaseCorruptError",
    "SchemaUpgradeNeededError",
    "DuckDBVersionError",
    "read_connection",
    "write_connection",
    "set_read_only",
]
