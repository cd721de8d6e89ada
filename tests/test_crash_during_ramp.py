"""A crash after a ramp, in real processes: the reference trainer is SIGKILLed a few steps after
applying an approved ramp, `rampwatch recover` marks it killed, and `--resume` continues it. The
record must never hold two states at once: either the resumed run carries the ramp (tier, LR, data
position exactly as the run had before the crash), or the ramp's command says the crash undid it.
The killed event stays in the run's history either way."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from rampwatch.dashboard.recommend import command_view
from rampwatch.store import CommandError, RunWriter, commands, reader, recover
from rampwatch.store import names as M
from rampwatch.store.command_rows import transition
from rampwatch.store.db import write_connection
from rampwatch.trainer import checkpoint as ckpt
from tests.procs import kill_group, wait_until
from tests.trainer_runs import metric, run_trainer, trainer_args, wait_for_step

# 4 x 2 per device, ramped to 4 x 4 by accumulation (no memory plan needed for that)
COMMON = ("--no-plan", "--per-device-batch", "4", "--accum", "2", "--total-tokens", "10000000000")
LONG = ("--steps", "100000")
RAMP = {"per_device_batch": 4, "accum": 4}
PER_STEP = (M.LR, M.PER_DEVICE_BATCH, M.ACCUM, M.BATCH_SEQS, M.FIRST_SAMPLE, M.TOKENS_SEEN)


def _applied(db, command_id: int, timeout: float = 120) -> commands.Command:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cmd = commands.get(db, command_id)
        if cmd.status != "pending" and cmd.status != "claimed":
            assert cmd.status == "applied", cmd.reason
            return cmd
        time.sleep(0.2)
    raise AssertionError(f"command {command_id} still {cmd.status} after {timeout}s")


def _ramp_then_kill(
    procs, tmp_path, db, ck, run_id: str, *args: str, after: int = 3
) -> tuple[int, int, int]:
    """Start the trainer (args), approve RAMP once it has logged step `after`, SIGKILL it a few
    steps after the ramp, recover. Returns (command id, ramp step, the killed run's last step)."""
    log = tmp_path / f"{run_id}.log"
    with open(log, "wb") as err:
        proc = procs.spawn(
            trainer_args(db, ck, *args, *COMMON, *LONG), stdout=subprocess.DEVNULL, stderr=err
        )
    start = wait_for_step(db, run_id, after, proc)
    cid = commands.submit(db, run_id, "ramp", RAMP, actor="test")
    wait_until(lambda: f"ramp (command {cid})" in log.read_text(), timeout=120)
    n = _applied(db, cid).applied_step
    assert n >= start
    wait_for_step(db, run_id, n + 3, proc)  # a few steps on the new tier reached the database
    kill_group(proc, signal.SIGKILL)
    report = recover(db)
    assert run_id in report.killed_runs
    killed_at = reader.get_run(db, run_id).last_step
    assert killed_at > n
    return cid, n, killed_at


def _per_step(db, run_id: str, steps: range) -> dict[str, dict[int, float]]:
    out = {}
    for name in PER_STEP:
        values = metric(db, run_id, name)
        out[name] = {s: values[s] for s in steps}
    return out


def _card_line(db, run_id: str):
    """The card's command line, built by the dashboard's own function from the real rows."""
    return command_view(commands.list_commands(db, run_id)[-1])


def _killed_events(db, run_id: str) -> list:
    return [e for e in reader.events(db, run_id) if e.kind == "killed"]


@pytest.mark.slow
def test_a_resume_after_a_crash_continues_at_the_ramped_tier(tmp_path, procs):
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    cid, n, killed_at = _ramp_then_kill(
        procs, tmp_path, db, ck, "r", "--run-id", "r", "--checkpoint-every", "500"
    )  # far apart: a fast machine runs tens of steps between the kill's poll and the kill
    saved = [e.step for e in reader.events(db, "r") if e.kind == M.EVENT_CHECKPOINT]
    assert saved and max(saved) == n, (saved, n)  # killed before the next periodic checkpoint
    after_ramp = range(n + 1, killed_at + 1)
    uninterrupted = _per_step(db, "r", after_ramp)  # the run itself, ramped at n, before the kill

    done = run_trainer(db, ck, "--resume", "r", "--steps", str(killed_at), *COMMON)
    assert done.returncode == 0, done.stdout

    resumed = _per_step(db, "r", after_ramp)
    for name in PER_STEP:
        assert resumed[name] == pytest.approx(uninterrupted[name], rel=1e-12), name
    assert set(resumed[M.ACCUM].values()) == {RAMP["accum"]}
    line = _card_line(db, "r")
    assert (line.command_id, line.status, line.applied_step) == (cid, "applied", n)
    [killed] = _killed_events(db, "r")
    assert (killed.step, killed.data["original_step"]) == (n, killed_at)
    [resume] = [e for e in reader.events(db, "r") if e.kind == M.EVENT_RESUME]
    assert resume.step == n and "killed" in resume.message


@pytest.mark.slow
def test_a_ramp_the_resumed_checkpoint_lacks_is_recorded_as_undone(tmp_path, procs):
    """Resumed from a checkpoint older than the ramp (here: the newest one was lost and the one
    before it restored), the ramp is not in the run: its command must not say 'applied'."""
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    first = run_trainer(db, ck, "--run-id", "u", "--steps", "8", "--checkpoint-every", "0", *COMMON)
    assert first.returncode == 0, first.stdout
    path, older = ckpt.checkpoint_path(ck, "u"), tmp_path / "step8.pt"
    shutil.copy(path, older)
    cid, n, killed_at = _ramp_then_kill(
        procs, tmp_path, db, ck, "u", "--resume", "u", "--checkpoint-every", "0", after=11
    )
    shutil.copy(older, path)

    done = run_trainer(db, ck, "--resume", "u", "--steps", str(killed_at), *COMMON)
    assert done.returncode == 0, done.stdout

    cmd = commands.get(db, cid)
    assert cmd.status == "undone" and cmd.applied_step is None
    assert "undone by the crash: resumed from step 8" in cmd.reason
    line = _card_line(db, "u")
    assert line.status != "applied" and "was applied" not in line.text, line.text
    assert "resumed from step 8" in line.text
    # the run itself: the old tier after step 8, no ramp marker past it
    accum = metric(db, "u", M.ACCUM)
    assert {accum[s] for s in range(9, killed_at + 1)} == {2}
    events = reader.events(db, "u")
    assert not [e for e in events if e.kind == M.EVENT_RAMP and e.step > 8]
    [killed] = _killed_events(db, "u")
    assert (killed.step, killed.data["original_step"]) == (8, killed_at)
    resume = [e for e in events if e.kind == M.EVENT_RESUME][-1]
    assert f"ramp #{cid} undone" in resume.message and "1 ramp" in resume.message


def test_only_an_applied_command_can_be_undone_and_undone_is_final(tmp_path):
    db = tmp_path / "runs.duckdb"
    w = RunWriter.start(db, "r", run_id="r", config={"per_device_batch": 4, "accum": 2})
    try:
        cid = commands.submit(db, "r", "ramp", RAMP, actor="test")
        with write_connection(db) as con:
            with pytest.raises(CommandError, match="cannot become undone"):
                transition(con, cid, "undone", "test", reason="x")
            transition(con, cid, "claimed", "test")
            transition(con, cid, "applied", "test", step=5)
            with pytest.raises(CommandError, match="needs a reason"):
                transition(con, cid, "undone", "test")
            transition(con, cid, "undone", "test", reason="undone by the crash")
            with pytest.raises(CommandError, match="undone is final"):
                transition(con, cid, "applied", "test", step=6)
    finally:
        w.close()
    assert [e.to_status for e in commands.log(db, cid)][-1] == "undone"
