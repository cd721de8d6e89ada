"""RampwatchCallback (rampwatch/integrations/lightning.py) in real Lightning 2.x fits, each a child
process (tests/lightning_child.py) against a real DuckDB file, compared step for step with the own
loop (tests/own_loop_child.py) on the same samples: approved ramps wait for a boundary where
Lightning's accumulation counters agree and then equal a switch by hand; the switch they avoid
applies a gradient twice; a ramped fit ends at its token budget with its LR schedule in tokens;
16-mixed's loss scale is undone; a per-device batch ramp the Trainer
cannot run is refused with its reason on the card; the auto policy ramps by itself; the telemetry
is the own loop's to the bit; examples/lightning_loop.py runs as written; a fit resumed from
Lightning's checkpoint continues the monitor's state.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed
from tests.budget_checks import assert_keeps_budget
from tests.procs import REPO, child_env, kill_group, spawn, wait_until

pytestmark = pytest.mark.timeout(240)

LIGHTNING = ["-m", "tests.lightning_child"]
OWN = ["-m", "tests.own_loop_child"]
PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
AUTO_POLICY = '{"min_estimates": 3, "hysteresis_steps": 2}'
# the manual fit's budget, 196 steps of 4 x 2: 6 of them, 3 of 4 x 4, then 46 of 2 x 16 (55 steps,
# past the noise-scale window's first estimate at ~50); the data are sized by it (own_loop_child)
BUDGET_STEPS, MANUAL_STEPS = "196", 55


def started(proc) -> str:
    """The run id the child prints once its monitor is up."""
    first = proc.stdout.readline()
    assert first.startswith("run "), first + proc.stderr.read()
    return first.split()[1]


def finished(proc) -> str:
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err
    return out + err


def only_run(db) -> str:
    (run,) = store.list_runs(db)
    return run.run_id


def series(db, run_id, name) -> dict[int, float]:
    s = store.series(db, run_id, name, width=1)
    return dict(zip(s.step.tolist(), s.last.tolist(), strict=True))


def assert_same_params(a, b, atol=1e-5):
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def manual(tmp_path_factory):
    """A Lightning fit at 4 x 2 that is sent two ramps: accumulation 4 at step 5 (due at an odd
    step, where Lightning's counters are mid-way through a cycle of 4), then 2 per device x 16 at
    step 7 (a new DataLoader: the next epoch start, after step 9); beside it, the own loop switched
    by hand at steps 6 and 9. Both keep the token budget."""
    tmp = tmp_path_factory.mktemp("manual")
    db, own_db = tmp / "runs.duckdb", tmp / "own.duckdb"
    steps = BUDGET_STEPS
    own = spawn(
        [
            *OWN,
            str(own_db),
            str(tmp / "own.pt"),
            "--switch-at",
            "6:4:4",
            "--switch-at",
            "9:2:16",
            "--steps",
            steps,
            "--ramp",
            "off",
        ],
        **PIPES,
    )
    proc = spawn(
        [
            *LIGHTNING,
            str(db),
            str(tmp / "lightning.pt"),
            "--wait-ramp-at",
            "5",
            "--wait-ramp-at",
            "7",
            "--steps",
            steps,
            "--epoch-samples",
            "96",
            "--reload",
        ],
        **PIPES,
    )
    try:
        run_id = started(proc)
        accum = commands.submit(
            db, run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="test"
        )
        wait_until(lambda: commands.get(db, accum).status == "applied", timeout=120)
        batch = commands.submit(
            db, run_id, "ramp", {"per_device_batch": 2, "accum": 16}, actor="test"
        )
        log = finished(proc)
        finished(own)
    finally:
        for p in (proc, own):
            if p.poll() is None:
                kill_group(p)
    return SimpleNamespace(
        db=db,
        run_id=run_id,
        own_db=own_db,
        own_run=only_run(own_db),
        accum=accum,
        batch=batch,
        log=log,
        result=torch.load(tmp / "lightning.pt"),
        own=torch.load(tmp / "own.pt"),
    )


def test_approved_ramps_wait_for_a_safe_boundary_and_equal_a_switch_by_hand(manual):
    m = manual
    assert m.result["applied"] == [6, 9], m.log
    assert "ramp applied at step 6: 4 x 4" in m.log and "ramp applied at step 9: 2 x 16" in m.log
    assert m.result["stale"] == 0  # every step began with zero_grad
    assert m.result["steps"] == MANUAL_STEPS  # the budget's: the own loop's too (params equal)
    assert_same_params(m.result, m.own)
    assert m.result["lr"] == pytest.approx(m.own["lr"], rel=1e-12)  # √ rule: 1e-2 × √4
    for cid, step in ((m.accum, 6), (m.batch, 9)):
        cmd = commands.get(m.db, cid)
        assert (cmd.status, cmd.applied_step) == ("applied", step)
    accum, batch = series(m.db, m.run_id, M.ACCUM), series(m.db, m.run_id, M.PER_DEVICE_BATCH)
    assert sorted(accum) == list(range(1, MANUAL_STEPS + 1))
    assert [accum[s] for s in sorted(accum)] == [2] * 6 + [4] * 3 + [16] * 46  # from S + 1
    assert [batch[s] for s in sorted(batch)] == [4] * 9 + [2] * 46
    ramps = store.events(m.db, m.run_id, kinds=[M.EVENT_RAMP])
    assert [e.step for e in ramps] == [6, 9]
    assert all("command" in e.message for e in ramps)


def test_telemetry_equals_the_own_loop_monitor_on_the_same_batches(manual):
    """Per-step partial sums (gns_g2, gns_trace), grad norm, loss and the windowed estimate."""
    m = manual
    names = [M.LOSS, M.GRAD_NORM, M.GNS_G2, M.GNS_TRACE, M.GNS_RAW, M.GNS, M.GNS_LOW]
    for name in names:
        ours, own = series(m.db, m.run_id, name), series(m.own_db, m.own_run, name)
        assert ours.keys() == own.keys(), name
        a = np.array([ours[s] for s in sorted(ours)])
        b = np.array([own[s] for s in sorted(own)])
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9 * np.abs(b).max(), err_msg=name)
    assert len(series(m.db, m.run_id, M.GNS)) > 0  # the window did produce estimates
    assert len(series(m.db, m.run_id, M.GNS_G2)) == MANUAL_STEPS


def test_the_unsafe_switch_it_avoids_would_apply_a_gradient_twice(tmp_path):
    """accumulate_grad_batches 2 -> 4 right after step 5 (ready = 10): batch_idx 10 does not zero
    .grad, so step 6 applies step 5's gradient again, and the result is not a switch at 5."""
    own = spawn(
        [
            *OWN,
            str(tmp_path / "own.duckdb"),
            str(tmp_path / "own.pt"),
            "--switch-at",
            "5:4:4",
            "--steps",
            "8",
            "--ramp",
            "off",
            "--schedule-in-steps",  # as Lightning without the callback: 8 steps, sched per step
        ],
        **PIPES,
    )
    unsafe = subprocess.run(
        [
            sys.executable,
            *LIGHTNING,
            str(tmp_path / "l.duckdb"),
            str(tmp_path / "unsafe.pt"),
            "--unsafe-switch-at",
            "5:4",
            "--steps",
            "8",
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert unsafe.returncode == 0, unsafe.stderr
    finished(own)
    result, ref = torch.load(tmp_path / "unsafe.pt"), torch.load(tmp_path / "own.pt")
    assert (result["steps"], result["stale"]) == (8, 1)
    diff = max(
        float((a - b).abs().max()) for a, b in zip(result["params"], ref["params"], strict=True)
    )
    assert diff > 1e-3


def test_the_loss_scale_of_16_mixed_is_undone(manual, tmp_path):
    """fp16 autocast with a GradScaler at 1024 (its norms are taken scaled after each backward):
    the same steps as the fp32 run before its first ramp, to fp16's precision."""
    db = tmp_path / "runs.duckdb"
    done = subprocess.run(
        [
            sys.executable,
            *LIGHTNING,
            str(db),
            str(tmp_path / "amp.pt"),
            "--ramp",
            "off",
            "--steps",
            BUDGET_STEPS,  # the manual fit's samples
            "--stop-after",
            "6",
            "--scaler",
            "1024",
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr
    run_id = only_run(db)
    for name in (M.LOSS, M.GRAD_NORM, M.GNS_G2, M.GNS_TRACE):
        ours, fp32 = series(db, run_id, name), series(manual.db, manual.run_id, name)
        a, b = np.array([ours[s] for s in range(1, 7)]), np.array([fp32[s] for s in range(1, 7)])
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max(), err_msg=name)


def test_a_ramped_fit_ends_at_its_token_budget_with_its_schedule_in_tokens(tmp_path):
    """max_steps 16 at 4 x 2 with a warmup-then-cosine schedule, ramped x2 (accumulation 2 -> 4)
    by an approved command at step 6: max_steps becomes 6 + 5, and at every token the LR of the
    same fit unramped x the ramp's √2."""
    db, plain_db = tmp_path / "runs.duckdb", tmp_path / "plain.duckdb"
    args = ("--schedule", "cosine", "--steps", "16")
    proc = spawn(
        [*LIGHTNING, str(db), str(tmp_path / "r.pt"), *args, "--wait-ramp-at", "6"], **PIPES
    )
    plain = None
    try:
        run_id = started(proc)
        commands.submit(db, run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="test")
        assert "ramp applied at step 6: 4 x 4" in finished(proc)
        plain = spawn(
            [*LIGHTNING, str(plain_db), str(tmp_path / "p.pt"), *args, "--ramp", "off"], **PIPES
        )
        finished(plain)
    finally:
        for p in (proc, plain):
            if p is not None and p.poll() is None:
                kill_group(p)
    steps = assert_keeps_budget(db, run_id, plain_db, only_run(plain_db))["step"]
    assert steps.tolist() == list(range(1, 12))
    assert torch.load(tmp_path / "r.pt")["steps"] == 11


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
    """ramp="auto" at 2 x 2 without reload_dataloaders_every_n_epochs; at step 3 it is sent a
    ramp to 1 per device x 4."""
    tmp = tmp_path_factory.mktemp("auto")
    db = tmp / "runs.duckdb"
    proc = spawn(
        [
            *LIGHTNING,
            str(db),
            str(tmp / "auto.pt"),
            "--ramp",
            "auto",
            "--steps",
            "90",
            "--batch",
            "2",
            "--policy",
            AUTO_POLICY,
            "--wait-ramp-at",
            "3",
        ],
        **PIPES,
    )
    try:
        run_id = started(proc)
        cid = commands.submit(db, run_id, "ramp", {"per_device_batch": 1, "accum": 4}, actor="test")
        log = finished(proc)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    return SimpleNamespace(
        db=db, run_id=run_id, cid=cid, log=log, result=torch.load(tmp / "auto.pt")
    )


def test_a_per_device_batch_ramp_without_a_new_loader_is_refused_on_the_card(auto, monkeypatch):
    cmd = commands.get(auto.db, auto.cid)
    assert cmd.status == "refused", auto.log
    assert cmd.reason.startswith(
        "per-device batch 2 -> 1 needs a new DataLoader, and this "
        "Trainer does not rebuild it: use Trainer(reload_dataloaders_"
        "every_n_epochs=1)"
    ), cmd.reason
    refused = store.events(auto.db, auto.run_id, kinds=[M.EVENT_REFUSED])
    assert [e.step for e in refused] == [3]
    text = seed.texts(seed.app(monkeypatch, auto.db))
    assert (
        f"Ramp #{auto.cid} to 1 per device × 4 accumulation was refused: per-device "
        "batch 2 -> 1 needs a new DataLoader" in text
    )


def test_the_auto_policy_ramps_by_itself_at_a_safe_boundary(auto):
    ramps = store.events(auto.db, auto.run_id, kinds=[M.EVENT_RAMP])
    assert ramps and ramps[0].data["source"].startswith("auto:"), auto.log
    first = ramps[0]
    # one device, no memory model: x2 by accumulation; applied where ready % 4 == 0 (even steps)
    assert first.data["after"] == {**first.data["after"], "per_device_batch": 2, "accum": 4}
    assert first.step % 2 == 0 and first.step in auto.result["applied"]
    accum = series(auto.db, auto.run_id, M.ACCUM)
    assert accum[first.step] == 2 and accum[first.step + 1] == 4
    assert auto.result["stale"] == 0


def test_the_example_runs_as_written(tmp_path):
    db = tmp_path / "runs.duckdb"
    done = subprocess.run(
        [sys.executable, "examples/lightning_loop.py", str(db)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr
    (run,) = store.list_runs(db)
    assert run.status == "finished" and run.name == "lightning"
    loss = series(db, run.run_id, M.LOSS)
    assert sorted(loss) == list(range(1, 61)) and all(np.isfinite(list(loss.values())))
    assert len(series(db, run.run_id, M.GNS_G2)) == 60  # accumulation 4: partial sums per step
    assert sorted(series(db, run.run_id, M.VAL_LOSS)) == [20, 40, 60]  # every 80 batches
    assert run.config["accum"] == 4 and run.config["integration"] == "lightning"
    assert run.config["trials"] is False  # the card shows why instead of a button
    assert run.config["trials_note"].startswith("Lightning owns the data loader")


def test_a_resumed_fit_continues_the_monitors_state(tmp_path):
    """fit(ckpt_path=...) in a fresh process: the monitor's state rode in Lightning's own
    checkpoint (noise window, tokens seen, base LR, ...) and the resumed monitor continues it."""
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ck"

    def fit(out: str, *flags: str):
        return spawn([*LIGHTNING, str(db), str(tmp_path / out), "--steps", "30", *flags], **PIPES)

    first = fit(
        "first.pt", "--stop-after", "20", "--checkpoint-dir", str(ck), "--checkpoint-every", "10"
    )
    run_id = started(first)
    finished(first)
    saved = ck / "epoch=0-step=10.ckpt"
    blob = torch.load(saved, weights_only=False)
    (kept,) = [s["monitor_state"] for s in blob["callbacks"].values() if "run_id" in s]
    per_step = 4 * 2  # the child's 4 per device x 2 micro-batches, one token each
    assert kept["tokens_seen"] == 10 * per_step and len(kept["noise_window"]["g2"]) == 10
    second = fit("second.pt", "--resume", str(saved))
    assert started(second) == run_id
    finished(second)
    resumed = torch.load(tmp_path / "second.pt")["monitor_at_start"]
    assert resumed == kept  # every key: window, tokens, base LR, infeasible, measured, last ramp
    tokens = series(db, run_id, M.TOKENS_SEEN)
    assert (tokens[10], tokens[11], tokens[30]) == (10 * per_step, 11 * per_step, 30 * per_step)
