"""The live page's schedule section, its content (no Streamlit): the run so far, the projected
ramps and a hand plan for the rest of the run, each with its steps and hours to the token
budget against the constant batch, and the hand plan's due step as a tier of the card. A run
that stops at its step limit before the budget gets none: there a ramp saves no step.

Owns `ScheduleView` / `build_schedule` (a live_data.Snapshot, its recommend.Card and the plan's
text → the section), `PlanDue` (the plan step the run has reached, its factor and the tier
advise() chooses for that factor, or why none can be offered), `with_plan_step` (the card with
that tier among its tiers, marked as the plan's, so Approve sends it as any ramp: the same
command, key and checks) and `COLUMNS` / `rows` (the steps and hours table). The math is
advisor/schedule.py's and advisor/hand_plan.py's; dashboard/schedule_section.py draws this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from rampwatch.advisor import schedule as sched
from rampwatch.advisor.advice import TierAdvice
from rampwatch.advisor.hand_plan import (
    DUE_LEAD_STEPS,
    DueStep,
    HandPlan,
    PlanError,
    format_batch,
    parse_plan,
    place,
)
from rampwatch.advisor.policy import RAMP_MAX_FACTOR
from rampwatch.advisor.tier_table import NOT_KNOWN, hours_text
from rampwatch.dashboard.recommend import (
    Card,
    budget_of,
    how_it_stopped,
    step_limit_of,
    tier_view,
)
from rampwatch.store import names as M


@dataclass(frozen=True)
class PlanDue:
    """The plan's step in effect now (or within DUE_LEAD_STEPS), at a batch above the running
    one: ×factor, and the tier advise() chooses for it (None, and why_not, when no ramp
    command can carry it)."""

    step: DueStep
    factor: float
    tier: TierAdvice | None
    why_not: str | None = None

    def words(self, plan: HandPlan) -> str:
        where = f"{self.step.start_tokens / plan.budget:.1%} of the budget"
        return f"step {self.step.number} of the hand plan ({self.step.text!r}, from {where})"


@dataclass(frozen=True)
class ScheduleView:
    budget: int | None
    seq_len: int | None
    now_tokens: float
    steps_done: int | None  # the run's steps so far (its newest step + 1)
    run_x: np.ndarray  # the run so far: tokens seen at each step's start ...
    run_y: np.ndarray  # ... and its batch in tokens
    constant: sched.Schedule | None = None
    projection: sched.Projection | None = None
    plan_text: str = ""
    plan: HandPlan | None = None
    plan_schedule: sched.Schedule | None = None
    plan_error: str | None = None  # one line: what is wrong with the typed plan
    due: PlanDue | None = None
    problems: list[str] = field(default_factory=list)  # why parts of the section are missing
    stopped: str | None = None  # a run that takes no ramp: what "now" is then


def _run_so_far(series, seq_len: int | None) -> tuple[np.ndarray, np.ndarray]:
    tokens, batch = series.get(M.TOKENS_SEEN), series.get(M.BATCH_SEQS)
    if not seq_len or tokens is None or batch is None or not len(tokens) or not len(batch):
        return np.zeros(0), np.zeros(0)
    steps = np.intersect1d(tokens.last_step, batch.last_step)
    seen = tokens.last[np.searchsorted(tokens.last_step, steps)]
    step_tokens = batch.last[np.searchsorted(batch.last_step, steps)] * seq_len
    ok = np.isfinite(seen) & np.isfinite(step_tokens)
    return seen[ok] - step_tokens[ok], step_tokens[ok]  # where each step began, its batch


def _noise_history(series) -> tuple[np.ndarray, np.ndarray]:
    """(tokens seen, smoothed noise scale) at each chart bucket's newest estimate."""
    gns, tokens = series.get(M.GNS), series.get(M.TOKENS_SEEN)
    if gns is None or tokens is None or not len(gns) or not len(tokens):
        return np.zeros(0), np.zeros(0)
    at = np.interp(gns.last_step, tokens.last_step, tokens.last)
    return at, gns.last


def build_schedule(snap, card: Card, plan_text: str = "") -> ScheduleView:
    """The section for one refresh of a run: its series, the card's advice and throughput
    model, and the hand plan as typed (empty: none)."""
    run, series = snap.run, snap.series
    seq = card.current.seq_len if card.current is not None else None
    budget = budget_of(run.config)
    now = float(snap.latest.get(M.TOKENS_SEEN) or 0.0)
    done = None if run.last_step is None else int(run.last_step) + 1
    run_x, run_y = _run_so_far(series, seq)
    view = ScheduleView(
        budget, seq, now, done, run_x, run_y, plan_text=plan_text.strip(), stopped=_stopped(run)
    )
    problems = []
    if card.advice is None:
        problems.append("no schedule: the run's tier is not known yet")
    elif not seq:
        problems.append(
            "no schedule: the run records no sequence length (the schedule is in tokens)"
        )
    elif budget is None:
        problems.append(
            "no schedule: the run records no token budget (run config total_tokens: the "
            "trainer's --total-tokens, Monitor.start(total_tokens=...)); the schedule runs to it"
        )
    elif now >= budget:
        problems.append(f"the run has seen its token budget ({budget:,} tokens): nothing is left")
    elif card.end_tokens is not None and card.end_tokens < budget:
        problems.append(
            f"no schedule: the run stops at its step limit (step {step_limit_of(run.config):,}, "
            "the trainer's --steps) before its token budget: it runs those steps whatever the "
            "batch, so a ramp saves none (it trains more tokens in them)"
        )
    if problems:
        return dataclasses.replace(view, problems=problems)
    advice, speeds = card.advice, card.speeds
    constant = sched.constant(advice, speeds, now, budget)
    projection, why = sched.project(
        advice, speeds, *_noise_history(series), now, budget, now_step=run.last_step
    )
    if projection is None:
        problems.append(f"no projection: {why}")
    view = dataclasses.replace(view, constant=constant, projection=projection, problems=problems)
    return _with_plan(view, snap, card)


def _stopped(run) -> str | None:
    """For a run that takes no ramp (finished, killed, stale): what the section's "now" is."""
    if run.running:
        return None
    return (
        f"{how_it_stopped(run)}: the schedule below reads from its last step (“now”), as if it "
        "were resumed."
    )


def _with_plan(view: ScheduleView, snap, card: Card) -> ScheduleView:
    if not view.plan_text:
        return view
    tokens = snap.series.get(M.TOKENS_SEEN)
    past = (tokens.last_step, tokens.last) if tokens is not None else ((), ())
    try:
        plan = place(
            parse_plan(view.plan_text),
            view.seq_len,
            view.budget,
            snap.run.last_step,
            view.now_tokens,
            *past,
        )
    except PlanError as e:
        return dataclasses.replace(view, plan_error=str(e))
    advice, speeds = card.advice, card.speeds
    segments = [
        dataclasses.replace(sched.tier_for(advice, batch, speeds), start_tokens=start)
        for start, batch in plan.segments_from(view.now_tokens)
    ]
    schedule = sched.walk("hand plan", segments, view.now_tokens, view.budget, view.seq_len, speeds)
    running = advice.current
    step = plan.due(view.now_tokens, running.batch, DUE_LEAD_STEPS * running.batch * view.seq_len)
    due = None if view.stopped else _due(step, advice)  # a stopped run takes no ramp
    return dataclasses.replace(view, plan=plan, plan_schedule=schedule, due=due)


def _due(step: DueStep | None, advice) -> PlanDue | None:
    if step is None:
        return None
    running = advice.current.batch
    factor = step.batch / running
    if step.batch % running:
        return PlanDue(
            step,
            factor,
            None,
            f"its batch ({step.batch:,} sequences) is ×{factor:.3g} the running {running:,}, "
            "not a whole factor: a ramp command takes a whole tier; ramp by hand",
        )
    if factor > RAMP_MAX_FACTOR:
        return PlanDue(
            step,
            factor,
            None,
            f"×{factor:g} is more than one ramp may grow the batch (RAMP_MAX_FACTOR "
            f"{RAMP_MAX_FACTOR}): approve ×{RAMP_MAX_FACTOR} or less first",
        )
    return PlanDue(step, factor, advice.advice_for(int(factor)))


def with_plan_step(card: Card, view: ScheduleView) -> Card:
    """The card with the plan's due tier among its tiers, in the place of advise's tier of the
    same factor (the same tier), marked as the plan's: Approve sends it as any ramp."""
    due = view.due
    if due is None or due.tier is None:
        return card
    planned = tier_view(due.tier, plan=due.words(view.plan))
    tiers = list(card.tiers)
    same = [i for i, v in enumerate(tiers) if v.option.factor == due.tier.option.factor]
    if same:
        tiers[same[0]] = planned
    else:
        tiers.insert(0, planned)
    return dataclasses.replace(card, tiers=tiers)


# ------------------------------------------------------------------------- the table

COLUMNS = (
    "schedule",
    "batch from now (tokens/step)",
    "steps left",
    "steps (run)",
    "hours left",
    "steps saved",
    "hours saved",
    "why unknown",
)


def _ramps(s: sched.Schedule, running: int) -> str:
    """The batches from now: "2K → 4K at 1,011,358 tokens (12.3%) → …"; a jump due already
    (the projection is past the ramp point now) reads "2K → 8K now"."""
    first, budget = s.segments[0], s.budget
    parts = [format_batch(running * s.seq_len)]
    if first.batch != running:
        parts.append(f"{format_batch(first.batch * s.seq_len)} now")
    for seg in s.ramps:
        parts.append(
            f"{format_batch(seg.batch * s.seq_len)} at {seg.start_tokens:,.0f} tokens "
            f"({seg.start_tokens / budget:.1%})"
        )
    return " → ".join(parts)


def _signed_hours(seconds: float | None) -> str:
    if seconds is None:
        return NOT_KNOWN
    text = hours_text(abs(seconds))
    if not text.strip("0."):  # rounds to nothing: neither saved nor lost
        return text
    return ("+" if seconds > 0 else "-") + text


def schedules(view: ScheduleView) -> list[sched.Schedule]:
    """The rows' schedules: constant, projected (central, early, late), hand plan."""
    p = view.projection
    out = [view.constant] + ([p.central, p.early, p.late] if p else []) + [view.plan_schedule]
    return [s for s in out if s is not None]


def rows(view: ScheduleView) -> list[dict[str, str]]:
    """One row per schedule, in COLUMNS, every cell text ("unknown" where nothing is known)."""
    if view.constant is None:
        return []
    out = []
    for s in schedules(view):
        saved_steps, saved_seconds = s.saved(view.constant)
        is_constant = s is view.constant
        total = None if view.steps_done is None else view.steps_done + s.steps_left
        values = (
            s.name,
            _ramps(s, view.constant.segments[0].batch),
            f"{s.steps_left:,}",
            NOT_KNOWN if total is None else f"{total:,}",
            hours_text(s.seconds_left),
            "" if is_constant else f"{saved_steps:+,}",
            "" if is_constant else _signed_hours(saved_seconds),
            "; ".join(s.notes),
        )
        out.append(dict(zip(COLUMNS, values, strict=True)))
    return out
