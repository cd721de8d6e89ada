"""Gradient noise scale: estimators of |G|² and tr(Σ), their per-sample EMAs, and what they imply.

Owns: the two-batch and in-accumulation estimators of the true gradient's squared norm |G|² and
of the per-example gradient covariance trace tr(Σ), the bias-corrected EMAs that smooth them
(`NoiseScaleEMA`), B_simple = tr(Σ)/|G|², and the step/example trade-off formulas built on it
(S/S_min, E/E_min, optimal learning rate, critical batch fit).

Source throughout: S. McCandlish, J. Kaplan, D. Amodei et al., "An Empirical Model of
Large-Batch Training", arXiv:1812.06162 (2018). Section numbers below refer to that paper.

Units: batch sizes are in *sequences* (examples); multiply a noise scale by the sequence length
for tokens. Squared norms are of *mean* gradients (the gradient of the mean loss over the batch),
measured in fp32/fp64, before clipping, with loss scaling and the 1/accum factor undone.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "two_batch_estimates",
    "line_estimates",
    "accumulation_estimates",
    "NoiseScaleEMA",
    "steps_ratio",
    "examples_ratio",
    "optimal_lr",
    "fit_critical_batch",
]


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def _sq_norm(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(
            f"{name} must be a finite squared norm >= 0, got {value!r} "
            "(measure norms in fp32/fp64 and skip steps whose gradients overflowed)"
        )
    return v


def two_batch_estimates(
    b_small: float, sq_norm_small: float, b_big: float, sq_norm_big: float
) -> tuple[float, float]:
    """Unbiased (|G|², tr(Σ)) from mean-gradient squared norms at two batch sizes.

    McCandlish et al. 2018, App. A (eqs. A.2): since E|g_B|² = |G|² + tr(Σ)/B,
        |G|²  ≈ (B_big·|g_big|² − B_small·|g_small|²) / (B_big − B_small)
        tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/B_small − 1/B_big)
    Each estimate is unbiased but noisy; |G|² may come out negative for one step. Smooth both with
    `NoiseScaleEMA` before taking their ratio.
    """
    bs = _positive("b_small", b_small)
    bb = _positive("b_big", b_big)
    if not bb > bs:
        raise ValueError(
            f"b_big ({b_big}) must be larger than b_small ({b_small}): the estimator needs two "
            "different batch sizes (pass the micro-batch as b_small and the accumulated batch as b_big)"
        )
    ys = _sq_norm("sq_norm_small", sq_norm_small)
    yb = _sq_norm("sq_norm_big", sq_norm_big)
    g2 = (bb * yb - bs * ys) / (bb - bs)
    trace = (ys - yb) / (1.0 / bs - 1.0 / bb)
    return g2, trace


def line_estimates(batch_sizes: Sequence[float], sq_norms: Sequence[float]) -> tuple[float, float]:
    """(|G|², tr(Σ)) by ordinary least squares of |g_B|² on 1/B over any number of batch sizes.

    Model (McCandlish et al. 2018, App. A): E|g_B|² = |G|² + tr(Σ)·(1/B), a line in x = 1/B with
    intercept |G|² and slope tr(Σ). OLS is unbiased for any correlation between the points (only
    its variance depends on it), so nested batches (running sums) are fine. With two sizes it is
    exactly `two_batch_estimates`. Use it for per-rank norms under DDP (B = local batch, several
    ranks) plus the all-reduced norm (B = global batch).
    """
    if len(batch_sizes) != len(sq_norms):
        raise ValueError(
            f"got {len(batch_sizes)} batch sizes but {len(sq_norms)} squared norms: pass one norm per batch"
        )
    xs = np.array([1.0 / _positive("batch size", b) for b in batch_sizes], dtype=np.float64)
    ys = np.array([_sq_norm("squared norm", y) for y in sq_norms], dtype=np.float64)
    if len(np.unique(xs)) < 2:
        raise ValueError(
            "the noise scale needs squared norms at two or more different batch sizes; "
            f"got batch sizes {list(batch_sizes)} (use gradient accumulation >= 2, several DDP ranks, "
            "or split the batch into two halves)"
        )
    if len(xs) == 2:
        (x0, x1), (y0, y1) = xs, ys
        b0, b1 = 1.0 / x0, 1.0 / x1
        if b0 < b1:
            return two_batch_estimates(b0, y0, b1, y1)
        return two_batch_estimates(b1, y1, b0, y0)
    xm, ym = xs.mean(), ys.mean()
    dx = xs - xm
    slope = float(np.dot(dx, ys - ym) / np.dot(dx, dx))
    intercept = float(ym - slope * xm)
    return intercept, slope


def accumulation_estimates(running_sq_norms: Sequence[float], micro_batch: int) -> tuple[float, float]:
    """(|G|², tr(Σ)) for one optimizer step from the running accumulated gradient.

    Within accumulation of k micro-batches of b sequences each, let S_j be the sum of the first j
    micro-batch *mean* gradients. When each micro-batch loss is divided by k, .grad after
    micro-batch j holds S_j/k, so |S_j/j|² = (k/j)²·|.grad|² (no per-micro-batch copy needed).
    running_sq_norms[j-1] = |S_j/j|² is the squared norm of the mean gradient over j·b sequences, and E|S_j/j|² = |G|² + tr(Σ)/(j·b) (McCandlish et al. 2018,
    App. A, applied to nested batches). Least squares of y_j on x_j = 1/(j·b): intercept |G|²,
    slope tr(Σ); with k = 2 this is exactly the two-batch formula with B_small = b, B_big = 2b.
    """
    b = micro_batch
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
        raise ValueError(f"micro_batch must be a positive integer number of sequences, got {micro_batch!r}")
    k = len(running_sq_norms)
    if k < 2:
        raise ValueError(
            f"got {k} running squared norm(s): the noise scale needs a second batch size. "
            "Use gradient accumulation >= 2 (one norm after each micro-batch), or the split option "
            "(two half micro-batches) when accumulation is 1"
        )
    sizes = [j * int(b) for j in range(1, k + 1)]
    return line_estimates(sizes, running_sq_norms)


class NoiseScaleEMA:
    """Bias-corrected EMAs of |G|² and tr(Σ), decayed per *sample*; B_simple is their ratio.

    Why two EMAs and not an EMA of the ratio: the per-step |G|² estimate is noisy and can be near
    zero or negative, so a ratio of noisy numbers is biased and heavy-tailed; McCandlish et al.
    2018, App. A.1 average numerator and denominator separately.

    Decay per sample: a step that saw `samples` sequences decays the average by
    beta**samples with beta = 0.5**(1/half_life_samples), so a bigger batch decays more per step and
    the half-life means the same amount of data before and after a ramp. Neither |G|² nor tr(Σ)
    depends on the batch, so a ramp keeps the state (do not reset it).

    Bias correction (Adam, Kingma & Ba 2015, §3): value = m / (1 − Π decays). It is kept here
    in the equivalent incremental form avg += (1 − d)/W · (x − avg), W = 1 − Π d, which makes the
    first update return the input exactly.
    """

    STATE_VERSION = 1

    def __init__(self, half_life_samples: float = 20_000.0):
        self.half_life_samples = _positive("half_life_samples", half_life_samples)
        self._g2 = 0.0
        self._trace = 0.0
        self._weight = 0.0  # 1 − Π decays: the bias-correction denominator
        self.samples_seen = 0
        self.updates = 0
        self.skipped = 0

    def update(self, g2: float, trace: float, samples: int) -> bool:
        """Fold one step's estimates in; returns False (and changes nothing) for non-finite input."""
        s = float(samples)
        if not math.isfinite(s) or s <= 0:
            raise ValueError(
                f"samples must be the positive number of sequences in this step, got {samples!r}"
            )
        try:
            g2f, trf = float(g2), float(trace)
        except (TypeError, ValueError):
            self.skipped += 1
            return False
        if not (math.isfinite(g2f) and math.isfinite(trf)):
            self.skipped += 1
            return False
        # 1 − decay via expm1: exact enough even when samples ≪ half-life (decay rounds to 1.0)
        fresh = -math.expm1(math.log(0.5) * s / self.half_life_samples)
        decay = 1.0 - fresh
        self._weight = decay * self._weight + fresh
        step = fresh / self._weight
        self._g2 += step * (g2f - self._g2)
        self._trace += step * (trf - self._trace)
        self.samples_seen += int(samples)
        self.updates += 1
        return True

    @property
    def g2(self) -> float | None:
        """Smoothed |G|² (None before the first update)."""
        return self._g2 if self.updates else None

    @property
    def trace(self) -> float | None:
        """Smoothed tr(Σ) (None before the first update)."""
        return self._trace if self.updates else None

    @property
    def b_simple(self) -> float | None:
        """B_simple = EMA(tr Σ)/EMA(|G|²) in sequences (McCandlish et al. 2018, §2.2, eq. for B_simple).

        None means "no estimate yet": no data, a smoothed |G|² that is not positive, or a negative
        smoothed trace. Never negative, never infinite.
        """
        if not self.updates or not self._g2 > 0 or self._trace < 0:
            return None
        b = self._trace / self._g2
        return b if math.isfinite(b) else None

    def b_simple_tokens(self, seq_len: int) -> float | None:
        """B_simple in tokens (sequences × seq_len)."""
        b = self.b_simple
        return None if b is None else b * _positive("seq_len", seq_len)

    def to_dict(self) -> dict:
        """JSON-safe state for a checkpoint."""
        return {
            "version": self.STATE_VERSION,
            "half_life_samples": self.half_life_samples,
            "g2": self._g2,
            "trace": self._trace,
            "weight": self._weight,
            "samples_seen": self.samples_seen,
            "updates": self.updates,
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, state: dict) -> NoiseScaleEMA:
        """Rebuild from `to_dict()` output; a resumed run continues the same averages."""
        version = state.get("version")
        if version != cls.STATE_VERSION:
            raise ValueError(
                f"NoiseScaleEMA state version {version!r} is not supported (expected "
                f"{cls.STATE_VERSION}); start a fresh NoiseScaleEMA instead of loading this checkpoint's"
            )
        missing = {"half_life_samples", "g2", "trace", "weight", "samples_seen", "updates"} - set(state)
        if missing:
            raise ValueError(f"NoiseScaleEMA state lacks {sorted(missing)}: not a to_dict() output")
        ema = cls(state["half_life_samples"])
        ema._g2 = float(state["g2"])
        ema._trace = float(state["trace"])
        ema._weight = float(state["weight"])
        if not (0.0 <= ema._weight <= 1.0) or not (math.isfinite(ema._g2) and math.isfinite(ema._trace)):
            raise ValueError("NoiseScaleEMA state is corrupt (weight outside [0, 1] or non-finite averages)")
        ema.samples_seen = int(state["samples_seen"])
        ema.updates = int(state["updates"])
        ema.skipped = int(state.get("skipped", 0))
        return ema

    def __repr__(self) -> str:
        return (
            f"NoiseScaleEMA(half_life_samples={self.half_life_samples:g}, g2={self.g2}, "
            f"trace={self.trace}, b_simple={self.b_simple}, updates={self.updates})"
        )


def steps_ratio(batch: float, b_noise: float) -> float:
    """S/S_min = 1 + B_noise/B: optimizer steps to a target loss relative to infinite batch.

    McCandlish et al. 2018, §2.3, eq. (2.11) (S/S_min − 1)(E/E_min − 1) = 1 with E = B·S,
    taking B_crit ≈ B_noise.
    """
    b = _positive("batch", batch)
    n = float(b_noise)
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"b_noise must be a finite noise scale >= 0 (sequences), got {b_noise!r}")
    return 1.0 + n / b


def examples_ratio(batch: float, b_noise: float) -> float:
    """E/E_min = 1 + B/B_noise: training examples to a target loss relative to tiny batches.

    McCandlish et al. 2018, §2.3, eq. (2.11), taking B_crit ≈ B_noise.
    """
    b = _positive("batch", batch)
    n = _positive("b_noise (a zero noise scale makes every example past the first wasted)", b_noise)
    return 1.0 + b / n


def optimal_lr(lr_max: float, batch: float, b_noise: float) -> float:
    """ε_opt(B) = ε_max / (1 + B_noise/B): the SGD-optimal step size at batch B.

    McCandlish et al. 2018, §2.2 (the optimal step size from the quadratic model of the loss,
    eqs. 2.6–2.7 in arXiv:1812.06162). Derived for plain SGD; for Adam-type optimizers use the
    √ rule of advisor.lr instead.
    """
    return _positive("lr_max", lr_max) / steps_ratio(batch, b_noise)


def fit_critical_batch(batches: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """(S_min, B_crit) from steps-to-target of >= 3 runs at different constant batch sizes.

    McCandlish et al. 2018, §2.3 and Fig. 4: S = S_min·(1 + B_crit/B), i.e. linear in 1/B:
    S = S_min + (S_min·B_crit)·(1/B). Ordinary least squares gives intercept S_min and slope
    S_min·B_crit, so B_crit = slope/intercept (= E_min/S_min, eq. 2.12).
    """
    if len(batches) != len(steps):
        raise ValueError(f"got {len(batches)} batch sizes but {len(steps)} step counts: pass one per run")
    xs = np.array([1.0 / _positive("batch", b) for b in batches], dtype=np.float64)
    ys = np.array([_positive("steps to target", s) for s in steps], dtype=np.float64)
    distinct = len(np.unique(xs))
    if distinct < 3:
        raise ValueError(
            f"fitting S = S_min(1 + B_crit/B) needs runs at >= 3 different constant batch sizes, got "
            f"{distinct} distinct ({sorted(set(float(b) for b in batches))}): train to the same target "
            "loss at more batch sizes"
        )
    A = np.stack([np.ones_like(xs), xs], axis=1)
    (s_min, slope), *_ = np.linalg.lstsq(A, ys, rcond=None)
    if not s_min > 0 or slope < 0:
        raise ValueError(
            f"the runs do not follow S = S_min(1 + B_crit/B) (fit gives S_min={s_min:.4g}, "
            f"S_min·B_crit={slope:.4g}); check that every run used the same target loss and a tuned "
            "learning rate, and add runs at smaller batch sizes"
        )
    return float(s_min), float(slope / s_min)
