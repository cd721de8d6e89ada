"""The reference training loop: data by sample id, accumulation, schedule in tokens, telemetry,
checkpoints, and where ramps (trainer/ramp_controller.py) and the out-of-memory guard (trainer/oom.py) are
called.

One optimizer step = `accum` micro-batches of `per_device_batch` sequences on each of
`world_size` ranks, taken from the contiguous range of sample ids that starts at the run's data
position, so a change of tier never skips or repeats a sample. Step numbers are 1-based: the
first optimizer step is step 1, and a checkpoint at step S holds S completed steps.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from rampwatch.advisor.lr import rule_for
from rampwatch.advisor.policy import CONFIG_KEY as POLICY_KEY
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.tiers import Tier
from rampwatch.monitor import Monitor
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer import dist
from rampwatch.trainer.config import (
    POLICY_FLAGS,
    PRESETS,
    ModelConfig,
    default_trial_delta_tokens,
    matmul_params,
)
from rampwatch.trainer.data import TokenDataset, rank_slice
from rampwatch.trainer.data_files import prepare_for_run
from rampwatch.trainer.data_loader import Prefetcher
from rampwatch.trainer.model import GPT, configure_optimizer
from rampwatch.trainer.oom import OomGuard, StopTraining, error_line
from rampwatch.trainer.ramp_controller import GptPlan, RampController
from rampwatch.trainer.trial_controller import TrialController


def lr_schedule(
    tokens_seen: int, warmup_tokens: int, total_tokens: int, min_ratio: float = 0.1
) -> float:
    """Multiplier of the base lr: linear warmup, then cosine decay to min_ratio, all in tokens
    (so a batch ramp does not stretch or squeeze the schedule)."""
    if tokens_seen < warmup_tokens:
        return (tokens_seen + 1) / warmup_tokens
    progress = min(1.0, (tokens_seen - warmup_tokens) / max(1, total_tokens - warmup_tokens))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepOutcome:
    loss: float
    tier: Tier


def monitor_state(state: ckpt.TrainState) -> dict:
    """The Monitor.load_state_dict() of a run at `state`. A checkpoint keeps the monitor's state
    in TrainState's own fields (so older ones resume as they are): the noise window, the
    per-device batches that ran out of memory, tokens seen, the base LR and the trial protocol's
    state (the latest trial's evidence, the retry due, the held-out batch the next trial asks
    for, the training losses a trial's Δ is chosen from; older checkpoints have the losses
    alone, or nothing). Not kept: measured peaks (measured again) and the last ramp (the resume
    step stands for it: the noise-scale history behind a ramp decision starts there)."""
    return {
        "tokens_seen": state.tokens_seen,
        "base_lr": state.base_lr,
        "last_ramp_step": state.step,
        "noise_window": state.noise_window,
        "infeasible": state.infeasible_batches,
        "trials": state.trials,
    }


def keep_monitor_state(state: ckpt.TrainState, monitor: dict) -> None:
    """Copy a Monitor.state_dict() into the fields monitor_state() reads (tokens seen and the
    base LR are the loop's own: it keeps them at every step and ramp)."""
    state.noise_window = monitor["noise_window"]
    state.infeasible_batches = monitor["infeasible"]
    state.trials = monitor["trials"]


# What a resumed run takes from its own checkpoint rather than from this launch's flags: the
# model, the optimizer and the schedule it started with (the tier and data position come with
# the checkpoint's state).
RESUMED_FROM_CONFIG = (
    "preset",
    "model",
    "optimizer",
    "lr",
    "weight_decay",
    "betas",
    "grad_clip",
    "warmup_tokens",
    "total_tokens",
    "seed",
    "gns_window",
)


def adopt_run_config(args, config: dict) -> None:
    for key in RESUMED_FROM_CONFIG:
        if key in config:
            setattr(args, key, config[key])
    args.chunked_ce = bool(config.get("model", {}).get("chunked_ce", args.chunked_ce))


class Trainer:
    def __init__(self, args):
        self.args = args
        self.ddp = dist.setup(args.device)
        self.device = self.ddp.device
        dist.auto_resume(args)  # a worker restarted by torchrun resumes --run-id
        self.resume_blob = (
            ckpt.load(ckpt.checkpoint_path(args.checkpoint_dir, args.resume))
            if args.resume
            else None
        )
        if self.resume_blob is not None:
            adopt_run_config(args, self.resume_blob["config"])
        torch.manual_seed(args.seed)
        self.cfg: ModelConfig = (
            ModelConfig(**args.model) if getattr(args, "model", None) else PRESETS[args.preset]
        )
        if args.chunked_ce:
            self.cfg = ModelConfig(**{**self.cfg.to_dict(), "chunked_ce": True})
        # --data files (or, resumed, the ones the run recorded) else the stdlib corpus; the
        # vocabulary is checked against the data here, before a model exists
        recorded = self.resume_blob["config"].get("data") if self.resume_blob else None
        self.data: TokenDataset
        self.data, self.cfg = prepare_for_run(self.cfg, args, recorded)
        self.loader = Prefetcher(self.data, self.device)
        self.model = GPT(self.cfg).to(self.device)
        self.optimizer = configure_optimizer(
            self.model, args.optimizer, args.lr, args.weight_decay, tuple(args.betas)
        )
        self.state, resume_notes = self._initial_state()
        resumed = self.resume_blob is not None
        self.checkpoint_path = ckpt.checkpoint_path(args.checkpoint_dir, self.state.run_id)
        if self.ddp.is_main:
            for tmp in ckpt.remove_stale_tmp(self.checkpoint_path):
                print(f"rampwatch: removed {tmp}, left by a save that was killed", file=sys.stderr)
        self.train_model = dist.wrap(self.model, self.ddp)
        if args.compile:
            self.train_model = torch.compile(self.train_model)
        self.amp = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda"
            else nullcontext()
        )
        self.run_config = self._run_config()
        # before the store's writer starts: its SIGTERM hook then flushes and chains to ours
        self.terminated = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_stop_signal)
            signal.signal(signal.SIGINT, self._on_stop_signal)
        self.mon = self._start_monitor(resumed)
        self.ramps = RampController(
            self.state,
            self.mon,
            GptPlan(self.cfg.to_dict(), args.optimizer, self.device.type, enabled=args.plan),
            is_main=self.ddp.is_main,
            save_checkpoint=self.save_checkpoint,
        )
        self.trials = TrialController(
            self,
            getattr(args, "trial_eval_batch", 256),
            getattr(args, "trial_keep", None),
            getattr(args, "trial_snapshots", "auto"),
        )
        self.injector = dist.oom_injector(args.inject_oom, self.ddp)
        self.oom = OomGuard(
            self.state,
            self.mon,
            self.model,
            self.ddp,
            checkpoint_path=self.checkpoint_path,
            write_checkpoint=self.write_checkpoint,
        )
        dist.after_setup(
            self.ddp,
            self.mon,
            self.train_model,
            run_id=args.run_id,
            notes=resume_notes,
            step=self.state.step,
        )
        self.val_x, self.val_y = (x.to(self.device) for x in self.data.val_batch(args.val_batch))
        self.reached_target = False  # --target-val-loss met at the last validation

    # -- set-up ---------------------------------------------------------------------------
    def _initial_state(self) -> tuple[ckpt.TrainState, list[dict]]:
        """The run's state, and the events a resume records once the monitor exists."""
        args, blob = self.args, self.resume_blob
        if blob is not None:
            self.model.load_state_dict(blob["model"])
            self.optimizer.load_state_dict(blob["optimizer"])
            return dist.on_resume(blob, self.ddp.world_size)
        run_id = dist.agree_run_id(args.run_id or uuid.uuid4().hex[:12], self.ddp)
        return ckpt.TrainState(
            run_id=run_id, per_device_batch=args.per_device_batch, accum=args.accum, base_lr=args.lr
        ), []

    def _run_config(self) -> dict:
        """What the store and checkpoints record. A resumed run keeps its original config (only
        the world size and the step limit, --steps, are this launch's), so its LR rule still
        scales from its first batch."""
        a = self.args
        launch = {"world_size": self.ddp.world_size, "step_limit": a.steps}
        if self.resume_blob is not None:
            return {**self.resume_blob["config"], **launch}
        return {
            "preset": a.preset,
            "model": self.cfg.to_dict(),
            "optimizer": a.optimizer,
            "lr": a.lr,
            "weight_decay": a.weight_decay,
            "betas": list(a.betas),
            "grad_clip": a.grad_clip,
            "warmup_tokens": a.warmup_tokens,
            "total_tokens": a.total_tokens,
            "seed": a.seed,
            "ramp": a.ramp,
            "per_device_batch": a.per_device_batch,
            "accum": a.accum,
            "seq_len": self.cfg.seq_len,
            "params": self.model.num_params(),
            "compile": a.compile,
            "data": self.data.meta,
            "gns_window": a.gns_window,
            POLICY_KEY: self._policy().to_config(),
            **launch,
        }

    def _policy(self) -> RampPolicy:
        a = self.args
        overrides = {k: getattr(a, k) for k in POLICY_FLAGS if getattr(a, k, None) is not None}
        return RampPolicy(
            original_batch=Tier(a.per_device_batch, a.accum, self.ddp.world_size).batch,
            original_lr=a.lr,
            lr_rule=rule_for(a.optimizer),
            **overrides,
        )

    def _start_monitor(self, resumed: bool) -> Monitor:
        from rampwatch.advisor.flops import flops_per_token

        fpt = flops_per_token(
            matmul_params(self.cfg), self.cfg.n_layer, self.cfg.d_model, self.cfg.seq_len
        )
        common = dict(
            model=self.model,
            optimizer=self.optimizer,
            per_device_batch=self.state.per_device_batch,
            accum=self.state.accum,
            seq_len=self.cfg.seq_len,
            world_size=self.ddp.world_size,
            flops_per_token=fpt,
            gns_window_steps=self.args.gns_window,
            echo=sys.stderr,
            ramp=self.args.ramp,
            policy=RampPolicy.from_config(self.run_config),
            control_group=self.ddp.side_group,
            **self._trial_options(),
        )
        if not self.ddp.is_main:
            mon = Monitor(None, device=self.device, **common)
        else:
            mon = Monitor.start(
                self.args.db,
                # a resume without --name keeps the run's name (None: the store keeps it)
                name=self.args.name if resumed else (self.args.name or self.state.run_id),
                config=self.run_config,
                capacity_bytes=self.args.capacity_bytes,
                run_id=self.state.run_id,
                resume_step=self.state.step if resumed else None,
                **common,
            )
        mon.load_state_dict(monitor_state(self.state))
        return mon

    def _trial_options(self) -> dict:
        """The monitor's trial settings: trials run unless ramps are off; Δ is --trial-delta-tokens,
        else chosen from the run's loss curve at each trial, at most
        config.default_trial_delta_tokens at the run's first tier (a resume's run config is
        the first launch's, whatever this launch's --per-device-batch and --accum say)."""
        a, c = self.args, self.run_config
        if a.ramp == "off":
            return {"trials": False, "trials_note": "the run was started with --ramp off"}
        given = getattr(a, "trial_delta_tokens", None)
        delta = given or default_trial_delta_tokens(
            Tier(c["per_device_batch"], c["accum"], self.ddp.world_size).batch,
            self.cfg.seq_len,
            a.total_tokens,
        )
        return {"trials": True, "trial_delta_tokens": delta, "trial_delta_from_loss": not given}

    # -- one optimizer step -------------------------------------------------------------------
    def _micro_batches(self, tier: Tier):
        """This rank's micro-batches of the step that starts at the run's data position; the
        loader makes the next step's in the background meanwhile (assuming the tier holds)."""
        b, world, rank = tier.per_device_batch, tier.world_size, self.ddp.rank
        global_n = tier.batch
        first, _ = rank_slice(self.state.next_sample, global_n, rank, world)
        after, _ = rank_slice(self.state.next_sample + global_n, global_n, rank, world)
        keys = [(start + j * b, b) for start in (first, after) for j in range(tier.accum)]
        self.loader.want(keys)
        for j, key in enumerate(keys[: tier.accum]):
            x, y = self.loader.get(*key)
            yield j, x, y

    def _forward_backward(self, tier: Tier, observe: bool = True) -> torch.Tensor:
        """The step's micro-batches; observe False: no noise-scale points (a trial's arm)."""
        loss_sum = torch.zeros((), device=self.device)
        for j, x, y in self._micro_batches(tier):
            last = j == tier.accum - 1
            with dist.no_sync_unless(self.train_model, last):
                self.injector.maybe_raise(self.state.step + 1, j, "forward")
                with self.amp:
                    loss = self.train_model(x, y)
                self.injector.attach_backward(loss, self.state.step + 1, j)
                (loss / tier.accum).backward()
            if observe:
                self.mon.after_backward()
            loss_sum += loss.detach()
        return loss_sum / tier.accum

    def train_step(self) -> StepOutcome:
        """Forward/backward with the OOM guard, then clip and step. Returns the mean loss."""
        tier = self.state.tier(self.ddp.world_size)
        while True:
            try:
                loss = self._forward_backward(tier)
                break
            except torch.OutOfMemoryError as exc:
                error = error_line(exc)
            # outside the except block: the failed step's tensors are no longer referenced
            tier = self.oom.recover(tier, error)
        step = self.state.step + 1
        metrics = self.mon.step(step, loss, extra={M.FIRST_SAMPLE: self.state.next_sample})
        if self.args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        try:
            self.injector.maybe_raise(step, 0, "optimizer")
            self.optimizer.step()
        except torch.OutOfMemoryError as exc:
            self.oom.recover(tier, error_line(exc), in_optimizer=True)  # raises StopTraining
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step = step
        self.state.next_sample += tier.batch
        self.state.tokens_seen = self.mon.tokens_seen
        return StepOutcome(metrics[M.LOSS], tier)

    def silent_step(self, tier: Tier, base_lr: float) -> torch.Tensor:
        """One optimizer step of a trial's arm at `tier` and `base_lr` (the schedule at the
        state's tokens): the same forward, backward, clipping and update as train_step, but
        nothing logged and no OOM fallback (an error abandons the trial). Moves the state's step,
        data position and tokens; returns the loss (on the device)."""
        self.set_lr(base_lr)
        loss = self._forward_backward(tier, observe=False)
        if self.args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.next_sample += tier.batch
        self.state.tokens_seen += tier.batch * self.cfg.seq_len
        return loss

    # -- around the steps ---------------------------------------------------------------------
    def set_lr(self, base_lr: float | None = None) -> float:
        mult = lr_schedule(self.state.tokens_seen, self.args.warmup_tokens, self.args.total_tokens)
        lr = (self.state.base_lr if base_lr is None else base_lr) * mult
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        with self.amp:
            loss = self.model(self.val_x, self.val_y)
        self.model.train()
        return float(loss)

    def save_checkpoint(self, final: bool = False, note: dict | None = None) -> None:
        """Rank 0's checkpoint of the last completed step (DDP keeps the ranks' weights equal).
        A save that fails (trainer/checkpoint.py: a full disk, say) is an alert and the run goes
        on from its older checkpoint; the final one (final: at the end or at a stop) ends the
        run failed instead. note: an event a run resumed from this checkpoint records."""
        if not self.ddp.is_main:
            return
        try:
            self._save(note=note)
        except ckpt.SaveFailed as failed:
            if final:
                raise StopTraining(str(failed)) from None
            self.mon.event(
                self.state.step,
                M.EVENT_ALERT,
                f"{failed}; training goes on",
                {"path": str(self.checkpoint_path)},
            )
            return
        self.mon.event(
            self.state.step,
            M.EVENT_CHECKPOINT,
            f"checkpoint at step {self.state.step}",
            {"path": str(self.checkpoint_path), "next_sample": self.state.next_sample},
        )

    def write_checkpoint(self, tier: Tier | None = None, note: dict | None = None) -> None:
        """The checkpoint file, from any rank (an out-of-memory stop writes it from the rank that
        failed, and stops failed instead when the save fails). tier: the one to resume at, when
        not the running one; note: an event for the resumed run to record."""
        try:
            self._save(tier, note)
        except ckpt.SaveFailed as failed:
            raise StopTraining(str(failed)) from None

    def _save(self, tier: Tier | None = None, note: dict | None = None) -> None:
        """What the monitor knows (the noise-scale window, the per-device batches that ran out
        of memory) is copied into the state here, so a resume keeps it. ckpt.SaveFailed when
        the file could not be written."""
        keep_monitor_state(self.state, self.mon.state_dict())
        state = self.state
        if tier is not None:
            state = replace(state)  # a copy: the running state keeps its own tier
            state.set_tier(tier)
        ckpt.save(
            self.checkpoint_path,
            state=state,
            model=self.model,
            optimizer=self.optimizer,
            config=self.run_config,
            note=note,
        )

    def _on_stop_signal(self, signum, frame) -> None:
        """SIGTERM or a first Ctrl-C: only a flag, the loop checkpoints at its next step
        boundary. A second Ctrl-C interrupts at once."""
        if signum == signal.SIGINT and self.terminated:
            raise KeyboardInterrupt
        self.terminated, self._stop_code = signal.Signals(signum).name, 128 + signum
        if signum == signal.SIGINT and self.ddp.is_main:
            print(
                "\nrampwatch: stopping after this step with a checkpoint (Ctrl-C again to "
                "stop at once, without one)",
                file=sys.stderr,
                flush=True,
            )

    def _stop_on_sigterm(self) -> None:
        """SIGTERM or Ctrl-C (on rank 0 under torchrun): a final checkpoint at this boundary,
        the same on every rank, then stop as killed."""
        with self.mon.untimed():
            self.save_checkpoint(final=True)
        why = self.terminated or "rank 0's stop"
        raise StopTraining(
            f"stopped by {why} after step {self.state.step}: checkpoint saved; "
            f"continue with --resume {self.state.run_id}",
            status="killed",
            code=getattr(self, "_stop_code", 128 + signal.SIGTERM),
        )

    def done(self) -> bool:
        a = self.args
        if self.reached_target:
            return True
        if a.steps is not None and self.state.step >= a.steps:
            return True
        return self.state.tokens_seen >= a.total_tokens

    def run(self) -> int:
        progress = Progress(self.args.progress, self)
        status, code = "finished", 0
        try:
            if self.state.step == 0 and not self.args.resume:
                self.mon.log(0, {M.VAL_LOSS: self.validate()})
            self.ramps.start()
            while not self.done():
                if self.terminated:
                    self.mon.request_stop()
                self.ramps.at_boundary()
                if self.mon.stopping:
                    self._stop_on_sigterm()
                self.trials.at_boundary()
                if self.done():  # a trial's kept arm can end the run
                    continue
                self.set_lr()
                outcome = self.train_step()
                progress.update(outcome)
                lr = self.optimizer.param_groups[0]["lr"]
                dist.debug_step(self.ddp, self.state, outcome.tier, lr)
                step = self.state.step
                if self.args.val_every and step % self.args.val_every == 0 or self.done():
                    with self.mon.untimed():
                        val = self.validate()
                        self.mon.log(step, {M.VAL_LOSS: val})
                    target = getattr(self.args, "target_val_loss", None)
                    self.reached_target = target is not None and val <= target
                every = self.args.checkpoint_every
                if every and step % every == 0 and not self.done():  # the final save follows
                    with self.mon.untimed():
                        self.save_checkpoint()
            self.save_checkpoint(final=True)
        except StopTraining as stop:
            print(f"\nrampwatch: {stop}", file=sys.stderr)
            status, code = stop.status, stop.code
        except KeyboardInterrupt:
            status, code = "killed", 130
        except Exception:  # e.g. under DDP a peer's exit breaks this rank's collective
            status = "failed"
            raise
        finally:
            self.loader.close()
            progress.close()
            self.mon.finish(status)
            dist.teardown(self.ddp)
        return code


class Progress:
    """Step, loss, tier, tokens/s and ETA (tokens left / tokens/s) on stderr: a one-line bar on
    a terminal ('on', or 'auto' on a tty), a plain line every LINE_EVERY steps into a log file
    ('auto' elsewhere), nothing with 'off'. Events (ramps, refusals, checkpoints, OOMs, alerts)
    are lines of their own, from the monitor."""

    LINE_EVERY = 50

    def __init__(self, mode: str, trainer: Trainer):
        main = trainer.ddp.is_main
        self.bar = main and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
        self.lines = main and mode == "auto" and not self.bar
        self.trainer = trainer
        self.started = time.perf_counter()
        self.tokens_at_start = trainer.state.tokens_seen

    def update(self, outcome: StepOutcome) -> None:
        state = self.trainer.state
        if not (self.bar or self.lines and state.step % self.LINE_EVERY == 0):
            return
        a = self.trainer.args
        elapsed = max(1e-9, time.perf_counter() - self.started)
        rate = (state.tokens_seen - self.tokens_at_start) / elapsed
        target = a.total_tokens if a.steps is None else None
        eta = f" eta {(target - state.tokens_seen) / rate:6.0f}s" if target and rate > 0 else ""
        text = (
            f"step {state.step:6d} loss {outcome.loss:7.4f} "
            f"tier {outcome.tier.per_device_batch}x{outcome.tier.accum} "
            f"{rate:9.0f} tok/s{eta}"
        )
        sys.stderr.write(f"\r{text}   " if self.bar else text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar:
            sys.stderr.write("\n")
