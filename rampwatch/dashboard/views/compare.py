"""Compare page: several runs side by side.

Thin page: choose runs; overlay any metric against step, tokens or time; the config keys that
differ; steps, tokens and time to a chosen loss; and, with >= 3 runs at different constant batch
sizes, the critical batch from S = S_min(1 + B_crit/B). Data via dashboard/store_access.py (the
chosen runs' metric names in one query, their curves in one read session, kept per session and
refreshed only for runs that changed; from several files, dashboard/sources.py), arithmetic in dashboard/comparison.py, the figure in
dashboard/charts.py.
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from rampwatch.dashboard import charts, comparison, sources
from rampwatch.store import names as M
from rampwatch.store.naming import display_name

cat, current, _ = sources.page_catalog()

st.title("Compare runs")
refs = cat.refs()
by_key = {ref.key: ref for ref in refs}  # a run is its file and its id (sources.run_key)
clashes = cat.clashing_ids()
default = [current] if current in by_key else []
default += [k for k in by_key if k not in default][: max(0, 6 - len(default))]
if "compare_runs" in st.session_state:
    st.session_state["compare_runs"] = [k for k in st.session_state["compare_runs"] if k in by_key]


def _label(key: str) -> str:
    ref = by_key[key]
    label = f"{display_name(ref.run.name or ref.run_id)} ({ref.run.status})"
    return f"{label} · {display_name(ref.file)}" if ref.run_id in clashes else label


chosen = st.multiselect(
    "Runs", list(by_key), default=default, key="compare_runs", format_func=_label
)
if not chosen:
    st.info("Choose one or more runs to compare.")
    st.stop()

# legends, captions and table columns: names shown safely; two that read alike get their ids
runs = {k: by_key[k].run for k in chosen}
labels = {k: display_name(runs[k].name or runs[k].run_id) for k in chosen}
if len(set(labels.values())) < len(labels):
    labels = {k: f"{labels[k]} ({display_name(runs[k].run_id)})" for k in chosen}
if len(set(labels.values())) < len(labels):  # the same id in two files: name the file too
    labels = {k: f"{labels[k][:-1]}, {display_name(by_key[k].file)})" for k in chosen}


def _readable(keys: list[str]) -> list[str]:
    """The runs whose files no read has found damaged; a warning for each file that was."""
    bad = sources.damaged([by_key[k] for k in keys])
    for why in bad.values():
        st.warning(f"Left out: {why}", icon=":material/error:")
    return [k for k in keys if by_key[k].db not in bad]


names = sources.metric_names([by_key[k] for k in chosen])
chosen = _readable(chosen)
if not chosen:
    st.stop()
if not names:
    st.info("The chosen runs have not logged any metrics yet.")
    st.stop()
c1, c2, c3 = st.columns([2, 2, 2])
metric = c1.selectbox(
    "Metric", names, index=names.index(M.LOSS) if M.LOSS in names else 0, key="compare_metric"
)
axis = c2.radio("Against", ["step", "tokens", "time"], horizontal=True, key="compare_x")
smoothing = c3.slider(
    "Smoothing (EMA weight)",
    0.0,
    0.99,
    0.9,
    0.01,
    key="compare_smoothing",
    help="debiased EMA, as on the live page; 0 = raw. The same smoothing picks "
    "when each run reaches the target loss below.",
)

AUX = (M.LOSS, M.TOKENS_SEEN, M.STEP_TIME, M.BATCH_SEQS)  # the axes and the target table
data = sources.series_of([by_key[k] for k in chosen], (metric, *AUX))
chosen = _readable(chosen)  # a read of the curves may find damage the names' did not
if not chosen:
    st.stop()
curves, time_how = [], set()
for rid in chosen:
    b = data[rid][metric]
    if not len(b):
        continue
    y = (
        comparison.debiased_ema(b.last, smoothing, counts=np.maximum(b.n - b.nonfinite, 1))
        if smoothing > 0
        else np.where(np.isfinite(b.last), b.last, np.nan)
    )
    x = b.steps.astype(np.float64)
    if axis == "tokens":
        x = comparison.tokens_at(b.steps, data[rid][M.TOKENS_SEEN])
    elif axis == "time":
        x, how = comparison.elapsed_at(b.steps, data[rid][M.STEP_TIME])
        time_how.add(how)
    if x is None:
        st.caption(
            f"{labels[rid]}: no {'tokens_seen' if axis == 'tokens' else 'step_time'} logged, "
            "left out of this axis"
        )
        continue
    nf = b.nonfinite > 0
    curves.append(
        {
            "name": labels[rid],
            "x": x,
            "y": y,
            "nonfinite_x": x[nf],
            "nonfinite_y": np.where(np.isfinite(b.hi[nf]), b.hi[nf], 0.0),
        }
    )
x_title = {"step": "step", "tokens": "tokens", "time": "seconds"}[axis]
st.plotly_chart(charts.overlay_figure(curves, metric, x_title), key="chart_compare")
if axis == "time" and time_how:
    st.caption("Time axis: " + ", ".join(sorted(time_how)) + ".")

st.subheader("Config differences")
diff = comparison.config_diff({labels[rid]: runs[rid].config for rid in chosen})
if len(chosen) < 2:
    st.caption("Choose at least two runs to see what differs.")
elif not diff:
    st.caption("The chosen runs have identical configs.")
else:
    st.dataframe(diff, hide_index=True, key="config_diff")

st.subheader("Steps, tokens and time to a target loss")
loss = {rid: data[rid][M.LOSS] for rid in chosen}
aux = {rid: tuple(data[rid][n] for n in AUX[1:]) for rid in chosen}
t_smooth = smoothing  # one smoothing for the curves and the target, said in the table
probe = [comparison.to_target(labels[r], loss[r], -np.inf, t_smooth) for r in chosen]
default_target = comparison.default_target([p.best for p in probe])
if default_target is None:
    st.info("None of the chosen runs has a finite loss yet.")
    st.stop()
target = st.number_input(
    "Target loss", value=float(default_target), step=0.01, format="%.4f", key="target_loss"
)
rows = [
    comparison.to_target(
        labels[r], loss[r], target, t_smooth, *aux[r][:2], batch=aux[r][2], config=runs[r].config
    )
    for r in chosen
]
st.dataframe(
    [
        {
            "run": r.label,
            "batch (sequences)": r.batch_text,
            "reached": "yes" if r.reached else "no",
            "steps": r.step,
            "tokens": None if r.tokens is None else int(r.tokens),
            "time (s)": None if r.seconds is None else round(r.seconds, 1),
            "best smoothed loss": None if r.best is None else round(r.best, 4),
        }
        for r in rows
    ],
    hide_index=True,
    key="target_table",
    column_config={"tokens": st.column_config.NumberColumn(format="localized")},  # as on Runs
)
fit = comparison.critical_batch(rows, target)
if fit.b_crit is not None:
    a, b = st.columns(2)
    a.metric("Critical batch B_crit", f"{fit.b_crit:,.1f} sequences")
    b.metric("S_min (steps at infinite batch)", f"{fit.s_min:,.0f}")
    st.caption(f"S = S_min(1 + B_crit/B), {fit.message} (McCandlish et al. 2018, §2.3).")
else:
    st.info(f"No critical-batch fit: {fit.message}.")
