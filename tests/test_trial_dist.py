"""Ramp trials under torchrun on the CPU: two gloo ranks of the reference trainer.

A trial command queued as the dashboard queues it runs on both ranks at the same boundary: the
same trial id, the same snapshot step, the same kept factor, the same weights after it (per-rank
debug lines, $RAMPWATCH_DEBUG_RANKS); rank 0 alone writes one trial_start / trial_arm / trial_end
set; the command is applied at continue_step and both ranks go on at the kept tier with equal
weights to the end (the trial's copies in files, --trial-snapshots disk: each rank's own folder,
removed after). A SIGKILL of one rank mid-trial: torchrun restarts both, the run resumes from
the checkpoint at the snapshot with the trial recorded abandoned, once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.dist import weights_digest
from tests.procs import child_env, kill_group, spawn
from tests.test_dist import finish, rank_lines, torchrun
from tests.trainer_runs import metric

pytestmark = pytest.mark.slow

# 2 ranks × 4 per device × accum 1: 8 sequences of 128 tokens a step; ×2 by accumulation
COMMON = ("--no-plan", "--per-device-batch", "4", "--accum", "1", "--checkpoint-every", "0")
COMMON += ("--total-tokens", "10000000000")
DELTA = 4 * 8 * 128  # 4 control steps, 2 steps at ×2
TRIAL_LINE = re.compile(
    r"rampwatch-trial rank=(\d+) pid=(\d+) (start|end|abandoned) trial=(-?\d+) step=(\d+)"
    r"(?: kept=(\d+) continue=(\d+) digest=(\w+))?"
)
WEIGHTS_LINE = re.compile(r"rampwatch-weights rank=(\d+) digest=(\w+)")


def trial_lines(out: str) -> list[dict]:
    keys = ("rank", "pid", "what", "trial", "step", "kept", "continue", "digest")
    rows = []
    for m in TRIAL_LINE.finditer(out):
        row = dict(zip(keys, m.groups(), strict=True))
        rows.append(
            {k: v if k in ("what", "digest") or v is None else int(v) for k, v in row.items()}
        )
    return rows


def last_weights(out: str) -> dict[int, str]:
    """{rank: weights digest} of each rank's last teardown line."""
    return {int(r): d for r, d in WEIGHTS_LINE.findall(out)}


def watch(proc: subprocess.Popen, on_line, timeout: float = 240) -> str:
    """Read the job's output line by line (on_line(line, all lines so far) may act on it), then
    its exit; fails with the output when it does not succeed."""
    lines: list[str] = []
    watchdog = threading.Timer(timeout, kill_group, [proc])  # reading stdout could block forever
    watchdog.start()
    try:
        for raw in proc.stdout:
            lines.append(raw.decode())
            on_line(lines[-1], lines)
    finally:
        watchdog.cancel()
    out = "".join(lines)
    try:
        return out + finish(proc, timeout=60)
    except AssertionError as e:  # finish() shows only what was left unread: show all of it
        raise AssertionError(f"{e}\n{out[-6000:]}") from None


def test_a_trial_runs_the_same_arms_on_both_ranks_and_they_go_on_at_the_kept_tier(tmp_path):
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    # the flusher's claim takes about a second, 30-40 steps of this run on an idle machine:
    # room for five times that
    steps = 200
    proc = spawn(  # the copies in files: every rank in its own folder beside the checkpoint
        torchrun(
            db, ck, "--run-id", "d", "--steps", str(steps), "--trial-snapshots", "disk", *COMMON
        ),
        env=child_env(RAMPWATCH_DEBUG_RANKS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    submitted = []

    def on_line(line, _):  # queued once rank 0 trains, so the run is 'running'
        if not submitted and "rampwatch-rank rank=0 step=2 " in line:
            payload = {"factors": [2], "delta_tokens": DELTA}
            submitted.append(commands.submit(db, "d", "trial", payload, actor="test (dashboard)"))

    out = watch(proc, on_line)
    assert submitted, out[-6000:]
    cid = submitted[0]

    # every rank ran the same trial from the same step and kept the same arm, with equal weights
    rows = trial_lines(out)
    starts = {r["rank"]: r for r in rows if r["what"] == "start"}
    ends = {r["rank"]: r for r in rows if r["what"] == "end"}
    assert sorted(starts) == sorted(ends) == [0, 1], out[-6000:]
    assert len(rows) == 4, rows
    assert starts[0]["trial"] == starts[1]["trial"] == cid
    s = starts[0]["step"]
    assert starts[1]["step"] == s
    kept, cont = ends[0]["kept"], ends[0]["continue"]
    assert (ends[1]["kept"], ends[1]["continue"]) == (kept, cont)
    assert ends[0]["digest"] == ends[1]["digest"], "the ranks left the trial with other weights"
    assert cont == s + DELTA // (kept * 8 * 128) and cont < steps

    # rank 0 alone wrote one start, one end and one set of arm points; applied at continue_step
    events = reader.events(db, "d")
    [start] = [e for e in events if e.kind == M.EVENT_TRIAL_START]
    [end] = [e for e in events if e.kind == M.EVENT_TRIAL_END]
    assert start.step == s and start.data["trial_id"] == cid
    assert start.data["tier"] == {"per_device_batch": 4, "accum": 1}
    done = [e.data["factor"] for e in events if e.kind == M.EVENT_TRIAL_ARM and e.data["done"]]
    assert sorted(done) == [1, 2]
    assert (end.step, end.data["kept_factor"], end.data["continue_step"]) == (cont, kept, cont)
    assert f"files in {ck}/d.trial/" in end.data["snapshots"]
    assert list((ck / "d.trial").iterdir()) == []
    cmd = commands.get(db, cid)
    assert (cmd.status, cmd.applied_step) == ("applied", cont)

    # no step of either rank ran between S and continue_step; after it, both at the kept tier
    ranks = rank_lines(out)
    expected = [*range(1, s + 1), *range(cont + 1, steps + 1)]
    assert sorted(ranks[0]) == sorted(ranks[1]) == expected
    for r in (0, 1):
        assert {ranks[r][t][:2] for t in range(cont + 1, steps + 1)} == {(4, kept)}
    assert metric(db, "d", M.BATCH_SEQS)[steps] == 8 * kept
    # the data position after the trial: S's + Δ, split between the ranks as every step's
    first = metric(db, "d", M.FIRST_SAMPLE)
    assert first[cont + 1] == first[s] + 8 + DELTA // 128
    assert ranks[1][cont + 1][2] == ranks[0][cont + 1][2] + 4 * kept

    # the run's end: the same weights on both ranks, and they are the checkpoint's
    final = last_weights(out)
    assert final[0] == final[1] == weights_digest(ckpt.load(ck / "d.pt")["model"])
    assert reader.get_run(db, "d").status == "finished"


def test_a_rank_killed_mid_trial_resumes_from_the_snapshot_with_the_trial_abandoned(tmp_path):
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    steps = 40
    proc = spawn(
        torchrun(db, ck, "--run-id", "k", "--steps", str(steps), *COMMON, restarts=1),
        env=child_env(RAMPWATCH_DEBUG_RANKS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    submitted, killed = [], []

    def on_line(line, lines):
        if not submitted and "rampwatch-rank rank=0 step=2 " in line:
            # the default Δ here: 16 steps of ×4 = 64 control steps: time to kill in
            submitted.append(commands.submit(db, "k", "trial", {"factors": [2, 4]}, actor="test"))
        if submitted and not killed and "trial_arm" in line:  # rank 0's echo: arms are running
            [rank1] = [r for r in trial_lines("".join(lines)) if r["rank"] == 1]
            os.kill(rank1["pid"], signal.SIGKILL)
            killed.append(rank1)

    out = watch(proc, on_line)
    assert killed, out[-6000:]
    assert "restart 1: resuming run k" in out, out[-6000:]
    s, cid = killed[0]["step"], submitted[0]

    assert_resumed_from_the_snapshot(db, ck, "k", out, s, cid, steps)


def test_an_error_in_one_ranks_arm_abandons_the_trial_on_every_rank(tmp_path):
    """An out-of-memory injected into rank 1's control arm: rank 1 alone cannot restore and go
    on (its peer is inside the arm's all-reduce), so every rank stops and torchrun's restart
    resumes from the checkpoint at S with the trial abandoned."""
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    # the control arm's steps are S+1 .. S+64: step 42 is in it for any S the run reaches (the
    # claim takes a second or more; under load the run passed step 30 before it), and the run
    # itself (40 steps) never gets there
    steps, oom_step = 40, 42
    args = torchrun(db, ck, "--run-id", "e", "--steps", str(steps), *COMMON, restarts=1)
    proc = spawn(
        [*args, "--inject-oom", f"{oom_step}:0:forward"],
        env=child_env(RAMPWATCH_DEBUG_RANKS="1", RAMPWATCH_INJECT_OOM_RANK="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    submitted = []

    def on_line(line, _):
        if not submitted and "rampwatch-rank rank=0 step=2 " in line:
            submitted.append(commands.submit(db, "e", "trial", {"factors": [2, 4]}, actor="test"))

    out = watch(proc, on_line, timeout=180)
    assert submitted, out[-6000:]
    rows = trial_lines(out)
    starts = {r["step"] for r in rows if r["what"] == "start"}
    assert len(starts) == 1, f"trial starts {starts}\n{out[-6000:]}"
    [s] = starts
    assert s < oom_step, f"the trial started at step {s}, after the injected step"
    assert not [r for r in rows if r["what"] == "end"]
    assert "restart 1: resuming run e" in out, out[-6000:]
    assert_resumed_from_the_snapshot(db, ck, "e", out, s, submitted[0], steps)
    assert {r["rank"] for r in rows if r["what"] == "abandoned"} == {0, 1}, out[-6000:]


def assert_resumed_from_the_snapshot(db, ck, run_id, out, s, cid, steps) -> None:
    """The trial from S recorded abandoned once, its command refused, no branch kept; the
    restarted ranks went on from S exactly (every step once, the samples after S's) to the end
    with equal weights."""
    events = reader.events(db, run_id)
    [start] = [e for e in events if e.kind == M.EVENT_TRIAL_START]
    assert start.step == s and start.data["trial_id"] == cid
    assert not [e for e in events if e.kind == M.EVENT_TRIAL_END]
    [abandoned] = [e for e in events if e.kind == M.EVENT_TRIAL_ABANDONED]
    assert abandoned.step == s and abandoned.data["trial_id"] == cid
    assert "\n" not in abandoned.message and len(abandoned.message) < 500, abandoned.message
    assert commands.get(db, cid).status == "refused"
    assert not [e for e in events if e.kind == M.EVENT_RAMP]

    # the restarted ranks continued from S exactly: every step once, the samples after S's
    run_ = reader.get_run(db, run_id)
    assert run_.status == "finished" and run_.last_step == steps and run_.world_size == 2
    first, batch = metric(db, run_id, M.FIRST_SAMPLE), metric(db, run_id, M.BATCH_SEQS)
    assert sorted(first) == list(range(1, steps + 1))
    for step in range(2, steps + 1):
        assert first[step] == first[step - 1] + batch[step - 1]
    assert set(metric(db, run_id, M.ACCUM).values()) == {1}
    final = last_weights(out)
    assert final[0] == final[1] == weights_digest(ckpt.load(ck / f"{run_id}.pt")["model"])
