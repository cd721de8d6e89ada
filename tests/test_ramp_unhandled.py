"""A loop that calls mon.ramp_due() and drops what it returns: the approved ramp's command was
left "claimed" ("applying at the next step") for the rest of the run, and no other ramp could
be approved. At the next boundary it is refused with the reason, and the loop's author is told
once. In one process, a real Monitor on a small torch model against a real database."""

from __future__ import annotations

import time

import torch

from rampwatch import Monitor
from rampwatch.store import commands, reader
from rampwatch.store import names as M


def test_a_ramp_the_loop_drops_is_refused_at_the_next_boundary(tmp_path, capfd):
    db = tmp_path / "runs.duckdb"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = Monitor.start(
        db,
        name="drops",
        config={},
        model=model,
        optimizer=opt,
        per_device_batch=4,
        accum=2,
        seq_len=1,
    )
    cid = commands.submit(db, mon.run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="t")
    returned_at, step, deadline = None, 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        step += 1
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            mon.after_backward()
        mon.step(step, loss=1.0)
        opt.step()
        opt.zero_grad()
        ramp = mon.ramp_due()  # the loop drops it: neither applied nor refused
        if returned_at is not None:
            break
        if ramp is not None:
            returned_at = step
        time.sleep(0.05)  # the flusher claims the approved command in the background
    assert returned_at is not None, "the approved ramp never came"
    mon.finish()
    cmd = commands.get(db, cid)
    assert cmd.status == "refused", cmd
    assert f"returned it at step {returned_at}" in cmd.reason
    assert "neither applied nor refused" in cmd.reason
    alerts = reader.events(db, mon.run_id, kinds=[M.EVENT_ALERT])
    assert [a.step for a in alerts] == [returned_at + 1], alerts
    assert "mon.ramp_applied(ramp)" in alerts[0].message
    assert capfd.readouterr().err.count("neither applied nor refused") == 1
