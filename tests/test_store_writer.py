"""RunWriter in one process (plus a lock-holding child): values round-trip exactly, SQL-looking
text is stored literally, log() never raises, a busy database delays but loses nothing."""

from __future__ import annotations

import math
import os
import subprocess
import time

import numpy as np
import pytest

from rampwatch import store
from rampwatch.store import spool, spool_format
from rampwatch.store.db import spool_root
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(120)  # pytest.ini says 300 s; these are far shorter

EVIL = "x'); DROP TABLE runs;--"


def test_nonfinite_values_and_sql_looking_text_round_trip(db_path):
    w = store.RunWriter.start(
        db_path,
        EVIL,
        config={"note": EVIL, "lr": 3e-4},
        device=EVIL,
        capacity_bytes=141 * 2**30,
        world_size=8,
    )
    values = {
        "loss": math.nan,
        "up": math.inf,
        "down": -math.inf,
        EVIL: 1.5,
        'quote"\\back': -0.0,
        "ünï\ncode": 5e-324,
    }
    w.log(3, values)
    w.event(EVIL, EVIL, data={EVIL: [math.inf, None]})
    w.memory_plan(
        16, variant=EVIL, predicted_bytes=2**40, source="oom", feasible=False, breakdown={EVIL: 1}
    )
    assert w.close()
    run = store.get_run(db_path, w.run_id)
    assert (run.name, run.config["note"], run.device) == (EVIL, EVIL, EVIL)
    assert (run.capacity_bytes, run.world_size) == (141 * 2**30, 8)
    rows = store.export(db_path, w.run_id).to_pylist()
    got = {r["name"]: r["value"] for r in rows}
    assert set(got) == set(values) and all(r["step"] == 3 for r in rows)
    assert math.isnan(got["loss"]) and got["up"] == math.inf and got["down"] == -math.inf
    assert got[EVIL] == 1.5 and got["ünï\ncode"] == 5e-324
    assert math.copysign(1, got['quote"\\back']) == -1
    assert store.metric_names(db_path, w.run_id) == sorted(values)
    latest = store.latest(db_path, w.run_id, names=["loss", EVIL])
    assert set(latest) == {"loss", EVIL} and math.isnan(latest["loss"][1])
    (ev,) = store.events(db_path, w.run_id, kinds=[EVIL])
    assert (ev.kind, ev.message, ev.step) == (EVIL, EVIL, 3)
    assert ev.data[EVIL][0] == math.inf and ev.data[EVIL][1] is None
    (plan,) = store.memory_plan(db_path, w.run_id)
    assert (plan.variant, plan.source, plan.feasible, plan.breakdown) == (
        EVIL,
        "oom",
        False,
        {EVIL: 1},
    )
    s = store.series(db_path, w.run_id, "loss")
    assert s.count.tolist() == [1] and s.nonfinite.tolist() == [1] and math.isnan(s.min[0])
    # the tables are all still there
    assert {r.run_id for r in store.list_runs(db_path)} == {w.run_id}


class Floaty:
    def __float__(self):
        return 2.5


def test_log_accepts_anything_float_accepts(db_path):
    torch = pytest.importorskip("torch")
    w = store.RunWriter.start(db_path, "types")
    w.log(
        np.int64(1),
        {
            "i": 7,
            "b": True,
            "np32": np.float32(0.5),
            "np0d": np.array(1.25),
            "t": torch.tensor(3.5),
            "t_int": torch.tensor(4),
            "obj": Floaty(),
        },
    )
    w.log(torch.tensor(2), {"i": 8})
    assert w.close() and w.errors == 0, w.last_error
    got = {(r["step"], r["name"]): r["value"] for r in store.export(db_path, w.run_id).to_pylist()}
    assert got == {
        (1, "i"): 7.0,
        (1, "b"): 1.0,
        (1, "np32"): 0.5,
        (1, "np0d"): 1.25,
        (1, "t"): 3.5,
        (1, "t_int"): 4.0,
        (1, "obj"): 2.5,
        (2, "i"): 8.0,
    }


def test_log_never_raises_and_keeps_what_it_can(db_path):
    w = store.RunWriter.start(db_path, "bad", flush_interval=1000)
    w.log(1, {"ok": 1.0, "bad": "not a number", "also_ok": 2.0})
    assert w.errors == 1 and "'bad'" in w.last_error and "not a number" in w.last_error
    w.log(1.5, {"ok": 1.0})  # a fractional step is dropped, counted
    w.log("x", {"ok": 1.0})
    w.log(2.0, {"ok": 3.0})  # a float step is dropped too, integral or not
    w.log(2, {"ok": 3.0})
    w.log(3, {7: 1.0, "ok": 4.0})  # a non-str name is refused, the rest kept
    assert "the name is not a str" in w.last_error
    w.log(3, {"": 1.0, "  ": 2.0})  # so is a blank one
    assert "the name is empty" in w.last_error
    w.log(4, None)  # not even a dict
    assert w.errors == 7, w.last_error
    assert w.close()
    w.log(5, {"ok": 5.0})  # after close: counted, not raised
    assert w.errors == 8 and "closed" in w.last_error
    got = sorted(
        (r["step"], r["name"], r["value"]) for r in store.export(db_path, w.run_id).to_pylist()
    )
    assert got == [(1, "also_ok", 2.0), (1, "ok", 1.0), (2, "ok", 3.0), (3, "ok", 4.0)]


def test_events_default_to_last_step_and_validate(db_path):
    w = store.RunWriter.start(db_path, "ev", flush_interval=1000)
    w.event("start")
    w.log(10, {"a": 1})
    w.event("checkpoint", "saved", data={"path": "/ckpt/10"})
    w.event("oom", step=12)
    with pytest.raises(TypeError, match="JSON-serializable"):
        w.event("x", data={"t": object()})
    with pytest.raises(ValueError, match="source must be one of"):
        w.memory_plan(8, source="guess")
    w.update_run(device="cuda:0 H200", capacity_bytes=10)
    assert w.close()
    evs = store.events(db_path, w.run_id)
    assert [(e.kind, e.step) for e in evs] == [("start", None), ("checkpoint", 10), ("oom", 12)]
    assert [e.kind for e in store.events(db_path, w.run_id, since_step=11)] == ["oom"]
    assert store.get_run(db_path, w.run_id).device == "cuda:0 H200"


def test_busy_database_delays_but_loses_nothing(procs, db_path):
    w = store.RunWriter.start(db_path, "busy", flush_interval=0.1, lock_timeout=0.3)
    holder = procs.spawn(
        ["tests/store_child.py", "hold", str(db_path), "--duration", "2.5"], stdout=subprocess.PIPE
    )
    out = Lines(holder)
    out.wait_for("HOLDING")
    t0 = time.perf_counter()
    for step in range(100):
        w.log(step, {"a": step, "b": -step})
        time.sleep(0.01)
    assert time.perf_counter() - t0 < 2.0  # log() did not wait for the lock
    assert w.errors == 0
    with pytest.raises(store.StoreBusyError, match="busy"):
        store.list_runs(db_path, timeout=0.2)
    assert w.busy > 0 and "busy" in w.last_busy and w.last_error is None
    assert holder.wait(timeout=30) == 0
    assert w.close()
    assert store.export(db_path, w.run_id).num_rows == 200
    assert store.get_run(db_path, w.run_id).stored_status == "finished"


def test_close_while_busy_leaves_spool_and_recovery_finishes_the_run(procs, db_path):
    w = store.RunWriter.start(db_path, "late", flush_interval=1000, lock_timeout=0.2)
    for step in range(50):
        w.log(step, {"a": step})
    holder = procs.spawn(
        ["tests/store_child.py", "hold", str(db_path), "--duration", "1.5"], stdout=subprocess.PIPE
    )
    Lines(holder).wait_for("HOLDING")
    assert w.close(timeout=0.3) is False  # could not ingest: the spool stays for recovery
    assert [p.name for p in spool.list_spools(spool_root(db_path))] == [w._flusher.files.path.name]
    holder.wait(timeout=30)
    report = store.recover(db_path)
    assert report.spools[0].records == 50 and report.killed_runs == []
    run = store.get_run(db_path, w.run_id)
    assert (run.stored_status, run.last_step) == ("finished", 49)  # its own status, not killed
    assert not spool.list_spools(spool_root(db_path))


def test_forked_child_cannot_log(db_path):
    w = store.RunWriter.start(db_path, "fork", flush_interval=1000)
    w.log(0, {"a": 0.0})
    pid = os.fork()
    if pid == 0:  # the child: its log() must be refused (counted), never written
        w.log(1, {"a": 1.0, "new_name": 1.0})
        os._exit(0 if w.errors == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    w.log(2, {"a": 2.0})
    assert w.close()
    assert sorted(r["step"] for r in store.export(db_path, w.run_id).to_pylist()) == [0, 2]


def test_new_run_id_must_be_new_and_resume_needs_existing(db_path):
    store.RunWriter.start(db_path, "a", run_id="r").close()
    with pytest.raises(store.StoreError, match="already exists"):
        store.RunWriter.start(db_path, "a", run_id="r")
    with pytest.raises(store.RunNotFoundError, match="no such run"):
        store.RunWriter.start(db_path, "a", run_id="nope", resume_step=3)
    live = store.RunWriter.start(db_path, "b", run_id="live")
    with pytest.raises(store.StoreError, match="live process"):
        store.RunWriter.start(db_path, "b", run_id="live", resume_step=0)
    live.close()
    with pytest.raises(store.RunNotFoundError):
        store.get_run(db_path, "nope")


def test_claimed_commands_reach_the_writer_and_results_go_through_the_spool(db_path):
    w = store.RunWriter.start(db_path, "cmd", flush_interval=1000)
    cid = store.commands.submit(
        db_path, w.run_id, "ramp", {"per_device_batch": 32, "accum": 8, "note": EVIL}, "op"
    )
    assert w.take_claimed_commands() == []  # the trainer's way: the next visit claims
    assert w.flush()
    (cmd,) = w.take_claimed_commands()
    assert (cmd.command_id, cmd.payload["note"]) == (cid, EVIL)
    assert cmd.status == "claimed" and w.take_claimed_commands() == []
    w.command_applied(cid, 120)
    w.command_applied(cid, 121)  # illegal second result: an error event, not a crash
    assert w.close()
    done = store.commands.get(db_path, cid)
    assert (done.status, done.applied_step) == ("applied", 120)
    (err,) = store.events(db_path, w.run_id, kinds=["error"])
    assert "applied; it cannot become applied" in err.message


def test_a_quiet_writer_shows_as_stale(db_path):
    w = store.RunWriter.start(db_path, "quiet", flush_interval=1000)
    assert store.get_run(db_path, w.run_id).status == "running"
    time.sleep(0.6)
    assert store.get_run(db_path, w.run_id, stale_after=0.5).status == "stale"
    assert w.flush()  # a visit is a heartbeat
    run = store.get_run(db_path, w.run_id, stale_after=0.5)
    assert (run.status, run.stored_status) == ("running", "running")
    w.close()


def test_spool_rotation_keeps_every_row_once_and_the_disk_small(db_path):
    w = store.RunWriter.start(db_path, "rot", flush_interval=1000, rotate_bytes=4096)
    root = spool_root(db_path)
    for step in range(500):
        w.log(step, {"a": step, "b": -step})
        if step % 50 == 49:
            w.event("tick", step=step)
            assert w.flush()
            dirs = spool.list_spools(root)
            assert len(dirs) == 1 and dirs[0] == w._flusher.files.path  # the old one is gone
            assert sum(f.stat().st_size for f in dirs[0].iterdir()) < 4096 + 1024
    assert w.close()
    rows = store.export(db_path, w.run_id).to_pylist()
    assert sorted((r["step"], r["name"]) for r in rows) == sorted(
        (s, n) for s in range(500) for n in ("a", "b")
    )
    assert all(r["value"] == (r["step"] if r["name"] == "a" else -r["step"]) for r in rows)
    assert len(store.events(db_path, w.run_id, kinds=["tick"])) == 10
    assert store.get_run(db_path, w.run_id).stored_status == "finished"


def test_torn_tails_wait_until_whole(db_path):
    """A record (or a name) cut short, as a killed write would leave it, is not ingested until
    the rest arrives; nothing after it is skipped."""
    w = store.RunWriter.start(db_path, "torn", flush_interval=1000)
    w.log(0, {"a": 1.0})
    raw = spool_format.encode_one(1, 0.0, 2.0, 0) + spool_format.encode_one(2, 0.0, 3.0, 1)
    name_b = spool_format.encode_line([1, "b"])
    bin_fd = os.open(w._flusher.files.path / spool.BIN, os.O_WRONLY | os.O_APPEND)
    names_fd = os.open(w._flusher.files.path / spool.NAMES, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(bin_fd, raw[:20])
        assert w.flush()
        assert store.export(db_path, w.run_id).num_rows == 1
        os.write(bin_fd, raw[20:])  # record 1 is whole now; record 2 names id 1, not yet known
        os.write(names_fd, name_b[:-3])
        assert not w.flush()  # record 2 waits for its name: flush says not everything is in
        assert sorted(r["step"] for r in store.export(db_path, w.run_id).to_pylist()) == [0, 1]
        os.write(names_fd, name_b[-3:])
        assert w.flush()
    finally:
        os.close(bin_fd)
        os.close(names_fd)
    rows = store.export(db_path, w.run_id).to_pylist()
    assert [(r["step"], r["name"], r["value"]) for r in rows] == [
        (0, "a", 1.0),
        (1, "a", 2.0),
        (2, "b", 3.0),
    ]
    assert w.close()


def test_overlapping_readers_do_not_starve_a_writer(procs, db_path):
    store.RunWriter.start(db_path, "x").close()
    readers = [
        procs.spawn(
            ["tests/store_child.py", "readloop", str(db_path), "--duration", "8", "--hold", "0.08"],
            stdout=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for r in readers:
        Lines(r).wait_for("READING")
    waits = []
    for _ in range(5):
        t0 = time.perf_counter()
        with store.write_connection(db_path, timeout=3.0) as con:
            con.execute("SELECT 1").fetchall()
        waits.append(time.perf_counter() - t0)
        time.sleep(0.1)
    assert max(waits) < 2.0, waits  # a writer waits for the readers inside, not for all later
