"""Gradient noise scale: estimators of |G|² and tr(Σ), their per-sample EMAs, and what they imply.

Owns: the two-batch and in-accumulation estimators of the true gradient's squared norm |G|² and
of the per-example gradient covariance trace tr(Σ) (one step's estimates; advisor/gns_window.py
smooths them into B_simple = tr(Σ)/|G|² with an interval), and the step/example trade-off
formulas built on it (S/S_min, E/E_min, optimal learning rate, critical batch fit).

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

from rampwatch.advisor.checks import ols_line, positive_number

__all__ = [
    "two_batch_estimates",
    "line_estimates",
    "accumulation_estimates",
    "steps_ratio",
    "examples_ratio",
    "optimal_lr",
    "fit_critical_batch",
]


_positive = positive_number


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
    Each estimate is unbiased but noisy; |G|² may come out negative for one step. Sum both over
    a window of steps before taking their ratio (advisor.gns_window).
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
    return _two_batch(bs, ys, bb, yb)


def _two_batch(bs: float, ys: float, bb: float, yb: float) -> tuple[float, float]:
    """two_batch_estimates' formula, its arguments already checked (bb > bs > 0, ys, yb >= 0)."""
    return (bb * yb - bs * ys) / (bb - bs), (ys - yb) / (1.0 / bs - 1.0 / bb)


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
    # plain floats: a step's 2–4 points cost less in Python than in numpy
    xs = [1.0 / _positive("batch size", b) for b in batch_sizes]
    ys = [_sq_norm("squared norm", y) for y in sq_norms]
    if len(set(xs)) < 2:
        raise ValueError(
            "the noise scale needs squared norms at two or more different batch sizes; "
            f"got batch sizes {list(batch_sizes)} (use gradient accumulation >= 2, several DDP ranks, "
            "or split the batch into two halves)"
        )
    if len(xs) == 2:  # the checks above are the two-batch formula's: not again (every step)
        (x0, x1), (y0, y1) = xs, ys
        b0, b1 = 1.0 / x0, 1.0 / x1
        return _two_batch(b0, y0, b1, y1) if b0 < b1 else _two_batch(b1, y1, b0, y0)
    return ols_line(xs, ys)


def accumulation_estimates(
    running_sq_norms: Sequence[float], micro_batch: int
) -> tuple[float, float]:
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
        raise ValueError(
            f"micro_batch must be a positive integer number of sequences, got {micro_batch!r}"
        )
    k = len(running_sq_norms)
    if k < 2:
        raise ValueError(
            f"got {k} running squared norm(s): the noise scale needs a second batch size. "
            "Use gradient accumulation >= 2 (one norm after each micro-batch), or the split option "
            "(two half micro-batches) when accumulation is 1"
        )
    sizes = [j * int(b) for j in range(1, k + 1)]
    return line_estimates(sizes, running_sq_norms)


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
        raise ValueError(
            f"got {len(batches)} batch sizes but {len(steps)} step counts: pass one per run"
        )
    xs = np.array([1.0 / _positive("batch", b) for b in batches], dtype=np.float64)
    ys = np.array([_positive("steps to target", s) for s in steps], dtype=np.float64)
    distinct = len(np.unique(xs))
    if distinct < 3:
        raise ValueError(
            f"fitting S = S_min(1 + B_crit/B) needs runs at >= 3 different constant batch sizes, got "
            f"{distinct} distinct ({sorted(set(float(b) for b in batches))}): train to the same target "
            "loss at more batch sizes"
        )
    s_min, slope = ols_line(xs, ys)
    if not s_min > 0 or slope < 0:
        raise ValueError(
            f"the runs do not follow S = S_min(1 + B_crit/B) (fit gives S_min={s_min:.4g}, "
            f"S_min·B_crit={slope:.4g}); check that every run used the same target loss and a tuned "
            "learning rate, and add runs at smaller batch sizes"
        )
    return float(s_min), float(slope / s_min)
