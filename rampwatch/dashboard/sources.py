"""The databases the dashboard serves: one file (`--db FILE`, as before), or a team's
directories and files of them (`rampwatch dashboard DIR …`, `--db` repeated), listed again on
every page load so that a file copied in shows up without a restart.

Owns: the catalog (the sources → every `*.duckdb` file under each directory, store/db_files.py;
each file with its runs or its problem, read through store_access and cached on the file's
version token, so an unchanged file costs a stat per page load, and a damaged, foreign or
too-new one is a line on the Runs page, never the end of the dashboard); the file labels (the
path below the sources' common folder: shown, and the address's `db=`); a run's identity,
RunRef = its file and its id, and the key widgets, the session and the address name it by
(the run id alone when the dashboard serves one file, so one file's addresses and sessions read
as before; else "FILE::RUN_ID", as two files may hold the same id); and page_catalog, the
entry of the pages that show runs of every file (Runs, Compare).

Each run's file is its own database: the live page, its Approve and its refresh go to that file
alone (store_access with the RunRef's db), and so to the writer that holds that file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from rampwatch.dashboard import store_access
from rampwatch.dashboard.store_access import Problem
from rampwatch.store.db_files import SUFFIX, database_files
from rampwatch.store.naming import display_name

DB_PARAM, RUN_PARAM = "db", "run"  # the address's query parameters that name a run
KEY_SEP = "::"


def run_key(file: str, run_id: str) -> str:
    """The one string a run is selected by: its file's label and its id ('' file: the only
    file, and the key is the run id itself)."""
    return f"{file}{KEY_SEP}{run_id}" if file else run_id


@dataclass(frozen=True)
class DbFile:
    path: Path
    label: str  # shown, and the address's db=
    problem: Problem | None = None  # None: a Rampwatch database with runs
    runs: tuple = ()  # store.reader.Run, newest first


@dataclass(frozen=True)
class RunRef:
    db: Path  # the run's own file: every read and write of the run goes there
    file: str  # that file's label; '' when the dashboard serves one file
    run: object  # store.reader.Run

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def key(self) -> str:
        return run_key(self.file, self.run.run_id)


@dataclass(frozen=True)
class Catalog:
    sources: tuple[Path, ...]
    files: tuple[DbFile, ...]
    single: bool  # one file given: its problem is the page's, as the dashboard always did
    problem: Problem | None  # shown instead of any page (None: some file has runs)

    def refs(self) -> list[RunRef]:
        """Every run of every readable file, newest first."""
        out = [
            RunRef(f.path, "" if self.single else f.label, r) for f in self.files for r in f.runs
        ]
        return sorted(out, key=lambda ref: -(ref.run.created_at or 0.0))

    def clashing_ids(self) -> set[str]:
        """Run ids held by more than one file: where they are shown, so is the file."""
        seen: dict[str, int] = {}
        for f in self.files:
            for r in f.runs:
                seen[r.run_id] = seen.get(r.run_id, 0) + 1
        return {rid for rid, n in seen.items() if n > 1}

    def troubled(self) -> list[DbFile]:
        """Files that could not be read as Rampwatch databases with runs (no runs yet included)."""
        return [f for f in self.files if f.problem is not None]

    def key_from_address(self, file: str | None, run_id: str | None) -> str | None:
        """The key an address names (?db=FILE&run=ID); without db=, the newest run of that id
        in any file; None when it names no run."""
        if not run_id:
            return None
        if self.single or file:
            return run_key("" if self.single else file, run_id)
        ids = [ref.key for ref in self.refs() if ref.run_id == run_id]
        return ids[0] if ids else run_id

    def describe(self) -> str:
        """The sidebar's line: the file, or the sources and how many files they hold."""
        if self.single:
            return f"Database: `{self.sources[0]}`"
        where = ", ".join(f"`{s}`" for s in self.sources) or "none"
        bad = sum(1 for f in self.troubled() if f.problem.kind != "no-runs")
        note = f", {bad} with a problem (see Runs)" if bad else ""
        return f"Databases: {where} · {len(self.files)} file(s){note}"


def _common(sources: tuple[Path, ...]) -> Path:
    folders = [s if s.is_dir() else s.parent for s in sources]
    return Path(os.path.commonpath([str(f) for f in folders])) if folders else Path("/")


def _listed(sources: tuple[Path, ...]) -> list[DbFile]:
    """The files of the sources, each once, with a label; a folder that cannot be listed is an
    entry with its problem."""
    common = _common(sources)
    seen, out = set(), []
    for src in sources:
        try:
            paths = database_files(src) if src.is_dir() else [src]
        except OSError as e:
            message = f"Cannot list the directory {src}: {e.strerror}."
            out.append(DbFile(src, str(src), Problem("error", message)))
            continue
        for p in paths:
            real = os.path.realpath(p)
            if real not in seen:
                seen.add(real)
                out.append(DbFile(p, os.path.relpath(p, common)))
    return out


def _checked(f: DbFile) -> DbFile:
    problem = store_access.file_problem(f.path)
    if problem is not None:
        return DbFile(f.path, f.label, problem)
    try:
        runs = tuple(store_access.list_runs(f.path))
    except Exception as e:  # noqa: BLE001 - it changed since the check: a line, not the end
        return DbFile(f.path, f.label, Problem("error", f"Could not read {f.path}: {e}"))
    return DbFile(f.path, f.label, None, runs)


def catalog(opts: store_access.Options) -> Catalog:
    """The databases of the dashboard's sources now, each with its runs or its problem."""
    sources = opts.sources
    if len(sources) == 1 and not sources[0].is_dir():  # one file: today's dashboard
        db = sources[0]
        problem = store_access.damage_seen(db) or store_access.db_problem(db)
        runs = () if problem is not None else tuple(store_access.list_runs(db))
        return Catalog(sources, (DbFile(db, db.name, problem, runs),), True, problem)
    if not sources:
        return Catalog(sources, (), False, store_access.db_problem(None))
    files = tuple(_checked(f) for f in _listed(sources))
    problem = None
    if not any(f.runs for f in files):
        where = " and ".join(str(s) for s in sources)
        problem = Problem(
            "no-runs",
            f"No runs yet in the Rampwatch databases under {where} ({len(files)} "
            f"*{SUFFIX} file(s) found). Start training runs with `--db` set to a file in "
            "it, or copy their databases in; this page refreshes when one appears.",
            fatal=False,
        )
    return Catalog(sources, files, False, problem)


def page_catalog() -> tuple[Catalog, str | None, bool]:
    """(catalog, the picked run's key, read_only) for a page that shows runs of every file, or
    a message on the page and st.stop() (app.py shows why before it runs a page; a page run by
    itself checks again)."""
    opts = store_access.options()
    cat = catalog(opts)
    problem = store_access.options_problem(opts) or cat.problem
    if problem is not None:
        (st.error if problem.fatal else st.info)(problem.message)
        st.stop()
    read_only = bool(st.session_state.get("rw_read_only")) or opts.read_only
    return cat, st.session_state.get("rw_run"), read_only


def file_notes(cat: Catalog) -> list[tuple[bool, str]]:
    """(is it a problem, one line) for each file that shows no runs: damaged, foreign, newer,
    unreadable (a problem), or with no runs yet / busy for now (a note)."""
    out = []
    for f in cat.troubled():
        label = display_name(f.label)
        message = f.problem.message.replace(str(f.path), label)
        # most problems name their file already: the label once, in front
        out.append(
            (f.problem.fatal, message if message.startswith(label) else f"{label}: {message}")
        )
    return out


def metric_names(refs: list[RunRef]) -> list[str]:
    """Every metric any of these runs logged: one query per file."""
    by_file: dict[Path, list] = {}
    for ref in refs:
        by_file.setdefault(ref.db, []).append(ref.run)
    names: set[str] = set()
    for db, runs in by_file.items():
        names.update(store_access.metric_names(db, runs))
    return sorted(names)


def damaged(refs: list[RunRef]) -> dict[Path, str]:
    """{file: why} for the files of these runs that a read found damaged since the catalog
    listed them (store_access.note_damaged): their runs are left out of what a page shows."""
    seen = {db: store_access.damage_seen(db) for db in dict.fromkeys(ref.db for ref in refs)}
    return {db: problem.message for db, problem in seen.items() if problem is not None}


def series_of(refs: list[RunRef], names) -> dict[str, dict]:
    """{run key: {name: Buckets}} of these runs, from their files (store_access.run_series);
    a run whose file a read found damaged is missing (store_access.damage_seen says why)."""
    data = store_access.run_series([(ref.db, ref.run) for ref in refs], names)
    return {ref.key: data[k] for ref in refs if (k := (str(ref.db), ref.run_id)) in data}
