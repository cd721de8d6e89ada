"""Rampwatch in the Hugging Face Trainer: `RampwatchTrainer` (telemetry and the noise scale with
the micro-batches' real weights; ramps by save-and-restart), `resume_args` (the arguments that
continue a run at its new tier) and `RampRestart` (exit status EXIT_RAMP = 75).

    args = TrainingArguments(**resume_args("out", per_device_train_batch_size=8,
                                           gradient_accumulation_steps=4), max_steps=2000)
    trainer = RampwatchTrainer(model=model, args=args, train_dataset=ds, db="runs.duckdb")
    trainer.train()   # an applied ramp saves checkpoint-N and exits 75: run the same command again

Under `torchrun --nproc_per_node N` (DDP through accelerate) every rank runs the same script; only
rank 0 writes the database and rampwatch.json, and every rank exits 75 at the same step.

Source read: transformers 5.24.0 trainer.py (numbers: its lines), loss/loss_utils.py and
accelerate 1.15.0 data_loader.py.
- A Trainer subclass, not a callback: `_run_epoch` (1897-1969) runs the last micro-batch's
  backward, then `_clip_grad_norm`, `on_pre_optimizer_step`, `optimizer.step()`, `on_step_end`,
  so a callback never sees that backward's unclipped .grad, nor `inputs` / `num_items_in_batch`
  (the weights). `training_step`, the documented override point, sees all three; `_run_epoch`
  sets `accelerator.sync_gradients` on the step's last micro-batch (1897-1899) before it, so
  `Monitor.step` runs there, before clipping, and the user's max_grad_norm stays as it is.
- Weights: N = `num_items_in_batch` (2343: labels != -100 over the step's micro-batches) goes to
  the model (2170), whose loss (loss_utils.py:41-47) is Σ CE / N; `training_step` then does not
  divide by k (2115-2119) and `compute_loss` multiplies by num_processes (2215; 1 here). So
  micro-batch j's mean loss is scaled by m_j / N, m_j the label positions its loss sums: counted
  as the loss counts (shifted for ForCausalLMLoss), since N is counted unshifted when
  model.loss_type is None (543; GPT2LMHeadModel), where Σ m_j / N < 1. Without N: 1 /
  current_gradient_accumulation_steps (1885, 2119; an epoch's last step may be short).
- Ramps: the Trainer fixes its dataloader and accumulation per train(). At the boundary after
  step s where a ramp is due, `on_step_end` moves the LR (`Ramp.scale_lr`: optimizer and
  scheduler, so `_save_checkpoint` writes the new base LRs) and sets should_save and
  should_training_stop; `on_save` adds rampwatch.json to checkpoint-s, the ramp is recorded
  applied at step s, and train() raises RampRestart. Data: a resume skips (s % U)·k' batches of
  the NEW loader (1709, 1852; U its steps per epoch, 2523), s·b'·k' samples where s·b·k were
  used. So the resumed run reads its own loader: the same seeded order (SeedableRandomSampler,
  data_loader.py:73-107, or a SequentialSampler: independent of the batch) from the first unused
  sample, in batches of b', behind exactly the batches that skip drops (SkipBatchSampler,
  data_loader.py:1332-1352). From a ramp on the epochs are one stream (a batch may span an
  epoch's end); no sample is skipped or repeated.
- Budget: the command's `max_steps` counts steps of the run's first tier, so the run's token
  budget is max_steps × that tier's tokens per step (`Monitor.start(total_tokens=…)`; the tier's
  tokens per step ride in rampwatch.json as BUDGET_STEP_TOKENS). A restart at a new tier ends
  where the budget does: `set_initial_training_values` (2495-2564, whose max_steps
  `_init_training_state` gives the TrainerState, 1711, and `create_scheduler` its length, 1778)
  returns the checkpoint's step + the steps the tokens left take at the new tier
  (token_clock.steps_to_budget). The schedule stays the unramped one in tokens: `create_scheduler`
  plans it over the command's max_steps and wraps it in a TokenClock driven by the monitor's
  tokens seen, which `_run_epoch` steps after the optimizer (1951-1952), saves and loads with
  the checkpoint (3584, 3996).
- Several ranks (torchrun; DDP, which accelerate wraps the model in before on_train_begin: 1781,
  1653). The monitor gets `model_wrapped`, the DDP module, and registers its per-rank norm hook
  on it before the first backward (monitor/gradstats.py); every rank calls Monitor.start and
  step(), only rank 0 opens the database (monitor/monitor.py). Weights: with
  average_tokens_across_devices (the default) N is the count over every rank (2348-2350,
  accelerator.gather) and compute_loss multiplies the loss by num_processes // tp (2207-2215),
  so rank r's micro-batch j is scaled by W·m_rj / N and DDP's mean over ranks is the global token
  mean; each rank passes its own W·m_rj / N, its points are its own token-weighted means
  (gradstats normalizes each rank's points before it averages them). Data: the prepared loader's
  BatchSamplerShard deals the batches of one order, rank r every W-th (data_loader.py:213-270),
  so one micro-step reads W·b consecutive samples; samples_seen counts them all, and before a
  ramp stops at the epoch's end, where the shard tops the last batches up with the epoch's first
  samples. The resumed stream is the same order from samples_seen in batches of b', with W times
  the loader's batches and skipped batches, which the shard deals out again: each rank continues
  from its first unused sample and the ranks' union skips and repeats none. Ramps: the monitor's
  RampChannel gives every rank the same ramp at the same boundary; each rank moves its LR, the
  Trainer saves (model and optimizer on rank 0, every rank its RNG state, which makes the folder:
  3512-3514), rank 0 writes rampwatch.json, and every rank waits for the others
  (wait_for_everyone) before it exits 75, since torchrun ends the other ranks once one exits. The
  torchrun command then exits 1 (its agent's failure, naming exit code 75); run it again. Budget
  and tiers count W: a step is b·k·W sequences.
"""

from __future__ import annotations

import json
import os
import sys

import torch

try:
    from transformers import Trainer, TrainerCallback, TrainerState, optimization
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length
except ImportError as e:
    raise ImportError(
        "rampwatch.integrations.transformers needs transformers and accelerate: "
        "pip install 'rampwatch[transformers]'"
    ) from e

from rampwatch.advisor.checks import positive_int
from rampwatch.advisor.policy import CONFIG_KEY, RampPolicy
from rampwatch.integrations.hf_restart import (
    EXIT_RAMP,
    STATE_FILE,
    RampRestart,
    StreamBatchSampler,
    index_sampler,
    read_state,
    resume_args,
)
from rampwatch.monitor import Monitor
from rampwatch.monitor.monitor import check_monitor_keywords
from rampwatch.monitor.ramp_protocol import check_mode_name
from rampwatch.monitor.token_clock import TokenClock, steps_to_budget

__all__ = ["EXIT_RAMP", "STATE_FILE", "RampRestart", "RampwatchTrainer", "resume_args"]

# why the card offers no "Test ×2 first" here: a trial replays the same examples from a snapshot
TRIALS_NOTE = (
    "the Hugging Face Trainer owns the data loader and the optimizer step: a trial cannot "
    "replay the same examples from a snapshot"
)
_ORDERED_SAMPLERS = ("SeedableRandomSampler", "SequentialSampler")  # order independent of b
BUDGET_STEP_TOKENS = "budget_step_tokens"  # rampwatch.json: tokens of one step of max_steps
EVAL_LOSS = "eval_loss"  # evaluate()'s loss (its default metric_key_prefix, "eval")
# schedulers the Trainer steps by an eval metric, not per step (trainer.py 1951): no clock
_BY_METRIC = (torch.optim.lr_scheduler.ReduceLROnPlateau, getattr(optimization, "GreedyLR", ()))


class RampwatchTrainer(Trainer):
    """A Trainer that logs every optimizer step into a Rampwatch database and applies approved
    (or ramp="auto") ramps by save-and-restart. Extra keywords: db (the DuckDB file), name (the
    run's name), ramp ("manual", "auto", "off"), policy (RampPolicy), seq_len (default: the
    first sample's input_ids length), run_config (more JSON values for the run's config) and
    monitor_kwargs (to Monitor.start, e.g. flops_per_token). One device per process: torchrun
    for several (DDP), not DataParallel."""

    def __init__(
        self,
        *args,
        db,
        name: str | None = None,
        ramp: str = "manual",
        policy: RampPolicy | None = None,
        seq_len: int | None = None,
        run_config: dict | None = None,
        monitor_kwargs: dict | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        check_mode_name(ramp)
        if seq_len is not None:  # None: the first sample's length
            seq_len = positive_int("seq_len", seq_len)
        self._db, self._name, self._ramp_mode, self._policy = db, name, ramp, policy
        self._seq_len, self._run_config = seq_len, dict(run_config or {})
        self._monitor_kwargs = dict(monitor_kwargs or {})
        check_monitor_keywords(self._monitor_kwargs, "RampwatchTrainer(monitor_kwargs=...)")
        self._mon: Monitor | None = None
        self._resume: dict | None = None  # the checkpoint's rampwatch.json, set by train()
        self._shifts: bool | None = None  # does the model's loss shift its labels
        self.add_callback(_Hooks(self))

    @property
    def monitor(self) -> Monitor | None:
        """The run's Monitor while train() runs (e.g. monitor.add_memory_plan(rows))."""
        return self._mon

    # -- train(): resume checks, the monitor's status, the restart ------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        ckpt = resume_from_checkpoint or self.args.resume_from_checkpoint  # resume_args's
        if ckpt is True:
            ckpt = get_last_checkpoint(self.args.output_dir) or True  # True: HF says none
        if self.args.n_gpu > 1:  # torch DataParallel: one process splits each batch itself
            raise ValueError(
                f"RampwatchTrainer runs one device per process, not {self.args.n_gpu} GPUs in "
                "one (DataParallel): launch with torchrun --nproc_per_node N instead"
            )
        self._resume = read_state(ckpt) if isinstance(ckpt, str) else None
        self._ckpt_step = (
            TrainerState.load_from_json(os.path.join(ckpt, TRAINER_STATE_NAME)).global_step
            if isinstance(ckpt, str)
            else None
        )
        st, b, a = self._resume, self._train_batch_size, self.args.gradient_accumulation_steps
        if st is not None and st.get("world_size", 1) != self.args.world_size:
            raise ValueError(
                f"{ckpt} was saved by {st.get('world_size', 1)} process(es), not "
                f"{self.args.world_size}: its sample stream and budget are per world size; "
                "continue it with the same torchrun --nproc_per_node"
            )
        if st is not None and (st["per_device_batch"], st["accum"]) != (b, a):
            raise ValueError(
                f"{ckpt} continues at per-device batch {st['per_device_batch']} x accumulation "
                f"{st['accum']}, not {b} x {a}: build the TrainingArguments with "
                "rampwatch.integrations.transformers.resume_args(output_dir, ...)"
            )
        self._pending = self._restart = self._untimed = None
        self._samples_seen, self._step_loss, self._stream = 0, None, bool(st and st["stream"])
        self._order_name = None
        try:
            out = super().train(
                resume_from_checkpoint=ckpt, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
            )
        except KeyboardInterrupt:
            self._close("killed", "interrupted")
            raise
        except BaseException as e:
            self._close("failed", f"{type(e).__name__}: {e}")
            raise
        if self._restart is not None:
            ramp, path = self._restart
            msg = (
                f"rampwatch: stopped after step {ramp.step} to ramp to per-device batch "
                f"{ramp.per_device_batch} x accumulation {ramp.accum} (base LR "
                f"{ramp.base_lr:.4g}); saved {path}. Run the same command again: "
                "resume_args() continues this run at the new tier"
            )
            self._close("finished", msg)
            if self.args.process_index == 0:
                print(msg, file=sys.stderr, flush=True)
            # torchrun ends every rank once one exits: rank 0 must have written rampwatch.json
            # and closed its run before any rank leaves
            self.accelerator.wait_for_everyone()
            raise RampRestart(msg, path, ramp.tier)
        self._close("finished")
        return out

    def _timed(self) -> None:
        if self._untimed is not None:  # from on_step_end (saving, evaluating, logging)
            self._untimed.__exit__(None, None, None)
            self._untimed = None

    def _close(self, status: str, message: str | None = None) -> None:
        self._timed()
        mon, self._mon = self._mon, None
        if mon is None:
            return
        if self._pending is not None:  # decided, never saved: the card must not wait on it
            mon.ramp_refused(
                self._pending,
                f"the run stopped ({status}) before the checkpoint for the new tier was saved",
            )
        mon.finish(status, message)

    # -- the data: a resumed ramp continues the sample stream exactly ---------------------------
    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        st, step = self._resume, self._ckpt_step
        if st is not None and st["stream"]:
            return self._stream_loader(loader, st)
        if step and has_length(loader):  # HF's own resume, exact at the same tier: where it is
            steps, skipped = self._skip(loader, step)
            self._samples_seen = (
                step // steps * len(loader.dataset)
                + skipped * self._train_batch_size * self.args.world_size
            )
        return loader

    def _skip(self, loader, step: int) -> tuple[int, int]:
        """(steps per epoch, batches the resume skips): set_initial_training_values and
        _init_training_state."""
        a = self.args.gradient_accumulation_steps
        steps = max(len(loader) // a + int(len(loader) % a > 0), 1)
        return steps, 0 if self.args.ignore_data_skip else (step % steps) * a

    def _stream_loader(self, loader, st: dict):
        order = index_sampler(loader)
        self._order_name = type(order).__name__
        if self._order_name not in _ORDERED_SAMPLERS:
            raise ValueError(
                f"cannot continue {STATE_FILE}'s sample stream with a "
                f"{self._order_name}: its order is not the run's"
            )
        self._samples_seen = st["samples_seen"]
        workers = loader.num_workers
        world = self.args.world_size  # accelerate's BatchSamplerShard deals rank r every W-th
        sampler = StreamBatchSampler(
            order,
            len(loader.dataset),
            self._train_batch_size,
            st["samples_seen"],
            len(loader) * world,
            self._skip(loader, st["step"])[1] * world,
        )
        stream = torch.utils.data.DataLoader(
            loader.dataset,
            batch_sampler=sampler,
            collate_fn=loader.collate_fn,
            num_workers=workers,
            pin_memory=loader.pin_memory,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers if workers else False,
            prefetch_factor=loader.prefetch_factor if workers else None,
        )
        return self.accelerator.prepare(stream)

    # -- the budget: max_steps and the LR schedule in tokens (the module docstring, "Budget") ----
    def _budget(self) -> tuple[int, int] | None:
        """(tokens of one step of the command's max_steps, the run's token budget), or None for
        a run whose length is in epochs."""
        if self.args.max_steps is None or self.args.max_steps <= 0:
            return None
        st = self._resume or {}
        step_tokens = st.get(BUDGET_STEP_TOKENS)
        if step_tokens is None and st:  # a checkpoint from before the budget: the first tier
            step_tokens = RampPolicy.from_config({CONFIG_KEY: st["policy"]}).original_batch
            step_tokens *= self._sequence_tokens()
        if step_tokens is None:
            batch = self._tier_batch(self._train_batch_size, self.args.gradient_accumulation_steps)
            step_tokens = batch * self._sequence_tokens()
        return step_tokens, self.args.max_steps * step_tokens

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        st, budget = self._resume, self._budget()
        if st is None or budget is None or "tokens_seen" not in st:
            return values
        tier_tokens = self._tier_batch(self._train_batch_size, args.gradient_accumulation_steps)
        left = steps_to_budget(budget[1], st["tokens_seen"], tier_tokens * self._sequence_tokens())
        return (*values[:-1], st["step"] + left)  # the last value is max_steps

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        budget = self._budget()
        if budget is None or self.is_deepspeed_enabled:
            return super().create_scheduler(num_training_steps, optimizer)
        sched = super().create_scheduler(self.args.max_steps, optimizer)  # planned in its steps
        if not isinstance(sched, (TokenClock, *_BY_METRIC)):
            self.lr_scheduler = TokenClock(sched, budget[0], seen=lambda: self._mon.tokens_seen)
        return self.lr_scheduler

    def _sequence_tokens(self) -> int:
        return self._seq_len or _seq_len(self)

    def _tier_batch(self, per_device_batch: int, accum: int) -> int:
        """Sequences per optimizer step, every rank together (advisor/tiers.py Tier.batch)."""
        return per_device_batch * accum * self.args.world_size

    # -- each micro-batch ---------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        mon = self._mon
        if mon is None:
            return super().training_step(model, inputs, num_items_in_batch)
        weight = self._weight(inputs, num_items_in_batch)  # before super() moves the inputs
        self._count_samples(_batch_len(inputs))
        loss = super().training_step(model, inputs, num_items_in_batch)
        mon.after_backward(weight)  # a device tensor: read with the step's norms, no sync here
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if self.accelerator.sync_gradients:  # the step's last backward; clipping comes next
            scaler = self.accelerator.scaler  # fp16: .grad holds the loss scale until the step
            mon.step(
                self.state.global_step + 1,
                loss=self._step_loss,
                grad_scale=scaler.get_scale() if scaler is not None else 1.0,
            )
            self._step_loss = None
        return loss

    def _count_samples(self, batch: int) -> None:
        """The stream position after this micro-batch, every rank's share included (even
        batches: accelerate gives every rank the same size). Before a ramp the Trainer's own
        loader restarts its order at each epoch, topping the last batch up with the epoch's
        first samples on W > 1 ranks (BatchSamplerShard, data_loader.py:213-270): those are
        no new position, so the count stops at the epoch's end."""
        seen, n = self._samples_seen, _dataset_len(self.train_dataset)
        seen += batch * self.args.world_size
        if not self._stream and n:
            seen = min(seen, (self._samples_seen // n + 1) * n)
        self._samples_seen = seen

    def _weight(self, inputs, num_items_in_batch):
        """What this micro-batch's mean loss is multiplied by (see the module docstring)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # training_step's own rule
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            return 1.0 / getattr(
                self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps
            )
        if num_items_in_batch is None:
            return 1.0  # a loss already scaled, with no count: each micro-batch's as it is
        count = self._counted(inputs)
        return None if count is None else count * self._loss_scale() / num_items_in_batch

    def _loss_scale(self) -> int:
        """compute_loss's factor on a loss divided by a count over every rank (trainer.py
        2207-2215): DDP then averages the ranks' gradients back to the global token mean."""
        a = self.args
        if not (
            a.average_tokens_across_devices
            and (self.model_accepts_loss_kwargs or self.compute_loss_func)
        ):
            return 1
        return self.accelerator.num_processes // self.get_tp_size() if a.n_gpu <= 1 else a.n_gpu

    def _counted(self, inputs):
        """Label positions this micro-batch's loss sums over, on their device."""
        if self.compute_loss_func is not None or self.label_smoother is not None:
            # their normalization is theirs: Trainer's own count, the rule N is made by (both
            # divided by the same tp·cp·sp size, which cancels in the ratio)
            return self._get_num_items_in_batch([inputs], self.args.device)
        labels = inputs.get("shift_labels")
        if labels is None:
            labels = inputs.get("labels")
            if labels is None:
                return None
            if self._loss_shifts():
                labels = labels[..., 1:]
        return labels.ne(-100).sum()

    def _loss_shifts(self) -> bool:
        if self._shifts is None:
            model = self.accelerator.unwrap_model(self.model)
            config = getattr(model, "config", None)
            loss = getattr(model, "loss_function", None) if hasattr(model, "loss_type") else None
            self._shifts = (
                loss is ForCausalLMLoss
                if loss is not None
                else bool(getattr(self, "_loss_shifts_labels", False))
            ) and not getattr(config, "is_encoder_decoder", False)
        return self._shifts

    # -- the monitor and the step boundary (called by _Hooks) ---------------------------------
    def _start_monitor(self, loader) -> None:
        st = self._resume or {}
        blocker = self._ramp_blocker(loader)
        mode = "off" if blocker else self._ramp_mode
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # AcceleratedOptimizer
        a = self.args
        config = {
            "framework": f"transformers {sys.modules['transformers'].__version__}",
            "lr": a.learning_rate,
            "max_steps": a.max_steps,
            "seed": a.seed,
            "lr_scheduler_type": _plain(a.lr_scheduler_type),
            "optim": _plain(a.optim),
            "max_grad_norm": a.max_grad_norm,
            "output_dir": a.output_dir,
            **({"ramp_note": blocker} if blocker else {}),
            **self._run_config,
        }
        policy = RampPolicy.from_config({CONFIG_KEY: st["policy"]}) if st else self._policy
        kw = {"echo": sys.stderr, **self._monitor_kwargs}  # events as lines on stderr
        kw.update(trials=False, trials_note=TRIALS_NOTE)  # no trial_due() is ever asked here
        budget = self._budget()
        self._mon = mon = Monitor.start(
            self._db,
            name=self._name or a.run_name or "hf-trainer",
            config=config,
            # under torchrun the DDP module (1781), on which the monitor registers its norm hook
            model=self.model_wrapped if a.world_size > 1 else self.model,
            optimizer=optimizer,
            per_device_batch=self._train_batch_size,
            accum=a.gradient_accumulation_steps,
            seq_len=self._sequence_tokens(),
            total_tokens=budget[1] if budget else None,
            run_id=st.get("run_id"),
            resume_step=st.get("step"),
            ramp=mode,
            policy=policy,
            **kw,
        )
        if st:
            mon.load_state_dict(st)  # its Monitor.state_dict() keys: see _saved

    def _ramp_blocker(self, loader) -> str | None:
        """Why this run cannot be ramped by save-and-restart (the card says it), or None."""
        a = self.args
        if a.max_steps is None or a.max_steps <= 0:
            return (
                "its length is set in epochs, and the LR schedule's length in steps would "
                "change with the batch; set max_steps to let Rampwatch ramp it"
            )
        if a.save_only_model:
            return "save_only_model=True: checkpoints lack the optimizer and scheduler"
        if a.auto_find_batch_size or a.dataloader_drop_last:
            return "auto_find_batch_size / dataloader_drop_last change the batches on resume"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "DeepSpeed and FSDP checkpoints are not handled by this integration"
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset) or not has_length(
            self.train_dataset
        ):
            return "an iterable dataset's position cannot be carried to another batch size"
        name = self._order_name or type(index_sampler(loader)).__name__
        if name not in _ORDERED_SAMPLERS:
            return (
                f"its {name} orders samples by the batch (or the global RNG), so the "
                "position cannot be carried to another batch size"
            )
        return None

    def _boundary(self, state, control) -> None:
        ramp = self._mon.ramp_due(state.global_step)
        if ramp is None:
            return
        if state.global_step >= state.max_steps or control.should_training_stop:
            self._mon.ramp_refused(
                ramp,
                f"the run ends at step {state.global_step} "
                "(max_steps or a callback): no step is left for the new "
                "tier",
            )
            return
        ramp.scale_lr(self.optimizer, self.lr_scheduler)  # saved with them, on the new base
        self._pending = ramp
        control.should_save = True
        control.should_training_stop = True

    def _saved(self, state) -> None:
        """on_save: checkpoint-N is complete; add our state (and, for a ramp, say applied)."""
        path = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        ramp, mon = self._pending, self._mon
        if not os.path.isdir(path):
            return  # a hyperparameter-search trial's folder: not ours to continue
        self._stream = self._stream or ramp is not None
        b, a = (
            (ramp.per_device_batch, ramp.accum)
            if ramp
            else (self._train_batch_size, self.args.gradient_accumulation_steps)
        )
        kept = mon.state_dict()  # at the top level, where files written before it hold it too
        if ramp is not None:  # applied once this file is in: the restart runs the new base LR
            kept["base_lr"] = ramp.base_lr
        state_doc = {
            **kept,
            "version": 1,
            "run_id": mon.run_id,
            "step": state.global_step,
            "per_device_batch": b,
            "accum": a,
            "world_size": self.args.world_size,
            "samples_seen": self._samples_seen,
            "stream": self._stream,
            BUDGET_STEP_TOKENS: (self._budget() or (None,))[0],
            "policy": mon.policy.to_config(),
            "ramp": None
            if ramp is None
            else {
                "before": [ramp.before.per_device_batch, ramp.before.accum],
                "source": ramp.source,
                "command_id": ramp.command_id,
            },
        }
        if self.args.process_index == 0:  # beside rank 0's model, optimizer and scheduler
            tmp = os.path.join(path, STATE_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(state_doc, f)
            os.replace(tmp, os.path.join(path, STATE_FILE))
        if ramp is not None:
            self._pending, self._restart = None, (ramp, path)
            mon.ramp_applied(ramp)  # the card: "applied at step N"; N + 1 runs the new tier


class _Hooks(TrainerCallback):
    """The Trainer's events RampwatchTrainer needs (_inner_training_loop and _run_epoch)."""

    def __init__(self, trainer: RampwatchTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.trainer._start_monitor(train_dataloader)  # optimizer, scheduler, resume: all in

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._timed()

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t._mon is None:
            return
        t._boundary(state, control)
        if control.should_save or control.should_evaluate or control.should_log:
            t._untimed = t._mon.untimed()  # saving, evaluating, logging: not step time
            t._untimed.__enter__()

    def on_save(self, args, state, control, **kwargs):
        if self.trainer._mon is not None:
            self.trainer._saved(state)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        mon = self.trainer._mon  # evaluate() outside train() has no run to log into
        if mon is not None and metrics:  # eval_loss draws on the loss chart as val_loss
            mon.log_validation(state.global_step, metrics, loss_key=EVAL_LOSS)


def _seq_len(trainer) -> int:
    try:
        return max(1, len(trainer.train_dataset[0]["input_ids"]))
    except Exception:  # no such key, not indexable: tokens are then counted per sequence
        return 1


def _dataset_len(dataset) -> int:
    return len(dataset) if has_length(dataset) else 0


def _plain(value):
    return getattr(value, "value", value)  # TrainingArguments' enums, as JSON strings


def _batch_len(inputs) -> int:
    return next(
        (int(v.shape[0]) for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0
    )
