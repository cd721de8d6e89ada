"""Live run page: one run's charts and the recommendation card, refreshed in place.

Thin page: dashboard/live_data.py fetches (incrementally, inside an st.fragment that reruns every few
seconds while the run is live), dashboard/recommend.py decides, dashboard/charts.py and dashboard/card.py draw.
Charts: loss (raw faint + debiased EMA, validation), gradient norm, noise scale vs batch,
memory vs capacity with each tier's predicted peak, tokens/s and MFU; events on every chart;
then "More charts": the run's own metrics as they appear, any other on request.
Under the card the schedule (dashboard/run_schedule.py builds, schedule_section.py draws: the
projected ramps, a hand plan kept in the URL, steps and hours), then the ramp trials' section
(latest trial, its arms' chart, earlier trials). Below them the events, and the run's refused
writes (when there are any).
"""

from __future__ import annotations

import time

import streamlit as st

from rampwatch.dashboard import card as card_view
from rampwatch.dashboard import (
    charts,
    live_data,
    recommend,
    run_schedule,
    schedule_section,
    store_access,
)
from rampwatch.store import names as M
from rampwatch.store.naming import display_name, markdown_literal

REFRESH_CHOICES = {"off": None, "2 s": 2, "5 s": 5, "10 s": 10, "30 s": 30}
MORE = "more_charts"  # the "More charts" multiselect: metrics charted below the fixed charts

db, run_id, read_only = store_access.page_context()
file = st.session_state.get("rw_file") or ""  # the run's file among several ('' for the only one)

with st.sidebar:
    smoothing = st.slider(
        "Loss smoothing (EMA weight)",
        0.0,
        0.99,
        0.9,
        0.01,
        key="smoothing",
        help="debiased exponential moving average; 0 = raw",
    )
    refresh_label = st.selectbox("Refresh", list(REFRESH_CHOICES), index=2, key="refresh")


def _age(t: float | None) -> str:
    if t is None:
        return "never"
    s = max(0.0, time.time() - t)
    if s < 120:
        return f"{s:.0f} s ago"
    return f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _header(snap: live_data.Snapshot) -> None:
    run = snap.run
    tokens = snap.latest.get(M.TOKENS_SEEN)
    st.title(markdown_literal(display_name(run.name or run.run_id)))
    step = run.last_step if run.last_step is not None else "—"
    bits = [
        f"status **{run.status}**",
        f"step **{step}**",
        f"device {run.device or '?'}",
        f"heartbeat {_age(run.heartbeat)}",
        f"id `{display_name(run.run_id)}`",
    ]
    if file:
        bits.append(f"file `{display_name(file)}`")
    if tokens:
        bits.insert(2, f"tokens **{tokens:,.0f}**")
    st.markdown(" · ".join(bits))
    stale, lost, alerts = st.empty(), st.empty(), st.container()
    dead = store_access.dead_writer_notes(db, run.run_id)
    if dead:  # the next writer would ingest them, but read-only mode never will
        stale.warning(" ".join(n + "." for n in dead), icon=":material/warning:")
    elif run.status == "stale":
        stale.warning(
            "No heartbeat from this run's writer: it may have died. Its last data is "
            "shown; the next writer to open the database marks it killed."
        )
    n_lost = store_access.lost_records(snap.events)
    if n_lost:
        lost.warning(
            f"{n_lost:,} records of this run never reached the database (dropped by "
            "the writer or lost to a damaged spool): the charts have gaps there. The "
            "alert events below say which and why.",
            icon=":material/warning:",
        )
    newest = int(snap.gns_steps[-1]) if len(snap.gns_steps) else None
    with alerts:
        for e in store_access.active_alerts(snap.events, run.last_step, newest)[:4]:
            what = "Out of memory" if e["kind"] == M.EVENT_OOM else "Alert"
            st.warning(
                f"**{what} at step {e['step']:,}:** {e['message']}", icon=":material/warning:"
            )


def _charts(snap: live_data.Snapshot, card: recommend.Card) -> None:
    s, ev = snap.series, snap.events
    left, right = st.columns(2)
    with left:
        st.plotly_chart(
            charts.loss_figure(s.get(M.LOSS), s.get(M.VAL_LOSS), smoothing, ev), key="chart_loss"
        )
        st.plotly_chart(charts.grad_norm_figure(s.get(M.GRAD_NORM), ev), key="chart_grad_norm")
        st.plotly_chart(
            charts.throughput_figure(s.get(M.TOKENS_PER_S), s.get(M.MFU), ev),
            key="chart_throughput",
        )
    with right:
        st.plotly_chart(
            charts.noise_figure(
                s.get(M.GNS), s.get(M.BATCH_SEQS), ev, s.get(M.GNS_LOW), s.get(M.GNS_HIGH)
            ),
            key="chart_noise",
        )
        st.plotly_chart(
            charts.memory_figure(
                s.get(M.MEM_PEAK),
                s.get(M.MEM_CAPACITY),
                [t.chart_line() for t in card.tiers],
                ev,
                card.usable_bytes,
            ),
            key="chart_memory",
        )


def _offered(snap: live_data.Snapshot) -> list[str]:
    """The run's metrics that the fixed charts do not draw."""
    return [n for n in snap.names if n not in live_data.LIVE_METRICS]


def _more_chosen(snap: live_data.Snapshot) -> list[str]:
    """The "More charts" choice for this run, before its widget is drawn: the run's own metrics
    (not the monitor's: mon.log, extra=, a framework's validation) are added the first time
    each appears; one taken out stays out; a name this run lacks is dropped."""
    offered = _offered(snap)
    seen = st.session_state.setdefault("_rw_more_seen", {}).setdefault(snap.run.run_id, set())
    new_own = [n for n in offered if n not in seen and n not in M.MONITOR_METRICS]
    seen.update(offered)
    before = list(st.session_state.get(MORE, []))
    chosen = [n for n in before if n in offered] + new_own
    if chosen != before:
        st.session_state[MORE] = chosen  # allowed: the widget is not drawn yet in this run
    return chosen


def _more_charts(snap: live_data.Snapshot) -> None:
    """The run's other metrics, one chart each, as chosen in the multiselect."""
    offered = _offered(snap)
    if not offered:
        return
    chosen = st.multiselect(
        "More charts",
        offered,
        key=MORE,
        help="the run's other metrics: its own (logged by the loop or its validation) are "
        "added as they appear; the monitor's (lr, step time, memory detail, the noise "
        "scale's parts) on request",
    )
    columns = st.columns(2)
    for i, name in enumerate(chosen):
        with columns[i % 2]:
            figure = charts.metric_figure(snap.series.get(name), name, snap.events)
            st.plotly_chart(figure, key=f"chart_more_{name}")


def _events_table(snap: live_data.Snapshot) -> None:
    with st.expander(f"Events ({len(snap.events)})", expanded=False):
        if not snap.events:
            st.caption("No events yet (ramps, OOM recoveries, checkpoints, alerts appear here).")
            return
        st.dataframe(
            [
                {"step": e["step"], "kind": e["kind"], "message": e["message"]}
                for e in reversed(snap.events)
            ],
            hide_index=True,
            key="events_table",
            column_config={"message": st.column_config.TextColumn(width="large")},
        )


def _refusals_table() -> None:
    rows = store_access.refusals(db, run_id)
    if not rows:
        return
    with st.expander(f"Refused writes ({len(rows)})", expanded=False):
        st.caption(
            "Approve / Cancel clicks this dashboard refused (a wrong or missing token or "
            "operator name): the name as typed (never the token), the "
            "client's address where known, and why."
        )
        st.dataframe(
            [{**r, "t": _when(r["t"])} for r in rows],
            hide_index=True,
            key="refusals_table",
            column_config={"reason": st.column_config.TextColumn(width="large")},
        )


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


_status = next((r.status for r in store_access.list_runs(db) if r.run_id == run_id), None)
interval = REFRESH_CHOICES[refresh_label] if _status in ("running", "stale") else None


@st.fragment(run_every=interval)
def live_view() -> None:
    top, note = st.container(), st.empty()  # the header, once the run is read; a status line
    card_view.send_pending(note)  # a click's approval first: the card below then shows it
    try:
        snap = live_data.live_snapshot(db, run_id, st.session_state.get(MORE, ()))
        more = _more_chosen(snap)
        if any(n not in snap.series for n in more):  # chosen just now: fetch their series too
            snap = live_data.live_snapshot(db, run_id, more)
    except store_access.RunNotFoundError:
        st.warning(
            f"Run {display_name(run_id)} is no longer in the database (it was deleted). Pick "
            "another run in the sidebar."
        )
        return
    except store_access.DatabaseCorruptError as e:  # not passing: the Runs page lists it now
        st.error(store_access.note_damaged(db, e).message, icon=":material/error:")
        return
    except store_access.StoreError as e:
        st.info(f"Could not refresh: {e}")
        return
    card = recommend.card_of(snap)
    schedule = run_schedule.build_schedule(
        snap, card, schedule_section.plan_text(snap.run.run_id, file)
    )
    card = run_schedule.with_plan_step(card, schedule)  # a due hand-plan step, under Approve
    with top:
        _header(snap)
    if snap.busy:  # the status line is always there, so the elements below keep their places
        note.caption(f"Showing the previous refresh: {snap.busy}")
    trial = recommend.build_trial_card(
        snap.run.config,
        card.tokens_per_s,
        store_access.trial_refusal(snap.run.config),
        card.end_tokens,
        snap.commands,
        snap.trials,
        snap.trial_points,
    )
    card_view.render(card, db=db, run=snap.run, read_only=read_only, trial=trial)
    schedule_section.render(schedule, run_id=snap.run.run_id, file=file)
    card_view.render_trial(trial, run=snap.run)
    _charts(snap, card)
    _more_charts(snap)
    _events_table(snap)
    _refusals_table()


live_view()
