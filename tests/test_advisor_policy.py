"""advisor.policy: the one ramp policy, its price by eq. 2.11, and its home in the run config."""

from __future__ import annotations

import json
import math

import pytest

from rampwatch.advisor.policy import CONFIG_KEY, RampPolicy


def test_band_cost_is_eq_2_11_at_the_band_ends():
    # B in [B_noise, 2·B_noise]: S/S_min = 1 + B_noise/B in [1.5, 2], E/E_min = 1 + B/B_noise in [2, 3]
    cost = RampPolicy(original_batch=16, original_lr=3e-3).band_cost()
    assert (cost["batch_low"], cost["batch_high"]) == (1.0, 2.0)
    assert (cost["steps_low"], cost["steps_high"]) == (1.5, 2.0)
    assert (cost["examples_low"], cost["examples_high"]) == (2.0, 3.0)
    half = RampPolicy(original_batch=16, original_lr=3e-3, ramp_at=2.0).band_cost()
    assert (half["steps_low"], half["steps_high"], half["examples_high"]) == (2.0, 3.0, 2.0)


def test_the_run_config_round_trips_through_json():
    policy = RampPolicy(
        original_batch=32,
        original_lr=6e-4,
        lr_rule="linear",
        hysteresis_steps=7,
        offered_factors=(2, 4),
    )
    config = json.loads(json.dumps({CONFIG_KEY: policy.to_config(), "lr": 1.0}))
    assert RampPolicy.from_config(config) == policy
    assert RampPolicy.from_config(config, ramp_at=1.0).ramp_at == 1.0


def test_configs_written_before_the_policy_read_through_their_keys():
    old = {
        "optimizer": "sgd",
        "lr": 0.1,
        "per_device_batch": 8,
        "accum": 2,
        "world_size": 4,
        "ramp_hysteresis": 50,
        "ramp_min_samples": 100,
        "original_lr": 0.1,
        "original_batch": 64,
    }
    p = RampPolicy.from_config(old)
    assert (p.original_batch, p.original_lr, p.lr_rule) == (64, 0.1, "linear")
    assert (p.hysteresis_steps, p.min_estimates) == (50, 100)
    # no original_batch: the config's first tier
    first = RampPolicy.from_config({k: v for k, v in old.items() if k != "original_batch"})
    assert first.original_batch == 8 * 2 * 4
    with pytest.raises(ValueError, match="no ramp policy and no first tier"):
        RampPolicy.from_config({"optimizer": "adamw"})


def test_new_base_lr_scales_from_the_original_and_restores_it():
    p = RampPolicy(original_batch=16, original_lr=3e-3)
    assert p.new_base_lr(64) == pytest.approx(3e-3 * 2)
    assert p.new_base_lr(16) == 3e-3  # bit for bit


def test_decide_uses_the_policys_ramp_point_and_bound():
    p = RampPolicy(
        original_batch=16, original_lr=3e-3, ramp_at=2.0, hysteresis_steps=5, min_estimates=5
    )
    steps = list(range(20))
    assert not p.decide(steps, [30.0] * 20, [20.0] * 20, 16, None).ready  # 30 < 2 × 16
    assert p.decide(steps, [40.0] * 20, [20.0] * 20, 16, None).ready
    assert not p.decide(steps, [40.0] * 20, [10.0] * 20, 16, None).ready  # bound < 16
    default = RampPolicy(original_batch=16, original_lr=3e-3, hysteresis_steps=5, min_estimates=5)
    assert default.decide(steps, [20.0] * 20, [17.0] * 20, 16, None).ready
    assert not default.decide(steps, [20.0] * 20, [15.0] * 20, 16, None).ready


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="original_batch"):
        RampPolicy(original_batch=0, original_lr=1e-3)
    with pytest.raises(ValueError, match="original_lr"):
        RampPolicy(original_batch=8, original_lr=math.nan)
    with pytest.raises(ValueError):
        RampPolicy(original_batch=8, original_lr=1e-3, lr_rule="cubic")


def test_a_policy_never_jumps_past_the_stores_limit():
    from rampwatch.advisor.policy import RAMP_MAX_FACTOR

    with pytest.raises(ValueError, match="at most 8"):
        RampPolicy(16, 1e-3, factor=2 * RAMP_MAX_FACTOR)
    with pytest.raises(ValueError, match="offered_factors"):
        RampPolicy(16, 1e-3, offered_factors=(2, 16))
