"""advisor.trial's bound on the control's half-progress ratio r = P₂/P₁ (module docstring, "r's
bound"), against a known answer: per-example held-out losses drawn from exponential decay
L_i(t) = c_i + a_i·exp(−t/τ) plus independent eval noise of known size, so the true ratio is
exp(−Δ/2τ). Asserted: each one-sided 95% bound misses the true r about 5% of the time over many
seeds; a surely-too-long and a surely-fine Δ are decided right every time; a Δ truly too long
reads "fine" at most at the bound's level, and "cannot tell", judged at r's lower bound, keeps
no branch past B_crit where the branches follow the model; `examples_to_tell` is exactly the batch at which the same spread decides 80% of
the time; a mean
with no per-example losses cannot tell; the card and old stored verdicts read the new state."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from rampwatch.advisor.gns_window import _t_quantile
from rampwatch.advisor.trial import (
    HALF_PROGRESS_MIN,
    TELL_POWER,
    TrialPlan,
    TrialVerdict,
    failed_factor,
    half_progress_bounds,
    judge,
    tolerance_fraction,
)

PLAN = TrialPlan.for_optimizer("adamw", batch=4, ks=(2, 4, 8), delta_tokens=4 * 8 * 10)
X_MIN = -2 * math.log(HALF_PROGRESS_MIN)  # Δ/τ at the threshold, ≈ 0.79


def _evals(rng, x, n=256, a=0.1, sigma=0.05):
    """Held-out losses at the snapshot, Δ/2 and Δ of a control with Δ/τ = x: each example its own
    floor c_i and amplitude a_i (skewed, spread ≫ the progress), each eval its own noise σ."""
    c = rng.gamma(2.0, 1.0, n) + 2.0
    amp = a * rng.gamma(4.0, 0.25, n)  # mean a
    return tuple(c + amp * math.exp(-f * x) + rng.normal(0.0, sigma, n) for f in (0, 0.5, 1))


def _judge(snap, mid, end):
    return judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=mid)


def _with_branches(rng, x, b_crit, n=256, a=0.1, sigma=0.05):
    """The same control, and each branch k where the model puts it: Δ at k·B is worth the
    control's share e = (1 + B/B_crit)/(1 + k·B/B_crit) of Δ (module docstring, "The tolerance")."""
    c = rng.gamma(2.0, 1.0, n) + 2.0
    amp = a * rng.gamma(4.0, 0.25, n)

    def at(share):
        return c + amp * math.exp(-share * x) + rng.normal(0.0, sigma, n)

    snap, mid, end = at(0), at(0.5), at(1)
    b = PLAN.batch
    branches = {k: at((1 + b / b_crit) / (1 + k * b / b_crit)) for k in PLAN.ks}
    return judge(PLAN, snap, end, branches, midway_losses=mid)


@pytest.mark.parametrize("x", [0.5, X_MIN, 2.0])
def test_each_bound_misses_the_true_ratio_about_5_in_100(x):
    """1,000 seeds: a one-sided 95% bound misses ~50 times (binomial sd ≈ 7); accept 25–75."""
    rng, true_r = np.random.default_rng(7), math.exp(-x / 2)
    below = above = 0
    for _ in range(1000):
        snap, mid, end = _evals(rng, x)
        lo, hi = half_progress_bounds(snap - mid, mid - end)
        below += lo is not None and lo > true_r  # the lower bound missed
        above += hi is not None and hi < true_r  # the upper bound missed
    assert 25 <= below <= 75 and 25 <= above <= 75, (below, above)


def test_surely_too_long_and_surely_fine_are_decided_right():
    """Small eval noise (σ = 0.003, 512 examples): Δ = 4τ (r = 0.14) is too long and Δ = 0.2τ
    (r = 0.90) fine, in every one of 50 seeds; the verdict's words follow."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        long = _judge(*_evals(rng, 4.0, n=512, sigma=0.003))
        short = _judge(*_evals(rng, 0.2, n=512, sigma=0.003))
        assert long.delta_check == "too long" and long.bracket is None and long.kept_k == 1
        assert long.half_progress_bounds[1] < HALF_PROGRESS_MIN
        assert short.delta_check == "fine" and short.delta_ok and short.bracket is not None
        assert short.half_progress_bounds[0] >= HALF_PROGRESS_MIN
    assert "Δ too long" in long.summary and "at most" in long.summary


@pytest.mark.parametrize("x", [X_MIN, 1.0, 1.5])
def test_a_delta_truly_too_long_reads_fine_at_most_at_the_bounds_level(x):
    """The conservative side: at r ≤ HALF_PROGRESS_MIN (Δ/τ at and past the threshold) over
    1,000 seeds "fine" (branches judged against the linear tolerance) comes at most ~5% of the
    time (≤ 75 of 1,000); every "too long" brackets nothing and keeps the control."""
    rng = np.random.default_rng(11)
    fine = 0
    for _ in range(1000):
        v = _judge(*_evals(rng, x))
        fine += v.delta_check == "fine"
        if v.delta_check == "too long":
            assert v.bracket is None and v.k_star is None and v.kept_k == 1 and not v.judged
    assert fine <= 75, fine


@pytest.mark.parametrize("x", [0.4, X_MIN, 1.0])
def test_cannot_tell_judged_at_r_s_lower_bound_keeps_nothing_past_b_crit(x):
    """Branches where the model puts them, B_crit = 6 at B = 4 (every branch past it): over
    1,000 seeds a trial that cannot tell keeps a branch at most 1% of the time (the tolerance
    at r's lower bound is the one a branch at B_crit would lose; measured: 1 of 1,000 at each
    Δ). At B_crit = 20 (×2 and ×4 below it) the same trials do keep a branch (13, 24 and 28 of
    1,000 measured): the bound gives answers where the linear check gave none."""
    past = below = 0
    rng = np.random.default_rng(11)
    for _ in range(1000):
        v = _with_branches(rng, x, b_crit=6.0)
        if v.delta_check == "cannot tell" and v.k_star is not None:
            past += 1
            assert v.judged and v.tolerance_ratio == v.half_progress_bounds[0] > 0
            assert v.half_progress_ratio >= HALF_PROGRESS_MIN
    rng = np.random.default_rng(11)
    for _ in range(1000):
        v = _with_branches(rng, x, b_crit=20.0)
        below += v.delta_check == "cannot tell" and v.k_star is not None
    assert past <= 10, past
    assert below >= 10, below


def test_near_the_threshold_it_cannot_tell_and_says_what_would():
    """Δ/τ = 0.6 (r = 0.74) with the default noise: r̂ 0.68, but neither bound clears the
    threshold; the verdict names the eval batch that would tell (more than it has) and its
    bounds, and judges the branches (here the control's own losses) at r's lower bound, each
    held to less than the linear tolerance. At r̂ below the threshold nothing is judged."""
    v = _judge(*_evals(np.random.default_rng(5), 0.6))
    assert v.delta_check == "cannot tell" and not v.delta_ok
    lo, hi = v.half_progress_bounds
    assert 0 < lo < HALF_PROGRESS_MIN <= (math.inf if hi is None else hi)
    assert v.judged and v.tolerance_ratio == lo and v.k_star == 8 and v.bracket == (32, None)
    for b in v.branches:
        assert 0 < b.tolerance < tolerance_fraction(b.k) * v.progress
        assert b.tolerance == pytest.approx(tolerance_fraction(b.k, lo) * v.progress)
    assert v.examples_to_tell > v.examples and v.suggested_delta_tokens is None
    assert "Whether Δ is too long could not be told" in v.summary
    assert f"~{v.examples_to_tell:,} examples (now {v.examples:,})" in v.summary
    # and where that batch is set: the trainer's flag, an own loop's evaluate()
    assert "--trial-eval-batch" in v.summary and "evaluate()" in v.summary
    below = _judge(*_evals(np.random.default_rng(4), 0.6))  # r̂ 0.66: more likely too long
    assert below.delta_check == "cannot tell" and below.half_progress_ratio < HALF_PROGRESS_MIN
    assert not below.judged and below.bracket is None and below.tolerance_ratio is None
    assert below.summary.startswith("Cannot tell whether Δ is too long")


def test_at_the_lower_bound_only_a_failure_of_the_linear_tolerance_ends_the_bracket():
    """Branches a constant above the control: ×2 within the tolerance at r's lower bound, ×4
    between it and the linear one, ×8 past both. ×2 is kept, and the bracket ends at ×8, not at
    ×4, whose failure says nothing of B_crit; with ×2 between too it is "below ×8", and with
    every branch between there is no bracket."""
    snap, mid, end = _evals(np.random.default_rng(5), 0.6)
    first = _judge(snap, mid, end)
    p, lo = first.progress, first.tolerance_ratio
    inside = {k: tolerance_fraction(k, lo) * p / 4 for k in PLAN.ks}
    between = {k: (tolerance_fraction(k, lo) + tolerance_fraction(k)) / 2 * p for k in PLAN.ks}
    past = {k: 2 * tolerance_fraction(k) * p for k in PLAN.ks}
    offsets = {2: inside[2], 4: between[4], 8: past[8]}
    v = judge(PLAN, snap, end, {k: end + d for k, d in offsets.items()}, midway_losses=mid)
    assert [b.passed for b in v.branches] == [True, False, False]
    assert v.k_star == 2 and v.bracket == (8, 32) and failed_factor(v) == 8
    assert v.summary.startswith("Critical batch between 8 and 32 sequences (×2 pass, ×4 fail")
    offsets[2] = between[2]
    v = judge(PLAN, snap, end, {k: end + d for k, d in offsets.items()}, midway_losses=mid)
    assert v.k_star is None and v.bracket == (None, 32) and v.kept_k == 1
    offsets[8] = between[8]
    v = judge(PLAN, snap, end, {k: end + d for k, d in offsets.items()}, midway_losses=mid)
    assert v.bracket is None and v.kept_k == 1 and failed_factor(v) is None
    assert v.summary.startswith("No bracket (×2 fail, ×4 fail, ×8 fail): no branch passed")
    assert "Whether Δ is too long could not be told" in v.summary


def test_the_tolerance_at_a_ratio_is_the_models_loss_at_b_crit_and_grows_with_it():
    """tolerance_fraction(k, r): a branch at k·B = B_crit on L = a·exp(−t/τ) reaches the
    control's loss at share e = (k + 1)/(2k) of Δ (brute force: its loss there against the
    control's, over P), it tends to (k − 1)/(2k) as r → 1, and grows with r."""
    for k in (2, 4, 8):
        for r in (0.1, 0.5, HALF_PROGRESS_MIN, 0.9):
            tau = 1 / (-2 * math.log(r))  # Δ = 1
            loss = [math.exp(-t / tau) for t in (0, (k + 1) / (2 * k), 1)]
            lost = (loss[1] - loss[2]) / (loss[0] - loss[2])
            assert tolerance_fraction(k, r) == pytest.approx(lost, rel=1e-12)
        assert tolerance_fraction(k, 1 - 1e-9) == pytest.approx(tolerance_fraction(k), abs=1e-6)
        grid = [tolerance_fraction(k, r) for r in np.linspace(0.01, 0.99, 99)]
        assert all(np.diff(grid) > 0)


def _exact(n, r_hat, p1=0.04, sd=0.05):
    """Losses whose per-example progress has exactly mean p1 and r_hat·p1, and sd(p2) = sd
    (p1 the same on every example), for any n: d = p2 − r*·p1 has the same mean and sd at
    every n, so the batch at which it is significant is known."""
    e = np.random.default_rng(0).normal(size=n)
    e = (e - e.mean()) / e.std(ddof=1) * sd
    end = np.random.default_rng(1).gamma(2.0, 1.0, n) + 2.0
    mid = end + r_hat * p1 + e
    return mid + p1, mid, end


@pytest.mark.parametrize("r_hat", [0.55, 0.8])
def test_examples_to_tell_is_the_batch_at_which_the_same_spread_decides_with_80_percent_power(
    r_hat,
):
    """Fieller's set excludes r* exactly when the paired t test of p2 − r*·p1 rejects (module
    docstring): with that mean and sd held fixed, the batch at which the test is just
    significant decides and one fewer does not; the named batch is the one at which the mean is
    t + z(0.8) standard errors from r*, where a fresh batch with that mean and spread is
    significant 80% of the time, one fewer is not."""
    v = _judge(*_exact(64, r_hat))
    assert v.delta_check == "cannot tell"
    mean, sd = abs(r_hat - HALF_PROGRESS_MIN) * 0.04, 0.05  # _exact's d = p2 − r*·p1

    def margin(n, power):  # standard errors past the test's bound at n examples
        return mean * math.sqrt(n) / sd - _t_quantile(0.95, n - 1) - NormalDist().inv_cdf(power)

    n = v.examples_to_tell
    assert margin(n, TELL_POWER) >= 0 > margin(n - 1, TELL_POWER)
    just = next(m for m in range(2, n) if margin(m, 0.5) >= 0)
    assert 2 < n / just < 2.6  # about (1 + 0.84/1.645)²
    at, below = _judge(*_exact(just, r_hat)), _judge(*_exact(just - 1, r_hat))
    assert at.delta_check == ("fine" if r_hat > HALF_PROGRESS_MIN else "too long")
    assert below.delta_check == "cannot tell"


def test_a_mean_without_per_example_losses_cannot_tell():
    """A midway (or snapshot) loss given as a number has no spread to bound r: cannot tell,
    however clear the point estimate, and it says what would."""
    snap, mid, end = _evals(np.random.default_rng(2), 0.2, sigma=0.0)
    v = judge(PLAN, snap, end, {k: end for k in PLAN.ks}, midway_losses=float(mid.mean()))
    assert v.half_progress_ratio > 0.85 and v.delta_check == "cannot tell"
    assert v.half_progress_bounds is None and v.bracket is None
    assert "Per-example held-out losses at the snapshot and at Δ/2 would tell" in v.summary


def test_the_new_state_survives_json_and_old_verdicts_read_as_they_were_judged():
    import json

    v = _judge(*_evals(np.random.default_rng(5), X_MIN))
    back = TrialVerdict.from_dict(json.loads(json.dumps(v.to_dict())))
    assert back == v and back.summary == v.summary
    for check in ("too long", "fine"):
        x = 4.0 if check == "too long" else 0.2
        old = _judge(*_evals(np.random.default_rng(3), x, n=512, sigma=0.003)).to_dict()
        for new in ("half_progress_bounds", "delta_check", "examples_to_tell"):
            del old[new]
        loaded = TrialVerdict.from_dict(old)
        assert loaded.delta_check == check and loaded.half_progress_bounds is None
    unjudged = _judge(*_evals(np.random.default_rng(3), 0.2, sigma=0.003)).to_dict()
    unjudged["half_progress_ratio"] = None
    del unjudged["delta_check"]
    assert TrialVerdict.from_dict(unjudged).delta_check == "not judged"


def test_the_card_words_a_trial_that_cannot_tell():
    """With no lower bound above 0 no branch is judged; with one, each is, at its tolerance."""
    from rampwatch.dashboard.recommend import TrialView

    rng = np.random.default_rng(4)
    end = rng.gamma(2.0, 1.0, 256) + 2.0
    p1 = rng.normal(0.0, 0.05, 256)
    mid = end + 0.01 + rng.normal(0.0, 0.001, 256)
    v = _judge(mid + p1 + 0.002 - p1.mean(), mid, end)  # r̂ > 3, bounded neither way
    view = TrialView(trial=None, verdict=v)
    assert view.bracket_text is None and not v.judged
    rows = {r["result"] for r in view.branch_rows()}
    assert rows == {"not judged: cannot tell whether Δ is too long"}
    judged = TrialView(trial=None, verdict=_judge(*_evals(np.random.default_rng(5), 0.6)))
    assert {r["result"] for r in judged.branch_rows()} == {"pass"}


def test_a_first_half_not_clearly_positive_cannot_tell_however_large_the_ratio():
    """p̄1 > 0 but within its noise: r may be anything, negative included (Fieller's set on the
    whole line is two rays), so no bound holds either way, though r̂ is far above the threshold;
    the batch named is the one at which p̄1 itself would be significant."""
    rng = np.random.default_rng(4)
    n = 256
    end = rng.gamma(2.0, 1.0, n) + 2.0
    p1 = rng.normal(0.0, 0.05, n)
    p1 += 0.002 - p1.mean()  # mean 0.002, standard error 0.003
    mid = end + 0.01 + rng.normal(0.0, 0.001, n)  # p2: 0.01, clearly positive
    v = _judge(mid + p1, mid, end)
    assert v.half_progress_ratio > 3 and v.half_progress_bounds == (None, None)
    assert v.delta_check == "cannot tell" and v.bracket is None
    need = ((1.645 + NormalDist().inv_cdf(TELL_POWER)) * p1.std(ddof=1) / p1.mean()) ** 2
    assert need < v.examples_to_tell < 1.1 * need
    assert "95% bounds −∞ to ∞" in v.summary


def test_a_second_half_that_surely_lost_ground_is_too_long():
    """p̄2 clearly below 0 with p̄1 clearly above: the whole set is negative, so surely too long
    (the [0, ∞) reading of the noise scale's interval would have bounded it above 0 instead)."""
    rng = np.random.default_rng(6)
    end = rng.gamma(2.0, 1.0, 256) + 2.0
    mid = end - 0.02 + rng.normal(0.0, 0.01, 256)  # the loss rose by 0.02 in the second half
    v = _judge(mid + 0.05 + rng.normal(0.0, 0.01, 256), mid, end)
    lo, hi = v.half_progress_bounds
    assert lo < v.half_progress_ratio < hi < 0 and v.delta_check == "too long"
