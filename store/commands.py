"""The command queue: the dashboard asks a running trainer to change its batch, the trainer answers.

Owns: payload validation per kind, the legal status changes, the rule of at most one open ramp
per run, and the command log (every change timestamped and attributed to an actor).

Lifecycle: pending → claimed | cancelled | refused; claimed → applied (at a step) | refused
(with a reason). Nothing else. The trainer claims a command synchronously (`claim`: it must
know it owns the command before acting on it), then reports the result either synchronously
(`apply` / `refuse`) or without waiting through its RunWriter (`command_applied` /
`command_refused`, spooled and recorded at the next ingest).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from store.db import DEFAULT_TIMEOUT, first, read_connection, transaction, write_connection
from store.errors import CommandError

KINDS = ("ramp",)
STATUSES = ("pending", "claimed", "applied", "refused", "cancelled")
LEGAL = {"pending": ("claimed", "cancelled", "refused"), "claimed": ("applied", "refused")}
OPEN = ("pending", "claimed")
_RAMP_FIELDS = ("per_device_batch", "accum", "lr_multiplier", "note")

_SELECT = ("SELECT command_id, run_id, kind, payload, status, actor, created_at, updated_at, "
           "applied_step, reason FROM commands")


@dataclass(frozen=True)
class Command:
    command_id: int
    run_id: str
    kind: str
    payload: dict
    status: str
    actor: str
    created_at: float
    updated_at: float
    applied_step: int | None
    reason: str | None


@dataclass(frozen=True)
class LogEntry:
    command_id: int
    t: float
    from_status: str | None
    to_status: str
    actor: str
    detail: str | None


def _command(row) -> Command:
    return Command(int(row[0]), row[1], row[2], json.loads(row[3]), *row[4:])


def _positive_int(payload: dict, key: str) -> int:
    v = payload.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise CommandError(f"ramp payload {key} must be an integer > 0, got {v!r} "
                           f"({type(v).__name__})")
    return v


def validate(kind: str, payload) -> dict:
    """The normalized payload, or CommandError saying what is wrong."""
    if kind not in KINDS:
        raise CommandError(f"unknown command kind {kind!r}; known kinds: {', '.join(KINDS)}")
    if not isinstance(payload, dict):
        raise CommandError(f"ramp payload must be a dict with per_device_batch and accum, got "
                           f"{type(payload).__name__}")
    unknown = sorted(str(k) for k in payload if k not in _RAMP_FIELDS)
    if unknown:
        raise CommandError(f"ramp payload has unknown field(s) {', '.join(map(repr, unknown))}; "
                           f"allowed: {', '.join(_RAMP_FIELDS)}")
    out = {"per_device_batch": _positive_int(payload, "per_device_batch"),
           "accum": _positive_int(payload, "accum")}
    if payload.get("lr_multiplier") is not None:
        m = payload["lr_multiplier"]
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise CommandError(f"ramp payload lr_multiplier must be a finite number > 0, got "
                               f"{m!r}")
        out["lr_multiplier"] = float(m)
    if payload.get("note") is not None:
        if not isinstance(payload["note"], str):
            raise CommandError(f"ramp payload note must be a string, got "
                               f"{type(payload['note']).__name__}")
        out["note"] = payload["note"]
    return out


def _check_actor(actor) -> None:
    if not isinstance(actor, str) or not actor.strip():
        raise CommandError("every command change needs an actor: a non-empty string naming who "
                           "made it (e.g. 'dashboard:alice', 'trainer')")


def transition(con, command_id: int, to: str, actor: str, *, step: int | None = None,
               reason: str | None = None, t: float | None = None) -> None:
    """Change a command's status inside the caller's transaction, or raise CommandError."""
    _check_actor(actor)
    row = first(con.execute("SELECT status FROM commands WHERE command_id = ?", [command_id]))
    if row is None:
        raise CommandError(f"no command #{command_id}")
    frm = row[0]
    if to not in LEGAL.get(frm, ()):
        legal = LEGAL.get(frm)
        raise CommandError(
            f"command #{command_id} is {frm}; it cannot become {to} "
            + (f"(from {frm} only: {', '.join(legal)})" if legal else f"({frm} is final)"))
    if to == "applied" and (isinstance(step, bool) or not isinstance(step, int)):
        raise CommandError(f"applying command #{command_id} needs the step it took effect at")
    if to == "refused" and (not isinstance(reason, str) or not reason.strip()):
        raise CommandError(f"refusing command #{command_id} needs a reason")
    t = time.time() if t is None else t
    con.execute("UPDATE commands SET status = ?, updated_at = ?, applied_step = ?, reason = ? "
                "WHERE command_id = ?",
                [to, t, step if to == "applied" else None, reason, command_id])
    detail = (f"at step {step}" if to == "applied" else reason)
    con.execute("INSERT INTO command_log VALUES (?, ?, ?, ?, ?, ?)",
                [command_id, t, frm, to, actor, detail])


def pending(con, run_id: str) -> list[Command]:
    rows = con.execute(_SELECT + " WHERE run_id = ? AND status = 'pending' ORDER BY command_id",
                       [run_id]).fetchall()
    return [_command(r) for r in rows]


def refuse_open(con, run_id: str, reason: str, actor: str) -> int:
    """Refuse every pending or claimed command of a run (it died); returns how many."""
    ids = [r[0] for r in con.execute(
        "SELECT command_id FROM commands WHERE run_id = ? AND status IN ('pending', 'claimed')",
        [run_id]).fetchall()]
    for cid in ids:
        transition(con, cid, "refused", actor, reason=reason)
    return len(ids)


def submit(db, run_id: str, kind: str, payload, actor: str,
           timeout: float = DEFAULT_TIMEOUT) -> int:
    """Queue a command for a running run; returns its id. Dead writers are recovered first."""
    from store.recovery import recover_dead  # late: recovery → ingest → this module
    payload = validate(kind, payload)
    _check_actor(actor)
    with write_connection(db, timeout) as con:
        recover_dead(con, db)
        with transaction(con):
            row = first(con.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]))
            if row is None:
                raise CommandError(f"no run {run_id!r} in {db}; commands go to existing runs")
            if row[0] != "running":
                raise CommandError(f"run {run_id!r} is {row[0]}, not running; commands go only "
                                   "to running runs")
            if kind == "ramp":
                open_ = first(con.execute(
                    "SELECT command_id, status FROM commands WHERE run_id = ? AND kind = 'ramp' "
                    "AND status IN ('pending', 'claimed') ORDER BY command_id LIMIT 1",
                    [run_id]))
                if open_ is not None:
                    raise CommandError(
                        f"run {run_id!r} already has ramp command #{open_[0]} {open_[1]}; cancel "
                        "it or wait until it is applied or refused before submitting another")
            [(cid,)] = con.execute("SELECT nextval('command_ids')").fetchall()
            now = time.time()
            con.execute("INSERT INTO commands VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, NULL, NULL)",
                        [cid, run_id, kind, json.dumps(payload, sort_keys=True), actor, now, now])
            con.execute("INSERT INTO command_log VALUES (?, ?, NULL, 'pending', ?, ?)",
                        [cid, now, actor, "submitted"])
    return int(cid)


def _change(db, command_id: int, to: str, actor: str, timeout: float, **kw) -> Command:
    with write_connection(db, timeout) as con:
        with transaction(con):
            transition(con, command_id, to, actor, **kw)
        return _command(first(con.execute(_SELECT + " WHERE command_id = ?", [command_id])))


def claim(db, command_id: int, actor: str, timeout: float = DEFAULT_TIMEOUT) -> Command:
    """pending → claimed; raises CommandError if someone cancelled or refused it meanwhile."""
    return _change(db, command_id, "claimed", actor, timeout)


def apply(db, command_id: int, step: int, actor: str, timeout: float = DEFAULT_TIMEOUT) -> Command:
    """claimed → applied at `step`."""
    return _change(db, command_id, "applied", actor, timeout, step=step)


def refuse(db, command_id: int, reason: str, actor: str,
           timeout: float = DEFAULT_TIMEOUT) -> Command:
    """pending or claimed → refused, with the reason shown to the operator."""
    return _change(db, command_id, "refused", actor, timeout, reason=reason)


def cancel(db, command_id: int, actor: str, timeout: float = DEFAULT_TIMEOUT) -> Command:
    """pending → cancelled (a claimed command is already being acted on: it cannot be)."""
    return _change(db, command_id, "cancelled", actor, timeout)


def list_commands(db, run_id: str | None = None, status: str | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> list[Command]:
    """Commands, oldest first, optionally of one run and/or one status."""
    with read_connection(db, timeout) as con:
        rows = con.execute(_SELECT + " WHERE (?::VARCHAR IS NULL OR run_id = ?) AND "
                           "(?::VARCHAR IS NULL OR status = ?) ORDER BY command_id",
                           [run_id, run_id, status, status]).fetchall()
    return [_command(r) for r in rows]


def get(db, command_id: int, timeout: float = DEFAULT_TIMEOUT) -> Command:
    with read_connection(db, timeout) as con:
        row = first(con.execute(_SELECT + " WHERE command_id = ?", [command_id]))
    if row is None:
        raise CommandError(f"no command #{command_id} in {db}")
    return _command(row)


def log(db, command_id: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[LogEntry]:
    """Every status change (of one command, or all), in order."""
    with read_connection(db, timeout) as con:
        rows = con.execute("SELECT * FROM command_log WHERE (?::BIGINT IS NULL OR command_id = ?) "
                           "ORDER BY t, rowid", [command_id, command_id]).fetchall()
    return [LogEntry(int(r[0]), *r[1:]) for r in rows]


__all__ = ["Command", "LogEntry", "CommandError", "submit", "claim", "apply",
           "refuse", "cancel", "list_commands", "get", "log", "validate", "KINDS", "STATUSES"]
