"""Rampwatch's store: the one module through which every process reads and writes the DuckDB file.

Public API (see each module's docstring for the why):
  RunWriter.start(db, …) → writer.log(step, {name: value}), .event, .memory_plan, .update_run,
      .take_claimed_commands, .command_applied, .command_refused (never wait on the database),
      .flush, .close, .stats (writer.py; its Flusher: flusher.py)
  Reader(db) and list_runs, get_run, metric_names, series, latest, events, memory_plan,
      trials, trial_points, export; metric_stats and events_of_runs, of every run in one
      query (reader.py)
  commands: submit, claim, apply, refuse, cancel, list_commands, get, log (commands.py)
  recover(db) and dead_writers(db), which only looks, delete_run(db, run_id) (recovery.py),
      schema_version(db) (db.py); compact(db, keep_last_steps=N | before_step=S) (compact.py);
  naming: check_run_id, check_run_name, display_name (naming.py);
  record_refusal, list_refusals, refusal_counts: the dashboard's refused writes (refusals.py);
  the errors (errors.py); `rampwatch info|recover|upgrade|export|compact DB` (cli.py);
  read_connection / write_connection (db.py) for tools that need raw SQL under the lock;
  set_read_only() makes every read of the process write nothing (the dashboard's read-only
  mode; reads also pass read_only=True one by one).
No torch, streamlit or pandas here: stdlib, duckdb, numpy, pyarrow only.
"""

from __future__ import annotations

from rampwatch.store import commands, naming
from rampwatch.store.commands import Command, LogEntry
from rampwatch.store.compact import CompactReport, compact
from rampwatch.store.db import read_connection, schema_version, set_read_only, write_connection
from rampwatch.store.errors import (
    CommandError,
    DatabaseCorruptError,
    DatabaseMissingError,
    DuckDBVersionError,
    InvalidNameError,
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
    MetricStats,
    PlanRow,
    Reader,
    Run,
    Series,
    Trial,
    TrialPoint,
    Wanted,
    events,
    events_of_runs,
    export,
    get_run,
    latest,
    list_runs,
    memory_plan,
    metric_names,
    metric_stats,
    series,
    trial_points,
    trials,
)
from rampwatch.store.recovery import DeadWriter, RecoveryReport, dead_writers, delete_run, recover
from rampwatch.store.refusals import Refusal, list_refusals, refusal_counts
from rampwatch.store.refusals import record as record_refusal
from rampwatch.store.schema import CURRENT_VERSION
from rampwatch.store.writer import RunWriter

__all__ = [
    "RunWriter",
    "Reader",
    "Run",
    "Series",
    "Wanted",
    "Event",
    "MetricStats",
    "PlanRow",
    "Trial",
    "TrialPoint",
    "Command",
    "LogEntry",
    "RecoveryReport",
    "DeadWriter",
    "Refusal",
    "list_runs",
    "get_run",
    "metric_names",
    "series",
    "latest",
    "metric_stats",
    "events",
    "events_of_runs",
    "memory_plan",
    "trials",
    "trial_points",
    "export",
    "commands",
    "naming",
    "recover",
    "dead_writers",
    "record_refusal",
    "list_refusals",
    "refusal_counts",
    "delete_run",
    "compact",
    "CompactReport",
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
    "InvalidNameError",
    "read_connection",
    "write_connection",
    "set_read_only",
]
