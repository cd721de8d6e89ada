"""The advice: the one place a ramp is decided, for every caller.

Owns `RunningTier` (the run as it is now: its tier, sequence length and device capacity),
`memory_evidence` (memory rows → what is known of memory: measured peaks, the newest plan,
per-device batches that ran out of memory), `advise` (policy + noise-scale estimates + memory
evidence + the latest trial's calibration + the running tier → one `Advice`: the decision, what
it rests on, the tiers with their LR and effect, notes), `TrialEvidence` (what a finished trial
says of the noise scale), `Advice.refusal` (why a tier cannot run) and `Advice.advice_for` (the
tier of any one factor, chosen as the offered ones are: the schedule's ramps and a hand plan's
steps). The monitor's auto mode and its check of an
approved command (monitor/ramp_protocol.py) and the dashboard's card (dashboard/recommend.py) all call
these, so they cannot disagree: given the same rows, the same advice.

Memory rows are plain mappings, the store's `memory_plan` rows or what the monitor wrote:
per_device_batch, and any of variant, predicted_bytes, measured_bytes, feasible, step, error.

Trial evidence. A ramp trial (advisor/trial.py) measures the critical batch directly, as Merrill
et al. 2025 §3.1 do: its bracket's lower end B*_lower is a batch the run was shown to take, and
c = B*_lower / B_simple (TrialVerdict.calibration) is what the noise scale underestimated it by
here — they found B_simple "cannot be used reliably as a proxy", low by orders of magnitude on
OLMo. Between trials the decision reads the noise-scale trend translated by c, c · B_simple as the
critical batch: the trend still says how fast the critical batch grows, the trial says where it
is. The ratio drifts as training goes on (their 1B and 7B trends differ), so only the latest
finished trial counts, and the Advice names it and its age ("noise scale × 3.1 from trial 7 at
step 400, 120 steps ago"). A trial that passed no branch has no c: the noise scale alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from rampwatch.advisor.lr import noise_scale_warning
from rampwatch.advisor.memory import MemoryModel, fit_memory_model, format_gb, usable_bytes
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.ramp_point import Effect, Recommendation, predicted_effect
from rampwatch.advisor.tiers import Tier, TierOption, accumulation_tiers, candidate_tiers

__all__ = [
    "Advice",
    "MemoryEvidence",
    "RunningTier",
    "TierAdvice",
    "TrialEvidence",
    "advise",
    "memory_evidence",
]


@dataclass(frozen=True)
class RunningTier:
    """The run as it is now: the tier it runs (the monitor replaces it at every set_tier), its
    sequence length and its device's capacity in bytes (None where not known: the card)."""

    tier: Tier
    seq_len: int | None = None
    capacity_bytes: float | None = None

    @property
    def batch(self) -> int:
        return self.tier.batch

    def describe(self) -> str:
        return self.tier.describe(self.seq_len)


# ------------------------------------------------------------------------------ memory evidence


@dataclass(frozen=True)
class MemoryEvidence:
    """What is known of memory, by per-device batch."""

    measured: dict[int, int]  # the largest measured peak (never one that ran out of memory)
    planned: dict[int, int]  # the newest plan's prediction for the running variant
    infeasible: frozenset[int]  # ran out of memory in this run

    def model(self) -> tuple[MemoryModel | None, str]:
        """The fitted line (advisor/memory.py) and what it rests on; None and why when none."""
        try:
            m = fit_memory_model(self.measured, self.planned or None)
        except ValueError as e:
            return None, f"no memory model yet: {e}"
        return m, f"memory model: {m.source}"


def _batch_of(row: Mapping) -> int | None:
    try:
        f = float(row.get("per_device_batch"))
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) and f > 0 and f == int(f) else None


def _positive(v) -> bool:
    return v is not None and v > 0


def memory_evidence(
    rows: Iterable[Mapping], variant: str, infeasible: Iterable[int] = ()
) -> MemoryEvidence:
    """The memory evidence of a run from its memory rows (oldest first).

    infeasible: per-device batches known to have run out of memory besides the rows' own
    `feasible: False` (the card: OOM events; the monitor: its checkpoint's set). A plan is the
    rows written at one step with a prediction; only the newest plan counts, whole: an older
    plan may have been made at another accumulation or precision, and its points would bend the
    line. Rows of another variant (the other loss head) are not this run's memory."""
    rows = [(b, r) for r in rows if (b := _batch_of(r)) is not None]
    bad = frozenset({*infeasible, *(b for b, r in rows if r.get("feasible") is False)})
    usable = [(b, r) for b, r in rows if r.get("feasible") is not False]
    measured: dict[int, int] = {}
    for b, r in usable:
        if (
            b not in bad
            and r.get("variant", variant) == variant
            and _positive(mb := r.get("measured_bytes"))
        ):
            measured[b] = max(measured.get(b, 0), int(mb))
    plan = [(b, r) for b, r in usable if _positive(r.get("predicted_bytes")) and not r.get("error")]
    newest = max((_step(r) for _, r in plan), default=None)
    planned = {
        b: int(r["predicted_bytes"])
        for b, r in plan
        if _step(r) == newest and r.get("variant", variant) == variant
    }
    return MemoryEvidence(measured, planned, bad)


def _step(row: Mapping) -> int:
    return -1 if row.get("step") is None else int(row["step"])


# ------------------------------------------------------------------------------ trial evidence


@dataclass(frozen=True)
class TrialEvidence:
    """What the latest finished trial says of the noise scale: its id, snapshot step and
    coefficient c = bracket's lower end / B_simple (None: no branch passed, or no noise scale)."""

    trial_id: int  # the command id; negative for a trial the loop started itself
    step: int  # the snapshot step S
    coefficient: float | None
    passed: bool  # a branch passed: the run continued from it (a ramp)

    @classmethod
    def of(cls, trial_id: int, step: int, verdict) -> TrialEvidence:
        """From an advisor.trial.TrialVerdict: the monitor's own, or the card's from the store."""
        c = verdict.calibration
        ok = c is not None and math.isfinite(c) and c > 0
        return cls(int(trial_id), int(step), float(c) if ok else None, verdict.k_star is not None)

    @property
    def name(self) -> str:
        return f"trial {self.trial_id}" if self.trial_id > 0 else f"auto trial {-self.trial_id}"

    def describe(self, now_step: int | None) -> str:
        """What a decision on it rests on, with its age in steps at now_step."""
        if self.coefficient is None:
            return f"noise scale only ({self.name} at step {self.step:,} gave no calibration)"
        age = ""
        if now_step is not None and now_step > self.step:
            age = f", {now_step - self.step:,} steps ago"
        return f"noise scale × {self.coefficient:.3g} from {self.name} at step {self.step:,}{age}"

    def to_dict(self) -> dict:
        return asdict(self)


NOISE_ONLY = "noise scale only"


def _evidence_words(policy: RampPolicy, trial: TrialEvidence | None, now: int | None) -> str:
    if trial is not None:
        return trial.describe(now)
    if policy.gate == "trial":
        return f"{NOISE_ONLY}, read as about half the critical batch until a trial measures it"
    return NOISE_ONLY


def _reads_critical(c: float | None) -> bool:
    """The values are read as the critical batch itself (RampPolicy.decide's `critical`): once a
    trial calibrated them. Before that, under either gate, B_simple is read by the policy's band
    (about half the critical batch): the trial gate's first trial comes when the noise gate
    would ramp, and the trial is the check."""
    return c is not None


def _translated(values, c: float | None):
    """The series × c (None stays None): the noise-scale trend as the critical batch."""
    if values is None or c is None:
        return values
    return [None if v is None else v * c for v in values]


# ------------------------------------------------------------------------------------- advice


@dataclass(frozen=True)
class TierAdvice:
    """A candidate tier and what moving to it means."""

    option: TierOption
    new_base_lr: float | None  # by the policy's rule from the original LR (None: not known)
    lr_warning: str | None
    effect: Effect | None

    @property
    def fits(self) -> bool:
        return self.option.fits


@dataclass(frozen=True)
class Advice:
    policy: RampPolicy
    current: RunningTier
    decision: Recommendation
    tiers: list[TierAdvice]  # the policy's offered factors, then its auto factor if not among them
    memory: MemoryEvidence
    memory_model: MemoryModel | None
    memory_note: str
    usable_bytes: float | None
    notes: list[str] = field(default_factory=list)  # what the advice could not judge, and why
    evidence: str = NOISE_ONLY  # what the decision rests on, in words (the card's line)
    trial: TrialEvidence | None = None  # the latest finished trial, when there is one
    knows_lr: bool = True  # the run recorded its original LR (else no new base LR)

    @property
    def suggested(self) -> TierAdvice | None:
        """The tier of the policy's ramp (×factor): what auto applies and the card offers first."""
        return next((t for t in self.tiers if t.option.factor == self.policy.factor), None)

    @property
    def calibration(self) -> float | None:
        """c of the latest trial (critical batch ≈ c × B_simple); None: the noise scale alone."""
        return self.trial.coefficient if self.trial is not None else None

    @property
    def critical(self) -> bool:
        """The decision reads the (calibrated) noise scale as the critical batch."""
        return _reads_critical(self.calibration)

    def advice_for(self, factor: int) -> TierAdvice:
        """×factor of the running batch as advise() advises it: its own tier when it offered
        that factor, else the same choice made for this factor alone."""
        mine = next((t for t in self.tiers if t.option.factor == factor), None)
        if mine is not None:
            return mine
        [o] = _options(
            self.policy, self.current, self.memory.infeasible, self.memory_model, (factor,)
        )
        return _tier_advice(self.policy, self.current, o, self.decision, self.knows_lr)

    def option_for(self, factor: int) -> TierOption:
        """The tier advise() chooses for ×factor of the running batch."""
        return self.advice_for(factor).option

    def refusal(self, tier: Tier) -> str | None:
        """Why this tier (per-device batch × accumulation; the world is the run's) cannot run
        here, now; None when it can."""
        b, cur = tier.per_device_batch, self.current
        if tier.to_payload() == cur.tier.to_payload():
            return f"the run already uses {b} x {tier.accum}"
        if b in self.memory.infeasible:
            return f"per-device batch {b} ran out of memory earlier in this run"
        if b <= cur.tier.per_device_batch or b in self.memory.measured:
            return None
        if self.memory_model is None or cur.capacity_bytes is None:
            return (
                f"per-device batch {b} is larger than any measured and no memory plan "
                "is in yet to predict it (the reference trainer's comes a few steps into the "
                "run; another loop passes one to Monitor.add_memory_plan); a larger "
                "accumulation needs none"
            )
        capacity, margin = cur.capacity_bytes, self.policy.margin
        need = self.memory_model.predict(b)
        if need > self.usable_bytes:
            return (
                f"per-device batch {b} needs about {format_gb(need)} > "
                f"{format_gb(self.usable_bytes)} usable ({format_gb(capacity)} capacity, "
                f"{margin:.0%} margin)"
            )
        return None


def advise(
    policy: RampPolicy,
    current: RunningTier,
    gns_steps: Sequence[int],
    gns_values: Sequence[float | None],
    gns_lower: Sequence[float | None] | None,
    memory: MemoryEvidence,
    since_step: int | None,
    knows_lr: bool = True,
    trial: TrialEvidence | None = None,
) -> Advice:
    """The ramp decision and its tiers for a run at `current`.

    gns_*: the smoothed noise scale's steps with an estimate, its point (None: no point) and its
    one-sided 95% lower bound (advisor.gns_window); since_step: the last ramp (the hysteresis
    restarts there); knows_lr False: the run recorded no original LR, so no new base LR; trial:
    the latest finished trial (module docstring: the decision reads c · B_simple as the critical
    batch). Uncalibrated, the trial gate reads the noise scale as the noise gate does (about half
    the critical batch, RampPolicy's band): the trial that follows is the check."""
    c = trial.coefficient if trial is not None else None
    decision = policy.decide(
        gns_steps,
        _translated(gns_values, c),
        _translated(gns_lower, c),
        current.batch,
        since_step,
        critical=_reads_critical(c),
        subject="The noise scale" if c is None else "The calibrated noise scale",
    )
    now = int(max(gns_steps)) if len(gns_steps) else None
    model, memory_note = memory.model()
    notes = []
    usable = None
    if current.capacity_bytes is None:
        notes.append(
            "the run's device capacity is unknown (no capacity_bytes, no mem_capacity): "
            "only accumulation-only ramps can be judged"
        )
    else:
        usable = usable_bytes(current.capacity_bytes, policy.margin)
    tiers = [
        _tier_advice(policy, current, o, decision, knows_lr)
        for o in _options(policy, current, memory.infeasible, model, _advised_factors(policy))
    ]
    return Advice(
        policy,
        current,
        decision,
        tiers,
        memory,
        model,
        memory_note,
        usable,
        notes,
        _evidence_words(policy, trial, now),
        trial,
        knows_lr,
    )


def _tier_advice(
    policy: RampPolicy, current: RunningTier, o: TierOption, decision: Recommendation, knows_lr
) -> TierAdvice:
    """A candidate tier with its new base LR, LR note and predicted effect."""
    b_noise = decision.evidence.noise_scale
    band_top = policy.band_cost()["batch_high"]  # the LR note: only for a tier past the band
    return TierAdvice(
        o,
        policy.new_base_lr(o.tier.batch) if knows_lr else None,
        noise_scale_warning(o.tier.batch, b_noise, band_top) if b_noise else None,
        predicted_effect(current.batch, o.tier.batch, b_noise) if b_noise and b_noise > 0 else None,
    )


def _advised_factors(policy: RampPolicy) -> tuple[int, ...]:
    """The offered factors, then the auto ramp's if it is not among them."""
    factors = tuple(policy.offered_factors)
    return factors if policy.factor in factors else (*factors, policy.factor)


def _options(
    policy: RampPolicy, cur: RunningTier, infeasible, model: MemoryModel | None, factors
) -> list[TierOption]:
    seq, t = cur.seq_len or 1, cur.tier
    if model is not None and cur.capacity_bytes:
        return candidate_tiers(
            t.per_device_batch,
            t.accum,
            t.world_size,
            seq,
            model,
            cur.capacity_bytes,
            policy.margin,
            factors,
            infeasible=infeasible,
            rule=policy.lr_rule,
            keep_noise_scale=policy.keep_noise_scale,
        )
    return accumulation_tiers(
        t.per_device_batch, t.accum, t.world_size, seq, factors, infeasible, policy.lr_rule
    )
