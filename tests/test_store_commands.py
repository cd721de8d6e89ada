"""The command queue: validation, legal and illegal status changes, one open ramp per run,
the log of every change, and refusal of a dead run's commands."""

from __future__ import annotations

import subprocess
from itertools import pairwise

import pytest

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store.errors import CommandError
from tests.procs import kill_group
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(120)  # pytest.ini says 300 s; these are far shorter

RAMP = {"per_device_batch": 32, "accum": 8}
EVIL = "x'); DROP TABLE commands;--"


@pytest.fixture
def run(db_path):
    w = store.RunWriter.start(db_path, "cmds", run_id="r", flush_interval=1000)
    yield w
    w.close()


@pytest.mark.parametrize(
    "kind,payload,words",
    [
        ("grow", RAMP, "unknown command kind 'grow'"),
        ("ramp", [32, 8], "payload must be a dict"),
        ("ramp", {"accum": 8}, "per_device_batch must be an integer in 1 .. 1048576, got None"),
        (
            "ramp",
            {"per_device_batch": 0, "accum": 8},
            "per_device_batch must be an integer in 1 .. 1048576, got 0",
        ),
        ("ramp", {"per_device_batch": "32", "accum": 8}, "got '32' (str)"),
        ("ramp", {"per_device_batch": True, "accum": 8}, "got True (bool)"),
        (
            "ramp",
            {"per_device_batch": 32, "accum": 2.0},
            "accum must be an integer in 1 .. 4096, got 2.0",
        ),
        ("ramp", {**RAMP, "lr_multiplier": 0}, "lr_multiplier must be a finite number in (0, 64]"),
        ("ramp", {**RAMP, "lr_multiplier": float("nan")}, "lr_multiplier must be a finite number"),
        ("ramp", {**RAMP, "note": 3}, "note must be a string"),
        (
            "ramp",
            {**RAMP, "seq_len": 4096},
            "unknown field(s) 'seq_len'; allowed: per_device_batch",
        ),
    ],
)
def test_invalid_payloads_are_rejected_with_the_reason(run, db_path, kind, payload, words):
    with pytest.raises(CommandError) as e:
        commands.submit(db_path, "r", kind, payload, "op")
    assert words in str(e.value)
    assert commands.list_commands(db_path) == []


def test_submit_needs_a_running_run_and_an_actor(run, db_path):
    with pytest.raises(CommandError, match="no run 'ghost'"):
        commands.submit(db_path, "ghost", "ramp", RAMP, "op")
    with pytest.raises(CommandError, match="needs an actor"):
        commands.submit(db_path, "r", "ramp", RAMP, " ")
    store.RunWriter.start(db_path, "done", run_id="done").close()
    with pytest.raises(CommandError, match="run 'done' is finished, not running"):
        commands.submit(db_path, "done", "ramp", RAMP, "op")


def test_lifecycle_log_and_one_open_ramp_per_run(run, db_path):
    cid = commands.submit(
        db_path, "r", "ramp", {**RAMP, "lr_multiplier": 2, "note": EVIL}, "dashboard:alice"
    )
    c = commands.get(db_path, cid)
    assert (c.status, c.actor, c.payload) == (
        "pending",
        "dashboard:alice",
        {**RAMP, "lr_multiplier": 2.0, "note": EVIL},
    )
    with pytest.raises(CommandError, match=f"already has ramp command #{cid} pending"):
        commands.submit(db_path, "r", "ramp", RAMP, "op")
    assert commands.claim(db_path, cid, "trainer").status == "claimed"
    with pytest.raises(CommandError, match=f"already has ramp command #{cid} claimed"):
        commands.submit(db_path, "r", "ramp", RAMP, "op")
    done = commands.apply(db_path, cid, 400, "trainer")
    assert (done.status, done.applied_step) == ("applied", 400)
    cid2 = commands.submit(db_path, "r", "ramp", RAMP, "op")  # the ramp slot is free again
    assert commands.cancel(db_path, cid2, "dashboard:bob").status == "cancelled"
    cid3 = commands.submit(db_path, "r", "ramp", RAMP, "op")
    refused = commands.refuse(
        db_path, cid3, "64 does not fit: predicted 150 GB > 141 GB", "trainer"
    )
    assert refused.reason.startswith("64 does not fit")
    assert [c.command_id for c in commands.list_commands(db_path, "r", "cancelled")] == [cid2]
    log = commands.log(db_path)
    assert [(e.command_id, e.from_status, e.to_status, e.actor) for e in log] == [
        (cid, None, "pending", "dashboard:alice"),
        (cid, "pending", "claimed", "trainer"),
        (cid, "claimed", "applied", "trainer"),
        (cid2, None, "pending", "op"),
        (cid2, "pending", "cancelled", "dashboard:bob"),
        (cid3, None, "pending", "op"),
        (cid3, "pending", "refused", "trainer"),
    ]
    assert log[2].detail == "at step 400" and log[-1].detail.startswith("64 does not fit")
    assert all(a.t <= b.t for a, b in pairwise(log))


ILLEGAL = [
    (
        [],
        "applied",
        "is pending; it cannot become applied (from pending only: claimed, cancelled, refused)",
    ),
    (["claimed"], "cancelled", "is claimed; it cannot become cancelled"),
    (["claimed"], "claimed", "is claimed; it cannot become claimed"),
    (["cancelled"], "claimed", "is cancelled; it cannot become claimed (cancelled is final)"),
    (["claimed", "applied"], "refused", "is applied; it cannot become refused"),
    (["refused"], "cancelled", "is refused; it cannot become cancelled"),
]


@pytest.mark.parametrize("path,to,words", ILLEGAL)
def test_illegal_transitions_raise_and_change_nothing(run, db_path, path, to, words):
    cid = commands.submit(db_path, "r", "ramp", RAMP, "op")
    do = {
        "claimed": lambda: commands.claim(db_path, cid, "t"),
        "cancelled": lambda: commands.cancel(db_path, cid, "t"),
        "refused": lambda: commands.refuse(db_path, cid, "no", "t"),
        "applied": lambda: commands.apply(db_path, cid, 5, "t"),
    }
    for step in path:
        do[step]()
    before = commands.log(db_path, cid)
    with pytest.raises(CommandError) as e:
        do[to]()
    assert words in str(e.value)
    assert commands.log(db_path, cid) == before
    assert commands.get(db_path, cid).status == (path[-1] if path else "pending")


def test_results_need_their_step_or_reason(run, db_path):
    cid = commands.submit(db_path, "r", "ramp", RAMP, "op")
    commands.claim(db_path, cid, "t")
    with pytest.raises(CommandError, match="needs the step"):
        commands.apply(db_path, cid, None, "t")
    with pytest.raises(CommandError, match="needs a reason"):
        commands.refuse(db_path, cid, "", "t")
    with pytest.raises(CommandError, match="no command #999"):
        commands.claim(db_path, 999, "t")


def test_a_killed_run_refuses_its_open_commands(procs, db_path):
    child = procs.spawn(
        [
            "tests/store_child.py",
            "log",
            str(db_path),
            "--run-id",
            "d",
            "--last",
            "5",
            "--exit-mode",
            "wait",
        ],
        stdout=subprocess.PIPE,
    )
    Lines(child).wait_for("WAITING")
    c1 = commands.submit(db_path, "d", "ramp", RAMP, "op")
    commands.claim(db_path, c1, "trainer")
    kill_group(child)
    with pytest.raises(CommandError, match="run 'd' is killed, not running"):
        commands.submit(db_path, "d", "ramp", RAMP, "op")  # submit recovered the run first
    got = commands.get(db_path, c1)
    assert (got.status, got.reason) == ("refused", "run killed")
    assert commands.log(db_path, c1)[-1].actor == "recovery"
    assert store.get_run(db_path, "d").stored_status == "killed"


def test_delete_run_removes_everything_of_that_run_only(db_path):
    keep = store.RunWriter.start(db_path, "keep", run_id="keep")
    keep.log(1, {"a": 1.0})
    w = store.RunWriter.start(db_path, "gone", run_id="gone")
    w.log(1, {"a": 1.0})
    w.event("e")
    w.memory_plan(4, predicted_bytes=1)
    cid = commands.submit(db_path, "gone", "ramp", RAMP, "op")
    with pytest.raises(store.StoreError, match="live writer"):
        store.delete_run(db_path, "gone")
    assert w.close()
    store.delete_run(db_path, "gone")
    from rampwatch.store.db import read_connection
    from rampwatch.store.schema import RUN_TABLES

    # through the store's lock: keep's flusher opens the file read-write on its visits, and
    # one process may not hold it with two configurations at once
    with read_connection(db_path) as con:
        for table in RUN_TABLES:
            n = con.execute(f"SELECT count(*) FROM {table} WHERE run_id = 'gone'").fetchall()
            assert n == [(0,)], table
        assert con.execute(
            "SELECT count(*) FROM command_log WHERE command_id = ?", [cid]
        ).fetchall() == [(0,)]
    assert keep.close() and [r.run_id for r in store.list_runs(db_path)] == ["keep"]
