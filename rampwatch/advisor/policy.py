"""The ramp policy: one dataclass that the trainer's auto mode, its command check and the
dashboard's card all read from the run config, so they cannot disagree.

Target: keep the effective batch B within [B_noise, 2·B_noise], with B_noise the measured
B_simple. Ramp ×2 once the noise scale's one-sided 95% lower bound has stayed at or above B
(`bound_at`) — and its point at or above `ramp_at`·B — for `hysteresis_steps` estimates.

Why not [B_noise/2, B_noise]: B_simple underestimates the critical batch when the Hessian is not
isotropic (McCandlish et al. 2018, §2.2: B_noise >= B_simple; B_crit ≈ B_noise). bench/ramp_bench.py
measured B_crit ≈ 1.8 × B_simple at its target, so [B_simple, 2·B_simple] is about
[B_crit/2, B_crit]; the README has the figures, including the same bench at ramp_at = 2.

What it costs, by eq. 2.11 (S/S_min = 1 + B_noise/B, E/E_min = 1 + B/B_noise): inside the band
1.5–2× the minimum number of steps and 2–3× the minimum number of examples with B_crit = B_simple,
or about 1.9–2.8× and 1.6–2.1× with B_crit = 1.8·B_simple; a batch held at B while B_noise grows
to k·B takes (1 + k)× the minimum steps. `band_cost()` states it for any settings.

The gate: what an auto ramp rests on. "noise" (the default) ramps on the noise scale as above.
"trial" ramps only through a ramp trial that passes (advisor/trial.py; the kept branch is the
ramp): the monitor starts one when the noise gate would ramp (before any trial, B_simple read by
the band above as about half the critical batch; after one, c·B_simple read as the critical batch
itself, `critical` below, past factor × B), or every `trial_interval_tokens` whatever it says,
and waits that interval after a trial that kept the control. Why both: B_simple can
underestimate the critical batch by orders of magnitude (Merrill et al. 2025, arXiv 2505.23971),
so the evidence alone could never call a trial; the interval bounds what trials cost (None:
TRIAL_INTERVAL_DELTAS × the trial's Δ, which keeps a ×2, ×4 trial's discarded arms within 2% of
the tokens between trials).

The run config holds the policy under CONFIG_KEY; `from_config` also reads the keys that runs
written before the policy existed used (ramp_hysteresis, ramp_min_samples, original_lr,
original_batch), and falls back on the first tier of the config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace

from rampwatch.advisor.lr import rule_for, scaled_base_lr
from rampwatch.advisor.ramp_point import ramp_decision

__all__ = [
    "CONFIG_KEY",
    "GATES",
    "RAMP_MAX_FACTOR",
    "RampPolicy",
    "TRIAL_INTERVAL_DELTAS",
    "default",
]

RAMP_MAX_FACTOR = 8  # effective-batch growth per ramp: a larger jump is a typo, not a ramp

GATES = ("noise", "trial")  # what an auto ramp rests on (above)
TRIAL_INTERVAL_DELTAS = 100  # gate "trial", no interval given: a trial every 100 × its Δ tokens

CONFIG_KEY = "ramp_policy"  # where the run config keeps RampPolicy.to_config()
# keys of run configs written before the policy existed
LEGACY_HYSTERESIS = "ramp_hysteresis"
LEGACY_MIN_ESTIMATES = "ramp_min_samples"
LEGACY_ORIGINAL_LR = "original_lr"
LEGACY_ORIGINAL_BATCH = "original_batch"


@dataclass(frozen=True)
class RampPolicy:
    original_batch: int  # sequences per optimizer step at the run's start (all ranks)
    original_lr: float  # base LR at original_batch; every ramp's LR is scaled from it
    lr_rule: str = "sqrt"  # advisor.lr rule: 'sqrt' (Adam family), 'linear' (SGD), 'none'
    ramp_at: float = 1.0  # ramp once the noise scale >= ramp_at × B ...
    bound_at: float = 1.0  # ... and its one-sided 95% lower bound >= bound_at × B
    factor: int = 2  # the auto ramp multiplies the batch by this
    hysteresis_steps: int = 20  # consecutive estimates above, counted after the last ramp
    min_estimates: int = 30  # noise-scale estimates before any ramp
    margin: float = 0.05  # fraction of device memory kept free when judging fit
    offered_factors: tuple[int, ...] = (2, 4, 8)  # the tiers the card offers
    keep_noise_scale: bool = True  # on one device, offer tiers with accumulation >= 2
    gate: str = "noise"  # auto ramps on the noise scale, or only through a passing trial
    trial_interval_tokens: int | None = None  # gate "trial": tokens between trials (None: above)

    def __post_init__(self):
        if not (isinstance(self.original_batch, int) and self.original_batch > 0):
            raise ValueError(
                f"original_batch must be a positive integer, got {self.original_batch!r}"
            )
        if not (math.isfinite(self.original_lr) and self.original_lr > 0):
            raise ValueError(f"original_lr must be a positive number, got {self.original_lr!r}")
        rule_for(rule=self.lr_rule)  # raises on an unknown rule
        if not (self.ramp_at > 0 and self.bound_at >= 0 and self.factor >= 2):
            raise ValueError("ramp_at must be > 0, bound_at >= 0 and factor >= 2")
        if self.hysteresis_steps < 1 or self.min_estimates < 0 or not 0 <= self.margin < 1:
            raise ValueError("hysteresis_steps >= 1, min_estimates >= 0 and margin in [0, 1)")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        if self.trial_interval_tokens is not None and not (
            isinstance(self.trial_interval_tokens, int) and self.trial_interval_tokens > 0
        ):
            raise ValueError(
                "trial_interval_tokens must be a positive number of tokens or None, got "
                f"{self.trial_interval_tokens!r}"
            )
        if max(self.factor, *self.offered_factors) > RAMP_MAX_FACTOR:
            raise ValueError(
                f"factor and offered_factors must be at most {RAMP_MAX_FACTOR} (RAMP_MAX_FACTOR: "
                "the store refuses a larger jump in one ramp)"
            )

    # -- what it says ---------------------------------------------------------------------
    def band_cost(self) -> dict[str, float]:
        """Steps and examples relative to their minima at the band's ends (eq. 2.11)."""
        low, high = 1.0 / self.ramp_at, self.factor / self.ramp_at  # B / B_noise at the ends
        return {
            "batch_low": low,
            "batch_high": high,
            "steps_low": 1 + 1 / high,
            "steps_high": 1 + 1 / low,
            "examples_low": 1 + low,
            "examples_high": 1 + high,
        }

    def describe(self) -> str:
        c = self.band_cost()
        return (
            f"keep the batch within [{c['batch_low']:g}, {c['batch_high']:g}] × the noise "
            f"scale: ×{self.factor} once it is >= {self.ramp_at:g}× the batch for "
            f"{self.hysteresis_steps} estimates (95% lower bound >= {self.bound_at:g}× the "
            f"batch); eq. 2.11 prices that band at {c['steps_low']:g}–{c['steps_high']:g}× "
            f"the minimum steps and {c['examples_low']:g}–{c['examples_high']:g}× the "
            "minimum examples"
            + ("; auto ramps only through a passing trial" if self.gate == "trial" else "")
        )

    def critical_scale(self, critical: bool) -> int:
        """What the ramp point is multiplied by when the values estimate the critical batch
        itself (`decide`'s `critical`): the factor, so the new batch is at most B_crit."""
        return self.factor if critical else 1

    def ramp_point(self, batch: float, critical: bool = False) -> float:
        """The noise scale (or, critical, the critical batch) at which `decide` ramps a run at
        `batch`: ramp_at × batch, × factor when critical. advisor/schedule.py projects it."""
        return self.ramp_at * self.critical_scale(critical) * float(batch)

    def trial_interval(self, delta_tokens: int) -> int:
        """Gate "trial": tokens from one trial's start to the next that the evidence did not call."""
        return self.trial_interval_tokens or TRIAL_INTERVAL_DELTAS * int(delta_tokens)

    def new_base_lr(self, new_batch: int) -> float:
        """The base LR at new_batch, scaled from the original (a ramp and its reverse restore it)."""
        return scaled_base_lr(self.original_lr, self.original_batch, new_batch, self.lr_rule)

    def decide(
        self,
        steps: Sequence[int],
        b_noise: Sequence[float | None],
        lower: Sequence[float | None] | None,
        batch: float,
        since_step: int | None,
        critical: bool = False,
        subject: str = "The noise scale",
    ):
        """advisor.ramp_point.ramp_decision with this policy's thresholds (its only source of them).

        critical: the values estimate the critical batch itself (a trial's calibration), not
        B_simple. The band [B_simple, 2·B_simple] above is about [B_crit/2, B_crit]; for B_crit
        the same ramp point is factor × ramp_at × B, so the new batch is at most the critical
        batch (Merrill et al.'s warmup: double B once B* > 2B). subject: what the verdict's
        sentences call the values ("The calibrated noise scale" after a trial)."""
        scale = self.critical_scale(critical)
        return ramp_decision(
            steps,
            b_noise,
            batch,
            ramp_at=self.ramp_at * scale,
            bound_at=self.bound_at * scale,
            hysteresis_steps=self.hysteresis_steps,
            min_estimates=self.min_estimates,
            factor=self.factor,
            since_step=since_step,
            lower=lower,
            subject=subject,
        )

    # -- the run config -----------------------------------------------------------------------
    def to_config(self) -> dict:
        d = asdict(self)
        d["offered_factors"] = list(self.offered_factors)
        return d

    @classmethod
    def from_config(cls, config: Mapping | None, **overrides) -> RampPolicy:
        """The policy a run recorded; older configs through their legacy keys and first tier.
        Raises ValueError when the config names neither a policy nor a first tier and LR."""
        config = config or {}
        saved = config.get(CONFIG_KEY)
        if isinstance(saved, Mapping):
            known = {f.name for f in fields(cls)}
            kw = {k: v for k, v in saved.items() if k in known}
            if "offered_factors" in kw:
                kw["offered_factors"] = tuple(int(f) for f in kw["offered_factors"])
            return replace(cls(**kw), **overrides)
        batch = config.get(LEGACY_ORIGINAL_BATCH) or _first_batch(config)
        lr = config.get(LEGACY_ORIGINAL_LR) or config.get("lr")
        if not batch or not isinstance(lr, (int, float)):
            raise ValueError("the run config names no ramp policy and no first tier and LR")
        kw = {"original_batch": int(batch), "original_lr": float(lr)}
        try:
            kw["lr_rule"] = rule_for(config.get("optimizer") or "adamw")
        except ValueError:
            pass  # an optimizer with no known rule: the default rule, and the card says so
        if config.get(LEGACY_HYSTERESIS):
            kw["hysteresis_steps"] = int(config[LEGACY_HYSTERESIS])
        if config.get(LEGACY_MIN_ESTIMATES) is not None:
            kw["min_estimates"] = int(config[LEGACY_MIN_ESTIMATES])
        return replace(cls(**kw), **overrides)


def default(knob: str):
    """The policy's default of one knob: a function that takes the knob defaults to this,
    never to a copy of the number."""
    return {f.name: f.default for f in fields(RampPolicy)}[knob]


def _first_batch(config: Mapping) -> int | None:
    try:
        b = int(config["per_device_batch"]) * int(config["accum"])
    except (KeyError, TypeError, ValueError):
        return None
    return b * int(config.get("world_size") or 1) if b > 0 else None
