"""A user's own training loop, as examples/own_loop.py writes it (its LR schedule stepped by tokens
through a TokenClock, to a token budget of --steps steps of the first tier), with knobs for the
tests: run in a child process against a real database (tests/test_own_loop_ramps.py).

    python -m tests.own_loop_child DB OUT.pt [--ramp manual|auto|off] [--steps N]
        [--batch B --accum A] [--wait-ramp-at S]   block at boundary S until a ramp arrives
        [--schedule warmup|cosine]                  LambdaLR warmup, or warmup then cosine decay
        [--schedule-in-steps]                       no clock: sched.step() per step, N steps
        [--switch-at S:B:A]                         switch by hand at boundary S (no monitor)
        [--oom-at B]                                a per-device batch >= B "runs out of memory"
        [--policy JSON] [--capacity-bytes N] [--step-sleep SECONDS]
        [--no-after-backward]                       the loop forgets mon.after_backward()
        [--compile]                                 pass torch.compile(model) to the monitor
    torchrun --nproc_per_node=2 -m tests.own_loop_child …   data parallel (gloo): OUT.rank{r}

OUT.pt gets the final parameters and the step each ramp was applied at.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch

from rampwatch import Monitor, TokenClock
from rampwatch.advisor.lr import scaled_base_lr
from rampwatch.advisor.policy import RampPolicy
from rampwatch.monitor.ramp_protocol import scale_lr
from tests.procs import free_ddp, loop_parser, wait_for_ramp

WIDTH = 256  # wide enough that a per-device batch's activations show in the measured peak


def build(seed: int = 0, schedule: str = "warmup", steps: int = 20):
    """Model, AdamW and its LR schedule, planned over `steps` steps (cosine: a 4-step linear
    warmup, then cosine decay to 0 at `steps`)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    S = torch.optim.lr_scheduler
    if schedule == "cosine":
        parts = [S.LinearLR(opt, 0.1, total_iters=4), S.CosineAnnealingLR(opt, T_max=steps - 4)]
        return model, opt, S.SequentialLR(opt, parts, milestones=[4])
    return model, opt, S.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


def data(n: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True) + 0.5 * torch.randn(n, 1, generator=g)


def main(argv=None) -> int:
    p = loop_parser()
    p.add_argument("--switch-at", action="append", default=[])
    p.add_argument("--oom-at", type=int)
    p.add_argument("--capacity-bytes", type=int)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--no-after-backward", action="store_true")
    p.add_argument("--schedule", choices=["warmup", "cosine"], default="warmup")
    p.add_argument("--schedule-in-steps", action="store_true")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args(argv)

    model, opt, sched = build(schedule=a.schedule, steps=a.steps)
    rank, world, train = 0, 1, model
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: data parallel, gloo
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        train = torch.nn.parallel.DistributedDataParallel(model)
    if a.compile:  # the eager backend: the wrapper a compiled model has, without the compile time
        train = torch.compile(train, backend="eager")
    x_all, y_all = data(a.batch * a.accum * a.steps * 16 * world)
    batch, accum, pos = a.batch, a.accum, 0
    budget = a.steps * batch * accum * world  # seq_len 1: one token per sample
    if not a.schedule_in_steps:
        sched = TokenClock(sched, tokens_per_step=batch * accum * world)
    policy = RampPolicy(
        original_batch=batch * accum * world,
        original_lr=1e-2,
        lr_rule="sqrt",
        **json.loads(a.policy),
    )
    mon = Monitor.start(
        a.db,
        name="own-loop-child",
        config={"lr": 1e-2},
        model=train,
        optimizer=opt,
        per_device_batch=batch,
        accum=accum,
        seq_len=1,
        ramp=a.ramp,
        policy=policy,
        capacity_bytes=a.capacity_bytes,
        total_tokens=budget,
    )
    switches = {int(s): (int(b), int(c)) for s, b, c in (v.split(":") for v in a.switch_at)}
    applied: list[int] = []
    if rank == 0:
        print(f"run {mon.run_id}", flush=True)
    step = 0
    while (step < a.steps) if a.schedule_in_steps else (mon.tokens_seen < budget):
        step += 1
        if a.oom_at and batch >= a.oom_at:  # what a loop does when its forward runs out
            mon.report_oom(batch, step - 1, "simulated out of memory")
            batch, accum = batch // 2, accum * 2
            mon.set_tier(batch, accum)
        total = torch.zeros(())
        for j in range(accum):
            i = pos + rank * batch  # this rank's share of the micro-step's world × batch
            x, y, pos = x_all[i : i + batch], y_all[i : i + batch], pos + batch * world
            # DDP: the all-reduce only on the last micro-batch (the monitor's local points)
            with train.no_sync() if world > 1 and j < accum - 1 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(train(x), y)
                (loss / accum).backward()
            if not a.no_after_backward:
                mon.after_backward()
            total += loss.detach() / accum
        mon.step(step, loss=total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.schedule_in_steps:
            sched.step()
        else:
            sched.step(batch * accum * world)  # this step's tokens
        time.sleep(a.step_sleep)
        if step in switches:  # by hand, the LR by the same rule
            new_batch, new_accum = switches[step]
            scale_lr(opt, scaled_base_lr(1.0, batch * accum, new_batch * new_accum, "sqrt"), sched)
            batch, accum = new_batch, new_accum
            mon.set_tier(batch, accum)
            applied.append(step)
        ramp = wait_for_ramp(mon.ramp_due, step in a.wait_ramp_at)
        if ramp is not None:
            batch, accum = ramp.per_device_batch, ramp.accum
            ramp.scale_lr(opt, sched)
            mon.ramp_applied(ramp)
            applied.append(step)
            print(f"ramp applied at step {step}: {batch} x {accum}", flush=True)
    mon.finish()
    torch.save(
        {
            "params": [t.detach() for t in model.parameters()],
            "applied": applied,
            "lr": opt.param_groups[0]["lr"],
            "finite": all(math.isfinite(float(t.detach().sum())) for t in model.parameters()),
        },
        a.out if world == 1 else f"{a.out}.rank{rank}",
    )
    if world > 1:  # DDP first (see tests.procs.free_ddp): the monitor holds it too
        del train, mon
        free_ddp()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
