"""advisor.gns: noise-scale estimators against hand-computed cases, closed forms and a simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampwatch.advisor.gns import (
    accumulation_estimates,
    examples_ratio,
    fit_critical_batch,
    line_estimates,
    optimal_lr,
    steps_ratio,
    two_batch_estimates,
)

# ------------------------------------------------------------------ two-batch (McCandlish App. A)


def test_two_batch_hand_computed():
    # |G|² = 2, tr(Σ) = 64: E|g_8|² = 2 + 64/8 = 10, E|g_32|² = 2 + 64/32 = 4.
    # |G|²  = (32·4 − 8·10)/(32 − 8) = 48/24 = 2
    # tr(Σ) = (10 − 4)/(1/8 − 1/32) = 6/(3/32) = 64
    g2, tr = two_batch_estimates(8, 10.0, 32, 4.0)
    assert g2 == pytest.approx(2.0, rel=1e-15)
    assert tr == pytest.approx(64.0, rel=1e-15)


def test_two_batch_can_be_negative_for_one_noisy_step():
    # the big batch's norm above what the small batch implies: |G|² estimate < 0 (noise), kept as is
    g2, tr = two_batch_estimates(4, 1.0, 8, 0.2)
    assert g2 == pytest.approx((8 * 0.2 - 4 * 1.0) / 4)
    assert g2 < 0 and tr > 0


@pytest.mark.parametrize(
    "args, match",
    [
        ((8, 1.0, 8, 1.0), "two different batch sizes"),
        ((16, 1.0, 8, 1.0), "must be larger than b_small"),
        ((0, 1.0, 8, 1.0), "b_small must be a positive"),
        ((4, -1.0, 8, 1.0), "squared norm >= 0"),
        ((4, float("nan"), 8, 1.0), "finite squared norm"),
    ],
)
def test_two_batch_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        two_batch_estimates(*args)


# ------------------------------------------------------------------------ in-accumulation estimates


def test_accumulation_k2_equals_two_batch_formula():
    y1, y2 = 7.3, 3.1  # |S_1/1|², |S_2/2|² with micro-batch 6: batch sizes 6 and 12
    assert accumulation_estimates([y1, y2], 6) == two_batch_estimates(6, y1, 12, y2)
    # and the general least-squares line through the same two points agrees
    slope, intercept = np.polyfit([1 / 6, 1 / 12], [y1, y2], 1)
    g2, tr = accumulation_estimates([y1, y2], 6)
    assert g2 == pytest.approx(intercept, rel=1e-12)
    assert tr == pytest.approx(slope, rel=1e-12)


def test_accumulation_hand_computed_k4():
    # b = 2, G2 = 1, T = 8: y_j = 1 + 8/(2j) = 5, 3, 7/3, 2
    g2, tr = accumulation_estimates([5.0, 3.0, 7 / 3, 2.0], 2)
    assert g2 == pytest.approx(1.0, rel=1e-12)
    assert tr == pytest.approx(8.0, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    g2=st.floats(0.0, 1e6, allow_subnormal=False),
    trace=st.floats(0.0, 1e6, allow_subnormal=False),
    k=st.integers(2, 64),
    b=st.integers(1, 512),
)
def test_accumulation_recovers_noiseless_line(g2, trace, k, b):
    ys = [g2 + trace / (j * b) for j in range(1, k + 1)]
    est_g2, est_tr = accumulation_estimates(ys, b)
    # exact up to float rounding, relative to the size of the numbers involved
    scale = g2 + trace / b
    assert est_g2 == pytest.approx(g2, rel=1e-9, abs=1e-9 * scale + 1e-300)
    assert est_tr == pytest.approx(trace, rel=1e-9, abs=1e-9 * scale * b + 1e-300)


def test_accumulation_needs_a_second_batch_size():
    with pytest.raises(ValueError, match="second batch size.*accumulation >= 2.*split"):
        accumulation_estimates([3.0], 8)
    with pytest.raises(ValueError, match="micro_batch must be a positive integer"):
        accumulation_estimates([3.0, 2.0], 0)


def test_line_estimates_for_ddp_ranks_and_global():
    # 4 ranks at local batch 8 plus the all-reduced gradient at 32; G2 = 3, T = 40
    sizes = [8, 8, 8, 8, 32]
    ys = [3 + 40 / 8] * 4 + [3 + 40 / 32]
    g2, tr = line_estimates(sizes, ys)
    assert (g2, tr) == (pytest.approx(3.0), pytest.approx(40.0))
    with pytest.raises(ValueError, match="two or more different batch sizes"):
        line_estimates([8, 8], [1.0, 2.0])
    with pytest.raises(ValueError, match="one norm per batch"):
        line_estimates([8, 16], [1.0])


# ------------------------------------------------------------------- statistical check (simulated)


def test_simulated_gaussian_gradients_recover_truth_within_5_percent():
    """Per-example gradients g ~ N(G, Σ) in 50 dimensions, |G|² = 1, tr(Σ) = 64 (B_simple = 64).

    Each step: 8 micro-batches of 8 examples; the running mean after micro-batch j is what .grad
    holds (S_j/j); its squared norms go through accumulation_estimates, summed over all steps.
    """
    rng = np.random.default_rng(12345)
    dim, b, k, steps, true_g2, true_trace = 50, 8, 8, 4000, 1.0, 64.0
    mean = rng.normal(size=dim)
    mean *= math.sqrt(true_g2) / np.linalg.norm(mean)
    a = rng.normal(size=(dim, dim))
    cov = a @ a.T  # anisotropic, known covariance
    cov *= true_trace / np.trace(cov)
    chol = np.linalg.cholesky(cov)
    per_step = []
    js = np.arange(1, k + 1)[:, None]
    for _ in range(steps):
        grads = mean + rng.standard_normal((b * k, dim)) @ chol.T  # per-example gradients
        micro_means = grads.reshape(k, b, dim).mean(axis=1)
        running = np.cumsum(micro_means, axis=0) / js  # S_j / j
        g2, tr = accumulation_estimates((running**2).sum(axis=1).tolist(), b)
        per_step.append((g2, tr))
    # the per-step estimates are unbiased: their plain means are close, and so is their ratio
    g2_mean, tr_mean = np.mean(per_step, axis=0)
    assert tr_mean / g2_mean == pytest.approx(true_trace / true_g2, rel=0.05)
    assert g2_mean == pytest.approx(true_g2, rel=0.05)
    assert tr_mean == pytest.approx(true_trace, rel=0.05)


# --------------------------------------------------------------------- steps, examples, LR, B_crit


def test_steps_and_examples_ratios_hand_computed():
    assert steps_ratio(256, 512) == 3.0  # 1 + 512/256
    assert examples_ratio(256, 512) == 1.5  # 1 + 256/512
    assert steps_ratio(100, 0) == 1.0
    # (S/S_min − 1)(E/E_min − 1) = 1, McCandlish eq. 2.11
    assert (steps_ratio(300, 700) - 1) * (examples_ratio(300, 700) - 1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="b_noise"):
        examples_ratio(256, 0)
    with pytest.raises(ValueError, match="batch must be a positive"):
        steps_ratio(0, 10)


def test_optimal_lr_hand_computed():
    assert optimal_lr(1e-3, 256, 256) == pytest.approx(5e-4)  # 1e-3/(1 + 1)
    assert optimal_lr(6e-4, 1024, 256) == pytest.approx(6e-4 / 1.25)


def test_fit_critical_batch_exact_and_noisy():
    s_min, b_crit = 1000.0, 512.0
    batches = [64, 128, 256, 512, 1024]
    steps = [s_min * (1 + b_crit / b) for b in batches]
    got = fit_critical_batch(batches, steps)
    assert got == (pytest.approx(s_min), pytest.approx(b_crit))
    noisy = [s * f for s, f in zip(steps, (1.01, 0.99, 1.0, 1.02, 0.98), strict=True)]
    s_fit, b_fit = fit_critical_batch(batches, noisy)
    assert s_fit == pytest.approx(s_min, rel=0.1) and b_fit == pytest.approx(b_crit, rel=0.1)


def test_fit_critical_batch_says_what_is_missing():
    with pytest.raises(ValueError, match=">= 3 different constant batch sizes"):
        fit_critical_batch([64, 128], [5000, 3000])
    with pytest.raises(ValueError, match=">= 3 different"):
        fit_critical_batch([64, 64, 128], [5000, 5100, 3000])
    with pytest.raises(ValueError, match="one per run"):
        fit_critical_batch([64, 128, 256], [5000, 3000])
    with pytest.raises(ValueError, match="do not follow"):
        fit_critical_batch([64, 128, 256], [1000, 2000, 4000])  # more steps at bigger batch
