"""Plotly figures the pages draw, built from plain arrays and `Buckets` (no store, no Streamlit).

Owns: every figure of the live page (loss, gradient norm, noise scale vs batch, memory vs
capacity with tier lines, throughput/MFU, a ramp trial's arms, the whole run's schedule), the
compare overlay, and the shared pieces: a
downsampled series as a min/max band plus a last-value line, non-finite values as markers
(never gaps), and events as vertical markers with a hover label.

Trace names are part of the contract with the tests (tests/test_pages_live.py reads them from the
figure JSON): "<label>" for a series' line, "<label> range" for its band, "<label> non-finite"
for its markers, "events" for the event hover trace; event lines are layout shapes named
"event:<kind>". The noise chart adds "90% interval" (its band's two edges) and "lower bound only".
The schedule chart's traces are "run so far", "projected", "projected range" (its band's two
edges), "hand plan"; its vertical lines are the shapes "budget" and "now".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from rampwatch.advisor.hand_plan import format_batch
from rampwatch.advisor.memory import GB
from rampwatch.dashboard.buckets import Buckets
from rampwatch.dashboard.smoothing import debiased_ema

HEIGHT = 340
THROUGHPUT_SMOOTHING = 0.9  # debiased EMA weight per step: step times are noisy on a CPU
EVENT_COLORS = {
    "ramp": "#2ca02c",
    "oom": "#d62728",
    "refused": "#ff7f0e",
    "resume": "#9467bd",
    "alert": "#e377c2",
    "checkpoint": "#b0b0b0",
}
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def empty_figure(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, height=HEIGHT, margin=dict(l=50, r=20, t=40, b=30))
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _base(title: str, y_title: str, x_title: str = "step") -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        title=dict(text=title, x=0.01, font=dict(size=14)),
        height=HEIGHT,
        margin=dict(l=55, r=20, t=36, b=40),
        hovermode="x unified",
        legend=dict(
            orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0.0, font=dict(size=11)
        ),
        yaxis=dict(title=y_title),
        xaxis=dict(title=dict(text=x_title, standoff=4)),
    )
    return fig


def nonfinite_positions(
    b: Buckets, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, count) for buckets holding non-finite values: placed on the curve (the bucket's
    last finite figure, else the nearest earlier one), so they sit where the gap would be."""
    mask = b.nonfinite > 0
    if not mask.any():
        return np.zeros(0), np.zeros(0), np.zeros(0, np.int64)
    cand = np.where(np.isfinite(b.last), b.last, b.hi)
    idx = np.where(np.isfinite(cand), np.arange(len(cand)), -1)
    np.maximum.accumulate(idx, out=idx)
    finite = cand[np.isfinite(cand)]
    fallback = finite[0] if finite.size else 0.0
    y = np.where(idx >= 0, cand[np.maximum(idx, 0)], fallback)
    return b.steps[mask], y[mask] * scale, b.nonfinite[mask]


def series_traces(
    b: Buckets,
    label: str,
    color: str,
    *,
    scale: float = 1.0,
    opacity: float = 1.0,
    band: bool = True,
    shape: str = "linear",
    yaxis: str = "y",
    width: float = 1.5,
) -> list[go.Scatter]:
    """A downsampled series: min/max band (when buckets hold > 1 step), last line, non-finite x's."""
    traces: list[go.Scatter] = []
    x = b.steps
    if band and b.width > 1 and len(b):
        traces.append(
            go.Scatter(
                x=x,
                y=b.lo * scale,
                mode="lines",
                line=dict(width=0),
                name=f"{label} range",
                legendgroup=label,
                showlegend=False,
                hoverinfo="skip",
                yaxis=yaxis,
            )
        )
        traces.append(
            go.Scatter(
                x=x,
                y=b.hi * scale,
                mode="lines",
                line=dict(width=0),
                fill="tonexty",
                fillcolor=_rgba(color, 0.18 * opacity + 0.05),
                name=f"{label} range",
                legendgroup=label,
                showlegend=False,
                hoverinfo="skip",
                yaxis=yaxis,
            )
        )
    y = np.where(np.isfinite(b.last), b.last, np.nan) * scale
    traces.append(
        go.Scatter(
            x=x,
            y=y,
            mode="lines",
            name=label,
            legendgroup=label,
            line=dict(color=color, width=width, shape=shape),
            opacity=opacity,
            connectgaps=True,
            yaxis=yaxis,
        )
    )
    nx, ny, nc = nonfinite_positions(b, scale)
    if len(nx):
        traces.append(
            go.Scatter(
                x=nx,
                y=ny,
                mode="markers",
                name=f"{label} non-finite",
                yaxis=yaxis,
                marker=dict(symbol="x", size=10, color="#d62728", line=dict(width=2)),
                text=[f"{int(c)} non-finite value(s)" for c in nc],
                hovertemplate="%{text}",
            )
        )
    return traces


def add_raw_and_smoothed(
    fig: go.Figure, b: Buckets, raw: str, smoothed: str, color: str, weight: float
) -> None:
    """A noisy series as its faint raw traces under a debiased EMA line (each bucket decays the
    average by the finite steps it holds)."""
    for tr in series_traces(b, raw, color, opacity=0.35, width=1):
        fig.add_trace(tr)
    smooth = debiased_ema(b.last, weight, counts=np.maximum(b.n - b.nonfinite, 1))
    fig.add_trace(
        go.Scatter(
            x=b.steps, y=smooth, mode="lines", name=smoothed, line=dict(color=color, width=2.2)
        )
    )


def add_events(fig: go.Figure, events: Sequence[Mapping]) -> int:
    """Vertical line per event (shape 'event:<kind>') and one hover trace 'events'; returns count."""
    pts = [e for e in events if e.get("step") is not None]
    shapes = [
        dict(
            type="line",
            x0=e["step"],
            x1=e["step"],
            xref="x",
            yref="paper",
            y0=0,
            y1=1,
            name=f"event:{e.get('kind')}",
            layer="below",
            line=dict(
                color=EVENT_COLORS.get(str(e.get("kind")), "#7f7f7f"),
                width=1.5,
                dash="solid" if e.get("kind") in ("ramp", "oom") else "dot",
            ),
        )
        for e in pts
    ]
    if shapes:  # one layout update: add_shape per event re-validates the layout each time
        fig.update_layout(shapes=list(fig.layout.shapes) + shapes)
    if pts:
        fig.add_trace(
            go.Scatter(
                x=[e["step"] for e in pts],
                y=[1.0] * len(pts),
                yaxis="y9",
                mode="markers",
                name="events",
                showlegend=False,
                marker=dict(
                    symbol="triangle-down",
                    size=9,
                    color=[EVENT_COLORS.get(str(e.get("kind")), "#7f7f7f") for e in pts],
                ),
                text=[
                    f"{e.get('kind')} @ {e['step']}: {str(e.get('message') or '')[:160]}"
                    for e in pts
                ],
                hovertemplate="%{text}<extra></extra>",
            )
        )
        fig.update_layout(
            yaxis9=dict(overlaying="y", range=[0, 1.04], visible=False, fixedrange=True)
        )
    return len(pts)


def loss_figure(
    loss: Buckets | None, val: Buckets | None, smoothing: float, events: Sequence[Mapping] = ()
) -> go.Figure:
    """Raw loss faint (band + last), the debiased EMA of it, validation loss, events."""
    if (loss is None or not len(loss)) and (val is None or not len(val)):
        return empty_figure("Loss", "no loss logged yet")
    fig = _base("Loss", "loss")
    if loss is not None and len(loss):
        add_raw_and_smoothed(fig, loss, "loss (raw)", "loss (smoothed)", PALETTE[0], smoothing)
    if val is not None and len(val):
        for tr in series_traces(val, "val_loss", PALETTE[1], band=False):
            tr.update(mode="lines+markers" if tr.name == "val_loss" else tr.mode)
            fig.add_trace(tr)
    add_events(fig, events)
    return fig


def grad_norm_figure(gn: Buckets | None, events: Sequence[Mapping] = ()) -> go.Figure:
    if gn is None or not len(gn):
        return empty_figure("Gradient norm", "no gradient norm logged yet")
    return metric_figure(gn, "grad_norm", events, "Gradient norm (before clipping)", "‖g‖")


def metric_figure(
    b: Buckets | None,
    name: str,
    events: Sequence[Mapping] = (),
    title: str | None = None,
    y_title: str = "",
    color: str = PALETTE[4],
) -> go.Figure:
    """One metric against step (its band, its last values, events); markers on a sparse one (a
    validation every few hundred steps is a handful of points)."""
    title = name if title is None else title
    if b is None or not len(b):
        return empty_figure(title, f"no {name} logged yet")
    fig = _base(title, y_title)
    for tr in series_traces(b, name, color):
        if tr.name == name and len(b) <= 50:
            tr.update(mode="lines+markers")
        fig.add_trace(tr)
    add_events(fig, events)
    return fig


def noise_figure(
    gns: Buckets | None,
    batch: Buckets | None,
    events: Sequence[Mapping] = (),
    lower: Buckets | None = None,
    upper: Buckets | None = None,
) -> go.Figure:
    """The windowed noise scale B_simple against the effective batch, all in sequences, drawn
    only where the estimator stands behind it: a point where it logged one; its 90% interval
    (the one-sided 95% bounds `lower` and `upper`) as a band where both ends are known; an
    upward marker at the bound where it logged a lower bound and no point (the windowed |G|² is
    not positive: the noise scale is far above the batch). A step logs an estimate only when it
    has a fresh one, so a stretch without estimates breaks the lines instead of joining across."""
    if (gns is None or not len(gns)) and (batch is None or not len(batch)):
        return empty_figure("Noise scale vs batch", "no noise-scale estimate yet")
    fig = _base("Gradient noise scale vs batch", "sequences")
    if lower is not None and upper is not None and len(lower):
        for tr in _interval_band(lower, upper, PALETTE[2]):
            fig.add_trace(tr)
    if gns is not None and len(gns):
        for tr in series_traces(gns, "noise scale (B_simple)", PALETTE[2], band=False):
            if not tr.name.endswith("non-finite"):
                tr.connectgaps = False
                tr.x, tr.y = break_gaps(tr.x, tr.y, _max_gap(gns))
            fig.add_trace(tr)
    if lower is not None and len(lower):
        bound_only = _bound_only(lower, gns)
        if bound_only is not None:
            fig.add_trace(bound_only)
    if batch is not None and len(batch):
        for tr in series_traces(batch, "batch (sequences)", PALETTE[7], band=False, shape="hv"):
            fig.add_trace(tr)
    ticks = _ticks_125(gns, batch, lower, upper)
    fig.update_yaxes(
        type="log",
        tickvals=ticks,
        ticktext=None if ticks is None else [plain_number(v) for v in ticks],
    )
    add_events(fig, events)
    return fig


def _interval_band(lower: Buckets, upper: Buckets, color: str) -> list[go.Scatter]:
    """The 90% interval as a filled band between its ends, at the steps that have both (a lower
    bound of 0 is none; an upper bound not logged is unbounded)."""
    tops = dict(zip(upper.last_step.tolist(), upper.last.tolist(), strict=True))
    both = [
        (s, lo, tops[s])
        for s, lo in zip(lower.last_step.tolist(), lower.last.tolist(), strict=True)
        if lo > 0 and math.isfinite(tops.get(s, math.nan))
    ]
    if not both:
        return []
    x, lo, hi = (np.array(c, dtype=float) for c in zip(*both, strict=True))
    gap = _max_gap(lower)
    edges = [break_gaps(x, lo, gap), break_gaps(x, hi, gap)]
    return [
        go.Scatter(
            x=ex,
            y=ey,
            mode="lines",
            line=dict(width=0),
            connectgaps=False,
            fill="tonexty" if i else None,
            fillcolor=_rgba(color, 0.2),
            name="90% interval",
            legendgroup="90% interval",
            showlegend=bool(i),
            hoverinfo="skip",
        )
        for i, (ex, ey) in enumerate(edges)
    ]


def _bound_only(lower: Buckets, gns: Buckets | None) -> go.Scatter | None:
    """Upward markers at the steps with a lower bound and no point: "at least this much"."""
    points = set() if gns is None else set(gns.last_step.tolist())
    keep = np.array(
        [s not in points and v > 0 for s, v in zip(lower.last_step, lower.last, strict=True)]
    )
    if not keep.any():
        return None
    return go.Scatter(
        x=lower.last_step[keep],
        y=lower.last[keep],
        mode="markers",
        name="lower bound only",
        marker=dict(symbol="triangle-up", size=8, color=PALETTE[2]),
        hovertemplate="noise scale above %{y:,.3g} (95%): no point estimate, the windowed "
        "|G|² is not positive<extra></extra>",
    )


def _max_gap(b: Buckets) -> int:
    """Steps between neighbouring points beyond which the series had no estimate: a few
    buckets' widths (a bucket holds `width` steps), and never less than 5 steps."""
    return max(5, 3 * b.width)


def break_gaps(x, y, max_gap: float) -> tuple[np.ndarray, np.ndarray]:
    """x and y with a NaN point inserted wherever x jumps by more than max_gap, so a line
    drawn with connectgaps=False stops there."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    cut = np.flatnonzero(np.diff(x) > max_gap) + 1
    if not cut.size:
        return x, y
    return np.insert(x, cut, (x[cut - 1] + x[cut]) / 2), np.insert(y, cut, np.nan)


def plain_number(v: float) -> str:
    """A tick label a person reads: 0.0005, 0.5, 20, 5,000 (never 500µ or 5k)."""
    return f"{v:,.0f}" if v >= 1 else f"{v:.10f}".rstrip("0")


def _ticks_125(*series: Buckets | None) -> list[float] | None:
    """1-2-5 ticks spanning the data, for a readable log axis."""
    vals = np.concatenate(
        [np.r_[b.lo, b.hi, b.last] for b in series if b is not None and len(b)] or [np.zeros(0)]
    )
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if not vals.size:
        return None
    lo, hi = math.floor(math.log10(vals.min())), math.ceil(math.log10(vals.max()))
    return [m * 10.0**e for e in range(lo, hi + 1) for m in (1, 2, 5)]


def memory_figure(
    peak: Buckets | None,
    capacity: Buckets | None,
    tiers: Sequence[Mapping] = (),
    events: Sequence[Mapping] = (),
    usable_bytes: float | None = None,
) -> go.Figure:
    """Peak memory against capacity (GB); each tier's predicted peak as a horizontal line.

    tiers: mappings with 'label', 'predicted_bytes' and 'fits' (dashboard/recommend.py TierView).
    """
    if (peak is None or not len(peak)) and not tiers:
        return empty_figure("Memory", "no memory figures logged yet")
    fig = _base("Memory (GB)", "GB")
    xs = [0, 1]
    if peak is not None and len(peak):
        xs = [int(peak.steps[0]), int(peak.steps[-1])]
        for tr in series_traces(peak, "peak memory", PALETTE[0], scale=1 / GB):
            fig.add_trace(tr)
    if capacity is not None and len(capacity):
        for tr in series_traces(
            capacity, "capacity", "#000000", scale=1 / GB, band=False, shape="hv"
        ):
            fig.add_trace(tr)
    if usable_bytes:
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[usable_bytes / GB] * 2,
                mode="lines",
                name="usable",
                line=dict(color="#555555", dash="dot", width=1),
            )
        )
    for t in tiers:
        if t.get("predicted_bytes") is None:
            continue
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[t["predicted_bytes"] / GB] * 2,
                mode="lines",
                name=str(t["label"]),
                line=dict(color="#2ca02c" if t.get("fits") else "#d62728", dash="dash", width=1.2),
            )
        )
    _scale_to_data(fig, peak, capacity, tiers, usable_bytes)
    add_events(fig, events)
    return fig


CAPACITY_OFF_CHART = 4.0  # capacity this many times the data's top: the axis follows the data


def _scale_to_data(
    fig: go.Figure,
    peak: Buckets | None,
    capacity: Buckets | None,
    tiers: Sequence[Mapping],
    usable_bytes: float | None,
) -> None:
    """On a CPU the capacity is the host's RAM, far above the run: then the axis follows the
    run's peak and the tiers, and the capacity is said in a note instead of a line up top."""
    data = [
        float(np.nanmax(peak.hi))
        if peak is not None and len(peak) and np.isfinite(peak.hi).any()
        else 0.0
    ]
    data += [float(t["predicted_bytes"]) for t in tiers if t.get("predicted_bytes")]
    cap = (
        float(np.nanmax(capacity.last))
        if capacity is not None and len(capacity) and np.isfinite(capacity.last).any()
        else None
    )
    top = max(data)
    if cap is None or top <= 0 or cap < CAPACITY_OFF_CHART * top:
        return
    fig.update_yaxes(range=[0, 1.25 * top / GB])
    usable = f", usable {usable_bytes / GB:.1f} GB" if usable_bytes else ""
    fig.add_annotation(
        text=f"capacity {cap / GB:.1f} GB{usable}: off the chart",
        xref="paper",
        yref="paper",
        x=1.0,
        y=1.0,  # in the title's row, right-aligned: clear of the lines and the event markers
        xanchor="right",
        yanchor="bottom",
        yshift=10,
        showarrow=False,
        font=dict(size=11, color="#555555"),
    )


def throughput_figure(
    tps: Buckets | None, mfu: Buckets | None, events: Sequence[Mapping] = ()
) -> go.Figure:
    """Tokens per second (left axis) and MFU in percent (right axis)."""
    if (tps is None or not len(tps)) and (mfu is None or not len(mfu)):
        return empty_figure("Throughput", "no throughput logged yet")
    fig = _base("Throughput", "tokens/s")
    if tps is not None and len(tps):
        add_raw_and_smoothed(
            fig, tps, "tokens/s", "tokens/s (smoothed)", PALETTE[5], THROUGHPUT_SMOOTHING
        )
    if mfu is not None and len(mfu):
        for tr in series_traces(mfu, "MFU (%)", PALETTE[9], scale=100.0, band=False, yaxis="y2"):
            fig.add_trace(tr)
        fig.update_layout(
            yaxis2=dict(title="MFU %", overlaying="y", side="right", rangemode="tozero")
        )
    add_events(fig, events)
    return fig


def overlay_figure(curves: Sequence[Mapping], metric: str, x_title: str) -> go.Figure:
    """One line per run: curves are mappings with 'name', 'x', 'y' (and optional 'nonfinite_x/y')."""
    if not curves:
        return empty_figure(metric, "choose runs that logged this metric")
    fig = _base(f"{metric} by {x_title}", metric, x_title)
    fig.update_layout(height=420)
    for i, c in enumerate(curves):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(
            go.Scatter(
                x=c["x"],
                y=c["y"],
                mode="lines",
                name=str(c["name"]),
                line=dict(color=color, width=1.8),
                connectgaps=True,
            )
        )
        if len(c.get("nonfinite_x", ())):
            fig.add_trace(
                go.Scatter(
                    x=c["nonfinite_x"],
                    y=c["nonfinite_y"],
                    mode="markers",
                    name=f"{c['name']} non-finite",
                    showlegend=False,
                    marker=dict(symbol="x", size=9, color=color),
                )
            )
    return fig


# ---- ramp trials (issue 26) ---------------------------------------------------------------


def trial_figure(points: Sequence) -> go.Figure:
    """A trial's arms from the snapshot: train loss against tokens, one line per arm ("control
    ×1", "branch ×k"), and at each arm's end its held-out loss, the number the verdict judges,
    as a diamond; points are store.reader.TrialPoint (factor, tokens, loss, eval_loss, ...)."""
    title = "Trial arms: loss against tokens from the snapshot"
    train: dict[int, list] = {}
    held_out: dict[int, list] = {}
    for p in points:
        for into, v in ((train, p.loss), (held_out, p.eval_loss)):
            if v is not None and math.isfinite(v):
                into.setdefault(p.factor, []).append((p.tokens, v))
    if not train and not held_out:
        return empty_figure(title, "no arm has logged a loss yet")
    fig = _base(title, "loss", "tokens since the snapshot")
    for i, k in enumerate(sorted(train.keys() | held_out.keys())):
        name, color = ("control ×1" if k == 1 else f"branch ×{k}"), PALETTE[i % len(PALETTE)]
        for xy, held in ((sorted(train.get(k, ())), False), (held_out.get(k, ()), True)):
            if xy:
                fig.add_trace(
                    go.Scatter(
                        x=[x for x, _ in xy],
                        y=[y for _, y in xy],
                        name=f"{name}, held-out" if held else f"{name}, train",
                        legendgroup=name,
                        mode="markers" if held else "lines+markers",
                        marker=dict(symbol="diamond", size=11) if held else None,
                        line=dict(color=color, width=2),
                    )
                )
    return fig


# ---- the whole run's schedule (issue 27) -----------------------------------------------------


def step_xy(points: Sequence[tuple[float, float]], end: float) -> tuple[list, list]:
    """A step line through (start, value) points, each value held until the next start and the
    last until `end`: the corners drawn, so two such lines can be filled between."""
    xs, ys = [], []
    for i, (start, value) in enumerate(points):
        stop = points[i + 1][0] if i + 1 < len(points) else end
        xs += [start, stop]
        ys += [value, value]
    return xs, ys


def schedule_figure(
    run_x: Sequence[float],
    run_y: Sequence[float],
    now: float,
    budget: float,
    projected: Sequence[tuple[float, float]] | None = None,
    early: Sequence[tuple[float, float]] | None = None,
    late: Sequence[tuple[float, float]] | None = None,
    plan: Sequence[tuple[float, float]] | None = None,
) -> go.Figure:
    """Batch (tokens per step) against tokens seen, as step lines: the run so far as logged
    (each step from where it began), the projected schedule from now to the budget with the
    band between its early and late forms, the hand plan dashed over the whole budget, and the
    budget and now as vertical lines. Schedules are (start tokens, batch tokens) points."""
    title = "Schedule: batch vs tokens seen"
    if not len(run_x) and not projected and not plan:
        return empty_figure(title, "no batch or schedule to draw yet")
    fig = _base(title, "batch (tokens per step)", "tokens seen")
    if early and late:
        for i, pts in enumerate((late, early)):
            x, y = step_xy(pts, budget)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines",
                    line=dict(width=0),
                    fill="tonexty" if i else None,
                    fillcolor=_rgba(PALETTE[2], 0.2),
                    name="projected range",
                    legendgroup="projected range",
                    showlegend=bool(i),
                    hoverinfo="skip",
                )
            )
    for name, pts, color, dash in (
        ("projected", projected, PALETTE[2], "solid"),
        ("hand plan", plan, PALETTE[1], "dash"),
    ):
        if pts:
            x, y = step_xy(pts, budget)
            fig.add_trace(
                go.Scatter(
                    x=x, y=y, mode="lines", name=name, line=dict(color=color, width=2, dash=dash)
                )
            )
    if len(run_x):  # last, on top: a plan that matches the run so far must not hide it
        x = [*np.asarray(run_x, float).tolist(), now]
        y = [*np.asarray(run_y, float).tolist(), float(run_y[-1])]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name="run so far",
                line=dict(color=PALETTE[0], width=3, shape="hv"),
            )
        )
    _vertical(fig, "budget", budget, "#000000", "solid")
    _vertical(fig, "now", now, "#7f7f7f", "dot")
    levels = sorted(
        {float(v) for pts in (projected, early, late, plan) if pts for _, v in pts}
        | {float(v) for v in run_y}
    )
    fig.update_yaxes(type="log", tickvals=levels, ticktext=[format_batch(v) for v in levels])
    return fig


def _vertical(fig: go.Figure, name: str, x: float, color: str, dash: str) -> None:
    fig.add_shape(
        type="line",
        x0=x,
        x1=x,
        xref="x",
        yref="paper",
        y0=0,
        y1=1,
        name=name,
        line=dict(color=color, width=1.5, dash=dash),
    )
    fig.add_annotation(
        x=x, y=1, xref="x", yref="paper", text=name, showarrow=False, yanchor="bottom"
    )
