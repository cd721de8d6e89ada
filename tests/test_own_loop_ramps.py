"""The ramp protocol in a user's own loop (monitor/ramp_protocol.py), each loop a real child process
(tests/own_loop_child.py) against a real DuckDB file: an approved ramp lands at a step boundary
exactly as a switch by hand would, the loop ends at its token budget with its LR schedule in
tokens (monitor/token_clock.py), the auto policy ramps by itself, measured memory gives the card a
line, and a reported OOM or a tier that cannot run is refused with its reason on the card.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed
from tests.budget_checks import assert_keeps_budget
from tests.procs import REPO, child_env, run_torchrun, start_loop, wait_until

pytestmark = pytest.mark.timeout(300)


def start(procs, db, out, *args):
    return start_loop(procs, ["-m", "tests.own_loop_child", str(db), str(out), *args])


def finish(proc) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    return out + err


def run_child(db, out, *args) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tests.own_loop_child", str(db), str(out), *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_an_approved_ramp_equals_a_switch_by_hand(tmp_path, procs):
    db = tmp_path / "runs.duckdb"
    # a budget of 19 steps of 4 x 2: 5 of them, then 7 of 4 x 4
    proc, run_id = start(procs, db, tmp_path / "ramped.pt", "--wait-ramp-at", "5", "--steps", "19")
    cid = commands.submit(db, run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="test")
    log = finish(proc)
    assert "ramp applied at step 5: 4 x 4" in log
    run_child(db, tmp_path / "by_hand.pt", "--switch-at", "5:4:4", "--steps", "19", "--ramp", "off")
    ramped, by_hand = torch.load(tmp_path / "ramped.pt"), torch.load(tmp_path / "by_hand.pt")
    assert ramped["applied"] == by_hand["applied"] == [5]
    for a, b in zip(ramped["params"], by_hand["params"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert ramped["lr"] == pytest.approx(1e-2 * 2**0.5)  # √ rule, past the scheduler's warmup
    cmd = commands.get(db, cid)
    assert (cmd.status, cmd.applied_step) == ("applied", 5)
    accum = store.series(db, run_id, M.ACCUM, width=1)
    assert [int(v) for v in accum.last] == [2] * 5 + [4] * 7  # the new tier from step 6
    ramps = store.events(db, run_id, kinds=[M.EVENT_RAMP])
    assert len(ramps) == 1 and ramps[0].step == 5 and "command" in ramps[0].message


def test_a_ramped_loop_ends_at_its_token_budget_with_its_schedule_in_tokens(tmp_path, procs):
    """A warmup-then-cosine SequentialLR through a TokenClock, planned over 16 steps of 4 x 2 and
    ramped x2 (accumulation 2 -> 4) by an approved command at step 6: 6 + 5 steps, and at every
    token the LR of the same loop unramped x the ramp's √2."""
    db, plain_db = tmp_path / "runs.duckdb", tmp_path / "plain.duckdb"
    args = ("--schedule", "cosine", "--steps", "16")
    proc, run_id = start(procs, db, tmp_path / "ramped.pt", *args, "--wait-ramp-at", "6")
    commands.submit(db, run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="test")
    assert "ramp applied at step 6: 4 x 4" in finish(proc)
    run_child(plain_db, tmp_path / "plain.pt", *args, "--ramp", "off")
    [plain] = store.list_runs(plain_db)
    steps = assert_keeps_budget(db, run_id, plain_db, plain.run_id)["step"]
    assert steps.tolist() == list(range(1, 12))


def test_the_auto_policy_ramps_by_itself(tmp_path):
    db = tmp_path / "runs.duckdb"
    log = run_child(
        db,
        tmp_path / "auto.pt",
        "--ramp",
        "auto",
        "--steps",
        "90",
        "--batch",
        "2",
        "--policy",
        '{"min_estimates": 3, "hysteresis_steps": 2}',
    )
    run = store.list_runs(db)[0]
    ramps = store.events(db, run.run_id, kinds=[M.EVENT_RAMP])
    assert ramps and ramps[0].data["source"].startswith("auto:"), log
    first = ramps[0]
    # one device, no memory model: ×2 by accumulation, which keeps two batch sizes per step
    assert first.data["after"] == {**first.data["after"], "per_device_batch": 2, "accum": 4}
    series = store.series(db, run.run_id, M.ACCUM, width=1)
    accum = dict(zip(series.step.tolist(), series.last.tolist(), strict=True))
    assert accum[first.step] == 2 and accum[first.step + 1] == 4


def test_measured_memory_line_and_a_reported_oom_reach_the_card(tmp_path, procs, monkeypatch):
    db = tmp_path / "runs.duckdb"
    # 4 then 8 per device (two measured peaks); 16 "runs out of memory" and falls back to 8 x 2
    proc, run_id = start(
        procs,
        db,
        tmp_path / "mem.pt",
        "--switch-at",
        "3:8:1",
        "--switch-at",
        "6:16:1",
        "--oom-at",
        "16",
        "--steps",
        "80",  # a budget of 80 steps of 4 x 2: about 43 steps, most of them at 16 a step
        "--step-sleep",
        "0.2",
    )
    rows = lambda: store.memory_plan(db, run_id)  # noqa: E731
    wait_until(lambda: any(r.feasible is False for r in rows()), timeout=120)
    cid = commands.submit(db, run_id, "ramp", {"per_device_batch": 16, "accum": 2}, actor="test")
    wait_until(lambda: commands.get(db, cid).status == "refused", timeout=120)
    at = seed.app(monkeypatch, db)
    text = seed.texts(at)
    finish(proc)
    measured = {r.per_device_batch for r in rows() if r.measured_bytes}
    assert {4, 8} <= measured and 16 not in measured
    assert "memory model: measured line (2 points)" in text
    assert "was refused: per-device batch 16 ran out of memory earlier in this run" in text


def test_under_torchrun_every_rank_applies_rank_0s_ramp_at_the_same_step(tmp_path):
    """The monitor's ramp channel in a user's own DDP loop (two gloo ranks): rank 0's auto
    decision reaches both ranks at one boundary; the weights stay equal; one ramp event."""
    db = tmp_path / "runs.duckdb"
    done = run_torchrun(
        "-m",
        "tests.own_loop_child",
        str(db),
        str(tmp_path / "ddp.pt"),
        "--ramp",
        "auto",
        "--steps",
        "80",
        "--batch",
        "2",
        "--policy",
        '{"min_estimates": 3, "hysteresis_steps": 2, "bound_at": 0}',
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"ddp.pt.rank{r}") for r in (0, 1)]
    assert ranks[0]["applied"] and ranks[0]["applied"] == ranks[1]["applied"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    [run] = store.list_runs(db)
    assert run.world_size == 2
    ramps = store.events(db, run.run_id, kinds=[M.EVENT_RAMP])
    assert [e.step for e in ramps] == ranks[0]["applied"]
    assert ramps[0].data["before"]["batch"] == 2 * 2 * 2  # per device × accum × world
    assert ramps[0].data["after"]["batch"] == 16
