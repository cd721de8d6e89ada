"""Ramp trials on bench/trial_bench.py's stiff-sgd problem (least squares with one stiff direction
and eight soft ones, plain SGD at batch 32 and a low LR), where the Hessian-weighted B_noise is
≥ 10× B_simple: the trial's bracket holds the critical batch of the linear rule's local sweep
(the wall past which LR × B/B0 diverges) within 2×, B_simple is outside 2× of it and of the
tuned sweep's; B_noise is not SGD's critical batch here (strict xfails, with what was measured):
the wall moves with the run's LR, B_noise does not, and the LR-tuned sweep sits 100× below it."""

from __future__ import annotations

import pytest

from bench.trial_bench import STIFF_SETTINGS, BaseRun, Quadratic, measure_stiff, overlaps

# one seed, the sweeps' batches near what they find (the bench runs 3 seeds and all batches)
SETTINGS = {
    **STIFF_SETTINGS,
    "runs": ((0.02, (0.025,)), (0.01, (0.025,)), (0.08, (0.025,))),
    "seeds": (0,),
    "rule_batches": (256, 512, 1024, 2048, 4096, 8192),
    "tuned_batches": (1, 2, 4, 8, 16, 32, 64),
}


@pytest.fixture(scope="module")
def report():
    return measure_stiff(settings=SETTINGS)


def _by_lr(report) -> dict:
    return {p.lr: p for p in report.points}


def test_b_noise_is_ten_times_b_simple(report):
    ratios = {p.lr: p.b_noise / p.b_simple for p in report.points}
    assert all(r >= 10 for r in ratios.values()), ratios


def test_b_noise_closed_form_matches_sampled_gradients():
    """At the stiff-sgd snapshot (LR 0.02, 2.5% of the initial excess): the closed forms against
    200,000 sampled per-example gradients, so B_noise ≈ 20 × B_simple is the problem's, not a
    slip of the formula."""
    problem = Quadratic(**SETTINGS["problem"])
    run = BaseRun(problem, SETTINGS["base_batch"], 0.02, optimizer="sgd")
    run.until(0.025 * run.excess())
    w = run.w.detach()
    simple, noise = problem.sampled_noise_scales(w, 200_000, data_seed=5)
    assert problem.b_simple(w) == pytest.approx(simple, rel=0.03)
    assert problem.b_noise(w) == pytest.approx(noise, rel=0.03)
    assert noise >= 10 * simple


def test_trial_brackets_the_linear_rules_critical_batch_within_2x(report):
    """The local sweep at the run's LR × B/B0 (what a ramp does) reaches the target in the same
    examples at every batch up to a wall and diverges past it; the trial's bracket meets that
    [reached, diverged) within 2×, and costs Δ per branch it ran (at most len(ks) · Δ) per try."""
    for p in report.points:
        verdict = p.adaptive[-1]
        assert verdict.delta_ok, (p.lr, verdict.delta_check)
        assert overlaps(verdict.bracket, p.wall), (p.lr, verdict.bracket, p.wall)
        for tried in p.adaptive:
            assert tried.cost_tokens == len(tried.branches) * tried.plan.delta_tokens


def test_b_simple_is_outside_2x_of_both_sweeps(report):
    for p in report.points:
        assert not overlaps((p.b_simple, p.b_simple), p.wall), (p.lr, p.b_simple, p.wall)
        tuned = p.tuned[2]
        assert not tuned / 2 <= p.b_simple <= 2 * tuned, (p.lr, p.b_simple, tuned)


def test_the_wall_moves_with_the_lr_and_b_noise_does_not(report):
    """8× the LR moves the linear rule's wall ≥ 4× down; B_noise stays within 1.5× (it is set
    by the soft curvature, the wall by 2/h_max: bench/trial_bench.py's measure_stiff)."""
    slow, fast = _by_lr(report)[0.01], _by_lr(report)[0.08]
    assert slow.wall[0] >= 4 * fast.wall[0], (slow.wall, fast.wall)
    assert 1 / 1.5 <= slow.b_noise / fast.b_noise <= 1.5, (slow.b_noise, fast.b_noise)


@pytest.mark.xfail(
    strict=True,
    reason="measured (seed 0, from excess 0.0333): the linear rule's wall [reached, diverged) is "
    "[4096, 8192), [2048, 4096), [512, 1024) at LR 0.01, 0.02, 0.08, B_noise 958, 936, 937: "
    "within 2x only at 0.08. The wall is B0·2/(η0·h_max), set by the run's LR; B_noise by the "
    "soft curvature",
)
def test_b_noise_is_the_linear_rules_critical_batch(report):
    for p in report.points:
        assert overlaps((p.b_noise, p.b_noise), p.wall), (p.lr, p.b_noise, p.wall)


@pytest.mark.xfail(
    strict=True,
    reason="measured (seed 0): the LR-tuned local sweep's B_crit is 7.5 at all three snapshots, "
    "B_noise 936-958 (125x): tuned, every batch from 8 up runs at LR 1.3-1.8, near 2/h_max, "
    "so the steps stop falling at a few examples",
)
def test_b_noise_is_the_tuned_sweeps_critical_batch(report):
    for p in report.points:
        tuned = p.tuned[2]
        assert tuned / 2 <= p.b_noise <= 2 * tuned, (p.lr, p.b_noise, tuned)


@pytest.mark.xfail(
    strict=True,
    reason="measured (seed 0): the trial's brackets [4096, inf), [4096, inf), [512, 1024) "
    "against the tuned sweep's B_crit 7.5: the trial keeps the run's LR and moves it by the "
    "linear rule, the tuned sweep takes LR 1.8 at batch 32 (90x the run's 0.02)",
)
def test_trial_brackets_the_tuned_sweeps_critical_batch(report):
    for p in report.points:
        tuned = p.tuned[2]
        assert overlaps(p.adaptive[-1].bracket, (tuned, tuned)), (p.lr, tuned)


@pytest.mark.xfail(
    strict=True,
    reason="measured (seed 0): the bracket's lower end is 4096, 4096, 512 at LR 0.02, 0.01, "
    "0.08 where the linear rule's sweep last reached the target at 2048, 4096, 512: at LR 0.02 "
    "the trial passes a batch whose LR (2.56, past 2/h_max = 2) diverges. Its arms last 4 steps "
    "of x128 (Δ 16,384): too few for the stiff direction to grow from its noise floor to the "
    "soft directions' loss, and the longer Δ before (8 steps) did not fail x128 either, so no "
    "cap keeps it (at LR 0.08 the longer Δs' failure of x32 does: [512, 1024))",
)
def test_the_trials_lower_end_does_not_diverge(report):
    """advisor/trial.py: the bracket errs low, so a ramp it allows is safe."""
    for p in report.points:
        lower = p.adaptive[-1].bracket[0]
        assert lower is None or lower <= p.wall[0], (p.lr, lower, p.wall)
