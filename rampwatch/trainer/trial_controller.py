"""Ramp trials inside the reference trainer: a client of the monitor's trial protocol
(monitor/trial_protocol.py: the checked request, the events, the kept branch as a ramp), plus
what only this trainer does — the checkpoint at the snapshot, its data position, its LR schedule
in tokens, and the held-out evaluation of the GPT.

Owns `TrialController`. At a boundary S with a trial due:
1. checkpoint at S first, with a note: a run killed during the trial resumes from S and records
   the trial abandoned (its command is refused by recovery: "run killed"); never a half-restored
   state: the arms' states live in host memory, or in files under <checkpoint>.trial/ that a
   resume removes (monitor/trial_snapshot.py: files when host memory cannot hold the copies,
   or --trial-snapshots disk);
2. Monitor.run_trial snapshots model, optimizer and RNG (monitor/trial_runner.py); the data
   position is the sample id at S (the trainer samples by id: every arm reads ids next_sample ..
   next_sample + Δ/seq_len − 1, so every arm sees the same examples), and the LR schedule's
   position is tokens seen at S, both moved by each arm step from there; the monitor's own state
   does not move during arms (no step() is logged), so it needs no copy;
3. each arm step runs the trainer's own forward/backward at the arm's tier (more accumulation or
   a larger per-device batch, as advise() chose) with the arm's base LR (the policy's rule at its
   batch: what a ramp to it sets) shaped by the schedule at its tokens;
4. the held-out evaluation: per-sequence mean token loss on a FIXED batch of the validation
   split (TokenDataset.val_batch: windows evenly spaced over the val tokens; every run has a val
   split: the stdlib corpus's held-out files, --val-data or --val-fraction), the same for every
   arm, so the judgement is paired example by example (advisor/trial.py). A trial after one
   that could not tell asks for the batch that one said would tell (monitor/trial_protocol.py,
   `eval_examples`): it gets that many, at most config.TRIAL_EVAL_GROWTH × --trial-eval-batch,
   and at most what the split holds. So does the same trial's second stage, when the control's
   own evaluations cannot tell whether Δ is too long (monitor/trial_runner.py). A batch larger
   than --trial-eval-batch leaves the device when the trial ends;
5. continue from the kept arm (its end state restored from its copy): the run's step is
   S + its steps, its tier and base LR the arm's, the data position S's + Δ/seq_len; checkpoint
   there, then Monitor.trial_ended records trial_end, the ramp and 'applied'. A trial that fails
   inside (an out-of-memory in an arm, say) is restored to S, recorded abandoned, and the run goes
   on with a clean checkpoint at S (on one process; under torchrun every rank stops, below).
Under torchrun (trainer/dist.py) every rank gets the trial at the same boundary and runs the
same arms on its rank slice of each step (DDP keeps the weights equal). The held-out batch is
split into one shard per rank and the per-sequence losses all-gathered in order, so every rank
judges the same numbers with the same code: the same verdict and the same kept arm, at 1/world
of the evaluation's cost (rather than each rank evaluating the whole batch and trusting the
floating point to agree); a check on the kept arm stops every rank if they ever differ. A trial
that fails on any rank stops every rank (its peers may be inside an arm's all-reduce: a rank that
went on alone would pair its collectives with theirs); torchrun --max-restarts resumes from the
checkpoint at S with the trial abandoned, as after a SIGKILL.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rampwatch.monitor.trial_protocol import TrialOutcome, TrialRequest, abandoned_note
from rampwatch.monitor.trial_snapshot import remove_left_behind
from rampwatch.trainer import dist
from rampwatch.trainer.config import TRIAL_EVAL_GROWTH

if TYPE_CHECKING:
    from rampwatch.trainer.loop import Trainer


class TrialController:
    """Owned by the Trainer; called at every optimizer-step boundary after the ramp controller."""

    EVAL_CHUNK = 64  # held-out sequences per forward (full logits: keep the eval's memory small)

    def __init__(
        self, trainer: Trainer, eval_batch: int, keep: int | None = None, snapshots="auto"
    ):
        self.trainer = trainer
        self.eval_batch = eval_batch
        self.keep = keep  # --trial-keep: a testing aid
        self.snapshots = snapshots  # --trial-snapshots
        # where the copies go when host memory cannot hold them: beside the checkpoint
        self.snapshot_dir = trainer.checkpoint_path.with_suffix(".trial")
        remove_left_behind(self.snapshot_dir)  # a trial's files, if one was killed
        self._held_out = None  # (x, y) on the device, all ranks' count, the count asked for
        self._asked = eval_batch  # the held-out sequences the running trial scores

    def at_boundary(self) -> None:
        t = self.trainer
        request = t.mon.trial_due()
        if request is None:
            return
        dist.debug_trial(t.ddp, "start", request)
        with t.mon.untimed():
            t.save_checkpoint(note=abandoned_note(request))
            at_s = replace(t.state)
            out = self._run(request, at_s)
            if out is None:  # restored to S: a clean checkpoint there, without the note
                self._put_back(at_s)
                t.save_checkpoint()
                dist.debug_trial(t.ddp, "abandoned", request)
                dist.stop_after_abandoned(t.ddp, request)  # under torchrun: every rank stops
                return
            dist.agree_on_kept(t.ddp, request, out.kept.factor)
            self._continue(out, at_s)
            dist.debug_trial(t.ddp, "end", request, out, t.model)
            t.save_checkpoint()
        t.mon.trial_ended(out)

    def _run(self, request: TrialRequest, at_s) -> TrialOutcome | None:
        t = self.trainer

        def train_step(model, optimizer, start: int, count: int):
            arm = request.arm(count // request.control.batch)
            t.state.next_sample = start
            t.state.tokens_seen = at_s.tokens_seen + (start - at_s.next_sample) * request.seq_len
            return t.silent_step(arm.tier, arm.base_lr)

        self.grow_eval(request.eval_examples or self.eval_batch)
        try:
            return t.mon.run_trial(
                request,
                train_step,
                self.evaluate,
                start=at_s.next_sample,
                keep=self.keep,
                snapshots=self.snapshots,
                snapshot_dir=self.snapshot_dir,
                grow_eval=self.grow_eval,
            )
        finally:
            if self._asked > self.eval_batch:  # a larger batch than the loop's: not kept
                self._held_out = None

    def grow_eval(self, asked: int) -> int:
        """The held-out sequences the trial scores from now on: as asked, at least
        --trial-eval-batch, at most TRIAL_EVAL_GROWTH times it and what the val split holds."""
        self._asked = min(max(asked, self.eval_batch), TRIAL_EVAL_GROWTH * self.eval_batch)
        return len(self.trainer.data.val_starts(self._asked))

    def _put_back(self, at_s) -> None:
        s = self.trainer.state
        s.step, s.next_sample, s.tokens_seen = at_s.step, at_s.next_sample, at_s.tokens_seen

    def _continue(self, out: TrialOutcome, at_s) -> None:
        s, req = self.trainer.state, out.request
        s.step = out.continue_step
        s.next_sample = at_s.next_sample + req.delta_examples
        s.tokens_seen = at_s.tokens_seen + req.delta_tokens
        s.set_tier(out.tier)
        s.base_lr = out.kept.base_lr

    @torch.no_grad()
    def evaluate(self, model) -> torch.Tensor:
        """Per-sequence mean token loss (fp32) on the fixed held-out batch: under torchrun each
        rank evaluates its shard and every rank gets all of them (the same bytes)."""
        t = self.trainer
        if self._held_out is None or self._held_out[3] != self._asked:
            x, y = t.data.val_batch(self._asked)  # fewer when the split is small
            lo, hi = dist.shard(len(x), t.ddp)
            self._held_out = x[lo:hi].to(t.device), y[lo:hi].to(t.device), len(x), self._asked
        x, y, examples, _ = self._held_out
        model.eval()
        out = [torch.zeros(0, device=t.device)]  # a rank's shard may be empty
        for i in range(0, len(x), self.EVAL_CHUNK):
            xb, yb = x[i : i + self.EVAL_CHUNK], y[i : i + self.EVAL_CHUNK]
            with t.amp:
                logits = model(xb)
            ce = F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="none")
            out.append(ce.view_as(yb).mean(dim=1))
        model.train()
        return dist.gather_shards(t.ddp, torch.cat(out), examples)
