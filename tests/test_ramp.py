"""Approving a ramp, end to end through the store: the trainer (a real process) applies it at a
step boundary, refuses what cannot run, and survives out-of-memory by halving the per-device
batch while keeping the effective batch."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from rampwatch.advisor.policy import RampPolicy
from rampwatch.store import CommandError, commands, reader
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from tests.procs import kill_group
from tests.test_trainer import assert_continuous_samples
from tests.trainer_runs import metric, run_trainer, trainer_args, wait_for_step

pytestmark = pytest.mark.slow
LONG = ["--steps", "100000", "--total-tokens", "10000000000", "--checkpoint-every", "0"]


def wait_command(db, command_id, statuses=("applied", "refused"), timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cmd = commands.get(db, command_id)
        if cmd.status in statuses:
            return cmd
        time.sleep(0.2)
    raise AssertionError(f"command {command_id} still {cmd.status} after {timeout}s")


def test_approved_ramp_is_applied_at_a_step_boundary(tmp_path, procs):
    db = tmp_path / "runs.duckdb"
    proc = procs.spawn(
        trainer_args(
            db,
            tmp_path / "ckpt",
            "--run-id",
            "r",
            "--no-plan",
            "--per-device-batch",
            "4",
            "--accum",
            "2",
            *LONG,
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(db, "r", 25, proc)
    cid = commands.submit(db, "r", "ramp", {"per_device_batch": 4, "accum": 4}, actor="test")
    cmd = wait_command(db, cid)
    assert cmd.status == "applied", cmd.reason
    n = cmd.applied_step
    last = wait_for_step(db, "r", max(n + 21, 60), proc)
    kill_group(proc, signal.SIGTERM)

    ramps = [e for e in reader.events(db, "r") if e.kind == M.EVENT_RAMP]
    assert [e.step for e in ramps] == [n]
    assert ramps[0].data["before"]["batch"] == 8 and ramps[0].data["after"]["batch"] == 16
    batch = metric(db, "r", M.BATCH_SEQS)
    assert batch[n] == 8 and batch[n + 1] == 16
    lr = metric(db, "r", M.LR)
    assert lr[n + 1] / lr[n] == pytest.approx(np.sqrt(2), rel=0.01)  # AdamW: sqrt rule
    assert_continuous_samples(db, "r")
    loss = metric(db, "r", M.LOSS)
    before = np.mean([loss[s] for s in range(n - 19, n + 1)])
    after = np.mean([loss[s] for s in range(n + 1, n + 21)])
    assert after < before
    assert_fresh_noise_scale_after(db, "r", n, last)


def assert_fresh_noise_scale_after(db, run_id: str, ramp_step: int, last: int) -> None:
    """The ramped tier still has two batch sizes per step: a new per-step estimate at every step
    after the ramp, and the windowed value (with its bound) logged on those steps only."""
    g2 = metric(db, run_id, M.GNS_G2)
    assert all(s in g2 for s in range(ramp_step + 1, last + 1)), sorted(g2)[-30:]
    bound = metric(db, run_id, M.GNS_LOW)  # logged on every step with a windowed estimate
    after = [s for s in bound if s > ramp_step]
    assert after and set(after) <= set(g2), (after, sorted(g2)[-30:])


def test_commands_that_cannot_run_are_refused_with_reasons(tmp_path, procs):
    db = tmp_path / "runs.duckdb"
    proc = procs.spawn(
        trainer_args(
            db,
            tmp_path / "ckpt",
            "--run-id",
            "r",
            "--per-device-batch",
            "4",
            "--accum",
            "2",
            "--capacity-bytes",
            str(10**8),
            *LONG,
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(db, "r", 3, proc)
    deadline = time.monotonic() + 120
    while not any(p.source == "plan" for p in reader.memory_plan(db, "r")):
        assert time.monotonic() < deadline, "no memory plan within 120 s"
        time.sleep(0.5)

    # malformed: the store refuses it at the door, naming the field
    with pytest.raises(CommandError, match="per_device_batch"):
        commands.submit(db, "r", "ramp", {"per_device_batch": "64", "accum": 1}, actor="test")
    # over capacity (x8, the most one command may ask): accepted by the store, refused by the
    # trainer's re-check against a 100 MB device
    big = commands.submit(db, "r", "ramp", {"per_device_batch": 64, "accum": 1}, actor="test")
    refused = wait_command(db, big)
    assert refused.status == "refused" and "needs about" in refused.reason
    assert "usable" in refused.reason
    # the tier it already runs
    same = commands.submit(db, "r", "ramp", {"per_device_batch": 4, "accum": 2}, actor="test")
    assert "already uses" in wait_command(db, same).reason

    # a second pending ramp: the trainer is stopped so the first is certainly still pending
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        first = commands.submit(db, "r", "ramp", {"per_device_batch": 4, "accum": 3}, actor="t")
        with pytest.raises(CommandError, match="pending"):
            commands.submit(db, "r", "ramp", {"per_device_batch": 4, "accum": 5}, actor="t")
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    assert wait_command(db, first).status == "applied"

    refusals = [e for e in reader.events(db, "r") if e.kind == M.EVENT_REFUSED]
    assert len(refusals) == 2
    step = reader.get_run(db, "r").last_step
    wait_for_step(db, "r", step + 3, proc)  # the run is unaffected: it keeps stepping
    kill_group(proc, signal.SIGTERM)
    assert reader.get_run(db, "r").status in ("finished", "killed")
    # a run that has ended takes no commands
    with pytest.raises(CommandError, match="not running|finished|killed"):
        commands.submit(db, "r", "ramp", {"per_device_batch": 4, "accum": 4}, actor="test")


# -- out of memory -------------------------------------------------------------------------
OOM_STEP = 6


def _params(path):
    return ckpt.load(path)["model"]


@pytest.fixture(scope="module")
def switched_reference(tmp_path_factory):
    """The run without OOM that switched to B/2 per device with twice the accumulation at
    step OOM_STEP: 5 steps at 4 x 2, checkpoint, re-tier to 2 x 4, resume to step OOM_STEP+5."""
    tmp = tmp_path_factory.mktemp("reference")
    db, ck = tmp / "runs.duckdb", tmp / "ckpt"
    common = ("--no-plan", "--checkpoint-every", "0", "--total-tokens", "10000000")
    first = run_trainer(
        db,
        ck,
        "--run-id",
        "ref",
        "--per-device-batch",
        "4",
        "--accum",
        "2",
        "--steps",
        str(OOM_STEP - 1),
        *common,
    )
    assert first.returncode == 0, first.stdout
    ckpt.retier(ckpt.checkpoint_path(ck, "ref"), 2, 4, infeasible=4)
    second = run_trainer(db, ck, "--resume", "ref", "--steps", str(OOM_STEP + 5), *common)
    assert second.returncode == 0, second.stdout
    return _params(ckpt.checkpoint_path(ck, "ref"))


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_redoes_the_step_at_half_the_per_device_batch(tmp_path, phase, switched_reference):
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    done = run_trainer(
        db,
        ck,
        "--run-id",
        "oom",
        "--per-device-batch",
        "4",
        "--accum",
        "2",
        "--steps",
        str(OOM_STEP + 5),
        "--no-plan",
        "--checkpoint-every",
        "0",
        "--total-tokens",
        "10000000",
        "--inject-oom",
        f"{OOM_STEP}:1:{phase}",
    )
    assert done.returncode == 0, done.stdout
    [oom] = [e for e in reader.events(db, "oom") if e.kind == M.EVENT_OOM]
    assert oom.step == OOM_STEP and oom.data["exact"] is True
    assert oom.data["before"] == {"per_device_batch": 4, "accum": 2}
    assert oom.data["after"] == {"per_device_batch": 2, "accum": 4}
    assert any(
        p.source == "oom" and p.per_device_batch == 4 and p.feasible is False
        for p in reader.memory_plan(db, "oom")
    )
    batch = metric(db, "oom", M.PER_DEVICE_BATCH)
    assert batch[OOM_STEP - 1] == 4 and batch[OOM_STEP] == 2
    assert_continuous_samples(db, "oom")
    params = _params(ckpt.checkpoint_path(ck, "oom"))
    for name, ref in switched_reference.items():
        torch.testing.assert_close(params[name], ref, rtol=0, atol=1e-5, msg=name)


def test_oom_in_the_optimizer_stops_with_a_checkpoint_at_the_smaller_tier(tmp_path):
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    common = ("--no-plan", "--total-tokens", "10000000", "--per-device-batch", "4", "--accum", "2")
    done = run_trainer(
        db,
        ck,
        "--run-id",
        "opt",
        "--steps",
        "20",
        "--checkpoint-every",
        "4",
        "--inject-oom",
        "6:0:optimizer",
        *common,
    )
    assert done.returncode == 3
    assert "out of memory inside the optimizer step" in done.stdout
    assert "--resume opt" in done.stdout
    assert reader.get_run(db, "opt").status == "failed"
    state = ckpt.load(ckpt.checkpoint_path(ck, "opt"))["state"]
    assert (state.per_device_batch, state.accum, state.step) == (2, 4, 4)
    resumed = run_trainer(db, ck, "--resume", "opt", "--steps", "8", *common)
    assert resumed.returncode == 0, resumed.stdout
    batch = metric(db, "opt", M.PER_DEVICE_BATCH)
    assert sorted(batch) == list(range(1, 9)) and batch[5] == 2 and batch[4] == 4


def test_oom_at_per_device_batch_one_stops_with_a_clear_message(tmp_path):
    done = run_trainer(
        tmp_path / "r.duckdb",
        tmp_path / "ck",
        "--run-id",
        "one",
        "--per-device-batch",
        "1",
        "--accum",
        "2",
        "--steps",
        "5",
        "--no-plan",
        "--inject-oom",
        "2:0:forward",
    )
    assert done.returncode == 3
    assert "out of memory at per-device batch 1" in done.stdout
    assert reader.get_run(tmp_path / "r.duckdb", "one").status == "failed"


def test_auto_mode_applies_the_advisors_ramp_itself(tmp_path, procs):
    """--ramp auto: once the smoothed noise scale has stayed above the batch, the trainer ramps
    by itself (same checks) and records that it did."""
    db = tmp_path / "runs.duckdb"
    proc = procs.spawn(
        trainer_args(
            db,
            tmp_path / "ckpt",
            "--run-id",
            "auto",
            "--ramp",
            "auto",
            "--per-device-batch",
            "2",
            "--accum",
            "2",
            "--hysteresis-steps",
            "10",
            "--min-estimates",
            "20",
            *LONG,
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(db, "auto", 1, proc)
    deadline = time.monotonic() + 240
    ramps = []
    while not ramps:
        assert proc.poll() is None, "the trainer exited"
        assert time.monotonic() < deadline, "no automatic ramp within 240 s"
        time.sleep(1)
        ramps = [e for e in reader.events(db, "auto") if e.kind == M.EVENT_RAMP]
    ramp = ramps[0]
    last = wait_for_step(db, "auto", ramp.step + 15, proc)
    kill_group(proc, signal.SIGTERM)
    assert ramp.data["source"].startswith("auto")
    assert ramp.data["after"]["batch"] == 2 * ramp.data["before"]["batch"] == 8
    assert ramp.data["after"]["accum"] >= 2  # on one device the policy keeps two batch sizes
    gns, low = metric(db, "auto", M.GNS), metric(db, "auto", M.GNS_LOW)
    recent = sorted(s for s in gns if s <= ramp.step)[-10:]
    # the run config's policy: the noise scale and its 95% lower bound above the batch of 4
    policy = RampPolicy.from_config(reader.get_run(db, "auto").config)
    assert len(recent) == 10 and all(
        gns[s] >= policy.ramp_at * 4 and low[s] >= policy.bound_at * 4 for s in recent
    )
    assert_fresh_noise_scale_after(db, "auto", ramp.step, last)
    assert commands.list_commands(db, "auto") == []  # no operator involved
