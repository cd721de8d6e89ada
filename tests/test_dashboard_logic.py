"""The dashboard's pure parts: debiased EMA, the recommendation built from store rows over
advisor/, the compare arithmetic, option parsing, and the chart builders' contracts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from rampwatch.advisor.memory import GB
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.ramp_point import predicted_effect
from rampwatch.dashboard import charts, comparison, recommend
from rampwatch.dashboard.buckets import Buckets
from rampwatch.dashboard.smoothing import debiased_ema, first_crossing
from rampwatch.dashboard.store_access import parse_options
from rampwatch.store import names as M

# ------------------------------------------------------------------------------- smoothing


def test_debiased_ema_starts_at_first_value_and_skips_nan():
    out = debiased_ema([4.0, np.nan, 2.0, np.inf], 0.5)
    assert out[0] == 4.0  # bias-corrected: not pulled towards 0
    assert out[1] == 4.0  # NaN keeps the average
    # second finite value: (0.5·0.5·4 + 0.5·2) / (1 − 0.25) with the correction
    assert out[2] == pytest.approx((0.25 * 4 + 0.5 * 2) / 0.75)
    assert out[3] == out[2]
    assert np.isnan(debiased_ema([np.nan, 1.0], 0.9)[0])


def test_debiased_ema_weight_zero_is_identity_and_counts_decay_per_step():
    v = np.array([3.0, 1.0, 2.0])
    np.testing.assert_array_equal(debiased_ema(v, 0.0), v)
    # a bucket standing for 4 steps decays like 4 single steps of the same value
    a = debiased_ema([1.0, 5.0], 0.9, counts=[1, 4])
    b = debiased_ema([1.0, 5.0, 5.0, 5.0, 5.0], 0.9)
    assert a[-1] == pytest.approx(b[-1])
    with pytest.raises(ValueError):
        debiased_ema(v, 1.0)


def test_first_crossing():
    assert first_crossing([3, np.nan, 2.5, 2.0], 2.5) == 2
    assert first_crossing([3, 4], 2.5) is None


# -------------------------------------------------------------------------- recommendation

RUN = {
    "run_id": "r1",
    "world_size": 1,
    "capacity_bytes": 80 * GB,
    "config": {
        "optimizer": "adamw",
        "lr": 1e-3,
        "per_device_batch": 8,
        "accum": 2,
        "world_size": 1,
        "seq_len": 128,
        "model": {"chunked_ce": False},
    },
}
LATEST = {M.PER_DEVICE_BATCH: 8, M.ACCUM: 2, M.BATCH_SEQS: 16}
PLAN = [
    {
        "step": 0,
        "per_device_batch": b,
        "variant": "plain",
        "predicted_bytes": (10 + 2 * b) * GB,
        "measured_bytes": None,
        "source": "plan",
        "feasible": None,
    }
    for b in (4, 8, 16, 32, 64)
]


def _gns(above: bool, n: int = 300):
    steps = list(range(n))
    return steps, [40.0 if above else 5.0 + 0.001 * s for s in steps]


def test_an_unknown_optimizer_is_noted_only_when_no_recorded_policy_names_the_rule():
    config = {**RUN["config"], "optimizer": "DistAdamW"}
    card = recommend.build_card({**RUN, "config": config}, LATEST, *_gns(True), [], PLAN)
    assert any("optimizer 'DistAdamW': the sqrt rule is assumed" in n for n in card.notes)
    policy = RampPolicy(original_batch=16, original_lr=1e-3, lr_rule="linear").to_config()
    config = {**config, "ramp_policy": policy}  # Monitor.start(..., lr_rule="linear")
    card = recommend.build_card({**RUN, "config": config}, LATEST, *_gns(True), [], PLAN)
    assert not any("DistAdamW" in n for n in card.notes), card.notes
    assert card.suggested.payload()["lr_multiplier"] == pytest.approx(2.0)


def test_card_ready_with_tiers_lr_and_effect():
    card = recommend.build_card(RUN, LATEST, *_gns(True), [], PLAN)
    assert card.decision.ready and card.current.batch == 16
    assert [t.option.factor for t in card.tiers] == [2, 4, 8]
    x2 = card.suggested
    # 32 x 1 fits (74 GB <= 76 GB usable) but on one device it would measure no noise scale:
    # the policy keeps accumulation 2 and the table says what the faster tier would cost
    assert (x2.option.tier.per_device_batch, x2.option.tier.accum) == (16, 2)
    assert x2.option.tier.measures_noise
    assert "32 × 1 would fit too but measures no noise scale" in x2.option.reason
    assert x2.predicted_bytes == 42 * GB and x2.fits
    assert x2.payload() == {
        "per_device_batch": 16,
        "accum": 2,
        "lr_multiplier": pytest.approx(math.sqrt(2)),
    }
    assert x2.new_base_lr == pytest.approx(1e-3 * math.sqrt(2))
    assert x2.effect == predicted_effect(16, 32, 40.0)
    assert card.memory_note == "memory model: plan (5 points)"
    assert card.key == "r1:None:16x2"


def test_card_not_ready_forecasts_and_measured_peaks_win():
    plan = PLAN + [
        {
            "step": 5,
            "per_device_batch": 8,
            "variant": "plain",
            "predicted_bytes": None,
            "measured_bytes": 30 * GB,
            "source": "measured",
            "feasible": None,
        }
    ]
    card = recommend.build_card(RUN, LATEST, *_gns(False), [], plan)
    assert not card.decision.ready
    # a trend this flat crosses further ahead than the forecast was calibrated for: no range
    assert card.decision.forecast_range is None and card.decision.forecast_step is None
    assert "no reliable forecast yet: the trend says in about" in card.decision.reason
    steps = list(range(300))
    rising = recommend.build_card(
        RUN, LATEST, steps, [5.0 * math.exp(0.003 * s) for s in steps], [], plan
    )
    lo, hi = rising.decision.forecast_range
    assert 300 <= lo < 388 < hi  # the trend crosses 16 at ln(3.2)/0.003 = 388
    assert (
        f"expected to cross between steps {lo:,} and {hi:,} (such ranges held 9 times in 10 on "
        in rising.decision.reason
    )
    assert card.memory_note == "memory model: measured peak + plan slope"
    # measured 30 GB at 8 + 2 GB/seq: 16 -> 46, 32 -> 78 > 76 usable, so x2 runs 16 x 2
    assert (card.suggested.option.tier.per_device_batch, card.suggested.option.tier.accum) == (
        16,
        2,
    )


def test_card_since_last_ramp_and_infeasible_batches():
    events = [
        {"step": 250, "kind": M.EVENT_RAMP, "message": "", "data": {}},
        {"step": 260, "kind": M.EVENT_OOM, "message": "", "data": {"per_device_batch": 16}},
    ]
    plan = PLAN + [
        {
            "step": 260,
            "per_device_batch": 32,
            "variant": "plain",
            "predicted_bytes": None,
            "measured_bytes": None,
            "source": "oom",
            "feasible": False,
        }
    ]
    run = {**RUN, "config": {**RUN["config"], "ramp_hysteresis": 50}}  # a pre-policy config key
    card = recommend.build_card(run, LATEST, *_gns(True), events, plan)
    assert card.policy.hysteresis_steps == 50 and card.last_ramp_step == 250
    assert card.decision.evidence.steps_above == 49  # hysteresis restarted at the ramp
    assert not card.decision.ready
    assert card.suggested.option.tier.per_device_batch == 8  # 16 and 32 ran out of memory
    assert card.key == "r1:250:8x4"


def test_card_without_memory_data_offers_accumulation_only():
    card = recommend.build_card(RUN, LATEST, *_gns(True), [], [])
    assert card.memory_note.startswith("no memory model yet:")
    assert [(t.option.tier.per_device_batch, t.option.tier.accum, t.fits) for t in card.tiers] == [
        (8, 4, True),
        (8, 8, True),
        (8, 16, True),
    ]


def test_card_without_tier_information():
    card = recommend.build_card({"run_id": "r", "config": {}}, {}, [], [], [], [])
    assert card.current is None and card.tiers == []
    assert "per_device_batch and accum" in card.problems[0]


def test_command_views():
    base = {
        "command_id": 7,
        "payload": {"per_device_batch": 32, "accum": 1},
        "reason": None,
        "applied_step": None,
    }
    assert (
        recommend.command_view({**base, "status": "applied", "applied_step": 1234}).text
        == "Ramp #7 to 32 per device × 1 accumulation was applied at step 1234."
    )
    v = recommend.command_view({**base, "status": "refused", "reason": "too big"})
    assert v.text.endswith("was refused: too big") and not v.open
    assert recommend.command_view({**base, "status": "pending"}).open


# --------------------------------------------------------------------------------- compare


def test_flatten_and_config_diff():
    a = {"lr": 1e-3, "model": {"d": 128, "n": 2}, "betas": [0.9, 0.95], "x": {}}
    b = {"lr": 1e-3, "model": {"d": 256, "n": 2}, "betas": [0.9, 0.99]}
    assert comparison.flatten(a) == {
        "lr": 1e-3,
        "model.d": 128,
        "model.n": 2,
        "betas": "[0.9, 0.95]",
        "x": "{}",
    }
    rows = comparison.config_diff({"A": a, "B": b})
    assert [r["key"] for r in rows] == ["betas", "model.d", "x"]
    assert rows[2] == {"key": "x", "A": "{}", "B": "—"}
    assert comparison.config_diff({"A": a, "B": dict(a)}) == []


def _buckets(steps, values, width=1):
    steps = np.asarray(steps)
    return Buckets.from_columns(
        width,
        bucket=steps // width,
        last_step=steps,
        lo=values,
        hi=values,
        last=values,
        n=np.ones(len(steps), np.int64),
    )


def test_to_target_and_critical_batch():
    rows = []
    for b in (16, 32, 64):
        s_target = 100 * (1 + 64 / b)
        steps = np.arange(1000)
        loss = 2 + 3 * np.exp(-steps / (s_target / math.log(6)))
        tok = _buckets(steps, (steps + 1.0) * b)
        rows.append(
            comparison.to_target(
                f"b{b}",
                _buckets(steps, loss),
                2.5,
                0.0,
                tok,
                _buckets(steps, np.full(1000, 0.5)),
                _buckets(steps, np.full(1000, float(b))),
            )
        )
    assert [r.step for r in rows] == [math.ceil(100 * (1 + 64 / b)) for b in (16, 32, 64)]
    assert rows[0].tokens == (rows[0].step + 1) * 16 and rows[0].seconds == pytest.approx(
        0.5 * (rows[0].step + 1)
    )
    fit = comparison.critical_batch(rows, 2.5)
    assert fit.b_crit == pytest.approx(64, rel=0.03) and fit.s_min == pytest.approx(100, rel=0.03)
    two = comparison.critical_batch(rows[:2], 2.5)
    assert two.b_crit is None and "have 2 (16, 32)" in two.message


def test_constant_batch_and_default_target():
    assert comparison.constant_batch(_buckets([0, 1], np.array([16.0, 16.0]))) == 16.0
    assert comparison.constant_batch(_buckets([0, 1], np.array([16.0, 32.0]))) is None
    assert (
        comparison.constant_batch(None, {"per_device_batch": 4, "accum": 2, "world_size": 2}) == 16
    )
    assert comparison.default_target([2.31, None, 2.4501]) == 2.451


# ---------------------------------------------------------------------------------- charts


def test_series_traces_band_line_and_nonfinite_markers():
    b = Buckets.from_columns(
        64,
        bucket=[0, 1, 2],
        last_step=[63, 127, 191],
        lo=[1.0, np.nan, 0.5],
        hi=[2.0, np.nan, 0.9],
        last=[1.5, np.nan, 0.7],
        n=[64, 64, 64],
        nonfinite=[0, 64, 1],
    )
    names = [t.name for t in charts.series_traces(b, "x", "#1f77b4")]
    assert names == ["x range", "x range", "x", "x non-finite"]
    x, y, c = charts.nonfinite_positions(b)
    assert list(x) == [127, 191] and list(y) == [1.5, 0.7] and list(c) == [64, 1]


def test_events_are_vertical_markers():
    fig = charts.grad_norm_figure(
        _buckets([0, 1, 2], np.array([1.0, 2.0, 3.0])),
        [
            {"step": 1, "kind": "ramp", "message": "m"},
            {"step": None, "kind": "alert", "message": "no step"},
        ],
    )
    shapes = [s for s in fig.layout.shapes if s.name.startswith("event:")]
    assert [(s.name, s.x0) for s in shapes] == [("event:ramp", 1)]
    assert [t.name for t in fig.data] == ["grad_norm", "events"]


def test_empty_figures_say_why():
    fig = charts.loss_figure(None, None, 0.9)
    assert fig.layout.annotations[0].text == "no loss logged yet"


# --------------------------------------------------------------------------------- options


def test_options_from_argv_then_env():
    o = parse_options(["--db", "/x/r.duckdb", "--read-only"], {})
    assert o.db == Path("/x/r.duckdb") and o.read_only and o.source == "--db"
    o = parse_options([], {"RAMPWATCH_DB": "/y.duckdb", "RAMPWATCH_READ_ONLY": "yes"})
    assert o.db == Path("/y.duckdb") and o.read_only
    o = parse_options(["-q", "tests"], {})
    assert o.db is None and not o.read_only


def test_noise_chart_breaks_at_a_stretch_without_estimates_and_labels_plainly():
    steps = [*range(1, 51), *range(121, 151)]  # no estimate at steps 51-120
    gns = Buckets.from_columns(
        1,
        bucket=steps,
        last_step=steps,
        lo=[0.002] * 80,
        hi=[30.0] * 80,
        last=[0.002] * 50 + [30.0] * 30,
        n=[1] * 80,
        nonfinite=[0] * 80,
    )
    fig = charts.noise_figure(gns, None, lower=gns, upper=gns)
    lines = [t for t in fig.data if t.name in ("noise scale (B_simple)", "90% interval")]
    assert len(lines) == 3  # the point's line and the band's two edges
    for tr in lines:
        name = tr.name
        x, y = np.asarray(tr.x, float), np.asarray(tr.y, float)
        gap = np.flatnonzero(np.isnan(y))
        assert gap.size == 1 and 50 < x[gap[0]] < 121 and not tr.connectgaps, name
    labels = fig.layout.yaxis.ticktext
    assert "0.002" in labels and "20" in labels and "50" in labels
    assert not any(u in t for t in labels for u in ("m", "µ", "k"))


def test_memory_chart_follows_the_run_when_capacity_is_far_above_it():
    """A CPU run: capacity is the host's 25 GB, the run peaks near 1 GB; the axis shows the run
    and the capacity is a note. On a GPU near capacity the capacity line stays on the axis."""
    steps = list(range(1, 11))
    peak = Buckets.from_columns(
        1,
        bucket=steps,
        last_step=steps,
        lo=[0.6e9] * 10,
        hi=[1.0e9] * 10,
        last=[1.0e9] * 10,
        n=[1] * 10,
        nonfinite=[0] * 10,
    )
    cap = Buckets.from_columns(
        1,
        bucket=steps,
        last_step=steps,
        lo=[25.3e9] * 10,
        hi=[25.3e9] * 10,
        last=[25.3e9] * 10,
        n=[1] * 10,
        nonfinite=[0] * 10,
    )
    tiers = [{"label": "x2", "predicted_bytes": 1.6e9, "fits": True}]
    fig = charts.memory_figure(peak, cap, tiers, usable_bytes=24.0e9)
    assert fig.layout.yaxis.range == (0, 1.25 * 1.6)
    assert any("capacity 25.3 GB, usable 24.0 GB" in a.text for a in fig.layout.annotations)
    gpu = charts.memory_figure(
        peak,
        Buckets.from_columns(
            1,
            bucket=steps,
            last_step=steps,
            lo=[2e9] * 10,
            hi=[2e9] * 10,
            last=[2e9] * 10,
            n=[1] * 10,
            nonfinite=[0] * 10,
        ),
        tiers,
    )
    assert gpu.layout.yaxis.range is None and not gpu.layout.annotations


def test_throughput_has_a_smoothed_line_over_the_faint_raw_one():
    steps = list(range(1, 101))
    rng = np.random.default_rng(0)
    raw = 3000 + 800 * rng.standard_normal(100)
    tps = Buckets.from_columns(
        1, bucket=steps, last_step=steps, lo=raw, hi=raw, last=raw, n=[1] * 100, nonfinite=[0] * 100
    )
    fig = charts.throughput_figure(tps, None)
    by_name = {t.name: t for t in fig.data}
    smooth = np.asarray(by_name["tokens/s (smoothed)"].y, float)
    assert by_name["tokens/s"].opacity < 1
    assert np.std(np.diff(smooth[20:])) < 0.3 * np.std(np.diff(raw[20:]))


def test_signed_percent_keeps_small_effects_readable():
    from rampwatch.dashboard.card import signed_percent

    assert [signed_percent(x) for x in (-0.42, 0.16, -0.0031, 0.0, 0.0999)] == [
        "-42%",
        "+16%",
        "-0.31%",
        "0%",
        "+10%",
    ]


def test_the_trial_chart_draws_every_arm_and_the_held_out_losses_judged():
    """A one-step arm still shows; each arm's held-out loss, what the verdict compares, is drawn."""
    from rampwatch.store.reader import TrialPoint

    points = [
        TrialPoint(1, 2048, 3.1, None, False),
        TrialPoint(1, 4096, 3.0, 2.9, True),
        TrialPoint(4, 4096, 3.2, 2.95, True),  # one step: its only point is its end
    ]
    fig = charts.trial_figure(points)
    names = [t.name for t in fig.data]
    assert names == [
        "control ×1, train",
        "control ×1, held-out",
        "branch ×4, train",
        "branch ×4, held-out",
    ]
    held = {t.name: list(t.y) for t in fig.data if t.name.endswith("held-out")}
    assert held == {"control ×1, held-out": [2.9], "branch ×4, held-out": [2.95]}
