"""The ramp point: when the batch should grow, and what growing it buys.

Owns `ramp_decision` / `Recommendation` (is the smoothed noise scale above the batch for long
enough; when will it be) and `predicted_effect` (steps and examples before and after a ramp).
How far the batch can grow in memory is advisor/tiers.py.

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
    threshold_batch: float  # threshold × current batch, sequences
    trend_per_step: float | None  # d(noise scale)/d(step) at the latest step, from the trend fit
    steps_above: (
        int  # consecutive estimates (most recent) above threshold_batch, since the last ramp
    )
    hysteresis_steps: int
    min_samples: int
    trend: str  # how the trend was fitted, e.g. 'log-linear over 200 estimates'
    lower_bound: float | None = None  # the latest estimate's one-sided 95% lower bound


@dataclass(frozen=True)
class Recommendation:
    ready: bool
    reason: str
    forecast_step: int | None  # when not ready: the likeliest crossing step (or "ready at" step)
    forecast_range: tuple[int, int | None] | None  # (first, last) step of the stated range
    evidence: Evidence
    suggested_batch: int | None  # 2 × current batch when ready
    forecast_note: str = ""  # what the range rests on, or why no forecast is given

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(steps: Sequence[int], values: Sequence[float | None]) -> list[tuple[int, float | None]]:
    if len(steps) != len(values):
        raise ValueError(
            f"got {len(steps)} steps but {len(values)} noise-scale values: pass one per step"
        )
    out = []
    for s, v in zip(steps, values):
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
    threshold: float = 1.0,
    hysteresis_steps: int = 50,
    min_samples: int = 100,
    window: int = 200,
    since_step: int | None = None,
    trend: str = "log",
    z: float = 1.96,
    lower: Sequence[float | None] | None = None,
    lower_threshold: float = 0.0,
    calibration: ForecastCalibration | None = FORECAST_CALIBRATION,
) -> Recommendation:
    """Should the batch be doubled now, and if not, when will it be time?

    steps, b_noise: the smoothed noise scale (sequences, e.g. advisor.gns_window's b_simple) by step;
    None / NaN / negative mean "no estimate". Ready when at least `min_samples` estimates exist and
    the noise scale has stayed above threshold × current_batch for the last `hysteresis_steps`
    steps (counted only after `since_step`, the last ramp: a ramp restarts the hysteresis but keeps
    the noise-scale history). Otherwise the crossing is forecast from an OLS trend over the last
    `window` estimates, log-linear (trend='log', the noise scale grows roughly geometrically as
    the loss falls) or linear. With trend='log' the stated range is the calibration's
    (`calibrated_forecast`: where the crossing came on recorded runs, given the trend's), and no
    forecast is given outside what it was measured on. With calibration=None or a linear trend
    the range is ±z standard errors by the delta method, which takes the smoothed, correlated
    points for independent ones: on recorded runs it held far less often than it claims (README).

    lower: the noise scale's one-sided lower bound at each step (advisor.gns_window), or None.
    With it, a step counts as above when its point is above the target and its bound is at least
    lower_threshold × current_batch, or when it has no point (the windowed |G|² is not positive:
    B_noise ≫ batch) but its bound alone is above the target. Steps are the steps that have an
    estimate; a step with none is simply absent and neither breaks nor extends the streak.
    """
    batch = float(current_batch)
    if not math.isfinite(batch) or batch <= 0:
        raise ValueError(
            f"current_batch must be a positive number of sequences, got {current_batch!r}"
        )
    if not (math.isfinite(float(threshold)) and threshold > 0):
        raise ValueError(f"threshold must be a positive multiple of the batch, got {threshold!r}")
    hyst = _pos_int("hysteresis_steps", hysteresis_steps)
    if isinstance(min_samples, bool) or int(min_samples) < 0:
        raise ValueError(f"min_samples must be >= 0, got {min_samples!r}")
    min_samples = int(min_samples)
    win = _pos_int("window", window)
    if trend not in ("log", "linear"):
        raise ValueError(f"trend must be 'log' or 'linear', got {trend!r}")
    target = float(threshold) * batch
    points = _clean(steps, b_noise)
    bounds = dict(_clean(steps, lower)) if lower is not None else {}
    bound_target = float(lower_threshold) * batch

    def above(s: int, v: float | None) -> bool:
        b = bounds.get(s)
        if v is None:
            return b is not None and b > target
        return v > target and (lower is None or (b is not None and b >= bound_target))

    valid = [(s, v) for s, v in points if v is not None]
    estimates = [(s, v) for s, v in points if v is not None or bounds.get(s)]
    n = len(estimates)
    latest = valid[-1][1] if valid else None
    last_step = points[-1][0] if points else None
    latest_bound = bounds.get(estimates[-1][0]) if estimates else None
    if estimates and estimates[-1][1] is None:  # the newest step has a bound and no point
        latest = None

    # Consecutive estimates above the target, newest first, after the last ramp.
    steps_above = 0
    for s, v in reversed(estimates):
        if since_step is not None and s <= since_step:
            break
        if not above(s, v):
            break
        steps_above += 1

    # Trend over the recent window.
    recent = valid[-win:]
    if trend == "log":
        recent = [(s, v) for s, v in recent if v > 0]
    fit = None
    if recent:
        xs = np.array([s - recent[-1][0] for s, _ in recent], dtype=np.float64)
        ys = np.array([v for _, v in recent], dtype=np.float64)
        fit = fit_trend(xs, np.log(ys) if trend == "log" else ys)
    trend_desc = f"{'log-linear' if trend == 'log' else 'linear'} over {len(recent)} estimates"
    slope_per_step = forecast = frange = None
    calibrated, note = trend == "log" and calibration is not None, ""
    if fit is not None:
        c, s, cov = fit
        level = math.exp(c) if trend == "log" else c
        slope_per_step = s * level if trend == "log" else s
        if latest is not None and latest <= target and s > 0:
            goal = math.log(target) if trend == "log" else target
            delta = (goal - c) / s
            if delta < 1e15:
                crossing = recent[-1][0] + delta  # continuous step of the crossing
                if calibrated:  # (point, range), or (None, why not)
                    forecast, frange = calibrated_forecast(last_step, crossing, n, calibration)
                    note, frange = (
                        (calibration.note(), frange) if forecast is not None else (frange, None)
                    )
                else:
                    forecast = max(last_step + 1, math.ceil(crossing))
                    grad = np.array([-1.0 / s, -delta / s])  # ∂delta/∂(c, s), delta method
                    sd = math.sqrt(max(0.0, float(grad @ cov @ grad)))
                    lo = max(last_step + 1, math.floor(crossing - z * sd))
                    s_se = math.sqrt(max(0.0, float(cov[1, 1])))
                    hi = None if s - z * s_se <= 0 else max(forecast, math.ceil(crossing + z * sd))
                    frange, note = (lo, hi), f"±{z:g} SE, uncalibrated"

    evidence = Evidence(
        n_samples=n,
        noise_scale=latest,
        threshold_batch=target,
        trend_per_step=slope_per_step,
        steps_above=steps_above,
        hysteresis_steps=hyst,
        min_samples=min_samples,
        trend=trend_desc,
        lower_bound=latest_bound,
    )
    ready = n >= min_samples and steps_above >= hyst
    ns = "none" if latest is None else significant(latest)
    if latest is None and latest_bound:
        ns = f"> {significant(latest_bound)} (95%)"
    bound_note = (
        "" if lower is None else f" with its 95% lower bound >= {significant(bound_target)}"
    )
    if ready:
        reason = (
            f"noise scale {ns} has stayed above {_thr(threshold)}the batch ({significant(target)} "
            f"sequences){bound_note} for {steps_above} estimates ({n} in all): ramp the batch"
        )
        return Recommendation(True, reason, None, None, evidence, int(round(2 * batch)))
    if not estimates:
        reason = "no noise-scale estimate yet: keep training"
    elif steps_above > 0:
        ready_at = last_step + hyst - steps_above
        reason = (
            f"noise scale {ns} above {significant(target)}{bound_note} for {steps_above} of {hyst} "
            f"estimates: ready at step ~{ready_at} if it stays above"
        )
        forecast, frange, note = ready_at, None, ""
    elif latest is not None and latest > target:
        reason = f"noise scale {ns} is above {significant(target)}, but " + (
            f"its 95% lower bound is below {significant(bound_target)}: wait for more evidence"
            if lower is not None
            else f"not since the ramp at step {since_step}"
        )
    elif latest is None:
        reason = (
            f"noise scale {ns}: not above {significant(target)} with 95% confidence yet"
            if latest_bound
            else "the windowed |G|² is not positive and no bound is known yet"
        )
    elif forecast is not None or note:
        said = (
            "no reliable forecast yet"
            if frange is None
            else (
                f"crossing expected between steps {frange[0]:,} and "
                + ("unbounded" if frange[1] is None else f"{frange[1]:,}")
            )
        )
        reason = (
            f"noise scale {ns} below {significant(target)}; trend {slope_per_step:+.3g}/step "
            f"({trend_desc}): {said} ({note})"
        )
    elif fit is None:
        reason = f"noise scale {ns} below {significant(target)}; too few estimates ({len(recent)}) for a trend"
    else:
        reason = f"noise scale {ns} below {significant(target)} and not rising ({trend_desc}): no crossing forecast"
    if n < min_samples:
        reason = f"not enough evidence ({n} noise-scale estimates, need {min_samples}); " + reason
    return Recommendation(False, reason, forecast, frange, evidence, None, note)


def _thr(threshold: float) -> str:
    return "" if threshold == 1 else f"{threshold:g}× "


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
