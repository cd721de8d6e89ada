"""The run's token budget across ramps: `TokenClock`, which drives any step-based LR scheduler by
tokens seen, and `steps_to_budget`, the optimizer steps a budget has left at the batch now.

    sched = TokenClock(LambdaLR(opt, warmup), tokens_per_step=batch * accum * seq_len)
    ...
    opt.step()
    sched.step(batch * accum * seq_len)   # this step's tokens, at whatever tier runs now

A scheduler counts its own steps, so after a ×2 ramp its warmup and decay would run over twice
the tokens. The clock keeps the schedule as written, in steps of `tokens_per_step` tokens (the
tier it was planned for), and calls `scheduler.step()` once for every `tokens_per_step` tokens
trained: after a ×k ramp, k times per optimizer step. So the LR at every token is the unramped
schedule's at that token, and `Ramp.scale_lr` multiplies it as before: the clock's
`_schedulers` is the scheduler, which scale_lr walks (as it walks SequentialLR's children).

Why stepping and not a closed form in tokens: it works for every scheduler unchanged (LambdaLR,
the Hugging Face schedules, CosineAnnealingLR's recursive form, SequentialLR, OneCycleLR), its
state stays the scheduler's own, and where tokens arrive in multiples of `tokens_per_step` (a
ramp by a whole factor of the planned tier) it is exact. Otherwise the schedule stands at the
last whole step of `tokens_per_step` tokens, at most one planned step behind.

Frameworks that call `step()` with no argument pass `seen`, a function returning the tokens seen
so far (the Monitor's `tokens_seen`, counted at `Monitor.step` before the optimizer step).
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["TokenClock", "steps_to_budget"]


def steps_to_budget(total_tokens: int, tokens_seen: int, step_tokens: int) -> int:
    """Optimizer steps of `step_tokens` tokens until the budget is reached: the last one may
    pass it by less than one step, as the reference trainer's `tokens_seen >= total_tokens`."""
    return max(0, math.ceil((total_tokens - tokens_seen) / step_tokens))


class TokenClock:
    """`scheduler` stepped by tokens: one scheduler step per `tokens_per_step` tokens trained.

    step(tokens): after an optimizer step that trained on `tokens` tokens (no argument: the
    tokens `seen()` reports, or one planned step). state_dict() holds the scheduler's state and
    the clock's count, so a checkpoint or a trial's snapshot puts both back. tokens_per_step may
    be set after construction, before the first step (a framework that learns its batch late)."""

    def __init__(
        self,
        scheduler,
        tokens_per_step: int | None,
        *,
        seen: Callable[[], int] | None = None,
    ):
        if tokens_per_step is not None and not (
            type(tokens_per_step) is int and tokens_per_step > 0
        ):
            raise ValueError(
                f"tokens_per_step must be a positive whole number (the tokens one step of the "
                f"schedule stands for), got {tokens_per_step!r}"
            )
        self.scheduler = scheduler
        self.tokens_per_step = tokens_per_step
        self.seen = seen
        self.tokens = 0  # tokens trained so far, by this clock's count
        self.steps = 0  # scheduler steps taken: tokens // tokens_per_step once caught up

    def step(self, tokens: int | None = None) -> None:
        if self.tokens_per_step is None:
            raise RuntimeError("TokenClock.step() before its tokens_per_step was set")
        if tokens is not None:
            self.tokens += int(tokens)
        elif self.seen is not None:
            self.tokens = int(self.seen())
        else:
            self.tokens += self.tokens_per_step
        due = self.tokens // self.tokens_per_step
        while self.steps < due:
            self.scheduler.step()
            self.steps += 1

    # -- what torch, Hugging Face and Lightning ask of a scheduler -------------------------------
    @property
    def optimizer(self):
        return self.scheduler.optimizer

    @property
    def _schedulers(self) -> list:
        return [self.scheduler]  # ramp_protocol.scale_lr scales the scheduler's base LRs here

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "tokens": self.tokens,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """A clock's state, or a bare scheduler's (a checkpoint from before the clock: every one
        of its steps was a planned step)."""
        if "scheduler" not in state:
            self.scheduler.load_state_dict(state)
            self.steps = int(state.get("last_epoch", 0))
            self.tokens = self.steps * (self.tokens_per_step or 0)
            return
        self.scheduler.load_state_dict(state["scheduler"])
        self.tokens, self.steps = int(state["tokens"]), int(state["steps"])
