"""Ramp trials on bench/trial_bench.py's least-squares problem, where the critical batch is known
from constant-batch sweeps (from w = 0, and local: from the trial's own snapshot) and the noise
scale is wrong by 10× or more: the trial (its Δ halved until the control's half progress says Δ
can tell) is closer than the noise scale; within 2× of either sweep at every point it is not yet
(strict xfails, with what was measured); the midway eval that judges Δ leaves the control exact; its restore is exact (the control
restored and continued equals a run that never branched; the kept branch equals a run ramped by
hand); the noise scales' closed forms match sampled per-example gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from bench.trial_bench import (
    SETTINGS,
    BaseRun,
    Quadratic,
    agrees,
    measure,
    per_example_loss,
    plan_at,
    restore_check,
)
from rampwatch.advisor.trial import TrialPlan
from rampwatch.monitor.trial_runner import run_trial

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
    still learns over Δ (the deepest point sits on its LR's noise floor); the verdict is the
    adaptive trial's (Δ halved until it can tell)."""
    out = []
    for target, p in zip(report.sweeps, report.points, strict=True):
        b_crit, verdict = report.sweeps[target][2], p.adaptive[-1]
        if p.b_simple >= 10 * b_crit and verdict.progress > 0:
            out.append((b_crit, p.b_simple, verdict))
    return out


def _local_points(report):
    """(local B_crit, the adaptive verdict) where the local sweep fits and the control learns."""
    return [
        (p.local[2], p.adaptive[-1])
        for p in report.points
        if math.isfinite(p.local[2]) and p.adaptive[-1].progress > 0
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
        assert verdict.cost_tokens == len(verdict.branches) * verdict.plan.delta_tokens


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured, adaptive Δ: at the two points where B_simple is 10x the from-init B_crit "
    "(5.3, 9.5) the bracket is [-, 4) at Δ = 64 and 128 examples: within 2x at the first, "
    "2.4x below at the second (the fixed Δ = 512 brackets nothing at any point: too long, or "
    "cannot tell)",
)
def test_trial_brackets_the_sweeps_critical_batch_within_2x(report):
    points = _deep_points(report)
    assert points and all(agrees(v.bracket, b_crit) for b_crit, _, v in points)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured, adaptive Δ (halved from 512 until the trial judges its branches: the "
    "control's half-progress ratio's 95% lower bound >= 0.67, or its estimate so and the "
    "branches judged at that bound; 2026-12-06, unchanged by the second rule): brackets [4, 8), [4, 8), [-, 4), [-, 4) at "
    "Δ = 16, 16, 64, 128 examples against a local B_crit of 7.0, 1.4, 5.7, 17.4: within 2x at "
    "2 of 4 (2.9x above at the second; 4.4x below at the fourth, where the control's first half "
    "made no progress, so Δ was not judged). At batch 2 one trajectory's noise moves the ratio "
    "more than its bound over the 2,048 held-out examples allows (0.12 (0.06-0.20), 0.02 "
    "(0-0.08), 0.17 (0.11-0.22) as Δ halves 256, 128, 64 at the first point): the bound covers "
    "which examples were drawn, not the trajectory",
)
def test_trial_brackets_the_local_critical_batch_within_2x(report):
    points = _local_points(report)
    assert len(points) >= 3 and all(agrees(v.bracket, b_crit) for b_crit, v in points)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured: B_noise / B_simple is 0.7-1.5 at every point; both weigh directions by "
    "curvature and are set by the stiff ones, so this problem shows Adam against the noise "
    "scale, not the Hessian weighting against B_simple (the issue's premise; the bench's "
    "stiff-sgd problem is one where they differ 20x: tests/test_trial_stiff_sgd.py)",
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
    sampled_simple, sampled_noise = problem.sampled_noise_scales(w, 200_000, data_seed=5)
    assert problem.b_simple(w) == pytest.approx(sampled_simple, rel=0.03)
    assert problem.b_noise(w) == pytest.approx(sampled_noise, rel=0.03)
    assert problem.b_noise(w) > 1.5 * problem.b_simple(w)  # the weighting does matter here


@pytest.mark.parametrize(
    "rule, warm, ks, kept",
    [("linear", 200, (2, 4, 8, 16, 32, 64), "control"), ("sqrt", 5, (2, 4, 8), "branch")],
)
def test_restore_is_exact(rule, warm, ks, kept):
    """LR × k under Adam (the linear rule) wrecks every branch, so the control is kept; early,
    with the √ rule and a Δ short enough to tell (16 examples: at step 5 the loss halves in a
    few dozen), a branch is. Either way the trialled run equals the one run by hand."""
    problem = Quadratic(**SETTINGS["problem"])
    plan = plan_at(2, ks, 4 if kept == "control" else 1)
    plan = TrialPlan(**{**plan.__dict__, "rule": rule})
    k, diff = restore_check(problem, 2, 0.08, plan, warm_steps=warm, after_steps=30)
    assert (k == 1) == (kept == "control"), k
    assert diff <= 1e-6


class _NoisyRun(BaseRun):
    """A run whose steps and whose eval both draw torch's RNG: a midway eval that leaked its
    draws into the control's second half would show as a different end state."""

    def train_step(self, model, optimizer, start, count):
        x, y = self.problem.examples(self.data_seed, start, count)
        optimizer.zero_grad()
        jitter = 1 + 0.1 * torch.rand(count, dtype=torch.float64)  # dropout's kind of draw
        (per_example_loss(model[0], x, y)[0] * jitter).mean().backward()
        optimizer.step()

    def evaluate(self, model):
        torch.rand(3)  # an eval that samples (a shuffled loader, a dropout left on)
        return super().evaluate(model)


def test_the_midway_eval_judges_delta_and_leaves_the_control_exact():
    """The control is evaluated at Δ/2: the verdict's half-progress ratio is the one a run by
    hand measures there, and the control continued past it equals a run that never paused."""
    problem = Quadratic(**SETTINGS["problem"])
    plan = plan_at(2, (2, 4), 4)
    torch.manual_seed(7)
    trialled = _NoisyRun(problem, 2, 0.08)
    for _ in range(20):
        trialled.step()
    by_hand = copy.deepcopy(trialled)
    rng = torch.get_rng_state()
    verdict, _ = run_trial(
        plan, trialled.model, trialled.opt, trialled.train_step, trialled.evaluate,
        start=trialled.seen, keep=1,
    )  # fmt: skip
    torch.set_rng_state(rng)
    losses = []
    for _ in range(2):  # the snapshot's and the midway eval draw outside the control's steps
        with torch.random.fork_rng(devices=[]):
            losses.append(by_hand.evaluate(by_hand.model).mean().item())
        for _ in range(plan.steps(1) // 2):
            by_hand.step()
    losses.append(by_hand.evaluate(by_hand.model).mean().item())
    first, second = losses[0] - losses[1], losses[1] - losses[2]
    assert verdict.half_progress_ratio == pytest.approx(second / first, rel=1e-9)
    assert float((trialled.w - by_hand.w).detach().abs().max()) <= 1e-12
