"""Nothing at a step boundary waits on the database: the writer's flusher claims the run's pending
commands and hands them over in memory (take_claimed_commands), and results are queued
(command_applied / command_refused), even while another process holds the database for
seconds."""

from __future__ import annotations

import subprocess
import time

import pytest

from rampwatch import store
from rampwatch.store import commands
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(120)

RAMP = {"per_device_batch": 16, "accum": 4}


def _take_within(w, seconds: float) -> list:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = w.take_claimed_commands()
        if got:
            return got
        time.sleep(0.02)
    return []


def test_a_step_boundary_never_waits_on_a_locked_database(procs, db_path):
    w = store.RunWriter.start(db_path, "nb", run_id="r", flush_interval=0.1)  # 10 s lock wait
    assert w.take_claimed_commands() == []  # switches the writer to claiming for us
    cid = commands.submit(db_path, "r", "ramp", RAMP, "dashboard:op")
    holder = procs.spawn(
        ["tests/store_child.py", "hold", str(db_path), "--duration", "3"], stdout=subprocess.PIPE
    )
    held = Lines(holder)
    held.wait_for("HOLDING")
    # the step loop while the database is locked: every boundary returns at once
    worst, step, got = 0.0, 0, []
    end = time.monotonic() + 8
    while time.monotonic() < end and not got:
        t0 = time.perf_counter()
        got = w.take_claimed_commands()  # the boundary's command check
        w.log(step, {"loss": 1.0 / (step + 1)})
        if got:
            w.command_applied(got[0].command_id, step)
        worst = max(worst, time.perf_counter() - t0)
        step += 1
        time.sleep(0.005)
    assert holder.wait(timeout=30) == 0
    assert worst < 0.05, f"a step boundary took {worst:.3f} s"
    assert [c.command_id for c in got] == [cid] and got[0].status == "claimed"
    assert "RELEASED" in held.finish()
    assert w.close()
    done = commands.get(db_path, cid)
    assert (done.status, done.applied_step) == ("applied", step - 1)
    assert [e.actor for e in commands.log(db_path, cid)] == ["dashboard:op", "trainer", "trainer"]


def test_results_are_queued_while_the_database_is_locked(procs, db_path):
    w = store.RunWriter.start(db_path, "q", run_id="r", flush_interval=0.1)
    w.take_claimed_commands()
    cid = commands.submit(db_path, "r", "ramp", RAMP, "op")
    (cmd,) = _take_within(w, 10)
    holder = procs.spawn(
        ["tests/store_child.py", "hold", str(db_path), "--duration", "2"], stdout=subprocess.PIPE
    )
    Lines(holder).wait_for("HOLDING")
    t0 = time.perf_counter()
    w.command_refused(cmd.command_id, "does not fit: 90 GB > 76 GB")
    assert time.perf_counter() - t0 < 0.05
    assert holder.wait(timeout=30) == 0
    end = time.monotonic() + 10  # written by the flusher once the lock is free, no close
    while commands.get(db_path, cid).status != "refused":
        assert time.monotonic() < end, "the queued result never reached the database"
        time.sleep(0.1)
    assert commands.get(db_path, cid).reason == "does not fit: 90 GB > 76 GB"
    assert w.close()


def test_claimed_commands_never_taken_are_refused_at_close(db_path):
    w = store.RunWriter.start(db_path, "c", run_id="r", flush_interval=1000)
    w.take_claimed_commands()
    cid = commands.submit(db_path, "r", "ramp", RAMP, "op")
    assert w.flush()  # the flusher's visit claims it; nobody takes it
    assert commands.get(db_path, cid).status == "claimed"
    assert w.close()
    got = commands.get(db_path, cid)
    assert got.status == "refused" and "before the trainer took" in got.reason


def test_nothing_is_claimed_until_the_trainer_asks(db_path):
    w = store.RunWriter.start(db_path, "old", run_id="r", flush_interval=1000)
    cid = commands.submit(db_path, "r", "ramp", RAMP, "op")
    assert w.flush()
    assert commands.get(db_path, cid).status == "pending"  # not claimed behind its back
    assert w.take_claimed_commands() == []  # the trainer asks: the next visit claims
    assert w.flush()
    (claimed,) = w.take_claimed_commands()
    assert (claimed.command_id, claimed.status) == (cid, "claimed")
    w.command_applied(cid, 3)
    assert w.close()
    assert commands.get(db_path, cid).status == "applied"
