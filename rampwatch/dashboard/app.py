"""The Rampwatch dashboard app: `rampwatch dashboard [DIR …] [--db PATH …] [--read-only]`, which
runs this file with Streamlit (from a checkout, `streamlit run app.py -- --db PATH` runs main()
too).

Owns: page config, the navigation over views/ (Live run, Compare, Runs), and the shared sidebar
(the databases in use, read-only badge, run picker over every file's runs). It lists and checks
the databases once per run of the script (dashboard/sources.py) and shows what is wrong with
one file (missing, empty, foreign, newer schema), or that a directory has no runs yet, instead
of any page; the pages then read the choice from st.session_state: "rw_db" (the picked run's
file, a Path), "rw_read_only" (bool), "rw_run_id" (the picked run's id, or None), "rw_run"
(its key: sources.run_key) and "rw_file" (its file's label, '' for the only file).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from rampwatch.dashboard import sources, store_access
from rampwatch.store.naming import display_name

# The page scripts live in the package, so an installed dashboard needs no pages/ folder beside
# its entry script (which would also switch on Streamlit's older folder-based page routing).
VIEWS = Path(__file__).resolve().parent / "views"


def _run_label(ref: sources.RunRef, clashes: set[str]) -> str:
    run = ref.run
    name = run.name or run.run_id
    label = f"{display_name(name)} · {run.status}"
    label = label if name == run.run_id else f"{label} · {display_name(run.run_id)}"
    return f"{label} · {display_name(ref.file)}" if run.run_id in clashes else label


def _wanted(cat: sources.Catalog) -> str | None:
    """The run this session or its address asked for: the session's pick, else ?db=&run=."""
    ss, q = st.session_state, st.query_params
    if ss.get("rw_run"):
        return ss["rw_run"]
    if cat.single and ss.get("rw_run_id"):
        return ss["rw_run_id"]
    return cat.key_from_address(q.get(sources.DB_PARAM), q.get(sources.RUN_PARAM))


def _pick_run(cat: sources.Catalog) -> sources.RunRef:
    """Sidebar run picker over every file's runs; keeps the choice across pages (by file and
    run id), falls back when it disappears."""
    refs = cat.refs()
    by_key = {r.key: r for r in refs}
    wanted = _wanted(cat)
    if wanted and wanted not in by_key:
        file, _, run_id = wanted.rpartition(sources.KEY_SEP)
        where = "the database" if cat.single else "the databases"
        why = "deleted?"
        if any(f.label == file and f.problem is not None for f in cat.files):
            where, why = display_name(file), "the file has a problem: see Runs"
        st.sidebar.warning(
            f"Run {display_name(run_id)} is no longer in {where} ({why}); showing another run."
        )
        wanted = None
        st.session_state.pop("run_picker", None)
    if wanted is None:
        live = [r.key for r in refs if r.run.status == "running"]
        wanted = live[0] if live else refs[0].key
    if st.session_state.get("run_picker") not in by_key:
        st.session_state["run_picker"] = wanted
    clashes = cat.clashing_ids()
    chosen = st.sidebar.selectbox(
        "Run", list(by_key), key="run_picker", format_func=lambda k: _run_label(by_key[k], clashes)
    )
    ref = by_key[chosen]
    st.session_state.update(rw_run=chosen, rw_run_id=ref.run_id, rw_db=ref.db, rw_file=ref.file)
    return ref


def _pages() -> list:
    return [
        st.Page(
            VIEWS / "live.py",
            title="Live run",
            icon=":material/monitoring:",
            url_path="live",
            default=True,
        ),
        st.Page(
            VIEWS / "compare.py",
            title="Compare",
            icon=":material/stacked_line_chart:",
            url_path="compare",
        ),
        st.Page(VIEWS / "runs.py", title="Runs", icon=":material/table_rows:", url_path="runs"),
    ]


def main() -> None:
    """One run of the app: sidebar, database checks, then the page the URL names."""
    st.set_page_config(page_title="Rampwatch", page_icon="📈", layout="wide")
    opts = store_access.options()
    st.session_state["rw_db"] = opts.db  # the picked run's file, once a run is picked
    st.session_state["rw_read_only"] = opts.read_only
    nav = st.navigation(_pages())
    cat = sources.catalog(opts)

    with st.sidebar:
        st.markdown("**Rampwatch**")
        st.caption(cat.describe() if opts.sources else "Database: none")
        if opts.read_only:
            st.caption(":lock: read-only: no controls, nothing is written")

    problem = store_access.options_problem(opts) or cat.problem
    if problem is not None:
        st.session_state["rw_run_id"] = None
        st.session_state.pop("rw_run", None)
        st.title("Rampwatch")
        if problem.fatal:
            st.error(problem.message, icon=":material/error:")
            return
        st.info(problem.message, icon=":material/info:")
        if not cat.single:
            for bad, note in sources.file_notes(cat):
                (st.warning if bad else st.caption)(note)

        @st.fragment(run_every=5)
        def _wait_for_runs():
            if sources.catalog(opts).problem is None:
                st.rerun(scope="app")

        _wait_for_runs()
    else:
        _pick_run(cat)
        nav.run()


if __name__ == "__main__":
    main()
