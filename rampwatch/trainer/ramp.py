"""Batch ramps inside the trainer: approved commands → checked → applied at a step boundary, the
`--ramp auto` policy, the memory plan the checks rest on, and the out-of-memory fallback.

A ramp command is re-checked here even though the dashboard only offers tiers that fit: the
memory picture may have changed (an OOM, a new measurement) since the operator clicked.
Every command ends exactly once: applied at step N, or refused with a reason.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch

from rampwatch.advisor.memory import fit_memory_model, format_gb, usable_bytes
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.ramp import accumulation_tiers, candidate_tiers
from rampwatch.store import CommandError
from rampwatch.store import names as M
from rampwatch.store.commands import Command
from rampwatch.store.commands import validate as validate_command
from rampwatch.trainer import memplan

HISTORY = 2000  # noise-scale points kept for the auto policy (covers its window and min samples)


class StopTraining(Exception):
    """The run cannot go on (e.g. out of memory at per-device batch 1); status for the store."""

    def __init__(self, message: str, status: str = "failed"):
        super().__init__(message)
        self.status = status


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
        raise StopTraining("out of memory at per-device batch 1: nothing smaller to fall back to. "
                           "Use a smaller model or sequence length, or --chunked-ce.")
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
            raise SystemExit(f"--inject-oom {spec!r}: expected STEP:MICRO:PHASE, e.g. 12:1:backward")
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


@dataclass
class Check:
    tier: Tier | None
    reason: str


class RampController:
    """Owned by the Trainer; called at every optimizer-step boundary."""

    def __init__(self, trainer, mode: str = "manual"):
        if mode not in ("manual", "auto", "off"):
            raise ValueError(f"--ramp {mode!r}: one of manual, auto, off")
        self.t = trainer
        self.mode = mode
        # the run config's policy (a resumed run's own): ramps scale from its first LR and batch
        self.policy = RampPolicy.from_config(trainer.run_config)
        self.plan_rows: list[dict] = []
        self.measured: dict[int, int] = {}
        self._plan = None
        self._handled: set[int] = set()
        self._gns_steps: list[int] = []  # steps with a fresh noise-scale estimate
        self._gns_values: list[float | None] = []
        self._gns_lower: list[float] = []
        self._last_ramp_step = trainer.state.step

    # -- memory plan ----------------------------------------------------------------------
    def start(self) -> None:
        self._start_plan()
        if self.mode == "auto" and not self.t.args.plan and self.t.ddp.is_main:
            self._say("--ramp auto without a memory plan (--no-plan): ramps by accumulation "
                      f"only, per-device batch stays {self.t.state.per_device_batch}")

    def _say(self, message: str) -> None:
        print(f"rampwatch: {message}", file=sys.stderr, flush=True)

    def _start_plan(self) -> None:
        if not self.t.args.plan or not self.t.ddp.is_main:
            return
        b = self.t.state.per_device_batch
        ladder = sorted({max(1, b // 2), b, 2 * b, 4 * b, 8 * b})
        if self._plan is not None:
            self._plan.cancel()
        self._plan = memplan.start_plan(self.t.cfg.to_dict(), ladder, self.t.args.optimizer,
                                        self.t.device.type,
                                        amp="bf16" if self.t.device.type == "cuda" else None,
                                        accum_steps=self.t.state.accum)

    def _poll_plan(self) -> None:
        if self._plan is None or not self._plan.done():
            return
        rows = self._plan.result() or []
        self._plan = None
        good = [r for r in rows if r.get("error") is None]
        if good:
            self.plan_rows = good
        self._write_plan_rows(rows, source="plan")

    def _write_plan_rows(self, rows: list[dict], source: str) -> None:
        writer = self.t.mon.writer
        if writer is None:
            return
        for r in rows:
            writer.memory_plan(
                r["per_device_batch"], variant=r.get("variant", "plain"),
                predicted_bytes=r.get("predicted_bytes"), measured_bytes=r.get("measured_bytes"),
                source=source, feasible=r.get("feasible"), step=self.t.state.step,
                breakdown=r.get("breakdown") or ({"error": r["error"]} if r.get("error") else None))

    def _record_measurement(self) -> None:
        peak = self.t.mon.last_metrics.get(M.MEM_PEAK)
        if peak is None or not math.isfinite(peak):
            return
        b = self.t.state.per_device_batch
        if peak > self.measured.get(b, 0) * 1.01:  # new information only
            self.measured[b] = int(peak)
            self._write_plan_rows([{"per_device_batch": b, "measured_bytes": int(peak),
                                    "variant": "chunked" if self.t.cfg.chunked_ce else "plain"}],
                                  source="measured")

    def memory_model(self):
        variant = "chunked" if self.t.cfg.chunked_ce else "plain"
        planned = memplan.plan_points(self.plan_rows, variant)
        measured = {b: v for b, v in self.measured.items()
                    if b not in self.t.state.infeasible_batches}
        if not planned and len(measured) < 2:
            return None
        return fit_memory_model(measured, planned or None)

    def mark_infeasible(self, per_device_batch: int, step: int) -> None:
        self._write_plan_rows([{"per_device_batch": per_device_batch, "feasible": False,
                                "variant": "chunked" if self.t.cfg.chunked_ce else "plain"}],
                              source="oom")

    # -- each step boundary -------------------------------------------------------------------
    def at_boundary(self) -> None:
        if self.t.state.step > 0:
            self._record_measurement()
            last = self.t.mon.last_metrics
            if M.GNS_LOW in last:  # a fresh estimate this step (a point, a bound or both)
                self._gns_steps.append(self.t.state.step)
                self._gns_values.append(last.get(M.GNS))
                self._gns_lower.append(last[M.GNS_LOW])
            if len(self._gns_steps) > HISTORY:  # ramp_decision's cost grows with the history
                del self._gns_steps[:-HISTORY], self._gns_values[:-HISTORY]
                del self._gns_lower[:-HISTORY]
        self._poll_plan()
        if self.mode == "off" or self.t.mon.writer is None:
            return
        # the writer's flusher claims approved commands in the background: nothing here waits
        # on the database, however long another process holds it
        for cmd in self.t.mon.writer.take_claimed_commands():
            if cmd.command_id not in self._handled:
                self._handled.add(cmd.command_id)
                self._handle_command(cmd)
        if self.mode == "auto":
            self._auto()

    def _handle_command(self, cmd: Command) -> None:
        writer = self.t.mon.writer
        if cmd.kind != "ramp":
            writer.command_refused(cmd.command_id, f"the trainer does not know command kind "
                                                   f"{cmd.kind!r}")
            return
        payload = cmd.payload or {}
        check = self.check(payload)
        if check.tier is None:
            writer.command_refused(cmd.command_id, check.reason)
            self.t.mon.event(self.t.state.step, M.EVENT_REFUSED,
                             f"ramp command {cmd.command_id} refused: {check.reason}",
                             {"command_id": cmd.command_id, "payload": payload})
            return
        self.take(check.tier, f"command {cmd.command_id}", payload.get("lr_multiplier"),
                  cmd.command_id)

    def take(self, tier: Tier, source: str, lr_multiplier: float | None = None,
             command_id: int | None = None) -> None:
        """Act on a decision that passed check(): apply it now. (Under DDP, dist's subclass
        announces it to every rank instead, and every rank applies it after the next step.)"""
        self.apply(tier, source=source, lr_multiplier=lr_multiplier)
        if command_id is not None:
            self.t.mon.writer.command_applied(command_id, self.t.state.step)

    def check(self, payload: dict) -> Check:
        """Would this tier run here, now? (None, reason) when not."""
        try:  # the store's own payload rules: the trainer does not trust what it was sent
            payload = validate_command("ramp", payload)
        except CommandError as e:
            return Check(None, str(e))
        b, a = payload["per_device_batch"], payload["accum"]
        current = Tier(self.t.state.per_device_batch, self.t.state.accum)
        if (b, a) == (current.per_device_batch, current.accum):
            return Check(None, f"the run already uses {b} x {a}")
        if b in self.t.state.infeasible_batches:
            return Check(None, f"per-device batch {b} ran out of memory earlier in this run")
        if b > current.per_device_batch and b not in self.measured:
            model = self.memory_model()
            if model is None:
                return Check(None, f"per-device batch {b} is larger than any measured and the "
                                   "memory plan is not ready yet; try again in a few steps")
            capacity, margin = self.t.mon.capacity, self.policy.margin
            need, usable = model.predict(b), usable_bytes(capacity, margin)
            if need > usable:
                return Check(None, f"per-device batch {b} needs about {format_gb(need)} > "
                                   f"{format_gb(usable)} usable ({format_gb(capacity)} capacity, "
                                   f"{margin:.0%} margin)")
        return Check(Tier(b, a), "fits")

    def apply(self, tier: Tier, source: str, lr_multiplier: float | None = None) -> None:
        """Checkpoint, switch tier, move the schedule's base LR, re-plan, record the event."""
        t = self.t
        t.save_checkpoint()
        before = Tier(t.state.per_device_batch, t.state.accum)
        world = t.ddp.world_size
        old_batch = before.per_device_batch * before.accum * world
        new_batch = tier.per_device_batch * tier.accum * world
        old_lr = t.state.base_lr
        by_rule = self.policy.new_base_lr(new_batch)
        if lr_multiplier is None or math.isclose(old_lr * lr_multiplier, by_rule, rel_tol=1e-9):
            t.state.base_lr = by_rule  # from the original base: a ramp and its reverse restore it
        else:
            t.state.base_lr = old_lr * lr_multiplier
        t.state.per_device_batch, t.state.accum = tier.per_device_batch, tier.accum
        t.mon.set_tier(tier.per_device_batch, tier.accum)
        self._last_ramp_step = t.state.step
        seq = t.cfg.seq_len
        t.mon.event(t.state.step, M.EVENT_RAMP,
                    f"ramp ({source}): {before.per_device_batch} x {before.accum} -> "
                    f"{tier.per_device_batch} x {tier.accum} per device; batch {old_batch} -> "
                    f"{new_batch} sequences; base lr {old_lr:.3g} -> {t.state.base_lr:.3g}",
                    {"source": source, "before": {**before.as_dict(), "batch": old_batch,
                                                  "tokens": old_batch * seq, "base_lr": old_lr},
                     "after": {**tier.as_dict(), "batch": new_batch, "tokens": new_batch * seq,
                               "base_lr": t.state.base_lr}, "rule": self.policy.lr_rule})
        if tier.per_device_batch != before.per_device_batch:
            self._start_plan()

    def _auto(self) -> None:
        t, policy = self.t, self.policy
        st = t.state
        rec = policy.decide(self._gns_steps, self._gns_values, self._gns_lower,
                            st.per_device_batch * st.accum * t.ddp.world_size,
                            since_step=self._last_ramp_step)
        if not rec.ready:
            return
        model = self.memory_model()
        if model is None and t.args.plan:
            return  # the plan is still running: judge the per-device batch when it is in
        if model is None:
            tiers = accumulation_tiers(st.per_device_batch, st.accum, t.ddp.world_size,
                                       t.cfg.seq_len, (policy.factor,), st.infeasible_batches,
                                       policy.lr_rule)
        else:
            tiers = candidate_tiers(st.per_device_batch, st.accum, t.ddp.world_size,
                                    t.cfg.seq_len, model, t.mon.capacity, policy.margin,
                                    factors=(policy.factor,), infeasible=st.infeasible_batches,
                                    rule=policy.lr_rule, keep_noise_scale=policy.keep_noise_scale)
        tier = next((x for x in tiers if x.fits), None)
        if tier is None:
            return
        check = self.check({"per_device_batch": tier.per_device_batch, "accum": tier.accum})
        if check.tier is not None:
            self.take(check.tier, f"auto: {rec.reason}")

    def close(self, status: str) -> None:
        if self._plan is not None:
            self._plan.cancel()
