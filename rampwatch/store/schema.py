"""The Rampwatch schema: its tables, the migrations that build them, and the version check.

Owns: the SQL every module runs inside a connection the caller holds (`transaction`, the one
BEGIN … COMMIT, and `first`, the first row of a result), the ordered MIGRATIONS list (each one runs in its own transaction and records its version
in `rampwatch_schema`), reading a file's version, refusing foreign or newer files, the rollup
constant the metrics layout depends on, and the field tables of the runs, memory_plan, events,
commands and trials tables (RUNS, MEMORY_PLAN, EVENTS, COMMANDS, TRIALS: one list of columns
that drives their INSERT, their SELECT and the row a reader returns, Run, PlanRow, Event,
Command and Trial).

Version history (a file at any older version is upgraded in place when opened):
  1  rampwatch_schema, runs (id, name, status, config, created/ended), metrics (tall).
  2  runs gains device, capacity_bytes, world_size, heartbeat, last_step (backfilled);
     events, memory_plan, commands + command_log, spool_offsets.
  3  min/max/last rollups of metrics at the ROLLUP_LEVELS (see store/rollup.py), backfilled.
  4  spool_offsets gets PRIMARY KEY (spool). Should a file hold several rows for one spool, the
     one that reached furthest is kept (its rows were ingested; the others' offsets are stale).
  5  commands gains idempotency_key: a second submit with the same key returns the first id.
     (Written with spool format 2: checked records; store/spool_format.py.)
  6  write_refusals: writes the dashboard refused (who typed what name, from where, which run,
     what was attempted, why; never the token). Read-only reading of v3..v5 sees none.
  7  trials: one row per ramp trial, kept by the ingest from the trial_* events (store/names.py)
     of a run: its plan, status, cost, kept arm and verdict. Read-only reading of v3..v6 sees
     no trials.
  8  runs gains metrics_t_min, metrics_t_max: the earliest and latest `t` of the run's metric
     rows (backfilled; kept by the ingest). Rows are appended in ingest order, so `t`'s zone
     maps are tight, and a raw read bounded by these skips other runs' row groups (the reader
     says what it pays). Read-only reading of v3..v7 reads without the bound.
Times are unix seconds (DOUBLE); JSON is stored as text. No other primary keys or unique
indexes: uniqueness is enforced by code under the exclusive lock (an index would grow the
metrics table several-fold and make a whole append fail on one duplicate). spool_offsets is the
exception: one small row per writer session, and the one row exactly-once ingest hangs on, so a
second row for a spool must fail its transaction rather than be read back by chance.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import MISSING, dataclass, field, fields

import duckdb
import pyarrow as pa

from rampwatch.store.errors import NotRampwatchError, SchemaTooNewError


def first(result):
    """The first row of a result, or None. Reads it to the end: DuckDB 2.0 refuses register()
    and some other calls on a connection whose last result was not fetched completely."""
    rows = result.fetchall()
    return rows[0] if rows else None


@contextlib.contextmanager
def transaction(con):
    """BEGIN … COMMIT on `con`, ROLLBACK if the block raises."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except duckdb.Error:
            pass  # the connection is being torn down anyway; the original error matters
        raise
    con.execute("COMMIT")


CURRENT_VERSION = 8
# Oldest version the readers' queries work on unchanged (read-only reading does not upgrade):
# v3 added the rollups every chart reads; v4 and v5 changed nothing a reader selects; v6's
# and v7's tables are read only where the file has them (store/refusals.py, store/reader.py).
MIN_READABLE_VERSION = 3
VERSION_TABLE = "rampwatch_schema"
# (shift, complete-buckets table, open-buckets table): rollups at 2**shift steps per bucket,
# finest first. Measured choice: store/reader.py.
ROLLUP_LEVELS = (
    (3, "metrics_rollup_fine", "rollup_partial_fine"),
    (6, "metrics_rollup", "rollup_partial"),
)
ROLLUP_SHIFT = ROLLUP_LEVELS[-1][0]  # the coarsest level: run extents, names, latest values

_ROLLUP_COLUMNS = """(
    run_id VARCHAR NOT NULL, name VARCHAR NOT NULL, bucket BIGINT NOT NULL,
    vmin DOUBLE, vmax DOUBLE, last_step BIGINT NOT NULL, last_value DOUBLE NOT NULL,
    n BIGINT NOT NULL, n_nonfinite BIGINT NOT NULL)"""

# Aggregates of one bucket of raw rows; min/max skip NaN and ±inf (counted in n_nonfinite).
RAW_AGGREGATES = """
    min(value) FILTER (WHERE isfinite(value)) AS vmin,
    max(value) FILTER (WHERE isfinite(value)) AS vmax,
    max(step) AS last_step,
    arg_max(value, step) AS last_value,
    count(*) AS n,
    count(*) FILTER (WHERE NOT isfinite(value)) AS n_nonfinite"""

_V1 = [
    f"""CREATE TABLE {VERSION_TABLE} (
        version INTEGER NOT NULL, applied_at DOUBLE NOT NULL, note VARCHAR)""",
    """CREATE TABLE runs (
        run_id VARCHAR NOT NULL, name VARCHAR, status VARCHAR NOT NULL, config VARCHAR,
        created_at DOUBLE NOT NULL, ended_at DOUBLE)""",
    """CREATE TABLE metrics (
        run_id VARCHAR NOT NULL, step BIGINT NOT NULL, t DOUBLE NOT NULL,
        name VARCHAR NOT NULL, value DOUBLE NOT NULL)""",
]

_V2 = [
    "ALTER TABLE runs ADD COLUMN device VARCHAR",
    "ALTER TABLE runs ADD COLUMN capacity_bytes BIGINT",
    "ALTER TABLE runs ADD COLUMN world_size INTEGER",
    "ALTER TABLE runs ADD COLUMN heartbeat DOUBLE",
    "ALTER TABLE runs ADD COLUMN last_step BIGINT",
    """UPDATE runs SET last_step = (SELECT max(m.step) FROM metrics m WHERE m.run_id = runs.run_id),
                      heartbeat = (SELECT max(m.t) FROM metrics m WHERE m.run_id = runs.run_id)""",
    """CREATE TABLE events (
        run_id VARCHAR NOT NULL, step BIGINT, t DOUBLE NOT NULL, kind VARCHAR NOT NULL,
        message VARCHAR, data VARCHAR)""",
    """CREATE TABLE memory_plan (
        run_id VARCHAR NOT NULL, step BIGINT, t DOUBLE NOT NULL, per_device_batch INTEGER NOT NULL,
        variant VARCHAR NOT NULL, predicted_bytes BIGINT, measured_bytes BIGINT,
        source VARCHAR NOT NULL, feasible BOOLEAN, breakdown VARCHAR)""",
    "CREATE SEQUENCE command_ids START 1",
    """CREATE TABLE commands (
        command_id BIGINT NOT NULL, run_id VARCHAR NOT NULL, kind VARCHAR NOT NULL,
        payload VARCHAR NOT NULL, status VARCHAR NOT NULL, actor VARCHAR NOT NULL,
        created_at DOUBLE NOT NULL, updated_at DOUBLE NOT NULL, applied_step BIGINT,
        reason VARCHAR)""",
    """CREATE TABLE command_log (
        command_id BIGINT NOT NULL, t DOUBLE NOT NULL, from_status VARCHAR,
        to_status VARCHAR NOT NULL, actor VARCHAR NOT NULL, detail VARCHAR)""",
    # One row per writer session's spool: how far it has been ingested (exactly-once ingest).
    """CREATE TABLE spool_offsets (
        spool VARCHAR NOT NULL, run_id VARCHAR NOT NULL, bin_offset BIGINT NOT NULL,
        jsonl_offset BIGINT NOT NULL, pid BIGINT, host VARCHAR, updated_at DOUBLE NOT NULL)""",
]


def _v3() -> list[str]:
    stmts = [
        "CREATE TABLE rollup_state (run_id VARCHAR NOT NULL, shift INTEGER NOT NULL, "
        "through BIGINT NOT NULL)"
    ]
    for shift, complete, partial in ROLLUP_LEVELS:  # identifiers: our constants, never input
        stmts += [
            f"CREATE TABLE {complete} {_ROLLUP_COLUMNS}",  # complete buckets, append-only
            f"CREATE TABLE {partial} {_ROLLUP_COLUMNS}",  # each run's open buckets (small)
            # Backfill: buckets below the one holding a run's last step are complete.
            f"""INSERT INTO rollup_state
                SELECT run_id, {shift}, max(step) >> {shift} FROM metrics GROUP BY run_id""",
            f"""INSERT INTO {complete}
                SELECT m.run_id, m.name, m.step >> {shift} AS bucket, {RAW_AGGREGATES}
                FROM metrics m JOIN rollup_state s ON m.run_id = s.run_id AND s.shift = {shift}
                WHERE (m.step >> {shift}) < s.through
                GROUP BY m.run_id, m.name, bucket ORDER BY m.run_id, bucket, m.name""",
            f"""INSERT INTO {partial}
                SELECT m.run_id, m.name, m.step >> {shift} AS bucket, {RAW_AGGREGATES}
                FROM metrics m JOIN rollup_state s ON m.run_id = s.run_id AND s.shift = {shift}
                WHERE (m.step >> {shift}) >= s.through
                GROUP BY m.run_id, m.name, bucket""",
        ]
    return stmts


_V3 = _v3()

# DuckDB builds the index of ALTER TABLE … ADD PRIMARY KEY over rows deleted in the same
# transaction too, so the table is rebuilt instead: new table, the furthest row per spool, swap.
_OFFSET_COLUMNS = "spool, run_id, bin_offset, jsonl_offset, pid, host, updated_at"
_V4 = [
    """CREATE TABLE spool_offsets_v4 (
        spool VARCHAR NOT NULL PRIMARY KEY, run_id VARCHAR NOT NULL, bin_offset BIGINT NOT NULL,
        jsonl_offset BIGINT NOT NULL, pid BIGINT, host VARCHAR, updated_at DOUBLE NOT NULL)""",
    f"""INSERT INTO spool_offsets_v4 ({_OFFSET_COLUMNS})
        SELECT {_OFFSET_COLUMNS} FROM spool_offsets
        QUALIFY row_number() OVER (PARTITION BY spool ORDER BY bin_offset DESC,
                                   jsonl_offset DESC, updated_at DESC) = 1""",
    "DROP TABLE spool_offsets",
    "ALTER TABLE spool_offsets_v4 RENAME TO spool_offsets",
]

_V5 = ["ALTER TABLE commands ADD COLUMN idempotency_key VARCHAR"]

REFUSALS_VERSION = 6
_V6 = [
    """CREATE TABLE write_refusals (
        t DOUBLE NOT NULL, run_id VARCHAR, action VARCHAR NOT NULL, detail VARCHAR,
        operator VARCHAR, client VARCHAR, reason VARCHAR NOT NULL)"""
]

TRIALS_VERSION = 7
_V7 = [
    """CREATE TABLE trials (
        run_id VARCHAR NOT NULL, trial_id BIGINT NOT NULL, command_id BIGINT, start_step BIGINT,
        status VARCHAR NOT NULL, factors VARCHAR, delta_tokens BIGINT, cost_tokens BIGINT,
        cost_fraction DOUBLE, cost_seconds DOUBLE, kept_factor INTEGER, continue_step BIGINT,
        verdict VARCHAR, plan VARCHAR, source VARCHAR, message VARCHAR, reason VARCHAR,
        updated_at DOUBLE NOT NULL)"""
]

ROW_TIMES_VERSION = 8
_V8 = [
    "ALTER TABLE runs ADD COLUMN metrics_t_min DOUBLE",
    "ALTER TABLE runs ADD COLUMN metrics_t_max DOUBLE",
    """UPDATE runs SET metrics_t_min = m.lo, metrics_t_max = m.hi
       FROM (SELECT run_id, min(t) AS lo, max(t) AS hi FROM metrics GROUP BY run_id) m
       WHERE runs.run_id = m.run_id""",
]

# Every table with a run_id column, children first (commands' log goes with its commands).
RUN_TABLES = (
    "metrics",
    *(t for _, c, p in ROLLUP_LEVELS for t in (c, p)),
    "rollup_state",
    "events",
    "memory_plan",
    "spool_offsets",
    "write_refusals",
    "trials",
    "commands",
    "runs",
)

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "runs and tall metrics", _V1),
    (2, "run details, events, memory plan, commands, spool offsets", _V2),
    (3, "min/max/last rollups of metrics", _V3),
    (4, "primary key on spool_offsets (spool)", _V4),
    (5, "idempotency keys of commands", _V5),
    (REFUSALS_VERSION, "refused dashboard writes", _V6),
    (TRIALS_VERSION, "ramp trials", _V7),
    (ROW_TIMES_VERSION, "the time span of each run's metric rows", _V8),
]
assert [v for v, _, _ in MIGRATIONS] == list(range(1, CURRENT_VERSION + 1))


def _tables(con) -> list[str]:
    rows = con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
        "AND table_catalog = current_database() ORDER BY table_name"
    ).fetchall()
    return [r[0] for r in rows]


def read_version(con, db, allow_empty: bool = False) -> int:
    """The file's schema version; 0 for an empty DuckDB file when allow_empty (a new database).

    Raises NotRampwatchError for a DuckDB file that holds other tables (or, for reading, none).
    """
    try:  # the common case in one cheap query; the catalog listing only when it fails
        [(version,)] = con.execute(f"SELECT max(version) FROM {VERSION_TABLE}").fetchall()
        return int(version or 0)
    except duckdb.CatalogException:
        pass
    tables = _tables(con)
    if VERSION_TABLE not in tables:
        if not tables and allow_empty:
            return 0
        what = (
            "it has no tables"
            if not tables
            else "it has other tables ("
            + ", ".join(tables[:8])
            + (", …" if len(tables) > 8 else "")
            + ")"
        )
        raise NotRampwatchError(
            f"{db} is a DuckDB database but not a Rampwatch one: {what} and no "
            f"{VERSION_TABLE} table. Rampwatch will not write to it; use another path."
        )
    [(version,)] = con.execute(f"SELECT max(version) FROM {VERSION_TABLE}").fetchall()
    return int(version or 0)


def check_not_newer(version: int, db) -> None:
    if version > CURRENT_VERSION:
        raise SchemaTooNewError(
            f"{db} has Rampwatch schema version {version}, newer than this Rampwatch "
            f"understands ({CURRENT_VERSION}); nothing was written. Upgrade Rampwatch to open it."
        )


def upgrade(con, version: int, target: int = CURRENT_VERSION) -> list[int]:
    """Apply every migration after `version` up to `target`, each in one transaction."""
    applied = []
    for v, note, statements in MIGRATIONS:
        if version < v <= target:
            with transaction(con):
                for sql in statements:
                    con.execute(sql)
                con.execute(f"INSERT INTO {VERSION_TABLE} VALUES (?, ?, ?)", [v, time.time(), note])
            applied.append(v)
    return applied


def create_at_version(path, target: int) -> None:
    """Create a new database at an older schema version (for migration tests and tooling)."""
    con = duckdb.connect(
        str(path),
        config={"autoinstall_known_extensions": False, "autoload_known_extensions": False},
    )
    try:
        if _tables(con):
            raise ValueError(f"{path} already has tables; create_at_version wants a new file")
        upgrade(con, 0, target)
    finally:
        con.close()


# ---- field tables: the current columns of runs, memory_plan, events, commands and trials ----
# The dataclass a reader returns lists its table's columns (every statement names them, so
# their order is the row's, not the table's); each column's
# metadata says how ingest batches it (Arrow type), whether a record must carry it (NOT NULL),
# whether the table holds it as JSON text, and whether it is a run detail that start and
# update_run set. A new column is then its migration above and one field here (and the writer
# argument that fills it, if any).


def _column(
    arrow=None, *, null=True, json=False, detail=False, name=None, read=True, default=MISSING
):
    """A column of the table. read=False: written, never read back (a column that a later schema
    version added and no reader needs, so that older files, read read-only, still read)."""
    meta = {"arrow": arrow, "null": null, "json": json, "detail": detail, "column": name}
    return field(default=default, metadata={**meta, "read": read})


def _derived():
    """A field of the row that is no column: the reader computes it."""
    return field(metadata={"derived": True})


@dataclass(frozen=True)
class Run:
    run_id: str = _column()
    name: str | None = _column(detail=True)
    status: str = _derived()  # as shown: 'stale' replaces 'running' when its writer looks gone
    stored_status: str = _column(name="status")  # as stored: running, finished, failed, killed
    config: dict | None = _column(json=True, detail=True)
    device: str | None = _column(detail=True)
    capacity_bytes: int | None = _column(detail=True)
    world_size: int | None = _column(detail=True)
    created_at: float = _column()
    ended_at: float | None = _column()
    heartbeat: float | None = _column()
    last_step: int | None = _column()
    # v8, kept by the ingest: the t span of the run's metric rows (store/reader.py reads them
    # itself: older files, read read-only, have none)
    metrics_t_min: float | None = _column(read=False, default=None)
    metrics_t_max: float | None = _column(read=False, default=None)

    @property
    def running(self) -> bool:
        """Running as stored, and its writer not gone (not stale): a run that can take a ramp."""
        return self.stored_status == "running" and self.status == "running"


@dataclass(frozen=True)
class PlanRow:
    run_id: str = _column(pa.string(), null=False)
    step: int | None = _column(pa.int64())
    t: float = _column(pa.float64(), null=False)
    per_device_batch: int = _column(pa.int64(), null=False)
    variant: str = _column(pa.string(), null=False)
    predicted_bytes: int | None = _column(pa.int64())
    measured_bytes: int | None = _column(pa.int64())
    source: str = _column(pa.string(), null=False)
    feasible: bool | None = _column(pa.bool_())
    breakdown: dict | None = _column(pa.string(), json=True)


@dataclass(frozen=True)
class Event:
    run_id: str = _column(pa.string(), null=False)
    step: int | None = _column(pa.int64())
    t: float = _column(pa.float64(), null=False)
    kind: str = _column(pa.string(), null=False)
    message: str | None = _column(pa.string())
    data: dict | None = _column(pa.string(), json=True)


@dataclass(frozen=True)
class Command:
    command_id: int = _column()
    run_id: str = _column()
    kind: str = _column()
    payload: dict = _column(json=True)  # stored with sorted keys: the idempotency check compares it
    status: str = _column()
    actor: str = _column()
    created_at: float = _column()
    updated_at: float = _column()
    applied_step: int | None = _column()
    reason: str | None = _column()
    # the submit's key (v5; None: none given): written, never read back, so v3-v4 files still read
    idempotency_key: str | None = _column(read=False, default=None)


def json_int(v) -> int | None:
    """An integer field of an event's JSON data as a BIGINT column holds it; None for anything
    else (a bool is not one)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 63 else None


def to_json(obj) -> str | None:
    """A JSON column's text (None stays NULL)."""
    return None if obj is None else json.dumps(obj, ensure_ascii=False)


def from_json(text: str | None):
    """A JSON column's value (NULL stays None)."""
    return None if text is None else json.loads(text)


class Fields:
    """One table's field table, read off its row dataclass (table names: our constants)."""

    def __init__(self, table: str, row: type):
        self.table, self.row = table, row
        cols = [f for f in fields(row) if not f.metadata.get("derived")]
        self._fields = [(f.name, f.metadata["column"] or f.name, f.metadata) for f in cols]
        self.columns = tuple(c for _, c, _ in self._fields)
        self.details = tuple(c for _, c, m in self._fields if m["detail"])
        self._json = {c for _, c, m in self._fields if m["json"]}
        self._read = [(n, c, m) for n, c, m in self._fields if m["read"]]
        self.select = f"SELECT {', '.join(c for _, c, _ in self._read)} FROM {table}"
        self.insert = (
            f"INSERT INTO {table} ({', '.join(self.columns)}) "
            f"VALUES ({', '.join('?' for _ in self.columns)})"
        )

    def params(self, values: dict) -> list:
        """The parameters of `insert` from {column: value} (a column not given is NULL)."""
        return [values.get(c) for c in self.columns]

    def insert_from(self, source: str) -> str:
        """INSERT of every row of a registered Arrow table that has every column but run_id,
        which is the statement's one parameter."""
        rest = ", ".join(c for c in self.columns if c != "run_id")
        return f"INSERT INTO {self.table} (run_id, {rest}) SELECT ?, {rest} FROM {source}"

    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema of a batch of from_record() rows (every column but run_id)."""
        return pa.schema([(c, m["arrow"]) for _, c, m in self._fields if c != "run_id"])

    def from_record(self, r: dict) -> dict:
        """A spooled record's column values but run_id: KeyError if a NOT NULL one is missing,
        JSON columns as text."""
        out = {}
        for _, c, m in self._fields:
            if c != "run_id":
                v = r.get(c) if m["null"] else r[c]
                out[c] = to_json(v) if m["json"] else v
        return out

    def encode(self, column: str, value):
        """A value as the table stores it in `column` (JSON columns as text)."""
        return to_json(value) if column in self._json else value

    def values(self, row) -> dict:
        """The row dataclass's column fields from a row of `select`, JSON columns decoded."""
        return {
            name: from_json(v) if m["json"] else v
            for (name, _, m), v in zip(self._read, row, strict=True)
        }


TRIAL_STATUSES = ("running", "finished", "abandoned")


@dataclass(frozen=True)
class Trial:
    """One ramp trial of a run, as the ingest keeps it from its trial_* events (one row per
    trial_id: the command's id, or a negative id for an auto trial)."""

    run_id: str = _column()
    trial_id: int = _column()
    command_id: int | None = _column()  # the trial command, None for an auto trial
    start_step: int | None = _column()  # the snapshot step S
    status: str = _column()  # TRIAL_STATUSES
    factors: list | None = _column(json=True)  # the branches' batch factors, e.g. [2, 4]
    delta_tokens: int | None = _column()  # tokens each arm trains
    cost_tokens: int | None = _column()  # planned at the start, the discarded tokens at the end
    cost_fraction: float | None = _column()  # of the run's token budget (None: no budget)
    cost_seconds: float | None = _column()  # estimated at the start, measured at the end
    kept_factor: int | None = _column()  # the arm the run continued from (1: the control)
    continue_step: int | None = _column()  # the step the run continued from
    verdict: dict | None = _column(json=True)  # advisor.trial.TrialVerdict.to_dict()
    plan: dict | None = _column(json=True)  # the trial_start event's data
    source: str | None = _column()  # "command 7" / "auto: ..."
    message: str | None = _column()  # the start's cost sentence, then the verdict's summary
    reason: str | None = _column()  # why it was abandoned
    updated_at: float = _column()


RUNS = Fields("runs", Run)
MEMORY_PLAN = Fields("memory_plan", PlanRow)
EVENTS = Fields("events", Event)
COMMANDS = Fields("commands", Command)
TRIALS = Fields("trials", Trial)
