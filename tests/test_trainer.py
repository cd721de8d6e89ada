"""The reference trainer as a real process: every metric reaches the store, it learns, it
resumes as the same run without logging a step twice or skipping a sample, and the README's
own-loop snippet works."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from rampwatch.store import names as M
from rampwatch.store import reader
from rampwatch.trainer import checkpoint as ckpt
from tests.procs import REPO, kill_group, spawn
from tests.trainer_runs import metric, run_trainer, trainer_args, wait_for_step

pytestmark = pytest.mark.slow

PER_STEP = {
    M.LOSS,
    M.GRAD_NORM,
    M.LR,
    M.PER_DEVICE_BATCH,
    M.ACCUM,
    M.BATCH_SEQS,
    M.BATCH_TOKENS,
    M.TOKENS_SEEN,
    M.STEP_TIME,
    M.TOKENS_PER_S,
    M.MEM_PEAK,
    M.MEM_RSS,
    M.MEM_CAPACITY,
    M.GNS_G2,
    M.GNS_TRACE,
    M.FIRST_SAMPLE,
}


def assert_continuous_samples(db, run_id):
    first = metric(db, run_id, M.FIRST_SAMPLE)
    batch = metric(db, run_id, M.BATCH_SEQS)
    steps = sorted(first)
    assert steps == list(range(1, len(steps) + 1)), "steps missing or out of order"
    assert first[1] == 0
    for s in steps[1:]:
        assert first[s] == first[s - 1] + batch[s - 1], f"sample stream broken at step {s}"


def test_tiny_run_logs_every_metric_and_learns(tmp_path):
    db = tmp_path / "runs.duckdb"
    done = run_trainer(
        db,
        tmp_path / "ckpt",
        "--run-id",
        "tiny",
        "--steps",
        "50",
        "--val-every",
        "25",
        "--checkpoint-every",
        "25",
        "--no-plan",
        "--progress",
        "auto",
    )
    assert done.returncode == 0, done.stdout
    # its log (not a terminal): a progress line every 50 steps and a line per event
    assert re.search(r"^step +50 loss +\d+\.\d+ tier 8x2 +\d+ tok/s", done.stdout, re.M), (
        done.stdout
    )
    assert "rampwatch: step 50: checkpoint: checkpoint at step 50" in done.stdout
    run = reader.get_run(db, "tiny")
    assert run.status == "finished" and run.last_step == 50
    # the last periodic save is the final one: each step saved once
    saved = [e.step for e in reader.events(db, "tiny") if e.kind == M.EVENT_CHECKPOINT]
    assert saved == [25, 50], saved
    assert run.config["preset"] == "test-tiny" and run.config["data"]["corpus"]["files"] > 100
    assert run.config["step_limit"] == 50  # --steps: the card counts steps left to it
    names = set(reader.metric_names(db, "tiny"))
    assert PER_STEP | {M.VAL_LOSS, M.GNS, M.GNS_TOKENS} <= names, PER_STEP - names
    assert M.MFU not in names  # no peak FLOPs for a CPU
    for name in PER_STEP - {M.STEP_TIME, M.TOKENS_PER_S}:
        assert sorted(metric(db, "tiny", name)) == list(range(1, 51)), name
    # throughput starts at step 2: the first step of a tier may include compilation
    assert sorted(metric(db, "tiny", M.TOKENS_PER_S)) == list(range(2, 51))
    # the windowed noise scale once its window holds its 48 steps: a bound on every such step
    assert sorted(metric(db, "tiny", M.GNS_LOW)) == list(range(48, 51))
    assert set(metric(db, "tiny", M.GNS)) <= set(range(48, 51))
    val = metric(db, "tiny", M.VAL_LOSS)
    assert sorted(val) == [0, 25, 50]
    assert val[50] < val[0] - 0.5, val
    assert_continuous_samples(db, "tiny")


def test_killed_run_resumes_as_the_same_run(tmp_path):
    db, ckpt_dir = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    proc = spawn(
        trainer_args(
            db,
            ckpt_dir,
            "--run-id",
            "r",
            "--name",
            "first-launch",
            "--steps",
            "1000",
            "--checkpoint-every",
            "10",
            "--no-plan",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_step(db, "r", 26, proc)
    finally:
        kill_group(proc, signal.SIGKILL)
    # under load the run goes on past step 26 before the kill lands: resume to beyond where it got
    saved = ckpt.load(ckpt.checkpoint_path(ckpt_dir, "r"))["state"].step
    reached = max(saved, reader.get_run(db, "r").last_step)
    end = reached + 9
    # the run's own model and schedule win over this launch's flags (a different preset here)
    done = run_trainer(
        db, ckpt_dir, "--resume", "r", "--steps", str(end), "--no-plan", "--preset", "cpu-tiny"
    )
    assert done.returncode == 0, done.stdout
    run = reader.get_run(db, "r")
    assert run.status == "finished" and run.last_step == end
    losses = metric(db, "r", M.LOSS)  # asserts no step twice
    assert sorted(losses) == list(range(1, end + 1))
    resumes = [e for e in reader.events(db, "r") if e.kind == M.EVENT_RESUME]
    assert len(resumes) == 1 and resumes[0].step == saved and saved >= 20 and saved % 10 == 0
    assert_continuous_samples(db, "r")
    assert run.config["preset"] == "test-tiny"
    assert run.config["step_limit"] == end  # this launch's --steps, not the first's
    assert run.name == "first-launch"  # a resume without --name keeps the run's name


def test_own_loop_snippet_from_readme(tmp_path):
    db = tmp_path / "own.duckdb"
    proc = spawn(
        ["examples/own_loop.py", str(db)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()
    [run] = reader.list_runs(db)
    assert run.name == "own-loop" and run.status == "finished"
    for name in (M.LOSS, M.GRAD_NORM, M.GNS_G2, M.MEM_PEAK):
        assert sorted(metric(db, run.run_id, name)) == list(range(1, 61)), name
    loss = metric(db, run.run_id, M.LOSS)
    assert loss[60] < loss[1]
    readme = (REPO / "README.md").read_text()
    snippet = (REPO / "examples/own_loop.py").read_text().split("# --- the integration")[1]
    body = [line for line in snippet.splitlines()[1:] if line.strip()]
    assert all(line in readme for line in body), (
        "README's snippet differs from examples/own_loop.py"
    )
    # the loop itself, five calls that log, five that ramp, the token budget and its clock
    assert len(body) <= 17 + 10 + 3


def test_sigterm_saves_a_final_checkpoint_at_the_next_step_boundary(tmp_path):
    """SIGTERM only sets a flag; the loop checkpoints at its next step boundary and stops as
    killed (exit 143), so a resume loses no completed step."""
    db, ckpt_dir = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    proc = spawn(
        trainer_args(
            db,
            ckpt_dir,
            "--run-id",
            "t",
            "--no-plan",
            "--steps",
            "100000",
            "--total-tokens",
            "10000000000",
            "--checkpoint-every",
            "0",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_step(db, "t", 8, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 143, out.decode()
    run = reader.get_run(db, "t")
    saved = ckpt.load(ckpt.checkpoint_path(ckpt_dir, "t"))["state"]
    assert run.status == "killed" and saved.step == run.last_step >= 8
    assert f"stopped by SIGTERM after step {saved.step}: checkpoint saved" in out.decode()
    checkpoints = [e.step for e in reader.events(db, "t") if e.kind == M.EVENT_CHECKPOINT]
    assert checkpoints == [saved.step]
