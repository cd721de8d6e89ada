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
    threshold_batch: float  # ramp_at × current batch, sequences
    trend_per_step: float | None  # d(noise scale)/d(step) at the latest step, from the trend fit
    steps_above: int  # consecutive estimates (newest first) above threshold_batch, since the ramp
    hysteresis_steps: int
    min_estimates: int
    trend: str  # how the trend was fitted, e.g. 'log-linear over 200 estimates'
    lower_bound: float | None = None  # the latest estimate's one-sided 95% lower bound


@dataclass(frozen=True)
class Recommendation:
    ready: bool
    reason: str
    forecast_step: int | None  # when not ready: the likeliest crossing step (or "ready at" step)
    forecast_range: tuple[int, int | None] | None  # (first, last) step of the stated range
    evidence: Evidence
    suggested_batch: int | None  # factor × current batch when ready
    forecast_note: str = ""  # what the range rests on, or why no forecast is given

    def to_dict(self) -> dict:
        return asdict(self)


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
    bound_note = (
        "" if lower is None else f" with its 95% lower bound >= {significant(bound_target)}"
    )
    if evidence.n_samples >= evidence.min_estimates and steps_above >= hyst:
        reason = (
            f"noise scale {series.shown()} has stayed above {_thr(ramp_at)}the batch "
            f"({significant(target)} sequences){bound_note} for {steps_above} estimates "
            f"({series.n} in all): ramp the batch"
        )
        return Recommendation(True, reason, None, None, evidence, int(round(factor * batch)))
    if steps_above > 0:
        ready_at = series.last_step + hyst - steps_above
        reason = (
            f"noise scale {series.shown()} above {significant(target)}{bound_note} for "
            f"{steps_above} of {hyst} estimates: ready at step ~{ready_at} if it stays above"
        )
        forecast = _Forecast(ready_at, None, "")
    else:
        reason = _not_above(series, fit, forecast, target, bound_target, lower, since_step)
    if series.n < evidence.min_estimates:
        reason = (
            f"not enough evidence ({series.n} noise-scale estimates, need "
            f"{evidence.min_estimates}); " + reason
        )
    return Recommendation(
        False, reason, forecast.step, forecast.range, evidence, None, forecast.note
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

    def shown(self) -> str:
        if self.latest is None and self.latest_bound:
            return f"> {significant(self.latest_bound)} (95%)"
        return "none" if self.latest is None else significant(self.latest)

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
        desc = f"{'log-linear' if kind == 'log' else 'linear'} over {len(recent)} estimates"
        return cls(kind, recent, fit, desc, slope)


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
    if latest is None or latest > target or s <= 0:
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


def _not_above(series, trend, forecast, target, bound_target, lower, since_step) -> str:
    """Why no streak is running: no estimate, a point above without its bound, or below."""
    ns, latest = series.shown(), series.latest
    if not series.estimates:
        return "no noise-scale estimate yet: keep training"
    if latest is not None and latest > target:
        return f"noise scale {ns} is above {significant(target)}, but " + (
            f"its 95% lower bound is below {significant(bound_target)}: wait for more evidence"
            if lower is not None
            else f"not since the ramp at step {since_step}"
        )
    if latest is None:
        return (
            f"noise scale {ns}: not above {significant(target)} with 95% confidence yet"
            if series.latest_bound
            else "the windowed |G|² is not positive and no bound is known yet"
        )
    if forecast.step is not None or forecast.note:
        frange = forecast.range
        said = (
            "no reliable forecast yet"
            if frange is None
            else (
                f"crossing expected between steps {frange[0]:,} and "
                + ("unbounded" if frange[1] is None else f"{frange[1]:,}")
            )
        )
        return (
            f"noise scale {ns} below {significant(target)}; trend "
            f"{trend.slope_per_step:+.3g}/step ({trend.desc}): {said} ({forecast.note})"
        )
    if trend.fit is None:
        return (
            f"noise scale {ns} below {significant(target)}; too few estimates "
            f"({len(trend.recent)}) for a trend"
        )
    return (
        f"noise scale {ns} below {significant(target)} and not rising ({trend.desc}): "
        "no crossing forecast"
    )


def _thr(ramp_at: float) -> str:
    return "" if ramp_at == 1 else f"{ramp_at:g}× "


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
