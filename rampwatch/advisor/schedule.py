"""The rest of the run's batch schedule: where the noise scale is heading in tokens, the ramps
that implies, and what each schedule costs in steps and hours to the run's token budget.

Owns `PowerLaw` / `fit_power_law` (the noise scale as a power of the tokens seen, with a low and
a high slope), `Segment` (a batch from a point in tokens on, and the tier that runs it),
`Schedule` / `walk` (segments → steps and seconds from now to the budget), `tier_for` (a batch
→ the tier that would run it), `ramp_ladder` (the tiers a ramp can reach) and `project` /
`constant` (→ `Projection`: the central, early and late schedules; the batch kept as it is).

The projection. B(T) = B(T0)·(T/T0)^α: OLS of log B_simple on log T (forecast.fit_trend) over
the smoothed estimates since FIT_FROM × the tokens seen now (the last two doublings of tokens:
a lever arm in log tokens, and past the early transient). Why a power law: Kaplan et al. 2020
("Scaling Laws for Neural Language Models", arXiv:2001.08361, §5.1) find the critical batch a
power of the loss, and the loss falls as a power of the tokens, so over a stretch of training
the critical batch is a power of the tokens. It is an extrapolation, and can be wrong in a known
direction: Merrill et al. 2025 (arXiv:2505.23971, §3) measured OLMo's critical batch rising fast
early and then levelling off, and a power law fitted before such a plateau projects ramps that
never come. Times c, the latest trial's calibration (advisor/advice.py TrialEvidence: critical
batch ≈ c × B_simple), it is read as the critical batch, as advise() reads it. A ramp ×factor
(the policy's) happens where the projection reaches the ramp point of the batch running then
(RampPolicy.ramp_point: ramp_at × batch, × factor when read as the critical batch); the
hysteresis, a few estimates, is left out. The batches are the tiers advise() chooses for ×factor,
×factor², … of the running batch (`Advice.option_for`), no further than RAMP_MAX_FACTOR × it
(advise's largest) and only while they fit: past that, which tier would run and how fast is not
known.

The first ramp, where the card times it (`FirstRamp`, `first_ramp`): given the run's step, the
first ramp is where advise()'s decision puts the crossing: now when it says ramp now, the step
its streak completes, else its calibrated forecast's point and range (advisor/forecast.py). After
a forecast first ramp the law is moved to pass through it (same slope) for the ramps after.
Where the card gives no forecast (not rising, or above the batch while its bound is not), the
law places the first ramp, but no sooner than the card could say ramp now (its streak of
hysteresis estimates complete and enough estimates in all: `Evidence.estimates_short`). On
recorded runs the card's range held for 88% of queries and the law's own
first-crossing range for 6%, its point off by a median 254 steps against the card's 177
(bench/forecast_bench.py, the README's "Forecast coverage"); and one page must not say both
"soon" and "never", nor "now" under "Not yet".

The range: the slope ± Z standard errors, pivoted at the fit's mean log tokens, so the high
slope ramps early and the low late. It is the fit's own uncertainty and takes the smoothed,
correlated estimates for independent ones, as forecast.py's delta range did (which held for 17%
of queries on recorded runs): narrower than the truth, and not calibrated.

Steps: from the tokens seen now, each segment runs whole steps of its batch until its end is
passed (ceil), the last to the budget, as the tier table counts steps left; seconds: steps × the
tier's step time from advisor/throughput.py (measured, modelled, else unknown — and a schedule
with one unknown segment has unknown hours).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from rampwatch.advisor.advice import Advice
from rampwatch.advisor.forecast import fit_trend
from rampwatch.advisor.gns_window import significant
from rampwatch.advisor.policy import RAMP_MAX_FACTOR
from rampwatch.advisor.throughput import ThroughputModel
from rampwatch.advisor.tiers import Tier

__all__ = [
    "FIT_FROM",
    "FirstRamp",
    "PowerLaw",
    "Projection",
    "Schedule",
    "Segment",
    "constant",
    "first_ramp",
    "fit_power_law",
    "project",
    "ramp_ladder",
    "tier_for",
    "walk",
]

FIT_FROM = 0.25  # fit the estimates since this share of the tokens seen now
MIN_ESTIMATES = 10  # estimates the fit needs (as forecast's calibrated range)
Z = 1.645  # the range: slope ± Z SE, a two-sided 90% level (the card's noise-scale interval)


def _exp(x: float) -> float:
    """e^x, inf past the largest float: a nearly flat law reaches a level at e^(huge) tokens."""
    return math.exp(x) if x < _LOG_FLOAT_MAX else math.inf


_LOG_FLOAT_MAX = math.log(sys.float_info.max)


@dataclass(frozen=True)
class PowerLaw:
    """log B = y0 + slope·(log T − x0), fitted on `n` estimates between tokens_from and
    tokens_to; slope_se: the OLS standard error of the slope."""

    x0: float  # mean log tokens of the fitted estimates
    y0: float  # the fitted log noise scale there
    slope: float
    slope_se: float
    n: int
    tokens_from: float
    tokens_to: float

    def value(self, tokens: float, z: float = 0.0) -> float:
        """The noise scale at `tokens`, with the slope moved by z standard errors."""
        return _exp(self.y0 + (self.slope + z * self.slope_se) * (math.log(tokens) - self.x0))

    def reaches(self, level: float, after: float, z: float = 0.0) -> float:
        """The first tokens ≥ `after` where the law is at `level` or above (inf: never)."""
        if self.value(after, z) >= level:
            return float(after)
        s = self.slope + z * self.slope_se
        if s <= 0:
            return math.inf
        return _exp(self.x0 + (math.log(level) - self.y0) / s)

    def through(self, tokens: float, level: float) -> PowerLaw:
        """The same slope, moved to be at `level` at `tokens` (its range pivots there)."""
        return replace(self, x0=math.log(tokens), y0=math.log(level))

    def describe(self) -> str:
        return (
            f"noise scale ∝ tokens^{self.slope:.3g} (± {self.slope_se:.2g} SE), fitted on "
            f"{self.n} estimates from {significant(self.tokens_from)} to "
            f"{significant(self.tokens_to)} tokens"
        )


def fit_power_law(
    tokens: Sequence[float], noise: Sequence[float], now_tokens: float
) -> tuple[PowerLaw | None, str]:
    """The law over the estimates (tokens seen, smoothed noise scale) since FIT_FROM × now;
    None and why not when too few are there or they span no tokens."""
    t, b = np.asarray(tokens, np.float64), np.asarray(noise, np.float64)
    keep = np.isfinite(t) & np.isfinite(b) & (b > 0) & (t > 0) & (t >= FIT_FROM * now_tokens)
    t, b = t[keep], b[keep]
    if t.size < MIN_ESTIMATES:
        return None, (
            f"the projection needs {MIN_ESTIMATES} noise-scale estimates since "
            f"{FIT_FROM:.0%} of the tokens seen ({t.size} so far)"
        )
    x, y = np.log(t), np.log(b)
    fit = fit_trend(x, y)
    if fit is None:
        return None, "the noise-scale estimates span no tokens: nothing to fit a trend on"
    c, s, cov = fit
    x0 = float(x.mean())
    se = math.sqrt(max(0.0, float(cov[1, 1])))
    return PowerLaw(x0, c + s * x0, s, se, int(t.size), float(t.min()), float(t.max())), ""


@dataclass(frozen=True)
class Segment:
    """`batch` sequences a step from `start_tokens` on, run as `tier` (None: no tier known, and
    `note` says why)."""

    start_tokens: float
    batch: int
    tier: Tier | None = None
    note: str = ""


@dataclass(frozen=True)
class Schedule:
    """Segments from now to the budget, with each one's steps and seconds (None: unknown)."""

    name: str
    segments: tuple[Segment, ...]
    steps: tuple[int, ...]
    seconds: tuple[float | None, ...]
    seq_len: int
    budget: int
    notes: tuple[str, ...] = ()  # why its hours are unknown

    @property
    def steps_left(self) -> int:
        return sum(self.steps)

    @property
    def seconds_left(self) -> float | None:
        return None if any(s is None for s in self.seconds) else float(sum(self.seconds))

    @property
    def ramps(self) -> tuple[Segment, ...]:
        """The segments after the first: where the batch changes."""
        return self.segments[1:]

    def points(self) -> list[tuple[float, int]]:
        """(start tokens, batch tokens per step) of each segment, for the chart."""
        return [(s.start_tokens, s.batch * self.seq_len) for s in self.segments]

    def saved(self, other: Schedule) -> tuple[int, float | None]:
        """Steps and seconds this schedule saves against `other` (None: a side is unknown)."""
        mine, theirs = self.seconds_left, other.seconds_left
        seconds = None if mine is None or theirs is None else theirs - mine
        return other.steps_left - self.steps_left, seconds


def walk(
    name: str,
    segments: Sequence[Segment],
    now_tokens: float,
    budget: int,
    seq_len: int,
    speeds: ThroughputModel | None,
) -> Schedule:
    """Steps and seconds of `segments` (starts increasing, the first at now) to the budget:
    each runs whole steps until the next one's start is passed, the last to the budget."""
    cursor = float(now_tokens)
    steps, seconds, notes = [], [], []
    for i, seg in enumerate(segments):
        end = budget if i + 1 == len(segments) else min(segments[i + 1].start_tokens, budget)
        n = max(0, math.ceil((end - cursor) / (seg.batch * seq_len)))
        cursor += n * seg.batch * seq_len
        steps.append(n)
        step_time, why = _step_time(seg, speeds)
        seconds.append(None if step_time is None and n else n * (step_time or 0.0))
        if step_time is None and n and why not in notes:
            notes.append(why)
    return Schedule(
        name, tuple(segments), tuple(steps), tuple(seconds), seq_len, budget, tuple(notes)
    )


def _step_time(seg: Segment, speeds: ThroughputModel | None) -> tuple[float | None, str]:
    if seg.tier is None:
        return None, seg.note or f"no tier known for batch {seg.batch:,}"
    if speeds is None:
        return None, "no step of this run was timed yet"
    s = speeds.speed(seg.tier)
    what = f"{seg.tier.per_device_batch} × {seg.tier.accum}"
    return s.step_time_s, f"{what}: {s.note}"


def tier_for(advice: Advice, batch: int, speeds: ThroughputModel | None = None) -> Segment:
    """A segment at `batch` from token 0 with the tier that would run it: the running tier; the
    tier advise() chooses for a whole factor of the running batch up to RAMP_MAX_FACTOR; else a
    tier of this batch the run ran (the most timed); else none, and why."""
    cur = advice.current.tier
    if batch == cur.batch:
        return Segment(0.0, batch, cur)
    if batch % cur.batch == 0 and batch // cur.batch <= RAMP_MAX_FACTOR:
        o = advice.option_for(batch // cur.batch)
        if o.fits:
            return Segment(0.0, batch, o.tier)
        return Segment(0.0, batch, None, f"×{o.factor} does not fit: {o.reason}")
    ran = [] if speeds is None else [m for t, m in speeds.measured.items() if t.batch == batch]
    if ran:
        return Segment(0.0, batch, max(ran, key=lambda m: m.samples).tier)
    return Segment(
        0.0,
        batch,
        None,
        f"batch {batch:,} is neither a whole factor up to ×{RAMP_MAX_FACTOR} of the running "
        f"{cur.batch:,} nor a tier this run ran: no tier to time it",
    )


def ramp_ladder(advice: Advice) -> tuple[list[Tier], str]:
    """The tiers of ×factor, ×factor², … of the running batch as advise() chooses them, while
    they fit and within RAMP_MAX_FACTOR; and where and why the ladder ends."""
    f = advice.policy.factor
    tiers, k = [], f
    while k <= RAMP_MAX_FACTOR:
        o = advice.option_for(k)
        if not o.fits:
            return tiers, f"the projection stops below ×{k}: it does not fit ({o.reason})"
        tiers.append(o.tier)
        k *= f
    return tiers, (
        f"the projection grows the batch at most ×{k // f} (RAMP_MAX_FACTOR {RAMP_MAX_FACTOR}: "
        "advise's largest tier); past it, which tier would run and how fast is not known"
    )


@dataclass(frozen=True)
class FirstRamp:
    """Where advise()'s decision puts the first ramp, in tokens at the running batch: its point
    and range (late inf: the range has no end), and what they rest on."""

    point: float
    early: float
    late: float
    note: str
    floor: bool = False  # no sooner than `point`: where the law puts it, if later


def first_ramp(advice: Advice, now_step: int, now_tokens: float) -> FirstRamp | None:
    """The card's timing of the first ramp (steps → tokens from the run's `now_step`); where the
    card gives no forecast, a floor: not before the card could say ramp now."""
    d, cur = advice.decision, advice.current
    if d.ready:
        return FirstRamp(now_tokens, now_tokens, now_tokens, "first ramp now, as the card says")
    if not cur.seq_len:
        return None

    def tokens(step: int | None) -> float:
        if step is None:
            return math.inf
        return now_tokens + max(0, step - now_step) * cur.batch * cur.seq_len

    if d.forecast_step is None:
        e = d.evidence
        ready = now_step + e.estimates_short  # one estimate a step, at the most
        at = tokens(ready)
        return FirstRamp(
            at,
            at,
            at,
            f"first ramp no sooner than step {ready:,}, the first at which the card could say "
            f"ramp now ({e.hysteresis_steps} estimates in a row above the ramp point, "
            f"{e.min_estimates} in all)",
            floor=True,
        )
    if d.forecast_range is None:  # a streak under way: ready when it is long enough
        at = tokens(d.forecast_step)
        return FirstRamp(at, at, at, f"first ramp at step {d.forecast_step:,}, as the card says")
    first, last = d.forecast_range
    span = f"{first:,}–{last:,}" if last is not None else f"{first:,} on"
    return FirstRamp(
        tokens(d.forecast_step),
        tokens(first),
        tokens(last),
        f"first ramp at the card's forecast, step {d.forecast_step:,} (range {span}: "
        f"{d.forecast_note})",
    )


@dataclass(frozen=True)
class Projection:
    """The projected ramps: central, early (the high slope) and late (the low slope)."""

    law: PowerLaw
    first: FirstRamp | None  # the card's timing of the first ramp (None: the law's)
    calibration: float | None  # c of the latest trial (None: the noise scale alone)
    critical: bool  # read as the critical batch (the ramp point × factor)
    central: Schedule
    early: Schedule
    late: Schedule
    notes: tuple[str, ...] = ()


def constant(
    advice: Advice, speeds: ThroughputModel | None, now_tokens: float, budget: int
) -> Schedule:
    """The running tier kept to the budget."""
    cur = advice.current
    seg = Segment(float(now_tokens), cur.batch, cur.tier)
    return walk("constant", [seg], now_tokens, budget, cur.seq_len, speeds)


def project(
    advice: Advice,
    speeds: ThroughputModel | None,
    tokens: Sequence[float],
    noise: Sequence[float],
    now_tokens: float,
    budget: int,
    now_step: int | None = None,
) -> tuple[Projection | None, str]:
    """The projected schedules from the run's noise-scale history (tokens seen at each
    estimate, its smoothed B_simple in sequences), or None and why not. now_step: the run's
    newest step, where now_tokens were seen; with it the first ramp is the card's (`first_ramp`)."""
    cur, policy = advice.current, advice.policy
    if not cur.seq_len:
        return None, "the run records no sequence length: the schedule is in tokens"
    law, why = fit_power_law(tokens, noise, now_tokens)
    if law is None:
        return None, why
    ladder, ladder_note = ramp_ladder(advice)
    c, critical = advice.calibration, advice.critical
    first = None if now_step is None else first_ramp(advice, now_step, now_tokens)

    def schedule(name: str, z: float, bound: str) -> Schedule:
        """bound: the FirstRamp field ("point", "early", "late") that times this schedule's
        first ramp; the law times the rest, moved through it when the card's forecast set it."""
        segs = [Segment(float(now_tokens), cur.batch, cur.tier)]
        path = law
        for i, tier in enumerate(ladder):
            level = policy.ramp_point(segs[-1].batch, critical) / (c or 1.0)
            at = path.reaches(level, segs[-1].start_tokens, z)
            if i == 0 and first is not None:
                card_at = getattr(first, bound)
                if first.floor:
                    at = max(card_at, at)
                else:
                    at = card_at
                    if now_tokens < at < budget:  # ahead: the law's ramps after it start there
                        path = law.through(at, level)
            if at >= budget:
                break
            if at <= segs[-1].start_tokens:  # due already: the jump happens at this point
                segs[-1] = Segment(segs[-1].start_tokens, tier.batch, tier)
            else:
                segs.append(Segment(at, tier.batch, tier))
        return walk(name, segs, now_tokens, budget, cur.seq_len, speeds)

    notes = [law.describe(), ladder_note]
    if c is not None:
        notes.append(
            f"× {c:.3g}, the calibration of {advice.trial.name}: read as the critical batch"
        )
    return (
        Projection(
            law,
            first,
            c,
            critical,
            schedule("projected", 0.0, "point"),
            schedule("projected, early", Z, "early"),
            schedule("projected, late", -Z, "late"),
            tuple(notes),
        ),
        "",
    )
