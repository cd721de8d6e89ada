"""The command queue: the dashboard asks a running trainer to change its batch, the trainer answers.

Owns the queue's API: each call opens its own connection under the store's lock and closes it,
and submit first recovers dead writers (a dead writer's run is marked killed, so a command to
it is refused). The rules the calls enforce, and the rows they read and write, are
store/command_rows.py: validation, the tier rule, idempotency keys, the legal status changes,
one open ramp or trial per run, the command log.

Lifecycle: pending → claimed | cancelled | refused; claimed → applied (at a step) | refused
(with a reason); applied → undone (a resume from an earlier step discarded it). Nothing else.
The trainer never waits on the database for them: its RunWriter's flusher claims the run's
pending commands at its visits (`claim_pending`, handed over by take_claimed_commands) and
the results go through the spool (`command_applied` / `command_refused`, recorded at the next
ingest). `claim`, `apply` and `refuse` are the same changes made synchronously, each in its
own connection: for tools, and for tests that put a command in a given state (tests/seed.py).
"""

from __future__ import annotations

from rampwatch.store import command_rows as rows
from rampwatch.store.command_rows import (
    KINDS,
    MAX_ACCUM,
    MAX_DELTA_TOKENS,
    MAX_LR_MULTIPLIER,
    MAX_NOTE,
    MAX_PER_DEVICE_BATCH,
    RAMP_MAX_FACTOR,
    STATUSES,
    Command,
    LogEntry,
    as_command_id,
    claim_pending,
    ramp_refusal,
    trial_refusal,
    validate,
)
from rampwatch.store.db import DEFAULT_TIMEOUT, read_connection, write_connection
from rampwatch.store.errors import CommandError
from rampwatch.store.recovery import recover_dead
from rampwatch.store.schema import transaction


def submit(
    db,
    run_id: str,
    kind: str,
    payload,
    actor: str,
    timeout: float = DEFAULT_TIMEOUT,
    key: str | None = None,
) -> int:
    """Queue a command for a running run; returns its id. Dead writers are recovered first.

    key: an idempotency key (say, a UUID the dashboard made when it drew the button). A second
    submit with the same key returns the first command's id and adds nothing, whatever became
    of that command since; the same key with a different command is a CommandError.
    """
    payload = validate(kind, payload)
    rows.check_actor(actor)
    rows.check_key(key)
    with write_connection(db, timeout, create=False) as con:
        recover_dead(con, db)
        with transaction(con):
            return rows.queue(con, db, run_id, kind, payload, actor, key)


def _change(db, command_id: int, to: str, actor: str, timeout: float, **kw) -> Command:
    command_id = as_command_id(command_id)
    with write_connection(db, timeout, create=False) as con:
        with transaction(con):
            rows.transition(con, command_id, to, actor, **kw)
        return rows.find(con, command_id)


def claim(db, command_id: int, actor: str, timeout: float = DEFAULT_TIMEOUT) -> Command:
    """pending → claimed; raises CommandError if someone cancelled or refused it meanwhile."""
    return _change(db, command_id, "claimed", actor, timeout)


def apply(db, command_id: int, step: int, actor: str, timeout: float = DEFAULT_TIMEOUT) -> Command:
    """claimed → applied at `step`."""
    return _change(db, command_id, "applied", actor, timeout, step=step)


def refuse(
    db, command_id: int, reason: str, actor: str, timeout: float = DEFAULT_TIMEOUT
) -> Command:
    """pending or claimed → refused, with the reason shown to the operator."""
    return _change(db, command_id, "refused", actor, timeout, reason=reason)


def cancel(db, command_id: int, actor: str, timeout: float = DEFAULT_TIMEOUT) -> Command:
    """pending → cancelled (a claimed command is already being acted on: it cannot be)."""
    return _change(db, command_id, "cancelled", actor, timeout)


def list_commands(
    db, run_id: str | None = None, status: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> list[Command]:
    """Commands, oldest first, optionally of one run and/or one status."""
    with read_connection(db, timeout) as con:
        return rows.matching(con, run_id, status)


def get(db, command_id: int, timeout: float = DEFAULT_TIMEOUT) -> Command:
    command_id = as_command_id(command_id)
    with read_connection(db, timeout) as con:
        cmd = rows.find(con, command_id)
    if cmd is None:
        raise CommandError(f"no command #{command_id} in {db}")
    return cmd


def log(db, command_id: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[LogEntry]:
    """Every status change (of one command, or all), in order."""
    if command_id is not None:
        command_id = as_command_id(command_id)
    with read_connection(db, timeout) as con:
        return rows.log_entries(con, command_id)


__all__ = [
    "Command",
    "LogEntry",
    "CommandError",
    "submit",
    "claim",
    "apply",
    "refuse",
    "cancel",
    "list_commands",
    "get",
    "log",
    "validate",
    "as_command_id",
    "claim_pending",
    "ramp_refusal",
    "trial_refusal",
    "KINDS",
    "STATUSES",
    "MAX_PER_DEVICE_BATCH",
    "MAX_ACCUM",
    "MAX_LR_MULTIPLIER",
    "MAX_DELTA_TOKENS",
    "MAX_NOTE",
    "RAMP_MAX_FACTOR",
]
