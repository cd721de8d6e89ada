"""The card and the noise chart in plain words (issue 25, item 5): the verdict sentences of every
case, on seeded real databases through the live page (AppTest), and the sentence builders and the
noise chart on their own. A number is never said to be below (or above) a number that looks the
same; a run that is not running gets no forecast; an LR note sits on a tier past the policy's
band, never beside "Ramp now" as a second verdict; the chart draws the interval as a band and no
point the estimator would not stand behind."""

from __future__ import annotations

import math
import re
import signal
import subprocess

import numpy as np
import pytest

from rampwatch import store
from rampwatch.advisor.policy import RampPolicy
from rampwatch.dashboard import charts, recommend
from rampwatch.dashboard.buckets import Buckets
from tests import seed
from tests.procs import kill_group
from tests.test_dashboard_logic import LATEST, PLAN, RUN

NOISE = "Gradient noise scale vs batch"


def _card_text(at) -> str:
    """The verdict: the one success or info box whose text starts with a bold verdict."""
    [box] = [
        str(e.value)
        for e in (*at.success, *at.info)
        if str(e.value).startswith(("**Ramp now.**", "**Not yet.**", "**Not running.**"))
    ]
    return box


def _numbers_that_contradict(text: str) -> list[str]:
    """'X below Y' / 'X above Y' (or 'just below' / 'just above') where X and Y look equal."""
    bad = []
    pattern = r"\(([\d,.]+)\)[^()]*?\b(?:just )?(?:below|above)\b[^()]*?\(([\d,.]+)\)"
    for a, b in re.findall(pattern, text):
        if float(a.replace(",", "")) == float(b.replace(",", "")):
            bad.append(f"{a} vs {b}")
    return bad


def _page(monkeypatch, db, **kw):
    run = seed.live_run(db, **kw)
    at = seed.app(monkeypatch, db)
    assert not at.exception, [e.message for e in at.exception]
    return run, at


# ----------------------------------------------------------------------- each verdict (AppTest)


def test_ramp_now_says_so_once_with_no_lr_warning_beside_it(db_path, monkeypatch):
    run, at = _page(monkeypatch, db_path)
    try:
        verdict = _card_text(at)
        assert verdict == (
            "**Ramp now.** The noise scale (79.4) has stayed above the batch (16) for 146 "
            "estimates, its 95% lower bound at least the batch (16): ramp the batch to 32."
        )
        for label in at.radio(key="tier_choice").options:
            at.radio(key="tier_choice").set_value(label).run()
            # every offered tier is within the policy's band (up to 2× the noise scale)
            assert not [w for w in at.warning if "noise scale" in str(w.value)], label
        assert not _numbers_that_contradict(seed.texts(at))
    finally:
        run.close()


def test_not_yet_rising_says_when_in_steps_and_time(db_path, monkeypatch):
    run, at = _page(monkeypatch, db_path, ramp_due=False)
    try:
        verdict = _card_text(at)
        m = re.fullmatch(
            r"\*\*Not yet\.\*\* The noise scale \(7\.99\) is below the batch \(16\)\. It is "
            r"rising: expected to cross between steps ([\d,]+) and ([\d,]+), in about (\d+) "
            r"seconds? to ([\d.]+) minutes at the run's ([\d.]+) steps/s \(such ranges held 9 "
            r"times in 10 on 10 recorded runs\)\.",
            verdict,
        )
        assert m, verdict
        lo, hi, t_lo, t_hi, rate = (float(g.replace(",", "")) for g in m.groups())
        assert 399 < lo < hi
        assert 24 < rate < 25  # 50,000-51,000 tokens/s over 16 × 128 tokens a step
        assert t_lo == pytest.approx((lo - 399) / rate, abs=0.5)  # seconds
        assert t_hi == pytest.approx((hi - 399) / rate / 60, rel=0.05)  # minutes
        # the ×2 tier (32) is past the band (2 × 7.99): its LR note is a note on that tier
        notes = [c for c in at.caption if "noise scale" in str(c.value)]
        assert [str(c.value) for c in notes][:1] == [
            "Note on this tier: batch 32 exceeds 2× the gradient noise scale (7.99 sequences), "
            "the top of the policy's band: a doubling there saves at most 17% of the steps "
            "for at least 67% more examples (McCandlish et al. 2018, §2.3), and the scaled "
            "learning rate may be too high; watch the loss."
        ]
        assert not [w for w in at.warning if "noise scale" in str(w.value)]
    finally:
        run.close()


def test_not_yet_just_below_is_never_below_itself(db_path, monkeypatch):
    """The issue's card: a noise scale of 15.98 rising fast against a batch of 16."""
    run, at = _page(
        monkeypatch,
        db_path,
        noise=lambda s: (15.98 * math.exp(0.01 * (s - 399)),) * 3,
    )
    try:
        assert _card_text(at) == (
            "**Not yet.** The noise scale (15.98) is just below the batch (16). It is rising; "
            "no reliable forecast yet: the trend says within 1 step, sooner than the "
            "forecast can time."
        )
        assert not _numbers_that_contradict(seed.texts(at))
    finally:
        run.close()


def test_not_yet_flat_says_it_is_not_rising(db_path, monkeypatch):
    run, at = _page(monkeypatch, db_path, noise=lambda s: (6.0 - 0.001 * s, 3.0, 9.0 - 0.001 * s))
    try:
        assert _card_text(at) == (
            "**Not yet.** The noise scale (5.60) is below the batch (16). It is not rising: "
            "no crossing to forecast."
        )
    finally:
        run.close()


def test_above_but_its_bound_below(db_path, monkeypatch):
    run, at = _page(monkeypatch, db_path, noise=lambda s: (40.0, 12.0, 90.0))
    try:
        assert _card_text(at) == (
            "**Not yet.** The noise scale (40.0) is above the batch (16), but its 95% lower "
            "bound (12.0) is below the batch (16): wait for more evidence."
        )
    finally:
        run.close()


def test_no_estimate_yet(db_path, monkeypatch):
    run, at = _page(monkeypatch, db_path, estimates_until=-1)
    try:
        assert _card_text(at) == "**Not yet.** No noise-scale estimate yet: keep training."
    finally:
        run.close()


# the not-yet-rising run (it has a forecast while it runs), its writer held open in a child
HELD_RUN = """
import sys
from tests import seed
from tests.procs import kill_group
run = seed.live_run(sys.argv[1], ramp_due=False)
print(run.run_id, flush=True)
sys.stdin.read()
"""


def _stopped_run(procs, db, status: str) -> None:
    """The not-yet-rising run, stopped as `status`: its writer SIGKILLed (stale: no heartbeat,
    no live spool), then recovered (killed); or closed (finished)."""
    if status == "finished":
        seed.live_run(db, ramp_due=False).close()
        return
    child = procs.spawn(
        ["-c", HELD_RUN, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip(), "the seeded run did not start"
    kill_group(child, signal.SIGKILL)
    if status == "killed":
        store.recover(db)


STOPPED = {
    "stale": "The run stopped reporting at step 399 (no heartbeat): no ramp and no forecast "
    "until it reports again.",
    "killed": "The run is killed, stopped at step 399: no ramp and no forecast.",
    "finished": "The run is finished, stopped at step 399: no ramp and no forecast.",
}


@pytest.mark.parametrize("status", list(STOPPED))
def test_a_run_that_is_not_running_gets_no_forecast(procs, db_path, monkeypatch, status):
    _stopped_run(procs, db_path, status)
    at = seed.app(monkeypatch, db_path)
    assert not at.exception
    assert f"status **{status}**" in seed.texts(at)
    assert _card_text(at) == f"**Not running.** {STOPPED[status]}"
    text = seed.texts(at)
    assert "forecast crossing: none (the run is not running)" in text
    assert "expected to cross" not in text and "crossing expected" not in text


# ------------------------------------------------------------------------- sentence builders

POLICY = RampPolicy(original_batch=16, original_lr=1e-3)


def _decide(steps, values, lower=None, batch=16, since=None):
    return POLICY.decide(steps, values, lower, batch, since)


def test_every_case_reads_as_sentences_and_never_contradicts_its_numbers():
    steps = list(range(400))
    cases = {
        "ready": ([40.0] * 400, [20.0] * 400),
        "streak": ([10.0] * 390 + [40.0] * 10, [5.0] * 390 + [20.0] * 10),
        "just below": ([15.999] * 400, [10.0] * 400),
        "just above, bound below": ([16.001] * 400, [10.0] * 400),
        "bound only": ([None] * 400, [15.9996] * 400),
        "at": ([16.0] * 400, [10.0] * 400),
    }
    said = {k: _decide(steps, v, lo).reason for k, (v, lo) in cases.items()}
    assert said["ready"] == (
        "The noise scale (40.0) has stayed above the batch (16) for 400 estimates, its 95% "
        "lower bound at least the batch (16): ramp the batch to 32."
    )
    assert said["streak"] == (
        "The noise scale (40.0) has been above the batch (16), its 95% lower bound at least "
        "the batch (16), for 10 of the 20 estimates it needs. Ready at step ~409 if it stays "
        "above."
    )
    assert said["just below"] == (
        "The noise scale (15.999) is just below the batch (16). It is not rising: no crossing "
        "to forecast."
    )
    assert said["just above, bound below"] == (
        "The noise scale (16.001) is just above the batch (16), but its 95% lower bound "
        "(10.0) is below the batch (16): wait for more evidence."
    )
    assert said["bound only"] == (
        "The noise scale's 95% lower bound (15.9996) is just below the batch (16), and there "
        "is no point estimate (the windowed |G|² is not positive): wait for more evidence."
    )
    assert said["at"].startswith("The noise scale (16.0) is at the batch (16).")
    for k, text in said.items():
        assert not _numbers_that_contradict(text), (k, text)
    few = _decide(steps[:8], [5.0 * 1.01**s for s in range(8)])
    assert few.reason == (
        "Not enough evidence yet: 8 noise-scale estimates of the 30 needed. The noise scale "
        "(5.36) is below the batch (16). It is rising; no reliable forecast yet: the forecast "
        "needs 10 estimates first."
    )


def test_the_forecast_in_time_at_the_runs_step_rate():
    steps = list(range(300))
    rec = _decide(steps, [5.0 * math.exp(0.003 * s) for s in steps])
    lo, hi = rec.forecast_range
    in_steps = (
        f"It is rising: expected to cross between steps {lo:,} and {hi:,} (such ranges held "
        "9 times in 10 on 10 recorded runs)."
    )
    assert rec.reason.endswith(in_steps) and rec.said() == rec.reason
    # at 0.5 steps/s from step 299: each end in the unit a person reads it in
    timed = rec.said(now_step=299, steps_per_second=0.5)
    secs, mins = (lo - 299) / 0.5, (hi - 299) / 0.5 / 60
    assert secs < 90 <= mins * 60 < 5400, (secs, mins)
    assert timed.endswith(
        f"It is rising: expected to cross between steps {lo:,} and {hi:,}, in about "
        f"{secs:.0f} seconds to {mins:.0f} minutes at the run's one step every 2.00 s (such "
        "ranges held 9 times in 10 on 10 recorded runs)."
    ), timed
    assert rec.said(now_step=299, steps_per_second=0.01).count("hours") == 1  # 11 to 42 hours
    # the hysteresis's step, in time too
    streak = _decide(steps, [10.0] * 290 + [40.0] * 10, [5.0] * 290 + [20.0] * 10)
    assert streak.said(now_step=299, steps_per_second=10.0).endswith(
        "Ready at step ~309 (in about 1 second) if it stays above."
    )


def test_the_lr_note_only_for_a_tier_past_the_policys_band():
    """Noise scale 40, batch 16: ×2 (32) and ×4 (64) are within 2 × 40; only ×8 (128) is past
    it. The old rule warned at 64 beside 'Ramp now'."""
    steps = list(range(300))
    card = recommend.build_card(RUN, LATEST, steps, [40.0] * 300, [], PLAN)
    assert card.decision.ready
    notes = {t.option.factor: t.lr_warning for t in card.tiers}
    assert notes[2] is None and notes[4] is None
    assert notes[8].startswith(
        "batch 128 exceeds 2× the gradient noise scale (40.0 sequences), the top of the "
        "policy's band: a doubling there saves at most 17% of the steps"
    )


# ------------------------------------------------------------------------------ noise chart


def _b(steps, values):
    return Buckets.from_columns(
        1,
        bucket=steps,
        last_step=steps,
        lo=values,
        hi=values,
        last=values,
        n=[1] * len(steps),
        nonfinite=[0] * len(steps),
    )


def test_noise_chart_draws_the_interval_as_a_band_and_only_points_it_stands_behind():
    # steps 1-10: point, bounds [0.5x, 2x]; 11-15: a lower bound only (|G|² not positive: no
    # point, no upper bound); 16-20: point and a lower bound of 0 (none) with an upper bound
    steps = list(range(1, 21))
    point = _b([*range(1, 11), *range(16, 21)], [10.0] * 10 + [3.0] * 5)
    lower = _b(steps, [5.0] * 10 + [30.0] * 5 + [0.0] * 5)
    upper = _b([*range(1, 11), *range(16, 21)], [20.0] * 10 + [9.0] * 5)
    fig = charts.noise_figure(point, None, lower=lower, upper=upper)
    by_name = {t.name: t for t in fig.data}
    line = by_name["noise scale (B_simple)"]
    drawn = {int(x) for x, y in zip(line.x, line.y, strict=True) if np.isfinite(y)}
    assert drawn == {*range(1, 11), *range(16, 21)}  # no point where the estimator has none
    edges = [t for t in fig.data if t.name == "90% interval"]
    assert len(edges) == 2 and edges[1].fill == "tonexty"
    lo_x = {int(x) for x, y in zip(edges[0].x, edges[0].y, strict=True) if np.isfinite(y)}
    assert lo_x == set(range(1, 11))  # only where both ends are known
    np.testing.assert_allclose([y for y in edges[1].y if np.isfinite(y)], [20.0] * 10)
    bound = by_name["lower bound only"]
    assert list(bound.x) == list(range(11, 16)) and list(bound.y) == [30.0] * 5
    assert bound.mode == "markers" and bound.marker.symbol == "triangle-up"
    assert "noise scale (B_simple) range" not in by_name  # the bucket min/max is no interval
