"""Batch ramps inside the reference trainer: a client of the monitor's ramp protocol
(monitor/ramp.py: claim, check, auto, refuse), plus what only this trainer does — the GPT's memory
plan in a child process, a checkpoint before each switch, the schedule's base LR in TrainState,
and the out-of-memory fallback (halve the per-device batch, keep the effective batch).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import torch

from rampwatch.monitor.ramp import Ramp
from rampwatch.trainer import memplan


class StopTraining(Exception):
    """The run cannot go on (e.g. out of memory at per-device batch 1); status for the store."""

    def __init__(self, message: str, status: str = "failed", code: int = 3):
        super().__init__(message)
        self.status = status
        self.code = code  # the process's exit status


@dataclass(frozen=True)
class Tier:
    per_device_batch: int
    accum: int

    def as_dict(self) -> dict:
        return asdict(self)


def halve_tier(tier: Tier) -> tuple[Tier, bool]:
    """The OOM fallback: ⌊B/2⌋ per device, accumulation raised to keep B·accum where it can.
    Returns (tier, exact) where exact says whether the effective batch is unchanged."""
    if tier.per_device_batch <= 1:
        raise StopTraining(
            "out of memory at per-device batch 1: nothing smaller to fall back to. "
            "Use a smaller model or sequence length, or --chunked-ce."
        )
    half = tier.per_device_batch // 2
    total = tier.per_device_batch * tier.accum
    accum = -(-total // half)  # ceil: never a smaller effective batch than approved
    return Tier(half, accum), half * accum == total


class OomInjector:
    """Fault injection for tests and drills: `--inject-oom STEP:MICRO:PHASE` raises
    torch.OutOfMemoryError once, at that optimizer step and micro-batch, in forward, in backward
    (from inside autograd) or in the optimizer step."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, step: int | None = None, micro: int = 0, phase: str = "forward"):
        self.step, self.micro, self.phase = step, micro, phase

    @classmethod
    def parse(cls, spec: str | None) -> "OomInjector":
        if not spec:
            return cls()
        try:
            step, micro, phase = spec.split(":")
            inj = cls(int(step), int(micro), phase)
        except ValueError:
            raise SystemExit(
                f"--inject-oom {spec!r}: expected STEP:MICRO:PHASE, e.g. 12:1:backward"
            )
        if inj.phase not in cls.PHASES:
            raise SystemExit(f"--inject-oom phase {phase!r}: one of {', '.join(cls.PHASES)}")
        return inj

    def _due(self, step: int, micro: int, phase: str) -> bool:
        if self.step is None or (step, micro, phase) != (self.step, self.micro, self.phase):
            return False
        self.step = None  # once
        return True

    def maybe_raise(self, step: int, micro: int, phase: str) -> None:
        if self._due(step, micro, phase):
            raise torch.OutOfMemoryError(f"injected out of memory ({phase}, step {step})")

    def attach_backward(self, loss: torch.Tensor, step: int, micro: int) -> None:
        if self._due(step, micro, "backward"):

            def boom(grad):
                raise torch.OutOfMemoryError(f"injected out of memory (backward, step {step})")

            loss.register_hook(boom)


class RampController:
    """Owned by the Trainer; called at every optimizer-step boundary (every rank under DDP:
    the monitor's protocol makes the decision rank 0's and the boundary the same everywhere)."""

    def __init__(self, trainer):
        self.t = trainer
        self.protocol = trainer.mon.ramps
        self.protocol.variant = "chunked" if trainer.cfg.chunked_ce else "plain"
        self.protocol.infeasible = set(trainer.state.infeasible_batches)
        self.protocol.last_ramp_step = trainer.state.step

    # -- memory plan (the GPT's, in a child process) ------------------------------------------
    def start(self) -> None:
        self._start_plan()
        if self.protocol.mode == "auto" and not self.t.args.plan and self.t.ddp.is_main:
            self._say(
                "--ramp auto without a memory plan (--no-plan): ramps by accumulation "
                f"only, per-device batch stays {self.t.state.per_device_batch}"
            )

    def _say(self, message: str) -> None:
        print(f"rampwatch: {message}", file=sys.stderr, flush=True)

    def _start_plan(self) -> None:
        if not self.t.args.plan or not self.t.ddp.is_main:
            return
        b = self.t.state.per_device_batch
        ladder = sorted({max(1, b // 2), b, 2 * b, 4 * b, 8 * b})
        self.protocol.start_plan(
            memplan.start_plan(
                self.t.cfg.to_dict(),
                ladder,
                self.t.args.optimizer,
                self.t.device.type,
                amp="bf16" if self.t.device.type == "cuda" else None,
                accum_steps=self.t.state.accum,
            )
        )

    def mark_infeasible(self, per_device_batch: int, step: int) -> None:
        self.protocol.mark_infeasible(per_device_batch, step)
        self.t.state.infeasible_batches = sorted(self.protocol.infeasible)

    # -- each step boundary -------------------------------------------------------------------
    def at_boundary(self) -> None:
        ramp = self.t.mon.ramp_due(self.t.state.step)
        if ramp is not None:
            self.apply(ramp)

    def apply(self, ramp: Ramp) -> None:
        """Checkpoint, switch tier, move the schedule's base LR, re-plan, record the event."""
        t = self.t
        t.save_checkpoint()
        t.state.base_lr = ramp.base_lr  # the schedule (set_lr) shapes it from the next step
        t.state.per_device_batch, t.state.accum = ramp.per_device_batch, ramp.accum
        t.mon.ramp_applied(ramp)
        if ramp.per_device_batch != ramp.before[0]:
            self._start_plan()
