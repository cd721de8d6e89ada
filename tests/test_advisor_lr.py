"""advisor.lr: rules by optimizer, scaling from the original base LR, exact reversal, warnings."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampwatch.advisor.lr import (
    lr_multiplier,
    noise_scale_warning,
    ramp_lr,
    rule_for,
    rule_for_type,
    scaled_base_lr,
)


@pytest.mark.parametrize(
    "name, rule",
    [
        ("adamw", "sqrt"),
        ("AdamW", "sqrt"),
        ("torch.optim.AdamW", "sqrt"),
        ("Adam", "sqrt"),
        ("NAdam", "sqrt"),
        ("RAdam", "sqrt"),
        ("LAMB", "sqrt"),
        ("Adafactor", "sqrt"),
        ("FusedAdam", "sqrt"),
        ("AdamW8bit", "sqrt"),
        ("sgd", "linear"),
        ("SGD", "linear"),
        ("sgd-momentum", "linear"),
        ("SGD_Nesterov", "linear"),
    ],
)
def test_rule_by_optimizer(name, rule):
    assert rule_for(name) == rule


def test_an_optimizer_subclass_takes_its_base_classs_rule():
    class Adam:
        pass

    class ReduceScatterAdam(Adam):  # a loop's own, as nanochat's
        pass

    class Lion:
        pass

    assert rule_for_type(ReduceScatterAdam) == "sqrt"
    assert rule_for_type(ReduceScatterAdam, rule="linear") == "linear"
    with pytest.raises(ValueError, match="no learning-rate rule known for optimizer 'Lion'"):
        rule_for_type(Lion)


def test_named_rule_overrides_and_unknown_optimizer_is_refused():
    assert rule_for("lion", rule="sqrt") == "sqrt"
    assert rule_for("adamw", rule="none") == "none"
    assert rule_for("linear") == "linear"  # a rule where the optimizer goes
    with pytest.raises(ValueError, match="no learning-rate rule known for optimizer 'lion'.*rule="):
        rule_for("lion")
    with pytest.raises(ValueError, match="unknown LR rule 'cubic'"):
        rule_for("adamw", rule="cubic")
    with pytest.raises(ValueError, match="no optimizer and no LR rule"):
        rule_for(None)


def test_multipliers_hand_computed():
    assert lr_multiplier(256, 1024, "sqrt") == 2.0
    assert lr_multiplier(256, 512, "linear") == 2.0
    assert lr_multiplier(256, 512, "none") == 1.0
    assert lr_multiplier(512, 256, "sqrt") == pytest.approx(1 / math.sqrt(2))
    assert scaled_base_lr(3e-4, 256, 1024, "sqrt") == 6e-4
    assert scaled_base_lr(0.1, 256, 2048, "linear") == pytest.approx(0.8)
    with pytest.raises(ValueError, match="positive batch size"):
        lr_multiplier(0, 512, "sqrt")


batches = st.integers(1, 1 << 20)


@given(
    base=st.floats(1e-8, 10.0),
    original=batches,
    path=st.lists(batches, min_size=1, max_size=8),
    rule=st.sampled_from(["sqrt", "linear", "none"]),
)
def test_ramp_and_reverse_restore_base_lr_bit_for_bit(base, original, path, rule):
    lrs = [scaled_base_lr(base, original, b, rule) for b in path]  # a run of ramps
    assert all(math.isfinite(x) and x > 0 for x in lrs)
    assert scaled_base_lr(base, original, original, rule) == base  # back at the start: exact
    # going to the same batch by any route gives the same float (no compounding)
    assert scaled_base_lr(base, original, path[-1], rule) == lrs[-1]


def test_ramp_lr_warns_beyond_noise_scale():
    change = ramp_lr(3e-4, 256, 512, optimizer="AdamW", b_noise=1000)
    assert change.rule == "sqrt" and change.warning is None
    assert change.base_lr == pytest.approx(3e-4 * math.sqrt(2))
    change = ramp_lr(3e-4, 256, 2048, optimizer="AdamW", b_noise=1000)
    assert change.warning and "exceeds the gradient noise scale (1,000 sequences)" in change.warning
    # a small noise scale keeps its digits (it read "(0 sequences)" at 0.182)
    assert "noise scale (0.182 sequences)" in noise_scale_warning(16, 0.182)
    assert noise_scale_warning(2048, None) is None
    assert noise_scale_warning(2048, float("nan")) is None
