"""The command queue's rows and rules, inside a connection (and transaction) the caller holds.

Owns: payload validation per kind (every field bounded: a command is an instruction to a
training run, so a typo must not become a 10^9 accumulation or a 1e300 learning rate), the
tier rule (a ramp moves the effective batch at most advisor/tiers.py's RAMP_MAX_FACTOR up per
command and never below the run's starting tier, where the store knows them), idempotency
keys (a double click or a replayed request makes one command), the legal status changes, the
rule of at most one open ramp or trial per run (a trial ends in a ramp: the two never overlap),
the trial payload (factors, delta_tokens, note) and which runs take trials, undoing the ramps a resume discarded, the command log
(every change timestamped and attributed to an actor), and the SQL that reads and writes the
commands and command_log tables.

Nothing here opens a connection or recovers dead writers: that is the API (store/commands.py).
So ingest (a spooled command result), recovery (a dead run's open commands are refused) and the
writer's flusher (claim_pending) change commands inside their own transactions by importing
this module alone, which imports only leaf modules of the store (and advisor/tiers.py: what a
tier is, and how far one ramp may grow it, has one home).
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import time
from dataclasses import dataclass

from rampwatch.advisor.tiers import RAMP_MAX_FACTOR, Tier
from rampwatch.store import names as M
from rampwatch.store.errors import CommandError
from rampwatch.store.schema import COMMANDS, ROLLUP_LEVELS, Command, first, transaction

KINDS = ("ramp", "trial")
STATUSES = ("pending", "claimed", "applied", "refused", "cancelled", "undone")
# applied -> undone: a resume from a step before the one it was applied at discarded it
LEGAL = {
    "pending": ("claimed", "cancelled", "refused"),
    "claimed": ("applied", "refused"),
    "applied": ("undone",),
}
OPEN = ("pending", "claimed")
_RAMP_FIELDS = (*Tier.PAYLOAD, "lr_multiplier", "note")
MAX_PER_DEVICE_BATCH = 1 << 20  # sequences per micro-batch
MAX_ACCUM = 4096  # micro-batches per optimizer step
MAX_LR_MULTIPLIER = 64.0  # more is a typo or a unit mistake, never a ramp
MAX_NOTE = 1000  # characters
MAX_KEY = 200
MAX_DELTA_TOKENS = 10**12  # tokens per trial arm: more is a unit mistake, never a trial
_TRIAL_FIELDS = ("factors", "delta_tokens", "note")
_EXCLUSIVE = ("ramp", "trial")  # at most one open command of these kinds per run


@dataclass(frozen=True)
class LogEntry:
    command_id: int
    t: float
    from_status: str | None
    to_status: str
    actor: str
    detail: str | None


def _command(row) -> Command:
    return Command(**COMMANDS.values(row))


def _bounded_int(payload: dict, key: str, hi: int) -> int:
    v = payload.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise CommandError(
            f"ramp payload {key} must be an integer in 1 .. {hi}, got "
            f"{_short(v)} ({type(v).__name__})"
        )
    return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:40] + f"… ({len(text)} characters)"


def _lr_multiplier(m) -> float:
    ok = not isinstance(m, bool) and isinstance(m, (int, float))
    if ok and isinstance(m, float):
        ok = math.isfinite(m)
    if not ok or not 0 < m <= MAX_LR_MULTIPLIER:  # an int compares without float overflow
        raise CommandError(
            f"ramp payload lr_multiplier must be a finite number in (0, "
            f"{MAX_LR_MULTIPLIER:g}], got {_short(m)} ({type(m).__name__})"
        )
    return float(m)


def _note(kind: str, payload: dict) -> str | None:
    note = payload.get("note")
    if note is None:
        return None
    if not isinstance(note, str):
        raise CommandError(f"{kind} payload note must be a string, got {type(note).__name__}")
    if len(note) > MAX_NOTE:
        raise CommandError(
            f"{kind} payload note must be at most {MAX_NOTE} characters, got "
            f"{len(note)}; shorten it"
        )
    return note


def _known_fields(kind: str, payload, allowed: tuple[str, ...], example: str) -> None:
    if not isinstance(payload, dict):
        raise CommandError(
            f"{kind} payload must be a dict with {example}, got {type(payload).__name__}"
        )
    unknown = sorted(str(k) for k in payload if k not in allowed)
    if unknown:
        raise CommandError(
            f"{kind} payload has unknown field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)}"
        )


def _ramp_payload(payload) -> dict:
    _known_fields("ramp", payload, _RAMP_FIELDS, "per_device_batch and accum")
    out = {
        "per_device_batch": _bounded_int(payload, "per_device_batch", MAX_PER_DEVICE_BATCH),
        "accum": _bounded_int(payload, "accum", MAX_ACCUM),
    }
    if payload.get("lr_multiplier") is not None:
        out["lr_multiplier"] = _lr_multiplier(payload["lr_multiplier"])
    return out


def _factors(v) -> list[int]:
    ok = isinstance(v, list) and 0 < len(v) <= RAMP_MAX_FACTOR
    ok = ok and all(not isinstance(k, bool) and isinstance(k, int) for k in v)
    ok = ok and all(2 <= k <= RAMP_MAX_FACTOR for k in v)
    ok = ok and all(a < b for a, b in itertools.pairwise(v))
    if not ok:
        raise CommandError(
            "trial payload factors must be a non-empty list of strictly increasing integers "
            f"in 2 .. {RAMP_MAX_FACTOR} (RAMP_MAX_FACTOR), e.g. [2, 4], got {_short(v)}"
        )
    return list(v)


def _trial_payload(payload) -> dict:
    _known_fields("trial", payload, _TRIAL_FIELDS, "factors (e.g. [2, 4]) and delta_tokens")
    delta = payload.get("delta_tokens")
    if delta is not None and (
        isinstance(delta, bool) or not isinstance(delta, int) or not 1 <= delta <= MAX_DELTA_TOKENS
    ):
        raise CommandError(
            "trial payload delta_tokens must be null (the loop's default) or an integer in "
            f"1 .. {MAX_DELTA_TOKENS}, got {_short(delta)} ({type(delta).__name__})"
        )
    return {"factors": _factors(payload.get("factors")), "delta_tokens": delta}


def validate(kind: str, payload) -> dict:
    """The normalized payload, or CommandError naming the field, its limit and what was sent."""
    if kind not in KINDS:
        raise CommandError(f"unknown command kind {kind!r}; known kinds: {', '.join(KINDS)}")
    out = _ramp_payload(payload) if kind == "ramp" else _trial_payload(payload)
    note = _note(kind, payload)
    if note is not None:
        out["note"] = note
    return out


def as_command_id(value) -> int:
    """A command id as an int, or CommandError: ids are integers (never text to splice)."""
    if isinstance(value, bool) or isinstance(value, float):
        value = None
    try:
        cid = operator.index(value)
    except TypeError:
        raise CommandError(
            f"a command id must be an integer (as submit() returned), got "
            f"{value!r} ({type(value).__name__})"
        ) from None
    if not 0 < cid < 1 << 63:
        raise CommandError(f"a command id must be a positive integer, got {cid}")
    return cid


def check_actor(actor) -> None:
    if not isinstance(actor, str) or not actor.strip():
        raise CommandError(
            "every command change needs an actor: a non-empty string naming who "
            "made it (e.g. 'dashboard:alice', 'trainer')"
        )


def check_key(key) -> None:
    if key is not None and (not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY):
        raise CommandError(
            f"an idempotency key must be a non-empty string of at most {MAX_KEY} "
            f"characters (e.g. a UUID made when the button was drawn), got "
            f"{_short(key)}"
        )


def transition(
    con,
    command_id: int,
    to: str,
    actor: str,
    *,
    step: int | None = None,
    reason: str | None = None,
    t: float | None = None,
) -> None:
    """Change a command's status inside the caller's transaction, or raise CommandError."""
    check_actor(actor)
    row = first(con.execute("SELECT status FROM commands WHERE command_id = ?", [command_id]))
    if row is None:
        raise CommandError(f"no command #{command_id}")
    frm = row[0]
    if to not in LEGAL.get(frm, ()):
        legal = LEGAL.get(frm)
        raise CommandError(
            f"command #{command_id} is {frm}; it cannot become {to} "
            + (f"(from {frm} only: {', '.join(legal)})" if legal else f"({frm} is final)")
        )
    if to == "applied" and (isinstance(step, bool) or not isinstance(step, int)):
        raise CommandError(f"applying command #{command_id} needs the step it took effect at")
    if to in ("refused", "undone") and (not isinstance(reason, str) or not reason.strip()):
        verb = "refusing" if to == "refused" else "undoing"
        raise CommandError(f"{verb} command #{command_id} needs a reason")
    t = time.time() if t is None else t
    con.execute(
        "UPDATE commands SET status = ?, updated_at = ?, applied_step = ?, reason = ? "
        "WHERE command_id = ?",
        [to, t, step if to == "applied" else None, reason, command_id],
    )
    detail = f"at step {step}" if to == "applied" else reason
    con.execute(
        "INSERT INTO command_log VALUES (?, ?, ?, ?, ?, ?)", [command_id, t, frm, to, actor, detail]
    )


def undo_after(con, run_id: str, step: int, cause: str, actor: str) -> list[int]:
    """Undo every command of a run applied after `step`: a resume from `step` (after a `cause`,
    e.g. "crash") discarded the steps they took effect at. Returns their ids."""
    rows = con.execute(
        "SELECT command_id, applied_step FROM commands WHERE run_id = ? AND status = 'applied' "
        "AND applied_step > ? ORDER BY command_id",
        [run_id, step],
    ).fetchall()
    for cid, applied in rows:
        why = (
            f"undone by the {cause}: resumed from step {step}, before step {applied} where it "
            "took effect"
        )
        transition(con, cid, "undone", actor, reason=why)
    return [int(cid) for cid, _ in rows]


def pending(con, run_id: str) -> list[Command]:
    rows = con.execute(
        COMMANDS.select + " WHERE run_id = ? AND status = 'pending' ORDER BY command_id", [run_id]
    ).fetchall()
    return [_command(r) for r in rows]


def claim_pending(con, run_id: str, actor: str) -> list[Command]:
    """Claim every pending command of a run in one transaction (the writer's flusher, for
    take_claimed_commands); returns them as claimed."""
    with transaction(con):
        ids = [c.command_id for c in pending(con, run_id)]
        for cid in ids:
            transition(con, cid, "claimed", actor)
        if not ids:
            return []
        rows = con.execute(
            COMMANDS.select
            + " WHERE command_id IN (SELECT unnest(?::BIGINT[])) ORDER BY command_id",
            [ids],
        ).fetchall()
    return [_command(r) for r in rows]


def refuse_open(con, run_id: str, reason: str, actor: str) -> int:
    """Refuse every pending or claimed command of a run (it died); returns how many."""
    ids = [
        r[0]
        for r in con.execute(
            "SELECT command_id FROM commands WHERE run_id = ? AND status IN ('pending', 'claimed')",
            [run_id],
        ).fetchall()
    ]
    for cid in ids:
        transition(con, cid, "refused", actor, reason=reason)
    return len(ids)


def _positive(x) -> int | None:
    """x as a positive int if it is one (ints, integral floats from metrics), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    if isinstance(x, float) and not (math.isfinite(x) and x.is_integer()):
        return None
    return int(x) if x >= 1 else None


def _tiers(con, run_id: str, config: dict, ws: int) -> tuple[Tier | None, Tier | None]:
    """(the starting tier, the current tier) as far as known."""
    b0, a0 = _positive(config.get("per_device_batch")), _positive(config.get("accum"))
    start = Tier(b0, a0, ws) if b0 and a0 else None
    _, complete, partial = ROLLUP_LEVELS[-1]  # table names: our constants, never input
    rows = con.execute(
        f"""SELECT name, arg_max(last_value, last_step) FROM (
                SELECT name, last_step, last_value FROM {partial} WHERE run_id = $r
                    AND name IN ($b, $a)
                UNION ALL SELECT name, last_step, last_value FROM {complete} WHERE run_id = $r
                    AND name IN ($b, $a)) GROUP BY name""",
        {"r": run_id, "b": M.PER_DEVICE_BATCH, "a": M.ACCUM},
    ).fetchall()
    latest = {n: _positive(v) for n, v in rows}
    b, a = latest.get(M.PER_DEVICE_BATCH), latest.get(M.ACCUM)
    current = Tier(b, a, ws) if b and a else start
    return start, current


def ramp_refusal(config) -> str | None:
    """Why a run takes no ramp commands, from its config (the loop's monitor started with
    ramp='off', e.g. a framework that cannot change its batch mid-run), or None."""
    if not isinstance(config, dict) or config.get("ramp") != "off":
        return None
    why = config.get("ramp_note")
    return (
        "takes no ramps from the dashboard"
        + (f": {why}" if why else " (its loop started the monitor with ramp='off')")
        + "; change its batch by hand"
    )


def trial_refusal(config) -> str | None:
    """Why a run takes no trial commands, from its config, or None. A trial ends in a ramp, so a
    run that takes no ramps takes no trials; otherwise the loop says it runs trials by writing
    `trials: true` or `trial_delta_tokens` (its default Δ), and why not by `trials: false` or
    `trials_note`."""
    refusal = ramp_refusal(config)
    if refusal:
        return refusal
    config = config if isinstance(config, dict) else {}
    why = config.get("trials_note")
    opted_in = config.get("trials") is True or _positive(config.get("trial_delta_tokens"))
    if why or config.get("trials") is False or not opted_in:
        return "runs no ramp trials" + (
            f": {why}" if why else " (its loop does not say that it can snapshot and restore)"
        )
    return None


def _check_tier(con, run_id: str, payload: dict, config, world_size) -> None:
    config = config if isinstance(config, dict) else {}
    ws = _positive(world_size) or _positive(config.get("world_size")) or 1
    start, current = _tiers(con, run_id, config, ws)
    new = Tier.from_payload(payload, ws)
    what = (
        f"a ramp to {new.per_device_batch} x {new.accum} on {ws} rank(s) (effective batch "
        f"{new.batch})"
    )
    if start is not None and new.batch < start.batch:
        raise CommandError(
            f"{what} is below the run's starting tier {start.batch} (per_device_batch "
            "x accum x world_size of its config); ramps grow the batch"
        )
    if current is not None and new.batch > RAMP_MAX_FACTOR * current.batch:
        raise CommandError(
            f"{what} grows the batch more than x{RAMP_MAX_FACTOR} in one "
            f"command (from {current.batch} to {new.batch}; at most "
            f"{RAMP_MAX_FACTOR * current.batch}); ramp in smaller steps"
        )


def _config_from_json(text):
    """The run config's JSON text as a dict; None for none, or for text that is no JSON."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None  # a config that is not JSON tells nothing about tiers


def queue(con, db, run_id: str, kind: str, payload: dict, actor: str, key: str | None) -> int:
    """Add a validated command as pending inside the caller's transaction; returns its id, or
    the first command's id when `key` was used before for the same command (db: for messages).

    Refused (CommandError): a key used for another command, a run that does not exist or is not
    running, a second open ramp or trial, a run that takes no ramps (or trials), a ramp off the
    tier rule.
    """
    text = json.dumps(payload, sort_keys=True)
    if key is not None:
        same = first(
            con.execute(
                "SELECT command_id, run_id, kind, payload FROM commands WHERE idempotency_key = ?",
                [key],
            )
        )
        if same is not None:
            if (same[1], same[2], same[3]) == (run_id, kind, text):
                return int(same[0])
            raise CommandError(
                f"idempotency key {key!r} was used for command #{same[0]} (run "
                f"{same[1]!r}, {same[2]} {same[3]}); a different command needs a new "
                "key"
            )
    row = first(
        con.execute("SELECT status, config, world_size FROM runs WHERE run_id = ?", [run_id])
    )
    if row is None:
        raise CommandError(f"no run {run_id!r} in {db}; commands go to existing runs")
    if row[0] != "running":
        raise CommandError(
            f"run {run_id!r} is {row[0]}, not running; commands go only to running runs"
        )
    open_ = first(
        con.execute(
            "SELECT command_id, status, kind FROM commands WHERE run_id = ? "
            "AND list_contains(?::VARCHAR[], kind) AND status IN ('pending', 'claimed') "
            "ORDER BY command_id LIMIT 1",
            [run_id, list(_EXCLUSIVE)],
        )
    )
    if open_ is not None:
        raise CommandError(
            f"run {run_id!r} already has {open_[2]} command #{open_[0]} {open_[1]}; cancel "
            "it or wait until it is applied or refused before submitting another"
        )
    config = _config_from_json(row[1])
    refusal = ramp_refusal(config) if kind == "ramp" else trial_refusal(config)
    if refusal:
        raise CommandError(f"run {run_id!r} {refusal}")
    if kind == "ramp":
        _check_tier(con, run_id, payload, config, row[2])
    [(cid,)] = con.execute("SELECT nextval('command_ids')").fetchall()
    now = time.time()
    new = dict(command_id=cid, run_id=run_id, kind=kind, payload=text, status="pending")
    new.update(actor=actor, created_at=now, updated_at=now, idempotency_key=key)
    con.execute(COMMANDS.insert, COMMANDS.params(new))  # the rest: NULL
    con.execute(
        "INSERT INTO command_log VALUES (?, ?, NULL, 'pending', ?, ?)",
        [cid, now, actor, "submitted"],
    )
    return int(cid)


def find(con, command_id: int) -> Command | None:
    """The command with this id, or None."""
    row = first(con.execute(COMMANDS.select + " WHERE command_id = ?", [command_id]))
    return None if row is None else _command(row)


def matching(con, run_id: str | None = None, status: str | None = None) -> list[Command]:
    """Commands, oldest first, optionally of one run and/or one status."""
    rows = con.execute(
        COMMANDS.select + " WHERE (?::VARCHAR IS NULL OR run_id = ?) AND "
        "(?::VARCHAR IS NULL OR status = ?) ORDER BY command_id",
        [run_id, run_id, status, status],
    ).fetchall()
    return [_command(r) for r in rows]


def log_entries(con, command_id: int | None = None) -> list[LogEntry]:
    """Every status change (of one command, or all), in order."""
    rows = con.execute(
        "SELECT * FROM command_log WHERE (?::BIGINT IS NULL OR command_id = ?) ORDER BY t, rowid",
        [command_id, command_id],
    ).fetchall()
    return [LogEntry(int(r[0]), *r[1:]) for r in rows]
