"""The Rampwatch dashboard app: `rampwatch dashboard --db PATH [--read-only]`, which runs this file
with Streamlit (from a checkout, `streamlit run app.py -- --db PATH` runs main() too).

Owns: page config, the navigation over views/ (Live run, Compare, Runs), and the shared sidebar
(the database in use, read-only badge, run picker). It checks the database once per run of the
script and shows what is wrong (missing, empty, foreign, newer schema) instead of any page; the
pages then read the choice from st.session_state: "rw_db" (Path), "rw_read_only" (bool) and
"rw_run_id" (the picked run, or None).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from rampwatch.dashboard import store_access
from rampwatch.store.naming import display_name

# The page scripts live in the package, so an installed dashboard needs no pages/ folder beside
# its entry script (which would also switch on Streamlit's older folder-based page routing).
VIEWS = Path(__file__).resolve().parent / "views"


def _run_label(run) -> str:
    name = run.name or run.run_id
    label = f"{display_name(name)} · {run.status}"
    return label if name == run.run_id else f"{label} · {display_name(run.run_id)}"


def _pick_run(runs) -> str | None:
    """Sidebar run picker; keeps the choice across pages, falls back when it disappears."""
    ids = [r.run_id for r in runs]
    by_id = {r.run_id: r for r in runs}
    wanted = st.session_state.get("rw_run_id") or st.query_params.get("run")
    if wanted and wanted not in by_id:
        st.sidebar.warning(
            f"Run {display_name(wanted)} is no longer in the database (deleted?); showing "
            "another run."
        )
        wanted = None
        st.session_state.pop("run_picker", None)
    if wanted is None:
        live = [r.run_id for r in runs if r.status == "running"]
        wanted = live[0] if live else ids[0]
    if st.session_state.get("run_picker") not in by_id:
        st.session_state["run_picker"] = wanted
    chosen = st.sidebar.selectbox(
        "Run", ids, key="run_picker", format_func=lambda i: _run_label(by_id[i])
    )
    st.session_state["rw_run_id"] = chosen
    return chosen


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
    st.session_state["rw_db"] = opts.db
    st.session_state["rw_read_only"] = opts.read_only
    nav = st.navigation(_pages())

    with st.sidebar:
        st.markdown("**Rampwatch**")
        st.caption(f"Database: `{opts.db}`" if opts.db else "Database: none")
        if opts.read_only:
            st.caption(":lock: read-only: no controls, nothing is written")

    problem = store_access.options_problem(opts) or store_access.db_problem(opts.db)
    if problem is not None and problem.fatal:
        st.session_state["rw_run_id"] = None
        st.title("Rampwatch")
        st.error(problem.message, icon=":material/error:")
    elif problem is not None:
        st.session_state["rw_run_id"] = None
        st.title("Rampwatch")
        st.info(problem.message, icon=":material/info:")

        @st.fragment(run_every=5)
        def _wait_for_runs():
            if store_access.db_problem(opts.db) is None:
                st.rerun(scope="app")

        _wait_for_runs()
    else:
        runs = store_access.list_runs(opts.db)
        _pick_run(runs)
        nav.run()


if __name__ == "__main__":
    main()
