"""The dashboard's one door to the store: every store access but the live page's refresh, in
one place: options, database checks, cached reads, and the writes (submit a ramp or a trial
command, cancel one), with the record of those refused.

Owns: where the database paths and read-only flag come from (`rampwatch dashboard [DIR …]
[--db PATH …] [--read-only]`, which passes them as `--db` after `--` to the app; else
RAMPWATCH_DB / RAMPWATCH_READ_ONLY; the files under a directory are dashboard/sources.py's);
turning store errors into a message a page can show (`db_problem`), and damage a read met after
that check into the file's problem (`note_damaged`);
st.cache_data reads keyed on the file's version token (its and its WAL's size and mtime), or,
for reads of chosen runs, on each run's `run_version`, so a finished run is read once and a
live one on every change; what a page shows for many runs, read in one session whatever their
number (the Runs page's summaries; the compare page's curves, kept per session as SeriesCaches
and refreshed only for the runs that changed, as the live page refreshes its one run); the
command calls, each checked by guard.py and, when refused, recorded in the store with the client's address and counted
against the client (guard.THROTTLE); and the notes on dead writers' waiting spools. The live
page's incremental refresh is dashboard/live_data.py, which runs outside Streamlit too (`rampwatch
plan --db`), so the store rows' plain forms and the read timeout live there and are used here.
Pages never call store/ directly.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import streamlit as st

from rampwatch.dashboard import guard
from rampwatch.dashboard.buckets import Buckets, SeriesCache
from rampwatch.dashboard.live_data import (
    COMMANDS_DIRTY,
    TIMEOUT,
    buckets_from,
    event_dict,
    refresh_series,
    refresh_series_many,
)
from rampwatch.store import commands as store_commands
from rampwatch.store import db as store_db
from rampwatch.store import names as M
from rampwatch.store import recovery as store_recovery
from rampwatch.store import refusals as store_refusals
from rampwatch.store.errors import (
    CommandError,
    DatabaseCorruptError,
    DatabaseMissingError,
    NotRampwatchError,
    RunNotFoundError,
    SchemaTooNewError,
    StoreBusyError,
    StoreError,
)
from rampwatch.store.naming import display_name
from rampwatch.store.reader import Reader

COMPARE_BUCKETS = 2000


# ------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class Options:
    sources: tuple[Path, ...]  # database files and directories of them (dashboard/sources.py)
    read_only: bool
    source: str  # where the paths came from, for the sidebar
    unknown: tuple[str, ...] = ()  # arguments the dashboard does not take (shown as an error)

    @property
    def db(self) -> Path | None:
        """The one path given (today's dashboard on one file), else None."""
        return self.sources[0] if len(self.sources) == 1 else None


def _truthy(v: str | None) -> bool:
    return str(v or "").strip().lower() in ("1", "true", "yes", "on")


def parse_options(argv: list[str] | None = None, env: dict | None = None) -> Options:
    """--db PATH (repeated: files or directories of them) / --read-only after `--` on the
    streamlit command line, else the environment (RAMPWATCH_DB: one path)."""
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ if env is None else env
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--db", action="append", default=[])
    ap.add_argument("--read-only", action="store_true")
    args, unknown = ap.parse_known_args(argv)
    read_only = bool(args.read_only) or _truthy(env.get("RAMPWATCH_READ_ONLY"))
    unknown = tuple(unknown)
    if args.db:
        paths = tuple(dict.fromkeys(Path(p).expanduser().absolute() for p in args.db))
        return Options(paths, read_only, "--db", unknown)
    if env.get("RAMPWATCH_DB"):
        path = Path(env["RAMPWATCH_DB"]).expanduser().absolute()
        return Options((path,), read_only, "RAMPWATCH_DB", unknown)
    return Options((), read_only, "", unknown)


def options() -> Options:
    """The dashboard's options; in read-only mode every read of this process writes nothing
    (no schema upgrade, no lock file)."""
    opts = parse_options()
    store_db.set_read_only(opts.read_only)
    return opts


def page_context(need_run: bool = True) -> tuple[Path, str | None, bool]:
    """(db, run_id, read_only) for a page, or a message on the page and st.stop().

    app.py checks the database and picks the run before it runs a page; a fragment rerun runs
    only the page's fragment, so the page checks again (cached, cheap).
    """
    opts = options()
    db = st.session_state.get("rw_db") or opts.db
    read_only = bool(st.session_state.get("rw_read_only")) or opts.read_only
    problem = db_problem(db)
    if problem is not None:
        (st.error if problem.fatal else st.info)(problem.message)
        st.stop()
    run_id = st.session_state.get("rw_run_id")
    if need_run:
        ids = [r.run_id for r in list_runs(db)]
        if run_id not in ids:
            if run_id is not None:
                st.warning(
                    f"Run {display_name(run_id)} is no longer in the database (it was deleted). Pick "
                    "another run in the sidebar."
                )
            else:
                st.info("Pick a run in the sidebar.")
            st.stop()
    return db, run_id, read_only


# ---------------------------------------------------------------------------- database checks


@dataclass(frozen=True)
class Problem:
    kind: (
        str  # 'usage', 'unset', 'missing', 'empty', 'foreign', 'newer', 'busy', 'error', 'no-runs',
        # 'damaged' (a read met damage after the file's check: note_damaged)
    )
    message: str
    fatal: bool = True  # False: the database is fine, it just has nothing to show yet


def version_token(db: Path) -> tuple:
    """Changes whenever the database (or its WAL) is written: the cache key of every read."""
    out = []
    for p in (db, Path(str(db) + ".wal")):
        try:
            s = os.stat(p)
            out.append((s.st_size, s.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def options_problem(opts: Options) -> Problem | None:
    """Arguments the dashboard does not take are an error, not silently ignored."""
    if not opts.unknown:
        return None
    return Problem(
        "usage",
        f"Unknown dashboard argument(s): {' '.join(opts.unknown)}. The "
        "dashboard takes --db PATH and --read-only (`rampwatch dashboard --help`).",
    )


def db_problem(db: Path | None) -> Problem | None:
    """None when the database opens and has runs; otherwise what is wrong and what to do."""
    if db is None:
        return Problem(
            "unset",
            "No database given. Start the dashboard with "
            "`rampwatch dashboard --db PATH` (or set RAMPWATCH_DB=PATH).",
        )
    if db.is_dir():
        return Problem(
            "foreign",
            f"{db} is a directory, not a database file. Pass the path of the "
            "`.duckdb` file the trainer writes (its --db).",
        )
    if not db.exists():
        return Problem(
            "missing",
            f"No database at {db}: the file does not exist yet. Start a "
            f"training run with `--db {db}` (it creates the file), or check the path; "
            "this page refreshes when it appears.",
            fatal=False,
        )
    if db.stat().st_size == 0:
        return Problem(
            "empty",
            f"{db} is an empty file (0 bytes), not a Rampwatch database. Delete "
            "it and let a training run create the database, or point --db elsewhere.",
        )
    try:
        runs = list_runs(db)
    except StoreError as e:
        return _problem_from(e, db)
    except Exception as e:  # noqa: BLE001 - never a traceback on the page
        return Problem("error", f"Could not read {db}: {type(e).__name__}: {e}")
    if not runs:
        return Problem(
            "no-runs",
            f"{db} is a Rampwatch database with no runs yet. Start a training "
            f"run with `--db {db}`; this page refreshes when it appears.",
            fatal=False,
        )
    return None


class _Uncached(Exception):
    """A problem that passes (a busy file): raised out of the cache, so it is not kept."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


@st.cache_data(ttl=60, max_entries=1024, show_spinner=False)
def _file_problem(db: str, token: tuple) -> Problem | None:
    problem = db_problem(Path(db))
    if problem is not None and problem.kind == "busy":
        raise _Uncached(problem)
    return problem


# path -> (the file's version token when a read met damage in it, that problem)
_DAMAGE_SEEN: dict[str, tuple[tuple, Problem]] = {}


def note_damaged(db: Path, error: DatabaseCorruptError) -> Problem:
    """A read met damage the file check did not: DuckDB checks a block's checksum only when a
    read reaches it, so a file whose catalog is whole lists its runs and fails later, on a
    run's rows. From now on, until the file changes, it is a problem line on the Runs page and
    its runs are not offered (every session of this dashboard)."""
    problem = Problem("damaged", str(error))
    _DAMAGE_SEEN[str(db)] = (version_token(db), problem)
    return problem


def damage_seen(db: Path) -> Problem | None:
    """The damage a read met in this file as it is now (note_damaged), or None."""
    seen = _DAMAGE_SEEN.get(str(db))
    return seen[1] if seen is not None and seen[0] == version_token(db) else None


def file_problem(db: Path) -> Problem | None:
    """db_problem, cached on the file's version token: a damaged or foreign file in a directory
    is looked at again only when it changes, not on every page load (a busy one: every time).
    Damage a read met since (note_damaged) comes first."""
    if (seen := damage_seen(db)) is not None:
        return seen
    try:
        return _file_problem(str(db), version_token(db))
    except _Uncached as e:
        return e.problem


def _problem_from(e: Exception, db: Path) -> Problem:
    if isinstance(e, SchemaTooNewError):
        return Problem("newer", f"{e} (This dashboard cannot read it; nothing was changed.)")
    if isinstance(e, NotRampwatchError):
        return Problem("foreign", f"{e}")
    if isinstance(e, DatabaseMissingError):
        return Problem("missing", f"{e}")
    if isinstance(e, StoreBusyError):
        return Problem("busy", f"{e} The page retries on its next refresh.", fatal=False)
    return Problem("error", f"Could not read {db}: {e}")


# ----------------------------------------------------------------------------- cached reads


@st.cache_data(ttl=60, max_entries=256, show_spinner=False)
def _list_runs(db: str, token: tuple):
    return Reader(db, timeout=TIMEOUT).list_runs()


def list_runs(db: Path):
    """Every run, newest first (store.reader.Run); statuses include 'stale'."""
    return _list_runs(str(db), version_token(db))


def run_version(run) -> tuple:
    """Changes whenever rows of this run are added or removed: every ingest moves its last step
    or heartbeat (a live writer's) or its status (recovery closes a dead writer's run; a resume
    reopens one). The key of the reads of one run, so a live run's writes leave the others'
    cached. Its first item, created_at, tells a run deleted and made again under its id."""
    return (run.created_at, run.stored_status, run.last_step, run.heartbeat, run.ended_at)


def _versions(runs) -> tuple:
    return tuple((r.run_id, run_version(r)) for r in runs)


@st.cache_data(ttl=300, max_entries=64, show_spinner=False)
def _metric_names(db: str, versions: tuple) -> list[str]:
    stats = Reader(db, timeout=TIMEOUT).metric_stats(run_ids=[rid for rid, _ in versions])
    return sorted(set().union(*(set(s) for s in stats.values())))


def metric_names(db: Path, runs) -> list[str]:
    """Every metric any of these runs (store.reader.Run) logged, in one query (none from a
    file that turns out damaged: noted, note_damaged)."""
    try:
        return _metric_names(str(db), _versions(runs))
    except DatabaseCorruptError as e:
        note_damaged(db, e)
        return []


@st.cache_data(ttl=300, max_entries=512, show_spinner=False)
def _series(db: str, run_id: str, name: str, buckets: int, token: tuple) -> Buckets:
    return buckets_from(Reader(db, timeout=TIMEOUT).series(run_id, name, buckets=buckets))


_SERIES_STATE = "_rw_series"  # session state: SeriesCaches of the runs this session compares


def run_series(
    chosen, names, buckets: int = COMPARE_BUCKETS
) -> dict[tuple[str, str], dict[str, Buckets]]:
    """{(db, run_id): {name: Buckets}}: whole metrics of several runs at ~`buckets` points each,
    for the compare page; chosen: (db, store.reader.Run) pairs, from one file or several.

    Kept per session as one SeriesCache per run and metric; a run whose run_version is what it
    was is not read at all, the others are read in one Reader session per file (one
    Reader.series_many: one query for all their raw rows), each series only from its last
    bucket on (a resume, counted by the run's resume events, refetches it whole). Runs not asked
    for are dropped from the session; so are the runs of a file a read finds damaged (they are
    missing from the result, and the file is noted: note_damaged).
    """
    names = tuple(dict.fromkeys(names))
    chosen = [(str(db), r) for db, r in chosen]
    state = st.session_state.setdefault(_SERIES_STATE, {})
    if "caches" not in state:
        state.update(caches={}, versions={})
    caches, versions = state["caches"], state["versions"]
    wanted = {(db, r.run_id) for db, r in chosen}
    for key in [k for k in caches if k[:2] not in wanted]:
        del caches[key]
    for key in [k for k in versions if k not in wanted]:
        del versions[key]
    stale: dict[str, list] = {}
    for db, r in chosen:
        run_key = (db, r.run_id)
        if versions.get(run_key, (r.created_at,))[0] != r.created_at:  # another run, same id
            for key in [k for k in caches if k[:2] == run_key]:
                del caches[key]
        new = [n for n in names if (*run_key, n) not in caches]
        for n in new:
            caches[(*run_key, n)] = SeriesCache(buckets)
        if new or versions.get(run_key) != run_version(r):
            stale.setdefault(db, []).append(r)
    for db, runs in stale.items():
        try:
            _refresh_file_series(db, runs, caches)
        except DatabaseCorruptError as e:  # its runs are left out; the page says why
            note_damaged(Path(db), e)
            chosen = [(d, r) for d, r in chosen if d != db]
            for key in [k for k in caches if k[0] == db]:
                del caches[key]
            continue
        for r in runs:
            versions[(db, r.run_id)] = run_version(r)
    return {(db, r.run_id): {n: caches[(db, r.run_id, n)].data for n in names} for db, r in chosen}


def _refresh_file_series(db: str, runs, caches) -> None:
    """One file's stale runs, read in one session into their SeriesCaches."""
    reader = Reader(db, timeout=TIMEOUT)
    with reader.session():
        resumes = reader.events_of_runs([M.EVENT_RESUME], [r.run_id for r in runs])
        refresh_series_many(
            reader,
            [
                (
                    r.run_id,
                    {k[2]: c for k, c in caches.items() if k[:2] == (db, r.run_id)},
                    r.last_step,
                    len(resumes.get(r.run_id, ())),
                )
                for r in runs
            ],
        )


@st.cache_data(ttl=60, max_entries=256, show_spinner=False)
def _run_summaries(db: str, token: tuple) -> dict[str, dict]:
    r = Reader(db, timeout=TIMEOUT)
    with r.session():
        stats = r.metric_stats([M.TOKENS_SEEN, M.LOSS, M.MEM_PEAK])
        alerts = r.events_of_runs([M.EVENT_ALERT])
    out = {}
    for rid in set(stats) | set(alerts):
        s, evs = stats.get(rid, {}), [event_dict(e) for e in alerts.get(rid, ())]
        tokens, loss, peak = (s.get(n) for n in (M.TOKENS_SEEN, M.LOSS, M.MEM_PEAK))
        out[rid] = {
            "tokens": None if tokens is None else tokens.last,
            "best_loss": None if loss is None else loss.min,
            "peak_bytes": None if peak is None else peak.max,
            "alerts": len(evs),
            "lost_records": lost_records(evs),
        }
    return out


NO_SUMMARY = {"tokens": None, "best_loss": None, "peak_bytes": None, "alerts": 0, "lost_records": 0}


def run_summaries(db: Path) -> dict[str, dict]:
    """{run_id: tokens seen, best (lowest finite) loss, peak memory, alerts, lost records} of
    every run, in one read session (a run with none of these: absent, see NO_SUMMARY); none
    from a file that turns out damaged (noted: note_damaged, so the page lists it next)."""
    try:
        return _run_summaries(str(db), version_token(db))
    except DatabaseCorruptError as e:
        note_damaged(db, e)
        return {}


# what an alert's data counts when records never reached the database: dropped by the writer
# (bad values, a full disk; store/outbox.py) or lost to a damaged spool (store/ingest.py)
LOSS_COUNTS = ("dropped", "lost_metric_records")


def lost_records(events: list[dict]) -> int:
    """Records of a run that never reached the database, as its alert events count them."""
    total = 0
    for e in events:
        if e.get("kind") != M.EVENT_ALERT:
            continue
        d = e.get("data") or {}
        for key in LOSS_COUNTS:
            if isinstance(d.get(key), (int, float)):
                total += int(d[key])
    return total


ALERT_HOLDS_STEPS = 200  # an alert is a banner until the run is this many steps past it
MEASUREMENT_OFF = "noise scale not measured"


def active_alerts(
    events: list[dict], last_step: int | None, newest_estimate_step: int | None
) -> list[dict]:
    """The alerts and OOM recoveries that still hold, newest of each sort, for banners: recent
    ones (within ALERT_HOLDS_STEPS of the run's last step), and 'noise scale not measured' for
    as long as no estimate is fresh. Lost records have their own banner (lost_records)."""
    last = {}
    for e in events:
        if e.get("kind") not in (M.EVENT_ALERT, M.EVENT_OOM) or e.get("step") is None:
            continue
        if any(key in (e.get("data") or {}) for key in LOSS_COUNTS):
            continue
        sort = e["kind"] + ":" + str(e.get("message") or "").split(":")[0]
        if sort not in last or e["step"] >= last[sort]["step"]:
            last[sort] = e
    now = last_step if last_step is not None else 0
    held = []
    for e in last.values():
        if str(e.get("message") or "").startswith(MEASUREMENT_OFF):
            stale = newest_estimate_step is None or now - newest_estimate_step > 50
            if stale:
                held.append(e)
        elif now - e["step"] <= ALERT_HOLDS_STEPS:
            held.append(e)
    return sorted(held, key=lambda e: -e["step"])


# Refusals change rarely, but a live run's file changes every second: keyed on the file's
# version, the live page would open one more connection per refresh to read them. So they are
# cached for REFUSALS_TTL and dropped whenever this process records one (another dashboard's
# show up within the TTL).
REFUSALS_TTL = 30


@st.cache_data(ttl=REFUSALS_TTL, max_entries=64, show_spinner=False)
def _refusals(db: str, run_id: str) -> list[dict]:
    return [
        {
            "t": r.t,
            "operator": r.operator,
            "client": r.client,
            "action": r.action,
            "detail": r.detail,
            "reason": r.reason,
        }
        for r in store_refusals.list_refusals(db, run_id, timeout=TIMEOUT)
    ]


def refusals(db: Path, run_id: str) -> list[dict]:
    """The run's refused writes, newest first (at most store.refusals.LIST_LIMIT)."""
    return _refusals(str(db), run_id)


@st.cache_data(ttl=REFUSALS_TTL, max_entries=256, show_spinner=False)
def _refusal_counts(db: str) -> dict[str, int]:
    return store_refusals.refusal_counts(db, timeout=TIMEOUT)


def refusal_counts(db: Path) -> dict[str, int]:
    """{run_id: refused writes} (Runs page)."""
    return _refusal_counts(str(db))


# a writer's death changes no byte of the database, so this is cached for a while, not by version
@st.cache_data(ttl=5, max_entries=256, show_spinner=False)
def _dead_writers(db: str) -> list:
    return store_recovery.dead_writers(db, timeout=TIMEOUT)


def dead_writer_notes(db: Path, run_id: str | None = None) -> list[str]:
    """One sentence per dead writer's spool that recovery would ingest (of one run, or all):
    read-only mode cannot recover, so the operator must be told what to run."""
    notes = []
    for d in _dead_writers(str(db)):
        if run_id is not None and d.run_id != run_id:
            continue
        who = f"run {d.run_id}" if d.run_id else f"an unknown run (spool {d.spool})"
        notes.append(
            f"{who}: its writer died with {d.records:,} records not yet in the database; "
            f"run `rampwatch recover {db}` to ingest them"
            if d.records
            else f"{who}: its writer died (everything it logged is in the database); "
            f"run `rampwatch recover {db}` to mark the run killed"
        )
    return notes


def export_bytes(db: Path, run_id: str, fmt: str) -> bytes:
    """Every raw metric row of a run as CSV or Parquet (called when the user clicks download)."""
    try:
        table = Reader(db, timeout=30.0).export(run_id)
    except DatabaseCorruptError as e:  # the next page load lists the file with its problem
        note_damaged(db, e)
        raise
    buf = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buf)
    else:
        pa_csv.write_csv(table, buf)
    return buf.getvalue()


# ------------------------------------------------------------------------------------ writes


NO_ADDRESS = "(no address)"  # the throttle's one key for clients whose address is unknown


def client_address() -> str | None:
    """The client's address as Streamlit sees it; None on loopback, under AppTest, outside a
    session. Streamlit says it can be spoofed: a record and a throttle key, not an identity."""
    try:
        ip = st.context.ip_address
    except Exception:  # noqa: BLE001 - no session, no address
        return None
    return ip if isinstance(ip, str) else None  # AppTest's stand-in client has no real one


def _writable(
    operator: str | None,
    token: str | None,
    attempt: dict,
) -> str:
    """The command log's actor for this write, or CommandError saying why it may not happen:
    checked here, on the server, whatever the page rendered. A refusal is recorded (attempt:
    db, run_id, action, detail) and counted against the client; a client in its cooldown is
    refused without a look at its token, and not recorded again."""
    if options().read_only or st.session_state.get("rw_read_only"):
        raise CommandError("this dashboard is read-only: it writes nothing")
    client = client_address()
    key = client or NO_ADDRESS
    wait = guard.THROTTLE.wait(key)
    if wait > 0:
        raise CommandError(guard.cooldown_refusal(wait))
    expected = guard.server_token()
    reason = AGENT_API_REFUSAL if agent_api_enabled() else guard.refusal(token, operator, expected)
    if reason is None:
        guard.THROTTLE.passed(key)
        return guard.actor(operator)
    guard.THROTTLE.refused(key)
    name = guard.recordable_name(operator, token, expected)
    raise CommandError(reason + _record_refusal(attempt, name, client, reason))


def _record_refusal(attempt: dict, operator: str | None, client: str | None, reason: str) -> str:
    """Record a refused write; '' when recorded, else a note for the message (never raises)."""
    try:
        run_id = attempt.get("run_id")
        if run_id is None:  # a cancel names its command: the record names the command's run
            run_id = _command_run(attempt["db"], attempt["command_id"])
        store_refusals.record(
            attempt["db"],
            run_id=run_id,
            action=attempt["action"],
            detail=attempt["detail"],
            operator=operator,
            client=client,
            reason=reason,
            timeout=TIMEOUT,
        )
        _refusals.clear()  # the pages show it at once (the caches are not keyed on the file)
        _refusal_counts.clear()
    except Exception as e:  # noqa: BLE001 - a refusal must never become a traceback
        return f" (this refusal could not be recorded: {e})"
    return ""


def _command_run(db: Path, command_id) -> str | None:
    try:
        return store_commands.get(db, command_id, timeout=TIMEOUT).run_id
    except CommandError:  # no such command (an id a script made up): recorded without a run
        return None


ramp_refusal = store_commands.ramp_refusal  # a run whose loop takes no ramps: say why
trial_refusal = store_commands.trial_refusal  # a run whose loop runs no trials: say why


def agent_api_enabled() -> bool:
    """Streamlit's agent API is a second way to drive the page: no writes while it is on."""
    try:
        return bool(st.get_option("server.enableAgentApi"))
    except Exception:  # noqa: BLE001 - a Streamlit without the option has no agent API
        return False


AGENT_API_REFUSAL = (
    "Streamlit's agent API is on (server.enableAgentApi), another way to drive "
    "this page: the dashboard writes nothing while it is. Turn it off, or serve "
    "with --read-only."
)


def submit_ramp(
    db: Path,
    run_id: str,
    payload: dict,
    *,
    operator: str | None,
    token: str | None,
    key: str | None = None,
) -> int:
    """Queue an approved ramp for `operator`, if the token is this server's (store validates
    and refuses a second open one); the same key makes one command however often it is sent."""
    what = f"ramp to {payload.get('per_device_batch')} × {payload.get('accum')}"
    return _submit(db, run_id, "ramp", payload, what, operator, token, key)


def submit_trial(
    db: Path,
    run_id: str,
    payload: dict,
    *,
    operator: str | None,
    token: str | None,
    key: str | None = None,
) -> int:
    """Queue an approved ramp trial, guarded exactly as a ramp (the same checks and record)."""
    what = "trial " + ", ".join(f"×{k}" for k in payload.get("factors") or ())
    return _submit(db, run_id, "trial", payload, what, operator, token, key)


SUBMIT = {"ramp": submit_ramp, "trial": submit_trial}  # the card's one click path, by kind


def _submit(db, run_id, kind, payload, what, operator, token, key) -> int:
    attempt = {"db": db, "run_id": run_id, "action": "approve", "detail": what}
    actor = _writable(operator, token, attempt)
    try:
        return store_commands.submit(
            db, run_id, kind, payload, actor=actor, timeout=TIMEOUT, key=key
        )
    finally:
        st.session_state[COMMANDS_DIRTY] = True  # the live page reads commands on its next tick


def cancel_command(
    db: Path, command_id: int, *, operator: str | None, token: str | None, kind: str = "ramp"
):
    what = f"cancel {kind} #{command_id}"
    attempt = {"db": db, "command_id": command_id, "action": "cancel", "detail": what}
    actor = _writable(operator, token, attempt)
    try:
        return store_commands.cancel(db, command_id, actor=actor, timeout=TIMEOUT)
    finally:
        st.session_state[COMMANDS_DIRTY] = True  # the live page reads commands on its next tick


__all__ = [
    "Options",
    "Problem",
    "parse_options",
    "options",
    "page_context",
    "options_problem",
    "db_problem",
    "file_problem",
    "list_runs",
    "metric_names",
    "run_version",
    "run_series",
    "refresh_series",
    "run_summaries",
    "NO_SUMMARY",
    "refusals",
    "refusal_counts",
    "dead_writer_notes",
    "client_address",
    "export_bytes",
    "submit_ramp",
    "submit_trial",
    "trial_refusal",
    "cancel_command",
    "agent_api_enabled",
    "lost_records",
    "active_alerts",
    "CommandError",
    "DatabaseCorruptError",
    "RunNotFoundError",
    "StoreError",
]
