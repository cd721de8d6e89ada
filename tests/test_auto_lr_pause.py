"""ramp="auto" in a loop that sets its own LR every step and ignores the ramp's multiplier (a
nanoGPT get_lr() without mon.lr_scale): the first auto ramp's LR check fails, and auto takes no
further ramp on its own, since each would grow the batch at the old LR again. In one process, a
real Monitor on a small torch model against a real database (tests/test_trial_gate.py's setup)."""

from __future__ import annotations

import torch

from rampwatch import Monitor
from rampwatch.advisor.policy import RampPolicy
from rampwatch.monitor.ramp_protocol import AUTO_PAUSED, AUTO_RESUMED
from rampwatch.store import names as M
from rampwatch.store import reader

LR = 0.02


def _run(db, steps: int, carry_lr: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, 8, generator=g)
    y = x @ (0.05 * torch.arange(1.0, 9.0)).unsqueeze(1) + torch.randn(200_000, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    policy = RampPolicy(
        original_batch=8, original_lr=LR, lr_rule="sqrt", hysteresis_steps=5, min_estimates=5
    )
    mon = Monitor.start(
        db,
        name="auto",
        config={},
        model=model,
        optimizer=opt,
        per_device_batch=4,
        accum=2,
        seq_len=1,
        ramp="auto",
        policy=policy,
    )
    pos = 0
    for step in range(1, steps + 1):
        for group in opt.param_groups:  # the loop's own schedule: a constant
            group["lr"] = LR * (mon.lr_scale if carry_lr else 1.0)
        tier = mon.tier
        for _ in range(tier.accum):
            xs, ys = x[pos : pos + tier.per_device_batch], y[pos : pos + tier.per_device_batch]
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            (loss / tier.accum).backward()
            mon.after_backward()
            pos += tier.per_device_batch
        mon.step(step, loss=loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (ramp := mon.ramp_due()) is not None:
            ramp.scale_lr(opt)  # overwritten by the next step's own LR unless it carries it
            mon.ramp_applied(ramp)
    mon.finish()
    return mon, reader.events(db, mon.run_id)


def test_a_failed_lr_check_pauses_auto_ramps(tmp_path):
    mon, events = _run(tmp_path / "runs.duckdb", 120, carry_lr=False)
    ramps = [e for e in events if e.kind == M.EVENT_RAMP]
    [check] = [e for e in events if (e.data or {}).get("cause") == "lr_check"]
    assert [e.step for e in ramps] == [check.data["ramp_step"]], [e.step for e in ramps]
    assert ramps[0].data["source"].startswith("auto")
    assert check.data["outcome"] == "not reached" and check.data["auto_paused"] is True
    assert check.message.endswith(AUTO_PAUSED)
    assert mon.state_dict()["auto_paused"] is True


def test_a_loop_that_carries_the_lr_keeps_ramping(tmp_path):
    """The same run with lr = LR * mon.lr_scale: every check passes and auto ramps again (what
    the paused run would have done)."""
    mon, events = _run(tmp_path / "runs.duckdb", 120, carry_lr=True)
    ramps = [e for e in events if e.kind == M.EVENT_RAMP]
    assert len(ramps) >= 2 and all(e.data["source"].startswith("auto") for e in ramps)
    assert not [e for e in events if (e.data or {}).get("cause") == "lr_check"]
    assert AUTO_RESUMED not in [e.message for e in events]
    assert mon.state_dict()["auto_paused"] is False
