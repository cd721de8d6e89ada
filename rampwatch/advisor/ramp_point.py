"""The ramp point: when the batch should grow, and what growing it buys.

Owns `ramp_decision` / `Recommendation` (is the smoothed noise scale above the batch for long
enough; when will it be) and `predicted_effect` (steps and examples before and after a ramp).
How far the batch can grow in memory is advisor/tiers.py. It also owns the verdict's words
(`Recommendation.reason`, `.said`): plain sentences whose numbers carry digits enough that a value
is never said to be below one that looks the same, and the forecast in steps (in time too, given
the run's step rate).

Sources: the ramp rule and effect use S/S_min = 1 + B_noise/B and E/E_min = 1 + B/B_noise
(McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", §2.3, eq. 2.11 with
B_crit ≈ B_noise): at B = B_noise a doubling saves 25% of the steps and costs 50% more examples;
past it, less and more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from rampwatch.advisor.checks import positive_int as _pos_int
from rampwatch.advisor.forecast import (
    FORECAST_CALIBRATION,
    ForecastCalibration,
    calibrated_forecast,
    fit_trend,
)
from rampwatch.advisor.gns import examples_ratio, steps_ratio
from rampwatch.advisor.gns_window import significant

__all__ = [
    "Evidence",
    "Recommendation",
    "ramp_decision",
    "Effect",
    "predicted_effect",
]


# ---------------------------------------------------------------------------------- ramp point


@dataclass(frozen=True)
class Evidence:
    """What a ramp decision rests on."""

    n_samples: int  # finite noise-scale estimates in the series (observations, not sequences)
    noise_scale: float | None  # latest smoothed noise scale, sequences (None: no point)
    threshold_batch: float  # ramp_at × current batch, sequences
    trend_per_step: float | None  # d(noise scale)/d(step) at the latest step, from the trend fit
    steps_above: int  # consecutive estimates (newest first) above threshold_batch, since the ramp
    hysteresis_steps: int
    min_estimates: int
    trend: str  # how the trend was fitted, e.g. 'log-linear over 200 estimates'
    lower_bound: float | None = None  # the latest estimate's one-sided 95% lower bound

    @property
    def estimates_short(self) -> int:
        """How many more estimates, at the fewest, before the decision could be ready: the
        streak of `hysteresis_steps` complete and `min_estimates` reached (at least one)."""
        return max(1, self.hysteresis_steps - self.steps_above, self.min_estimates - self.n_samples)


@dataclass(frozen=True)
class Recommendation:
    ready: bool
    reason: str  # `status`, then what comes next (the forecast), in plain sentences
    forecast_step: int | None  # when not ready: the likeliest crossing step (or "ready at" step)
    forecast_range: tuple[int, int | None] | None  # (first, last) step of the stated range
    evidence: Evidence
    suggested_batch: int | None  # factor × current batch when ready
    forecast_note: str = ""  # what the range rests on, or why no forecast is given
    status: str = ""  # where the noise scale stands: `reason` without its forecast

    def to_dict(self) -> dict:
        return asdict(self)

    def said(self, now_step: int | None = None, steps_per_second: float | None = None) -> str:
        """The reason, with the forecast's steps also in time from `now_step` at the run's
        measured step rate (the card's; the advisor has no clock). Without them: `reason`."""
        pace = _Pace.of(now_step, steps_per_second)
        if pace is None or (self.forecast_step is None and self.forecast_range is None):
            return self.reason
        return _join(
            self.status,
            _outlook(self.forecast_step, self.forecast_range, self.forecast_note, pace),
        )


def _clean(steps: Sequence[int], values: Sequence[float | None]) -> list[tuple[int, float | None]]:
    if len(steps) != len(values):
        raise ValueError(
            f"got {len(steps)} steps but {len(values)} noise-scale values: pass one per step"
        )
    out = []
    for s, v in zip(steps, values, strict=True):
        fv = None
        if v is not None:
            fv = float(v)
            if not math.isfinite(fv) or fv < 0:
                fv = None
        out.append((int(s), fv))
    out.sort(key=lambda sv: sv[0])
    return out


def ramp_decision(
    steps: Sequence[int],
    b_noise: Sequence[float | None],
    current_batch: float,
    *,
    ramp_at: float,
    bound_at: float,
    hysteresis_steps: int,
    min_estimates: int,
    factor: int,
    since_step: int | None = None,
    lower: Sequence[float | None] | None = None,
    window: int = 200,
    trend: str = "log",
    z: float = 1.96,
    calibration: ForecastCalibration | None = FORECAST_CALIBRATION,
    subject: str = "The noise scale",
) -> Recommendation:
    """Should the batch grow ×factor now, and if not, when will it be time?

    The thresholds are advisor.policy.RampPolicy's fields, by their names (RampPolicy.decide
    passes them). steps, b_noise: the smoothed noise scale (sequences, e.g. advisor.gns_window's
    b_simple) by step; None / NaN / negative mean "no estimate". Ready when at least
    `min_estimates` estimates exist and the noise scale has stayed above ramp_at × current_batch
    for the last `hysteresis_steps` estimates (counted only after `since_step`, the last ramp: a
    ramp restarts the hysteresis but keeps the noise-scale history). Otherwise the crossing is
    forecast from an OLS trend over the last `window` estimates, log-linear (trend='log', the
    noise scale grows roughly geometrically as the loss falls) or linear. With trend='log' the
    stated range is the calibration's (`calibrated_forecast`: where the crossing came on recorded
    runs, given the trend's), and no forecast is given outside what it was measured on. With
    calibration=None or a linear trend the range is ±z standard errors by the delta method, which
    takes the smoothed, correlated points for independent ones: on recorded runs it held far
    less often than it claims (README).

    lower: the noise scale's one-sided lower bound at each step (advisor.gns_window), or None.
    With it, a step counts as above when its point is above the target and its bound is at least
    bound_at × current_batch, or when it has no point (the windowed |G|² is not positive:
    B_noise ≫ batch) but its bound alone is above the target. Steps are the steps that have an
    estimate; a step with none is simply absent and neither breaks nor extends the streak.
    subject: what the sentences call the values ("The calibrated noise scale" after a trial).
    """
    batch = _checked(current_batch, ramp_at, min_estimates, trend)
    hyst, win = _pos_int("hysteresis_steps", hysteresis_steps), _pos_int("window", window)
    target, bound_target = float(ramp_at) * batch, float(bound_at) * batch
    series = _Series.of(steps, b_noise, lower)
    steps_above = series.streak(target, bound_target, since_step)
    fit = _Trend.of(series.valid[-win:], trend)
    forecast = _forecast(series, fit, target, calibration, z) if fit.fit is not None else _NONE
    evidence = Evidence(
        n_samples=series.n,
        noise_scale=series.latest,
        threshold_batch=target,
        trend_per_step=fit.slope_per_step,
        steps_above=steps_above,
        hysteresis_steps=hyst,
        min_estimates=int(min_estimates),
        trend=fit.desc,
        lower_bound=series.latest_bound,
    )
    words = _Words(series, target, bound_target, float(ramp_at), float(bound_at), subject)
    if evidence.n_samples >= evidence.min_estimates and steps_above >= hyst:
        status = words.ready(steps_above, int(round(factor * batch)))
        return Recommendation(
            True, status, None, None, evidence, int(round(factor * batch)), status=status
        )
    if steps_above >= hyst:  # held long enough, but too few estimates in all: no step to give
        forecast, status, outlook = _NONE, words.streak(steps_above, hyst), ""
    elif steps_above > 0:
        forecast = _Forecast(series.last_step + evidence.estimates_short, None, "")
        status, outlook = words.streak(steps_above, hyst), _outlook(forecast.step, None, "", None)
    else:
        status, outlook = _not_above(words, fit, forecast, since_step)
    if 0 < series.n < evidence.min_estimates:
        status = (
            f"Not enough evidence yet: {series.n} noise-scale estimates of the "
            f"{evidence.min_estimates} needed. {status}"
        )
    return Recommendation(
        False,
        _join(status, outlook),
        forecast.step,
        forecast.range,
        evidence,
        None,
        forecast.note,
        status,
    )


def _checked(current_batch, ramp_at, min_estimates, trend) -> float:
    """current_batch as a float, once every argument is known to be usable."""
    batch = float(current_batch)
    if not math.isfinite(batch) or batch <= 0:
        raise ValueError(
            f"current_batch must be a positive number of sequences, got {current_batch!r}"
        )
    if not (math.isfinite(float(ramp_at)) and ramp_at > 0):
        raise ValueError(f"ramp_at must be a positive multiple of the batch, got {ramp_at!r}")
    if isinstance(min_estimates, bool) or int(min_estimates) < 0:
        raise ValueError(f"min_estimates must be >= 0, got {min_estimates!r}")
    if trend not in ("log", "linear"):
        raise ValueError(f"trend must be 'log' or 'linear', got {trend!r}")
    return batch


@dataclass(frozen=True)
class _Series:
    """The noise scale by step: points (None: no point), bounds, and the steps with either."""

    points: list[tuple[int, float | None]]
    bounds: dict[int, float | None]
    has_bounds: bool  # a lower bound was given (each step's may still be None)

    @classmethod
    def of(cls, steps, b_noise, lower) -> _Series:
        bounds = dict(_clean(steps, lower)) if lower is not None else {}
        return cls(_clean(steps, b_noise), bounds, lower is not None)

    @property
    def valid(self) -> list[tuple[int, float]]:
        return [(s, v) for s, v in self.points if v is not None]

    @property
    def estimates(self) -> list[tuple[int, float | None]]:
        return [(s, v) for s, v in self.points if v is not None or self.bounds.get(s)]

    @property
    def n(self) -> int:
        return len(self.estimates)

    @property
    def last_step(self) -> int | None:
        return self.points[-1][0] if self.points else None

    @property
    def latest(self) -> float | None:
        """The newest point; None when the newest estimate is a bound without a point."""
        est = self.estimates
        if est and est[-1][1] is None:
            return None
        valid = self.valid
        return valid[-1][1] if valid else None

    @property
    def latest_bound(self) -> float | None:
        est = self.estimates
        return self.bounds.get(est[-1][0]) if est else None

    def streak(self, target: float, bound_target: float, since_step: int | None) -> int:
        """Consecutive estimates above the target, newest first, after the last ramp."""
        n = 0
        for s, v in reversed(self.estimates):
            if since_step is not None and s <= since_step:
                break
            b = self.bounds.get(s)
            if v is None:
                above = b is not None and b > target
            else:
                above = v > target and (
                    not self.has_bounds or (b is not None and b >= bound_target)
                )
            if not above:
                break
            n += 1
        return n


FLAT = 1e-3  # a trend that grows less than 0.1% over its window is not rising


@dataclass(frozen=True)
class _Trend:
    """The OLS trend over the recent estimates (log-linear or linear)."""

    kind: str
    recent: list[tuple[int, float]]
    fit: tuple | None  # (intercept, slope, covariance) from forecast.fit_trend
    desc: str
    slope_per_step: float | None

    @classmethod
    def of(cls, recent: list[tuple[int, float]], kind: str) -> _Trend:
        if kind == "log":
            recent = [(s, v) for s, v in recent if v > 0]
        fit = slope = None
        if recent:
            xs = np.array([s - recent[-1][0] for s, _ in recent], dtype=np.float64)
            ys = np.array([v for _, v in recent], dtype=np.float64)
            fit = fit_trend(xs, np.log(ys) if kind == "log" else ys)
        if fit is not None:
            c, sl, _ = fit
            slope = sl * math.exp(c) if kind == "log" else sl
        fitted = "log-linear" if kind == "log" else "linear"
        desc = f"{fitted} fit over the last {len(recent)} estimates"
        return cls(kind, recent, fit, desc, slope)

    @property
    def rising(self) -> bool:
        """Rising by more than FLAT over its window: a constant series' float noise is flat."""
        if self.fit is None or self.fit[1] <= 0:
            return False
        span = self.recent[-1][0] - self.recent[0][0]
        growth = self.fit[1] * span  # log trend: relative growth over the window
        if self.kind == "linear":
            growth /= max(abs(self.recent[-1][1]), 1e-300)
        return growth > FLAT


@dataclass(frozen=True)
class _Forecast:
    step: int | None
    range: tuple[int, int | None] | None
    note: str  # what the range rests on, or why no forecast is given


_NONE = _Forecast(None, None, "")


def _forecast(series, trend: _Trend, target, calibration, z) -> _Forecast:
    """When the trend crosses the target: calibrated (log trend) or ±z SE (delta method)."""
    c, s, cov = trend.fit
    latest = series.latest
    if latest is None or latest > target or not trend.rising:
        return _NONE
    log = trend.kind == "log"
    delta = ((math.log(target) if log else target) - c) / s
    if delta >= 1e15:
        return _NONE
    crossing = trend.recent[-1][0] + delta  # continuous step of the crossing
    last_step = series.last_step
    if log and calibration is not None:  # (point, range), or (None, why not)
        point, frange = calibrated_forecast(last_step, crossing, series.n, calibration)
        if point is None:
            return _Forecast(None, None, frange)
        return _Forecast(point, frange, calibration.note())
    point = max(last_step + 1, math.ceil(crossing))
    grad = np.array([-1.0 / s, -delta / s])  # ∂delta/∂(c, s), delta method
    sd = math.sqrt(max(0.0, float(grad @ cov @ grad)))
    lo = max(last_step + 1, math.floor(crossing - z * sd))
    s_se = math.sqrt(max(0.0, float(cov[1, 1])))
    hi = None if s - z * s_se <= 0 else max(point, math.ceil(crossing + z * sd))
    return _Forecast(point, (lo, hi), f"±{z:g} SE, uncalibrated")


# ------------------------------------------------------------------------------------ words


@dataclass(frozen=True)
class _Words:
    """The verdict's sentences: the noise scale against the ramp point, as a person says it."""

    series: _Series
    target: float  # ramp_at × batch
    bound_target: float  # bound_at × batch
    ramp_at: float
    bound_at: float
    name: str = "The noise scale"  # or "The calibrated noise scale": what the values are

    def subject(self) -> tuple[str, float]:
        """Who the sentence is about, and its value: the point, or its bound when it has none."""
        latest = self.series.latest
        if latest is None:
            return f"{self.name}'s 95% lower bound", self.series.latest_bound
        return self.name, latest

    def bound_note(self) -> str:
        if not self.series.has_bounds or self.bound_target <= 0:
            return ""
        return (
            f", its 95% lower bound at least {_of_batch(self.bound_at, _count(self.bound_target))}"
        )

    def ready(self, n: int, new_batch: int) -> str:
        who, value = self.subject()
        a, _, point = _against(value, self.ramp_at, self.target)
        return (
            f"{who} ({a}) has stayed above {point} for {n} estimates{self.bound_note()}: "
            f"ramp the batch to {new_batch:,}."
        )

    def streak(self, n: int, needed: int) -> str:
        who, value = self.subject()
        a, _, point = _against(value, self.ramp_at, self.target)
        bound = self.bound_note()
        if n >= needed:  # the streak is long enough: what it lacks is the evidence
            return f"{who} ({a}) has stayed above {point}{bound} for {n} estimates."
        return (
            f"{who} ({a}) has been above {point}{bound}{',' if bound else ''} for {n} of the "
            f"{needed} estimates it needs."
        )


def _not_above(w: _Words, trend: _Trend, forecast: _Forecast, since_step) -> tuple[str, str]:
    """Why no streak is running (where the noise scale stands), and what comes next."""
    series, latest = w.series, w.series.latest
    if not series.estimates:
        return "No noise-scale estimate yet: keep training.", ""
    if latest is None:
        bound = series.latest_bound
        if not bound:
            return (
                "No usable noise-scale estimate yet: the windowed |G|² is not positive and no "
                "bound is known."
            ), ""
        a, rel, point = _against(bound, w.ramp_at, w.target)
        return (
            f"{w.name}'s 95% lower bound ({a}) is {rel} {point}, and there is no point "
            "estimate (the windowed |G|² is not positive): wait for more evidence."
        ), ""
    a, rel, point = _against(latest, w.ramp_at, w.target)
    if latest > w.target:
        if not series.has_bounds:
            return (
                f"{w.name} ({a}) is {rel} {point}, but not since the ramp at step "
                f"{since_step:,}: wait for estimates at the new batch."
            ), ""
        bound = series.latest_bound
        if bound is None:
            why = "it has no 95% lower bound yet"
        else:
            b, brel, bpoint = _against(bound, w.bound_at, w.bound_target)
            why = f"its 95% lower bound ({b}) is {brel} {bpoint}"
        return f"{w.name} ({a}) is {rel} {point}, but {why}: wait for more evidence.", ""
    status = f"{w.name} ({a}) is {rel} {point}."
    if forecast.range is not None:
        return status, _outlook(forecast.step, forecast.range, forecast.note, None)
    if forecast.note:
        return status, f"It is rising; no reliable forecast yet: {forecast.note}."
    if trend.fit is None:
        return status, f"Too few estimates ({len(trend.recent)}) for a trend yet."
    return status, "It is not rising: no crossing to forecast."


def _outlook(step: int, frange, note: str, pace: _Pace | None) -> str:
    """The forecast's sentence: the range the noise scale is expected to cross in (frange), or
    the step the hysteresis runs out (step, no range); in time too, given the pace."""
    if frange is None:
        when = "" if pace is None else pace.until(step)
        return f"Ready at step ~{step:,}{f' ({when})' if when else ''} if it stays above."
    lo, hi = frange
    said = f"after step {lo:,}" if hi is None else f"between steps {lo:,} and {hi:,}"
    when = "" if pace is None else pace.until(lo, hi, open_end=hi is None)
    if when:
        said += f", {when} at the run's {pace.rate()}"
    return f"It is rising: expected to cross {said}{f' ({note})' if note else ''}."


@dataclass(frozen=True)
class _Pace:
    """Where the run is and how fast it steps: steps in the future as time from now."""

    now: int
    steps_per_second: float

    @classmethod
    def of(cls, now_step, steps_per_second) -> _Pace | None:
        if now_step is None or steps_per_second is None:
            return None
        rate = float(steps_per_second)
        return cls(int(now_step), rate) if math.isfinite(rate) and rate > 0 else None

    def rate(self) -> str:
        r = self.steps_per_second
        return f"{_shown(r)} steps/s" if r >= 1 else f"one step every {_shown(1 / r)} s"

    def until(self, first: int, last: int | None = None, open_end: bool = False) -> str:
        """'in about 3–40 minutes' from now to steps first (..last); '' once they are past."""
        end = first if last is None else last
        if end <= self.now:
            return ""
        lo = max(0, first - self.now) / self.steps_per_second
        hi = (end - self.now) / self.steps_per_second
        if open_end:
            return f"{_duration(lo, lo)} or more"
        return _duration(lo, hi)


def _duration(lo_s: float, hi_s: float) -> str:
    """'in about 40 seconds', 'in about 3–40 minutes', 'in about 5 seconds to 2 minutes'."""
    (a, unit_a), (b, unit_b) = _amount(lo_s), _amount(hi_s)
    if (a, unit_a) == (b, unit_b):
        return f"in about {b} {unit_b}"
    if unit_a.rstrip("s") == unit_b.rstrip("s"):
        return f"in about {a}–{b} {unit_b.rstrip('s')}s"
    return f"in about {a} {unit_a} to {b} {unit_b}"


def _amount(seconds: float) -> tuple[str, str]:
    """(number, unit) a person reads: seconds under 90 s, minutes under 90 min, else hours."""
    unit, size = (
        ("second", 1) if seconds < 90 else ("minute", 60) if seconds < 5400 else ("hour", 3600)
    )
    v = seconds / size
    n = f"{v:.0f}" if v >= 10 or unit == "second" else f"{v:.2g}"
    return n, unit if n == "1" else unit + "s"


def _against(value: float, k: float, threshold: float) -> tuple[str, str, str]:
    """(value as shown, 'below' / 'just above' / 'at' / ..., 'the batch (16)' or '2× the batch
    (32)'): value and threshold with digits enough that they look as different as they are, so a
    number is never said to be below one that looks the same."""
    for digits in range(3, 8):
        a, b = _shown(value, digits), _count(threshold, digits)
        if value == threshold or float(a.replace(",", "")) != float(b.replace(",", "")):
            break
    if value == threshold:
        rel = "at"
    else:
        rel = "above" if value > threshold else "below"
        if abs(value - threshold) < 0.01 * abs(threshold):
            rel = "just " + rel
    return a, rel, _of_batch(k, b)


def _of_batch(k: float, shown: str) -> str:
    return f"the batch ({shown})" if k == 1 else f"{k:g}× the batch ({shown})"


def _count(x: float, digits: int = 3) -> str:
    """A threshold in sequences: a whole number as one (16, not 16.0)."""
    return f"{x:,.0f}" if float(x).is_integer() else _shown(x, digits)


def _shown(x: float, digits: int = 3) -> str:
    """gns_window.significant's format (no exponent, thousands separators) at `digits`
    significant digits: 8.40, 15.98, 1,230."""
    if digits == 3:
        return significant(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:,.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def _join(*sentences: str) -> str:
    return " ".join(s for s in sentences if s)


# ------------------------------------------------------------------------------------- effect


@dataclass(frozen=True)
class Effect:
    """Steps and examples to a target loss, relative to their minima, before and after a ramp."""

    steps_ratio_before: float  # S/S_min at the current batch
    steps_ratio_after: float
    examples_ratio_before: float  # E/E_min at the current batch
    examples_ratio_after: float
    step_savings: float  # fraction of optimizer steps saved: 1 − S_after/S_before
    example_cost: float  # fraction more examples (tokens) needed: E_after/E_before − 1

    def to_dict(self) -> dict:
        return asdict(self)


def predicted_effect(current_batch: float, new_batch: float, b_noise: float) -> Effect:
    """S/S_min = 1 + B_noise/B and E/E_min = 1 + B/B_noise at both batches (McCandlish §2.3)."""
    sb, sa = steps_ratio(current_batch, b_noise), steps_ratio(new_batch, b_noise)
    eb, ea = examples_ratio(current_batch, b_noise), examples_ratio(new_batch, b_noise)
    return Effect(sb, sa, eb, ea, 1.0 - sa / sb, ea / eb - 1.0)
