"""advisor.memory: the memory line from measured peaks and/or a plan, and the usable capacity."""

from __future__ import annotations

import pytest

from rampwatch.advisor.memory import GB, MemoryModel, fit_memory_model, format_gb, usable_bytes


def test_two_measured_points_give_their_line():
    m = fit_memory_model({16: 70 * GB, 32: 130 * GB})
    # slope (130 − 70)/16 = 3.75 GB/sequence, intercept 70 − 16·3.75 = 10 GB
    assert m.bytes_per_sequence == pytest.approx(3.75 * GB)
    assert m.intercept_bytes == pytest.approx(10 * GB)
    assert m.source == "measured line (2 points)"
    assert m.predict(64) == pytest.approx(250 * GB)


def test_measured_line_replaces_plan_and_never_predicts_below_a_measurement():
    measured = {8: 40 * GB, 16: 71 * GB, 32: 130 * GB}
    planned = {8: 1 * GB, 16: 2 * GB, 32: 4 * GB}  # ignored once two measurements exist
    m = fit_memory_model(measured, planned)
    assert m.source == "measured line (3 points)"
    # least-squares slope over (8, 40), (16, 71), (32, 130): x̄ = 56/3, ȳ = 241/3
    xs, ys = [8, 16, 32], [40, 71, 130]
    xm, ym = sum(xs) / 3, sum(ys) / 3
    cov = sum((x - xm) * (y - ym) for x, y in zip(xs, ys, strict=True))
    slope = cov / sum((x - xm) ** 2 for x in xs)
    assert m.bytes_per_sequence == pytest.approx(slope * GB)
    for b, peak in measured.items():
        assert m.predict(b) >= peak * (1 - 1e-12)
    assert any(m.predict(b) == pytest.approx(peak) for b, peak in measured.items())


def test_one_measured_peak_plus_plan_slope():
    # plan slope by least squares: (8, 20), (16, 36), (32, 68) -> exactly 2 GB/sequence
    m = fit_memory_model({16: 75 * GB}, {8: 20 * GB, 16: 36 * GB, 32: 68 * GB})
    assert m.source == "measured peak + plan slope"
    assert m.bytes_per_sequence == pytest.approx(2 * GB)
    assert m.predict(16) == pytest.approx(75 * GB)  # anchored on the measurement
    assert m.intercept_bytes == pytest.approx(43 * GB)


def test_plan_only():
    m = fit_memory_model({}, {8: 20 * GB, 16: 36 * GB})
    assert m.source == "plan (2 points)"
    assert (m.intercept_bytes, m.bytes_per_sequence) == (
        pytest.approx(4 * GB),
        pytest.approx(2 * GB),
    )
    assert fit_memory_model(None, {8: 20 * GB, 16: 36 * GB}) == m


def test_negative_measured_slope_falls_back_on_plan_or_says_why():
    measured = {16: 71 * GB, 32: 70 * GB}  # noise: peaks that shrink with the batch
    with pytest.raises(ValueError, match="shrink as the batch grows.*memory plan"):
        fit_memory_model(measured)
    m = fit_memory_model(measured, {16: 30 * GB, 32: 62 * GB})
    assert m.bytes_per_sequence == pytest.approx(2 * GB)
    assert m.predict(16) >= 71 * GB and m.predict(32) >= 70 * GB


@pytest.mark.parametrize(
    "measured, planned, match",
    [
        ({}, None, "no memory data"),
        (None, {16: GB}, "no memory data"),
        ({16: 70 * GB}, None, "one measured peak.*second per-device batch"),
        ({16: 70 * GB}, {32: GB}, "plan with >= 2"),
        ({0: 70 * GB, 8: GB}, None, "positive integer"),
        ({16: -1, 8: GB}, None, "positive bytes"),
        ({16.5: GB, 8: GB}, None, "integer number of sequences"),
    ],
)
def test_fit_errors_name_the_problem(measured, planned, match):
    with pytest.raises(ValueError, match=match):
        fit_memory_model(measured, planned)


def test_memory_model_validates():
    with pytest.raises(ValueError, match="does not shrink"):
        MemoryModel(1.0, -1.0, "x")
    with pytest.raises(ValueError, match="finite"):
        MemoryModel(float("nan"), 1.0, "x")
    with pytest.raises(ValueError, match="positive integer"):
        MemoryModel(1.0, 1.0, "x").predict(0)


def test_usable_bytes():
    assert usable_bytes(140 * GB) == pytest.approx(133 * GB)
    assert usable_bytes(100, margin=0.0) == 100
    assert usable_bytes(100, margin=0.2) == pytest.approx(80)
    with pytest.raises(ValueError, match="fraction in \\[0, 1\\)"):
        usable_bytes(100, margin=1.0)
    with pytest.raises(ValueError, match="capacity must be positive"):
        usable_bytes(0)
    assert format_gb(150.24e9) == "150.2 GB"
