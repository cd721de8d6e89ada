"""Runs page: every run in the database (or in each database of a directory), its status and
summary, and export of its raw rows.

Thin page: store.reader.Run rows of every file via dashboard/sources.py and store_access.py
(status 'stale' when a running run's writer is gone), each run's summary (tokens, best loss,
peak memory, alerts, lost records: one read session per file for all its runs) and refused
writes, a line for each file that could not be read (damaged, foreign, newer schema) or has no
runs yet, a note for each dead writer whose spool waits for `rampwatch recover`, and CSV /
Parquet export through st.download_button (the file is built only when the button is clicked).
With several files the table has a file column.
"""

from __future__ import annotations

import datetime as dt
import re
import time

import streamlit as st

from rampwatch.dashboard import sources, store_access
from rampwatch.store.naming import display_name, markdown_literal

cat, current, _ = sources.page_catalog()

STATUS_HELP = (
    "running: its writer is alive · stale: marked running but no heartbeat or no live "
    "writer (crashed?) · finished / failed: ended by the trainer · killed: its writer "
    "died and recovery closed it at its last step"
)


def _when(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _duration(r) -> str | None:
    end = r.ended_at or r.heartbeat or (time.time() if r.status == "running" else None)
    if end is None:
        return None
    s = max(0.0, end - r.created_at)
    return f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{int(s % 60):02d}"


st.title("Runs")
refs = cat.refs()
files = {f.path: f for f in cat.files if f.runs}
refused = {db: store_access.refusal_counts(db) for db in files}
summaries = {db: store_access.run_summaries(db) for db in files}
if sources.damaged(refs):  # a read found a file damaged: list it with its problem instead
    st.rerun()
rows = []
for ref in refs:
    r = ref.run
    s = summaries[ref.db].get(r.run_id, store_access.NO_SUMMARY)
    rows.append(
        {
            "name": display_name(r.name or r.run_id),
            # beside the name: which node's file a run is in is what a team scans for
            **({} if cat.single else {"file": display_name(ref.file)}),
            "status": r.status,
            "world size": r.world_size,  # in view: a team scans for its multi-device runs
            "started": _when(r.created_at),
            "duration": _duration(r),
            "steps": r.last_step,
            "tokens": s["tokens"],
            "best loss (raw)": None if s["best_loss"] is None else round(s["best_loss"], 4),
            "peak memory (GB)": None
            if s["peak_bytes"] is None
            else round(s["peak_bytes"] / 1e9, 2),
            "alerts": s["alerts"],
            "lost records": s["lost_records"],
            "refused writes": refused[ref.db].get(r.run_id, 0),
            "device": r.device,
            "run id": display_name(r.run_id),
        }
    )
st.dataframe(
    rows,
    hide_index=True,
    key="runs_table",
    column_config={"tokens": st.column_config.NumberColumn(format="localized")},
)
st.caption(STATUS_HELP)
for bad, note in [] if cat.single else sources.file_notes(cat):  # one file: shown by app.py
    (st.warning if bad else st.info)(note, icon=":material/warning:" if bad else None)
for db in files:  # the dashboard never recovers: say who can
    for note in store_access.dead_writer_notes(db):
        st.warning(note + ".", icon=":material/warning:")
lossy = [row["name"] for row in rows if row["lost records"]]
if lossy:
    st.warning(
        f"{len(lossy)} run(s) lost records before they reached the database "
        f"({markdown_literal(', '.join(lossy[:5]))}{' …' if len(lossy) > 5 else ''}): see the alert events "
        "on their live page.",
        icon=":material/warning:",
    )

st.subheader("Export")
by_key = {ref.key: ref for ref in refs}
clashes = cat.clashing_ids()


def _export_label(k: str) -> str:
    r = by_key[k].run
    label = f"{display_name(r.name or r.run_id)} ({display_name(r.run_id)})"
    return f"{label} · {display_name(by_key[k].file)}" if r.run_id in clashes else label


c1, c2, c3 = st.columns([3, 1, 2])
key = c1.selectbox(
    "Run to export",
    list(by_key),
    key="export_run",
    index=list(by_key).index(current) if current in by_key else 0,
    format_func=_export_label,
)
ref = by_key[key]
fmt = c2.radio("Format", ["CSV", "Parquet"], key="export_format", horizontal=True)
ext, mime = ("csv", "text/csv") if fmt == "CSV" else ("parquet", "application/vnd.apache.parquet")
c3.download_button(
    f"Download {fmt}",
    data=lambda: store_access.export_bytes(ref.db, ref.run_id, ext),
    file_name=re.sub(
        r"[/\\]",
        "_",
        f"{display_name(ref.run.name or ref.run_id, 80)}-{display_name(ref.run_id)}.{ext}",
    ),
    mime=mime,
    key="export_download",
    on_click="ignore",
)
st.caption("Every raw metric row of the run: run_id, step, t (unix seconds), name, value.")
