"""A loop that calls mon.ramp_due() and drops what it returns, or starts with trials=True and
never asks mon.trial_due(): the approved command was left "claimed" ("applying at the next
step") for the rest of the run, and no other could be approved. At the next boundary it is
refused with the reason, and the loop's author is told once. In one process, a real Monitor on
a small torch model against a real database."""

from __future__ import annotations

import time

import torch

from rampwatch import Monitor
from rampwatch.store import commands, reader
from rampwatch.store import names as M


def _loop(db, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = Monitor.start(
        db,
        name="drops",
        config={"total_tokens": 100_000},
        model=model,
        optimizer=opt,
        per_device_batch=4,
        accum=2,
        seq_len=1,
        **kw,
    )

    def step(n: int):
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            mon.after_backward()
        mon.step(n, loss=1.0)
        opt.step()
        opt.zero_grad()

    return mon, step


def _until(given, step) -> int:
    """Steps with a boundary each until given() (asked there) says the command came: that step."""
    deadline, n = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        n += 1
        step(n)
        if given():
            return n
        time.sleep(0.05)  # the flusher claims the approved command in the background
    raise AssertionError("the approved command never came")


def test_a_ramp_the_loop_drops_is_refused_at_the_next_boundary(tmp_path, capfd):
    db = tmp_path / "runs.duckdb"
    mon, step = _loop(db)
    cid = commands.submit(db, mon.run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="t")
    returned_at = _until(lambda: mon.ramp_due() is not None, step)  # and the loop drops it
    step(returned_at + 1)
    mon.ramp_due()
    mon.finish()
    cmd = commands.get(db, cid)
    assert cmd.status == "refused", cmd
    assert f"returned it at step {returned_at}" in cmd.reason
    assert "neither applied nor refused" in cmd.reason
    alerts = reader.events(db, mon.run_id, kinds=[M.EVENT_ALERT])
    assert [a.step for a in alerts] == [returned_at + 1], alerts
    assert "mon.ramp_applied(ramp)" in alerts[0].message
    assert capfd.readouterr().err.count("neither applied nor refused") == 1


def test_a_trial_the_loop_never_asks_for_is_refused_at_the_next_boundary(tmp_path, capfd):
    db = tmp_path / "runs.duckdb"
    mon, step = _loop(db, trials=True)
    cid = commands.submit(db, mon.run_id, "trial", {"factors": [2]}, actor="t")
    # the loop asks ramp_due() at each boundary and never trial_due()
    due_at = _until(lambda: mon.ramp_due() or mon.ramps.trials.pending, step)
    step(due_at + 1)
    mon.ramp_due()
    mon.finish()
    cmd = commands.get(db, cid)
    assert cmd.status == "refused" and f"ramp_due() at step {due_at}" in cmd.reason, cmd
    assert "mon.trial_due() was not called" in cmd.reason
    [alert] = reader.events(db, mon.run_id, kinds=[M.EVENT_ALERT])
    assert alert.step == due_at + 1 and "mon.trial_due() after each" in alert.message
    assert not reader.events(db, mon.run_id, kinds=[M.EVENT_TRIAL_START])
    assert capfd.readouterr().err.count("mon.trial_due() was not called") == 1
