"""A Lightning 2.x fit with RampwatchCallback, with knobs for the tests: run in a child process
against a real database (tests/test_integration_lightning.py). Model, optimizer, LR schedule and
data are tests/own_loop_child.py's, in the same order, so the two loops compare step for step.

    python -m tests.lightning_child DB OUT.pt [--ramp manual|auto|off] [--steps N]
        [--batch B --accum A] [--wait-ramp-at S ...]   block at boundary S until a ramp is due
        [--epoch-samples N] [--reload]     each epoch a fresh slice of N samples (the own loop's
                                           next ones); rebuild the loader every epoch
        [--unsafe-switch-at S:A]           no callback: accumulate_grad_batches = A right after
                                           step S, wherever Lightning's counters are
        [--policy JSON] [--stop-after S]   stop after step S (the data still sized by --steps)
        [--scaler SCALE]                   16-mixed with a GradScaler starting at SCALE
        [--checkpoint-dir DIR --checkpoint-every N]  Lightning's ModelCheckpoint every N steps
        [--resume CKPT]                    fit(ckpt_path=CKPT): resume from that checkpoint
        [--schedule warmup|cosine]         the own loop's LR schedules, planned over --steps
        [--then-resume CKPT DB OUT [--then-stop-after S]]  then, in the same processes, a fresh
                                           fit(ckpt_path=CKPT) into DB, its results in OUT
    torchrun --nproc_per_node=2 -m tests.lightning_child …   strategy="ddp" on gloo: OUT.rank{r}

The callback keeps the token budget (--steps steps of the first tier) and steps the schedule by
tokens; without it (--unsafe-switch-at) Lightning steps the schedule and ends at --steps.

OUT.pt gets the final parameters, the steps ramps were applied at, the LR, the optimizer steps,
how many of them ran with no zero_grad since the step before (gradients applied twice), every
batch's (step, accumulation, sample ids), the monitor's state_dict() when the fit started (a
resumed one: what it continued) and whether its DDP norm hook was attached.

Under torchrun the data are the own loop's for that world size, and Lightning puts a
DistributedSampler in the train loader, which shuffles each epoch's slice (a training loader is
always shuffled under DDP: trainer/connectors/data_connector.py `_process_dataloader`) and deals
it out to the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from rampwatch.advisor.lr import scaled_base_lr
from rampwatch.advisor.policy import RampPolicy
from rampwatch.integrations.lightning import RampwatchCallback
from rampwatch.monitor.ramp_protocol import scale_lr
from tests.own_loop_child import build, data
from tests.procs import loop_parser, wait_for_ramp


class Module(pl.LightningModule):
    def __init__(self, schedule: str = "warmup", steps: int = 20):
        super().__init__()
        # the own loop's seed, init, AdamW and LR schedule
        self.net, self.opt, self.sched = build(schedule=schedule, steps=steps)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch  # the third: sample ids (SampleLog)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return {
            "optimizer": self.opt,
            "lr_scheduler": {"scheduler": self.sched, "interval": "step"},
        }


class Slices(pl.LightningDataModule):
    """Epoch e reads samples [e·N, (e+1)·N) in order, so the loop sees the own loop's sequence."""

    def __init__(self, x, y, batch_size: int, epoch_samples: int):
        super().__init__()
        self.x, self.y, self.batch_size, self.n, self.offset = x, y, batch_size, epoch_samples, 0

    def train_dataloader(self):
        lo, self.offset = self.offset, self.offset + self.n
        return DataLoader(
            TensorDataset(
                self.x[lo : lo + self.n], self.y[lo : lo + self.n], torch.arange(lo, lo + self.n)
            ),
            batch_size=self.batch_size,
        )


class StaleSteps(pl.Callback):
    """Counts optimizer steps with no zero_grad since the previous step."""

    def __init__(self):
        self.zeroed, self.steps, self.stale = False, 0, 0

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.zeroed = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1
        self.stale += not self.zeroed
        self.zeroed = False


class SampleLog(pl.Callback):
    """(step, accumulate_grad_batches, sample ids) of every batch this rank trains on."""

    def __init__(self):
        self.batches: list[tuple[int, int, list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step + 1  # the optimizer step this batch's gradient goes into
        self.batches.append((step, trainer.accumulate_grad_batches, batch[2].tolist()))


class UnsafeSwitch(pl.Callback):
    """What the callback avoids: a new accumulation right after step S, mid-way through
    Lightning's counters (the LR by the same rule as the own loop's switch by hand)."""

    def __init__(self, step: int, accum: int, batch: int):
        self.step, self.accum, self.batch, self.done = step, accum, batch, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:
            self.done = True
            old = trainer.accumulate_grad_batches
            scale_lr(
                pl_module.opt,
                scaled_base_lr(1.0, self.batch * old, self.batch * self.accum, "sqrt"),
                pl_module.sched,
            )
            trainer.accumulate_grad_batches = self.accum


class Waiting(RampwatchCallback):
    """Blocks at the boundaries named until the monitor has a ramp due (the test approves it)."""

    def __init__(self, *args, wait_at=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.wait_at = set(wait_at)

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self.started_with = self.monitor.state_dict()
        self.rank_hook = self.monitor.grads.rank_hook is not None  # DDP's per-rank norm hook
        if trainer.global_rank == 0:  # under DDP: the rank with the writer
            print(f"run {self.monitor.run_id}", flush=True)

    def ramp_due(self, step):
        return wait_for_ramp(lambda: super(Waiting, self).ramp_due(step), step in self.wait_at)


def main(argv=None) -> int:
    p = loop_parser()
    p.add_argument("--epoch-samples", type=int)
    p.add_argument("--reload", action="store_true")
    p.add_argument("--unsafe-switch-at")
    p.add_argument("--stop-after", type=int)
    p.add_argument("--scaler", type=float)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--resume")
    p.add_argument("--schedule", choices=["warmup", "cosine"], default="warmup")
    p.add_argument("--then-resume", nargs=3, metavar=("CKPT", "DB", "OUT"))
    p.add_argument("--then-stop-after", type=int)
    a = p.parse_args(argv)
    fit(a)
    if a.then_resume:  # a fresh module, data, callback and Trainer, as a new process has
        ckpt, db, out = a.then_resume
        again = dict(db=db, out=out, resume=ckpt, stop_after=a.then_stop_after)
        fit(argparse.Namespace(**{**vars(a), **again, "wait_ramp_at": [], "checkpoint_dir": None}))
    return 0


def fit(a: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's: Lightning reads it too
    # the own loop's n for this world size: same samples, same order
    x, y = data(a.batch * a.accum * a.steps * 16 * world)
    module = Module(a.schedule, a.steps)
    stale, samples = StaleSteps(), SampleLog()
    callbacks: list[pl.Callback] = [stale, samples]
    cb = None
    if a.unsafe_switch_at:
        s, k = (int(v) for v in a.unsafe_switch_at.split(":"))
        callbacks.append(UnsafeSwitch(s, k, a.batch))
    else:
        policy = RampPolicy(
            original_batch=a.batch * a.accum * world,
            original_lr=1e-2,
            lr_rule="sqrt",
            **json.loads(a.policy),
        )
        cb = Waiting(
            a.db,
            name="lightning-child",
            seq_len=1,
            ramp=a.ramp,
            policy=policy,
            config={"lr": 1e-2},
            wait_at=a.wait_ramp_at,
        )
        callbacks.append(cb)
    if a.checkpoint_dir:
        every = a.checkpoint_every
        callbacks.append(
            ModelCheckpoint(a.checkpoint_dir, every_n_train_steps=every, save_top_k=-1)
        )
    # fp16 autocast on the CPU with a real loss scale (Lightning's "16-mixed" has none on the CPU)
    amp = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=a.scaler))]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy="ddp" if world > 1 else "auto",
        logger=False,
        enable_checkpointing=bool(a.checkpoint_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=amp if a.scaler else None,
        max_steps=a.stop_after or a.steps,
        accumulate_grad_batches=a.accum,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        reload_dataloaders_every_n_epochs=1 if a.reload else 0,
    )
    data_module = Slices(x, y, a.batch, a.epoch_samples or len(x))
    trainer.fit(module, datamodule=data_module, ckpt_path=a.resume)
    applied = [r.step for r in cb.history] if cb else []
    for r in cb.history if cb else ():
        print(f"ramp applied at step {r.step}: {r.per_device_batch} x {r.accum}", flush=True)
    torch.save(
        {
            "params": [t.detach() for t in module.net.parameters()],
            "applied": applied,
            "lr": module.opt.param_groups[0]["lr"],
            "steps": stale.steps,
            "stale": stale.stale,
            "batches": samples.batches,
            "monitor_at_start": cb.started_with if cb else None,
            "rank_hook": cb.rank_hook if cb else None,
        },
        a.out if world == 1 else f"{a.out}.rank{trainer.global_rank}",
    )


if __name__ == "__main__":
    sys.exit(main())
