"""Refused writes: the audit rows of writes the dashboard turned down (schema v6).

Owns the `write_refusals` table's rows: when, which run, what was attempted (approve or cancel,
and a short detail), the operator name as typed, the client's address (None where the server
does not know it), and why it was refused. The caller decides what may be recorded; this
module bounds every text (a scripted client chooses them) and never sees a token. Reading
works on older files opened read-only (v3..v5 have no table: no refusals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rampwatch.store import schema
from rampwatch.store.db import DEFAULT_TIMEOUT, read_connection, write_connection

MAX_TEXT = 200  # per field: a refusal row stays small whatever a client sends
LIST_LIMIT = 200  # the newest rows a listing returns
_COLUMNS = "t, run_id, action, detail, operator, client, reason"


@dataclass(frozen=True)
class Refusal:
    t: float  # unix seconds
    run_id: str | None
    action: str  # 'approve' or 'cancel'
    detail: str | None  # what exactly: "ramp to 16 × 2 (batch 32)", "cancel ramp #3"
    operator: str | None  # the name as typed (bounded), or what the caller put instead
    client: str | None  # the client's address, None where unknown (loopback, tests)
    reason: str


def _bounded(text) -> str | None:
    """Printable and at most MAX_TEXT characters: a client's text cannot bloat or garble a row."""
    if text is None:
        return None
    s = "".join(c if c.isprintable() else "\N{REPLACEMENT CHARACTER}" for c in str(text))
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 1] + "…"


def record(
    db,
    *,
    run_id: str | None,
    action: str,
    detail: str | None,
    operator: str | None,
    client: str | None,
    reason: str,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Append one refused write."""
    row = [time.time(), *map(_bounded, (run_id, action, detail, operator, client, reason))]
    with write_connection(db, timeout, create=False) as con:
        with schema.transaction(con):
            con.execute(
                f"INSERT INTO write_refusals ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", row
            )


def _has_table(con, db) -> bool:
    return schema.read_version(con, db) >= schema.REFUSALS_VERSION


def list_refusals(
    db,
    run_id: str | None = None,
    limit: int = LIST_LIMIT,
    timeout: float = DEFAULT_TIMEOUT,
    read_only: bool | None = None,
) -> list[Refusal]:
    """Refused writes (of one run, or all), newest first, at most `limit`."""
    with read_connection(db, timeout, read_only=read_only) as con:
        if not _has_table(con, db):
            return []
        where = "" if run_id is None else "WHERE run_id = $run"
        rows = con.execute(
            f"SELECT {_COLUMNS} FROM write_refusals {where} ORDER BY t DESC LIMIT $limit",
            {"limit": int(limit), **({} if run_id is None else {"run": run_id})},
        ).fetchall()
    return [Refusal(*r) for r in rows]


def refusal_counts(
    db, timeout: float = DEFAULT_TIMEOUT, read_only: bool | None = None
) -> dict[str, int]:
    """{run_id: refused writes} for every run that has any."""
    with read_connection(db, timeout, read_only=read_only) as con:
        if not _has_table(con, db):
            return {}
        rows = con.execute(
            "SELECT run_id, count(*) FROM write_refusals WHERE run_id IS NOT NULL GROUP BY run_id"
        ).fetchall()
    return {r: int(n) for r, n in rows}
