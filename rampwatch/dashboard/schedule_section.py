"""The live page's schedule section, drawn: the chart (charts.schedule_figure), the steps and
hours table (dashboard/run_schedule.py `rows`), and the hand plan's text field.

The plan's text is kept in the page's address (`?run=ID&plan=TEXT`, and `&db=FILE` when the
dashboard serves several files: dashboard/sources.py), so a
reload or a shared link brings it back. It is the browser's: nothing of it is stored in the
database, and another browser sees only its own. The field starts from the address when the
address names this run (or no run), and is kept per run for the session. A step of the plan the
run has reached is offered on the card (run_schedule.with_plan_step); this section says so.
Keys: the field "rw_plan:<run key>" (the run id for the only file), "chart_schedule", "schedule_table".
"""

from __future__ import annotations

import streamlit as st

from rampwatch.dashboard import charts, run_schedule
from rampwatch.dashboard.run_schedule import ScheduleView
from rampwatch.dashboard.sources import DB_PARAM, RUN_PARAM, run_key

PLAN_PARAM = "plan"  # the address's query parameter (beside the run's: dashboard/sources.py)
EXAMPLE = "2M → 4M at 70% → 8M at 90%"


def _key(run_id: str, file: str = "") -> str:
    return f"rw_plan:{run_key(file, run_id)}"


def plan_text(run_id: str, file: str = "") -> str:
    """The hand plan as typed for this run (of this file): the session's, else the address's
    when it names this run or none."""
    key, q = _key(run_id, file), st.query_params
    if key not in st.session_state:
        ours = q.get(RUN_PARAM) in (None, run_id) and q.get(DB_PARAM) in (None, file or None)
        st.session_state[key] = q.get(PLAN_PARAM, "") if ours else ""
    return st.session_state[key]


def _keep_in_url(run_id: str, file: str = "") -> None:
    text = (st.session_state.get(_key(run_id, file)) or "").strip()
    if text:
        st.query_params[PLAN_PARAM] = text
        st.query_params[RUN_PARAM] = run_id
        if file:
            st.query_params[DB_PARAM] = file
        elif DB_PARAM in st.query_params:
            del st.query_params[DB_PARAM]
    elif PLAN_PARAM in st.query_params:
        del st.query_params[PLAN_PARAM]


def _figure(view: ScheduleView):
    p, plan = view.projection, view.plan
    return charts.schedule_figure(
        view.run_x,
        view.run_y,
        view.now_tokens,
        view.budget,
        p.central.points() if p else None,
        p.early.points() if p else None,
        p.late.points() if p else None,
        plan.points() if plan else None,
    )


def render(view: ScheduleView, *, run_id: str, file: str = "") -> None:
    st.subheader("Schedule")
    with st.container(border=True):
        if view.stopped:
            st.info(view.stopped, icon=":material/stop_circle:")
        for problem in view.problems:
            st.info(problem, icon=":material/info:")
        if view.constant is None:
            return
        st.plotly_chart(_figure(view), key="chart_schedule")
        st.dataframe(
            run_schedule.rows(view),
            hide_index=True,
            key="schedule_table",
            column_config={"why unknown": st.column_config.TextColumn(width="large")},
        )
        p = view.projection
        if p is not None:
            st.caption(_projection_words(p))
        _plan_field(view, run_id, file)


def _projection_words(p) -> str:
    """How the projection was made, first ramp and range included (advisor/schedule.py)."""
    law = f"the noise scale extrapolated as a power of the tokens seen ({'; '.join(p.notes)})"
    if p.first is None or p.first.floor:
        made, range_is = f"{law}, a ramp where it reaches the ramp point", "the fit's slope"
        if p.first is not None:
            made += f", the {p.first.note}"
    else:
        made = f"the {p.first.note}; after it, {law}, a ramp where it reaches the ramp point"
        range_is = (
            "the card's for the first ramp (the law's own first crossing held less often on "
            "recorded runs), then the fit's slope"
        )
    return (
        f"Projected: {made}. The range is {range_is} ± 1.645 standard errors (early: steeper, "
        "late: flatter): it takes correlated estimates for independent ones and is narrower "
        "than the truth; a noise scale that levels off comes later than projected, or never. "
        "Hours from the tier table's throughput."
    )


def _plan_field(view: ScheduleView, run_id: str, file: str) -> None:
    st.text_input(
        "Hand plan",
        key=_key(run_id, file),
        placeholder=EXAMPLE,
        on_change=_keep_in_url,
        args=(run_id, file),
        help="batches in tokens per step (K = 1,024, M = 1,024²) or sequences ('1024 seq'); "
        "points 'at N%' of the token budget, 'at N tokens' or 'at N steps'",
    )
    if view.plan_error:
        st.error(f"Hand plan not read: {view.plan_error}", icon=":material/error:")
    elif view.plan is not None:
        st.caption(f"Read as: {view.plan.words()}.")
    due = view.due
    if due is not None:
        words = due.words(view.plan)
        if due.tier is not None:
            o = due.tier.option
            st.info(
                f"{words[0].upper()}{words[1:]} is due: the card offers it as ×{o.factor:g}, "
                f"{o.tier.per_device_batch} × {o.tier.accum}, under Approve.",
                icon=":material/event_available:",
            )
        else:
            st.warning(f"{words[0].upper()}{words[1:]} is due, but {due.why_not}.")
    st.caption(
        "The plan is kept in this page's address, so a reload or a shared link keeps it; it is "
        "this browser's, not stored in the database. Each step is approved on the card when the "
        "run reaches it."
    )
