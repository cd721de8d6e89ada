"""The smoothed noise scale: a ratio of sums over a sliding window of steps, with its interval.

Owns `NoiseScaleWindow` (per-step |G|² and tr(Σ) estimates in, `NoiseScaleEstimate` out) and
`fieller_interval` (the confidence set of a ratio of two means).

Why a window and not an EMA: McCandlish et al. 2018, App. A.1 average numerator and denominator
separately; an exponential average keeps an early |G|² (often 300× the later one) in its
denominator for about 12 half-lives before its bias falls under 10%, so it lags a training run
by hundreds of steps. A ratio of sums over the last n steps forgets the transient completely
after n steps.

How long a window: the shortest that meets a target relative standard error. The per-step
relative variance v of the ratio comes from the whole buffer by the delta method
(Var(ȳ/x̄) ≈ (s_yy − 2R·s_xy + R²·s_xx) / (n·x̄²)), and n = v / target² steps, clamped to
[min_steps, buffer]. A quiet run gets a short window and tracks closely; a noisy one averages
longer.

The interval is Fieller's (Fieller 1954, "Some problems in interval estimation", JRSS B 16):
all R with (ȳ − R·x̄)² ≤ q²·Var(ȳ − R·x̄). Unlike the delta method it stays honest when x̄, the
mean |G|², is near zero: then the set is unbounded above and its lower end is still a valid
bound — a negative windowed |G|² means B_noise ≫ batch, which is information, not a blank.
A two-sided level of 0.90 gives one-sided 95% bounds. Successive steps use fresh batches, so the
per-step estimates are independent given the weights; the drift of |G|² inside a window is not
in the variance, which is why the window is kept short.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

__all__ = ["NoiseScaleEstimate", "NoiseScaleWindow", "fieller_interval", "significant"]


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """B_simple = Σ tr(Σ) / Σ |G|² over the window, in sequences, with one-sided bounds."""

    b_simple: float | None  # None when the window's mean |G|² or trace is not positive
    lower: float  # one-sided lower bound at the window's level; 0.0 says nothing
    upper: float | None  # one-sided upper bound; None = unbounded
    steps: int  # steps in the window
    g2: float  # window mean of |G|²
    trace: float  # window mean of tr(Σ)

    def describe(self) -> str:
        """'42 (30–61)', '> 120', '< 3' or 'unknown': what a person reads on the card."""
        if self.b_simple is not None:
            hi = "∞" if self.upper is None else significant(self.upper)
            return f"{significant(self.b_simple)} ({significant(self.lower)}–{hi})"
        if self.lower > 0:
            return f"> {significant(self.lower)}"
        if self.upper is not None:
            return f"< {significant(self.upper)}"
        return "unknown"


def significant(x: float) -> str:
    """Three significant digits with thousands separators and no exponent: 0.00052, 8.4, 1,230."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:,.{digits}f}"


def _t_quantile(p: float, dof: int) -> float:
    """Student-t quantile by the Cornish–Fisher expansion around the normal one (Abramowitz &
    Stegun 26.7.5); within 0.3% of the exact value for dof >= 5 at p = 0.95."""
    z = NormalDist().inv_cdf(p)
    if dof <= 0:
        return math.inf
    return (
        z
        + (z**3 + z) / (4 * dof)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
    )


def fieller_interval(
    mx: float, my: float, vxx: float, vyy: float, vxy: float, q: float
) -> tuple[float, float | None]:
    """(lower, upper) of R = E[y]/E[x] on [0, ∞), from the means mx, my and their (co)variances.

    Solves (my − R·mx)² ≤ q²·(vyy − 2R·vxy + R²·vxx), i.e. a·R² − 2b·R + c ≤ 0 with
    a = mx² − q²vxx, b = mx·my − q²vxy, c = my² − q²vyy. a > 0 (mx clearly non-zero): a bounded
    interval. a ≤ 0: the complement of an interval or the whole line; on R ≥ 0 that is
    [r, ∞) (a lower bound only) when the other piece lies below zero, otherwise no information
    (0, None). upper None means unbounded; lower 0.0 means no lower bound.
    """
    a = mx * mx - q * q * vxx
    b = mx * my - q * q * vxy
    c = my * my - q * q * vyy
    disc = b * b - a * c
    if a > 0:
        root = math.sqrt(max(0.0, disc))
        lo, hi = (b - root) / a, (b + root) / a
        if hi < 0:  # the set lies below zero, where no ratio of |G|² >= 0 and tr Σ >= 0 is
            return _sign_bounds(mx, my, vxx, vyy, q)
        return max(0.0, lo), hi
    if disc <= 0 or a == 0:
        return 0.0, None
    root = math.sqrt(disc)
    r1, r2 = sorted(((b - root) / a, (b + root) / a))
    if r1 < 0:
        return max(0.0, r2), None
    return 0.0, None


DRIFT_Z = 3.0  # two-sample z beyond which a window's halves are taken to differ


class _Tail:
    """Sums over the newest n entries of x, y, x², y², xy for any n in O(1) (suffix sums)."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        rev = np.stack([x, y, x * x, y * y, x * y])[:, ::-1]
        self._sums = np.concatenate([np.zeros((5, 1)), np.cumsum(rev, axis=1)], axis=1)

    def moments(self, start: int, stop: int) -> tuple[float, float, float, float, float, int]:
        """Means of x and y and (co)variances (ddof 1) of entries start..stop-1 counted from the
        newest (0 = newest)."""
        n = stop - start
        sx, sy, sxx, syy, sxy = (self._sums[:, stop] - self._sums[:, start]).tolist()
        mx, my = sx / n, sy / n
        d = max(1, n - 1)
        return (
            mx,
            my,
            (sxx - n * mx * mx) / d,
            (syy - n * my * my) / d,
            (sxy - n * mx * my) / d,
            n,
        )


def _rel_se(tail: _Tail, n: int) -> float:
    """Relative standard error of the ratio of means over the newest n (delta method)."""
    mx, my, vxx, vyy, vxy, _ = tail.moments(0, n)
    if mx <= 0 or my <= 0:
        return math.inf
    ratio = my / mx
    var = (vyy - 2 * ratio * vxy + ratio * ratio * vxx) / (n * mx * mx)
    return math.sqrt(max(0.0, var)) / ratio


def _drifted(tail: _Tail, n: int) -> bool:
    """Do the older and the newer half of the newest n entries differ, in x or in y?"""
    half = n // 2
    if half < 2:
        return False
    new = tail.moments(0, half)
    old = tail.moments(half, n)
    for mean, var in ((0, 2), (1, 3)):  # x, then y
        se = math.sqrt(max(0.0, new[var]) / new[5] + max(0.0, old[var]) / old[5])
        if abs(new[mean] - old[mean]) > DRIFT_Z * se:
            return True
    return False


def _sign_bounds(
    mx: float, my: float, vxx: float, vyy: float, q: float
) -> tuple[float, float | None]:
    """Bounds when one mean came out negative though both true values are >= 0: the ratio of
    the one-sided limits of each mean (conservative: both limits at once). A mean observed at or
    below zero is taken at zero, so its upper limit is q standard errors."""
    x_hi, x_lo = max(mx, 0.0) + q * math.sqrt(vxx), mx - q * math.sqrt(vxx)
    y_hi, y_lo = max(my, 0.0) + q * math.sqrt(vyy), my - q * math.sqrt(vyy)
    if my > 0:  # |G|² came out negative: B_noise is large, bounded below
        return (y_lo / x_hi if y_lo > 0 and x_hi > 0 else 0.0), None
    return 0.0, (max(0.0, y_hi) / x_lo if x_lo > 0 else None)  # tr Σ negative: B_noise small


class NoiseScaleWindow:
    """Per-step (|G|², tr(Σ)) estimates in; the windowed B_simple and its interval out.

    `update()` takes one optimizer step's estimates (advisor.gns.line_estimates) and returns
    the new `NoiseScaleEstimate`, or None when the step had none (non-finite gradients): a step
    without a new estimate has no smoothed value either, so nothing stale is ever reported.
    Neither |G|² nor tr(Σ) depends on the batch size, so a ramp keeps the window.
    """

    STATE_VERSION = 2

    def __init__(
        self,
        max_steps: int = 200,
        min_steps: int = 48,
        target_rel_se: float = 0.2,
        level: float = 0.90,
    ):
        if not (
            isinstance(max_steps, int)
            and isinstance(min_steps, int)
            and 3 <= min_steps <= max_steps
        ):
            raise ValueError(
                f"need integers 3 <= min_steps <= max_steps, got {min_steps}, {max_steps}"
            )
        if not (math.isfinite(target_rel_se) and target_rel_se > 0):
            raise ValueError(f"target_rel_se must be a positive fraction, got {target_rel_se!r}")
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level!r}")
        self.max_steps, self.min_steps = max_steps, min_steps
        self.target_rel_se, self.level = float(target_rel_se), float(level)
        self._g2: deque[float] = deque(maxlen=max_steps)
        self._trace: deque[float] = deque(maxlen=max_steps)
        self.updates = 0
        self.skipped = 0
        self.latest: NoiseScaleEstimate | None = None

    def update(self, g2: float, trace: float) -> NoiseScaleEstimate | None:
        try:
            g, t = float(g2), float(trace)
        except (TypeError, ValueError):
            g = t = math.nan
        if not (math.isfinite(g) and math.isfinite(t)):
            self.skipped += 1
            return None
        self._g2.append(g)
        self._trace.append(t)
        self.updates += 1
        self.latest = self.estimate()
        return self.latest

    def window_steps(self, tail: _Tail, total: int) -> int:
        """The window, grown on a ×1.25 ladder from min_steps: stop at the first length whose own
        relative standard error (delta method) meets the target, or before the first length whose
        older half differs from its newer half (|G|² or tr(Σ) drifted: training moved on)."""
        n = self.min_steps
        while n < total:
            if _rel_se(tail, n) <= self.target_rel_se:
                return n
            grown = min(total, max(n + 1, int(n * 1.25)))
            if _drifted(tail, grown):
                return n
            n = grown
        return total

    def estimate(self) -> NoiseScaleEstimate | None:
        """The estimate over the current window (None until min_steps estimates)."""
        if len(self._g2) < self.min_steps:
            return None
        tail = _Tail(np.fromiter(self._g2, float), np.fromiter(self._trace, float))
        n = self.window_steps(tail, len(self._g2))
        mx, my, vxx, vyy, vxy, _ = tail.moments(0, n)
        q = _t_quantile(0.5 + self.level / 2, n - 1)
        lower, upper = fieller_interval(mx, my, vxx / n, vyy / n, vxy / n, q)
        point = my / mx if mx > 0 and my > 0 else None
        if point is not None:  # the point lies inside its own Fieller set; guard rounding
            lower = min(lower, point)
            upper = None if upper is None else max(upper, point)
        return NoiseScaleEstimate(point, lower, upper, n, mx, my)

    def to_dict(self) -> dict:
        """JSON-safe state for a checkpoint: the buffer itself, so a resume continues it."""
        return {
            "version": self.STATE_VERSION,
            "max_steps": self.max_steps,
            "min_steps": self.min_steps,
            "target_rel_se": self.target_rel_se,
            "level": self.level,
            "g2": list(self._g2),
            "trace": list(self._trace),
            "updates": self.updates,
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, state: dict) -> NoiseScaleWindow:
        if state.get("version") != cls.STATE_VERSION:
            raise ValueError(
                f"noise-scale state version {state.get('version')!r} is not "
                f"{cls.STATE_VERSION}: start a fresh NoiseScaleWindow instead"
            )
        w = cls(
            int(state["max_steps"]),
            int(state["min_steps"]),
            float(state["target_rel_se"]),
            float(state["level"]),
        )
        if len(state["g2"]) != len(state["trace"]):
            raise ValueError("noise-scale state is corrupt: g2 and trace buffers differ in length")
        w._g2.extend(float(v) for v in state["g2"])
        w._trace.extend(float(v) for v in state["trace"])
        w.updates, w.skipped = int(state["updates"]), int(state.get("skipped", 0))
        w.latest = w.estimate()
        return w
