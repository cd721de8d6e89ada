"""advisor/schedule.py against closed forms: a noise scale that is exactly B = A·T^α projects
ramps at T_k = (ramp point of batch_k / A)^(1/α); a trial's calibration c moves them to
(ramp point / (c·A))^(1/α), where the ramp point is ×factor (read as the critical batch); steps
are whole steps of each batch to the budget, hours the throughput model's step times."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rampwatch.advisor import schedule as S
from rampwatch.advisor.advice import RunningTier, TrialEvidence, advise, memory_evidence
from rampwatch.advisor.memory import GB
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.throughput import MeasuredSpeed, ThroughputModel
from rampwatch.advisor.tier_table import tier_rows
from rampwatch.advisor.tiers import Tier

SEQ = 128
RUNNING = Tier(8, 2, 1)  # 16 sequences, 2,048 tokens a step
STEP_TOKENS = RUNNING.batch * SEQ
NOW = 400 * STEP_TOKENS  # 819,200 tokens: 400 steps done
ALPHA = 0.5
A = 14.4 / math.sqrt(NOW)  # the noise scale is 14.4 now, below the batch of 16
BUDGET = 25 * NOW
HISTORY = STEP_TOKENS * np.arange(1, 401, dtype=np.float64)  # tokens seen after each step


def _advice(trial=None, capacity=80 * GB, infeasible=(), gns=None, **policy):
    plan = [
        {"per_device_batch": b, "predicted_bytes": (10 + 2 * b) * GB, "step": 0}
        for b in (4, 8, 16, 32, 64)
    ]
    plan += [{"per_device_batch": b, "feasible": False} for b in infeasible]
    return advise(
        RampPolicy(original_batch=16, original_lr=1e-3, **policy),
        RunningTier(RUNNING, SEQ, capacity),
        *(gns or ([1, 2, 3], [5.0, 5.0, 5.0])),
        None,
        memory_evidence(plan, "plain"),
        None,
        trial=trial,
    )


def _law(t):
    return A * np.asarray(t, np.float64) ** ALPHA


def _crossing(noise_scale):
    """Where A·T^α reaches a noise scale: the closed form."""
    return (noise_scale / A) ** (1 / ALPHA)


def _starts(s: S.Schedule):
    return [seg.start_tokens for seg in s.segments]


def _steps(starts, batches):
    """Whole steps of each batch from now until the next start is passed, the last to the budget."""
    cursor, out = NOW, []
    for i, b in enumerate(batches):
        end = starts[i + 1] if i + 1 < len(starts) else BUDGET
        n = math.ceil((end - cursor) / (b * SEQ))
        out.append(n)
        cursor += n * b * SEQ
    return out


def test_a_power_law_noise_scale_ramps_where_the_closed_form_says():
    advice = _advice()
    proj, why = S.project(advice, None, HISTORY, _law(HISTORY), NOW, BUDGET)
    assert proj is not None, why
    assert proj.law.slope == pytest.approx(ALPHA, abs=1e-9)
    assert proj.law.value(NOW) == pytest.approx(14.4, rel=1e-9)
    # ramp ×2 each time A·T^α reaches 1 × the batch (ramp_at 1): 16, then 32, then 64
    expected = [NOW, _crossing(16), _crossing(32), _crossing(64)]
    assert _crossing(64) < BUDGET < _crossing(128)  # three ramps fall within the budget
    central = proj.central
    assert _starts(central) == pytest.approx(expected, rel=1e-9)
    assert [seg.batch for seg in central.segments] == [16, 32, 64, 128]
    assert [seg.tier for seg in central.segments] == [
        RUNNING,
        advice.option_for(2).tier,
        advice.option_for(4).tier,
        advice.option_for(8).tier,
    ]
    assert central.steps == tuple(_steps(expected, [16, 32, 64, 128]))
    # an exact power law has no slope error: the early and late projections are the central one
    assert proj.law.slope_se == pytest.approx(0, abs=1e-9)
    assert _starts(proj.early) == pytest.approx(expected) and _starts(proj.late) == pytest.approx(
        expected
    )
    # the constant batch: steps left as the tier table counts them
    const = S.constant(advice, None, NOW, BUDGET)
    [now_row] = [r for r in tier_rows(advice, None, NOW, BUDGET) if r.kind == "now"]
    assert const.steps_left == now_row.steps_left == (BUDGET - NOW) // STEP_TOKENS
    steps_saved, seconds_saved = central.saved(const)
    assert steps_saved == const.steps_left - sum(_steps(expected, [16, 32, 64, 128]))
    assert seconds_saved is None and central.seconds_left is None  # nothing timed: unknown
    assert "no step of this run was timed yet" in central.notes


def test_a_trial_s_calibration_moves_the_ramps_to_the_critical_batch():
    c = 4.0
    advice = _advice(trial=TrialEvidence(7, 300, c, True))
    proj, _ = S.project(advice, None, HISTORY, _law(HISTORY), NOW, BUDGET)
    # read as the critical batch: ramp when c·B ≥ factor × ramp_at × batch, i.e. B ≥ batch / 2
    assert (proj.calibration, proj.critical) == (c, True)
    ramp = [advice.policy.ramp_point(b, critical=True) / c for b in (16, 32, 64)]
    assert ramp == [8, 16, 32]
    assert _crossing(8) < NOW  # due already: the run ramps now, so its first segment is ×2
    assert _starts(proj.central) == pytest.approx([NOW, _crossing(16), _crossing(32)], rel=1e-9)
    assert [seg.batch for seg in proj.central.segments] == [32, 64, 128]
    assert any("calibration of trial 7" in n for n in proj.notes)


def test_the_trial_gate_reads_the_uncalibrated_noise_scale_as_the_noise_gate_does():
    """Before a trial, B_simple is about half the critical batch (the policy's band): the trial
    gate's projection is the noise gate's, ramps where B reaches 1 × the batch."""
    trial, noise = (
        S.project(_advice(gate=gate), None, HISTORY, _law(HISTORY), NOW, BUDGET)[0]
        for gate in ("trial", "noise")
    )
    assert (trial.calibration, trial.critical) == (None, False)
    expected = [NOW, _crossing(16), _crossing(32), _crossing(64)]
    assert _starts(trial.central) == _starts(noise.central) == pytest.approx(expected, rel=1e-9)


def test_the_range_ramps_early_on_the_steep_slope_and_late_on_the_flat_one():
    rng = np.random.default_rng(3)
    noisy = _law(HISTORY) * np.exp(0.05 * rng.standard_normal(HISTORY.size))
    proj, _ = S.project(_advice(), None, HISTORY, noisy, NOW, BUDGET)
    law = proj.law
    assert law.n == np.count_nonzero(HISTORY >= S.FIT_FROM * NOW)  # the last two doublings
    assert law.slope_se > 0 and abs(law.slope - ALPHA) < 4 * law.slope_se
    early, central, late = (_starts(s)[1:] for s in (proj.early, proj.central, proj.late))
    assert len(early) >= len(central) >= 1
    for e, c in zip(early, central, strict=False):
        assert e < c
    for c, lt in zip(central, late, strict=False):
        assert c < lt
    # each is a power law through the fit's centre with the slope ± Z SE: its own closed form
    z_slope = law.slope + S.Z * law.slope_se
    first = math.exp(law.x0 + (math.log(16) - law.y0) / z_slope)
    assert early[0] == pytest.approx(first, rel=1e-9)


def test_given_the_run_s_step_the_first_ramp_is_where_the_card_times_it():
    """The card's calibrated forecast of the crossing, not the law's: the law's own first
    crossing held for 6% of queries on recorded runs, the card's range for 88% (README,
    "Forecast coverage"). The law, moved through that ramp, times the ones after it."""
    steps = np.arange(400)  # step s saw HISTORY[s] tokens by its end
    advice = _advice(gns=(steps, _law(HISTORY)))
    d = advice.decision
    assert not d.ready and d.forecast_step is not None and d.forecast_range is not None
    proj, why = S.project(advice, None, HISTORY, _law(HISTORY), NOW, BUDGET, now_step=399)
    assert proj is not None, why

    def tokens(step):
        return NOW + (step - 399) * STEP_TOKENS

    first = proj.first
    assert (first.point, first.early, first.late) == (
        tokens(d.forecast_step),
        tokens(d.forecast_range[0]),
        tokens(d.forecast_range[1]),
    )
    assert first.point != pytest.approx(_crossing(16), rel=0.01)  # not where the law puts it
    # after it, the law (slope α exactly) through (first ramp, 16): 32 at 2^(1/α) × its tokens
    assert _starts(proj.central)[:3] == pytest.approx(
        [NOW, first.point, first.point * 2 ** (1 / ALPHA)], rel=1e-9
    )
    assert _starts(proj.early)[1] == first.early and _starts(proj.late)[1] == first.late
    assert first.note.startswith(f"first ramp at the card's forecast, step {d.forecast_step:,}")
    # a card that says ramp now (43.2: past the ramp points of 16 and 32, short of 64's): the
    # first ramp now, and the law as fitted after it, which has passed 32's too: ×4 now
    now = S.project(
        _advice(gns=(steps, 3 * _law(HISTORY))),
        None,
        HISTORY,
        3 * _law(HISTORY),
        NOW,
        BUDGET,
        now_step=399,
    )[0]
    assert now.first.point == NOW and [g.batch for g in now.central.segments][:2] == [64, 128]
    assert now.central.segments[1].start_tokens == pytest.approx(_crossing(64 / 3), rel=1e-9)
    # without the run's step: the law alone
    assert S.project(advice, None, HISTORY, _law(HISTORY), NOW, BUDGET)[0].first is None
    # no forecast on the card (3 estimates of the 30 it needs, no streak): the law's ramp, but
    # not before the card could say ramp now (27 estimates on: step 426), though the law (43.2
    # now) says now; with 30 estimates, when its streak of 20 could complete (step 419)
    for law, where in ((_law(HISTORY), _crossing(16)), (3 * _law(HISTORY), tokens(426))):
        p = S.project(_advice(), None, HISTORY, law, NOW, BUDGET, now_step=399)[0]
        assert p.first.floor and p.first.point == tokens(426)
        assert p.first.note.startswith("first ramp no sooner than step 426")
        assert _starts(p.central)[1] == pytest.approx(where, rel=1e-9)
    flat = _advice(gns=(np.arange(370, 400), np.full(30, 5.0)))  # 30 estimates, none above
    assert flat.decision.forecast_step is None
    p = S.project(flat, None, HISTORY, 3 * _law(HISTORY), NOW, BUDGET, now_step=399)[0]
    assert p.first.floor and p.first.point == tokens(419) == _starts(p.central)[1]


def test_the_ladder_ends_at_rampmaxfactor_or_where_a_tier_does_not_fit():
    tiers, note = S.ramp_ladder(_advice())
    assert [t.batch for t in tiers] == [32, 64, 128] and "at most ×8" in note
    tiers, note = S.ramp_ladder(_advice(factor=4))  # ×16 would be past RAMP_MAX_FACTOR
    assert [t.batch for t in tiers] == [64] and "at most ×4" in note
    # the running per-device batch ran out of memory: no tier of the ladder fits
    tiers, note = S.ramp_ladder(_advice(infeasible=(8,), capacity=10 * GB))
    assert tiers == [] and note.startswith("the projection stops below ×2: it does not fit")
    proj, _ = S.project(
        _advice(infeasible=(8,), capacity=10 * GB), None, HISTORY, _law(HISTORY), NOW, BUDGET
    )
    assert [seg.batch for seg in proj.central.segments] == [16]


def test_a_noise_scale_that_does_not_grow_projects_no_ramp():
    flat = np.full(HISTORY.size, 9.0) * (1 - 1e-4 * np.arange(HISTORY.size))
    proj, _ = S.project(_advice(), None, HISTORY, flat, NOW, BUDGET)
    assert proj.law.slope < 0
    assert [seg.batch for seg in proj.central.segments] == [16]
    assert proj.central.steps_left == S.constant(_advice(), None, NOW, BUDGET).steps_left


def test_a_noise_scale_that_barely_grows_projects_no_ramp_and_does_not_overflow():
    """A slope of 1e-4 puts the ramp point at e^(log 2 / 1e-4) tokens: past any float."""
    barely = 9.0 * (HISTORY / HISTORY[0]) ** 1e-4
    proj, why = S.project(_advice(), None, HISTORY, barely, NOW, BUDGET)
    assert proj is not None, why
    assert 0 < proj.law.slope < 1e-3 and proj.law.reaches(16, NOW) == math.inf
    assert [seg.batch for seg in proj.central.segments] == [16]


def test_too_few_estimates_give_no_projection_and_say_why():
    recent = HISTORY[-5:]
    proj, why = S.project(_advice(), None, recent, _law(recent), NOW, BUDGET)
    assert proj is None
    assert (
        why
        == "the projection needs 10 noise-scale estimates since 25% of the tokens seen (5 so far)"
    )


def test_hours_are_the_throughput_model_s_step_times():
    advice = _advice()
    tiers = [RUNNING] + [advice.option_for(f).tier for f in (2, 4, 8)]
    tps = {t: 40_000.0 + 1_000 * i for i, t in enumerate(tiers)}  # measured at every tier
    speeds = ThroughputModel.fit({t: MeasuredSpeed(t, v, None, 50) for t, v in tps.items()}, SEQ, 1)
    proj, _ = S.project(advice, speeds, HISTORY, _law(HISTORY), NOW, BUDGET)
    s = proj.central
    expected = sum(
        n * seg.batch * SEQ / tps[seg.tier] for n, seg in zip(s.steps, s.segments, strict=True)
    )
    assert s.seconds_left == pytest.approx(expected, rel=1e-12)
    const = S.constant(advice, speeds, NOW, BUDGET)
    [now_row] = [r for r in tier_rows(advice, speeds, NOW, BUDGET) if r.kind == "now"]
    assert const.seconds_left == pytest.approx(now_row.eta_s, rel=1e-12)  # the tier table's ETA
    assert s.saved(const)[1] == pytest.approx(const.seconds_left - expected, rel=1e-12)


def test_tier_for_a_batch_is_advise_s_tier_for_its_factor_or_says_why_none():
    advice = _advice()
    assert S.tier_for(advice, 16).tier == RUNNING
    assert S.tier_for(advice, 64).tier == advice.option_for(4).tier
    assert S.tier_for(advice, 48).tier == advice.option_for(3).tier  # a factor not offered
    none = S.tier_for(advice, 24)
    assert none.tier is None and "neither a whole factor up to ×8 of the running 16" in none.note
    assert S.tier_for(advice, 256).tier is None  # ×16: past RAMP_MAX_FACTOR
