"""advisor.trial: the paired bound's coverage on synthetic losses with a known difference, pass
and fail at the tolerance's edge, the bracket (non-monotone passes included), cost, LR rule,
bad input named by its field, and Δ too long: the half-progress ratio against exponential decay
at known Δ/τ."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rampwatch.advisor.trial import (
    HALF_PROGRESS_MIN,
    TrialPlan,
    TrialVerdict,
    failed_factor,
    judge,
    tolerance_fraction,
)

PLAN = TrialPlan.for_optimizer("adamw", batch=4, ks=(2, 4, 8), delta_tokens=4 * 8 * 10)


def _paired(rng, n=400, true_diff=0.0, noise=0.05):
    """Per-example control losses with a large spread of their own, a branch that differs by
    `true_diff` on average with a small paired noise."""
    control = rng.gamma(2.0, 1.0, n)  # skewed, spread ≫ the paired differences
    return control, control + true_diff + rng.normal(0.0, noise, n)


def _verdict(diffs: dict[int, float], progress=0.1, plan=PLAN, n=400, **kw):
    """A verdict whose branches differ from the control by exactly `diffs` (no noise)."""
    control = np.random.default_rng(0).gamma(2.0, 1.0, n)
    branches = {k: control + d for k, d in diffs.items()}
    return judge(plan, control + progress, control, branches, **kw)


def test_bound_covers_the_true_difference_95_times_in_100():
    """Over 400 seeds the one-sided 95% bound lies above the true mean difference in ~95%."""
    true = 0.02
    covered = []
    for seed in range(400):
        control, branch = _paired(np.random.default_rng(seed), n=60, true_diff=true)
        verdict = judge(PLAN, control + 1.0, control, {2: branch, 4: branch, 8: branch})
        covered.append(verdict.branches[0].bound >= true)
    assert 0.92 <= np.mean(covered) <= 0.98


def test_pass_and_fail_at_the_tolerance_edge():
    """Tolerance = (k−1)/(2k) of the control's progress; a difference just inside passes, just
    outside fails (no paired noise: the bound is the mean)."""
    progress = 0.2
    edge = {k: tolerance_fraction(k) * progress for k in PLAN.ks}
    inside = _verdict({k: e - 1e-9 for k, e in edge.items()}, progress)
    outside = _verdict({k: e + 1e-9 for k, e in edge.items()}, progress)
    assert [b.passed for b in inside.branches] == [True, True, True]
    assert [b.passed for b in outside.branches] == [False, False, False]
    assert [b.tolerance for b in inside.branches] == pytest.approx([0.05, 0.075, 0.0875])


def test_noise_makes_a_branch_fail_not_pass():
    """A true difference at 80% of the tolerance passes with a tight eval and fails when the
    paired noise makes the bound wider than the room left."""
    tol = tolerance_fraction(2) * 0.1
    rng = np.random.default_rng(1)
    for noise, expect in ((0.001, True), (0.2, False)):
        control, branch = _paired(rng, n=400, true_diff=0.8 * tol, noise=noise)
        verdict = judge(PLAN, control + 0.1, control, {2: branch, 4: branch + 1, 8: branch + 1})
        assert verdict.branches[0].passed is expect


@pytest.mark.parametrize(
    "passes, k_star, bracket",
    [
        ((True, True, True), 8, (32, None)),  # open above
        ((True, True, False), 4, (16, 32)),
        ((True, False, True), 2, (8, 16)),  # non-monotone: ×8 passing does not count
        ((False, True, True), None, (None, 8)),  # [—, 2B)
        ((False, False, False), None, (None, 8)),
    ],
)
def test_bracket(passes, k_star, bracket):
    diffs = {k: (-0.01 if ok else 0.5) for k, ok in zip(PLAN.ks, passes, strict=True)}
    verdict = _verdict(diffs, b_simple=2.0)
    assert [b.passed for b in verdict.branches] == list(passes)
    assert verdict.k_star == k_star and verdict.bracket == bracket
    assert verdict.kept_k == (k_star or 1)
    assert verdict.calibration == (None if k_star is None else bracket[0] / 2.0)
    assert verdict.cost_tokens == 3 * PLAN.delta_tokens
    assert ("at least 32" if bracket[1] is None else f"{bracket[1]:,}") in verdict.summary


def test_no_progress_passes_only_a_surely_better_branch():
    verdict = _verdict({2: 0.0, 4: -0.01, 8: 0.01}, progress=-0.05)
    assert [b.tolerance for b in verdict.branches] == [0.0, 0.0, 0.0]
    assert [b.passed for b in verdict.branches] == [False, True, False]  # bound = mean here
    assert "could not tell" in verdict.summary


def test_a_control_that_did_not_learn_brackets_nothing_from_branches_that_failed():
    """With no progress over Δ there is no tolerance: a failed branch says nothing, so no
    bracket, no calibration and no "Critical batch below …" stated as a finding (seen on the
    demo: a green "below 16 … below 0.554× the noise scale" from a control that did not learn)."""
    verdict = _verdict({2: 0.01, 4: 0.02, 8: 0.03}, progress=-0.01, b_simple=29.0)
    assert [b.passed for b in verdict.branches] == [False, False, False]
    assert (verdict.k_star, verdict.bracket, verdict.calibration) == (None, None, None)
    assert verdict.kept_k == 1
    said = verdict.summary
    assert "Critical batch" not in said and "noise scale" not in said
    assert said.startswith("The control did not improve over Δ, so the trial could not tell")
    assert "(×2 fail, ×4 fail, ×8 fail against no tolerance); keep 4" in said
    assert TrialVerdict.from_dict(verdict.to_dict()).summary == said


def test_plan_steps_lr_and_cost():
    plan = TrialPlan.for_optimizer(
        "SGD", batch=8, ks=(2, 4), delta_tokens=8 * 4 * 16 * 3, tokens_per_example=16
    )
    assert plan.rule == "linear" and plan.lr_factor(4) == 4.0
    assert PLAN.rule == "sqrt" and PLAN.lr_factor(8) == pytest.approx(8**0.5)
    assert [plan.steps(k) for k in (1, 2, 4)] == [12, 6, 3]
    assert plan.cost_tokens == 2 * plan.delta_tokens


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(batch=0), "batch"),
        (dict(ks=(4, 2)), "ks"),
        (dict(ks=(1, 2)), "ks"),
        (dict(ks=(2, 3)), "delta_tokens"),  # 64 tokens are 8 steps of ×2, not whole ones of ×3
        (dict(ks=()), "ks"),
        (dict(delta_tokens=100), "delta_tokens"),
        (dict(rule="cubic"), "LR rule"),
        (dict(level=1.0), "level"),
    ],
)
def test_bad_plan_names_the_field(fields, name):
    base = dict(batch=4, ks=(2, 4), delta_tokens=64, rule="sqrt")
    with pytest.raises(ValueError, match=name):
        TrialPlan(**{**base, **fields})


def test_bad_losses_name_the_field():
    control = np.ones(10)
    good = {k: control for k in PLAN.ks}
    cases = [
        ((control, control[:1], good), "control_losses"),
        ((control, control, {**good, 4: control[:9]}), r"branch_losses\[4\]"),
        ((control, control, {**good, 8: np.full(10, np.nan)}), r"branch_losses\[8\]"),
        ((control + 1, control, {2: control}), "branch_losses"),
        ((np.inf, control, good), "snapshot_losses"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            judge(PLAN, *args)
    with pytest.raises(ValueError, match="b_simple"):
        judge(PLAN, control, control, good, b_simple=-1)


def test_a_verdict_survives_json():
    import json

    from rampwatch.advisor.trial import TrialVerdict

    verdict = _verdict({2: -0.01, 4: 0.5, 8: 0.5}, b_simple=2.0)
    back = TrialVerdict.from_dict(json.loads(json.dumps(verdict.to_dict())))
    assert back == verdict
    assert back.summary == verdict.summary


# -- Δ too long: the control's half progress (module docstring: the derivation) -------------


def _decay(delta_over_tau, a=1.0, floor=2.0, n=400):
    """Held-out losses of a control whose loss is floor + a·exp(−t/τ) in examples t: at the
    snapshot, at Δ/2, at Δ (the same examples, shifted by the mean)."""
    control = np.random.default_rng(0).gamma(2.0, 1.0, n)
    at = lambda frac: control + floor + a * math.exp(-frac * delta_over_tau)  # noqa: E731
    return at(0.0), at(0.5), at(1.0)


@pytest.mark.parametrize("delta_over_tau", [0.1, 0.5, 0.79, 0.8, 1.0, 2.0, 4.0])
def test_half_progress_ratio_reads_delta_over_tau(delta_over_tau):
    """Under L(t) = L∞ + a·exp(−t/τ) the second half's progress over the first half's is
    exp(−Δ/2τ); Δ is too long past Δ/τ = −2·ln(HALF_PROGRESS_MIN) ≈ 0.79."""
    snap, mid, end = _decay(delta_over_tau)
    verdict = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid)
    assert verdict.half_progress_ratio == pytest.approx(math.exp(-delta_over_tau / 2))
    assert verdict.delta_ok is (delta_over_tau <= -2 * math.log(HALF_PROGRESS_MIN))


def test_the_threshold_puts_a_branch_at_twice_the_critical_batch_on_the_tolerance():
    """At the threshold, a ×2 branch at 2·B_crit (B = B_crit: it covers (1 + 1)/(1 + 2) = ⅔ of
    the control's effective examples, McCandlish et al. 2018 §2.3) loses exactly the ×2
    tolerance ¼ of the control's progress: any longer Δ lets it pass, a bracket 2× too high."""
    x = -2 * math.log(HALF_PROGRESS_MIN)
    deficit = math.exp(-2 * x / 3) - math.exp(-x)  # a = 1
    assert deficit / (1 - math.exp(-x)) == pytest.approx(tolerance_fraction(2))
    assert HALF_PROGRESS_MIN == pytest.approx(0.6725, abs=1e-4)


def test_too_long_a_delta_gives_no_bracket_and_says_how_long():
    """Δ = 4τ: every branch ties the flattened control, yet the verdict keeps the control,
    brackets nothing and names the Δ that would tell (there the ratio is the threshold)."""
    snap, mid, end = _decay(4.0)
    verdict = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid, b_simple=2.0)
    assert [b.passed for b in verdict.branches] == [True, True, True]  # what Δ fools
    assert not verdict.delta_ok
    assert verdict.k_star is None and verdict.bracket is None and verdict.kept_k == 1
    assert verdict.calibration is None
    suggested = verdict.suggested_delta_tokens
    assert suggested == round(PLAN.delta_tokens * -2 * math.log(HALF_PROGRESS_MIN) / 4.0)
    assert "Δ too long" in verdict.summary and f"~{suggested:,} tokens" in verdict.summary
    assert "Critical batch" not in verdict.summary
    snap, mid, end = _decay(4.0 * suggested / PLAN.delta_tokens)
    again = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid)
    assert again.half_progress_ratio == pytest.approx(HALF_PROGRESS_MIN, rel=0.01)


def test_a_control_flat_in_its_second_half_is_too_long():
    snap, mid, _ = _decay(1.0)
    verdict = judge(PLAN, snap, mid + 0.001, {k: mid for k in PLAN.ks}, midway_losses=mid)
    assert verdict.half_progress_ratio < 0 and not verdict.delta_ok
    assert verdict.suggested_delta_tokens == PLAN.delta_tokens // 4


def test_without_a_midway_eval_delta_is_not_judged():
    verdict = _verdict({2: -0.01, 4: 0.5, 8: 0.5})
    assert verdict.half_progress_ratio is None and verdict.delta_ok
    assert verdict.suggested_delta_tokens is None and verdict.bracket == (8, 16)


def test_a_verdict_too_long_survives_json_and_old_dicts_load():
    import json

    from rampwatch.advisor.trial import TrialVerdict

    snap, mid, end = _decay(4.0)
    verdict = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid)
    back = TrialVerdict.from_dict(json.loads(json.dumps(verdict.to_dict())))
    assert back == verdict and back.summary == verdict.summary
    old = _verdict({2: -0.01, 4: 0.5, 8: 0.5}).to_dict()
    for new in ("half_progress_ratio", "delta_ok"):
        del old[new]
    loaded = TrialVerdict.from_dict(old)
    assert loaded.delta_ok and loaded.half_progress_ratio is None and loaded.bracket == (8, 16)


def test_the_card_words_a_trial_whose_delta_was_too_long():
    """The card (dashboard/recommend.py) for a verdict with no bracket: no bracket line (the
    summary above it says what to change: a demo card said it twice) and no branch called a
    pass or a fail."""
    from rampwatch.dashboard.recommend import TrialView

    snap, mid, end = _decay(4.0)
    verdict = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid)
    view = TrialView(trial=None, verdict=verdict)
    assert view.bracket_text is None and "shorten Δ" in verdict.summary
    assert {r["result"] for r in view.branch_rows()} == {"not judged: Δ too long"}


@pytest.mark.parametrize(
    "passes, cap, k_star, bracket",
    [
        ((True, True, True), 8, 4, (16, 32)),  # ×8 passes, but failed before: not kept
        ((True, True, True), 4, 2, (8, 16)),
        ((True, True, True), 2, None, (None, 8)),
        ((True, False, True), 8, 2, (8, 16)),  # the chain ends first: the cap changes nothing
        ((True, True, True), 16, 8, (32, 64)),  # past the plan: the bracket closes at it
    ],
)
def test_a_cap_keeps_no_branch_from_the_factor_that_failed_before(passes, cap, k_star, bracket):
    diffs = {k: (-0.01 if ok else 0.5) for k, ok in zip(PLAN.ks, passes, strict=True)}
    verdict = _verdict(diffs, cap=cap)
    assert [b.passed for b in verdict.branches] == list(passes)  # the arms' own results stand
    assert (verdict.k_star, verdict.bracket, verdict.kept_k) == (k_star, bracket, k_star or 1)
    assert verdict.cap == cap
    said = f"×{cap} failed in the trial before at this batch"
    assert (said in verdict.summary) is (cap <= 8)
    assert type(verdict).from_dict(verdict.to_dict()) == verdict


def test_failed_factor_is_the_smallest_failure_of_a_control_that_learned():
    assert failed_factor(_verdict({2: -0.01, 4: 0.5, 8: 0.5})) == 4
    assert failed_factor(_verdict({2: -0.01, 4: -0.01, 8: 0.5})) == 8
    assert failed_factor(_verdict({2: -0.01, 4: -0.01, 8: -0.01})) is None
    assert failed_factor(_verdict({2: -0.01, 4: -0.01, 8: -0.01}, cap=8)) == 8  # kept on
    # a Δ judged too long lets branches catch up: its failures stand (Δ = 4τ, ×8 behind)
    snap, mid, end = _decay(4.0)
    too_long = judge(PLAN, snap, end, {2: end, 4: end, 8: end + 1.0}, midway_losses=mid)
    assert too_long.delta_check == "too long" and failed_factor(too_long) == 8
    # a control that made no progress gives no tolerance: its failures say nothing
    assert failed_factor(_verdict({2: 0.0, 4: 0.5, 8: 0.5}, progress=-0.05)) is None


def test_the_card_says_a_branch_past_the_cap_passed_but_was_not_kept():
    from rampwatch.dashboard.recommend import TrialView

    view = TrialView(trial=None, verdict=_verdict({2: -0.01, 4: -0.01, 8: -0.01}, cap=4))
    assert [r["result"] for r in view.branch_rows()] == [
        "pass",
        "pass; not kept: ×4 failed in the trial before",
        "pass; not kept: ×4 failed in the trial before",
    ]
    assert view.bracket_text.startswith("Critical batch between 8 and 16")


def test_a_bound_near_the_threshold_is_shown_with_the_digits_that_tell_them_apart():
    """The demo's card said "at most 0.67× at 95%, 0.67× needed" for a bound just under
    0.6725: both are written to the first decimal where they differ."""
    import dataclasses

    snap, mid, end = _decay(4.0)
    too_long = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid)
    near = dataclasses.replace(
        too_long, half_progress_ratio=0.26, half_progress_bounds=(0.1, 0.668)
    )
    assert "(second half 0.26× the first, at most 0.668× at 95%, 0.673× needed)" in near.summary
    far = dataclasses.replace(too_long, half_progress_ratio=0.26, half_progress_bounds=(0.1, 0.4))
    assert "(second half 0.26× the first, at most 0.40× at 95%, 0.67× needed)" in far.summary
    unsure = dataclasses.replace(
        near, delta_check="cannot tell", half_progress_ratio=0.9, half_progress_bounds=(0.6705, 1.2)
    )
    assert "(95% bounds 0.670 to 1.20; 0.673× needed)" in unsure.summary
