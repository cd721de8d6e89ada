"""Runs page: every run in the database, its status and summary, and export of its raw rows.

Thin page: store.reader.Run rows via dashboard/store_access.py (status 'stale' when a running
run's writer is gone), each run's summary (tokens, best loss, peak memory, alerts, lost records:
one read session for all runs) and refused writes, a
note for each dead writer whose spool waits for `rampwatch recover`, and CSV / Parquet export
through st.download_button (the file is built only when the button is clicked).
"""

from __future__ import annotations

import datetime as dt
import re
import time

import streamlit as st

from rampwatch.dashboard import store_access
from rampwatch.store.naming import display_name

db, current, _ = store_access.page_context(need_run=False)

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
runs = store_access.list_runs(db)
refused = store_access.refusal_counts(db)
summaries = store_access.run_summaries(db)
rows = []
for r in runs:
    s = summaries.get(r.run_id, store_access.NO_SUMMARY)
    rows.append(
        {
            "name": display_name(r.name or r.run_id),
            "status": r.status,
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
            "refused writes": refused.get(r.run_id, 0),
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
for note in store_access.dead_writer_notes(db):  # the dashboard never recovers: say who can
    st.warning(note + ".", icon=":material/warning:")
lossy = [row["name"] for row in rows if row["lost records"]]
if lossy:
    st.warning(
        f"{len(lossy)} run(s) lost records before they reached the database "
        f"({', '.join(lossy[:5])}{' …' if len(lossy) > 5 else ''}): see the alert events "
        "on their live page.",
        icon=":material/warning:",
    )

st.subheader("Export")
by_id = {r.run_id: r for r in runs}
c1, c2, c3 = st.columns([3, 1, 2])
rid = c1.selectbox(
    "Run to export",
    list(by_id),
    key="export_run",
    index=list(by_id).index(current) if current in by_id else 0,
    format_func=lambda i: f"{display_name(by_id[i].name or i)} ({display_name(i)})",
)
fmt = c2.radio("Format", ["CSV", "Parquet"], key="export_format", horizontal=True)
ext, mime = ("csv", "text/csv") if fmt == "CSV" else ("parquet", "application/vnd.apache.parquet")
c3.download_button(
    f"Download {fmt}",
    data=lambda: store_access.export_bytes(db, rid, ext),
    file_name=re.sub(
        r"[/\\]", "_", f"{display_name(by_id[rid].name or rid, 80)}-{display_name(rid)}.{ext}"
    ),
    mime=mime,
    key="export_download",
    on_click="ignore",
)
st.caption("Every raw metric row of the run: run_id, step, t (unix seconds), name, value.")
