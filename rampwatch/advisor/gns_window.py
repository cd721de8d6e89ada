"""The smoothed noise scale: a ratio of sums over the steps since the last change, with its interval.

Owns `NoiseScaleWindow` (per-step |G|² and tr(Σ) estimates in, `NoiseScaleEstimate` out) and
`fieller_interval` (the confidence set of a ratio of two means).

Ratio of sums: McCandlish et al. 2018, App. A.1 average numerator and denominator separately.
Not an EMA: an exponential average keeps an early |G|² (often 300× the later one) in its
denominator for about 12 half-lives, so it lags a training run by hundreds of steps.

Which steps: every step since the last change point, up to the buffer (`max_steps`, 4,000). The
window grows by one step per step and shrinks only at a change point, so consecutive estimates
share all but one step of their evidence and never flip between two windows. A change point is
where the newer part of the window differs from the older: after each step every candidate cut
(newer parts of min_steps/4, ×1.25, … steps, and older parts of 2, 3, 4, 5, 6, 7, 9, … steps,
so a few stale steps at the old end are found too) is a two-sample z, variance pooled, on the
mean |G|² and on the mean tr(Σ), each clipped tighter (TEST_K) so heavy tails cost no power.
When the largest z passes CUT_Z the window drops everything older than that cut (adaptive
windowing: Bifet & Gavaldà 2007, "Learning from time-changing data with adaptive windowing",
SDM; the cut at the largest statistic estimates where the change is, as a two-window test does:
Page 1954, "Continuous inspection schemes", Biometrika 41). CUT_Z is high because it is one scan
of many cuts every step (measured: ~0.2 false cuts per 1,000 steady steps; a 20× fall of |G|²
is cut ~10 steps after it). A known moment (`mark`: a ramp) is tested alone, at MARK_Z. So the
early transient, an LR change or a drift of |G|² is left behind, and with no drift the window
keeps growing and the interval narrows. A window never reaches back across a cut: right after
one it holds a few steps (min_steps/4 at least), and while they cannot pin the value down the
interval says so (wide, or unbounded above) — there is no fallback to a longer, biased window.

One step cannot carry the estimate: each step's |G|² and tr(Σ) are clipped to the window's
median ± HAMPEL_K robust standard deviations (1.4826·MAD) before any sum — the Hampel
identifier (Hampel 1974, "The influence curve and its role in robust estimation", JASA 69)
bounding each step's influence as Huber's estimator does (Huber 1964, Ann. Math. Stat. 35). At
K = 6 a Gaussian step is clipped once in 500 million, so only true outliers are; a 50× step
then moves a 100-step mean by a few per cent instead of half.

The interval is Fieller's (Fieller 1954, "Some problems in interval estimation", JRSS B 16):
all R with (ȳ − R·x̄)² ≤ q²·Var(ȳ − R·x̄). Unlike the delta method it stays honest when x̄, the
mean |G|², is near zero: then the set is unbounded above and its lower end is still a valid
bound — a negative windowed |G|² means B_noise ≫ batch, which is information, not a blank.
A two-sided level of 0.90 gives one-sided 95% bounds. Successive steps use fresh batches, so the
per-step estimates are independent given the weights.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
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


@lru_cache(maxsize=16)
def _normal_quantile(p: float) -> float:
    return NormalDist().inv_cdf(p)


def _t_quantile(p: float, dof: int) -> float:
    """Student-t quantile by the Cornish–Fisher expansion around the normal one (Abramowitz &
    Stegun 26.7.5); within 0.3% of the exact value for dof >= 5 at p = 0.95."""
    z = _normal_quantile(p)
    if dof <= 0:
        return math.inf
    return (
        z
        + (z**3 + z) / (4 * dof)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
    )


def fieller_interval(
    mx: float, my: float, vxx: float, vyy: float, vxy: float, q: float, signed: bool = False
) -> tuple[float | None, float | None]:
    """(lower, upper) of R = E[y]/E[x] on [0, ∞), from the means mx, my and their (co)variances.

    Solves (my − R·mx)² ≤ q²·(vyy − 2R·vxy + R²·vxx), i.e. a·R² − 2b·R + c ≤ 0 with
    a = mx² − q²vxx, b = mx·my − q²vxy, c = my² − q²vyy. a > 0 (mx clearly non-zero): a bounded
    interval. a ≤ 0: the complement of an interval or the whole line; on R ≥ 0 that is
    [r, ∞) (a lower bound only) when the other piece lies below zero, otherwise no information
    (0, None). upper None means unbounded; lower 0.0 means no lower bound.

    signed: R on the whole line (a ratio that may be negative: advisor/trial.py's half-progress
    ratio). The set is then bounded only when a > 0, (lo, hi) as solved; otherwise it is two rays
    or the whole line, and neither end is bounded: (None, None).
    """
    a = mx * mx - q * q * vxx
    b = mx * my - q * q * vxy
    c = my * my - q * q * vyy
    disc = b * b - a * c
    if signed:
        if a <= 0:
            return None, None
        root = math.sqrt(max(0.0, disc))
        return (b - root) / a, (b + root) / a
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


HAMPEL_K = 6.0  # robust standard deviations beyond which one step's value is clipped
TEST_K = 3.0  # the same, tighter, for the change test only: so heavy tails cost it no power
CUT_Z = 4.5  # z of a scan over all cuts every step: ~0.2 false cuts per 1,000 steady steps
MARK_Z = 3.0  # the same test at one known moment (a ramp), looked at while the mark is recent
LADDER = 1.25  # candidate cuts lie ×1.25 apart
DEFAULT_MAX_STEPS = 4000  # the buffer, and so the checkpoint's state: at most 8,000 floats


class _Buffer:
    """The newest `size` (|G|², tr Σ) pairs in one numpy array; append is O(1) amortized."""

    def __init__(self, size: int):
        self.size = size
        self._data = np.empty((2, 2 * size))
        self._end = 0

    def __len__(self) -> int:
        return min(self._end, self.size)

    def append(self, g2: float, trace: float) -> None:
        if self._end == self._data.shape[1]:  # full: the newest `size` move to the front
            self._data[:, : self.size] = self._data[:, self._end - self.size :]
            self._end = self.size
        self._data[:, self._end] = g2, trace
        self._end += 1

    def newest(self, n: int) -> np.ndarray:
        """The newest n pairs, newest first: row 0 |G|², row 1 tr(Σ) (a view)."""
        return self._data[:, self._end - n : self._end][:, ::-1]


def _rows_median(x: np.ndarray, *, own: bool = False) -> np.ndarray:
    """Each row's median, as np.median(x, axis=1) (the mean of the two middle values when the
    row's length is even), by one partition of both rows; own: x may be reordered in place."""
    n = x.shape[1]
    half = n // 2
    if own:
        x.partition(half, axis=1)
        part = x
    else:
        part = np.partition(x, half, axis=1)
    if n % 2:
        return part[:, half]
    # the middle pair: the (half)th smallest, and the largest of the half before it
    return (part[:, :half].max(axis=1) + part[:, half]) / 2.0


def _clip(x: np.ndarray, centre: np.ndarray, scale: np.ndarray, k: float) -> np.ndarray:
    """Each row of x with values beyond centre ± k·scale moved to that edge (a row with scale
    0, a constant stream, is left as it is). A new array, C-ordered."""
    edge = np.where(scale > 0, k * scale, np.inf)
    return x.clip((centre - edge)[:, None], (centre + edge)[:, None])


_KS = np.array([[TEST_K], [HAMPEL_K]])


def _edges(centre: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_clip's edges at TEST_K ([0]) and HAMPEL_K ([1]) at once: (low, high), each [k, row, 1]."""
    edge = np.where(scale > 0, _KS * scale, np.inf)
    return (centre - edge)[..., None], (centre + edge)[..., None]


def _row_means(x: np.ndarray) -> np.ndarray:
    """x.mean(axis=1, keepdims=True): the same sums, divided by the same count."""
    return np.add.reduce(x, axis=1, keepdims=True) / x.shape[1]


def _split_z(x: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """|z| of mean(newest m) − mean(the rest) for each m in cuts, each row of x newest first
    (one row of z per row of x). The variance is pooled (both parts come from one distribution
    when nothing changed), so an older part of two steps is tested as soundly as one of two
    hundred."""
    x = x - _row_means(x)  # sums of squares about a central value keep their digits
    s1, s2 = np.add.accumulate(x, axis=1), np.add.accumulate(x * x, axis=1)
    n = x.shape[1]
    m, k = cuts, n - cuts
    head = s1[:, m - 1]
    new, old = head / m, (s1[:, -1:] - head) / k
    within = s2[:, -1:] - m * new * new - k * old * old  # squares about each part's own mean
    se = np.sqrt(np.maximum(within, 0.0) / (n - 2) * (1.0 / m + 1.0 / k))
    diff = np.abs(new - old)
    return np.divide(diff, se, out=np.where(diff > 0, np.inf, 0.0), where=se > 0)


def _ladder(first: int, last: int) -> list[int]:
    """first, ×LADDER, … up to last (each at least one more than the one before)."""
    out = [first] if first <= last else []
    while out and (grown := max(out[-1] + 1, int(out[-1] * LADDER))) <= last:
        out.append(grown)
    return out


@lru_cache(maxsize=32)
def _full_ladder(first: int, last: int) -> tuple[int, ...]:
    """_ladder(first, last), kept: a shorter ladder from `first` is a prefix of it."""
    return tuple(_ladder(first, last))


def _cuts(n: int, shortest: int, longest: int) -> list[int]:
    """The candidate newer-part lengths of a window of n steps (n <= longest), ascending:
    newer parts of shortest, ×1.25, … steps and older parts of 2, 3, 4, 5, 6, 7, 9, … steps."""
    newer = _full_ladder(shortest, longest)
    older = _full_ladder(2, longest)
    cuts = set(newer[: bisect_right(newer, n - 2)])
    cuts.update(n - k for k in older[: bisect_right(older, n - shortest)])
    return sorted(cuts)


class NoiseScaleWindow:
    """Per-step (|G|², tr(Σ)) estimates in; the windowed B_simple and its interval out.

    `update()` takes one optimizer step's estimates (advisor.gns.line_estimates) and returns
    the new `NoiseScaleEstimate`, or None when the step had none (non-finite gradients): a step
    without a new estimate has no smoothed value either, so nothing stale is ever reported.
    `mark()` says a known change may begin at the next step (a ramp, an LR change): neither
    |G|² nor tr(Σ) depends on the batch and the weights do not jump, so the window is kept, but
    that moment is tested on its own (MARK_Z) and cut at once when the steps after it differ.
    """

    STATE_VERSION = 3

    def __init__(
        self, max_steps: int = DEFAULT_MAX_STEPS, min_steps: int = 48, level: float = 0.90
    ):
        if not (
            isinstance(max_steps, int)
            and isinstance(min_steps, int)
            and 3 <= min_steps <= max_steps
        ):
            raise ValueError(
                f"need integers 3 <= min_steps <= max_steps, got {min_steps}, {max_steps}"
            )
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level!r}")
        self.max_steps, self.min_steps, self.level = max_steps, min_steps, float(level)
        self._steps = _Buffer(max_steps)
        self.length = 0  # steps in the window: the newest `length` of the buffer
        self.since_mark: int | None = None  # steps since a mark still to be tested
        self.updates = 0
        self.skipped = 0
        self.cuts = 0  # change points found
        self.latest: NoiseScaleEstimate | None = None

    def update(self, g2: float, trace: float) -> NoiseScaleEstimate | None:
        if not self._admit(g2, trace):
            return None
        x, centre, scale = self._robust()
        low, high = _edges(centre, scale)
        if self._cut(x.clip(low[0], high[0])):  # _clip(x, centre, scale, TEST_K)
            x, centre, scale = self._robust()
            low, high = _edges(centre, scale)
        # none before min_steps steps in all; after a cut the window's few steps give a wide
        # interval, not a blank, until it has grown again
        if self.updates < self.min_steps:
            self.latest = None
        else:  # _clip(x, centre, scale, HAMPEL_K)
            self.latest = self._estimate(x.clip(low[1], high[1]))
        return self.latest

    def _admit(self, g2, trace) -> bool:
        """One step's pair into the buffer and the window; False (counted as skipped) when it
        is not a pair of finite numbers."""
        try:
            g, t = float(g2), float(trace)
        except (TypeError, ValueError):
            g = t = math.nan
        if not (math.isfinite(g) and math.isfinite(t)):
            self.skipped += 1
            return False
        self._steps.append(g, t)
        self.updates += 1
        self.length = min(self.length + 1, len(self._steps))
        if self.since_mark is not None:
            self.since_mark += 1
        return True

    def mark(self) -> None:
        """A known change may start with the next step (a ramp, an LR change): the steps after
        it are tested against the window before it, alone (MARK_Z), until 4·min_steps later."""
        self.since_mark = 0

    def _robust(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The window's |G|² (row 0) and tr(Σ) (row 1), newest first; each row's median and
        robust SD (1.4826·MAD), the centre and scale it is clipped by."""
        x = self._steps.newest(self.length)
        centre = _rows_median(x)
        return x, centre, 1.4826 * _rows_median(np.abs(x - centre[:, None]), own=True)

    def _cut(self, tested: np.ndarray) -> bool:
        """Drop everything older than a change point the newest steps show, if any; tested:
        the window clipped at TEST_K. True when the window was cut."""
        n, shortest = self.length, max(2, self.min_steps // 4)
        mark = self.since_mark
        if mark is not None and mark > 4 * self.min_steps:
            self.since_mark = mark = None  # long past: the scan alone watches it now
        # newer parts of shortest, ×1.25, … steps, and older parts of 2, 3, … steps: a few
        # stale steps left at the window's old end are found as surely as a recent change
        cuts = _cuts(n, shortest, max(n, self.max_steps))
        if not cuts:
            return False
        at = np.array(cuts)
        z_g, z_t = _split_z(tested, at)
        z = np.maximum(z_g, z_t)
        best = int(np.argmax(z))
        if z[best] > CUT_Z:
            self.length = cuts[best]
        elif mark is not None and shortest <= mark <= n - 2:
            (z_g,), (z_t,) = _split_z(tested, np.array([mark]))
            if max(z_g, z_t) > MARK_Z:
                self.length = mark
            else:
                return False
        else:
            return False
        self.cuts += 1
        self.since_mark = None
        return True

    def estimate(self) -> NoiseScaleEstimate | None:
        """The estimate over the current window (None until min_steps estimates)."""
        if self.updates < self.min_steps or self.length < 2:
            return None
        return self._estimate(_clip(*self._robust(), HAMPEL_K))

    def _estimate(self, kept: np.ndarray) -> NoiseScaleEstimate:
        """Ratio of means and Fieller interval of the window clipped at HAMPEL_K."""
        n = kept.shape[1]
        means = _row_means(kept)  # g.mean() and t.mean(), and np.cov(g, t)'s own means
        (mx,), (my,) = means.tolist()
        d = kept - means  # np.cov's steps, without its checks and dispatch: the same numbers
        c = np.dot(d, d.T)
        c *= 1 / (n - 1)  # np.cov's np.true_divide(1, n - 1)
        (vxx, vxy), (_, vyy) = c.tolist()
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
            "level": self.level,
            "g2": self._steps.newest(len(self._steps))[0, ::-1].tolist(),
            "trace": self._steps.newest(len(self._steps))[1, ::-1].tolist(),
            "length": self.length,
            "since_mark": self.since_mark,
            "updates": self.updates,
            "skipped": self.skipped,
            "cuts": self.cuts,
        }

    @classmethod
    def from_dict(cls, state: dict) -> NoiseScaleWindow:
        """A window from to_dict(). A version-2 state (a checkpoint written before change
        points) keeps its buffer as the window, in today's larger buffer."""
        version = state.get("version")
        if version not in (2, cls.STATE_VERSION):
            raise ValueError(
                f"noise-scale state version {version!r} is not {cls.STATE_VERSION} (or 2): "
                "start a fresh NoiseScaleWindow instead"
            )
        if len(state["g2"]) != len(state["trace"]):
            raise ValueError("noise-scale state is corrupt: g2 and trace buffers differ in length")
        max_steps = int(state["max_steps"])
        if version == 2:  # its max_steps was the longest window; the buffer is larger now
            max_steps = max(max_steps, DEFAULT_MAX_STEPS)
        w = cls(max_steps, int(state["min_steps"]), float(state["level"]))
        for g, t in list(zip(state["g2"], state["trace"], strict=True))[-max_steps:]:
            w._steps.append(float(g), float(t))
        w.length = min(int(state.get("length", len(w._steps))), len(w._steps))
        mark = state.get("since_mark")
        w.since_mark = None if mark is None else int(mark)
        w.updates, w.skipped = int(state["updates"]), int(state.get("skipped", 0))
        w.cuts = int(state.get("cuts", 0))
        w.latest = w.estimate()
        return w
