"""Whether a ramp's LR change reached the optimizer: the LR a loop logs at the steps after an
applied ramp, judged against what its own schedule would have given without the ramp.

Owns `LrCheck` (one ramp's check, fed one logged LR per step), its verdicts and the sentence an
alert says. The monitor feeds it (monitor/ramp_protocol.py); nothing here knows the loop.

The loop's schedule is unknown (warmup, decay, its own get_lr()), so the unramped LR at step
S + j is extrapolated geometrically from the two LRs logged at S − 1 and S (the ramp's step):
lr_S · r^j with r = lr_S / lr_{S−1}. That is exact for a constant LR and exponential decay; for a
linear warmup at step S it is off by about j²/S² in log, for cosine decay by less. Each step's
ratio q = lr / (lr_S · r^j) is judged in log space against a tolerance of TOLERANCE · |log m|
(m: the ramp's multiplier): 'moved' within it of m, 'unmoved' within it of 1, else 'unclear'.
A schedule that moved by itself more than the tolerance in the step before the ramp (an early
warmup) cannot be told apart from the ramp, nor can a multiplier within MIN_CHANGE of 1: then
there is no check (`LrCheck.start` returns None).

Two steps are judged (S + 1, S + 2), so a loop that moves its LR one step late still passes
and one whose LR is rewritten from an unscaled base a step later (a scheduler that was not
scaled) does not: the last decisive verdict wins, 'moved' then 'unmoved' is `UNDONE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TOLERANCE = 1 / 3  # of |log m|: a third each side, so 'moved' and 'unmoved' never touch
MIN_CHANGE = 0.05  # a multiplier within 5% of 1 is no change a schedule's noise cannot fake
STEPS = 2  # steps after the ramp that are judged

REACHED, NOT_REACHED, UNDONE, UNCONFIRMED = "reached", "not reached", "undone", "unconfirmed"
MOVED, UNMOVED, UNCLEAR = "moved", "unmoved", "unclear"
CAUSE = "lr_check"  # the alert's data["cause"]: how the card finds it (dashboard/recommend.py)
# the alert's first words, where the live page groups its banners (store_access.active_alerts)
HEADLINE = "the ramp's LR change did not reach the optimizer"
UNCONFIRMED_HEADLINE = "the ramp's LR change could not be confirmed"


def _log(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return math.log(x) if math.isfinite(x) and x > 0 else None


@dataclass
class LrCheck:
    """One applied ramp's check: at step `step` the loop moved (or should have moved) its LR by
    `multiplier`; `observe` takes the LR logged at each later step until it has an outcome."""

    step: int  # the ramp's step S: the new tier runs from S + 1
    multiplier: float
    lr_at: float  # logged at S
    per_step: float  # r: the schedule's own change from S − 1 to S (1 when S − 1 is unknown)
    ratios: dict[int, float] = field(default_factory=dict)  # step → q
    verdicts: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls, step: int, multiplier: float, lr_at: float, lr_before: float | None = None
    ) -> LrCheck | None:
        """The check of a ramp at `step`, from the LR logged there and (if known) one step
        earlier; None when no check can tell the ramp from the schedule (see the docstring)."""
        log_m, log_at = _log(multiplier), _log(lr_at)
        if log_m is None or log_at is None or abs(log_m) < math.log1p(MIN_CHANGE):
            return None
        log_before = _log(lr_before) if lr_before is not None else log_at
        if log_before is None:  # an LR of 0 just before (a warmup from 0): no schedule to extend
            return None
        per_step = log_at - log_before
        if abs(per_step) > TOLERANCE * abs(log_m):
            return None
        return cls(step, float(multiplier), float(lr_at), math.exp(per_step))

    def verdict(self, step: int, lr) -> str:
        """One step's verdict on the LR logged at `step` (> self.step)."""
        log_lr, log_m = _log(lr), math.log(self.multiplier)
        if log_lr is None:
            return UNCLEAR
        log_q = log_lr - math.log(self.lr_at) - (step - self.step) * math.log(self.per_step)
        self.ratios[step] = math.exp(log_q)
        tol = TOLERANCE * abs(log_m)
        if abs(log_q - log_m) <= tol:
            return MOVED
        if abs(log_q) <= tol:
            return UNMOVED
        return UNCLEAR

    def observe(self, step: int, lr) -> str | None:
        """Feed the LR logged at `step`; the outcome once STEPS steps are judged, else None."""
        if step <= self.step or step in self.ratios:
            return None
        self.verdicts.append(self.verdict(step, lr))
        return self.outcome() if len(self.verdicts) >= STEPS else None

    def outcome(self) -> str | None:
        """From the verdicts so far (None with none): the last decisive one wins; 'moved' then
        'unmoved' is UNDONE; none decisive is UNCONFIRMED."""
        if not self.verdicts:
            return None
        decisive = [v for v in self.verdicts if v != UNCLEAR]
        if not decisive:
            return UNCONFIRMED
        if decisive[-1] == MOVED:
            return REACHED
        return UNDONE if MOVED in decisive else NOT_REACHED

    def ratio_text(self) -> str:
        return ", ".join(f"×{q:.4f} at step {s}" for s, q in sorted(self.ratios.items()))

    def message(self, outcome: str) -> str | None:
        """The alert for an outcome (None for REACHED): what was logged, what it means, the fix."""
        m, seen = f"×{self.multiplier:.4g}", self.ratio_text()
        of = "of what the schedule would give without the ramp"
        if outcome == NOT_REACHED:
            return (
                f"{HEADLINE}: the LR was {seen} {of}, not {m}; the run goes on at the new "
                "batch with the old LR. A loop that sets param_group['lr'] itself (its own "
                "get_lr()) must move its schedule: lr = get_lr(it) * mon.lr_scale, or its "
                "constants times ramp.lr_multiplier"
            )
        if outcome == UNDONE:
            return (
                f"{HEADLINE}: the LR was {seen} {of}: it moved by {m} and was undone, so "
                "something rewrites the LR from an unscaled base (a scheduler not passed to "
                "ramp.scale_lr, or the loop's own schedule: lr = get_lr(it) * mon.lr_scale)"
            )
        if outcome == UNCONFIRMED:
            return (
                f"{UNCONFIRMED_HEADLINE}: the LR was {seen} {of}, neither ×1 nor {m} (did the "
                "schedule change its course right at the ramp?); see the LR chart"
            )
        return None
