"""The judgement of a ramp trial: is a k× larger batch as good, token for token, as the running one?

Owns `TrialPlan` (what a trial runs: the batch B, the factors k, Δ tokens per arm, the LR rule),
`BranchResult` and `TrialVerdict` (what it found), `tolerance_fraction`, `HALF_PROGRESS_MIN`, the
exponential model's two directions (`delta_over_tau`, `half_progress_ratio_at`), the bound of the
control's half-progress ratio (`half_progress_bounds`), `judge`, `arms_left` (the branches still
worth running), `examples_to_judge_delta` (a trial's second stage) and `failed_factor` (the "no"
a retry at the same batch keeps). Pure: the losses come in as arrays; running the arms is the
caller's (monitor/trial_runner.py for a plain torch model and optimizer).

The method is Merrill, Arora, Groeneveld, Hajishirzi 2025, "Critical Batch Size Revisited"
(arXiv 2505.23971) §3.1: from one snapshot at batch B, train the control (k = 1) and each branch
at k·B, with the LR × f(k) (advisor/lr.py: √k for Adam-type, k for SGD), for the same Δ tokens on
the same data; k* is the largest k that is as good as every smaller k, and the critical batch
lies in [k*·B, next k·B). Two things differ from theirs:

The test. They compared smoothed losses within ε = 0.01, "chosen arbitrarily", and named "a
statistical test" as future work. Here every arm is evaluated on the same fixed held-out examples,
so the per-example differences d_i = loss_branch,i − loss_control,i are paired (the examples'
own spread, much larger than d, cancels), and a branch passes when the one-sided upper 95% bound
of mean(d), the paired t bound d̄ + t(0.95, n−1)·s_d/√n, is at most the tolerance. Why the
t bound and not a bootstrap: the eval batch has hundreds of examples, where d̄ is close to normal
(central limit) and the t bound is as accurate as a bootstrap's; it is exact arithmetic on the
stored losses (a verdict can be recomputed, no resampling seed), and the percentile bootstrap
covers less than its level at small n (its spread is too narrow by √((n−1)/n) and it ignores the
t tail). A passing branch is one we are 95% sure is not worse than the tolerance; a noisy eval
makes branches fail, never pass, so the bracket errs low (a ramp it allows is safe).

The tolerance. Not a fixed ε in loss units (0.01 is a lot late in a run and nothing early), but a
fraction of the control's own progress over the trial, P = loss at the snapshot − the control's
loss after Δ: what the trial can tell scales with how much a run learns in Δ tokens. The fraction
is the deficit that a branch exactly at the critical batch would show, from McCandlish et al.
2018 §2.3: examples to a given loss are E = E_min·(1 + b/B_crit), so Δ examples at batch b are
worth Δ/(1 + b/B_crit) tiny-batch examples. The branch's share of the control's progress is
e = (1 + B/B_crit)/(1 + k·B/B_crit), its deficit (1 − e)·P to first order, and at k·B = B_crit
    fraction(k) = (k − 1) / (2k)          (¼ at k = 2, ⅜ at k = 4, 7/16 at k = 8).
So "deficit ≤ fraction(k)·P" is "k·B ≤ B_crit" in that model, and pass/fail brackets the same
B_crit that a constant-batch sweep fits (bench/trial_bench.py checks it on a known problem). The
loss falls ever more slowly, so the true deficit at k·B = B_crit is below the linear (1 − e)·P:
a branch just past B_crit can still pass, which the 95% bound offsets. P ≤ 0 (the control did not
learn over Δ) leaves no tolerance: only a branch surely better than the control passes, and the
summary says the trial could not tell; unless one passed, the trial brackets nothing (a failure
against no tolerance says nothing of B_crit).

Δ too long. The tolerance is the linear limit: it assumes the control's loss falls at a steady
rate over Δ. A control that flattens within Δ (Δ ≫ the examples the run needs to make its next
progress) gives every branch time to catch up, and branches far past B_crit pass. So the control
is also evaluated at Δ/2 (one more eval), and the ratio of its second half's progress to its first
half's, r = P₂/P₁, says how far from linear Δ is. Under a loss that decays like
L(t) = L∞ + a·exp(−t/τ) (t in the control's examples), P₁ = a(1 − q), P₂ = a·q(1 − q) with
q = exp(−Δ/2τ): r = q, so Δ/τ = −2·ln r (r = 1 is the linear limit). A branch covering a share e
of the control's effective examples loses (q^(2e) − q²)/(1 − q²) of P, which is below the
tolerance's 1 − e whenever r < 1. The worst case is ×2: at k·B = 2·B_crit (B = B_crit,
e = (1 + 1)/(1 + 2) = ⅔) its loss, with u = q^(2/3), is u²/(1 + u + u²) of P, and that is at
least the ×2 tolerance ¼ iff u ≥ (1 + √13)/6, i.e.
    r ≥ HALF_PROGRESS_MIN = ((1 + √13)/6)^(3/2) ≈ 0.6725     (Δ ≤ 0.79·τ).
Above it no branch past 2·B_crit passes in the model (at ×4 … ×64 the overshoot is 1.7 … 1.5×): the bracket
stays within 2× of B_crit, the precision a bracket of doubling factors has anyway. (The ⅓ one
might guess is far too loose: there a ×2 branch at any batch sits on its tolerance.)

r's bound. r is a ratio of two means over the same held-out examples: with p1_i = L0_i − Lhalf_i
and p2_i = Lhalf_i − Lend_i per example, r̂ = mean(p2)/mean(p1), and the pairs (p1_i, p2_i) are
independent across examples given the three weights. Its one-sided 95% bounds are Fieller's
(Fieller 1954, "Some problems in interval estimation", JRSS B 16; the one implementation is
advisor/gns_window.py's `fieller_interval`, here with the paired means' (co)variances and
q = t(0.95, n − 1)): all R with (p̄2 − R·p̄1)² ≤ q²·Var(p̄2 − R·p̄1). A ratio R lies outside that
set exactly when the paired t test of d_i = p2_i − R·p1_i rejects mean(d) = 0, so the three
outcomes are one test at R = HALF_PROGRESS_MIN:
    upper bound < HALF_PROGRESS_MIN   Δ too long (`delta_check` "too long"): surely flattened;
    lower bound ≥ HALF_PROGRESS_MIN   Δ fine ("fine"): the branches are judged as above;
    otherwise                         "cannot tell": the eval cannot say which.
A Δ that is in truth too long (r < HALF_PROGRESS_MIN) lets branches past 2·B_crit pass the
linear tolerance, and it reads "fine" only when the lower bound clears the threshold, which for
a true r below it happens at most 5% of the time (the bound's level).

Judged at r's lower bound. "Cannot tell" still bounds r from below, at r_lo. In the exponential
model the share of P a branch at k·B = B_crit loses is, with e = (k + 1)/(2k),
    tolerance_fraction(k, r) = (r^(2e) − r²)/(1 − r²)      (→ (k − 1)/(2k) as r → 1),
and a branch loses less than that exactly when k·B < B_crit, at any r: held to it, pass/fail
brackets B_crit itself, not within 2×. It grows with r, so at r_lo it is the smaller tolerance
that holds for every r the bound allows (×2 at r_lo = 0.66: 0.178 of P, against ¼): a branch that
passes there passes at the true r too (at the level of both bounds). So a trial that cannot tell
whose r̂ is at or above HALF_PROGRESS_MIN (the point says fine, the bound cannot confirm it) and
whose r_lo > 0 judges its branches against that tolerance (`tolerance_ratio`); its failures are
"no"s, and end its bracket, only where they fail the linear tolerance too (`failed_factor`).
Below the threshold Δ is more likely too long, and there the model's one asymptote fails: a
larger batch's lower noise floor lets branches pass however small the tolerance (on
bench/trial_bench.py's least-squares problem, r̂ 0.38 and r_lo 0.09 at Δ 256: ×2 and ×4
passed, [8, 16) against a local B_crit of 1.4). Such a trial, and one with r_lo ≤ 0 or no bound,
brackets nothing and keeps the control. "Too long" brackets nothing: the retry at a shorter Δ
measures more. The eval's noise makes a trial bracket nothing, or bracket low, and high no more
often than the bounds' level (tests/test_advisor_trial_delta_bound.py: 1 in 1,000). Measured on
bench-tiny's kept trials (2,048 held-out examples, 2026-12-06): seed 2's first trial (r̂ 0.76,
r_lo 0.66) passes ×2 (bound 0.0078 against 0.0133) and fails ×4; seed 0's (r̂ 0.66) is not
judged (at r_lo 0.57 it would have failed ×2 by 0.0005). What the bound covers is
which held-out examples were drawn, as the branches' t bound does; not the trajectory's own noise
(one arm's SGD draws shift the loss on every example at once, which no per-example spread sees):
on bench/trial_bench.py's least-squares problem, with 2,048 examples, r moves between Δs more than
its bounds allow (tests/test_trial_known_answer.py's xfail reason has the numbers).
What would tell: the eval batch at which the current spread resolves, the n at which
|d̄|·√n / sd(d) ≥ t(0.95, n − 1) + z(TELL_POWER) at R = HALF_PROGRESS_MIN (and at which p̄1 is
itself significant: r may be negative, so Fieller's set is taken on the whole line, and unless
p̄1 is clearly non-zero it is two rays or everything, bounded neither way), d̄ and sd(d) as
measured (`examples_to_tell`; None when d̄ = 0: r̂ sits on the threshold and no batch would
tell). Without the z term that is the batch at which the measured d̄ is just significant, and a
fresh batch of that size, whose d̄ falls either side of the measured one, tells only half the
time; with z(0.8) = 0.84 it tells 4 times in 5 if d̄ and sd(d) are as measured (80% power, the
usual choice: Cohen 1988, "Statistical Power Analysis for the Behavioral Sciences", §2.4), at
about (1 + 0.84/1.645)² ≈ 2.3× the examples. A runner that can score that many evaluates the
control's three points again on them, in the same trial (`examples_to_judge_delta`,
monitor/trial_runner.py's second stage).
A longer Δ is not derived: it moves r̂ and the spread together. "Too long" names the Δ that
would put r at the threshold, Δ·ln r*/ln r̂ (the exponential model), or Δ/4 when the second half
made no progress. Without the midway eval (older verdicts, a caller that gives none), or when the
first half made no progress on the mean (nothing flattened; the tolerance is then conservative),
Δ is not judged. A snapshot or midway loss given as a mean (no per-example losses) has no spread
to bound r with: "cannot tell", for the same reason.

Each branch is tested on its own at the stated level; k* needs every smaller k to pass, so a
non-monotone pattern (fail at 4, pass at 8) keeps k* at 2 and the bracket [2B, 4B).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from rampwatch.advisor.checks import positive_int, positive_number
from rampwatch.advisor.gns_window import _t_quantile, fieller_interval, significant
from rampwatch.advisor.lr import lr_multiplier, rule_for

__all__ = [
    "TrialPlan",
    "BranchResult",
    "TrialVerdict",
    "tolerance_fraction",
    "HALF_PROGRESS_MIN",
    "TELL_POWER",
    "delta_over_tau",
    "half_progress_ratio_at",
    "half_progress_bounds",
    "DELTA_CHECKS",
    "judge",
    "arms_left",
    "examples_to_judge_delta",
    "discarded_at_most",
]

# the control's second-half over first-half progress below which Δ is too long (docstring)
HALF_PROGRESS_MIN = ((1 + math.sqrt(13)) / 6) ** 1.5
# the chance that the held-out batch a trial names tells, if the spread it measured holds
# (docstring, "What would tell")
TELL_POWER = 0.8
# what the Δ check found (docstring, "r's bound"); only "fine" and "not judged" judge the branches
DELTA_CHECKS = ("fine", "too long", "cannot tell", "not judged")


def discarded_at_most(factors, delta_tokens: int) -> int:
    """A trial's cost before it runs: every arm but the kept one, len(factors) × Δ whichever it
    is, when every arm runs (a verdict's `cost_tokens` counts the arms that ran)."""
    return len(factors) * delta_tokens


def delta_over_tau(ratio: float) -> float:
    """Δ/τ at which the control's half-progress ratio is `ratio` (0 < r < 1) under exponential
    decay: −2·ln r (docstring, "Δ too long"); advisor/trial_delta.py picks the default Δ by it."""
    return -2.0 * math.log(ratio)


def half_progress_ratio_at(x: float) -> float:
    """The other direction: the ratio a control of Δ = x·τ shows, exp(−x/2) (1 at τ = ∞)."""
    return math.exp(-x / 2)


def tolerance_fraction(k: int, ratio: float | None = None) -> float:
    """(k − 1)/(2k): the share of the control's progress a branch at k·B = B_crit loses (above).
    With `ratio`, a control's half-progress ratio r in (0, 1): the share it loses where the loss
    decays exponentially, (r^((k+1)/k) − r²)/(1 − r²), never above the linear one (module
    docstring, "Judged at r's lower bound")."""
    linear = (k - 1) / (2 * k)
    if ratio is None or ratio >= 1:
        return linear
    if ratio <= 0:
        raise ValueError(f"ratio must be a half-progress ratio in (0, 1), got {ratio!r}")
    return min(linear, (ratio ** ((k + 1) / k) - ratio**2) / (1 - ratio**2))


@dataclass(frozen=True)
class TrialPlan:
    """A trial from a snapshot at `batch` examples per step: the control and each k in `ks` run
    `delta_tokens` tokens on the same data, the branches at k·batch with the LR × `lr_factor(k)`.

    `rule` is 'sqrt', 'linear' or 'none' (advisor/lr.py; `TrialPlan.for_optimizer` picks it from
    the optimizer's name). Δ must be a whole number of steps of every branch, so every arm
    sees exactly the same examples.
    """

    batch: int  # examples (sequences) per optimizer step at the snapshot
    ks: tuple[int, ...]  # batch factors of the branches, increasing, each ≥ 2
    delta_tokens: int  # tokens each arm trains for
    rule: str  # LR rule on the branch's batch
    tokens_per_example: int = 1  # sequence length; 1 for a model that is not a language model
    level: float = 0.95  # one-sided level of the bound

    def __post_init__(self):
        positive_int("batch", self.batch)
        positive_int("tokens_per_example", self.tokens_per_example)
        positive_int("delta_tokens", self.delta_tokens)
        ks = tuple(self.ks)
        if not ks or any(positive_int("ks", k) < 2 for k in ks) or list(ks) != sorted(set(ks)):
            raise ValueError(
                f"ks must be increasing batch factors of at least 2, e.g. (2, 4, 8), got {self.ks!r}"
            )
        object.__setattr__(self, "ks", ks)
        object.__setattr__(self, "rule", rule_for(rule=self.rule))
        if not 0.5 < float(self.level) < 1:
            raise ValueError(f"level must be a one-sided level in (0.5, 1), got {self.level!r}")
        for k in ks:
            step = k * self.batch * self.tokens_per_example
            if self.delta_tokens % step:
                raise ValueError(
                    f"delta_tokens ({self.delta_tokens}) must be a multiple of every branch's step "
                    f"(×{k}: {k} × {self.batch} × {self.tokens_per_example} = {step} tokens), "
                    "so every arm trains on exactly the same examples"
                )

    @classmethod
    def for_optimizer(cls, optimizer: str, **fields) -> TrialPlan:
        """The plan with the LR rule of `optimizer` ('AdamW' → sqrt, 'SGD' → linear)."""
        return cls(rule=rule_for(optimizer), **fields)

    def steps(self, k: int = 1) -> int:
        """Optimizer steps of the arm at k·batch (k = 1: the control)."""
        return self.delta_tokens // (k * self.batch * self.tokens_per_example)

    def lr_factor(self, k: int) -> float:
        """The branch's LR relative to the control's: √k, k or 1 by the rule."""
        return lr_multiplier(self.batch, k * self.batch, self.rule)

    @property
    def cost_tokens(self) -> int:
        """Tokens trained and thrown away at most (`discarded_at_most`)."""
        return discarded_at_most(self.ks, self.delta_tokens)


@dataclass(frozen=True)
class BranchResult:
    """One branch against the control on the paired held-out examples."""

    k: int
    batch: int  # k · plan.batch
    lr_factor: float
    mean_diff: float  # mean(branch − control) per example; > 0 is worse
    bound: float  # one-sided upper bound of mean_diff at the plan's level
    tolerance: float  # tolerance_fraction(k[, r's lower bound]) · the control's progress
    passed: bool


@dataclass(frozen=True)
class TrialVerdict:
    """What a trial found; `bracket` is [lower, upper) of the critical batch in examples, or
    None when Δ was too long to tell (`delta_ok` False)."""

    plan: TrialPlan
    examples: int  # held-out examples, paired
    progress: float  # loss at the snapshot − the control's loss after Δ (held-out means)
    branches: tuple[BranchResult, ...]
    k_star: int | None  # largest k passing with every smaller k passing; None: none passed
    bracket: tuple[int | None, int | None] | None  # (None, ks[0]·B) or (k*·B, next k·B or None)
    calibration: float | None  # bracket's lower end / B_simple, when a noise scale was given
    b_simple: float | None
    kept_k: int  # the arm the run continues from: k_star, or 1 (the control)
    cost_tokens: int
    half_progress_ratio: float | None = None  # the control's P₂/P₁; None: no midway eval
    delta_ok: bool = True  # delta_check "fine" or "not judged" (`judged` says what was judged)
    # one-sided bounds of the ratio at the plan's level (an end None: unbounded); None: no bound
    half_progress_bounds: tuple[float | None, float | None] | None = None
    delta_check: str | None = None  # DELTA_CHECKS; None only in a verdict from before the bound
    examples_to_tell: int | None = None  # "cannot tell": held-out examples that would tell
    cap: int | None = None  # a factor that failed in the trial before: no k ≥ cap is kept
    # a second stage: the examples the control was first evaluated on, which could not tell
    first_examples: int | None = None
    # "cannot tell": r's lower bound that the branches' tolerances assume; None: linear ones
    tolerance_ratio: float | None = None

    @property
    def not_run(self) -> tuple[int, ...]:
        """The planned factors whose arms were not run, as they could not change the verdict."""
        ran = {b.k for b in self.branches}
        return tuple(k for k in self.plan.ks if k not in ran)

    def not_run_reason(self, k: int) -> str:
        """Why branch k (one of `not_run`) was not run, in the card's words (`arms_left`)."""
        if self.cap is not None and k >= self.cap:
            return f"nothing from ×{self.cap} up is kept: the trial before failed it"
        failed = _linear_failures(self.branches, self.progress)
        if self.progress <= 0 or not failed:
            return "the control did not improve over Δ, so no branch could be told"
        return (
            f"×{failed[0]} fell behind the control by more than its tolerance, so no larger "
            "branch could change the verdict"
        )

    @property
    def judged(self) -> bool:
        """The branches were judged: Δ fine or not judged, or "cannot tell" at r's lower bound."""
        return self.delta_ok or self.tolerance_ratio is not None

    def to_dict(self) -> dict:
        """JSON-safe: what a trial's end event carries (plan and branches nested, lists)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> TrialVerdict:
        plan = TrialPlan(**{**d["plan"], "ks": tuple(d["plan"]["ks"])})
        bounds = d.get("half_progress_bounds")
        check = d.get("delta_check")
        if check is None:  # a verdict from before the bound: the point estimate decided
            judged = d.get("half_progress_ratio") is not None
            check = ("fine" if judged else "not judged") if d.get("delta_ok", True) else "too long"
        return cls(
            **{
                **d,
                "plan": plan,
                "branches": tuple(BranchResult(**r) for r in d["branches"]),
                "bracket": None if d["bracket"] is None else tuple(d["bracket"]),
                "half_progress_bounds": None if bounds is None else tuple(bounds),
                "delta_check": check,
            }
        )

    @property
    def examples_wanted(self) -> int | None:
        """The larger held-out batch that would tell whether Δ is too long, when this one could
        not (`examples_to_tell`); None when it told, or when no batch would."""
        return _more_examples(self.delta_check, self.examples_to_tell, self.examples)

    @property
    def suggested_delta_tokens(self) -> int | None:
        """The Δ at which the control's half-progress ratio would be HALF_PROGRESS_MIN, under
        exponential decay (Δ/τ = −2·ln r); Δ/4 when its second half made no progress."""
        r = self.half_progress_ratio
        if self.delta_check != "too long" or r is None:
            return None
        if r <= 0:
            return self.plan.delta_tokens // 4
        return round(self.plan.delta_tokens * delta_over_tau(HALF_PROGRESS_MIN) / delta_over_tau(r))

    @property
    def summary(self) -> str:
        """What the trial found, in plain words (the card's and the bench's line)."""
        first = self.first_examples
        stages = (
            f"On {first:,} held-out examples the control could not tell whether Δ was too "
            f"long; it was measured again on {self.examples:,}. "
            if first is not None
            else ""
        )
        return stages + self._found()

    def _found(self) -> str:
        if not self.judged:
            return self._cannot_tell() if self.delta_check == "cannot tell" else self._too_long()
        b = self.plan.batch
        arms = ", ".join(
            [f"×{r.k} {'pass' if r.passed else 'fail'}" for r in self.branches]
            + [f"×{k} not run" for k in self.not_run]
        )
        kept = f"continue at ×{self.k_star} ({self.k_star * b:,})" if self.k_star else f"keep {b:,}"
        if self.bracket is None and self.tolerance_ratio is not None:
            return (
                f"No bracket ({arms}): no branch passed the tolerance at the ratio's lower bound, "
                f"and none failed the linear one; {kept}. {self._at_lower_bound()} Cost: "
                f"{self.cost_tokens:,} tokens of discarded arms."
            )
        if self.bracket is None:  # the control did not learn and no branch was surely better
            return (
                f"The control did not improve over Δ, so the trial could not tell ({arms} "
                f"against no tolerance); {kept}: lengthen Δ. Cost: {self.cost_tokens:,} tokens "
                "of discarded arms."
            )
        parts = [
            f"Critical batch {_in_words(self.bracket, '{:,}'.format)} sequences ({arms}); {kept}.",
            f"Cost: {self.cost_tokens:,} tokens of discarded arms.",
        ]
        if self.cap is not None and self.cap <= self.plan.ks[-1]:
            parts.insert(
                1,
                f"×{self.cap} failed in the trial before at this batch, where a branch could "
                f"only catch up: nothing from ×{self.cap} up is kept.",
            )
        if self.progress <= 0:
            parts.append(
                "The control did not improve over Δ, so the trial could not tell: lengthen Δ."
            )
        if self.tolerance_ratio is not None:
            parts.insert(1, self._at_lower_bound())
        if self.b_simple is not None:
            ratios = tuple(None if x is None else x / self.b_simple for x in self.bracket)
            parts.append(
                f"That is {_in_words(ratios, significant)}× the noise scale "
                f"({significant(self.b_simple)})."
            )
        return " ".join(parts)

    def _too_long(self) -> str:
        bounds = self.half_progress_bounds
        upper = None if bounds is None else bounds[1]
        (r, hi), needed = _beside_threshold(self.half_progress_ratio, upper)
        at_most = "" if hi is None else f", at most {hi}× at {self.plan.level:.0%}"
        return (
            f"Δ too long: the control had made most of its progress by Δ/2 (second half "
            f"{r}× the first{at_most}, {needed}× needed), so a "
            f"branch past the critical batch can catch up; keep {self.plan.batch:,} and shorten "
            f"Δ to ~{self.suggested_delta_tokens:,} tokens "
            f"(from {self.plan.delta_tokens:,}). Cost: {self.cost_tokens:,} tokens of "
            "discarded arms."
        )

    def _at_lower_bound(self) -> str:
        (r, lo), needed = _beside_threshold(self.half_progress_ratio, self.tolerance_ratio)
        k = self.plan.ks[0]
        return (
            f"Whether Δ is too long could not be told (second half {r}× the first half's "
            f"progress, at least {lo}× at {self.plan.level:.0%}; {needed}× needed), so each "
            f"branch was held to what it may lose if the ratio is {lo} (×{k}: "
            f"{tolerance_fraction(k, self.tolerance_ratio):.3f} of the control's progress, "
            f"against {tolerance_fraction(k):.3f}). "
            + (self._what_would_tell() if self.examples_wanted else "")
        ).rstrip()

    def _what_would_tell(self) -> str:
        n = self.examples_to_tell
        if n is None:
            return "It sits on the threshold: no held-out batch would tell; change Δ."
        return (
            f"A held-out batch of ~{n:,} examples (now {self.examples:,}) would tell "
            f"{TELL_POWER:.0%} of the time at this spread: the next trial asks for that "
            "many (the reference trainer's --trial-eval-batch caps it; an own loop's "
            "evaluate() reads the request's eval_examples)."
        )

    def _cannot_tell(self) -> str:
        bounds = self.half_progress_bounds
        lo, hi = (None, None) if bounds is None else bounds
        (r, lo, hi), needed = _beside_threshold(self.half_progress_ratio, lo, hi)
        if bounds is None:
            spread = "with no per-example losses at the snapshot and Δ/2 to bound it"
            tell = "Per-example held-out losses at the snapshot and at Δ/2 would tell."
        else:
            spread = f"95% bounds {lo or '−∞'} to {hi or '∞'}"
            tell = self._what_would_tell()
        return (
            f"Cannot tell whether Δ is too long: the control's second half made {r}× the "
            f"first half's progress ({spread}; {needed}× needed), so no branch "
            f"is judged; keep {self.plan.batch:,}. {tell} Cost: {self.cost_tokens:,} tokens "
            "of discarded arms."
        )


def _beside_threshold(*ratios: float | None) -> tuple[tuple[str | None, ...], str]:
    """The ratios as text, each to 2 decimals or to the first after that where it differs from
    HALF_PROGRESS_MIN (a bound of 0.668 is not "0.67" beside "0.67× needed"), and the threshold
    to the most decimals any of them took. None stays None."""

    def digits(x: float) -> int:
        return next((d for d in (2, 3, 4) if f"{x:.{d}f}" != f"{HALF_PROGRESS_MIN:.{d}f}"), 4)

    places = [None if x is None else digits(x) for x in ratios]
    texts = tuple(None if x is None else f"{x:.{d}f}" for x, d in zip(ratios, places, strict=True))
    widest = max((d for d in places if d is not None), default=2)
    return texts, f"{HALF_PROGRESS_MIN:.{widest}f}"


def _in_words(bracket: tuple, show) -> str:
    """[lower, upper) as 'between A and B', 'at least A' or 'below B'."""
    lower, upper = bracket
    if lower is None:
        return f"below {show(upper)}"
    if upper is None:
        return f"at least {show(lower)}"
    return f"between {show(lower)} and {show(upper)}"


def _losses(name: str, values, n: int | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1 or a.size < 2:
        raise ValueError(
            f"{name} must be one loss per held-out example (a 1-d array of at least 2), "
            f"got shape {a.shape}"
        )
    if n is not None and a.size != n:
        raise ValueError(
            f"{name} has {a.size} losses but the control has {n}: every arm must be evaluated on "
            "the same held-out examples, in the same order"
        )
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds non-finite losses: a diverged arm cannot be judged")
    return a


def _upper_bound(diff: np.ndarray, level: float) -> float:
    """Paired one-sided t bound: mean + t(level, n−1)·sd/√n."""
    n = diff.size
    return float(diff.mean() + _t_quantile(level, n - 1) * diff.std(ddof=1) / math.sqrt(n))


def _branch(plan: TrialPlan, k: int, control: np.ndarray, losses, progress: float, ratio=None):
    diff = _losses(f"branch_losses[{k}]", losses, control.size) - control
    tolerance = float(tolerance_fraction(k, ratio) * max(progress, 0.0))
    bound = _upper_bound(diff, plan.level)
    return BranchResult(
        k=k,
        batch=k * plan.batch,
        lr_factor=plan.lr_factor(k),
        mean_diff=float(diff.mean()),
        bound=bound,
        tolerance=tolerance,
        passed=bound <= tolerance if tolerance > 0 else bound < 0,
    )


def _k_star(branches: Sequence[BranchResult], cap: int | None = None) -> int | None:
    k_star = None
    for b in branches:
        if not b.passed or (cap is not None and b.k >= cap):
            break
        k_star = b.k
    return k_star


def _bracket(
    plan: TrialPlan, k_star: int | None, cap: int | None = None, ends=None
) -> tuple[int | None, int | None] | None:
    """[k*·B, the next k·B) with the cap; `ends`: the factors that may end it (None: any), for
    a trial judged at r's lower bound, whose failures say nothing unless they fail the linear
    tolerance too. None where neither end is known."""
    later = [k for k in plan.ks if k > (k_star or 1) and (ends is None or k in ends)]
    upper = min([*later[:1], *([cap] if cap else [])], default=None)
    if k_star is None and upper is None:
        return None
    return (None if k_star is None else k_star * plan.batch), (
        None if upper is None else upper * plan.batch
    )


def judge(
    plan: TrialPlan,
    snapshot_losses,
    control_losses,
    branch_losses: Mapping[int, Sequence[float]],
    b_simple: float | None = None,
    midway_losses=None,
    cap: int | None = None,
    partial: bool = False,
) -> TrialVerdict:
    """The verdict from per-example held-out losses: at the snapshot (or its mean, a number), of
    the control after Δ, and of each branch k after Δ, all on the same examples in one order;
    midway_losses, the control's at Δ/2 (or their mean), judges whether Δ is too long.
    cap: the factor `failed_factor` found in a trial before this one at the same batch; no
    branch at or past it is kept, and the bracket ends there at most.
    branch_losses may stop short of the plan where the arms left could not change the verdict
    (`arms_left`): they were not run, and cost nothing. partial: the arms so far of a trial
    still running, which may stop short anywhere (its runner asks `arms_left` what to run)."""
    ran = tuple(k for k in plan.ks if k in branch_losses)
    extra = [k for k in branch_losses if k not in plan.ks]
    if extra or ran != plan.ks[: len(ran)]:
        raise ValueError(
            f"branch_losses must hold the planned factors {list(plan.ks)} in order, from the "
            f"first: got {sorted(branch_losses)}"
        )
    verdict = _verdict(plan, snapshot_losses, control_losses, branch_losses, b_simple,
                       midway_losses, cap)  # fmt: skip
    missing = [k for k in plan.ks if k not in ran]
    if missing and not partial and arms_left(verdict):
        raise ValueError(
            f"branch_losses lacks {missing}, whose arms could still change the verdict "
            f"({', '.join(f'×{k}' for k in arms_left(verdict))}): run them, or plan fewer ks"
        )
    return verdict


def arms_left(verdict: TrialVerdict) -> tuple[int, ...]:
    """The planned factors not in `verdict` (judged on the arms run so far, in order) whose arms
    could still change what the trial finds, or () when none could: then the trial ends here.

    A later arm matters only through k*, the bracket's upper end, or the "no" a retry keeps
    (`failed_factor`). None from the cap up: it is never kept, and the bracket and the "no" end
    there at most. Below it, while the chain of passes is intact a pass raises k*; once a branch
    has failed the linear tolerance of a control that learned, k* is final, the bracket ends there
    (the first later factor; at r's lower bound, the first that failed the linear tolerance) and
    so does the "no". A control that did not learn leaves the failures nothing to say. So the
    arms left run while the chain is intact, or while the control learned and no branch has
    failed the linear tolerance; otherwise the verdict is what every arm would give, and the
    trial saves their tokens (Merrill et al.'s k* needs every smaller k to pass, §3.1)."""
    ran = {b.k for b in verdict.branches}
    cap = verdict.cap
    rest = tuple(k for k in verdict.plan.ks if k not in ran and (cap is None or k < cap))
    if not rest:
        return ()
    intact = verdict.judged and (verdict.k_star or 1) == max(ran, default=1)
    no_standing = verdict.progress > 0 and not _linear_failures(verdict.branches, verdict.progress)
    return rest if intact or no_standing else ()


def _verdict(plan, snapshot_losses, control_losses, branch_losses, b_simple, midway_losses, cap):
    """judge() on the branches in branch_losses, a prefix of the plan's."""
    control = _losses("control_losses", control_losses)
    snapshot = _mean_loss("snapshot_losses", snapshot_losses, "at the snapshot")
    ran = tuple(k for k in plan.ks if k in branch_losses)
    if b_simple is not None:
        b_simple = positive_number("b_simple", b_simple, "positive noise scale (examples)")
    progress = snapshot - float(control.mean())
    ratio, bounds, check, to_tell = _delta_evidence(plan, snapshot_losses, midway_losses, control)
    delta_ok = check in ("fine", "not judged")
    at = _tolerance_ratio(check, ratio, bounds)
    branches = tuple(_branch(plan, k, control, branch_losses[k], progress, at) for k in ran)
    judged = delta_ok or at is not None
    k_star = _k_star(branches, cap) if judged else None
    # a control that did not learn leaves no tolerance: a failed branch then says nothing
    told = judged and (progress > 0 or k_star is not None)
    ends = None if at is None else set(_linear_failures(branches, progress))
    bracket = _bracket(plan, k_star, cap, ends) if told else None
    calibration = bracket[0] / b_simple if b_simple is not None and bracket and bracket[0] else None
    return TrialVerdict(
        plan=plan,
        examples=control.size,
        progress=progress,
        branches=branches,
        k_star=k_star,
        bracket=bracket,
        calibration=calibration,
        b_simple=b_simple,
        kept_k=k_star or 1,
        cost_tokens=len(ran) * plan.delta_tokens,
        half_progress_ratio=ratio,
        delta_ok=delta_ok,
        half_progress_bounds=bounds,
        delta_check=check,
        examples_to_tell=to_tell,
        cap=cap,
        tolerance_ratio=at,
    )


def _tolerance_ratio(check: str, ratio: float | None, bounds) -> float | None:
    """r's lower bound, when the Δ check cannot tell, r̂ is at or above the threshold and that
    bound is positive: the branches are then held to the tolerance that holds there (module
    docstring, "Judged at r's lower bound")."""
    lower = None if bounds is None else bounds[0]
    if check != "cannot tell" or ratio is None or ratio < HALF_PROGRESS_MIN:
        return None
    return float(lower) if lower is not None and lower > 0 else None


def _delta_evidence(plan: TrialPlan, snapshot_losses, midway_losses, control: np.ndarray):
    """The Δ check from the control's three evaluations: (half-progress ratio, its bounds, the
    check, examples_to_tell), each None where it does not apply (module docstring)."""
    if midway_losses is None:
        return None, None, "not judged", None
    snapshot = _mean_loss("snapshot_losses", snapshot_losses, "at the snapshot")
    midway = _mean_loss("midway_losses", midway_losses, "of the control at Δ/2")
    ratio = _half_progress_ratio(snapshot, midway, float(control.mean()))
    if ratio is None:
        return None, None, "not judged", None
    bounds = to_tell = None
    pairs = _progress_pairs(snapshot_losses, midway_losses, control)
    if pairs is not None:
        lo, hi = half_progress_bounds(*pairs, plan.level)
        # the point lies inside its own Fieller set; guard rounding
        bounds = (None if lo is None else min(lo, ratio), None if hi is None else max(hi, ratio))
    check = _delta_check(bounds)
    if check == "cannot tell" and pairs is not None:
        to_tell = _examples_to_tell(*pairs, plan.level)
    return ratio, bounds, check, to_tell


def examples_to_judge_delta(plan: TrialPlan, snapshot_losses, midway_losses, control_losses):
    """The held-out batch that would tell whether Δ is too long, when the control's three
    evaluations (per example, on the same examples) cannot: their `examples_to_tell`; None when
    they tell, or when no batch would. A trial's second stage scores that many before the
    branches run (monitor/trial_runner.py)."""
    control = _losses("control_losses", control_losses)
    _, _, check, to_tell = _delta_evidence(plan, snapshot_losses, midway_losses, control)
    return _more_examples(check, to_tell, control.size)


def _more_examples(check: str | None, to_tell: int | None, examples: int) -> int | None:
    """`to_tell` when a check that could not tell names a batch larger than the one it had."""
    return to_tell if check == "cannot tell" and (to_tell or 0) > examples else None


def failed_factor(verdict: TrialVerdict) -> int | None:
    """The smallest factor that failed in a trial whose control made progress (its own cap
    included), or None: a "no" that a later trial at the same batch keeps. A Δ judged too long,
    or one that cannot tell whether it is, lets a branch catch up with the control, never fall
    behind (module docstring, "Δ too long"), so a failure there stands when a shorter Δ retries;
    a control that made no progress leaves no tolerance, and its failures say nothing."""
    failed = _linear_failures(verdict.branches, verdict.progress) if verdict.progress > 0 else []
    return min([*failed, *([verdict.cap] if verdict.cap else [])], default=None)


def _linear_failures(branches: Sequence[BranchResult], progress: float) -> list[int]:
    """The factors whose bound is above the linear tolerance: a branch held to less (at r's
    lower bound) may have failed only that, which says nothing of B_crit."""
    return [r.k for r in branches if r.bound > tolerance_fraction(r.k) * max(progress, 0.0)]


def _mean_loss(name: str, values, when: str) -> float:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim > 1 or not np.all(np.isfinite(a)) or a.size == 0:
        raise ValueError(
            f"{name} must be the finite held-out loss {when} (per example or their mean)"
        )
    return float(a.mean())


def _half_progress_ratio(snapshot: float, midway: float, end: float) -> float | None:
    """P₂/P₁ of the control; None when its first half made no progress (nothing to flatten)."""
    first, second = snapshot - midway, midway - end
    return second / first if first > 0 else None


def _progress_pairs(snapshot, midway, control: np.ndarray):
    """(p1_i, p2_i) per example, or None when the snapshot or midway loss is only a mean."""
    s, m = (np.asarray(x, dtype=np.float64) for x in (snapshot, midway))
    if s.ndim != 1 or m.ndim != 1:
        return None
    s = _losses("snapshot_losses", s, control.size)
    m = _losses("midway_losses", m, control.size)
    return s - m, m - control


def half_progress_bounds(p1, p2, level: float = 0.95) -> tuple[float | None, float | None]:
    """One-sided `level` bounds (lower, upper; None: unbounded) of mean(p2)/mean(p1) from
    paired per-example progress: Fieller's set at q = t(level, n − 1) (module docstring, "r's
    bound") on the whole line, as r may be negative; unbounded both ways unless p̄1 is clearly
    non-zero (then the set is two rays or everything)."""
    p1, p2 = np.asarray(p1, dtype=np.float64), np.asarray(p2, dtype=np.float64)
    n = p1.size
    c = np.cov(p1, p2)
    q = _t_quantile(level, n - 1)
    return fieller_interval(
        float(p1.mean()), float(p2.mean()), c[0, 0] / n, c[1, 1] / n, c[0, 1] / n, q, True
    )


def _delta_check(bounds) -> str:
    """ "fine" / "too long" / "cannot tell" from r's bounds (None: no spread to bound it)."""
    if bounds is None:
        return "cannot tell"
    lower, upper = bounds
    if upper is not None and upper < HALF_PROGRESS_MIN:
        return "too long"
    return "fine" if lower is not None and lower >= HALF_PROGRESS_MIN else "cannot tell"


def _examples_to_tell(p1: np.ndarray, p2: np.ndarray, level: float) -> int | None:
    """The held-out batch at which the paired t test of d = p2 − r*·p1 (r* = HALF_PROGRESS_MIN)
    rejects at `level` with chance TELL_POWER if d̄ and sd(d) are as measured, and p̄1 > 0 is
    significant too (so Fieller's set is bounded): module docstring, "r's bound". Power ½ is
    the batch at which the measured mean itself is just significant."""
    need, z = 2, NormalDist().inv_cdf(TELL_POWER)
    for x in (p2 - HALF_PROGRESS_MIN * p1, p1):
        mean, sd = abs(float(x.mean())), float(x.std(ddof=1))
        if mean == 0:
            return None
        ratio = sd / mean  # n ≥ ((t(level, n − 1) + z)·sd/mean)²: from the normal quantile's n up
        n = max(2, math.ceil(((NormalDist().inv_cdf(level) + z) * ratio) ** 2))
        while n < ((_t_quantile(level, n - 1) + z) * ratio) ** 2:  # t > z: a few steps at most
            n += 1
        need = max(need, n)
    return need
