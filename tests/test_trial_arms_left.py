"""A trial runs an arm only while its result could change the verdict (advisor/trial.py
`arms_left`): on random held-out losses in every mode of the Δ check, the verdict on the arms a
trial would run equals the verdict on all of them (k*, bracket, kept arm, the "no" a retry keeps)
and costs only the arms run; judge refuses a short list where a missing arm could matter; a real
trial whose ×2 fails runs no ×4 or ×8, costs one Δ, and the card says which arms did not run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rampwatch.advisor.trial import TrialPlan, arms_left, failed_factor, judge
from rampwatch.dashboard.recommend import TrialView
from rampwatch.monitor.trial_runner import run_trial
from tests.test_trial_protocol import _data, _train_step

PLAN = TrialPlan.for_optimizer("adamw", batch=4, ks=(2, 4, 8), delta_tokens=4 * 8 * 10)


def _losses(rng, n=200):
    """The held-out losses of one trial at random: the control's progress (none, some, much),
    its half-progress ratio around the threshold with a spread that tells or does not, and
    branches around their tolerances."""
    control = rng.gamma(2.0, 1.0, n)
    progress = rng.choice([-0.02, 0.01, 0.05, 0.2])
    ratio = rng.choice([0.1, 0.5, 0.66, 0.7, 0.9, 1.0])
    first = progress / (1 + ratio)
    noise = rng.choice([0.001, 0.02, 0.1])
    midway = control + progress - first + rng.normal(0, noise, n)
    snapshot = control + progress + rng.normal(0, noise, n)
    branches = {
        k: control
        + rng.uniform(-0.5, 1.5) * (k - 1) / (2 * k) * abs(progress)
        + rng.normal(0, rng.choice([0.001, 0.01, 0.05]), n)
        for k in PLAN.ks
    }
    return snapshot, midway, control, branches


def _sequential(snapshot, midway, control, branches, cap):
    """The branches a trial runs: in order, while `arms_left` names the next."""
    ran = {}
    for k in PLAN.ks:
        so_far = judge(PLAN, snapshot, control, ran, None, midway, cap, partial=True)
        if k not in arms_left(so_far):
            break
        ran[k] = branches[k]
    return ran


def test_the_arms_a_trial_skips_never_change_its_verdict():
    rng = np.random.default_rng(7)
    seen = {"check": set(), "lower bound": 0, "no progress": 0, "skipped": 0, "all": 0}
    for _ in range(3000):
        snapshot, midway, control, branches = _losses(rng)
        cap = rng.choice([None, None, 2, 4, 8])
        full = judge(PLAN, snapshot, control, branches, None, midway, cap)
        ran = _sequential(snapshot, midway, control, branches, cap)
        short = judge(PLAN, snapshot, control, ran, None, midway, cap)
        assert (short.k_star, short.bracket, short.kept_k, short.delta_check) == (
            full.k_star,
            full.bracket,
            full.kept_k,
            full.delta_check,
        )
        assert failed_factor(short) == failed_factor(full)
        assert short.cost_tokens == len(ran) * PLAN.delta_tokens <= full.cost_tokens
        assert short.not_run == PLAN.ks[len(ran) :]
        assert [b for b in full.branches if b.k in ran] == list(short.branches)
        for k in short.not_run:  # the card's reason: the cap, the control, or a failure
            capped = cap is not None and k >= cap
            why = short.not_run_reason(k)
            assert ("nothing from" in why, "did not improve" in why) == (
                capped,
                not capped and short.progress <= 0,
            )
        seen["check"].add(full.delta_check)
        seen["lower bound"] += full.tolerance_ratio is not None
        seen["no progress"] += full.progress <= 0
        seen["skipped"] += len(ran) < len(PLAN.ks)
        seen["all"] += len(ran) == len(PLAN.ks)
    # every mode was met, and the rule both skipped and ran everything often
    assert seen["check"] == {"fine", "too long", "cannot tell", "not judged"}
    assert min(seen["lower bound"], seen["no progress"]) >= 50
    assert min(seen["skipped"], seen["all"]) >= 300


def test_judge_refuses_missing_arms_that_could_change_the_verdict():
    control = np.random.default_rng(0).gamma(2.0, 1.0, 100)
    passing = {2: control + 0.001}  # ×2 passes: ×4 could raise k*
    with pytest.raises(ValueError, match=r"lacks \[4, 8\], whose arms could still change"):
        judge(PLAN, control + 0.1, control, passing)
    with pytest.raises(ValueError, match="in order, from the first"):
        judge(PLAN, control + 0.1, control, {4: control})
    failing = judge(PLAN, control + 0.1, control, {2: control + 0.05})  # fails its 0.025
    assert (failing.k_star, failing.bracket, failing.not_run) == (None, (None, 8), (4, 8))
    assert "×2 fail, ×4 not run, ×8 not run" in failing.summary
    assert "Cost: 320 tokens" in failing.summary


def test_a_trial_whose_first_branch_fails_runs_no_other_and_costs_one_delta():
    """Noise-free least squares, the LR not scaled: ×2 makes half the control's steps at its LR,
    about half its progress, and fails; ×4 and ×8 cannot pass after it and are not run."""
    x, y = _data(4000, 1)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1)  # no noise: every batch's gradient is the same
    plan = TrialPlan(batch=4, ks=(2, 4, 8), delta_tokens=4 * 8 * 4, rule="none")
    ran = []

    def trial(keep=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0005)
        on_arm = (lambda k, losses: ran.append(k)) if keep is None else None
        evaluate = lambda m: ((m(x[-64:]) - y[-64:]) ** 2).squeeze(1)  # noqa: E731
        return run_trial(
            plan, model, opt, _train_step(x, y), evaluate, on_arm=on_arm, keep=keep
        ), model

    (verdict, _), model = trial()
    assert ran == [1, 2]
    assert verdict.delta_check == "fine" and not verdict.branches[0].passed
    assert verdict.not_run == (4, 8) and verdict.cost_tokens == plan.delta_tokens
    (_, every_arm), _ = trial(keep=8)  # keep runs every arm up to its own
    full = judge(plan, every_arm[0], every_arm[1], {k: every_arm[k] for k in plan.ks},
                 None, every_arm["midway"])  # fmt: skip
    assert (full.k_star, full.bracket, full.cost_tokens) == (None, (None, 8), 3 * plan.delta_tokens)
    assert (verdict.k_star, verdict.bracket) == (full.k_star, full.bracket)
    view = TrialView(trial=None, verdict=verdict)
    rows = view.branch_rows()
    assert [r["result"] for r in rows] == ["fail", "not run", "not run"]
    why = "not run: ×2 fell behind the control by more than its tolerance, so no larger branch"
    lines = view.not_run_lines()
    assert len(lines) == 2 and all(
        line.startswith(f"×{k} {why}") for k, line in zip((4, 8), lines, strict=True)
    )
