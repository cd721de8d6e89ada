"""Memory tiers of a sharded model: its per-device peaks hold at one shard count. Shown here: on
two gloo ranks under FSDP2 the monitor keeps its measured peaks with the shard count (2), and a
fake-tensor plan or a probe, which would measure a one-process replica, is refused with an alert;
a resume with another shard count drops the saved peaks and says so.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from rampwatch import Monitor, store
from rampwatch.store import names as M
from tests.procs import run_torchrun

pytestmark = pytest.mark.slow

FSDP2_CHILD = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rampwatch import Monitor
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = Monitor.start(sys.argv[1], name="fsdp2", config={}, model=model, optimizer=opt,
                    per_device_batch=4, accum=1, seq_len=1)
for step in range(1, 4):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    mon.after_backward()
    mon.step(step, loss=loss.detach())
    opt.step()
    opt.zero_grad()
mon.plan_memory("tests.plan_models:not_reached")
probed = mon.probe_memory("tests.plan_models:not_reached", [4, 8])
if dist.get_rank() == 0:
    state = mon.state_dict()
    print("STATE", json.dumps({"shards": state["shards"], "measured": state["measured"],
                               "probed": probed}), flush=True)
mon.finish()
dist.destroy_process_group()
"""


def test_an_fsdp2_run_keeps_its_peaks_with_the_shard_count_and_plans_no_replica(tmp_path):
    db, child = tmp_path / "runs.duckdb", tmp_path / "child.py"
    child.write_text(textwrap.dedent(FSDP2_CHILD))
    done = run_torchrun(str(child), str(db), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [line] = [v for v in done.stdout.splitlines() if v.startswith("STATE")]
    state = json.loads(line.removeprefix("STATE"))
    assert state["shards"] == 2 and list(state["measured"]) == ["4"] and state["probed"] == []
    [run] = store.list_runs(db)
    said = [e.message for e in store.events(db, run.run_id, kinds=[M.EVENT_ALERT])]
    for what in ("plan_memory", "probe_memory"):
        assert any(
            m.startswith(f"{what}() skipped: the model is sharded over 2 devices") for m in said
        ), said
    rows = store.memory_plan(db, run.run_id)
    assert rows and all(r.source == "measured" for r in rows)


def _monitor(db):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Monitor.start(
        db, name="r", config={}, model=model, optimizer=opt, per_device_batch=4, accum=1, seq_len=1
    )


def test_a_resume_at_another_shard_count_drops_the_saved_peaks_and_says_so(tmp_path):
    db = tmp_path / "runs.duckdb"
    saved = {"step": 7, "measured": {"4": 123_000, "8": 246_000}, "infeasible": [16], "shards": 4}
    mon = _monitor(db)  # a replica: one shard
    mon.load_state_dict(saved)
    assert mon.ramps.measured == {} and mon.ramps.infeasible == set()
    assert mon.state_dict()["shards"] == 1
    mon.load_state_dict({**saved, "shards": 1})  # the same count: kept
    assert mon.ramps.measured == {4: 123_000, 8: 246_000} and mon.ramps.infeasible == {16}
    mon.finish()
    [note] = store.events(db, mon.run_id, kinds=[M.EVENT_RESUME])
    assert note.step == 7 and note.message.startswith(
        "memory peaks measured with the model on 4 shard(s) dropped: this launch shards it over 1"
    )
