"""advisor/throughput.py against closed forms: per-tier medians of per-step values, and the
step-time model step = accum · (c0 + c1·b) + overhead recovered from tiers it generated."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rampwatch.advisor.flops import mfu_at
from rampwatch.advisor.throughput import (
    RECENT,
    MeasuredSpeed,
    ThroughputModel,
    measure_tiers,
    recent_throughput,
)
from rampwatch.advisor.tiers import Tier

SEQ = 2048
C0, C1, OVERHEAD = 0.02, 0.015, 0.3  # seconds: t_micro(b) = C0 + C1·b
MFU_PER_TPS = 0.62 / 129_000  # the run's FLOPs per token / peak


def step_time(b: int, accum: int) -> float:
    return accum * (C0 + C1 * b) + OVERHEAD


def measured(*tiers: tuple[int, int], overhead: float = OVERHEAD) -> dict[Tier, MeasuredSpeed]:
    out = {}
    for b, a in tiers:
        t = Tier(b, a)
        tps = t.batch * SEQ / (a * (C0 + C1 * b) + overhead)
        out[t] = MeasuredSpeed(t, tps, tps * MFU_PER_TPS, 50)
    return out


def from_micro_times(accum: int, micro: dict[int, float]) -> dict[Tier, MeasuredSpeed]:
    """Tiers at one accumulation whose micro-batch time at b is micro[b] (no overhead, no MFU)."""
    out = {}
    for b, t in micro.items():
        tier = Tier(b, accum)
        out[tier] = MeasuredSpeed(tier, tier.batch * SEQ / (accum * t), None, 10)
    return out


def test_medians_per_tier_skip_untimed_steps_and_steps_without_mfu():
    b = [16, 16, 16, 16, 32, 32, 32, np.nan]
    a = [16, 16, 16, 16, 16, 16, 16, 16]
    tps = [np.nan, 100.0, 130.0, 120.0, 140.0, 0.0, 150.0, 999.0]  # step 0 is never timed
    mfu = [np.nan, 0.5, np.nan, 0.6, 0.7, 0.7, np.nan, 0.9]
    got = measure_tiers(b, a, tps, mfu, world_size=1)
    assert set(got) == {Tier(16, 16), Tier(32, 16)}
    assert got[Tier(16, 16)].tokens_per_s == 120.0 and got[Tier(16, 16)].samples == 3
    assert got[Tier(16, 16)].mfu == pytest.approx(0.55)
    assert got[Tier(32, 16)].tokens_per_s == 145.0 and got[Tier(32, 16)].mfu == 0.7
    assert measure_tiers(b, a, tps, None, 1)[Tier(16, 16)].mfu is None
    with pytest.raises(ValueError, match="aligned"):
        measure_tiers([1, 2], [1], [1.0, 2.0], None, 1)


def test_a_tier_is_measured_over_its_last_recent_steps():
    """A tier's throughput is its own recent_throughput: the median of its last RECENT timed
    steps, in step order, however many earlier ones ran slower (another tier between counts
    for that tier only)."""
    tps = [100.0] * 40 + [500.0] * 5 + [200.0] * (RECENT - 1) + [np.nan]
    b = [16] * 40 + [32] * 5 + [16] * RECENT
    got = measure_tiers(b, [1] * len(b), tps, None, world_size=1)
    assert got[Tier(16, 1)].tokens_per_s == recent_throughput(tps[:40] + tps[45:])
    assert got[Tier(16, 1)].tokens_per_s == 200.0 and got[Tier(16, 1)].samples == RECENT
    assert got[Tier(32, 1)].tokens_per_s == 500.0 and got[Tier(32, 1)].samples == 5


def test_overhead_and_micro_line_are_recovered_exactly():
    model = ThroughputModel.fit(measured((16, 16), (16, 32), (32, 16)), SEQ, 1)
    assert model.overhead_s == pytest.approx(OVERHEAD)
    assert model.line == pytest.approx((C0, C1))
    assert "per-step overhead 0.3 s, from 16 at accumulation 16, 32" in model.notes[0]
    for b, a in ((64, 8), (128, 16), (32, 64), (8, 2)):
        s = model.speed(Tier(b, a))
        assert s.source == "model"
        assert s.step_time_s == pytest.approx(step_time(b, a))
        assert s.tokens_per_s == pytest.approx(b * a * SEQ / step_time(b, a))
        assert s.mfu == pytest.approx(s.tokens_per_s * MFU_PER_TPS)  # MFU is linear in tokens/s
    seen = model.speed(Tier(16, 32))
    assert (seen.source, seen.note) == ("measured", "median of its last 50 steps")


def test_tokens_per_second_saturates_in_the_per_device_batch():
    model = ThroughputModel.fit(measured((16, 16), (32, 16), overhead=0.0), SEQ, 1)
    rates = [model.speed(Tier(b, 16)).tokens_per_s for b in (16, 32, 64, 128, 1024)]
    assert all(x < y for x, y in zip(rates, rates[1:], strict=False))
    assert rates[-1] < SEQ / C1  # the ceiling seq / c1


def test_one_measured_per_device_batch_predicts_only_its_accumulations():
    model = ThroughputModel.fit(measured((16, 16), overhead=0.0), SEQ, 1)
    assert "per-step overhead taken as 0" in model.notes[0]
    same = model.speed(Tier(16, 64))
    assert same.source == "model"
    assert same.step_time_s == pytest.approx(64 * (C0 + C1 * 16))
    other = model.speed(Tier(32, 16))
    assert (other.source, other.tokens_per_s, other.step_time_s, other.mfu) == (
        "unknown",
        None,
        None,
        None,
    )
    assert "only per-device batch 16 was measured" in other.note


def test_a_line_below_zero_at_b_0_is_read_as_flat_tokens_per_second():
    """t_micro 0.2 s at 16 and 0.5 s at 32: the line's c0 < 0 would make tokens/s fall with b."""
    model = ThroughputModel.fit(from_micro_times(4, {16: 0.2, 32: 0.5}), SEQ, 1)
    c1 = (16 * 0.2 + 32 * 0.5) / (16**2 + 32**2)
    assert model.line == pytest.approx((0.0, c1))
    assert any("flat" in n for n in model.notes)
    assert model.speed(Tier(64, 4)).tokens_per_s == pytest.approx(SEQ / c1)
    assert model.speed(Tier(64, 4)).mfu is None  # the run logged no MFU


def test_micro_time_that_does_not_grow_with_the_batch_models_no_other_batch():
    model = ThroughputModel.fit(from_micro_times(2, {16: 0.5, 32: 0.4}), SEQ, 1)
    assert model.line is None
    s = model.speed(Tier(64, 2))
    assert s.source == "unknown" and "does not grow" in s.note


def test_other_world_sizes_are_left_out():
    m = measured((16, 16))
    t2 = Tier(16, 16, 2)
    m[t2] = MeasuredSpeed(t2, 1.0, None, 5)
    model = ThroughputModel.fit(m, SEQ, 1)
    assert set(model.measured) == {Tier(16, 16)}
    assert any("another world size" in n for n in model.notes)
    assert model.speed(t2).source == "unknown"


def test_mfu_at_is_mfu_scaled_by_tokens_per_second():
    assert mfu_at(135_000, 0.62, 129_000) == pytest.approx(0.62 * 135 / 129)
    with pytest.raises(ValueError):
        mfu_at(1.0, 0.0, 1.0)
    assert math.isclose(mfu_at(0.0, 0.5, 10.0), 0.0)
