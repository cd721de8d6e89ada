"""The card's ramp trials (issue 26), AppTest on seeded databases: "Test ×2 / ×4 first" beside
Approve with its cost, a run that runs no trials (the reason, no button), a running trial's
progress and chart, a finished one's result, an abandoned one, and the click path (one trial
command, guarded like Approve)."""

from __future__ import annotations

import duckdb
import pytest

from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed, trial_events

pytestmark = pytest.mark.timeout(180)

BUDGET = {"total_tokens": 10_000_000}


@pytest.fixture
def trials_run(db_path):
    run = seed.live_run(db_path, **trial_events.TRIALS_ON, **BUDGET)
    yield run
    run.close()


def _progress(at) -> list[str]:
    """The trial arms' progress bars (the card's memory bar is one too)."""
    return [el.proto.text for el in at.get("progress") if " tokens" in el.proto.text]


def test_no_trial_yet_offers_test_first_with_its_cost(trials_run, monkeypatch):
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    [button] = [b for b in at.button if b.key == "test_first"]
    assert button.label == "Test ×2 / ×4 first"
    text = seed.texts(at)
    assert "Ramp trials" in text and "No trial yet" in text
    # 2 × Δ tokens, % of the run's 10M-token budget, minutes at the measured ~50k tokens/s
    assert "Cost: 2 × 65,536 = 131,072 tokens of discarded arms at most (1.31% of the run's" in text
    assert "at 50," in text and " s at " in text


def test_the_cost_in_minutes_is_at_the_runs_recent_median_throughput(trials_run, monkeypatch):
    """One fast step at the end (8× the run's ~50k tokens/s) moves neither the tier table's
    throughput nor the trial's minutes: both are medians (seen on the demo under load: the
    table said 1.0k tokens/s, the cost "at 1,714 tokens/s", the latest step's)."""
    w = trials_run.writer
    w.log(400, {M.TOKENS_PER_S: 400_000.0, M.PER_DEVICE_BATCH: 8, M.ACCUM: 2})
    assert w.flush(), w.stats()
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    text = seed.texts(at)
    assert "at 50," in text and "at 400,000 tokens/s" not in text


def test_the_tier_table_and_the_trial_cost_give_the_running_tier_one_throughput(
    trials_run, monkeypatch
):
    """The running tier sped up to 100k tokens/s for its last 40 steps (the load on its
    machine changed): its table row and the trial's minutes both say so, one number (seen on
    the demo under changing load: the table 1.3k tokens/s, the cost "at 1,644 tokens/s")."""
    w = trials_run.writer
    for s in range(400, 440):
        w.log(s, {M.TOKENS_PER_S: 100_000.0, M.PER_DEVICE_BATCH: 8, M.ACCUM: 2})
    assert w.flush(), w.stats()
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    [table] = [d for d in at.dataframe if "tokens/s (K)" in d.value.columns]
    [running] = [r for r in table.value.to_dict("records") if r["tier"].startswith("▶")]
    assert running["tokens/s (K)"] == "100.0"
    text = seed.texts(at)
    assert "at 100,000 tokens/s" in text
    assert "Throughput is measured (the median of the last 32 steps a tier ran)" in text


def test_a_run_that_runs_no_trials_shows_the_reason_and_no_button(db_path, monkeypatch):
    run = seed.live_run(db_path, trials_note="this loop cannot snapshot its data position")
    try:
        at = seed.app(monkeypatch, db_path)
        assert not at.exception
        assert "test_first" not in [b.key for b in at.button]
        assert "approve" in [b.key for b in at.button]  # ramps are still offered
        assert "runs no ramp trials: this loop cannot snapshot its data position" in seed.texts(at)
    finally:
        run.close()


def test_a_running_trial_shows_each_arm_s_progress_and_the_chart(trials_run, monkeypatch):
    arms = trial_events.arms()
    trial_events.write(trials_run.writer, [trial_events.start(), *arms[:3]])  # ×2 half done
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    assert "Trial 7 from step 399 is running" in seed.texts(at)
    assert _progress(at) == [
        "control ×1: 65,536 of 65,536 tokens (done)",
        "branch ×2: 32,768 of 65,536 tokens",
        "branch ×4: 0 of 65,536 tokens (waiting)",
    ]
    fig = seed.figures(at)["Trial arms: loss against tokens from the snapshot"]
    assert seed.trace_names(fig) == [
        "control ×1, train",
        "control ×1, held-out",
        "branch ×2, train",
    ]
    # while it runs, neither a ramp nor a second trial can be sent: both say why on a click
    at = seed.sign_in(at)
    at.run()
    at.button(key="test_first").click().run()
    assert "Not submitted: trial 7 is running" in seed.texts(at)
    assert commands.list_commands(trials_run.db, trials_run.run_id) == []


def test_a_finished_trial_shows_branches_bracket_kept_and_cost(trials_run, monkeypatch):
    events = [trial_events.start(), *trial_events.arms(), trial_events.end()]
    trial_events.write(trials_run.writer, events)
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    text = seed.texts(at)
    assert "Critical batch between 32 and 64 sequences (×2 pass, ×4 fail); continue at ×2" in text
    assert "Critical batch between 32 and 64 sequences (measured at batch 16)." in text
    assert "Kept branch ×2: the run continued from step 415. Cost: 65,536 tokens discarded" in text
    assert "Measured on 4 held-out examples." in text
    [table] = [d for d in at.dataframe if "95% upper bound" in d.value.columns]
    rows = table.value.to_dict("records")
    assert [(r["branch"], r["result"]) for r in rows] == [("×2", "pass"), ("×4", "fail")]
    assert float(rows[1]["loss difference"]) > float(rows[1]["tolerance"])
    assert seed.trace_names(seed.figures(at)["Trial arms: loss against tokens from the snapshot"])
    assert "test_first" in [b.key for b in at.button]  # another trial may follow


def test_a_branch_not_run_after_one_failed_says_so(trials_run, monkeypatch):
    """×2 fell behind, so ×4 could not change the verdict and was not run (advisor/trial.py
    `arms_left`): the table says so beside ×2's figures, the line under it why, and the summary
    counts one arm's cost."""
    end = trial_events.end(first_fails=True)
    trial_events.write(trials_run.writer, [trial_events.start(), *trial_events.arms()[:4], end])
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    text = seed.texts(at)
    assert "Critical batch below 32 sequences (×2 fail, ×4 not run); keep 16." in text
    assert "Cost: 65,536 tokens of discarded arms." in text
    [table] = [d for d in at.dataframe if "95% upper bound" in d.value.columns]
    rows = table.value.to_dict("records")
    assert [(r["branch"], r["result"]) for r in rows] == [("×2", "fail"), ("×4", "not run")]
    # its figures are blank: a missing number in a table is drawn as a grey "None"
    assert rows[1]["batch"] == 64 and rows[1]["loss difference"] == rows[1]["tolerance"] == ""
    assert rows[0]["loss difference"] == "0.6500"
    # the reason is a line under the table: in the cell it was cut at the table's width
    assert (
        "×4 not run: ×2 fell behind the control by more than its tolerance, so no larger "
        "branch could change the verdict." in text
    )


def test_a_control_measured_again_says_so_while_it_runs(trials_run, monkeypatch):
    """The second stage: the control trained its Δ, its 2 held-out examples could not tell
    whether Δ is too long, and it is evaluated again on 4 before the branches run."""
    stage = dict(
        step=399,
        kind=M.EVENT_TRIAL_ARM,
        message="trial 7: on 2 held-out examples the control could not tell",
        data={"trial_id": 7, "factor": 1, "tokens": 65_536, "loss": None, "eval_loss": None}
        | {"done": False, "first_examples": 2, "eval_examples": 4},
    )
    trial_events.write(trials_run.writer, [trial_events.start(), trial_events.arms()[0], stage])
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    assert _progress(at)[:2] == [
        "control ×1: 65,536 of 65,536 tokens (evaluating again on 4 held-out examples: 2 could "
        "not tell whether Δ is too long)",
        "branch ×2: 0 of 65,536 tokens (waiting)",
    ]
    fig = seed.figures(at)["Trial arms: loss against tokens from the snapshot"]
    assert seed.trace_names(fig) == ["control ×1, train"]  # the stage's point has no loss


def test_a_trial_measured_in_two_stages_says_both_sizes(trials_run, monkeypatch):
    finished = trial_events.end()
    finished["data"]["verdict"]["first_examples"] = 2  # its control's first 2 could not tell
    trial_events.write(trials_run.writer, [trial_events.start(), *trial_events.arms(), finished])
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    text = seed.texts(at)
    assert "Measured on 4 held-out examples (2 first, which could not tell)." in text
    assert (
        "On 2 held-out examples the control could not tell whether Δ was too long; it was "
        "measured again on 4. Critical batch between 32 and 64" in text
    )


@pytest.mark.parametrize(
    "how,said",
    [
        ("flattened", "Δ too long: the control had made most of its progress"),
        ("stalled", "The control did not improve over Δ"),
    ],
)
def test_a_trial_that_judged_nothing_is_no_answer_not_a_success(trials_run, monkeypatch, how, said):
    """Δ too long, or a control that did not learn: the card says so in an info box (a finished
    trial with a bracket is green) and states no bracket."""
    end = trial_events.end(7, 407, **{how: True})
    trial_events.write(trials_run.writer, [trial_events.start(), *trial_events.arms(), end])
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    infos = [str(e.value) for e in at.info]
    assert any(m.startswith(said) for m in infos), infos
    assert not [e for e in at.success if said in str(e.value)]
    assert "Critical batch" not in seed.texts(at)


def test_an_abandoned_trial_says_why_and_earlier_trials_are_listed(trials_run, monkeypatch):
    first = [trial_events.start(trial_id=3, step=200), trial_events.end(3, 208)]
    trial_events.write(trials_run.writer, first)
    trial_events.write(trials_run.writer, [trial_events.start(trial_id=-1, command_id=None)])
    trials_run.writer.event(
        "trial_abandoned", "x", step=399, data={"trial_id": -1, "reason": "arm ×4 diverged"}
    )
    assert trials_run.writer.flush()
    at = seed.app(monkeypatch, trials_run.db)
    assert not at.exception
    assert "Trial -1 from step 399 was abandoned: arm ×4 diverged." in seed.texts(at)
    [table] = [d for d in at.dataframe if "kept" in d.value.columns]
    [row] = table.value.to_dict("records")
    assert (row["trial"], row["status"], row["kept"]) == (3, "finished", "×2")


def test_test_first_queues_one_trial_command_however_often_clicked(trials_run, monkeypatch):
    at = seed.sign_in(seed.app(monkeypatch, trials_run.db))
    at.run()
    at.button(key="test_first").click().run()
    assert not at.exception
    [c] = commands.list_commands(trials_run.db, trials_run.run_id)
    assert (c.kind, c.payload, c.status) == (
        "trial",
        {"factors": [2, 4], "delta_tokens": None},
        "pending",
    )
    assert c.actor.startswith("alice")
    with duckdb.connect(str(trials_run.db), read_only=True) as con:  # written, never read back
        [(key,)] = con.execute(
            "SELECT idempotency_key FROM commands WHERE command_id = ?", [c.command_id]
        ).fetchall()
    assert key
    assert f"Trial #{c.command_id} (×2 / ×4) submitted" in seed.texts(at)
    at.button(key="test_first").click().run()  # a second click: no second command
    assert [x.command_id for x in commands.list_commands(trials_run.db, trials_run.run_id)] == [
        c.command_id
    ]
    text = seed.texts(at)
    assert f"Trial #{c.command_id} (×2, ×4) is pending" in text
    assert f"already waiting on trial #{c.command_id}" in text


def test_test_first_is_guarded_like_approve(trials_run, monkeypatch):
    """No token: refused and recorded, no command (the guard of Approve); read-only: no button."""
    at = seed.sign_in(seed.app(monkeypatch, trials_run.db), token="wrong")
    at.run()
    at.button(key="test_first").click().run()
    assert commands.list_commands(trials_run.db, trials_run.run_id) == []
    assert "Not submitted" in seed.texts(at)
    at = seed.app(monkeypatch, trials_run.db, read_only=True)
    assert "test_first" not in [b.key for b in at.button]
