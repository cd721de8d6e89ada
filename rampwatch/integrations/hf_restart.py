"""Ramps by save-and-restart in the Hugging Face Trainer, the parts that outlive one process: the
exit (`RampRestart`, status EXIT_RAMP = 75), the state a checkpoint carries (`STATE_FILE`,
`read_state`), the arguments that continue a run at its new tier (`resume_args`), and the batch
sampler that continues the data position at the new batch (`StreamBatchSampler`). Why the data
position continues exactly: integrations/transformers.py's docstring, "Ramps".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from rampwatch.advisor.tiers import Tier

EXIT_RAMP = 75  # EX_TEMPFAIL: not an error; run the same command again to continue
STATE_FILE = "rampwatch.json"  # beside the Trainer's files in every checkpoint it saves


class RampRestart(SystemExit):
    """Raised by train() after a ramp's checkpoint is saved: the process exits with EXIT_RAMP."""

    def __init__(self, message: str, checkpoint: str, tier: Tier):
        super().__init__(EXIT_RAMP)
        self.message, self.checkpoint, self.tier = message, checkpoint, tier

    def __str__(self) -> str:
        return self.message


def read_state(checkpoint: str | None) -> dict | None:
    """The rampwatch.json of a checkpoint folder, or None (none there, or not ours)."""
    path = os.path.join(checkpoint or "", STATE_FILE)
    return json.loads(Path(path).read_text()) if checkpoint and os.path.isfile(path) else None


def resume_args(
    output_dir: str, *, per_device_train_batch_size: int, gradient_accumulation_steps: int
) -> dict:
    """TrainingArguments keywords that start a run, or continue it from the newest checkpoint in
    output_dir at the tier that checkpoint names (the new one after a ramp). RampwatchTrainer.train
    resumes from `resume_from_checkpoint` and continues the same run id in the database."""
    out = {
        "output_dir": output_dir,
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "resume_from_checkpoint": None,
    }
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is not None:
        out["resume_from_checkpoint"] = last
        state = read_state(last)
        if state is not None:
            out["per_device_train_batch_size"] = state["per_device_batch"]
            out["gradient_accumulation_steps"] = state["accum"]
    return out


class StreamBatchSampler:
    """Batches of `batch` sample indices read on from sample `start` of the stream of epochs
    (epoch e's order: `order` after set_epoch(e)); `batches` per iteration, the first iteration
    beginning with `skipped` empty batches, which accelerate's SkipBatchSampler drops unread (an
    empty batch that reached the collator would fail loudly instead of training on wrong data)."""

    def __init__(self, order, n: int, batch: int, start: int, batches: int, skipped: int):
        self.order, self.n, self.batch = order, n, batch
        self.batches, self.skipped = batches, skipped
        self._pos, self._epoch, self._perm = start, -1, []

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        skipped, self.skipped = self.skipped, 0
        for _ in range(skipped):
            yield []
        for _ in range(self.batches - skipped):
            yield [self._take() for _ in range(self.batch)]

    def _take(self) -> int:
        epoch, i = divmod(self._pos, self.n)
        if epoch != self._epoch:
            if hasattr(self.order, "set_epoch"):
                self.order.set_epoch(epoch)  # SeedableRandomSampler: seeded with seed + epoch
            self._perm, self._epoch = list(iter(self.order)), epoch
        self._pos += 1
        return self._perm[i]


def index_sampler(loader):
    """The sample-index sampler under a (prepared) dataloader's batch samplers, or None."""
    bs = getattr(loader, "batch_sampler", None)
    while hasattr(bs, "batch_sampler"):  # accelerate's BatchSamplerShard / SkipBatchSampler
        bs = bs.batch_sampler
    return getattr(bs, "sampler", None)
