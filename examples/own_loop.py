"""Rampwatch in your own training loop: the README's snippet, runnable (tests/test_install.py runs it
from a wheel installed into a fresh environment; tests/test_trainer.py checks the README matches;
tests/test_own_loop_ramps.py approves ramps into the same loop from another process,
tests/test_own_loop_trials.py a trial).

    python examples/own_loop.py runs.duckdb [auto] [trials]
"""

import sys

import torch

from rampwatch import Monitor, TokenClock

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
batch, accum, steps = 16, 4, 60
data = torch.randn(batch * accum * steps * 8, 32)
target = data.sum(dim=1, keepdim=True) + 0.5 * torch.randn(len(data), 1)
held_x = torch.randn(256, 32)  # a trial judges every arm on these fixed held-out examples
held_y = held_x.sum(dim=1, keepdim=True) + 0.5 * torch.randn(len(held_x), 1)
step, pos = 0, 0  # the next sample: a ramp or a trial changes how many a step takes, never which
db, *opts = sys.argv[1:]
mode, trials = "auto" if "auto" in opts else "manual", "trials" in opts


def train_step(model, opt, start, count):
    """One optimizer step on examples start .. start + count - 1: a trial's arms call it."""
    x, y = data[start : start + count], target[start : start + count]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step(count)  # the TokenClock below: this step's tokens (one an example)
    return loss.detach()


def evaluate(model):
    """One loss per held-out example, always in the same order: the trial pairs them."""
    return ((model(held_x) - held_y) ** 2).squeeze(1)


# the README shows the part below as it is, aligned comments and all: the formatter leaves it
# fmt: off
# --- the integration ----------------------------------------------------------------------
budget = batch * accum * steps                # the run's tokens (seq_len 1: one an example)
sched = TokenClock(sched, tokens_per_step=batch * accum)  # the schedule's steps, in tokens
mon = Monitor.start(db, name="own-loop", config={"lr": 1e-2}, model=model, optimizer=opt,
                    per_device_batch=batch, accum=accum, seq_len=1, ramp=mode, trials=trials,
                    total_tokens=budget)
while mon.tokens_seen < budget:               # a ramp takes fewer steps, never more tokens
    step += 1
    total = torch.zeros(())
    for _ in range(accum):
        x, y, pos = data[pos:pos + batch], target[pos:pos + batch], pos + batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss / accum).backward()
        mon.after_backward()                  # noise-scale partial sums, no device sync
        total += loss.detach() / accum        # stays on the device
    mon.step(step, loss=total)                # before clipping: grad norm, noise scale, memory
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step(batch * accum)                 # this step's tokens: warmup and decay stay put
    if (ramp := mon.ramp_due()) is not None:  # approved on the dashboard (or ramp="auto")
        batch, accum = ramp.per_device_batch, ramp.accum
        ramp.scale_lr(opt, sched)             # the LR rule, on the scheduler's base LRs too
        mon.ramp_applied(ramp)                # the card: "applied at step N"
    if trial := mon.trial_due():              # "Test ×2 / ×4 first" (trials=True only)
        out = mon.run_trial(trial, train_step, evaluate, start=pos, scheduler=sched)
        if out is not None:                   # None: abandoned, the snapshot restored
            pos += trial.delta_examples       # every arm read the same examples
            batch, accum = out.tier.per_device_batch, out.tier.accum
            step = mon.trial_ended(out)       # trial_end; the run goes on from the kept arm
mon.finish()
