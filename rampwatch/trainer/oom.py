"""The reference trainer's out-of-memory fallback, in one place: `decide_oom` says what an
out-of-memory means (a pure function of the tier, where it struck and whether peers share the
step), `OomGuard` does it (free memory, mark the per-device batch infeasible, checkpoint, record
the event, then redo the step or stop). Also owns `halve_tier` (the smaller tier), `OomInjector`
(--inject-oom) and `StopTraining` (how the loop ends a run that cannot go on).

Why the three outcomes (docs/ARCHITECTURE.md "Distributed"):
- one process, forward or backward: nothing else waits on this step, so it is redone in place at
  the halved tier;
- several ranks, forward or backward: peers may already wait in this step's all-reduce, so the
  step cannot be redone; this rank checkpoints the last completed step at the halved tier and
  stops, and torchrun --max-restarts restarts every rank from it (trainer/dist.py);
- inside the optimizer step: the weights are half-updated, so only the last periodic checkpoint
  can be re-tiered, and the run stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rampwatch.advisor.tiers import Tier
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from rampwatch.monitor import Monitor
    from rampwatch.trainer.dist import DistInfo

SAVE = "save"  # checkpoint the last completed step at the halved tier
RETIER = "retier"  # rewrite the tier of the checkpoint already on disk


class StopTraining(Exception):
    """The run cannot go on (out of memory at per-device batch 1, a stop signal): the message,
    the run's status for the store and the process's exit status."""

    def __init__(self, message: str, status: str = "failed", code: int = 3):
        super().__init__(message)
        self.status = status
        self.code = code


def halve_tier(tier: Tier) -> Tier | None:
    """⌊b/2⌋ per device, accumulation rounded up so the effective batch never shrinks below what
    was approved (it grows when b·accum is odd at the new per-device batch); None at per-device
    batch 1, where there is nothing smaller."""
    if tier.per_device_batch <= 1:
        return None
    half = tier.per_device_batch // 2
    return Tier(half, -(-tier.per_rank // half), tier.world_size)


def error_line(exc: BaseException) -> str:
    """The first line of an out-of-memory error (CUDA's runs to a paragraph of allocator
    advice)."""
    text = str(exc)
    return text.splitlines()[0] if text else "out of memory"


@dataclass(frozen=True)
class OomDecision:
    """What one out-of-memory changes. `after` None: nothing smaller, the run stops with
    `message` and records nothing."""

    before: Tier
    after: Tier | None
    redo: bool  # redo the failed step in place at `after`; otherwise the run stops
    checkpoint: str | None  # SAVE, RETIER or None
    event_step: int | None  # where the event and the infeasible plan row go
    message: str
    data: dict = field(default_factory=dict)
    note: dict | None = None  # saved with the checkpoint: the event the resumed rank 0 records


def decide_oom(
    tier: Tier,
    completed_step: int,
    *,
    error: str,
    run_id: str,
    in_optimizer: bool = False,
    rank: int = 0,
    checkpoint_exists: bool = False,
) -> OomDecision:
    """The out-of-memory in step completed_step + 1 at `tier`, on `rank` of its world size."""
    world_size = tier.world_size
    after = halve_tier(tier)
    if after is None:
        return OomDecision(
            tier,
            None,
            redo=False,
            checkpoint=None,
            event_step=None,
            message="out of memory at per-device batch 1: nothing smaller to fall back to. "
            "Use a smaller model or sequence length, or --chunked-ce.",
        )
    failed = completed_step + 1
    exact = after.batch == tier.batch
    inexact = "" if exact else " (effective batch not kept exactly: odd per-device batch)"
    b, new = tier.per_device_batch, f"{after.per_device_batch} x {after.accum}"
    data = {
        "before": tier.to_payload(),
        "after": after.to_payload(),
        "exact": exact,
        "error": error,
    }
    if world_size > 1:
        data.update(rank=rank, world_size=world_size)
    if in_optimizer:
        where = (
            f"the checkpoint now holds tier {new}{inexact}: resume with --resume {run_id}"
            if checkpoint_exists
            else f"no checkpoint yet: start again at {new}{inexact}"
        )
        message = (
            f"out of memory inside the optimizer step at step {failed} (per-device batch {b}); "
            + where
        )
        return OomDecision(
            tier,
            after,
            redo=False,
            checkpoint=RETIER if checkpoint_exists else None,
            event_step=failed,
            message=message,
            data={"phase": "optimizer", **data},
        )
    if world_size == 1:
        message = f"out of memory at per-device batch {b}: step redone at {new}{inexact}"
        return OomDecision(tier, after, True, None, failed, message, data)
    message = (
        f"out of memory on rank {rank} at per-device batch {b} in step {failed}: all ranks "
        f"stop; the checkpoint at step {completed_step} holds tier {new}{inexact}; torchrun "
        f"--max-restarts resumes it (or --resume {run_id})"
    )
    # the event goes at the checkpoint's step, since a resume purges events after it; rank 0
    # records it now, another rank (no writer) through the note the resumed rank 0 records
    note = None if rank == 0 else {"kind": M.EVENT_OOM, "message": message, "data": data}
    return OomDecision(tier, after, False, SAVE, completed_step, message, data, note)


class OomGuard:
    """Applies decide_oom's decision for the loop: the one place an out-of-memory changes the
    run's tier, its infeasible per-device batches, its events and checkpoints, or stops it."""

    def __init__(
        self,
        state: ckpt.TrainState,
        monitor: Monitor,
        model: torch.nn.Module,
        info: DistInfo,
        *,
        checkpoint_path: Path,
        write_checkpoint: Callable[[Tier | None, dict | None], object],
    ):
        self.state = state
        self.monitor = monitor
        self.model = model
        self.info = info
        self.checkpoint_path = checkpoint_path
        self.write_checkpoint = write_checkpoint  # (tier to resume at, note): any rank writes

    def recover(self, tier: Tier, error: str, *, in_optimizer: bool = False) -> Tier:
        """After torch.OutOfMemoryError at `tier`: the tier to redo the step at, or StopTraining."""
        self.model.zero_grad(set_to_none=True)  # the failed step's gradients
        self.monitor.discard_step()
        if self.info.device.type == "cuda":
            torch.cuda.empty_cache()
        decision = decide_oom(
            tier,
            self.state.step,
            error=error,
            run_id=self.state.run_id,
            in_optimizer=in_optimizer,
            rank=self.info.rank,
            checkpoint_exists=self.checkpoint_path.exists(),
        )
        return self.apply(decision)

    def apply(self, decision: OomDecision) -> Tier:
        after, before = decision.after, decision.before
        if after is None:
            raise StopTraining(decision.message)
        # marked first, so a checkpoint (copying the monitor's state) holds it; Monitor.report_oom's
        # own event would come before the checkpoint, and the event must not claim one not there
        self.monitor.mark_infeasible(before.per_device_batch, decision.event_step)
        if decision.checkpoint == SAVE:
            self.write_checkpoint(after, decision.note)
        elif decision.checkpoint == RETIER:
            try:
                ckpt.retier(
                    self.checkpoint_path,
                    after.per_device_batch,
                    after.accum,
                    before.per_device_batch,
                )
            except ckpt.SaveFailed as failed:  # a full disk: the run stops failed, in one line
                raise StopTraining(f"{decision.message}; {failed}") from None
        self.monitor.event(decision.event_step, M.EVENT_OOM, decision.message, decision.data)
        if not decision.redo:
            raise StopTraining(decision.message)
        self.state.set_tier(after)
        self.monitor.set_tier(after.per_device_batch, after.accum)
        return after


class OomInjector:
    """Fault injection for tests and drills: `--inject-oom STEP:MICRO:PHASE` raises
    torch.OutOfMemoryError once, at that optimizer step and micro-batch, in forward, in backward
    (from inside autograd) or in the optimizer step."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, step: int | None = None, micro: int = 0, phase: str = "forward"):
        self.step, self.micro, self.phase = step, micro, phase

    @classmethod
    def parse(
        cls,
        spec: str | None,
        *,
        rank: int = 0,
        only_rank: int | None = None,
        restart: int = 0,
    ) -> OomInjector:
        """The --inject-oom spec (SystemExit when malformed). It fires once per job: never after
        a torchrun restart (the restarted run would fail again at the same step), and only on
        `only_rank` when that is given."""
        if not spec:
            return cls()
        try:
            step, micro, phase = spec.split(":")
            injector = cls(int(step), int(micro), phase)
        except ValueError:
            raise SystemExit(
                f"--inject-oom {spec!r}: expected STEP:MICRO:PHASE, e.g. 12:1:backward"
            ) from None
        if injector.phase not in cls.PHASES:
            raise SystemExit(f"--inject-oom phase {phase!r}: one of {', '.join(cls.PHASES)}")
        if restart > 0 or (only_rank is not None and only_rank != rank):
            return cls()
        return injector

    def _due(self, step: int, micro: int, phase: str) -> bool:
        if self.step is None or (step, micro, phase) != (self.step, self.micro, self.phase):
            return False
        self.step = None  # once
        return True

    def maybe_raise(self, step: int, micro: int, phase: str) -> None:
        if self._due(step, micro, phase):
            raise torch.OutOfMemoryError(f"injected out of memory ({phase}, step {step})")

    def attach_backward(self, loss: torch.Tensor, step: int, micro: int) -> None:
        """A hook on `loss` that raises from inside autograd, as a real backward OOM does."""
        if self._due(step, micro, "backward"):

            def boom(grad):
                raise torch.OutOfMemoryError(f"injected out of memory (backward, step {step})")

            loss.register_hook(boom)
