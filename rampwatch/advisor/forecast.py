"""The ramp point's forecast: when the smoothed noise scale will cross the batch, as a range
that holds as often as it says.

Owns: `fit_trend` (OLS of log noise scale on step) and `ForecastCalibration` /
`calibrated_forecast` (where the crossing came on recorded runs, given where the trend put it:
split-conformal, each run left out in turn; bench/forecast_bench.py measures and fits it, the
README's "Forecast coverage" has the figures). The ±1.96 SE delta-method range of the trend
alone held for 17% of queries on those runs: the smoothed points are correlated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ForecastCalibration:
    """Where the crossing really came on recorded runs, given where the log-linear trend put it.

    t: the query step (the newest estimate's); h: steps from t to the first estimate above the
    target; h_trend: the trend's (its crossing step − t, at least 1). With x = log(h_trend/t),
    log(h/t) = intercept + slope·x + e; the range is t + t·exp(intercept + slope·x + [low, high]),
    low and high quantiles of e (mid, its median, gives the point). Dividing by t frees it of the
    run's time scale. No range outside x in [x_min, x_max] or below `min_estimates` estimates,
    where it was not measured. coverage: the share of `queries` (on `runs` runs, outcome known)
    whose crossing the range held, each run left out of the fit in turn.
    """

    intercept: float
    slope: float
    low: float
    mid: float
    high: float
    x_min: float
    x_max: float
    min_estimates: int
    coverage: float
    runs: int
    queries: int

    def note(self) -> str:
        held = math.floor(self.coverage * 10 + 1e-9)
        return f"such ranges held {held} times in 10 on {self.runs} recorded runs"


# Fitted 2026-12-01 by `python -m bench.forecast_bench --keep DIR`: its ten bench-tiny runs at
# constant batches 8, 16 and 32 (seeds 2–11), ramp points 1, 2, 4× the batch, every other step
# queried. The README's "Forecast coverage" has the figures, and a check on ramp_bench's runs.
FORECAST_CALIBRATION = ForecastCalibration(
    intercept=-0.187,
    slope=0.23,
    low=-2.813,
    mid=0.138,
    high=2.096,
    x_min=-5.63,
    x_max=2.36,
    min_estimates=10,
    coverage=0.906,
    runs=10,
    queries=2574,
)


def calibrated_forecast(
    query_step: int,
    crossing: float,
    n_estimates: int,
    cal: ForecastCalibration = FORECAST_CALIBRATION,
):
    """(point, (first, last)) steps of the crossing by the calibration, or (None, why not: the
    words that follow "no reliable forecast yet:" on the card)."""
    t = max(1, int(query_step))
    if n_estimates < cal.min_estimates:
        return None, f"the forecast needs {cal.min_estimates} estimates first"
    ahead = max(1, math.ceil(crossing) - t)  # the trend's crossing, steps from now
    x = math.log(ahead / t)  # the trend's step, as the old point
    if x > cal.x_max:
        return (
            None,
            f"the trend says in about {ahead:,} steps, further ahead than the forecast can time",
        )
    if x < cal.x_min:
        return None, (
            f"the trend says within {ahead:,} step{'' if ahead == 1 else 's'}, sooner than the "
            "forecast can time"
        )
    centre = cal.intercept + cal.slope * x
    at = [t + t * math.exp(centre + e) for e in (cal.mid, cal.low, cal.high)]
    return max(t + 1, round(at[0])), (max(t + 1, math.floor(at[1])), max(t + 1, math.ceil(at[2])))


def fit_trend(xs: np.ndarray, ys: np.ndarray):
    """OLS y = c + s·x; returns (c, s, cov 2×2) or None when it cannot be fitted."""
    n = len(xs)
    if n < 3 or np.ptp(xs) == 0:
        return None
    X = np.stack([np.ones_like(xs), xs], axis=1)
    coef, *_ = np.linalg.lstsq(X, ys, rcond=None)
    resid = ys - X @ coef
    s2 = float(resid @ resid) / (n - 2)
    cov = s2 * np.linalg.inv(X.T @ X)
    return float(coef[0]), float(coef[1]), cov
