"""The smoothed noise scale: a ratio of sums over the steps since the last change, with its interval.

Owns `NoiseScaleWindow` (per-step |G|² and tr(Σ) estimates in, `NoiseScaleEstimate` out) and
`fieller_interval` (the confidence set of a ratio of two means).

Ratio of sums: McCandlish et al. 2018, App. A.1 average numerator and denominator separately.
Not an EMA: an exponential average keeps an early |G|² (often 300× the later one) in its
denominator for about 12 half-lives, so it lags a training run by hundreds of steps.

Which steps: every step since the last change point, up to the buffer (`max_steps`, 4,000). The
window grows by one step per step and shrinks only at a change point, so consecutive estimates
share all but one step of their evidence and never flip between two windows. A change point is
where the newer part of the window differs from the older: every SCAN_EVERY (4) steps, for each
step since the last scan, every candidate cut (newer parts of min_steps/4, ×1.25, … steps, and
older parts of 2, 3, 4, 5, 6, 7, 9, … steps, so a few stale steps at the old end are found too)
is a two-sample z, variance pooled, on the mean |G|² and on the mean tr(Σ), each clipped tighter
(TEST_K) so heavy tails cost no power. When the largest z passes CUT_Z the window drops everything older than that cut
(adaptive windowing: Bifet & Gavaldà 2007, "Learning from time-changing data with adaptive
windowing", SDM; the cut at the largest statistic estimates where the change is, as a two-window
test does: Page 1954, "Continuous inspection schemes", Biometrika 41). CUT_Z is high because it
is one scan of many cuts (measured, scanning every step: ~0.2 false cuts per 1,000 steady steps;
a 20× fall of |G|² is found 5 steps after it in the median of 20 streams, and cut at the next
scan: 7 steps after it).
A known moment (`mark`: a ramp) is tested alone, at MARK_Z, every step. So the early transient,
an LR change or a drift of |G|² is left behind, and with no drift the window keeps growing and
the interval narrows. A window never reaches back across a cut: right after one it holds a few
steps (min_steps/4 at least), and while they cannot pin the value down the interval says so
(wide, or unbounded above) — there is no fallback to a longer, biased window.

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
import operator
from functools import lru_cache
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

__all__ = ["NoiseScaleEstimate", "NoiseScaleWindow", "fieller_interval", "significant"]


class NoiseScaleEstimate(NamedTuple):
    """B_simple = Σ tr(Σ) / Σ |G|² over the window, in sequences, with one-sided bounds (a
    named tuple: made every step, and cheaper to make than a frozen dataclass)."""

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


@lru_cache(maxsize=8192)
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
REFRESH = 0.0625  # the median and MAD are taken again once this fraction of the window is new
SCAN_EVERY = 4  # steps between scans over all cuts (a mark is tested every step)


class _Buffer:
    """The newest `size` (|G|², tr Σ) pairs, in Python lists: a step's append is two list
    appends (no numpy call in the training loop); an array is made only for a refresh."""

    def __init__(self, size: int):
        self.size = size
        self._g: list[float] = []
        self._t: list[float] = []

    def __len__(self) -> int:
        return min(len(self._g), self.size)

    def append(self, g2: float, trace: float) -> None:
        self._g.append(g2)
        self._t.append(trace)
        if len(self._g) == 2 * self.size:  # the newest `size` stay: O(1) amortized
            del self._g[: self.size], self._t[: self.size]

    def oldest_first(self, n: int) -> np.ndarray:
        """The newest n pairs, oldest first: row 0 |G|², row 1 tr(Σ) (a new array)."""
        if n == 0:
            return np.empty((2, 0))
        return np.array((self._g[-n:], self._t[-n:]))


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


def _edges(centre: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The clipping edges at TEST_K and HAMPEL_K: [low_test, high_test, low_kept, high_kept],
    each a pair (|G|², tr Σ). A row with scale 0, a constant stream, is not clipped."""
    test, kept = (np.where(scale > 0, k * scale, np.inf) for k in (TEST_K, HAMPEL_K))
    return np.array([centre - test, centre + test, centre - kept, centre + kept])


class _PrefixSums:
    """Prefix sums of each step's terms, so any newest part's sums cost two columns.

    A step's terms are its values clipped at TEST_K (the change scan) and at HAMPEL_K (the
    estimate), about the centre: rows dg, dt, dg², dt² of the first and hg, ht, hg², ht², hg·ht
    of the second (sums about the median keep their digits). Column i holds the sums of the
    first i steps, the first of them the window's oldest when the sums were last rebuilt; a
    rebuild takes the window's new centre and scale. Appending is sequential addition from a
    start value, as numpy's accumulate is, so a resume that starts from the same column gets
    the same digits.

    A step's own work is in Python floats: in a training loop each numpy call meets caches the
    step has just cooled, and costs several microseconds. The columns appended since the last
    rebuild are tuples (`_tail`); the scan, every few steps, copies them into the array first."""

    ROWS = 9

    def __init__(self, capacity: int):
        self._c = np.zeros((self.ROWS, capacity + 1))
        self.n = 0  # steps summed
        self._base = 0  # the column _tail[0] is
        self._tail: list[tuple[float, ...]] = [(0.0,) * self.ROWS]  # columns _base .. n
        self._synced = 0  # columns 0 .. _synced of the array hold their sums
        self.clip_by(np.zeros(2), np.zeros(2))

    def clip_by(self, centre: np.ndarray, scale: np.ndarray) -> None:
        """The centre and robust SD that steps from now on are clipped by."""
        self.centre, self.scale = centre, scale
        self.edges = _edges(centre, scale)
        self._edges, self._centre = self.edges.tolist(), centre.tolist()
        self.clipped = bool(scale.all())  # a scale of 0 clips nothing

    @property
    def full(self) -> bool:
        return self.n + 1 >= self._c.shape[1]

    def rebuild(self, x: np.ndarray, start: np.ndarray | None = None) -> None:
        """Sums over x (pairs, oldest first) from `start` (the sums before x; zeros)."""
        edges, centre = self.edges[..., None], self.centre[:, None]
        d = x.clip(edges[0], edges[1]) - centre
        h = x.clip(edges[2], edges[3]) - centre
        n = x.shape[1]
        terms = np.empty((self.ROWS, n + 1))
        terms[:, 0] = 0.0 if start is None else start
        terms[:, 1:] = np.concatenate([d, d * d, h, h * h, h[:1] * h[1:]])
        np.add.accumulate(terms, axis=1, out=self._c[:, : n + 1])
        self.n = self._base = self._synced = n
        self._tail = [tuple(self._c[:, n].tolist())]

    def append(self, g: float, t: float) -> None:
        (lo_g, lo_t), (hi_g, hi_t), (klo_g, klo_t), (khi_g, khi_t) = self._edges
        cg, ct = self._centre
        dg, dt = min(max(g, lo_g), hi_g) - cg, min(max(t, lo_t), hi_t) - ct
        hg, ht = min(max(g, klo_g), khi_g) - cg, min(max(t, klo_t), khi_t) - ct
        terms = (dg, dt, dg * dg, dt * dt, hg, ht, hg * hg, ht * ht, hg * ht)
        self._tail.append(tuple(map(operator.add, self._tail[-1], terms)))
        self.n += 1

    def column(self, i: int) -> tuple[float, ...]:
        """The sums of the first i steps."""
        if i >= self._base:
            return self._tail[i - self._base]
        return tuple(self._c[:, i].tolist())  # a window capped at max_steps: its start moves

    def kept_moments(self, m: int) -> tuple[float, float, float, float, float]:
        """Means of |G|² and tr(Σ) over the newest m steps clipped at HAMPEL_K, and their
        sample variances and covariance (np.cov's): squares about the mean from sums about
        the centre."""
        sg, st, sgg, stt, sgt = map(operator.sub, self._tail[-1][4:], self.column(self.n - m)[4:])
        cg, ct = self._centre
        return (
            cg + sg / m,
            ct + st / m,
            max(0.0, sgg - sg * sg / m) / (m - 1),
            max(0.0, stt - st * st / m) / (m - 1),
            (sgt - sg * st / m) / (m - 1),
        )

    def split_z(self, back: np.ndarray, cuts: np.ndarray, n: int) -> np.ndarray:
        """|z| of mean(newest m) − mean(the rest) of the window as it was `back` steps before the
        newest, for each (back, m) given, the larger of |G|²'s and tr(Σ)'s; that window held
        n − back steps, all from one start (no cut since). The variance is pooled (both parts
        come from one distribution when nothing changed), so an older part of two steps is
        tested as soundly as one of two hundred."""
        c = self._c
        if self._synced < self.n:  # the columns appended since, into the array
            c[:, self._synced + 1 : self.n + 1] = np.array(
                self._tail[self._synced + 1 - self._base :]
            ).T
            self._synced = self.n
        e = self.n - back
        at_end = c[:4, e]  # dg, dt, dg², dt² summed to each window's end
        tot = at_end - c[:4, self.n - n, None]  # over each window: they share a start
        head = at_end[:2] - c[:2, e - cuts]  # over the newest m
        rest = tot[:2] - head  # over the older k
        m, k = cuts, (n - back) - cuts
        new, old = head / m, rest / k
        diff = new - old
        within = tot[2:] - head * new - rest * old  # squares about each part's own mean
        var = np.maximum(within, 0.0) * ((m + k) / (m * k * (m + k - 2)))  # of the difference
        z2 = np.divide(diff * diff, var, out=np.where(diff != 0, np.inf, 0.0), where=var > 0)
        return np.sqrt(z2.max(axis=0))

    def z_at(self, n: int, m: int) -> float:
        """split_z at one cut, in floats."""
        e = self.n
        last, at_m, at_start = self._tail[-1], self.column(e - m), self.column(e - n)
        k = n - m
        z2 = 0.0
        for r in (0, 1):  # |G|², then tr(Σ): rows r and r + 2
            head, tot = last[r] - at_m[r], last[r] - at_start[r]
            rest = tot - head
            new, old = head / m, rest / k
            diff = new - old
            within = last[r + 2] - at_start[r + 2] - head * new - rest * old
            var = max(within, 0.0) * (n / (m * k * (n - 2)))
            z2 = max(z2, diff * diff / var if var > 0 else (math.inf if diff != 0 else 0.0))
        return math.sqrt(z2)


def _ladder(first: int, last: int) -> list[int]:
    """first, ×LADDER, … up to last (each at least one more than the one before)."""
    out = [first] if first <= last else []
    while out and (grown := max(out[-1] + 1, int(out[-1] * LADDER))) <= last:
        out.append(grown)
    return out


@lru_cache(maxsize=32)
def _ladders(shortest: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """The newer parts' lengths (shortest, ×1.25, …) and the older parts' (2, 3, 4, 5, 6, 7,
    9, …) a window of up to `longest` steps is cut at (read-only arrays)."""
    ladders = (np.array(_ladder(shortest, longest)), np.array(_ladder(2, longest)))
    for a in ladders:
        a.flags.writeable = False
    return ladders


def _cuts(n: int, unscanned: int, shortest: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidate cuts of the windows of n, n − 1, … n − unscanned + 1 steps (each the
    window as it was `back` = 0, 1, … steps ago; n <= longest): (back, newer-part length) pairs,
    grouped by back, a length possibly twice. A window of w steps is cut at newer parts of
    shortest, ×1.25, … steps and at older parts of 2, 3, 4, 5, 6, 7, 9, … steps."""
    newer, older = _ladders(shortest, longest)
    backs = np.arange(unscanned)[:, None]
    w = n - backs  # each back's window length, as a column
    at = np.concatenate((np.broadcast_to(newer, (unscanned, newer.size)), w - older), axis=1)
    ok = np.concatenate((newer <= w - 2, older <= w - shortest), axis=1)
    return np.broadcast_to(backs, at.shape)[ok], at[ok]


class NoiseScaleWindow:
    """Per-step (|G|², tr(Σ)) estimates in; the windowed B_simple and its interval out.

    `update()` takes one optimizer step's estimates (advisor.gns.line_estimates) and returns
    the new `NoiseScaleEstimate`, or None when the step had none (non-finite gradients): a step
    without a new estimate has no smoothed value either, so nothing stale is ever reported.
    `mark()` says a known change may begin at the next step (a ramp, an LR change): neither
    |G|² nor tr(Σ) depends on the batch and the weights do not jump, so the window is kept, but
    that moment is tested on its own (MARK_Z) and cut at once when the steps after it differ.

    The median and MAD that clip each step are the window's as of its last refresh: after a
    cut, and once `refresh` of the window (1/16) is newer than them (0: every step). In between
    a step costs a few prefix sums instead of three partitions of the whole window
    (tests/test_advisor_gns_window_reference.py measures what that changes).
    """

    STATE_VERSION = 3

    def __init__(
        self,
        max_steps: int = DEFAULT_MAX_STEPS,
        min_steps: int = 48,
        level: float = 0.90,
        refresh: float = REFRESH,
        scan_every: int = SCAN_EVERY,
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
        if not 0 <= refresh <= 1:
            raise ValueError(f"refresh must be in [0, 1], got {refresh!r}")
        if not (isinstance(scan_every, int) and scan_every >= 1):
            raise ValueError(f"scan_every must be an integer >= 1, got {scan_every!r}")
        self.max_steps, self.min_steps, self.level = max_steps, min_steps, float(level)
        self.refresh, self.scan_every = float(refresh), scan_every
        self._one_sided = 0.5 + self.level / 2  # each bound's level: 0.95 at a level of 0.90
        self._steps = _Buffer(max_steps)
        self._sums = _PrefixSums(2 * max_steps + 2)
        self._stale = -1  # steps summed since the last refresh; -1: the sums do not hold the window
        self.length = 0  # steps in the window: the newest `length` of the buffer
        self.since_mark: int | None = None  # steps since a mark still to be tested
        self._unscanned = 0  # steps since the last scan: the ends the next one looks at
        self.updates = 0
        self.skipped = 0
        self.cuts = 0  # change points found
        self.latest: NoiseScaleEstimate | None = None

    def update(self, g2: float, trace: float) -> NoiseScaleEstimate | None:
        pair = self._admit(g2, trace)
        if pair is None:
            return None
        if self._refresh_due():
            self._refresh()
        else:
            self._sums.append(*pair)
            self._stale += 1
        if self._cut():
            self._refresh()
        # none before min_steps steps in all; after a cut the window's few steps give a wide
        # interval, not a blank, until it has grown again
        self.latest = None if self.updates < self.min_steps else self._estimate()
        return self.latest

    def _admit(self, g2, trace) -> tuple[float, float] | None:
        """One step's pair into the buffer and the window, as floats; None (counted as
        skipped) when it is not a pair of finite numbers."""
        try:
            g, t = float(g2), float(trace)
        except (TypeError, ValueError):
            g = t = math.nan
        if not (math.isfinite(g) and math.isfinite(t)):
            self.skipped += 1
            return None
        self._steps.append(g, t)
        self.updates += 1
        self.length = min(self.length + 1, len(self._steps))
        self._unscanned += 1
        if self.since_mark is not None:
            self.since_mark += 1
        return g, t

    def mark(self) -> None:
        """A known change may start with the next step (a ramp, an LR change): the steps after
        it are tested against the window before it, alone (MARK_Z), until 4·min_steps later."""
        self.since_mark = 0

    def _refresh_due(self) -> bool:
        """Whether this step takes the median and MAD afresh: `refresh` of the window is newer
        than them, or a MAD was 0 (ties, a constant stretch: the next step may end that and
        with it the only clipping there is)."""
        return (
            self._stale < 0
            or self._stale + 1 > self.refresh * self.length
            or not self._sums.clipped
            or self._sums.full
        )

    @staticmethod
    def _robust(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The window's median and robust SD (1.4826·MAD), |G|² and tr(Σ): what it is
        clipped by."""
        centre = _rows_median(x)
        return centre, 1.4826 * _rows_median(np.abs(x - centre[:, None]), own=True)

    def _refresh(self, start: np.ndarray | None = None) -> None:
        """The window's median and MAD taken again, its sums rebuilt by them; or, with `start`
        (a resume), the sums rebuilt from that column by the median and MAD it had."""
        x = self._steps.oldest_first(self.length)
        if start is None:
            self._sums.clip_by(*self._robust(x))
        self._sums.rebuild(x, start)
        self._stale = 0

    def _cut(self) -> bool:
        """Drop everything older than a change point the newest steps show, if any (each step
        clipped at TEST_K). True when the window was cut. The scan over all cuts runs every
        scan_every steps, over the window as it ended at each step since the last scan, so it
        finds the change where a scan every step would have (a z over CUT_Z at one step only
        is not missed) and cuts it at most scan_every − 1 steps later; a mark's one cut is
        tested every step, after those steps' scan."""
        n, shortest = self.length, max(2, self.min_steps // 4)
        mark = self.since_mark
        if mark is not None and mark > 4 * self.min_steps:
            self.since_mark = mark = None  # long past: the scan alone watches it now
        if self.updates % self.scan_every == 0 and (found := self._scan(shortest)):
            return self._cut_at(found)
        if mark is not None and shortest <= mark <= n - 2 and self._sums.z_at(n, mark) > MARK_Z:
            return self._cut_at(self._scan(shortest) or mark)
        return False

    def _scan(self, shortest: int) -> int | None:
        """The window's new length where a change point shows at a step not yet scanned (the
        earliest such step, at its largest z), or None."""
        unscanned = min(self._unscanned, self.length)
        self._unscanned = 0
        # newer parts of shortest, ×1.25, … steps, and older parts of 2, 3, … steps: a few
        # stale steps left at the window's old end are found as surely as a recent change
        backs, cuts = _cuts(self.length, unscanned, shortest, self.max_steps)
        if not cuts.size:
            return None
        z = self._sums.split_z(backs, cuts, self.length)
        over = z > CUT_Z
        if not over.any():
            return None
        back = backs[over].max()  # the earliest step a scan would have cut at
        z = np.where(backs == back, z, -1.0)
        best = cuts[z == z.max()].min()  # of equal z, the shortest newer part
        return int(best + back)

    def _cut_at(self, length: int) -> bool:
        self.length = length
        self.cuts += 1
        self.since_mark = None
        self._unscanned = 0
        return True

    def estimate(self) -> NoiseScaleEstimate | None:
        """The estimate over the current window (None until min_steps estimates)."""
        if self.updates < self.min_steps or self.length < 2:
            return None
        return self._estimate()

    def _estimate(self) -> NoiseScaleEstimate:
        """Ratio of means and Fieller interval of the window clipped at HAMPEL_K."""
        n = self.length
        mx, my, vxx, vyy, vxy = self._sums.kept_moments(n)
        q = _t_quantile(self._one_sided, n - 1)
        lower, upper = fieller_interval(mx, my, vxx / n, vyy / n, vxy / n, q)
        point = my / mx if mx > 0 and my > 0 else None
        if point is not None:  # the point lies inside its own Fieller set; guard rounding
            lower = min(lower, point)
            upper = None if upper is None else max(upper, point)
        return NoiseScaleEstimate(point, lower, upper, n, mx, my)

    def to_dict(self) -> dict:
        """JSON-safe state for a checkpoint: the buffer itself, so a resume continues it, and
        the sums' clipping and start, so it continues with the same digits."""
        held = self._steps.oldest_first(len(self._steps))
        state = {
            "version": self.STATE_VERSION,
            "max_steps": self.max_steps,
            "min_steps": self.min_steps,
            "level": self.level,
            "refresh": self.refresh,
            "scan_every": self.scan_every,
            "g2": held[0].tolist(),
            "trace": held[1].tolist(),
            "length": self.length,
            "since_mark": self.since_mark,
            "unscanned": self._unscanned,
            "updates": self.updates,
            "skipped": self.skipped,
            "cuts": self.cuts,
        }
        if self._stale >= 0 and self.length:
            state["sums"] = {
                "centre": self._sums.centre.tolist(),
                "scale": self._sums.scale.tolist(),
                "start": list(self._sums.column(self._sums.n - self.length)),
                "stale": self._stale,
            }
        return state

    @classmethod
    def from_dict(cls, state: dict) -> NoiseScaleWindow:
        """A window from to_dict(). A version-2 state (a checkpoint written before change
        points) keeps its buffer as the window, in today's larger buffer; a state without the
        sums (written before them) takes the window's median and MAD afresh."""
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
        refresh = float(state.get("refresh", REFRESH))
        scan_every = int(state.get("scan_every", SCAN_EVERY))
        w = cls(max_steps, int(state["min_steps"]), float(state["level"]), refresh, scan_every)
        for g, t in list(zip(state["g2"], state["trace"], strict=True))[-max_steps:]:
            w._steps.append(float(g), float(t))
        w.length = min(int(state.get("length", len(w._steps))), len(w._steps))
        mark = state.get("since_mark")
        w.since_mark = None if mark is None else int(mark)
        w.updates, w.skipped = int(state["updates"]), int(state.get("skipped", 0))
        w.cuts = int(state.get("cuts", 0))
        w._unscanned = int(state.get("unscanned", 0))
        sums = state.get("sums")
        if w.length and sums:
            w._sums.clip_by(np.array(sums["centre"], float), np.array(sums["scale"], float))
            w._refresh(start=np.array(sums["start"], dtype=float))
            w._stale = int(sums["stale"])
        elif w.length:
            w._refresh()
        w.latest = w.estimate()
        return w
