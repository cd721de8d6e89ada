"""Moving one spool's new records into DuckDB, exactly once, in one transaction.

Owns ingest: read the spool offsets stored in the database, take the whole records after them
(JSON-lines first: a run's start or resume must precede its metrics), insert metrics through
Arrow (never executemany, never pandas, which would turn NaN into NULL), fold them into the
rollup, update the run's heartbeat, last step and the t span of its metric rows, keep the trials table from the trial_* events
(one row per trial, updated in place: replaying an event changes nothing), and store the new
offsets, all in the same transaction. A crash anywhere leaves the old offsets and no rows, so the next ingest of the
spool (by the writer or by recovery) redoes exactly the missing part.

Those offsets are all that stands between a spool and duplicate rows, so they are checked, not
trusted: the offsets row is unique (schema v4's primary key), a live writer passes the offsets
it committed last and an ingest that reads older ones (or none) refuses instead of ingesting
again, and the UPDATE must change exactly the row that was read, with the offsets that were
read (compare-and-set). Any of these failing rolls the transaction back (SpoolOffsetsError).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from rampwatch.store import command_rows, rollup, spool
from rampwatch.store import names as M
from rampwatch.store import spool_format as fmt
from rampwatch.store.errors import CommandError, SpoolOffsetsError
from rampwatch.store.schema import (
    EVENTS,
    MEMORY_PLAN,
    RUNS,
    TRIALS,
    first,
    json_int,
    to_json,
    transaction,
)

MAX_RECORDS = 1 << 18  # per transaction (8 MB of spool, ~0.1 s): bounds lock hold and memory
ENDINGS = ("killed", "failed")  # event kinds of a run's end: a resume purge keeps them

_EVENT_SCHEMA = EVENTS.arrow_schema()
_PLAN_SCHEMA = MEMORY_PLAN.arrow_schema()
_SET_DETAILS = (  # a run update: None keeps a detail
    f"UPDATE runs SET {', '.join(f'{c} = coalesce(?, {c})' for c in RUNS.details)} WHERE run_id = ?"
)


@dataclass
class IngestResult:
    run_id: str | None
    records: int = 0  # metric rows inserted
    json_records: int = 0  # rare records applied
    max_step: int | None = None
    max_t: float | None = None
    more: bool = False  # the per-transaction cap was hit: call again
    bin_offset: int = 0  # offsets reached (committed with the rows)
    jsonl_offset: int = 0
    stored: bool = False  # the spool's offsets row holds (bin_offset, jsonl_offset) now
    damaged_bytes: int = 0  # stepped over in the records and rare-records files
    lost_records: int = 0  # metric records lost to damage (estimated from the bytes) or names
    torn_bytes: int = 0  # a dead writer's cut-short last write, never acknowledged
    unusable: int = 0  # records that passed their check but could not be applied

    @property
    def damaged(self) -> bool:
        """Something was stepped over: the spool must be kept for inspection, not deleted."""
        return bool(self.damaged_bytes or self.lost_records or self.unusable)


def _resume_message(s: int, purged: dict) -> str:
    """The resume event's line: what the purge discarded, kept and undid."""
    kinds = purged["deleted_event_kinds"]
    events = f"{purged['deleted_events']} events" + (
        " (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")" if kinds else ""
    )
    parts = [
        f"resumed from step {s}; discarded what came after it: "
        f"{purged['deleted_metric_rows']} metric rows and {events}"
    ]
    parts += [f"ramp #{cid} undone" for cid in purged["undone_commands"]]
    parts += [f"trial {tid} abandoned" for tid in purged["abandoned_trials"]]
    parts += [
        f"kept the {e['kind']} event of step {e['step']} (shown at step {s})"
        for e in purged["kept_events"]
    ]
    return "; ".join(parts)


class _Apply:
    """Applies rare records of one spool inside the open transaction; collects row inserts."""

    def __init__(self, con, run_id: str | None):
        self.con, self.run_id = con, run_id
        self.events: list[dict] = []
        self.plans: list[dict] = []
        self.pid = self.host = None
        self.unusable: list[str] = []  # records that passed their check but cannot be applied

    def record(self, r) -> None:
        kind = r.get("k") if isinstance(r, dict) else None
        handler = getattr(self, "_" + kind, None) if isinstance(kind, str) else None
        if handler is None:
            self.unusable.append(f"unknown record kind {kind!r}")
            return
        try:  # fields are read before any SQL runs, so a bad record changes nothing
            handler(r)
        except (KeyError, TypeError, ValueError) as e:
            self.unusable.append(f"{kind} record without a usable {e}")

    def _start(self, r: dict) -> None:
        con, run_id = self.con, r["run_id"]
        self.run_id, self.pid, self.host = run_id, r.get("pid"), r.get("host")
        row = first(con.execute("SELECT status, last_step FROM runs WHERE run_id = ?", [run_id]))
        if row is None:
            new = {
                **self._details(r),
                "run_id": run_id,
                "status": "running",
                "created_at": r["t"],
                "heartbeat": r["t"],
                "last_step": r.get("resume_step"),
            }
            con.execute(RUNS.insert, RUNS.params(new))  # the rest: NULL
        self._run_fields(r)
        s = r.get("resume_step")
        if s is None:
            return
        prev_status, prev_last = row if row is not None else (None, None)
        purged = self._purge_after(run_id, s, prev_status)
        con.execute(
            "UPDATE runs SET status = 'running', ended_at = NULL, last_step = ?, "
            "heartbeat = ? WHERE run_id = ?",
            [s, r["t"], run_id],
        )
        self.events.append(
            dict(
                step=s,
                t=r["t"],
                kind="resume",
                message=_resume_message(s, purged),
                data=to_json(
                    {
                        "resume_step": s,
                        "purge_step": s + 1,
                        **purged,
                        "previous_status": prev_status,
                        "previous_last_step": prev_last,
                    }
                ),
            )
        )

    def _purge_after(self, run_id: str, s: int, prev_status: str | None) -> dict:
        """Resume from step s (TensorBoard's purge_step = s + 1): drop the discarded future of
        the run (its metrics and events after s), but keep how its last life ended (a killed or
        failed event), moved to step s with its own step in data: the marker then sits where the
        kept history stops rather than inside the new one. Commands applied after s are undone,
        so no command says 'applied' for a ramp the resumed run does not carry. Returns what the
        resume event reports."""
        con = self.con
        [(n_metrics,)] = con.execute(
            "DELETE FROM metrics WHERE run_id = ? AND step > ?", [run_id, s]
        ).fetchall()
        later = con.execute(
            f"{EVENTS.select} WHERE run_id = ? AND step > ? ORDER BY step, t", [run_id, s]
        ).fetchall()
        con.execute("DELETE FROM events WHERE run_id = ? AND step > ?", [run_id, s])
        kept, discarded = [], {}
        for ev in map(EVENTS.values, later):
            kind, step, old = ev["kind"], ev["step"], ev["data"]
            if kind not in ENDINGS:
                discarded[kind] = discarded.get(kind, 0) + 1
                continue
            moved = {**(old if isinstance(old, dict) else {}), "original_step": step}
            self.events.append(EVENTS.from_record({**ev, "step": s, "data": moved}))
            kept.append({"kind": kind, "step": step})
        rollup.truncate(con, run_id, s)
        cause = "crash" if prev_status in ENDINGS else "resume"
        undone = command_rows.undo_after(con, run_id, s, cause, "resume")
        return {
            "abandoned_trials": _abandon_trials_after(con, run_id, s),
            "deleted_metric_rows": n_metrics,
            "deleted_events": sum(discarded.values()),
            "deleted_event_kinds": discarded,
            "kept_events": kept,
            "undone_commands": undone,
        }

    def _segment(self, r: dict) -> None:
        # The first record of a spool the writer rotated to: the run already exists.
        self.run_id, self.pid, self.host = r["run_id"], r.get("pid"), r.get("host")

    def _run(self, r: dict) -> None:
        self._run_fields(r)

    @staticmethod
    def _details(r: dict) -> dict:
        """The run details a start or run record carries (None where it says nothing)."""
        return {c: RUNS.encode(c, r.get(c)) for c in RUNS.details}

    def _run_fields(self, r: dict) -> None:
        self.con.execute(_SET_DETAILS, [*self._details(r).values(), r["run_id"]])

    def _event(self, r: dict) -> None:
        self.events.append(EVENTS.from_record(r))
        if r.get("kind") in _TRIAL_COLUMNS:
            problem = _trial_row(self.con, self.run_id, r)
            if problem:  # the event is kept; the trial it names cannot be recorded
                self.unusable.append(problem)

    def _plan(self, r: dict) -> None:
        self.plans.append(MEMORY_PLAN.from_record(r))

    def _status(self, r: dict) -> None:
        ended = r["t"] if r["status"] != "running" else None
        self.con.execute(
            "UPDATE runs SET status = ?, ended_at = ? WHERE run_id = ?",
            [r["status"], ended, self.run_id],
        )
        if r.get("message"):
            self.events.append(EVENTS.from_record({**r, "kind": r["status"], "data": None}))

    def _cmd(self, r: dict) -> None:
        # The trainer resolved a command it had claimed; the writer spooled it so the training
        # loop never waits. An illegal change becomes a visible error event, not a crash.
        try:
            command_rows.transition(
                self.con,
                r["command_id"],
                r["to"],
                r["actor"],
                step=r.get("step"),
                reason=r.get("reason"),
                t=r["t"],
            )
        except CommandError as e:
            message = f"command result not recorded: {e}"
            self.events.append(
                EVENTS.from_record(
                    dict(step=r.get("step"), t=r["t"], kind="error", message=message)
                )
            )

    def flush_rows(self) -> None:
        con = self.con
        if self.events:
            con.register("rw_events", pa.Table.from_pylist(self.events, schema=_EVENT_SCHEMA))
            try:
                con.execute(EVENTS.insert_from("rw_events"), [self.run_id])
            finally:
                con.unregister("rw_events")
        if self.plans:
            con.register("rw_plans", pa.Table.from_pylist(self.plans, schema=_PLAN_SCHEMA))
            try:
                con.execute(MEMORY_PLAN.insert_from("rw_plans"), [self.run_id])
            finally:
                con.unregister("rw_plans")


# ---- trials: the table's row of each trial, from its events (store/names.py's contract) -----
# Event kind -> (status it sets, {column: key in the event's data}).
_TRIAL_COLUMNS = {
    M.EVENT_TRIAL_START: (
        "running",
        {
            "command_id": "command_id",
            "factors": "factors",
            "delta_tokens": "delta_tokens",
            "cost_tokens": "cost_tokens",
            "cost_fraction": "cost_fraction",
            "cost_seconds": "cost_seconds",
            "source": "source",
        },
    ),
    M.EVENT_TRIAL_END: (
        "finished",
        {
            "kept_factor": "kept_factor",
            "continue_step": "continue_step",
            "cost_tokens": "cost_tokens",
            "cost_seconds": "cost_seconds",
            "verdict": "verdict",
        },
    ),
    M.EVENT_TRIAL_ABANDONED: ("abandoned", {"reason": "reason"}),
}
_INT_COLUMNS = {"command_id", "delta_tokens", "cost_tokens", "kept_factor", "continue_step"}
_NUMBER_COLUMNS = {"cost_fraction", "cost_seconds"}
_TEXT_COLUMNS = {"source", "reason"}


def _as_column(column: str, v):
    """A loop's value as the trials table stores it; None for one of the wrong type, so a bad
    field never fails the ingest's transaction (and with it every record after it)."""
    if column in _INT_COLUMNS:
        return json_int(v)
    if column in _NUMBER_COLUMNS:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok else None
    if column in _TEXT_COLUMNS:
        return v if isinstance(v, str) else None
    if column == "factors":
        ok = isinstance(v, list) and all(json_int(k) is not None for k in v)
        return TRIALS.encode(column, v) if ok else None
    return TRIALS.encode(column, v if isinstance(v, dict) else None)  # verdict


def _trial_row(con, run_id: str, r: dict) -> str | None:
    """Create or update the trial an event names; why not, or None. An update sets only what the
    event carries, so applying an event twice leaves the row as once."""
    kind, data = r["kind"], r.get("data")
    trial_id = json_int(data.get("trial_id")) if isinstance(data, dict) else None
    if trial_id is None:
        return f"{kind} event without an integer trial_id"
    status, columns = _TRIAL_COLUMNS[kind]
    values = {c: _as_column(c, data.get(key)) for c, key in columns.items()}
    values.update(status=status, updated_at=r["t"])
    if r.get("message"):
        values["message"] = str(r["message"])
    if kind == M.EVENT_TRIAL_START:
        values.update(start_step=json_int(r.get("step")), plan=TRIALS.encode("plan", data))
    exists = first(
        con.execute("SELECT 1 FROM trials WHERE run_id = ? AND trial_id = ?", [run_id, trial_id])
    )
    if exists is None:
        con.execute(
            TRIALS.insert, TRIALS.params({**values, "run_id": run_id, "trial_id": trial_id})
        )
    else:  # column names: the table's own, never input
        sets = ", ".join(f"{c} = ?" for c in values)
        con.execute(
            f"UPDATE trials SET {sets} WHERE run_id = ? AND trial_id = ?",
            [*values.values(), run_id, trial_id],
        )
    return None


def _abandon_trials_after(con, run_id: str, s: int) -> list[int]:
    """A resume from step s: trials that started after s are gone with their events; one still
    running, or one whose run continued after s, is abandoned (its kept arm is not in effect)."""
    con.execute("DELETE FROM trials WHERE run_id = ? AND start_step > ?", [run_id, s])
    rows = con.execute(
        "SELECT trial_id, status, continue_step FROM trials WHERE run_id = ? AND "
        "(status = 'running' OR (status = 'finished' AND continue_step > ?)) ORDER BY trial_id",
        [run_id, s],
    ).fetchall()
    for trial_id, status, cont in rows:
        reason = (
            f"the run stopped mid-trial and resumed from step {s}"
            if status == "running"
            else f"the run resumed from step {s}, before step {cont} where the trial ended: "
            "its kept arm is not in effect"
        )
        con.execute(
            "UPDATE trials SET status = 'abandoned', reason = ?, updated_at = ? "
            "WHERE run_id = ? AND trial_id = ?",
            [reason, time.time(), run_id, trial_id],
        )
    return [int(t) for t, _, _ in rows]


def _insert_metrics(con, run_id: str, recs: np.ndarray, names: list[str]) -> None:
    ids = np.ascontiguousarray(recs["name_id"])
    step, value = np.ascontiguousarray(recs["step"]), np.ascontiguousarray(recs["value"])
    table = pa.table(
        {
            "step": step,
            "t": np.ascontiguousarray(recs["t"]),
            # A dictionary column: the names list is shared, not repeated per row.
            "name": pa.DictionaryArray.from_arrays(pa.array(ids), pa.array(names, pa.string())),
            "value": value,
        }
    )
    con.register("rw_batch", table)
    try:
        con.execute(
            "INSERT INTO metrics (run_id, step, t, name, value) "
            "SELECT ?, step, t, name, value FROM rw_batch",
            [run_id],
        )
    finally:
        con.unregister("rw_batch")
    rollup.add_batch(con, run_id, step, value, ids, names)


def _check_expected(path: Path, row, expect: tuple[int, int] | None) -> None:
    if expect is None:
        return
    stored = None if row is None else (int(row[1]), int(row[2]))
    if stored is None or stored[0] < expect[0] or stored[1] < expect[1]:
        raise SpoolOffsetsError(
            f"spool {path.name}: its stored offsets (bin, jsonl) are "
            f"{'missing' if stored is None else stored}, behind the {expect} this writer "
            "committed before: the database lost an update or returned a stale row. Nothing "
            "was ingested (that would insert rows a second time); the records wait in "
            f"{path}.",
            path.name,
        )


def _names_for(path: Path, recs: np.ndarray, offs: np.ndarray, final: bool):
    """(records whose name is known, the list for their ids, records lost, offset to stop at).

    A name is written whole before the first record that uses it, so an id without a name means
    a names line that is still being written (its tail is torn: wait, unless final) or one that
    was damaged (its records are lost, and counted).
    """
    names, _, torn = spool.read_names(path)
    ids = recs["name_id"]
    top = max(names) if names else -1
    have = np.zeros(top + 2, bool)
    have[list(names)] = True
    known = have[np.clip(ids, -1, top + 1)] & (ids >= 0)  # ids < 0 and > top map to False
    table = [names.get(i, "") for i in range(top + 1)]
    if known.all():
        return recs, table, 0, None
    if torn and not final:  # wait at the first record whose name may be on its way
        cut = int(np.argmin(known))
        return recs[:cut], table, 0, int(offs[cut])
    return recs[known], table, int((~known).sum()), None


def _alert(
    result: IngestResult,
    path: Path,
    bin_damage: fmt.Damage,
    js_damage: fmt.Damage,
    lost_names: int,
    unusable: list[str],
    t: float,
) -> dict:
    about = bin_damage.records
    parts = []
    if bin_damage:
        parts.append(
            f"{bin_damage.nbytes} damaged bytes of metric records skipped (about {about} records)"
        )
    if lost_names:
        parts.append(f"{lost_names} metric records whose name line was damaged")
    if js_damage:
        parts.append(
            f"{js_damage.lines} damaged event/command lines ({js_damage.nbytes} bytes) skipped"
        )
    if unusable:
        parts.append(f"{len(unusable)} records that cannot be applied ({unusable[0]})")
    message = (
        f"spool {path.name} was damaged: " + "; ".join(parts) + ". Every record that "
        "passed its check was kept; the damaged spool is kept for inspection."
    )
    data = {
        "spool": path.name,
        "damaged_bytes": bin_damage.nbytes + js_damage.nbytes,
        "lost_metric_records": about + lost_names,
        "damaged_metric_bytes": bin_damage.nbytes,
        "metric_ranges": bin_damage.ranges,
        "lost_name_records": lost_names,
        "damaged_lines": js_damage.lines,
        "line_ranges": js_damage.ranges,
        "unusable_records": len(unusable),
    }
    return EVENTS.from_record(
        dict(step=result.max_step, t=t, kind="alert", message=message, data=data)
    )


def ingest_spool(
    con,
    path: Path,
    *,
    heartbeat: float | None = None,
    max_records: int = MAX_RECORDS,
    expect: tuple[int, int] | None = None,
    final: bool = False,
) -> IngestResult:
    """Ingest what `path` (one spool directory) holds beyond its stored offsets; one transaction.

    heartbeat: the live writer passes the time to record as the run's heartbeat; recovery
    passes None (a dead writer has no heartbeat).
    expect: the (bin, jsonl) offsets the caller itself committed for this spool last (the live
    writer); stored offsets behind them, or none, raise SpoolOffsetsError instead of ingesting.
    final: nothing will be appended any more (a dead writer's spool, or the writer's own after
    its last record): torn tails are judged instead of waited for.
    """
    name = path.name
    with transaction(con):
        row = first(
            con.execute(
                "SELECT run_id, bin_offset, jsonl_offset, count(*) OVER () "
                "FROM spool_offsets WHERE spool = ?",
                [name],
            )
        )
        if row is not None:
            if row[3] != 1:  # the primary key forbids it; never pick one row by chance
                raise SpoolOffsetsError(f"spool {name} has {row[3]} offsets rows", name)
            row = row[:3]
        _check_expected(path, row, expect)
        run_id, bin_off, js_off = row if row is not None else (None, 0, 0)
        records, js_new, js_damage = spool.read_json_records(path, js_off, final=final)
        apply = _Apply(con, run_id)
        for r in records:
            apply.record(r)
        run_id = apply.run_id
        result = IngestResult(
            run_id, json_records=len(records), bin_offset=bin_off, jsonl_offset=js_new
        )
        if run_id is None:  # not even a start record yet: the writer died while creating it
            result.jsonl_offset = js_off  # nothing is stored
            result.damaged_bytes = js_damage.nbytes
            return result
        recs, offs, bin_new, bin_damage, more = spool.read_records(
            path, bin_off, max_records, final
        )
        lost_names = 0
        if len(recs):
            recs, names, lost_names, stop = _names_for(path, recs, offs, final)
            if stop is not None:
                bin_new, more = stop, False
        result.more = more
        result.bin_offset = bin_new
        if len(recs):
            _insert_metrics(con, run_id, recs, names)
            result.records = len(recs)
            result.max_step = int(recs["step"].max())
            result.max_t = float(recs["t"].max())
        result.damaged_bytes = bin_damage.nbytes + js_damage.nbytes
        result.lost_records = bin_damage.records + lost_names
        result.torn_bytes = bin_damage.torn + js_damage.torn
        result.unusable = len(apply.unusable)
        if bin_damage or js_damage or lost_names or apply.unusable:
            apply.events.append(
                _alert(result, path, bin_damage, js_damage, lost_names, apply.unusable, time.time())
            )
        apply.flush_rows()
        t_min = float(recs["t"].min()) if len(recs) else None
        # least/greatest skip NULLs: a visit without metric rows keeps the span
        con.execute(
            """UPDATE runs SET last_step = CASE WHEN ?::BIGINT IS NULL THEN last_step
                                   ELSE greatest(coalesce(last_step, ?::BIGINT), ?::BIGINT) END,
                               heartbeat = coalesce(?, heartbeat),
                               metrics_t_min = least(metrics_t_min, ?::DOUBLE),
                               metrics_t_max = greatest(metrics_t_max, ?::DOUBLE)
               WHERE run_id = ?""",
            [
                result.max_step,
                result.max_step,
                result.max_step,
                heartbeat,
                t_min,
                result.max_t,
                run_id,
            ],
        )
        now = time.time()
        if row is None:  # a second row for the spool fails here: primary key
            con.execute(
                "INSERT INTO spool_offsets VALUES (?, ?, ?, ?, ?, ?, ?)",
                [name, run_id, bin_new, js_new, apply.pid, apply.host, now],
            )
        elif bin_new != bin_off or js_new != js_off:
            # Compare-and-set: exactly the row read above, still at the offsets read above.
            [(changed,)] = con.execute(
                "UPDATE spool_offsets SET bin_offset = ?, jsonl_offset = ?, updated_at = ? "
                "WHERE spool = ? AND bin_offset = ? AND jsonl_offset = ?",
                [bin_new, js_new, now, name, bin_off, js_off],
            ).fetchall()
            if changed != 1:
                raise SpoolOffsetsError(
                    f"spool {name}: storing offsets ({bin_new}, {js_new}) changed {changed} "
                    f"rows, not the one row read at ({bin_off}, {js_off}); rolled back so that "
                    "nothing is ingested twice",
                    name,
                )
        result.stored = True
    return result


def apply_records(con, run_id: str, records: list[dict]) -> list[str]:
    """Apply rare records straight to the database, in one transaction (the writer's outbox:
    records its spool could not take). Returns the reasons of records that could not be used."""
    with transaction(con):
        apply = _Apply(con, run_id)
        for r in records:
            apply.record(r)
        apply.flush_rows()
    return apply.unusable
