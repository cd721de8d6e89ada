"""Ramp trials in the store (issue 26): the trial command's payload and its one-open rule, the
trials table the ingest keeps from the trial_* events, the readers, a resume mid-trial, and a
v6 file that has no trials table. Every database is a real file written by a real RunWriter."""

from __future__ import annotations

import duckdb
import pytest

from rampwatch import store
from rampwatch.advisor.trial import TrialVerdict
from rampwatch.store import commands, ingest, schema
from rampwatch.store import names as M
from rampwatch.store.errors import CommandError
from tests import seed, trial_events

pytestmark = pytest.mark.timeout(120)

TRIALS_ON, TRIAL = trial_events.TRIALS_ON, trial_events.TRIAL
_start, _arms, _end, _write = (
    trial_events.start,
    trial_events.arms,
    trial_events.end,
    trial_events.write,
)


# ------------------------------------------------------------------------------- the command


@pytest.mark.parametrize(
    "payload, words",
    [
        ({"factors": []}, "factors must be a non-empty list"),
        ({"factors": [4, 2]}, "strictly increasing"),
        ({"factors": [2, 2]}, "strictly increasing"),
        ({"factors": [1, 2]}, "in 2 .. 8"),
        ({"factors": [2, 16]}, "in 2 .. 8"),
        ({"factors": [2, True]}, "factors must be"),
        ({"factors": "2,4"}, "factors must be"),
        ({"factors": [2], "delta_tokens": 0}, "delta_tokens must be null"),
        ({"factors": [2], "delta_tokens": 10**13}, "delta_tokens must be null"),
        ({"factors": [2], "delta_tokens": 1.5}, "delta_tokens must be null"),
        ({"factors": [2], "note": 3}, "trial payload note must be a string"),
        ({"factors": [2], "note": "x" * 1001}, "note must be at most 1000"),
        ({"factors": [2], "accum": 2}, "unknown field(s) 'accum'; allowed: factors"),
        ([2, 4], "trial payload must be a dict"),
    ],
)
def test_a_bad_trial_payload_names_its_field(payload, words):
    with pytest.raises(CommandError, match=words.replace("(", r"\(").replace(")", r"\)")):
        commands.validate("trial", payload)


def test_a_good_trial_payload_is_normalized():
    assert commands.validate("trial", {"factors": [2, 4, 8]}) == {
        "factors": [2, 4, 8],
        "delta_tokens": None,
    }
    assert commands.validate("trial", {"factors": [2], "delta_tokens": 4096, "note": "n"}) == {
        "factors": [2],
        "delta_tokens": 4096,
        "note": "n",
    }


def test_one_open_ramp_or_trial_per_run(db_path):
    run = seed.live_run(db_path, **TRIALS_ON)
    try:
        tid = commands.submit(db_path, run.run_id, "trial", TRIAL, actor="dashboard:a")
        with pytest.raises(CommandError, match=f"already has trial command #{tid} pending"):
            commands.submit(db_path, run.run_id, "ramp", seed.RAMP_PAYLOAD, actor="dashboard:a")
        with pytest.raises(CommandError, match=f"already has trial command #{tid} pending"):
            commands.submit(db_path, run.run_id, "trial", TRIAL, actor="dashboard:a")
        commands.claim(db_path, tid, actor="trainer")
        with pytest.raises(CommandError, match="claimed"):
            commands.submit(db_path, run.run_id, "ramp", seed.RAMP_PAYLOAD, actor="dashboard:a")
        commands.apply(db_path, tid, step=415, actor="trainer")
        rid = commands.submit(db_path, run.run_id, "ramp", seed.RAMP_PAYLOAD, actor="dashboard:a")
        with pytest.raises(CommandError, match=f"already has ramp command #{rid} pending"):
            commands.submit(db_path, run.run_id, "trial", TRIAL, actor="dashboard:a")
        # the same key makes one trial, however often it is sent
        commands.cancel(db_path, rid, actor="dashboard:a")
        a = commands.submit(db_path, run.run_id, "trial", TRIAL, actor="dashboard:a", key="k1")
        b = commands.submit(db_path, run.run_id, "trial", TRIAL, actor="dashboard:a", key="k1")
        assert a == b
        assert [c.kind for c in commands.list_commands(db_path, run.run_id)] == [
            "trial",
            "ramp",
            "trial",
        ]
    finally:
        run.close()


@pytest.mark.parametrize(
    "config, words",
    [
        ({}, "runs no ramp trials (its loop does not say"),
        ({**TRIALS_ON, "trials": False}, "runs no ramp trials"),
        ({"trials_note": "this loop cannot snapshot its data position"}, "cannot snapshot"),
        ({**TRIALS_ON, "ramp": "off", "ramp_note": "a framework"}, "takes no ramps"),
    ],
)
def test_a_run_that_runs_no_trials_refuses_a_trial_with_the_reason(db_path, config, words):
    run = seed.live_run(db_path, **config)
    try:
        assert commands.trial_refusal(store.get_run(db_path, run.run_id).config)
        with pytest.raises(CommandError, match=words.replace("(", r"\(")):
            commands.submit(db_path, run.run_id, "trial", TRIAL, actor="dashboard:a")
        assert commands.list_commands(db_path, run.run_id) == []
    finally:
        run.close()


# ---------------------------------------------------------------------- the table and readers


def test_trial_events_become_one_trial_row_and_its_points(db_path):
    run = seed.live_run(db_path, **TRIALS_ON)
    try:
        _write(run.writer, [_start()])
        [t] = store.trials(db_path, run.run_id)
        assert (t.trial_id, t.command_id, t.start_step, t.status) == (7, 7, 399, "running")
        assert (t.factors, t.delta_tokens, t.cost_tokens) == ([2, 4], 65_536, 131_072)
        assert (t.cost_fraction, t.cost_seconds, t.source) == (0.013, 120.0, "command 7")
        assert t.plan["tier"] == {"per_device_batch": 8, "accum": 2, "world_size": 1}
        assert t.message.startswith("trial ×2, ×4 from step 399") and t.verdict is None
        _write(run.writer, _arms())
        points = store.trial_points(db_path, run.run_id, 7)
        assert [(p.factor, p.tokens, p.done) for p in points] == [
            (f, n, n == 65_536) for f in (1, 2, 4) for n in (32_768, 65_536)
        ]
        assert points[1].eval_loss == 2.35 and points[0].eval_loss is None
        assert store.trial_points(db_path, run.run_id, 8) == []
        _write(run.writer, [_end()])
        [t] = store.trials(db_path, run.run_id)
        assert (t.status, t.kept_factor, t.continue_step) == ("finished", 2, 415)
        assert (t.cost_tokens, t.cost_seconds, t.start_step) == (65_536, 58.5, 399)
        assert TrialVerdict.from_dict(t.verdict).kept_k == 2
        assert t.message == "kept ×2"
    finally:
        run.close()


def test_replayed_trial_events_make_no_second_row(db_path):
    """The same events applied twice (ingest's apply_records: the writer's outbox path) leave
    one row with the same values: the row is per trial_id, updated in place."""
    run = seed.live_run(db_path, **TRIALS_ON)
    try:
        records = [{"k": "event", "t": 1.0 + i, **e} for i, e in enumerate([_start(), _end()])]
        for _ in range(2):
            with store.write_connection(db_path) as con:
                assert ingest.apply_records(con, run.run_id, records) == []
        [t] = store.trials(db_path, run.run_id)
        assert (t.status, t.kept_factor, t.start_step) == ("finished", 2, 399)
    finally:
        run.close()


def test_an_abandoned_trial_and_a_malformed_event(db_path):
    run = seed.live_run(db_path, **TRIALS_ON)
    try:
        _write(run.writer, [_start(trial_id=-1, command_id=None)])
        abandon = {"trial_id": -1, "reason": "error in arm ×4: CUDA out of memory; restored"}
        bad = {"trial_id": "seven", "factors": "x"}
        run.writer.event(M.EVENT_TRIAL_ABANDONED, "abandoned", step=399, data=abandon)
        run.writer.event(M.EVENT_TRIAL_START, "no id", step=399, data=bad)
        assert run.writer.flush()
        [t] = store.trials(db_path, run.run_id)
        assert (t.trial_id, t.command_id, t.status) == (-1, None, "abandoned")
        assert t.reason.startswith("error in arm ×4")
        # the malformed event is kept, and an alert says what could not be applied
        kinds = [e.kind for e in store.events(db_path, run.run_id)]
        assert kinds.count(M.EVENT_TRIAL_START) == 2 and M.EVENT_ALERT in kinds
    finally:
        run.close()


def test_a_resume_abandons_the_trial_it_cut_and_drops_later_ones(db_path):
    run = seed.live_run(db_path, **TRIALS_ON)
    _write(run.writer, [_start(trial_id=1, step=100), *_arms(1, 100), _end(1, 110)])
    _write(run.writer, [_start(trial_id=2, step=300), *_arms(2, 300)])  # running at the kill
    _write(run.writer, [_start(trial_id=3, step=350), _end(3, 360)])  # after the resume step
    run_id = run.run_id
    run.writer.close("killed")
    w = store.RunWriter.start(db_path, "live-run", run_id=run_id, resume_step=320)
    try:
        assert w.flush()
        by_id = {t.trial_id: t for t in store.trials(db_path, run_id)}
        assert sorted(by_id) == [1, 2]  # 3 started after step 320: gone with its events
        assert by_id[1].status == "finished"
        assert by_id[2].status == "abandoned" and "resumed from step 320" in by_id[2].reason
        [resume] = store.events(db_path, run_id, kinds=[M.EVENT_RESUME])
        assert resume.data["abandoned_trials"] == [2] and "trial 2 abandoned" in resume.message
        # a resume before a finished trial's continue step: its kept arm is not in effect
        w.close("killed")
        w = store.RunWriter.start(db_path, "live-run", run_id=run_id, resume_step=105)
        assert w.flush()
        [t1] = store.trials(db_path, run_id)  # trial 2 started at step 300: gone now
        assert t1.status == "abandoned" and "before step 110" in t1.reason
    finally:
        w.close()


def test_a_v6_file_read_only_shows_no_trials(db_path):
    schema.create_at_version(db_path, 6)
    con = duckdb.connect(str(db_path))
    con.execute(
        "INSERT INTO runs (run_id, name, status, created_at) VALUES ('r', 'v6', 'finished', 1.0)"
    )
    con.execute("INSERT INTO events VALUES ('r', 5, 1.0, 'trial_arm', NULL, '{\"trial_id\": 1}')")
    con.close()
    assert store.trials(db_path, "r", read_only=True) == []
    assert store.trial_points(db_path, "r", 1, read_only=True) == []  # no factor: no point
    assert store.schema_version(db_path, read_only=True) == 6  # nothing was upgraded
    assert store.trials(db_path, "r") == []  # a default read upgrades it: now an empty table
    assert store.schema_version(db_path, read_only=True) == schema.CURRENT_VERSION
    store.delete_run(db_path, "r")
