"""The telemetry API any training loop calls: start a run, after each backward, at each step,
at each step boundary (the ramp protocol), finish.

    mon = Monitor.start("runs.duckdb", name="my-run", config=vars(args), model=model,
                        optimizer=opt, per_device_batch=16, accum=4, seq_len=1024)
    for step in range(1, steps + 1):
        for x, y in micro_batches:
            (model(x, y) / 4).backward()
            mon.after_backward()          # noise-scale partial sums, stays on the device
        mon.step(step, loss=loss_sum)     # before clipping: reads grad norm, memory, time
        clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()
        if ramp := mon.ramp_due():        # an approved (or auto) ramp, checked: monitor/ramp_protocol.py
            ...                           # new per-device batch / accumulation, ramp.scale_lr()
            mon.ramp_applied(ramp)
    mon.finish()

A loop that sets param_group['lr'] itself every step (nanoGPT's get_lr()) moves its own
schedule instead of calling ramp.scale_lr(): lr = get_lr(it) * mon.lr_scale
(examples/nanogpt_loop.py). Either way the protocol checks, at the next two steps, that the LR
logged moved by the ramp's multiplier, and says so in an alert where it did not.

Device values are read once per optimizer step (one transfer of k norms), never per micro-step.
Everything is written through store.RunWriter, whose log() only appends to a spool file. The
monitor never raises into the loop: an error inside it becomes one `alert` event and the
telemetry it could not take is left out. A loop that calls it wrongly (no after_backward(), step()
twice) still gets all it can, and one alert that names the mistake, on stderr too.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import inspect
import math
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Mapping, TextIO

import torch

from rampwatch.advisor import flops as flops_math
from rampwatch.advisor.checks import positive_int
from rampwatch.advisor.gns import line_estimates
from rampwatch.advisor.gns_window import DEFAULT_MAX_STEPS, NoiseScaleWindow
from rampwatch.advisor.lr import rule_for_type
from rampwatch.advisor.policy import CONFIG_KEY as POLICY_KEY
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.throughput import RECENT, recent_throughput
from rampwatch.advisor.tiers import Tier
from rampwatch.monitor.device import (
    CpuPeak,
    device_capacity_bytes,
    device_name,
    distributed,
    memory_metrics,
    unmeasured_sharding,
)
from rampwatch.monitor.fsdp_norms import fsdp2_modules
from rampwatch.monitor.gradstats import NO_GRAD, AccumulationStats, StepGradStats
from rampwatch.monitor.ramp_protocol import (
    Ramp,
    RampChannel,
    RampProtocol,
    RunningTier,
    check_mode,
)
from rampwatch.monitor.trial_protocol import TrialOutcome, TrialProtocol, TrialRequest
from rampwatch.store import RunWriter
from rampwatch.store import names as M
from rampwatch.store.steps import step_problem

# a gradient-norm spike: above SPIKE_FACTOR × the median of the last SPIKE_WINDOW finite norms,
# once at least SPIKE_MIN_STEPS are known (early training's norms move too fast to judge)
SPIKE_FACTOR, SPIKE_WINDOW, SPIKE_MIN_STEPS = 10.0, 100, 20


def _base_lr(optimizer) -> float:
    group = optimizer.param_groups[0]
    return float(group.get("initial_lr", group["lr"]))  # a scheduler's base, before warmup


def default_policy(optimizer, batch: int, lr_rule: str | None = None) -> RampPolicy:
    """The ramp policy of a loop that names none: ramps scale from this batch and the
    optimizer's LR by the optimizer's rule (advisor/lr.py)."""
    try:
        rule = rule_for_type(type(optimizer), lr_rule)
    except ValueError as e:
        raise ValueError(
            f"{e}. Name the rule a ramp moves the LR by: Monitor.start(..., "
            "lr_rule='sqrt' (Adam-type), 'linear' (SGD) or 'none')"
        ) from None
    lr = _base_lr(optimizer)
    # an LR of 0 (frozen weights, a schedule that owns the LR) has no scale: ramps then move a
    # unit LR, so their multipliers are still the rule's
    return RampPolicy(original_batch=batch, original_lr=lr if lr > 0 else 1.0, lr_rule=rule)


def _keywords(fn) -> frozenset[str]:
    params = inspect.signature(fn).parameters
    return frozenset(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY)


def check_monitor_keywords(kwargs: Mapping[str, Any], caller: str) -> None:
    """TypeError naming the first keyword that neither Monitor.start nor Monitor.__init__ (to
    which start passes its **kwargs) takes: said where it was typed, not at a later start."""
    known = _keywords(Monitor.start) | _keywords(Monitor.__init__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, 1)
        raise TypeError(
            f"{caller} got an unexpected keyword argument {unknown[0]!r}"
            + (f": did you mean {close[0]!r}?" if close else "")
            + " (help(Monitor.start) and help(Monitor.__init__) list the ones it takes)"
        )


def _budget(total_tokens) -> int | None:
    """The run's token budget as given to Monitor.start, checked (None: no budget)."""
    if total_tokens is None:
        return None
    whole = isinstance(total_tokens, (int, float)) and not isinstance(total_tokens, bool)
    if not (whole and math.isfinite(total_tokens) and total_tokens == int(total_tokens) > 0):
        raise ValueError(
            f"total_tokens must be a positive whole number of tokens (the run's budget), got "
            f"{total_tokens!r}: pass e.g. total_tokens=steps * batch * seq_len, or leave it out"
        )
    return int(total_tokens)


def _tier_row(tier, seq_len: int, tokens_seen: int) -> dict[str, float]:
    """A step's tier metrics: per-device batch, accumulation, its batch in sequences and
    tokens, and the tokens seen after it."""
    return {
        M.PER_DEVICE_BATCH: tier.per_device_batch,
        M.ACCUM: tier.accum,
        M.BATCH_SEQS: tier.batch,
        M.BATCH_TOKENS: tier.batch * seq_len,
        M.TOKENS_SEEN: tokens_seen,
    }


def _number(loss) -> float | None:
    """A trial arm's train loss as a float (a tensor is read here: the arms log no step())."""
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


class Monitor:
    """Per-step telemetry and the ramp protocol for one run. Under torch.distributed every rank
    calls it (step() all-reduces a few values, ramp_due() hears rank 0's decision); rank 0 has
    the writer, other ranks have writer=None."""

    def __init__(
        self,
        writer: RunWriter | None,
        *,
        model: torch.nn.Module,
        optimizer,
        per_device_batch: int,
        accum: int,
        seq_len: int,
        world_size: int | None = None,
        device: torch.device | None = None,
        flops_per_token: float | None = None,
        gns_window_steps: int | None = None,
        loss_divided_by_accum: bool = True,
        noise_window: NoiseScaleWindow | None = None,
        echo: TextIO | None = None,
        ramp: str = "manual",
        policy: RampPolicy | None = None,
        lr_rule: str | None = None,
        base_lr: float | None = None,
        control_group=None,
        capacity_bytes: int | None = None,
        trials: bool = False,
        trial_delta_tokens: int | None = None,
        trials_note: str | None = None,
        total_tokens: int | None = None,
        trial_delta_from_loss: bool = False,
    ):
        self.writer = writer
        self.echo = echo  # each event is also one line here (the trainer passes stderr)
        self.model = model  # what a trial snapshots (run_trial), with the optimizer
        self.optimizer = optimizer
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the module inside
        module = getattr(model, "module", model)  # DistributedDataParallel's wrapped model
        self.device = device or next(module.parameters()).device
        capacity = capacity_bytes or device_capacity_bytes(self.device)
        running = RunningTier(
            Tier(per_device_batch, accum, world_size or distributed()[1]), seq_len, capacity
        )
        world = running.tier.world_size
        self.grads = AccumulationStats(module.parameters(), loss_divided_by_accum)
        fsdp2 = bool(fsdp2_modules(model))
        if type(model).__name__ == "DistributedDataParallel" and world > 1:
            self.grads.attach_ddp(model)
        elif fsdp2:  # fully_shard: its own reduce-scatter gives the rank's norm
            self.grads.attach_fsdp(model, world)
        if why := unmeasured_sharding(model):
            self.grads.mark_sharded(why)
        sharded = fsdp2 or why is not None  # each device holds a shard of the model's state
        self.noise = noise_window or NoiseScaleWindow(
            max_steps=gns_window_steps or DEFAULT_MAX_STEPS
        )
        self.flops_per_token = flops_per_token
        self.peak_flops = flops_math.peak_flops(device_name(self.device))
        self._cpu_peak = None if self.device.type == "cuda" else CpuPeak()
        self.tokens_seen = 0
        self.last_step = 0
        self.last_metrics: dict[str, float] = {}
        self._nonfinite_steps = 0
        self._excluded = 0.0
        self._alerted: set[str] = set()  # alerts said once per run
        self._finished: str | None = None  # finish()'s status: the record is closed
        self._backwards = 0  # after_backward() calls, and their count at the last step()
        self._backwards_at_step = 0
        self._in_trial = False  # run_trial's arms are running
        self._norms: collections.deque[float] = collections.deque(maxlen=SPIKE_WINDOW)
        policy = policy or default_policy(optimizer, running.batch, lr_rule)
        channel = RampChannel(control_group) if world > 1 else None
        self.ramps = RampProtocol(
            writer,
            running,
            policy,
            event=self.event,
            failed=self._internal_error,
            mode=ramp,
            base_lr=base_lr or _base_lr(optimizer),
            channel=channel,
            trials=TrialProtocol(
                bool(trials),
                trials_note,
                trial_delta_tokens,
                total_tokens,
                delta_from_loss=trial_delta_from_loss,
            ),
            author_alert=self._alert_author,
            shards=world if sharded else 1,
        )
        self.set_tier(per_device_batch, accum)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        db_path,
        *,
        name: str,
        config: Mapping[str, Any],
        model: torch.nn.Module,
        optimizer,
        per_device_batch: int,
        accum: int,
        seq_len: int,
        world_size: int | None = None,
        capacity_bytes: int | None = None,
        run_id: str | None = None,
        resume_step: int | None = None,
        ramp: str = "manual",
        lr_rule: str | None = None,
        trials: bool = False,
        trial_delta_tokens: int | None = None,
        trials_note: str | None = None,
        total_tokens: int | None = None,
        trial_delta_from_loss: bool = False,
        **kwargs,
    ) -> "Monitor":
        """Open (or resume) a run in the database at db_path and return its monitor.

        Under torch.distributed every rank calls it; only rank 0 opens the database. The run
        config records the ramp policy (from `config`'s own, else this batch, the optimizer's
        LR and its rule), the tier and `ramp`, so the dashboard's card judges as the loop does;
        and whether this loop runs trials (trials=True: it calls trial_due() and run_trial()),
        its default Δ or why it runs none (trials_note), so the card says so before a click.
        total_tokens: the run's token budget (default: config's "total_tokens"), recorded as the
        config's "total_tokens": the card's steps left and a trial's share of the run read it.
        trial_delta_from_loss: the default Δ is a cap, and each trial's Δ comes from the run's
        own loss curve below it (monitor/trial_protocol.py).
        """
        # every argument checked before the run exists: a mistake leaves no failed run behind
        total_tokens = _budget(config.get("total_tokens") if total_tokens is None else total_tokens)
        seq_len = positive_int("seq_len", seq_len)
        if capacity_bytes is not None:
            try:
                capacity_bytes = positive_int("capacity_bytes", capacity_bytes)
            except ValueError:
                raise ValueError(
                    f"capacity_bytes must be a positive whole number of bytes (e.g. 80 * 2**30 "
                    f"for 80 GiB), or None for the device's own; got {capacity_bytes!r}"
                ) from None
        check_monitor_keywords(kwargs, "Monitor.start()")
        trial_kwargs = dict(
            trials=trials,
            trial_delta_tokens=trial_delta_tokens,
            trials_note=trials_note,
            total_tokens=total_tokens,
            trial_delta_from_loss=trial_delta_from_loss,
        )
        rank, world = distributed()
        world = world_size or world
        module = getattr(model, "module", model)
        device = next(module.parameters()).device
        capacity = capacity_bytes or device_capacity_bytes(device)
        policy = kwargs.pop("policy", None)
        if policy is not None and not isinstance(policy, RampPolicy):  # before the run exists
            raise TypeError(
                "policy must be a RampPolicy (rampwatch.advisor.policy.RampPolicy), got "
                f"{type(policy).__name__}"
            )
        if policy is None and POLICY_KEY in config:
            policy = RampPolicy.from_config(config)
        policy = policy or default_policy(
            optimizer, Tier(per_device_batch, accum, world).batch, lr_rule
        )
        trial_protocol = TrialProtocol(
            bool(trials), trials_note, trial_delta_tokens, delta_from_loss=trial_delta_from_loss
        )
        check_mode(ramp, policy, trial_protocol)
        writer = None
        if rank == 0:
            recorded = {
                "per_device_batch": per_device_batch,
                "accum": accum,
                "world_size": world,
                "seq_len": seq_len,
                "ramp": ramp,
                "optimizer": type(optimizer).__name__,
                "lr": policy.original_lr,
                **dict(config),
                **({"total_tokens": total_tokens} if total_tokens else {}),
                POLICY_KEY: policy.to_config(),
                **trial_protocol.config(),
            }
            writer = RunWriter.start(
                db_path,
                name,
                config=recorded,
                device=device_name(device),
                capacity_bytes=capacity,
                world_size=world,
                run_id=run_id,
                resume_step=resume_step,
            )
        try:
            mon = cls(
                writer,
                model=model,
                optimizer=optimizer,
                per_device_batch=per_device_batch,
                accum=accum,
                seq_len=seq_len,
                world_size=world,
                device=device,
                ramp=ramp,
                policy=policy,
                capacity_bytes=capacity,
                **trial_kwargs,
                **kwargs,
            )
        except BaseException as e:  # e.g. a second DDP comm hook: the run must not stay running
            if writer is not None:
                writer.close("failed", f"the monitor could not start: {type(e).__name__}: {e}")
            raise
        return mon

    @property
    def run_id(self) -> str | None:
        return self.writer.run_id if self.writer else None

    # the running tier: one home, the ramp protocol's RunningTier, which set_tier replaces
    @property
    def tier(self) -> Tier:
        return self.ramps.running.tier

    @property
    def per_device_batch(self) -> int:
        return self.tier.per_device_batch

    @property
    def accum(self) -> int:
        return self.tier.accum

    @property
    def world_size(self) -> int:
        return self.tier.world_size

    @property
    def seq_len(self) -> int:
        return self.ramps.running.seq_len

    @property
    def capacity(self) -> int:
        return self.ramps.running.capacity_bytes

    @property
    def policy(self) -> RampPolicy:
        """The ramp policy the run records (its original batch and LR, the LR rule)."""
        return self.ramps.policy

    def set_tier(self, per_device_batch: int, accum: int) -> None:
        """After a ramp or an OOM fallback: the next step uses this tier (restarts throughput)."""
        running = self.ramps.running
        tier = Tier(per_device_batch, accum, running.tier.world_size)
        self.ramps.running = replace(running, tier=tier)
        self._last_step_t: float | None = None  # the first step of a tier may recompile
        self._recent_tps: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._one_size_alerted = False  # accumulation 1 on one device: said once per tier

    # -- per micro-batch ----------------------------------------------------------------------
    def after_backward(self, weight: float | None = None) -> None:
        """After each micro-batch's backward. weight: what this micro-batch's mean loss was
        multiplied by when that is not 1/accum (e.g. its share of the step's tokens)."""
        self._backwards += 1
        try:
            self.grads.after_backward(weight)
        except Exception as e:  # never into the loop
            self._internal_error("after_backward", e)

    def reduced_grad(self, *shards: torch.Tensor) -> None:
        """For a loop whose optimizer averages the gradients inside step() (nanochat's
        reduce-scatter), with no DDP wrapper: call it there with this rank's shards of the
        averaged gradient, then mon.step() after the optimizer's step. Their squared norms,
        summed over ranks, are the global point DDP's all-reduced .grad gives, so the noise
        scale is DDP's (monitor/gradstats.py)."""
        if self._in_trial:  # the arms' optimizer steps are no step of the run's
            return
        try:
            kept = self.grads.add_reduced(shards)
        except Exception as e:  # never into the loop
            self._internal_error("reduced_grad", e)
            return
        if not kept:
            self._tell_loop(
                self.last_step,
                "reduced_grad",
                "mon.reduced_grad() came with no backward recorded since mon.step(), or on a "
                "DDP or FSDP2 model (which give the global gradient themselves): it is "
                "ignored. In a loop that syncs inside the optimizer, call mon.after_backward() "
                "after each backward, mon.reduced_grad(...) inside the optimizer's step(), and "
                "mon.step() after the optimizer's step",
            )

    def discard_step(self) -> None:
        """Forget this step's partial sums and its peak memory: its backwards never reached an
        optimizer step (a skipped batch, an out-of-memory retry), and the peak of an attempt
        that ran out of memory is no peak of the smaller tier the step is redone at."""
        self.grads.reset()
        self._memory_metrics()

    @contextlib.contextmanager
    def untimed(self):
        """What runs inside (validation, checkpoints) is left out of step time and tokens/s,
        and out of the next step's peak memory: that row is the running tier's measured one.
        Inside a step's accumulation (Lightning can validate there) the micro-batches after it
        reach their peak again, and the optimizer's step comes after them."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - t0
            self._memory_metrics()  # read and reset: the peak starts again here

    # -- per optimizer step -------------------------------------------------------------------
    def step(
        self,
        step: int,
        loss: float,
        *,
        grad_scale: float = 1.0,
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Record one optimizer step. Call after the last backward, before clipping (a loop
        that hands reduced_grad() its shards: after the optimizer's step). Returns
        what was logged ({} when the monitor itself failed: said once as an alert)."""
        if self._after_finish("step", step):
            return {}
        checked, problem = step_problem(step)
        if problem is not None:  # said at the last good step: the store takes no other
            self.grads.reset()
            self._backwards_at_step = self._backwards
            self._tell_loop(
                self.last_step,
                "bad step",
                f"mon.step({step!r}, ...): {problem}, not an optimizer step count; that step "
                "is not logged. Pass the step as a non-negative int",
            )
            return {}
        try:
            return self._step(checked, loss, grad_scale, extra)
        except Exception as e:  # never into the loop
            self.grads.reset()
            self._internal_error("step", e, step)
            return {}

    def _internal_error(self, where: str, error: Exception, step: int | None = None) -> None:
        if where in self._alerted:
            return
        self._alerted.add(where)
        self.event(
            self.last_step if step is None else step,
            M.EVENT_ALERT,
            f"rampwatch could not take this step's telemetry in {where}: "
            f"{type(error).__name__}: {error}; training goes on without it",
            {"where": where, "error": repr(error)},
        )

    def _step(self, step: int, loss, grad_scale: float, extra) -> dict[str, float]:
        # after_backward() since the last step(): the noise scale's points are there
        reported = self.grads.sharded or self._backwards > self._backwards_at_step
        read_grads = reported or self._without_after_backward(step)
        if read_grads is None:  # step() again for a step already logged
            return {}
        if step <= self.last_step and step:  # logged, with two rows for one step: said once
            self._tell_loop(
                step,
                "step went back",
                f"mon.step({step}) came after mon.step({self.last_step}): steps must grow, or "
                "the charts, the noise-scale trend and the ramp's timing read two steps as "
                "one. Is the loop passing the batch's index in its epoch? Pass the optimizer "
                "step count (it goes on across epochs)",
            )
        self.last_step, self._backwards_at_step = step, self._backwards
        stats, mem = None, None
        running = self.ramps.running
        tier = running.tier
        if self.grads.sharded:  # FSDP1 / ZeRO: no norm of a shard passed off as the gradient's
            self._say_sharded(step)
            self.grads.reset()
        elif read_grads:
            if tier.world_size > 1:  # every rank calls step(): one small all-reduce in collect
                stats, loss, mem = self._collect_ddp(loss, grad_scale)
            else:
                stats = self.grads.collect(tier.per_device_batch, grad_scale)
        now = time.perf_counter()
        batch_seqs = tier.batch
        batch_tokens = batch_seqs * running.seq_len
        self.tokens_seen += batch_tokens
        m: dict[str, float] = {
            # a loss that still requires grad: no torch warning about reading it as a number
            M.LOSS: float(loss.detach() if isinstance(loss, torch.Tensor) else loss),
            M.LR: float(self.optimizer.param_groups[0]["lr"]),
            **_tier_row(tier, running.seq_len, self.tokens_seen),
        }
        if stats is not None:
            m[M.GRAD_NORM] = stats.grad_norm
            if reported:
                m.update(self._noise_metrics(step, stats, batch_seqs))
            self._check_spike(step, stats.grad_norm)
        if self._last_step_t is not None:
            dt = now - self._last_step_t - self._excluded
            m[M.STEP_TIME] = dt
            m[M.TOKENS_PER_S] = batch_tokens / dt
            self._recent_tps.append(m[M.TOKENS_PER_S])
            if self.flops_per_token and self.peak_flops:
                m[M.MFU] = flops_math.mfu(
                    m[M.TOKENS_PER_S], self.flops_per_token, self.peak_flops, self.world_size
                )
        self._last_step_t, self._excluded = now, 0.0
        m.update(mem if mem is not None else self._memory_metrics())
        if extra:
            m.update(self._numbers(step, extra, m, "mon.step(..., extra=...): extra"))
        self.last_metrics = m
        if self.writer:
            self.writer.log(step, m)
        self.ramps.observe(step, m)
        self.ramps.trials.observe(m)
        return m

    def _numbers(
        self, step: int, values: Mapping[str, Any], own: Mapping[str, float], call: str
    ) -> dict[str, float]:
        """values as floats; one that has no name, is not a number, or would replace a value the
        monitor measured (`own`) is left out and said to the loop's author once per key (never
        the rest lost). call: how the message names where the values came from."""
        out = {}
        for k, v in values.items():
            problem = M.name_problem(k)
            if problem is not None:
                said = f"is left out: {problem}. Name each value with a str"
            elif k in own:
                said = (
                    f"would replace the monitor's own {k!r}, which the charts and the advisor "
                    "read: left out. Log it under another name"
                )
            else:
                try:
                    out[k] = float(v)
                    continue
                except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of many
                    said = (
                        f"is not a number ({v!r:.60}): left out wherever it is not one, the "
                        "rest logged. Pass floats, ints or one-element tensors"
                    )
            self._tell_loop(step, f"{call} {k!r}", f"{call}[{k!r}] {said}")
        return out

    def _without_after_backward(self, step: int) -> bool | None:
        """step() with no after_backward() since the last step(): whether to read .grad for the
        gradient norm (never for the noise scale), or None to ignore this call. Each case is
        said once, on stderr too."""
        if self._backwards == 0:  # never called: .grad at this step is still the gradient
            self._tell_loop(
                step,
                "no after_backward",
                "mon.after_backward() was not called after each backward: the noise scale "
                "needs it; everything else is logged. To measure it, call "
                "mon.after_backward() right after each micro-batch's loss.backward()",
            )
            return self.grads.record_final()
        if step == self.last_step:  # logged already: a second row would count its tokens twice
            self._tell_loop(
                step,
                "step twice",
                f"mon.step({step}) was called twice for step {step}, with no "
                "mon.after_backward() in between: the second call is ignored; call mon.step() "
                "once per optimizer step, after its last backward",
            )
            return None
        # no backward since, or one the loop did not report: .grad may be the last step's
        self._tell_loop(
            step,
            "no backward since step",
            f"mon.step({step}) was called with no mon.after_backward() since "
            f"mon.step({self.last_step}): such a step is logged without gradient norm or noise "
            "scale; call mon.after_backward() after each backward, and mon.step() once per "
            "optimizer step",
        )
        return False

    def _tell_loop(self, step: int, key: str, message: str) -> None:
        """An alert about how the loop calls the monitor, once per run: printed to stderr even
        without echo, since only the loop's author can fix it."""
        if key not in self._alerted:
            self._alerted.add(key)
            self._record(step, M.EVENT_ALERT, message, {"cause": key}, self.echo or sys.stderr)

    def _alert_author(self, step: int, message: str, data: Mapping) -> None:
        """An alert about what the loop does (its LR ignored a ramp), each time it happens;
        the first of its cause is printed to stderr even without echo."""
        cause = str(data.get("cause"))
        loud = self.echo is None and cause not in self._alerted
        self._alerted.add(cause)
        self._record(step, M.EVENT_ALERT, message, data, sys.stderr if loud else self.echo)

    def _check_spike(self, step: int, grad_norm: float) -> None:
        """An alert when the gradient norm jumps past SPIKE_FACTOR × its median over the last
        SPIKE_WINDOW steps: the usual first sign of a bad batch or too high an LR."""
        history = self._norms
        if not math.isfinite(grad_norm):
            return
        if len(history) < SPIKE_MIN_STEPS or grad_norm <= SPIKE_FACTOR * min(history):
            history.append(grad_norm)  # at or below 10× the least, so 10× the median: no sort
            return
        median = statistics.median(history)
        if grad_norm > SPIKE_FACTOR * median:
            self.event(
                step,
                M.EVENT_ALERT,
                f"gradient-norm spike: {grad_norm:.3g} is {grad_norm / median:.0f}× the "
                f"median of the last {len(history)} steps ({median:.3g}); check this "
                "step's data and the LR (clipping bounds the update, not the cause)",
                {"grad_norm": grad_norm, "median": median},
            )
        history.append(grad_norm)

    def _say_sharded(self, step: int) -> None:
        if self.grads.sharded_why == NO_GRAD:  # most often the loop's order: said to its author
            self._tell_loop(
                step,
                "no grad",
                "gradient norm and noise scale not measured: mon.after_backward() found no "
                ".grad. Call it right after each loss.backward(), before the optimizer's step() "
                "and zero_grad(); an optimizer that keeps gradients in its own buffers "
                "(DeepSpeed ZeRO-2/3) cannot be measured",
            )
            return
        if "sharded" not in self._alerted:
            self._alerted.add("sharded")
            self.event(
                step,
                M.EVENT_ALERT,
                "noise scale not measured: sharded gradients: "
                f"{self.grads.sharded_why or 'a shard of .grad per rank'}. Measured under "
                "DistributedDataParallel (ZeroRedundancyOptimizer included) and FSDP2 "
                "(fully_shard on a 1-D mesh); not under FSDP1, DeepSpeed ZeRO, HSDP or tensor "
                "parallelism",
                {"sharded": True, "why": self.grads.sharded_why},
            )

    # -- at each step boundary: the ramp protocol (monitor/ramp_protocol.py) ------------
    def ramp_due(self, step: int | None = None) -> Ramp | None:
        """At a step boundary (after the optimizer step of `step`, default the last one logged):
        the ramp to apply now, already checked against memory and the policy, or None. Under
        torch.distributed every rank calls it and gets the same answer at the same boundary."""
        return self.ramps.due(self.last_step if step is None else step)

    def request_stop(self) -> None:
        """Ask the run to stop at a step boundary (e.g. from a SIGTERM handler: it only sets a
        flag). After the next ramp_due(), `stopping` is true on every rank at the same boundary
        (under torch.distributed, rank 0's request counts, one boundary later)."""
        self.ramps.stop_requested = True

    @property
    def stopping(self) -> bool:
        return self.ramps.stopping

    def ramp_applied(self, ramp: Ramp) -> None:
        """The loop now runs ramp.tier (and has moved its LR): the monitor takes the tier,
        records the ramp event and the command's 'applied at step N'."""
        self.set_tier(ramp.tier.per_device_batch, ramp.tier.accum)
        self.noise.mark()  # the new LR may change the trend from here: test this step alone
        self.ramps.applied(ramp)

    @property
    def lr_scale(self) -> float:
        """The cumulative LR multiplier of the ramps applied so far (the product of their
        lr_multiplier; a resume continues it), for a loop that computes its own LR each step:
        lr = get_lr(it) * mon.lr_scale. A ramp whose LR change the check found not carried
        out is taken back out of it."""
        return self.ramps.lr_scale

    def ramp_refused(self, ramp: Ramp, reason: str) -> None:
        """The loop could not apply it: the card shows 'refused: reason'."""
        self.ramps.refused(ramp, reason)

    # -- a trial at a step boundary (monitor/trial_protocol.py, monitor/trial_runner.py) ------
    def trial_due(self) -> TrialRequest | None:
        """After ramp_due() at the same boundary: the trial to run now (a checked trial command),
        or None; its trial_start event (with the cost) is written here. Under torch.distributed
        every rank gets the same request at the same boundary."""
        req, self.ramps.trials.pending = self.ramps.trials.pending, None
        if req is not None:
            self.ramps.trials.started(self.event, req, recent_throughput(self._recent_tps))
        return req

    def run_trial(
        self,
        request: TrialRequest,
        train_step,
        evaluate,
        start: int = 0,
        scheduler=None,
        keep: int | None = None,
        snapshots: str = "auto",
        snapshot_dir=None,
        grow_eval=None,
    ) -> TrialOutcome | None:
        """Run the trial on the model and optimizer this monitor was given (and `scheduler`):
        snapshot, the control and each branch that could still change the verdict for Δ tokens
        from example `start` (monitor/
        trial_runner.py: train_step(model, optimizer, start, count), one optimizer step on
        examples start .. start + count − 1, returning its loss; evaluate(model), one loss per
        held-out example), judge, and leave the kept arm's end state in place. No per-step
        metrics are logged while arms run (trial_arm points only), and the next step's peak
        memory is measured from the trial's end: an arm's larger batch is no peak of the
        running tier's (its measured memory row). An error inside restores the
        snapshot and abandons the trial (the event, the command refused): returns None. keep: a
        testing aid, continue from this arm whatever the verdict (the trial_end says so).
        snapshots / snapshot_dir: where the trial's copies of the state go ("auto": host memory
        while they fit, else files in snapshot_dir, else the trial is refused with the sizes;
        "memory"; "disk": monitor/trial_snapshot.py). grow_eval(n): evaluate() scores n
        held-out examples from now on, or as many as it can, and returns how many; given, a
        control whose evaluations cannot tell whether Δ is too long is measured again on the
        batch that would tell before the branches run (trial_runner.py, the second stage)."""
        from rampwatch.monitor.trial_runner import run_trial
        from rampwatch.monitor.trial_snapshot import COPIES, SnapshotsDoNotFit, place_snapshots

        plan, trials = request.plan(), self.ramps.trials
        every = {k: max(1, plan.steps(k) // 4) for k in (1, *plan.ks)}

        arm_losses: dict[int, list[float | None]] = {}

        def on_step(k, done, loss):
            arm_losses.setdefault(k, []).append(_number(loss))
            if done % every[k] == 0 and done < plan.steps(k):
                trials.arm_point(self.event, request, k, done, arm_losses[k][-1])

        def on_arm(k, losses):  # the arm's last step: its train loss and the held-out mean
            mean = float(losses.mean())
            last = arm_losses.get(k, [None])[-1]
            trials.arm_point(self.event, request, k, plan.steps(k), last, mean)

        def on_stage(first, examples):
            trials.second_stage(self.event, request, first, examples)

        t0, self._in_trial, place = time.perf_counter(), True, None
        try:
            copies = COPIES + (keep is not None)
            place = place_snapshots(self.model, self.optimizer, snapshots, snapshot_dir, copies)
            verdict, _ = run_trial(
                plan,
                self.model,
                self.optimizer,
                train_step,
                evaluate,
                start=start,
                scheduler=scheduler,
                b_simple=self.noise_scale,
                on_step=on_step,
                on_arm=on_arm,
                keep=keep,
                cap=request.cap,
                place=place,
                grow_eval=grow_eval,
                on_stage=on_stage,
            )
        except SnapshotsDoNotFit as e:  # nothing ran
            self.trial_abandoned(request, f"{e}; nothing was run")
            return None
        except Exception as e:  # the snapshot is back in place: the run goes on from S
            what = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]  # gloo's run on
            self.trial_abandoned(request, f"{what}; the snapshot was restored")
            return None
        finally:
            if place is not None:
                place.close()
            self.discard_step()  # the arms' backwards and peak memory are no step's of the run
            self._in_trial = False
        kept = request.arm(keep or verdict.kept_k)
        seconds = time.perf_counter() - t0
        return TrialOutcome(
            request, verdict, kept, seconds, place, tuple(arm_losses.get(kept.factor, ()))
        )

    def trial_ended(self, outcome: TrialOutcome) -> int:
        """The loop continues from the kept arm (its tier, its base LR, the data position after
        Δ): the trial_end event, a 'ramp' event (source "trial N") when a branch was kept, the
        command applied at continue_step. Returns continue_step: the next step() is one past it."""
        req, kept, step = outcome.request, outcome.kept, outcome.continue_step
        self._log_kept_steps(outcome)
        self.last_step = step
        self.tokens_seen += req.delta_tokens
        self.ramps.trials.ended(self.event, outcome)
        if kept.factor > 1:
            ramp = Ramp(
                kept.tier,
                lr_multiplier=kept.base_lr / self.ramps.base_lr,
                base_lr=kept.base_lr,
                step=step,
                source=f"trial {req.trial_id}",
                before=req.control,
            )
            self.ramp_applied(ramp)
        else:
            self.set_tier(req.control.per_device_batch, req.control.accum)  # restarts the timer
        self.ramps.trial_done(req.command_id, step)
        return step

    def _log_kept_steps(self, outcome: TrialOutcome) -> None:
        """The kept arm's steps are the run's: their rows, written once the verdict is in, so
        the curves have no gap and no discarded arm's step. Tier and tokens, and the train loss
        on one device (under torch.distributed an arm's loss is this rank's, not the step's
        mean). No LR (read before or after an arm's step, it is the step's in some loops and the
        next one's in others), norms, noise scale, memory or timing: the arms measure none."""
        if self.writer is None:
            return
        req, tier = outcome.request, outcome.kept.tier
        tokens = tier.batch * req.seq_len
        for i, loss in enumerate(outcome.kept_losses, start=1):
            m = _tier_row(tier, req.seq_len, self.tokens_seen + i * tokens)
            if loss is not None and self.world_size == 1:
                m[M.LOSS] = loss
            self.writer.log(req.step + i, m)

    def trial_abandoned(self, request: TrialRequest, reason: str) -> None:
        """The trial did not finish (the loop could not run it, or an error restored the
        snapshot): the event, and its command refused with the reason."""
        self.ramps.trials.abandoned(self.event, request, reason)
        self.ramps.trial_done(request.command_id, None, f"trial abandoned: {reason}")

    def report_oom(
        self, per_device_batch: int, step: int | None = None, message: str = "out of memory"
    ) -> None:
        """The loop ran out of memory at this per-device batch: no tier uses it again."""
        step = self.last_step if step is None else step
        self.mark_infeasible(per_device_batch, step)
        self.event(
            step,
            M.EVENT_OOM,
            f"out of memory at per-device batch {per_device_batch}: {message}",
            {"per_device_batch": int(per_device_batch), "error": message},
        )
        self.discard_step()

    def mark_infeasible(self, per_device_batch: int, step: int | None = None) -> None:
        """No tier uses this per-device batch again (its plan row says so), with no event: for a
        loop that records its own, after what must come first (the trainer's OOM checkpoint)."""
        self.ramps.mark_infeasible(per_device_batch, self.last_step if step is None else step)

    def set_plan_variant(self, variant: str) -> None:
        """Which memory-plan rows describe this run (the trainer's: plain or chunked CE)."""
        self.ramps.variant = variant

    def plan_memory(self, setup, per_device_batches=None, *, amp: str | None = None) -> None:
        """Predict the peak at several per-device batches (default ½, 1, 2, 4, 8 × the running
        one) on fake tensors, in a child process (monitor/memplan.py; `setup` is a module-level
        function or "module:function"); the rows reach the card and the ramp checks at a later
        ramp_due(). A model fake tensors cannot run gets an alert naming probe_memory()."""
        from rampwatch.monitor import memplan  # torch.distributed._tools: only when planning

        if self.writer is None or self._sharded_plan_said("plan_memory"):
            return
        b = self.per_device_batch
        batches = per_device_batches or sorted({max(1, b // 2), b, 2 * b, 4 * b, 8 * b})
        self.ramps.start_plan(
            memplan.start_plan(
                setup, batches, device_type=self.device.type, amp=amp, accum_steps=self.accum
            )
        )

    def probe_memory(self, setup, per_device_batches) -> list[dict]:
        """Measure the peak of real training steps at these per-device batches, in a child
        process on this device, up to the first out-of-memory (monitor/memprobe.py; blocks).
        For models the fake-tensor plan cannot run: what Lightning's BatchSizeFinder does."""
        from rampwatch.monitor.memprobe import probe

        if self._sharded_plan_said("probe_memory"):
            return []
        rows = probe(setup, per_device_batches, device=self.device.type)
        self.add_memory_plan(rows, "probe")
        return rows

    def _sharded_plan_said(self, what: str) -> bool:
        """True (and one alert) when the model is sharded over several devices: a plan or a
        probe runs a replica in one process, whose peak is not a shard's."""
        shards = self.ramps.shards
        if shards > 1:
            self.event(
                self.last_step,
                M.EVENT_ALERT,
                f"{what}() skipped: the model is sharded over {shards} devices and it would "
                f"measure a replica; the card's tiers use the peaks measured at {shards} shards",
                {"shards": shards},
            )
        return shards > 1

    def add_memory_plan(self, rows, source: str = "plan") -> None:
        """Rows of a memory plan (monitor/memplan.py) or a probe: the card and the checks use
        them (a plan's prediction until two per-device batches are measured)."""
        self.ramps.write_plan_rows(list(rows), source, self.last_step)

    def _collect_ddp(self, loss, grad_scale: float):
        """DDP: the loss averaged over ranks and the peak memory maxed over ranks ride on the
        noise-scale statistics' all-reduce (other memory figures stay this rank's)."""
        mem = self._memory_metrics()
        stats = self.grads.collect(
            self.per_device_batch,
            grad_scale,
            self.world_size,
            rank_mean=[loss],
            rank_max=[mem[M.MEM_PEAK]],
        )
        mem[M.MEM_PEAK] = stats.rank_maxes[0]
        return stats, stats.rank_means[0], mem

    def _noise_metrics(self, step: int, stats: StepGradStats, batch_seqs: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if not stats.finite:
            self._nonfinite_steps += 1
            self.event(
                step,
                M.EVENT_ALERT,
                "non-finite gradient: step left out of the noise scale",
                {"nonfinite_steps": self._nonfinite_steps},
            )
        elif len(stats.sq_norms) >= 2:
            # least squares of |S_j/j|^2 on 1/(batch behind it): intercept |G|^2, slope tr(Sigma)
            g2, trace = line_estimates(stats.batch_sizes, stats.sq_norms)
            out[M.GNS_G2], out[M.GNS_TRACE] = g2, trace
            if g2 > 0:
                out[M.GNS_RAW] = trace / g2
            out.update(self._smoothed(self.noise.update(g2, trace)))
        elif not self._one_size_alerted:  # one point per step: nothing to fit, say so once
            self._one_size_alerted = True
            self.event(
                step,
                M.EVENT_ALERT,
                (
                    "noise scale not measured: accumulation 1 on each rank without "
                    "DistributedDataParallel gives one batch size per step (.grad is the "
                    "rank's own until the optimizer syncs it); use accumulation ≥ 2, or "
                    "wrap the model in DistributedDataParallel"
                    if self.world_size > 1  # with DDP's hook there are always two sizes
                    else "noise scale not measured: accumulation 1 on one device gives one "
                    "batch size per step; use accumulation ≥ 2 (Lightning: "
                    "accumulate_grad_batches; Hugging Face: gradient_accumulation_steps; the "
                    "reference trainer: --accum, or --split-micro to split each batch in two)"
                ),
                {
                    "batch_sizes": stats.batch_sizes,
                    "accum": self.accum,
                    "world_size": self.world_size,
                },
            )
        return out

    def _smoothed(self, est) -> dict[str, float]:
        """This step's windowed estimate; nothing at all on a step without a fresh one."""
        if est is None:
            return {}
        out = {M.GNS_LOW: est.lower, M.GNS_WINDOW: est.steps}
        if est.b_simple is not None:
            out[M.GNS] = est.b_simple
            out[M.GNS_TOKENS] = est.b_simple * self.seq_len
        if est.upper is not None:
            out[M.GNS_HIGH] = est.upper
        return out

    def _memory_metrics(self) -> dict[str, float]:
        return memory_metrics(self.device, self._cpu_peak, self.capacity)

    # -- other records ------------------------------------------------------------------------
    def log_validation(
        self, step: int, metrics: Mapping[str, Any], loss_key: str = M.VAL_LOSS
    ) -> dict[str, float]:
        """A validation's results after optimizer step `step` (a framework's: Lightning's
        callback_metrics, the Hugging Face Trainer's evaluate()): each number under its own
        name, and `loss_key`'s as val_loss, which the loss chart draws beside the training loss.
        A name the monitor logs itself each step (loss, lr, ...) or a value that is not a number
        is left out and said once. Returns what was logged."""
        if self._after_finish("log_validation", step):
            return {}
        renamed = {M.VAL_LOSS if k == loss_key else k: v for k, v in metrics.items()}
        logged = self._numbers(step, renamed, self.last_metrics, "validation metrics")
        if logged and self.writer:
            self.writer.log(step, logged)
        return logged

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Any other per-step values (validation loss, your own metrics)."""
        if self.writer and not self._after_finish("log", step):
            self.writer.log(step, metrics)

    def event(self, step: int, kind: str, message: str, data: Mapping | None = None) -> None:
        self._record(step, kind, message, data, self.echo)

    def _record(self, step, kind, message, data, echo: TextIO | None) -> None:
        if self.writer and not self._after_finish("event", kind):  # rank 0: one line per event
            self.writer.event(kind, message, step=step, data=dict(data or {}))
            if echo is not None:
                print(f"rampwatch: step {step}: {kind}: {message}", file=echo, flush=True)

    # -- what a resume continues -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues, as plain JSON values (torch checkpoints read with
        weights_only=True hold it, and the Hugging Face restart's rampwatch.json): the last step
        logged, tokens seen, the noise-scale window, and the ramp protocol's base LR (and the
        base before any ramp: lr_scale), last ramp, per-device batches that ran out of memory
        and measured peaks."""
        return {
            "step": self.last_step,
            "tokens_seen": self.tokens_seen,
            "noise_window": self.noise.to_dict(),
            **self.ramps.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state_dict(). A key it lacks keeps this monitor's value (a checkpoint
        that does not keep it: the trainer's has no measured peaks; an empty noise window is a
        fresh one); keys it does not know are left alone (it may be part of a larger record)."""
        self.last_step = int(state.get("step", self.last_step))
        self.tokens_seen = int(state.get("tokens_seen", self.tokens_seen))
        if state.get("noise_window"):
            self.noise = NoiseScaleWindow.from_dict(state["noise_window"])
        self.ramps.load_state_dict(state)

    @property
    def noise_scale(self) -> float | None:
        """The latest windowed B_simple in sequences, or None while there is none."""
        est = self.noise.latest
        return None if est is None else est.b_simple

    def _after_finish(self, call: str, first: Any) -> bool:
        """True once finish() has closed the record: nothing more can be logged. Said once, on
        rank 0's stderr (the run's events are closed too), naming the call that came too late
        as mon.call(first, ...): built only then, since step() asks at every step."""
        if self._finished is None:
            return False
        if self.writer and "after finish" not in self._alerted:
            self._alerted.add("after finish")
            print(
                f"rampwatch: mon.{call}({first!r}, ...) came after mon.finish(): the run is "
                f"{self._finished} and nothing more is logged. Call mon.finish() once, after "
                "the loop's last step",
                file=sys.stderr,
                flush=True,
            )
        return True

    def finish(self, status: str = "finished", message: str | None = None) -> None:
        """Final status (finished, failed or killed) and a last flush into the database; a ramp
        decided but not yet applied is refused. The monitor logs nothing after it."""
        if self._finished is not None:  # a second finish() (an exit handler's) changes nothing
            return
        self.ramps.close(status)  # may record the refusal of a ramp not yet applied
        if self.writer:
            self.writer.close(status, message)
        self._finished = status
