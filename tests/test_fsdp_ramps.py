"""An approved ramp and a trial in an own sharded loop on two gloo ranks: the README's loop with
`fully_shard` and no-sync accumulation, and one with no wrapper whose optimizer reduce-scatters
in step() (nanochat's structure) and hands its shards to mon.reduced_grad. Both are applied on
every rank at the same step, and the ranks leave the trial with the same weights (every rank's
held-out losses, from the whole model, are equal); the FSDP2 loop's trial keeps its copies in
files (its DTensors as local shards), the other's in host memory.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from tests.procs import spawn, torchrun
from tests.test_trial_dist import watch
from tests.trainer_runs import metric

pytestmark = pytest.mark.slow

WAIT_AT, STEPS = 3, 40

CHILD = """
import sys, time, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rampwatch import Monitor
from tests.fsdp_child import sync_in_step  # nanochat's structure: syncs in step()
from tests.procs import rank_line, wait_for_ramp

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sharded = sys.argv[4] == "fsdp2"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
if sharded:
    fully_shard(model[0])
    fully_shard(model)
opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if sharded
       else sync_in_step(torch.optim.AdamW)(model.parameters(), lambda: mon, lr=1e-2))
g = torch.Generator().manual_seed(1)
data = torch.randn(40000, 8, generator=g)
target = data.sum(dim=1, keepdim=True) + 0.3 * torch.randn(len(data), 1, generator=g)
held_x = torch.randn(128, 8, generator=g)
held_y = held_x.sum(dim=1, keepdim=True)
mse = torch.nn.functional.mse_loss

def train_step(model, opt, start, count):  # count: the step's examples over every rank
    share = count // world
    i = start + rank * share
    loss = mse(model(data[i : i + share]), target[i : i + share])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()

def evaluate(model):
    with torch.no_grad():
        return ((model(held_x) - held_y) ** 2).squeeze(1)

batch, accum, step, pos = 4, 2, 0, 0
mon = Monitor.start(sys.argv[1], name="fsdp2-loop", config={}, model=model, optimizer=opt,
                    per_device_batch=batch, accum=accum, seq_len=1, trials=True,
                    total_tokens=10**9)
while step < int(sys.argv[2]):
    step += 1
    for j in range(accum):
        if sharded:
            model.set_requires_gradient_sync(j == accum - 1)  # no-sync until the last one
        i = pos + rank * batch
        loss = mse(model(data[i : i + batch]), target[i : i + batch])
        (loss / accum).backward()
        mon.after_backward()
        pos += batch * world
    if sharded:
        mon.step(step, loss=loss.detach())
        opt.step()
    else:  # the global gradient exists inside opt.step() only
        opt.step()
        mon.step(step, loss=loss.detach())
    opt.zero_grad()
    rank_line(f"STEP rank={rank} step={step} tier={batch}x{accum}")
    time.sleep(0.1)  # a loop's pace: the test's commands arrive while it runs
    if (ramp := wait_for_ramp(mon.ramp_due, step == int(sys.argv[3]))) is not None:
        batch, accum = ramp.per_device_batch, ramp.accum
        ramp.scale_lr(opt)
        mon.ramp_applied(ramp)
        rank_line(f"RAMP rank={rank} step={step}")
    if trial := mon.trial_due():
        start = step
        # FSDP2's copies in files (its DTensors as local shards), nanochat's in host memory
        out = mon.run_trial(trial, train_step, evaluate, start=pos,
                            snapshots="disk" if sharded else "auto", snapshot_dir=sys.argv[5])
        if out is not None:
            pos += trial.delta_examples
            batch, accum = out.tier.per_device_batch, out.tier.accum
            step = mon.trial_ended(out)
            held = float(evaluate(model).mean())
            rank_line(f"TRIAL rank={rank} start={start} continue={step} tier={batch}x{accum} "
                      f"held={held!r}")
mon.finish()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("wrap", ["fsdp2", "nanochat"])
def test_a_ramp_and_a_trial_land_on_both_ranks_at_the_same_step(tmp_path, wrap):
    db, child = tmp_path / "runs.duckdb", tmp_path / "child.py"
    child.write_text(textwrap.dedent(CHILD))
    args = (str(child), str(db), str(STEPS), str(WAIT_AT), wrap, str(tmp_path / "trials"))
    proc = spawn(torchrun(*args), stdout=-1, stderr=-2)
    sent: dict[str, int] = {}

    def on_line(line, _):
        [run] = reader.list_runs(db) if "ramp" not in sent and "step=2 " in line else [None]
        if run is not None:  # 4 per device × 2 → × 4: batch 16 → 32 over both ranks
            payload = {"per_device_batch": 4, "accum": 4}
            sent["ramp"] = commands.submit(db, run.run_id, "ramp", payload, actor="test")
        ramped = "ramp" in sent and commands.get(db, sent["ramp"]).status == "applied"
        if ramped and "trial" not in sent and line.startswith("STEP rank=0"):
            [run] = reader.list_runs(db)
            payload = {"factors": [2], "delta_tokens": 2 * 32}  # control 2 steps, ×2 one
            sent["trial"] = commands.submit(db, run.run_id, "trial", payload, actor="test")

    out = watch(proc, on_line, timeout=240)
    assert set(sent) == {"ramp", "trial"}, out[-4000:]
    [run] = reader.list_runs(db)
    assert run.world_size == 2 and run.status == "finished"

    ramps = {int(r): int(s) for r, s in re.findall(r"RAMP rank=(\d) step=(\d+)", out)}
    assert sorted(ramps) == [0, 1] and ramps[0] == ramps[1] == WAIT_AT
    assert commands.get(db, sent["ramp"]).applied_step == WAIT_AT

    pattern = r"TRIAL rank=(\d) start=(\d+) continue=(\d+) tier=(\d+x\d+) held=(\S+)"
    trials = {int(m[0]): m[1:] for m in re.findall(pattern, out)}
    assert sorted(trials) == [0, 1], out[-4000:]
    assert trials[0] == trials[1], "the ranks left the trial at other steps, tiers or weights"
    start, cont = int(trials[0][0]), int(trials[0][1])
    assert WAIT_AT < start < cont < STEPS
    cmd = commands.get(db, sent["trial"])
    assert (cmd.status, cmd.applied_step) == ("applied", cont)
    [end] = reader.events(db, run.run_id, kinds=[M.EVENT_TRIAL_END])
    assert ("files in" if wrap == "fsdp2" else "host memory") in end.data["snapshots"]
    # the noise scale on every logged step but the trial's, the global point among its points
    logged = sorted(metric(db, run.run_id, M.GNS_TRACE))
    assert logged == [*range(1, start + 1), *range(cont + 1, STEPS + 1)]
    assert not reader.events(db, run.run_id, kinds=[M.EVENT_ALERT])
