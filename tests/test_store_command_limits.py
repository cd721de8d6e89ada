"""Ramp commands are bounded: every payload field has a limit, named when refused; a ramp moves
the effective batch at most x8 up and never below the run's starting tier; command ids are
integers; the same idempotency key makes one command."""

from __future__ import annotations

import pytest

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store.errors import CommandError

pytestmark = pytest.mark.timeout(120)

RAMP = {"per_device_batch": 32, "accum": 8}


@pytest.fixture
def run(db_path):
    w = store.RunWriter.start(db_path, "lim", run_id="r", flush_interval=1000)
    yield w
    w.close()


@pytest.mark.parametrize(
    "payload,words",
    [
        ({**RAMP, "lr_multiplier": 1e300}, "lr_multiplier must be a finite number in (0, 64]"),
        ({**RAMP, "lr_multiplier": 10**400}, "lr_multiplier must be a finite number in (0, 64]"),
        ({**RAMP, "lr_multiplier": 64.5}, "got 64.5"),
        ({**RAMP, "lr_multiplier": -1}, "lr_multiplier"),
        ({**RAMP, "lr_multiplier": float("inf")}, "lr_multiplier"),
        ({**RAMP, "lr_multiplier": "2"}, "lr_multiplier"),
        ({"per_device_batch": 32, "accum": 10**9}, "accum must be an integer in 1 .. 4096"),
        (
            {"per_device_batch": 2**63, "accum": 8},
            "per_device_batch must be an integer in 1 .. 1048576",
        ),
        ({"per_device_batch": 2**20 + 1, "accum": 1}, "per_device_batch"),
        ({**RAMP, "note": "x" * 1_000_000}, "note must be at most 1000 characters"),
    ],
)
def test_out_of_bounds_payloads_are_refused_naming_field_and_limit(run, db_path, payload, words):
    with pytest.raises(CommandError) as e:
        commands.submit(db_path, "r", "ramp", payload, "op")
    assert words in str(e.value)
    assert commands.list_commands(db_path) == []


def test_bounds_themselves_are_accepted(run, db_path):
    cid = commands.submit(
        db_path,
        "r",
        "ramp",
        {"per_device_batch": 2**20, "accum": 4096, "lr_multiplier": 64, "note": "n" * 1000},
        "op",
    )
    assert commands.get(db_path, cid).payload["lr_multiplier"] == 64.0


def test_command_ids_must_be_integers(run, db_path):
    calls = {
        "cancel": lambda bad: commands.cancel(db_path, bad, "op"),
        "claim": lambda bad: commands.claim(db_path, bad, "op"),
        "apply": lambda bad: commands.apply(db_path, bad, 5, "op"),
        "refuse": lambda bad: commands.refuse(db_path, bad, "no", "op"),
        "get": lambda bad: commands.get(db_path, bad),
        "log": lambda bad: commands.log(db_path, bad),
    }
    for bad in ("1 OR 1=1", "7", 1.0, True, [1], -3, 0, 2**63):
        for name, call in calls.items():
            with pytest.raises(CommandError, match="command id must be") as e:
                call(bad)
            assert "Traceback" not in str(e.value), (name, bad)
    assert commands.log(db_path, None) == []  # None: every command's log


def _tiered_run(db, world_size=2):
    """Started at per-device 8 x accumulation 4 on 2 ranks: effective batch 64."""
    return store.RunWriter.start(
        db,
        "tier",
        run_id="t",
        flush_interval=1000,
        world_size=world_size,
        config={"per_device_batch": 8, "accum": 4, "world_size": world_size},
    )


def test_a_ramp_moves_the_batch_at_most_x8_and_never_below_the_start(db_path):
    w = _tiered_run(db_path)
    with pytest.raises(CommandError, match=r"below the run's starting tier .*64"):
        commands.submit(db_path, "t", "ramp", {"per_device_batch": 8, "accum": 2}, "op")
    with pytest.raises(CommandError, match=r"more than x8 .*64 .*1024"):
        commands.submit(db_path, "t", "ramp", {"per_device_batch": 64, "accum": 8}, "op")
    cid = commands.submit(db_path, "t", "ramp", {"per_device_batch": 32, "accum": 8}, "op")
    commands.cancel(db_path, cid, "op")
    # the trainer runs at 32 x 8 x 2 = 512 now: x8 from there is 4096
    w.log(10, {"per_device_batch": 32, "accum": 8})
    assert w.flush()
    with pytest.raises(CommandError, match=r"more than x8 .*512"):
        commands.submit(db_path, "t", "ramp", {"per_device_batch": 64, "accum": 64}, "op")
    commands.submit(db_path, "t", "ramp", {"per_device_batch": 64, "accum": 32}, "op")
    assert w.close()


def test_without_a_known_tier_only_the_field_bounds_apply(run, db_path):
    commands.submit(db_path, "r", "ramp", {"per_device_batch": 4096, "accum": 1}, "op")


def test_the_same_key_makes_one_command(run, db_path):
    a = commands.submit(db_path, "r", "ramp", RAMP, "dashboard:alice", key="click-1")
    b = commands.submit(db_path, "r", "ramp", RAMP, "dashboard:alice", key="click-1")
    assert a == b and len(commands.list_commands(db_path)) == 1
    commands.cancel(db_path, a, "op")
    # a replay after the command was resolved still names the first command, adds nothing
    assert commands.submit(db_path, "r", "ramp", RAMP, "dashboard:alice", key="click-1") == a
    assert len(commands.list_commands(db_path)) == 1
    with pytest.raises(CommandError, match="key 'click-1' was used for command"):
        commands.submit(db_path, "r", "ramp", {**RAMP, "accum": 4}, "op", key="click-1")
    c = commands.submit(db_path, "r", "ramp", RAMP, "op", key="click-2")
    assert c != a
    for bad in ("", "k" * 201, 5):
        with pytest.raises(CommandError, match="key must be"):
            commands.submit(db_path, "r", "ramp", RAMP, "op", key=bad)
