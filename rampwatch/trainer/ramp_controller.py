"""Batch ramps inside the reference trainer: a client of the monitor's ramp protocol
(monitor/ramp_protocol.py: claim, check, auto, refuse), plus what only this trainer does — the GPT's memory
plan in a child process, a checkpoint of each switch, the schedule's base LR in TrainState.

Owns `RampController` and its pure parts: `tier_switch` (what a due ramp becomes for the
trainer's state) and `plan_ladder` (the per-device batches the plan covers). A tier is
advisor/tiers.py's `Tier`; the trainer's state holds it as TrainState.tier(world size). The
out-of-memory fallback is trainer/oom.py's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rampwatch.advisor.tiers import Tier
from rampwatch.monitor.ramp_protocol import Ramp
from rampwatch.store import names as M
from rampwatch.trainer import gpt_plan

if TYPE_CHECKING:
    from rampwatch.monitor import Monitor
    from rampwatch.trainer.checkpoint import TrainState


def plan_ladder(per_device_batch: int) -> list[int]:
    """The per-device batches the GPT's plan covers around the running one b: b/2 (where an
    out-of-memory falls back to) up to 8b (the card's largest factor, all of it per device)."""
    b = per_device_batch
    return sorted({max(1, b // 2), b, 2 * b, 4 * b, 8 * b})


@dataclass(frozen=True)
class TierSwitch:
    """What a due ramp becomes for the trainer's state."""

    tier: Tier
    base_lr: float  # the schedule's new base (set_lr shapes it from the next step)
    replan: bool  # the per-device batch moved: plan the ladder around the new one


def tier_switch(running: Tier, ramp: Ramp) -> TierSwitch:
    tier = ramp.tier
    return TierSwitch(tier, ramp.base_lr, tier.per_device_batch != running.per_device_batch)


@dataclass(frozen=True)
class GptPlan:
    """What the GPT's memory plan is made from; enabled False is --no-plan (the checks then know
    only measured peaks)."""

    model_config: dict  # ModelConfig.to_dict()
    optimizer: str
    device_type: str
    enabled: bool = True

    @property
    def variant(self) -> str:
        return M.loss_variant(self.model_config.get("chunked_ce"))


class RampController:
    """Owned by the Trainer; called at every optimizer-step boundary (every rank under DDP:
    the monitor's protocol makes the decision rank 0's and the boundary the same everywhere)."""

    def __init__(
        self,
        state: TrainState,
        monitor: Monitor,
        plan: GptPlan,
        *,
        is_main: bool,
        save_checkpoint: Callable[[], None],
    ):
        self.state = state
        self.monitor = monitor
        self.plan = plan
        self.is_main = is_main  # only rank 0 plans (it alone writes rows)
        self.save_checkpoint = save_checkpoint
        self.protocol = monitor.ramps
        monitor.set_plan_variant(plan.variant)  # the rest of the state: loop.monitor_state()

    def start(self) -> None:
        self._start_plan()
        if self.protocol.mode == "auto" and not self.plan.enabled and self.is_main:
            print(
                "rampwatch: --ramp auto without a memory plan (--no-plan): ramps by accumulation "
                f"only, per-device batch stays {self.state.per_device_batch}",
                file=sys.stderr,
                flush=True,
            )

    def _start_plan(self) -> None:
        if not self.plan.enabled or not self.is_main:
            return
        device_type = self.plan.device_type
        self.protocol.start_plan(
            gpt_plan.start_plan(
                self.plan.model_config,
                plan_ladder(self.state.per_device_batch),
                self.plan.optimizer,
                device_type,
                amp="bf16" if device_type == "cuda" else None,
                accum_steps=self.state.accum,
            )
        )

    def at_boundary(self) -> None:
        """A due ramp: switch tier, move the schedule's base LR, checkpoint, record, re-plan.

        The checkpoint comes after the switch: the boundary lies between steps, so the state at
        the same step with the new tier and base LR is whole (data position, tokens, noise
        window and infeasible batches do not move), and a resume from it carries the ramp that
        its command reports as applied at this step. It comes before the record: a kill during
        the save leaves the previous checkpoint and a command still claimed, which recovery
        refuses ("run killed"), so the record never claims a ramp the checkpoint lacks. Under
        DDP every rank switches here and only rank 0 saves (save_checkpoint)."""
        ramp = self.monitor.ramp_due(self.state.step)
        if ramp is None:
            return
        switch = tier_switch(self.state.tier(self.monitor.world_size), ramp)
        self.state.base_lr = switch.base_lr
        self.state.set_tier(switch.tier)
        self.save_checkpoint()
        self.monitor.ramp_applied(ramp)
        if switch.replan:
            self._start_plan()
