"""advisor.gns_window: the windowed noise scale against streams with a known answer.

The streams are simulated the way a training step measures them: per-example gradients
g ~ N(G, Σ) (tr Σ = 64), accumulated over k micro-batches of b examples, the running means'
squared norms through advisor.gns.accumulation_estimates — so the per-step estimates have the
real estimator's noise and correlation, and the truth B_simple = tr Σ / |G|² is known.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rampwatch.advisor.gns import accumulation_estimates
from rampwatch.advisor.gns_window import NoiseScaleWindow, fieller_interval, significant

TRACE = 64.0


def simulated(seed: int, g2_at, steps: int, *, k: int = 2, b: int = 8, dim: int = 16):
    """Per-step (|G|², tr Σ) estimates of a run whose true |G|² at step s is g2_at(s)."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=dim)
    direction /= np.linalg.norm(direction)
    g2 = np.array([g2_at(s) for s in range(steps)])
    mean = direction[None, :] * np.sqrt(g2)[:, None]
    grads = mean[:, None, None, :] + math.sqrt(TRACE / dim) * rng.standard_normal(
        (steps, k, b, dim)
    )
    running = np.cumsum(grads.mean(axis=2), axis=1) / np.arange(1, k + 1)[None, :, None]
    return [accumulation_estimates(r.tolist(), b) for r in (running**2).sum(axis=2)]


def run_window(stream, **kw):
    w = NoiseScaleWindow(**kw)
    return [w.update(g, t) for g, t in stream]


def rel_error(est, truth: float = TRACE) -> float:
    return abs(est.b_simple / truth - 1)


def test_tracks_a_100x_fall_of_the_gradient_within_the_window_length():
    # |G|² falls 100× over the first 100 of 1,000 steps, then stays at 1 (B_simple 0.64 -> 64).
    # A bias-corrected EMA keeps the early |G|² in its denominator for ~12 half-lives; the window
    # cuts the fall off once the steps after it differ from it.
    def g2_at(s):
        return 100.0 * 0.01 ** min(1.0, s / 100)

    errors = []
    for seed in range(20):
        est = run_window(simulated(seed, g2_at, 1000, k=8), max_steps=400)
        errors.append([abs(est[s].b_simple / TRACE - 1) for s in (500, 600, 800, 999)])
    errors = np.array(errors)  # seeds × steps 500, 600, 800, 999 (400+ steps after the fall)
    assert (np.median(errors, axis=0) < 0.10).all(), np.median(errors, axis=0)
    assert (errors < 0.10).mean() >= 0.75, (errors < 0.10).mean(axis=0)  # measured 0.84


def test_default_window_is_unbiased_after_the_fall():
    def g2_at(s):
        return 100.0 * 0.01 ** min(1.0, s / 100)

    finals = [run_window(simulated(seed, g2_at, 600, k=8))[-1] for seed in range(20)]
    assert np.median([e.b_simple for e in finals]) == pytest.approx(TRACE, rel=0.10)
    assert all(e.steps <= 530 for e in finals)  # never back past step 70, |G|² 4× the end


def test_interval_covers_the_truth_at_its_stated_rate():
    # Stationary: B_simple = 64 = 4× the batch of 16 (accumulation 2 of 8), as in a real run.
    # Stated: 90% two-sided (Fieller), i.e. 95% for each one-sided bound. 200 streams give the
    # coverage to about ±2%.
    # A stream whose last steps were falsely cut has no estimate: it claims nothing (measured
    # 1 in 200).
    finals = [run_window(simulated(seed, lambda s: 1.0, 300))[-1] for seed in range(200)]
    finals = [e for e in finals if e is not None]
    assert len(finals) >= 196
    two_sided = np.mean([e.lower <= TRACE <= (e.upper or math.inf) for e in finals])
    lower_ok = np.mean([e.lower <= TRACE for e in finals])
    assert 0.85 <= two_sided <= 0.95 and lower_ok >= 0.90, (two_sided, lower_ok)
    assert np.mean([e.upper is not None for e in finals]) >= 0.9  # informative, not vacuous


def test_a_steady_stream_sharpens_past_200_steps_without_a_false_change():
    # No drift for 2,000 steps: the window keeps every step (the buffer holds 4,000), so its
    # error shrinks like 1/√steps; a false change point would cut it back.
    finals, last_200, cuts = [], [], []
    for seed in range(10):
        stream = simulated(seed, lambda s: 1.0, 2000, k=8)
        w = NoiseScaleWindow()
        for g, t in stream:
            w.update(g, t)
        finals.append(w.latest)
        cuts.append(w.cuts)
        g2, trace = np.array(stream[-200:]).T
        last_200.append(abs(trace.sum() / g2.sum() / TRACE - 1))
    assert np.mean([c == 0 for c in cuts]) >= 0.9, cuts
    assert np.median([e.steps for e in finals]) == 2000
    errors = [rel_error(e) for e in finals]
    assert np.median(errors) < 0.5 * np.median(last_200), (errors, last_200)  # √10 ≈ 3.2 fewer


def test_the_window_grows_by_one_step_and_shrinks_only_at_a_change():
    # Consecutive estimates share all but the newest step, so no value flips between windows:
    # the window grows by one step per step, or is cut where the stream changed.
    def g2_at(s):
        return 20.0 if s < 150 else 1.0

    for seed in range(10):
        w = NoiseScaleWindow()
        prev_length, prev_cuts, prev = 0, 0, None
        for g, t in simulated(seed, g2_at, 800):
            est = w.update(g, t)
            if w.cuts == prev_cuts:
                assert w.length == prev_length + 1
            else:
                assert w.cuts == prev_cuts + 1 and w.length <= prev_length
            bounded = est is not None and prev is not None and est.upper and prev.upper
            if bounded and w.cuts == prev_cuts:  # an unbounded interval stands behind no value
                assert 0.5 < est.b_simple / prev.b_simple < 2.0
            assert est is None or est.steps == w.length
            prev_length, prev_cuts, prev = w.length, w.cuts, est


def test_an_abrupt_change_is_cut_off_and_never_reached_back_into():
    # |G|² falls 20× at step 400 (B_simple 3.2 -> 64). Stated: 60 steps after the change the
    # window holds at most 2 steps from before it, for good, and 150 steps after it the
    # estimate is within 10% of the new answer in the median seed.
    change = 400

    def g2_at(s):
        return 20.0 if s < change else 1.0

    late = []
    for seed in range(20):
        est = run_window(simulated(seed, g2_at, 800, k=8))
        for s in range(change + 60, 800):
            assert est[s] is not None and est[s].steps <= s + 1 - change + 2, (seed, s)
        late.append([rel_error(est[s]) for s in (change + 150, 700, 799)])
    assert (np.median(late, axis=0) < 0.10).all(), np.median(late, axis=0)


def test_one_step_50x_outlier_moves_the_estimate_by_at_most_20_percent():
    # One step 300 of a steady stream reads 50× the typical |G|² (or tr Σ), either sign: the
    # estimate at every later step stays within 20% of the same stream without it.
    for seed in range(10):
        stream = simulated(seed, lambda s: 1.0, 400)
        clean = run_window(stream)
        typical_g2 = np.median(np.abs([g for g, _ in stream]))
        for g_out, t_out in (
            (50 * typical_g2, TRACE),
            (-50 * typical_g2, TRACE),
            (1.0, 50 * TRACE),
            (1.0, -50 * TRACE),
            (50 * typical_g2, -50 * TRACE),  # the step 117: |G|² high, tr Σ negative
        ):
            hit = run_window(stream[:300] + [(g_out, t_out)] + stream[301:])
            moved = [abs(hit[s].b_simple / clean[s].b_simple - 1) for s in range(300, 400)]
            assert max(moved) <= 0.20, (seed, g_out, t_out, max(moved))


def test_a_mark_keeps_the_window_when_nothing_changed_and_cuts_at_it_when_it_did():
    # A ramp doubles the batch: |G|² and tr Σ stay, the per-step noise halves. The window keeps
    # its steps. A change that starts at the mark (|G|² falls 4×) is cut at the mark itself.
    kept, cut_at_mark = [], []
    for seed in range(20):
        before = simulated(seed, lambda s: 1.0, 300, k=8)
        for g2_after, b_after, outcome in ((1.0, 16, kept), (0.25, 8, cut_at_mark)):
            w = NoiseScaleWindow()
            for g, t in before:
                w.update(g, t)
            w.mark()
            for g, t in simulated(
                seed + 100, lambda s, g2_after=g2_after: g2_after, 200, k=8, b=b_after
            ):
                w.update(g, t)
            outcome.append(w.latest.steps == (500 if outcome is kept else 200))
    assert np.mean(kept) >= 0.9 and np.mean(cut_at_mark) >= 0.8, (kept, cut_at_mark)


def test_no_estimate_from_a_step_without_one():
    w = NoiseScaleWindow(min_steps=4)
    assert [w.update(1.0, 10.0) for _ in range(3)] == [None] * 3  # not enough steps yet
    assert w.update(1.0, 10.0).b_simple == pytest.approx(10.0)
    assert w.update(math.nan, 1.0) is None and w.update(1.0, math.inf) is None
    assert w.update(None, 1.0) is None and w.skipped == 3 and w.updates == 4


def test_fieller_interval_hand_computed():
    # a > 0: (my − R·mx)² = q²(vyy + R²vxx) with mx = 2, my = 20, vxx = vyy = 1, q = 1:
    # (20 − 2R)² = 1 + R²  ->  3R² − 80R + 399 = 0  ->  R = (40 ∓ √403)/3
    lo, hi = fieller_interval(2.0, 20.0, 1.0, 1.0, 0.0, 1.0)
    assert (lo, hi) == (
        pytest.approx((40 - math.sqrt(403)) / 3),
        pytest.approx((40 + math.sqrt(403)) / 3),
    )
    # mx not distinguishable from 0 but my clearly positive: a lower bound only
    lo, hi = fieller_interval(0.1, 20.0, 1.0, 1.0, 0.0, 1.0)
    assert hi is None and 0 < lo < 20.0 / 0.1
    # nothing known
    assert fieller_interval(0.0, 0.1, 1.0, 1.0, 0.0, 1.0) == (0.0, None)


def test_state_round_trips_through_json_and_continues():
    w = NoiseScaleWindow(max_steps=50, min_steps=5)
    for g, t in simulated(1, lambda s: 1.0, 80):
        w.update(g, t)
    clone = NoiseScaleWindow.from_dict(json.loads(json.dumps(w.to_dict())))
    assert clone.latest == w.latest and clone.to_dict() == w.to_dict()
    assert clone.update(1.0, 60.0) == w.update(1.0, 60.0)
    with pytest.raises(ValueError, match="version"):
        NoiseScaleWindow.from_dict({**w.to_dict(), "version": 1})


def test_a_resume_anywhere_continues_with_the_same_digits():
    # The median and MAD are kept between refreshes, and the prefix sums continue from the
    # column the state names: a window resumed at any step (between refreshes, right after a
    # cut, during a mark's test) gives exactly the estimates of one that never stopped.
    def g2_at(s):
        return 20.0 if s < 150 else 1.0

    stream = simulated(4, g2_at, 500)
    whole = NoiseScaleWindow(max_steps=300)
    states, ests = {}, []
    for i, (g, t) in enumerate(stream):
        if i == 200:
            whole.mark()
        ests.append(whole.update(g, t))
        if i in (60, 149, 155, 171, 203, 260, 333, 420):
            states[i] = json.dumps(whole.to_dict())
    assert whole.cuts >= 1 and whole.updates == 500
    for at, state in states.items():
        w = NoiseScaleWindow.from_dict(json.loads(state))
        assert w.latest == ests[at], at
        for i in range(at + 1, len(stream)):
            if i == 200:
                w.mark()
            assert w.update(*stream[i]) == ests[i], (at, i)


def test_a_version_2_state_from_an_old_checkpoint_still_loads():
    # What NoiseScaleWindow.to_dict() wrote before change points: its buffer is the window.
    stream = simulated(2, lambda s: 1.0, 200)
    old = {
        "version": 2,
        "max_steps": 200,
        "min_steps": 48,
        "target_rel_se": 0.2,
        "level": 0.9,
        "g2": [g for g, _ in stream],
        "trace": [t for _, t in stream],
        "updates": 200,
        "skipped": 1,
    }
    w = NoiseScaleWindow.from_dict(json.loads(json.dumps(old)))
    assert w.latest.steps == 200 and w.updates == 200 and w.skipped == 1
    g2, trace = np.array(stream).T  # no step is an outlier: the ratio of the buffer's sums
    assert w.latest.b_simple == pytest.approx(trace.sum() / g2.sum(), rel=0.02)
    for g, t in simulated(3, lambda s: 1.0, 100):
        w.update(g, t)
    assert w.latest.steps == 300  # the buffer is today's: it grows past the old 200


def test_significant_digits_read_as_a_person_would():
    assert [significant(x) for x in (0.000523, 8.4, 42.0, 1234.5, 0)] == [
        "0.000523",
        "8.40",
        "42.0",
        "1,234",
        "0",
    ]
