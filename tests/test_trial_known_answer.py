"""Ramp trials on bench/trial_bench.py's least-squares problem, where the critical batch is known
from constant-batch sweeps (from w = 0, and local: from the trial's own snapshot) and the noise
scale is wrong by 10× or more: the trial is closer than the noise scale; within 2× of either
sweep it is not yet (strict xfails, with what was measured); its restore is exact (the control
restored and continued equals a run that never branched; the kept branch equals a run ramped by
hand); the noise scales' closed forms match sampled per-example gradients."""

from __future__ import annotations

import math

import pytest
import torch

from bench.trial_bench import SETTINGS, Quadratic, agrees, measure, plan_at, restore_check
from rampwatch.advisor.trial import TrialPlan

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def report():
    return measure()  # three seeds a batch: one seed's sweep is too noisy to fit (~30 s)


def _log_error(bracket, b_crit: float) -> float:
    """|log| of the bracket's geometric middle over B_crit (an open end counts as 2× the other)."""
    lo, hi = bracket
    lo, hi = lo or hi / 2, hi or lo * 2
    return abs(math.log(math.sqrt(lo * hi) / b_crit))


def _deep_points(report):
    """(sweep B_crit, B_simple, verdict) where the noise scale is off by 10× and the control
    still learns over Δ (the deepest point sits on its LR's noise floor)."""
    out = []
    for target, p in zip(report.sweeps, report.points, strict=True):
        b_crit = report.sweeps[target][2]
        if p.b_simple >= 10 * b_crit and p.verdict.progress > 0:
            out.append((b_crit, p.b_simple, p.verdict))
    return out


def _local_points(report):
    """(local B_crit, verdict) where the local sweep fits and the control learns over Δ."""
    return [
        (p.local[2], p.verdict)
        for p in report.points
        if math.isfinite(p.local[2]) and p.verdict.progress > 0
    ]


@pytest.mark.slow
def test_noise_scale_is_off_by_ten_times_at_the_target(report):
    target = list(report.sweeps)[-1]
    b_simple, b_crit = report.points[-1].b_simple, report.sweeps[target][2]
    assert b_simple >= 10 * b_crit, (b_simple, b_crit)


@pytest.mark.slow
def test_trial_is_closer_than_the_noise_scale(report):
    points = _deep_points(report)
    assert points
    for b_crit, b_simple, verdict in points:
        assert _log_error(verdict.bracket, b_crit) < abs(math.log(b_simple / b_crit))
        assert verdict.cost_tokens == len(verdict.plan.ks) * verdict.plan.delta_tokens


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured: brackets [16, 32) against a from-init sweep B_crit of 4.5-9.5 (2-3x "
    "off); a local sweep from the trial's snapshot does not close the gap (the next test)",
)
def test_trial_brackets_the_sweeps_critical_batch_within_2x(report):
    points = _deep_points(report)
    assert points and all(agrees(v.bracket, b_crit) for b_crit, _, v in points)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured: brackets [16, 32) at the three points where the control learns, against a "
    "local B_crit of 7.0, 1.4, 5.7 (2.3-11x below the lower end); Δ is 5-24x the examples the "
    "base batch needs to halve the loss, so the control flattens within Δ and the tolerance, "
    "which assumes progress linear in examples, lets through branches up to E(kB) ≈ Δ",
)
def test_trial_brackets_the_local_critical_batch_within_2x(report):
    points = _local_points(report)
    assert len(points) >= 3 and all(agrees(v.bracket, b_crit) for b_crit, v in points)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured: B_noise / B_simple is 0.7-1.5 at every point; both weigh directions by "
    "curvature and are set by the stiff ones, so this problem shows Adam against the noise "
    "scale, not the Hessian weighting against B_simple (the issue's premise)",
)
def test_hessian_weighted_noise_scale_differs_tenfold(report):
    ratios = [p.b_noise / p.b_simple for p in report.points]
    assert all(r >= 10 or r <= 0.1 for r in ratios), ratios


def test_noise_scales_match_sampled_gradients():
    """B_simple and B_noise from the closed forms against tr(Σ), tr(HΣ) of 200,000 sampled
    per-example gradients, at a point off the training path (both ratios differ there)."""
    problem = Quadratic(**SETTINGS["problem"])
    g = torch.Generator().manual_seed(3)
    error = 0.3 * torch.randn(problem.dim, generator=g, dtype=torch.float64)
    w = problem.w_star + error / problem.h.sqrt().clamp(min=0.01)  # flat directions far off
    x, y = problem.examples(data_seed=5, start=0, count=200_000)
    grads = x * (x @ w - y)[:, None]  # ∇½(x·w − y)² per example
    big_g = problem.h * (w - problem.w_star)  # the true gradient Hδ
    spread = grads - big_g
    sigma_diag = (spread**2).mean(0)  # diag(Σ): all that tr(Σ) and tr(HΣ) read (H is diagonal)
    sampled_simple = float(sigma_diag.sum() / (big_g @ big_g))
    sampled_noise = float((problem.h * sigma_diag).sum() / (big_g @ (problem.h * big_g)))
    assert problem.b_simple(w) == pytest.approx(sampled_simple, rel=0.03)
    assert problem.b_noise(w) == pytest.approx(sampled_noise, rel=0.03)
    assert problem.b_noise(w) > 1.5 * problem.b_simple(w)  # the weighting does matter here


@pytest.mark.parametrize("rule, warm, kept", [("linear", 200, "control"), ("sqrt", 5, "branch")])
def test_restore_is_exact(rule, warm, kept):
    """LR × k under Adam (the linear rule) wrecks every branch, so the control is kept; early,
    with the √ rule, a branch is. Either way the trialled run equals the one run by hand."""
    problem = Quadratic(**SETTINGS["problem"])
    plan = plan_at(2, (2, 4, 8, 16, 32, 64), 4)
    plan = TrialPlan(**{**plan.__dict__, "rule": rule})
    k, diff = restore_check(problem, 2, 0.08, plan, warm_steps=warm, after_steps=30)
    assert (k == 1) == (kept == "control"), k
    assert diff <= 1e-6
