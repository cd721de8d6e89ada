"""advisor.trial_delta: a trial's default Δ from the run's loss curve against known answers. On
an exponential loss with known τ (noise-free and with training-loss noise) the time scale is
found and the Δ chosen gives the control a half-progress ratio, computed on the true curve, near
the target and above HALF_PROGRESS_MIN; on a power law the time scale is the slope's, t/(α+1),
and errs short; a flat, rising or short history gives the default with the reason; bounds and
rounding; the bounded history that rides in a resume's state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rampwatch.advisor import trial_delta as td
from rampwatch.advisor.trial import HALF_PROGRESS_MIN, delta_over_tau, half_progress_ratio_at
from rampwatch.advisor.trial_delta import (
    TARGET_HALF_PROGRESS,
    LossHistory,
    choose_delta,
    loss_time_scale,
)

STEP = 2048  # tokens per step, the demo's 8 × 256
TOKENS = np.arange(1, 401) * STEP  # 400 steps
FLOOR, CEILING = 16 * STEP, 128 * STEP


def _exp(t, tau, amplitude=1.0):
    return 1.5 + amplitude * np.exp(-t / tau)


def _true_ratio(curve, t0: float, delta: float) -> float:
    """The control's half-progress ratio on the noise-free curve from t0 (what the trial sees)."""
    a, b, c = curve(t0), curve(t0 + delta / 2), curve(t0 + delta)
    return (b - c) / (a - b)


def test_the_exponential_model_runs_both_ways():
    for r in (0.3, HALF_PROGRESS_MIN, 0.8, 0.99):
        assert half_progress_ratio_at(delta_over_tau(r)) == pytest.approx(r, rel=1e-12)
    assert delta_over_tau(HALF_PROGRESS_MIN) == pytest.approx(0.794, abs=1e-3)  # Δ ≤ 0.79·τ
    assert half_progress_ratio_at(0.0) == 1.0


@pytest.mark.parametrize("tau_steps", [80, 150, 300])
def test_a_noise_free_exponential_gives_its_tau_and_the_target_ratio(tau_steps):
    tau = tau_steps * STEP
    scale = loss_time_scale(TOKENS, _exp(TOKENS, tau))
    assert scale.tau_tokens == pytest.approx(tau, rel=0.06)  # the grid's spacing
    choice = choose_delta(TOKENS, _exp(TOKENS, tau), FLOOR, CEILING, unit=4 * STEP)
    assert choice.basis == "loss curve" and choice.tokens % (4 * STEP) == 0
    r = _true_ratio(lambda t: _exp(t, tau), TOKENS[-1], choice.tokens)
    assert r == pytest.approx(TARGET_HALF_PROGRESS, abs=0.03)
    assert choice.expected_ratio == pytest.approx(r, abs=0.03)


def test_with_training_loss_noise_the_chosen_delta_keeps_the_ratio_above_the_minimum():
    """σ = 0.05 per step (the amplitude is 1): over 50 seeds the true ratio at the chosen Δ is
    at least HALF_PROGRESS_MIN in ≥ 95% (τ is a lower bound), its median between the target and
    0.9 (not so short that the trial learns nothing)."""
    tau = 150 * STEP
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(50):
        losses = _exp(TOKENS, tau) + rng.normal(0.0, 0.05, TOKENS.size)
        choice = choose_delta(TOKENS, losses, 4 * STEP, 10**9, unit=4 * STEP)
        assert choice.basis == "loss curve", choice.note
        ratios.append(_true_ratio(lambda t: _exp(t, tau), TOKENS[-1], choice.tokens))
    ratios = np.array(ratios)
    assert np.mean(ratios >= HALF_PROGRESS_MIN) >= 0.95
    assert TARGET_HALF_PROGRESS <= np.median(ratios) <= 0.9


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_a_power_law_gives_the_slopes_time_scale_and_errs_short(alpha):
    """L = L∞ + A·t^−α: the slope's e-folding time at t is t/(α+1); the true ratio at the chosen
    Δ is at or above the target (τ grows along Δ)."""

    def curve(t):
        return 1.5 + 40.0 * (t / STEP) ** -alpha

    scale = loss_time_scale(TOKENS, curve(TOKENS))
    assert scale.tau_tokens == pytest.approx(TOKENS[-1] / (alpha + 1), rel=0.06)
    choice = choose_delta(TOKENS, curve(TOKENS), FLOOR, 10**9)
    r = _true_ratio(curve, TOKENS[-1], choice.tokens)
    assert TARGET_HALF_PROGRESS - 0.01 <= r <= 0.9


def test_a_straight_line_has_no_bend_and_takes_the_cap():
    choice = choose_delta(TOKENS, 3.0 - 1e-7 * TOKENS, FLOOR, CEILING)
    assert (choice.tokens, choice.basis, choice.tau_tokens) == (CEILING, "loss curve", math.inf)
    assert "(its cap)" in choice.note and "no bend" in choice.note
    assert json.loads(json.dumps(choice.to_dict()))["tau_tokens"] is None  # JSON: no infinity


def test_a_curve_that_flattened_long_ago_takes_the_floor():
    tau = 5 * STEP  # flat for most of the window: the fit sees only its start, or nothing
    choice = choose_delta(TOKENS[:60], _exp(TOKENS[:60], tau, 30.0), FLOOR, CEILING)
    assert choice.tokens == FLOOR and "(its floor)" in choice.note


@pytest.mark.parametrize(
    "losses, why",
    [
        (np.full(400, 2.0) + np.random.default_rng(1).normal(0, 0.1, 400), "did not fall"),
        (1.0 + 1e-6 * TOKENS, "did not fall"),  # rising
        (_exp(TOKENS[:30], 100 * STEP), "32 needed"),  # 30 steps: 23 in the window
    ],
)
def test_no_time_scale_gives_the_default_and_says_why(losses, why):
    t = TOKENS[: len(losses)]
    choice = choose_delta(t, losses, FLOOR, CEILING)
    assert (choice.tokens, choice.basis, choice.tau_tokens) == (CEILING, "default", None)
    assert why in choice.note and choice.note.startswith("The default Δ")


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="floor <= ceiling"):
        choose_delta(TOKENS, _exp(TOKENS, 100 * STEP), CEILING, FLOOR)


def test_the_history_is_bounded_spans_the_run_and_survives_json():
    h = LossHistory()
    n = 5 * td.HISTORY_POINTS
    for i in range(1, n + 1):
        h.add(i * STEP, 5.0 / i)
    h.add((n + 1) * STEP, math.nan)  # a non-finite step is no point
    assert len(h) <= td.HISTORY_POINTS and h.stride > 1
    assert h.tokens[-1] > (n - h.stride) * STEP and h.tokens[0] <= n * STEP * 0.05  # the run
    assert h.tokens == sorted(h.tokens) and len(set(h.tokens)) == len(h)
    back = LossHistory.from_dict(json.loads(json.dumps(h.to_dict())))
    assert (back.tokens, back.losses, back.stride) == (h.tokens, h.losses, h.stride)


def test_a_resume_from_an_earlier_step_drops_the_points_after_it():
    h = LossHistory(tokens=[STEP * i for i in range(1, 11)], losses=[1.0] * 10)
    h.add(6 * STEP, 2.0)  # the run resumed at step 5 and logged step 6 again
    assert h.tokens == [STEP * i for i in range(1, 7)] and h.losses[-1] == 2.0


@pytest.mark.parametrize("tau", [3_000.0, 20_000.0])
def test_a_retry_aims_the_ratio_at_the_target_from_the_trials_own_ratio(tau):
    """A control of Δ on an exponential shows r = exp(−Δ/2τ): the retry's Δ puts r at 0.8."""
    delta = 40_960
    r = half_progress_ratio_at(delta / tau)
    choice = td.retry_choice(delta, r, floor=1, unit=1, why="trial 3 judged nothing: ")
    assert choice.basis == "retry" and choice.tau_tokens == pytest.approx(tau)
    assert half_progress_ratio_at(choice.tokens / tau) == pytest.approx(0.8, abs=1e-3)
    assert choice.expected_ratio == pytest.approx(0.8, abs=1e-3)
    assert choice.note.startswith(f"trial 3 judged nothing: once more at Δ {choice.tokens:,}")
    json.dumps(choice.to_dict())  # a checkpoint's state


def test_a_retry_keeps_delta_when_the_noise_hid_the_answer_and_quarters_a_flat_half():
    assert td.retry_choice(4096, 0.95, floor=1, unit=1).tokens == 4096  # r̂ above the target
    assert td.retry_choice(4096, None, floor=1, unit=1).tokens == 4096  # no ratio measured
    assert td.retry_choice(4096, -0.2, floor=1, unit=1).tokens == 1024  # no second-half progress
    # at least the floor, in whole units
    assert td.retry_choice(4096, 0.01, floor=1000, unit=96).tokens == 1056
