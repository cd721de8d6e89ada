"""Series arithmetic the pages share: the debiased EMA that smooths a loss curve, and the first
step at which a smoothed curve reaches a target.

Owns: `debiased_ema` (TensorBoard-style smoothing, decayed per *step* so a downsampled curve
smooths like the full one) and `first_crossing`. Plain numpy, no Streamlit: unit-testable.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["debiased_ema", "first_crossing"]


def debiased_ema(values, weight: float, counts=None) -> np.ndarray:
    """Bias-corrected exponential moving average of `values`.

    weight in [0, 1): 0 returns the values unchanged, 0.99 smooths heavily. Each point decays the
    average by weight**count, where count (default 1) is how many steps the point stands for (a
    downsampled bucket of 64 steps decays it as 64 steps would). Bias correction (as Adam and
    TensorBoard do) divides by 1 − Π decays, so the first point is the first value, not a value
    pulled towards zero. Non-finite values are skipped: they keep the previous average (NaN until
    the first finite value), so one NaN loss never poisons the rest of the curve.
    """
    v = np.asarray(values, dtype=np.float64)
    w = float(weight)
    if not (0.0 <= w < 1.0) or math.isnan(w):
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight!r}")
    out = np.full(v.shape, np.nan)
    if v.size == 0:
        return out
    if counts is None:
        c = np.ones(v.shape)
    else:
        c = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)
    if w == 0.0:
        out[:] = np.where(np.isfinite(v), v, np.nan)
        # carry the last finite value over gaps
        return _ffill(out)
    avg = 0.0
    norm = 0.0  # 1 − Π decays
    for i in range(v.size):
        x = v[i]
        if math.isfinite(x):
            d = w ** c[i]
            avg = d * avg + (1.0 - d) * x
            norm = d * norm + (1.0 - d)
        out[i] = avg / norm if norm > 0 else np.nan
    return out


def _ffill(a: np.ndarray) -> np.ndarray:
    idx = np.where(np.isfinite(a), np.arange(a.size), -1)
    np.maximum.accumulate(idx, out=idx)
    res = np.full(a.shape, np.nan)
    ok = idx >= 0
    res[ok] = a[idx[ok]]
    return res


def first_crossing(values, target: float) -> int | None:
    """Index of the first point whose value is <= target (NaN never crosses), or None."""
    v = np.asarray(values, dtype=np.float64)
    hit = np.flatnonzero(np.isfinite(v) & (v <= target))
    return int(hit[0]) if hit.size else None
