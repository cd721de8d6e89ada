"""Rampwatch in a Lightning 2.x `Trainer`: `RampwatchCallback` owns the `Monitor` of one fit (its
telemetry after each backward and before each optimizer step) and applies approved or auto ramps
at the step boundaries where Lightning's accumulation counters allow it.

    trainer = L.Trainer(accumulate_grad_batches=4, gradient_clip_val=1.0,
                        reload_dataloaders_every_n_epochs=1,  # only for per-device batch ramps
                        callbacks=[RampwatchCallback("runs.duckdb", name="my-run", seq_len=1024)])
    trainer.fit(model, datamodule=dm)  # dm.train_dataloader() reads dm.batch_size

What it relies on in Lightning (2.6.6, files under lightning/pytorch/):
- loops/optimization/automatic.py:329 (`_training_step`) divides the training_step loss by
  `trainer.accumulate_grad_batches` before backward (`ClosureResult.from_training_step_output`,
  automatic.py:80-83): the monitor's assumption, loss / accum, holds. Lightning also steps on an
  epoch's last batch with fewer micro-batches (training_epoch_loop.py:447-454), so each backward
  passes its weight 1/k explicitly and a short cycle is still measured right.
- plugins/precision/precision.py:47-51 `on_before_backward` sees the loss backward will see (times
  the loss scale under 16-mixed: amp.py:61-64); precision.py:77-81 `on_after_backward` follows each
  backward; precision.py:84-94 `on_before_optimizer_step` runs before `_clip_gradients`. Under
  16-mixed, amp.py:79-90 unscales .grad before that hook, but the after-backward norms were taken
  scaled, and scaler.update() comes only after the step (amp.py:95-96): this step's
  `trainer.scaler.get_scale()` undoes them.
- Accumulation: automatic.py:220 zeroes .grad before a batch only when `batch_idx % k == 0`;
  training_epoch_loop.py:438-440 steps when `batch_progress.current.ready % k == 0`, where
  batch_idx = current.ready - 1 (training_epoch_loop.py:106-110, 314-324); both restart each epoch
  (reset_on_run, training_epoch_loop.py:232). After a step at ready = r, a new k is safe iff
  r % k == 0: the next batch (batch_idx r) zeroes .grad and the step comes after exactly k batches.
  Otherwise (k -> 2k at r = k) the next batch does not zero .grad: the gradient just applied stays
  in it and is applied again by the next step, after only k new batches. An epoch end is always
  safe (the next batch is batch_idx 0); GradientAccumulationScheduler switches there
  (callbacks/gradient_accumulation_scheduler.py:139-140).
- training_epoch_loop.py:360-375: the "step" LR schedulers advance after the optimizer step and
  before `on_train_batch_end`, the boundary hook (as the own loop's sched.step() before ramp_due).
- A new per-device batch needs a new DataLoader: fit_loop.py:435-440 calls setup_data() at each
  epoch start, before on_train_epoch_start, and it asks train_dataloader() again only when
  `reload_dataloaders_every_n_epochs` says so (fit_loop.py:167-170, 226-228). So such a ramp waits
  for the epoch end (`on_train_epoch_end`) of a Trainer with reload_dataloaders_every_n_epochs=1
  whose loader reads a `batch_size` attribute (set with lightning_setattr, as the tuner's batch-size
  finder does: tuner/batch_size_scaling.py:385); otherwise it is refused with that reason.
- The train DataLoader exists only from fit_loop.run()'s setup_data (fit_loop.py:209), after
  on_fit_start (trainer.py:1057): the monitor starts in on_train_start, before any batch, so it can
  read the per-device batch from the loader.
- Budget: the Trainer's max_steps counts steps of the fit's first tier, so the run's token budget
  is max_steps × that tier's tokens per step (`Monitor.start(total_tokens=…)`; the callback's
  state keeps the tier's tokens per step, BUDGET_STEP_TOKENS). After a ramp, and on a resume,
  `fit_loop.epoch_loop.max_steps` (what trainer.max_steps and the loops' `done` read,
  fit_loop.py:129-131, training_epoch_loop.py:121) becomes the step + the steps the tokens left
  take at the tier now (token_clock.steps_to_budget). The "step" LR schedulers (not
  ReduceLROnPlateau) are wrapped in a TokenClock in on_fit_start, after strategy.setup made
  them (trainer.py:1053-1058) and before restore_training_state loads their state
  (trainer.py:1070, checkpoint_connector.py:396-404), so each is stepped by the monitor's tokens
  seen: its warmup and decay stay where the unramped fit has them, in tokens. Only frequency 1:
  Lightning counts a frequency in batches of the epoch (training_epoch_loop.py:482-486), which
  a ramp changes anyway, so such a scheduler keeps Lightning's own stepping.

A checkpoint carries the callback's tier, run id, ramp policy and the monitor's state_dict()
(Callback.state_dict, kept in Lightning's own checkpoint file): resuming one restores
accumulate_grad_batches and the batch attribute, which Lightning does not (they are constructor
arguments), continues the same database run from the restored global_step, and continues the
monitor (noise-scale window, tokens seen, base LR, last ramp, measured and infeasible batches).
A database without that run gets a new one and a fresh monitor; under DDP only rank 0 can look,
and every rank follows what it found (a rank that alone continued the tokens would step its LR
clock and max_steps apart from the others).

Under DDP every rank runs the callback; Monitor.start opens the database on rank 0 only, and the
monitor gets `trainer.model` (the DistributedDataParallel wrapper) to attach its per-rank norm
hook: strategy.setup wraps it (trainer.py:1053, strategies/ddp.py:172) before on_train_start and
any backward, and Lightning's no_sync on the accumulating batches (loops/optimization/
automatic.py:184) leaves .grad each rank's own until the last one, as the hook expects. DDP allows
one comm hook: a DDPStrategy(ddp_comm_hook=...) of your own is refused at start. Every rank asks
ramp_due() at every boundary and gets rank 0's decision at the same one, and Lightning's counters
agree on every rank, so all ranks apply a ramp after the same step. The train loader's
DistributedSampler (always shuffled for training, data_connector.py:491, seeded by PL_GLOBAL_SEED)
splits by sample index, not by batch, and a per-device batch ramp's new loader gets a fresh one
whose epoch is set at the epoch start (fit_loop.py:445): the ranks keep sharing each epoch out.
tests/test_integration_lightning_dist.py runs it on two gloo ranks.
Manual optimization: telemetry only (each optimizer.step() is a step; ramps are
refused: the module owns its accumulation). A short last batch of an epoch (drop_last=False) is
counted as a full per-device batch.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any, Mapping

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.utilities.parsing import (
        lightning_getattr,
        lightning_hasattr,
        lightning_setattr,
    )
except ImportError:  # the standalone package of the same 2.x API
    try:
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import GradientAccumulationScheduler
        from pytorch_lightning.utilities.parsing import (
            lightning_getattr,
            lightning_hasattr,
            lightning_setattr,
        )
    except ImportError as e:
        raise ImportError(
            "rampwatch.integrations.lightning needs Lightning 2.x: "
            "pip install 'rampwatch[lightning]'"
        ) from e

from rampwatch.advisor.checks import positive_int
from rampwatch.advisor.policy import CONFIG_KEY as POLICY_KEY
from rampwatch.advisor.policy import RampPolicy
from rampwatch.monitor import Monitor
from rampwatch.monitor.monitor import check_monitor_keywords
from rampwatch.monitor.ramp_protocol import Ramp, check_mode_name, scale_lr
from rampwatch.monitor.token_clock import TokenClock, steps_to_budget
from rampwatch.store import RunNotFoundError
from rampwatch.store import names as M

MONITOR_STATE = "monitor_state"  # where the callback's state_dict keeps Monitor.state_dict()
BUDGET_STEP_TOKENS = "budget_step_tokens"  # its state: tokens of one step of the first tier
# why the card offers no "Test ×2 first" here: a trial replays the same examples from a snapshot
TRIALS_NOTE = (
    "Lightning owns the data loader and the optimizer step: a trial cannot replay the same "
    "examples from a snapshot"
)
_NO_GROUPS = SimpleNamespace(param_groups=[])  # scale_lr on a scheduler alone (groups done once)


class RampwatchCallback(pl.Callback):
    """Per-step telemetry of a Lightning fit into the Rampwatch database at `db`, and its ramps.

    ramp: "manual" (commands approved on the dashboard), "auto" (the policy ramps by itself) or
    "off". per_device_batch: None reads the train DataLoader's batch_size (else the `batch_attr`
    attribute of the module, its hparams or the datamodule). checkpoint_before_ramp: save
    <default_root_dir>/rampwatch/before-ramp-step<N>.ckpt before switching. What the
    module's validation logs (self.log) is logged after each validation, at its step; the
    `val_loss` name's value is drawn on the loss chart. Other keyword arguments go to
    Monitor.start (lr_rule, capacity_bytes, flops_per_token, echo, ...)."""

    def __init__(
        self,
        db,
        *,
        name: str = "lightning",
        seq_len: int = 1,
        ramp: str = "manual",
        per_device_batch: int | None = None,
        config: Mapping[str, Any] | None = None,
        policy: RampPolicy | None = None,
        checkpoint_before_ramp: bool = False,
        batch_attr: str = "batch_size",
        val_loss: str = M.VAL_LOSS,
        **monitor_kwargs,
    ):
        check_mode_name(ramp)
        seq_len = positive_int("seq_len", seq_len)  # here, not at fit's first step
        check_monitor_keywords(monitor_kwargs, "RampwatchCallback()")
        self.db, self.name, self.seq_len, self.ramp = db, name, seq_len, ramp
        self.per_device_batch, self.config, self.policy = per_device_batch, config, policy
        self.checkpoint_before_ramp, self.batch_attr = checkpoint_before_ramp, batch_attr
        self.val_loss = val_loss
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self.history: list[Ramp] = []  # ramps applied, each at the step it took effect after
        self._held: Ramp | None = None  # due, accepted, waiting for its safe boundary
        self._loss: torch.Tensor | None = None  # this step's backward losses, summed on device
        self._backwards = 0
        self._boundary = 0  # global_step of the last boundary handled
        self._restored: dict = {}  # a checkpoint's tier and run, or the last fit's
        self._clocks: list[TokenClock] = []  # the "step" schedulers, stepped by tokens
        self._step_tokens: int | None = None  # tokens of one step of the first tier
        self._budget: int | None = None  # the run's tokens: max_steps × _step_tokens
        self._trainer = None
        self._untimed = None
        self._before_validation: dict = {}  # trainer.callback_metrics as validation started

    # -- start, resume, end ---------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer  # load_state_dict (checkpoint restore) comes after setup

    def state_dict(self) -> dict[str, Any]:
        mon = self.monitor  # after the fit (trainer.save_checkpoint at the end): its last state
        if mon is None:
            return dict(self._restored)
        return {
            "run_id": mon.run_id,
            "per_device_batch": mon.per_device_batch,
            "accum": mon.accum,
            BUDGET_STEP_TOKENS: self._step_tokens,
            POLICY_KEY: mon.policy.to_config(),
            MONITOR_STATE: mon.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint resumes the tier it was saved with: Lightning restores neither
        accumulate_grad_batches nor the batch-size attribute (they are Trainer/module args)."""
        self._restored = dict(state_dict)
        trainer = self._trainer
        if trainer is None or "accum" not in state_dict:
            return
        trainer.accumulate_grad_batches = int(state_dict["accum"])
        module = trainer.lightning_module
        if lightning_hasattr(module, self.batch_attr):  # read by the loader made after restore
            lightning_setattr(module, self.batch_attr, int(state_dict["per_device_batch"]))

    def on_fit_start(self, trainer, pl_module) -> None:
        """The "step" schedulers, stepped by tokens from here on (the docstring's "Budget")."""
        self._clocks = []
        if not pl_module.automatic_optimization:  # the module steps its own schedulers
            return
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
                continue
            if not isinstance(config.scheduler, TokenClock):
                config.scheduler = TokenClock(config.scheduler, None, seen=self._tokens_seen)
            self._clocks.append(config.scheduler)

    def _tokens_seen(self) -> int:
        return self.monitor.tokens_seen

    def on_train_start(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            return
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                "RampwatchCallback: DDP takes one communication hook and the "
                "monitor's per-rank norm hook needs it; drop ddp_comm_hook"
            )
        batch = self.per_device_batch or _loader_batch(trainer)
        if batch is None and lightning_hasattr(pl_module, self.batch_attr):
            batch = lightning_getattr(pl_module, self.batch_attr)
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(
                "RampwatchCallback: cannot read the per-device batch from the train "
                "DataLoader; pass per_device_batch="
            )
        self._plan_budget(trainer, batch)
        config = {
            "integration": "lightning",
            "lightning": pl.__version__,
            "precision": str(trainer.precision),
            **dict(self.config or {}),
        }
        start = dict(
            self.monitor_kwargs,
            name=self.name,
            config=config,
            model=trainer.model,
            optimizer=trainer.optimizers[0],
            per_device_batch=batch,
            accum=trainer.accumulate_grad_batches,
            seq_len=self.seq_len,
            ramp=self.ramp,
            policy=self.policy,
            trials=False,  # over monitor_kwargs: no trial_due() is ever asked here
            trials_note=TRIALS_NOTE,
            total_tokens=self._budget,
        )
        run_id, resumed = self._restored.get("run_id"), False
        if run_id and trainer.global_step > 0:  # resumed from a checkpoint: continue its run
            if self.policy is None and POLICY_KEY in self._restored:  # its original batch and LR
                start["policy"] = RampPolicy.from_config(self._restored)
            try:
                self.monitor = Monitor.start(
                    self.db, run_id=run_id, resume_step=trainer.global_step, **start
                )
                resumed = True
            except RunNotFoundError:  # another database: a new run
                pass
        if self.monitor is None:
            self.monitor = Monitor.start(self.db, **start)
        if trainer.world_size > 1:  # only rank 0 opened the database: every rank does as it did
            resumed = trainer.strategy.broadcast(resumed, src=0)  # (after each rank's one start)
        if resumed and MONITOR_STATE in self._restored:  # the run's window, tokens, base LR, ...
            self.monitor.load_state_dict(self._restored[MONITOR_STATE])
            self._keep_budget(trainer)  # at a ramped tier: the steps its tokens left take
        self._boundary = trainer.global_step

    def _plan_budget(self, trainer, batch: int) -> None:
        """The first tier's tokens per step (a resumed fit's, from its checkpoint) and the token
        budget trainer.max_steps of them make; the clocks' step sizes."""
        restored = self._restored if trainer.global_step > 0 else {}
        step_tokens = restored.get(BUDGET_STEP_TOKENS)
        if step_tokens is None and POLICY_KEY in restored:  # a checkpoint from before the budget
            step_tokens = RampPolicy.from_config(restored).original_batch * self.seq_len
        if step_tokens is None:
            tier = batch * trainer.accumulate_grad_batches * trainer.world_size
            step_tokens = tier * self.seq_len
        self._step_tokens = int(step_tokens)
        steps = trainer.max_steps
        self._budget = steps * self._step_tokens if steps is not None and steps > 0 else None
        for clock in self._clocks:
            clock.tokens_per_step = self._step_tokens

    def _keep_budget(self, trainer) -> None:
        """max_steps: this step + the steps the budget's tokens left take at the tier now."""
        mon = self.monitor
        if self._budget is None or mon is None:
            return
        left = steps_to_budget(self._budget, mon.tokens_seen, mon.tier.batch * mon.seq_len)
        trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + left

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish("finished")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning's SIGTERMException is a SystemExit
        killed = isinstance(exception, (KeyboardInterrupt, SystemExit))
        self._finish("killed" if killed else "failed", f"{type(exception).__name__}: {exception}")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._finish("finished")  # a fit that ended without on_train_end (nothing if it did)

    def _finish(self, status: str, message: str | None = None) -> None:
        self._end_untimed()
        if self.monitor is not None:
            self._restored = self.state_dict()
        mon, self.monitor, self._held = self.monitor, None, None
        if mon is not None:  # a held command is refused by the monitor: "the run stopped ..."
            mon.finish(status, message)

    # -- telemetry ------------------------------------------------------------------------------
    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if self.monitor is not None:
            d = loss.detach()
            self._loss = d if self._loss is None else self._loss + d
            self._backwards += 1

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            auto = pl_module.automatic_optimization
            self.monitor.after_backward(1.0 / trainer.accumulate_grad_batches if auto else None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        mon = self.monitor
        if mon is None:
            return
        k = trainer.accumulate_grad_batches  # 1 under manual optimization
        if k != mon.accum and pl_module.automatic_optimization:
            mon.set_tier(mon.per_device_batch, k)  # changed by another callback (the scheduler)
        scale = _grad_scale(trainer)
        loss, n = self._loss, self._backwards
        self._loss, self._backwards = None, 0
        if loss is None:
            loss = float("nan")
        elif n != k or scale != 1.0:  # each term was loss_j / k (× scale): the mean of n losses
            loss = loss * (k / (n * scale))
        mon.step(trainer.global_step + 1, loss=loss, grad_scale=scale)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        mon = self.monitor
        if mon is None:
            return
        if self._backwards:  # backwards Lightning never stepped (on_train_batch_start -> -1)
            mon.discard_step()
            self._loss, self._backwards = None, 0
        # the loader this epoch runs on (reloaded or not), unless the batch was given explicitly
        batch = _loader_batch(trainer) if self.per_device_batch is None else None
        if batch is not None and batch != mon.per_device_batch:
            mon.event(
                trainer.global_step,
                M.EVENT_ALERT,
                f"the train DataLoader's batch size is {batch}, not "
                f"{mon.per_device_batch}: the telemetry follows the loader",
                {"per_device_batch": batch},
            )
            mon.set_tier(batch, trainer.accumulate_grad_batches)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.monitor is None:  # the sanity check runs before the monitor starts
            return
        self._before_validation = dict(trainer.callback_metrics)
        if self._untimed is None:  # left out of step time
            self._untimed = self.monitor.untimed()
            self._untimed.__enter__()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._end_untimed()
        if self.monitor is not None:  # what this validation logged: its values are new objects
            before, now = self._before_validation, trainer.callback_metrics
            logged = {k: v for k, v in now.items() if before.get(k) is not v}
            self.monitor.log_validation(trainer.global_step, logged, loss_key=self.val_loss)

    def _end_untimed(self) -> None:
        if self._untimed is not None:
            self._untimed.__exit__(None, None, None)
            self._untimed = None

    # -- ramps at step boundaries -----------------------------------------------------------------
    def ramp_due(self, step: int) -> Ramp | None:
        """What the monitor has due at the boundary after `step` (a subclass may wait here)."""
        return self.monitor.ramp_due(step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mon, step = self.monitor, trainer.global_step
        if mon is None or step == self._boundary:
            return  # no optimizer step in this batch: mid-cycle
        self._boundary = step
        if self._held is None:  # one ramp at a time (under DDP every rank holds the same one)
            ramp = self.ramp_due(step)
            reason = None if ramp is None else self._cannot(trainer, pl_module, ramp)
            if reason is not None:
                mon.ramp_refused(ramp, reason)
            elif ramp is not None:
                self._held = ramp
        held = self._held
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # Lightning's counter
        if (
            held is not None
            and held.per_device_batch == mon.per_device_batch
            and ready % held.accum == 0
            and not _stopping(trainer)
        ):
            self._apply(trainer, pl_module, step)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # the epoch's last batch stepped; the next batch is batch_idx 0 of a (reloaded) loader
        if self._held is not None and self.monitor is not None and not _stopping(trainer, True):
            self._apply(trainer, pl_module, trainer.global_step)

    def _cannot(self, trainer, pl_module, ramp: Ramp) -> str | None:
        """Why this Trainer cannot run the ramp's tier; None if it can (now or at an epoch end)."""
        if not pl_module.automatic_optimization:
            return "manual optimization: the LightningModule owns its steps and accumulation"
        if trainer.strategy.handles_gradient_accumulation:
            return (
                f"{type(trainer.strategy).__name__} fixes gradient accumulation at setup; "
                "Lightning cannot change it during the fit"
            )
        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            return (
                "GradientAccumulationScheduler sets accumulate_grad_batches at every epoch "
                "start and would undo the ramp"
            )
        b, new_b, attr = self.monitor.per_device_batch, ramp.per_device_batch, self.batch_attr
        if new_b == b:
            return None
        why = f"per-device batch {b} -> {new_b} needs a new DataLoader, and "
        if trainer.reload_dataloaders_every_n_epochs != 1:
            return why + (
                "this Trainer does not rebuild it: use Trainer(reload_dataloaders_"
                f"every_n_epochs=1) and a train_dataloader() that reads `{attr}`; "
                "ramps by accumulation alone need neither"
            )
        if not lightning_hasattr(pl_module, attr):
            return why + (
                f"neither the LightningModule, its hparams nor the datamodule has a "
                f"`{attr}` attribute for train_dataloader() to read"
            )
        if lightning_getattr(pl_module, attr) != _loader_batch(trainer):
            return why + (
                f"the train DataLoader's batch size is not the `{attr}` attribute, so "
                "setting it would change nothing"
            )
        return None

    def _apply(self, trainer, pl_module, step: int) -> None:
        ramp, self._held = self._held, None
        if ramp.step != step:  # held since an earlier boundary: record where it took effect
            ramp = dataclasses.replace(ramp, step=step)
        mon = self.monitor
        if self.checkpoint_before_ramp:  # every rank calls it; the strategy writes on rank 0
            path = os.path.join(
                trainer.default_root_dir, "rampwatch", f"before-ramp-step{step}.ckpt"
            )
            with mon.untimed():
                trainer.save_checkpoint(path)
        if ramp.per_device_batch != mon.per_device_batch:  # the next epoch's loader reads it
            lightning_setattr(pl_module, self.batch_attr, ramp.per_device_batch)
        trainer.accumulate_grad_batches = ramp.accum
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        for opt in trainer.optimizers:
            own = [s for s in schedulers if getattr(s, "optimizer", None) is opt]
            ramp.scale_lr(opt, own[0] if own else None)
            for s in own[1:]:  # a second scheduler of the same optimizer: its own base LRs only
                scale_lr(_NO_GROUPS, ramp.lr_multiplier, s)
        mon.ramp_applied(ramp)
        self._keep_budget(trainer)
        self.history.append(ramp)


def _loader_batch(trainer) -> int | None:
    """The batch size of the fit's one train DataLoader (None: several, or a batch sampler)."""
    loader = trainer.train_dataloader  # CombinedLoader.iterables: the DataLoader itself if one
    return loader.batch_size if isinstance(loader, torch.utils.data.DataLoader) else None


def _grad_scale(trainer) -> float:
    """16-mixed's GradScaler scale of this step (None for 32-true and bf16: no scaling)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


def _stopping(trainer, epoch_end: bool = False) -> bool:
    """The fit stops at this boundary: a ramp applied now would never run, so it stays held and
    Monitor.finish refuses it. (fit_loop.done says the same but logs each time it is asked.)"""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    if epoch_end and trainer.max_epochs not in (None, -1):
        return trainer.current_epoch + 1 >= trainer.max_epochs
    return bool(trainer.should_stop)
