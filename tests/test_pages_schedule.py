"""The live page's schedule section (AppTest on databases written by the real RunWriter): a run
whose noise scale grows exactly as A·√tokens gets its first projected ramp where the card's
forecast puts it and the next where the closed form puts it from there, with steps and hours
against the constant batch; a hand plan typed in the field is kept in
the URL (a reload reads it back), a bad one shows its one-line message, and a plan step the run
has reached is offered on the card and approved through the same Approve, as a ramp command."""

from __future__ import annotations

import math
import re

import pytest

from rampwatch.store import commands
from tests import seed

STEP_TOKENS = 16 * seed.SEQ_LEN  # live_run: 8 × 2 sequences of 128
NOW = 400 * STEP_TOKENS  # its 400 steps
BUDGET = 10 * NOW
A = 14.4 / math.sqrt(NOW)  # noise scale = A·√tokens: 14.4 now, below the batch of 16
CHART = "Schedule: batch vs tokens seen"


def _power_law(step):
    b = A * math.sqrt((step + 1) * STEP_TOKENS)
    return b, 0.6 * b, 1.6 * b


@pytest.fixture
def growing(db_path):
    run = seed.live_run(db_path, noise=_power_law, total_tokens=BUDGET)
    yield run
    run.close()


def _crossing(b):
    return (b / A) ** 2


def _table(at) -> dict[str, dict]:
    [t] = [d.value for d in at.dataframe if "steps saved" in d.value.columns]
    return {row["schedule"]: dict(row) for _, row in t.iterrows()}


def _app(monkeypatch, db, plan=None, run_id=None):
    """The app as a browser with `?plan=…&run=…` in its address opens it."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("RAMPWATCH_DB", str(db))
    monkeypatch.setenv("RAMPWATCH_TOKEN", seed.TOKEN)
    monkeypatch.delenv("RAMPWATCH_READ_ONLY", raising=False)
    at = AppTest.from_file(str(seed.APP), default_timeout=60)
    if plan is not None:
        at.query_params["plan"] = plan
    if run_id is not None:
        at.query_params["run"] = run_id
    return at.run()


def test_the_section_projects_the_closed_form_ramps_with_steps_and_hours(growing, monkeypatch):
    at = seed.app(monkeypatch, growing.db)
    assert not at.exception
    fig = seed.figures(at)[CHART]
    names = seed.trace_names(fig)
    assert {"run so far", "projected", "projected range"} <= set(names)
    assert "hand plan" not in names
    shapes = {s["name"]: s["x0"] for s in fig["layout"]["shapes"]}
    assert shapes == {"budget": BUDGET, "now": NOW}
    run = next(t for t in fig["data"] if t["name"] == "run so far")
    assert set(run["y"]) == {STEP_TOKENS} and run["x"][-1] == NOW
    # the first ramp ×2 where the card's forecast puts it (not the law's (16/A)²: the card's
    # range held more often on recorded runs), in the card's stated range; then ×2 where A·√T,
    # moved through that ramp, reaches 32: at 4 × its tokens; 64's is past the budget
    text = seed.texts(at)
    point, first, last = (
        int(n.replace(",", ""))
        for n in re.search(
            r"first ramp at the card's forecast, step ([\d,]+) \(range ([\d,]+)–([\d,]+)", text
        ).groups()
    )
    assert f"expected to cross between steps {first:,} and {last:,}" in text  # the card's
    assert first < point < last
    projected = next(t for t in fig["data"] if t["name"] == "projected")
    ramps = [NOW + (point - 399) * STEP_TOKENS]
    ramps.append(4 * ramps[0])
    assert ramps[0] != pytest.approx(_crossing(16), rel=0.01) and ramps[1] < BUDGET < 8 * ramps[0]
    assert projected["x"] == pytest.approx([NOW, *sum(([r, r] for r in ramps), []), BUDGET])
    assert (
        projected["y"]
        == [STEP_TOKENS, STEP_TOKENS, 2 * STEP_TOKENS, 2 * STEP_TOKENS] + [4 * STEP_TOKENS] * 2
    )
    ramps = projected["x"][1:4:2]  # as drawn: 4 × the first to 1e-9, not to the last bit
    first = math.ceil((ramps[0] - NOW) / STEP_TOKENS)
    second = math.ceil((ramps[1] - NOW - first * STEP_TOKENS) / (2 * STEP_TOKENS))
    cursor = NOW + first * STEP_TOKENS + second * 2 * STEP_TOKENS
    steps = first + second + math.ceil((BUDGET - cursor) / (4 * STEP_TOKENS))
    rows = _table(at)
    assert list(rows) == ["constant", "projected", "projected, early", "projected, late"]
    const, proj = rows["constant"], rows["projected"]
    assert const["steps left"] == f"{(BUDGET - NOW) // STEP_TOKENS:,}"
    assert const["steps (run)"] == f"{BUDGET // STEP_TOKENS:,}"
    assert proj["steps left"] == f"{steps:,}"
    assert proj["steps saved"] == f"{(BUDGET - NOW) // STEP_TOKENS - steps:+,}"
    assert proj["batch from now (tokens/step)"] == (
        f"2K → 4K at {ramps[0]:,.0f} tokens ({ramps[0] / BUDGET:.1%}) → 8K at {ramps[1]:,.0f} "
        f"tokens ({ramps[1] / BUDGET:.1%})"
    )
    # the constant tier was timed (measured), 32 × 2 never ran: its hours are unknown, and why
    assert const["hours left"] != "unknown" and float(const["hours left"]) > 0
    assert proj["hours left"] == "unknown" and proj["hours saved"] == "unknown"
    assert "32 × 2: only per-device batch 8 was measured" in proj["why unknown"]
    assert "; after it, the noise scale extrapolated as a power of the tokens" in text
    assert "(noise scale ∝ tokens^0.5" in text and "narrower than the truth" in text
    assert "not stored in the database" in text


def test_a_typed_plan_is_kept_in_the_url_and_a_bad_one_shows_its_message(growing, monkeypatch):
    at = seed.app(monkeypatch, growing.db)
    field = at.text_input(key=f"rw_plan:{growing.run_id}")
    field.input("2K → 8X at 5%").run()
    assert not at.exception
    message = "Hand plan not read: plan step 2 ('8X at 5%'): '8X' is not a batch"
    assert [e.value for e in at.error if e.value.startswith("Hand plan")] == [
        message + "; write tokens per step (2M, 524288) or sequences (1024 seq)"
    ]
    assert at.query_params["plan"] == "2K → 8X at 5%"
    assert at.query_params["run"] == growing.run_id
    assert "hand plan" not in _table(at)
    # a reload (a new session from the same address) reads the plan back
    again = _app(monkeypatch, growing.db, plan="2K → 8K at 50%", run_id=growing.run_id)
    assert again.text_input(key=f"rw_plan:{growing.run_id}").value == "2K → 8K at 50%"
    assert "hand plan" in _table(again)
    assert "hand plan" in seed.trace_names(seed.figures(again)[CHART])
    assert "Read as: 2K = 2,048 tokens (16 sequences) from the start; 8K" in seed.texts(again)
    # an address naming another run leaves this run's field empty
    other = _app(monkeypatch, growing.db, plan="2K → 8K at 50%", run_id="another-run")
    assert not other.exception
    assert other.text_input(key=f"rw_plan:{growing.run_id}").value == ""
    assert "hand plan" not in _table(other)


def test_the_plan_s_due_step_is_approved_through_approve(growing, monkeypatch):
    at = _app(monkeypatch, growing.db, plan="2K → 8K at 5% → 16K at 90%", run_id=growing.run_id)
    assert not at.exception
    text = seed.texts(at)
    assert "Not yet." in text  # the advisor would not ramp: the step is the operator's plan
    assert "Step 2 of the hand plan ('8K at 5%', from 5.0% of the budget) is due" in text
    # ×4 of 16 sequences, as advise() chooses the tier for ×4 (16 ran out of memory: 32 × 2)
    assert at.radio(key="tier_choice").value == "hand plan ×4: 32 × 2 (73.6 GB)"
    approve = at.button(key="approve")
    assert approve.label == "Approve hand-plan step: ramp to 32 × 2 (batch 64)"
    assert not [c for c in at.checkbox if c.key == "override"]  # no override for one's own plan
    seed.sign_in(at)
    at.button(key="approve").click().run()
    assert not at.exception
    [c] = commands.list_commands(growing.db, growing.run_id)
    assert (c.kind, c.status) == ("ramp", "pending")
    assert c.payload == {"per_device_batch": 32, "accum": 2, "lr_multiplier": pytest.approx(2.0)}
    rows = _table(at)
    assert rows["hand plan"]["batch from now (tokens/step)"] == (
        f"2K → 8K now → 16K at {0.9 * BUDGET:,.0f} tokens (90.0%)"
    )


def test_a_due_step_no_ramp_command_can_carry_says_why(growing, monkeypatch):
    at = _app(monkeypatch, growing.db, plan="2K → 3K at 5%", run_id=growing.run_id)
    assert not at.exception
    assert (
        "is due, but its batch (24 sequences) is ×1.5 the running 16, not a whole factor"
        in seed.texts(at)
    )
    assert not at.radio(key="tier_choice").value.startswith("hand plan")
    assert at.button(key="approve").label.startswith("Approve early")


def test_a_run_without_a_budget_says_the_schedule_needs_one(db_path, monkeypatch):
    run = seed.live_run(db_path, noise=_power_law)
    try:
        at = seed.app(monkeypatch, run.db)
        assert not at.exception
        assert (
            "no schedule: the run records no token budget (run config total_tokens"
            in seed.texts(at)
        )
        assert CHART not in seed.figures(at)
    finally:
        run.close()


def test_a_run_that_stops_at_a_step_limit_gets_no_schedule_in_tokens(db_path, monkeypatch):
    """The trainer's --steps under a huge token budget (bench-tiny's 10¹²): the run ends at its
    step limit whatever the batch, so a ramp saves no step; the section says so, the card's
    tier table counts the steps to the limit at every tier, and a trial's cost is a share of
    the tokens to that limit."""
    run = seed.live_run(
        db_path, noise=_power_law, total_tokens=10**12, step_limit=600, trial_delta_tokens=16_384
    )
    try:
        at = seed.app(monkeypatch, run.db)
        assert not at.exception
        texts = seed.texts(at)
        assert (
            "no schedule: the run stops at its step limit (step 600, the trainer's --steps) "
            "before its token budget" in texts
        )
        assert CHART not in seed.figures(at)
        [table] = [d.value for d in at.dataframe if "tokens/s (K)" in d.value.columns]
        rows = {row["tier"]: dict(row) for _, row in table.iterrows()}
        now, double = rows["▶ now: 8 × 2"], rows["×2: 8 × 4"]
        # the run stops after logging step 600 (the trainer's steps count from 1); it is at 399
        assert (now["steps (run)"], now["steps left"]) == ("600", "201")
        assert (double["steps (run)"], double["steps left"]) == ("600", "201")
        assert float(now["ETA (h)"]) == pytest.approx(
            201 * float(now["step time (s)"]) / 3600, rel=0.05, abs=0.006
        )
        # 2 × 16,384 of the 819,200 tokens seen + 201 steps × 2,048 to come
        assert "32,768 tokens of discarded arms at most (2.66% of the run's tokens" in texts
    finally:
        run.close()


def test_a_projection_past_the_ramp_point_now_jumps_now(db_path, monkeypatch):
    above = 40.0 / math.sqrt(NOW)  # 40 now: past the ramp points of 16 and 32, short of 64's

    def noise(step):
        b = above * math.sqrt((step + 1) * STEP_TOKENS)
        return b, 0.6 * b, 1.6 * b

    run = seed.live_run(db_path, noise=noise, total_tokens=BUDGET)
    try:
        at = seed.app(monkeypatch, run.db)
        assert not at.exception
        at_64 = (64 / above) ** 2
        assert NOW < at_64 < BUDGET
        assert _table(at)["projected"]["batch from now (tokens/step)"] == (
            f"2K → 8K now → 16K at {at_64:,.0f} tokens ({at_64 / BUDGET:.1%})"
        )
    finally:
        run.close()


def test_a_stopped_run_s_schedule_reads_from_its_last_step_and_offers_no_plan_step(
    growing, monkeypatch
):
    growing.writer.close("killed")
    growing.writer = None
    at = _app(monkeypatch, growing.db, plan="2K → 8K at 5% → 16K at 90%", run_id=growing.run_id)
    assert not at.exception
    text = seed.texts(at)
    assert "Not running." in text  # the card: no ramp, no tier chooser
    assert not [r for r in at.radio if r.key == "tier_choice"]
    # the section says what its "now" is, and offers no plan step to a run that takes none
    assert (
        "The run is killed, stopped at step 399: the schedule below reads from its last step "
        "(“now”), as if it were resumed." in text
    )
    assert "is due" not in text
    assert "under Approve" not in text
    rows = _table(at)  # the projection and the plan still read, for a resume
    assert rows["hand plan"]["batch from now (tokens/step)"].startswith("2K → 8K now")


def test_hours_saved_that_round_to_zero_carry_no_sign():
    """Seen in the demo: a ramp that saves steps at the same tokens/s saved "-0.00" hours."""
    from rampwatch.dashboard.run_schedule import _signed_hours

    assert [_signed_hours(s) for s in (-5.0, 0.0, 5.0)] == ["0.00"] * 3
    assert [_signed_hours(s) for s in (-7200.0, 900.0)] == ["-2.0", "+0.25"]
