"""The default Δ of a ramp trial from the run's own loss curve: how long the control can train
before its loss flattens too much for the trial to tell (advisor/trial.py, "Δ too long").

Owns `LossHistory` (the per-step training loss against tokens seen, bounded, in a resume's state),
`TimeScale` and `loss_time_scale` (the curve's time scale at its newest point), `DeltaChoice`
and `choose_delta` (Δ from that time scale, within the loop's bounds). Pure.

The time scale. The trial judges Δ by the control's half-progress ratio r = P₂/P₁ (the progress
of its second half over its first), and under exponential decay r = exp(−Δ/2τ) (advisor/trial.py:
`delta_over_tau`). Progress is the integral of the slope, so the τ that matters is the e-folding
time of the slope, τ = −L′/L″, and for the exponential it is also the loss's own. Training curves
are not exponential: over steps (tokens, at one batch) they follow a power law,
L = L∞ + A·t^−α (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §5.2, L(S)), whose
slope falls as t^−β with β = α + 1, so τ(t) = t/β grows as the run goes on. The fit here is of
that slope family, |dL/dt| ∝ t^−β, over the history's last three quarters (the first quarter
holds the warmup and the first transient): L = c + a·g_β(t/t_end) with g_β(x) = (x^(1−β) − 1)/
(1 − β) (ln x at β = 1: a log curve; β = 0: a straight line, τ = ∞), β on a grid, (c, a) by
least squares at each, and τ = t_end/β at the newest point. The exponential itself,
L = c + a·exp(−t/τ), is fitted beside it (τ on a grid), since over the same window a power law
reads an exponential's bend as about twice as slow. A few hundred noisy losses pin the shape down
only roughly, so τ is not the best fit's but a one-sided 95% lower bound: the shortest τ among
the shapes of either family whose residual sum of squares is within (1 + PROFILE_F/(n − 3)) of
the best (the profile likelihood's set, Venzon & Moolgavkar 1988). Since a power law's τ grows
along Δ, r is then above exp(−Δ/2τ) on it too: the estimate errs short. A fit that does not
explain the loss's fall better than a flat line (F ≥ F_MIN on 2 and n − 3 degrees of freedom,
about p < 0.001 at n ≥ 30), a loss that is not falling, or fewer than MIN_POINTS losses in the
window give no time scale, and the loop's default Δ holds.

The choice. Δ = τ·delta_over_tau(TARGET_HALF_PROGRESS): the Δ at which the expected ratio is 0.8,
where the trial needs HALF_PROGRESS_MIN ≈ 0.6725 (Δ = 0.45·τ against 0.79·τ); the margin is for
the ratio the trial measures: its 95% lower bound must clear 0.6725 for the branches to be judged
(advisor/trial.py, "r's bound"), and one arm's trajectory noise moves it too. Δ is then
bounded: at least `floor` (a few steps of the largest branch, so that each arm makes progress the
held-out evaluation can resolve) and at most `ceiling` (the loop's budget rule). A shorter Δ is
no free gain: the control's progress over it, which the tolerance and the ratio are fractions
of, shrinks towards the held-out loss's step-to-step noise (bench/trial_delta_bench.py measures
how often a trial is judged with each rule).

The retry. A trial whose Δ check judged nothing (too long, or cannot tell) measured the control's
own ratio r̂ over Δ, and so its time scale, τ̂ = Δ/delta_over_tau(r̂): `retry_choice` aims again
at TARGET_HALF_PROGRESS from it, Δ·ln(0.8)/ln r̂ (shorter when r̂ < 0.8). Aiming at
HALF_PROGRESS_MIN instead (the verdict's `suggested_delta_tokens`) would put the retry's ratio on
the threshold, where its bound straddles it about half the time. r̂ ≤ 0 (no progress in the
second half): Δ/4. r̂ ≥ 0.8: the length did not hide the answer, the eval's noise did: the same Δ.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from rampwatch.advisor.trial import HALF_PROGRESS_MIN, delta_over_tau, half_progress_ratio_at

__all__ = [
    "LossHistory",
    "TimeScale",
    "loss_time_scale",
    "DeltaChoice",
    "choose_delta",
    "TARGET_HALF_PROGRESS",
    "retry_choice",
    "whole_units",
]

TARGET_HALF_PROGRESS = 0.8  # the default Δ's expected ratio (module docstring)
MIN_POINTS = 32  # losses in the fitted window (the history's last three quarters)
F_MIN = 9.0  # the fit against a flat line: about p < 0.001 on (2, ≥ 30) degrees of freedom
PROFILE_F = 2.71  # χ²₁ at 0.90: the profile set of a one-sided 95% lower bound on τ
FIT_FROM = 0.25  # the window: tokens ≥ this share of the newest point's
# the shapes fitted: the slope's exponent β (0: a straight line) up to a very fast bend, and the
# exponential's τ as a share of the newest point's tokens
BETAS = np.concatenate([[0.0], np.geomspace(0.05, 20.0, 121)])
EXP_TAUS = np.geomspace(0.01, 10.0, 121)
HISTORY_POINTS = 1024  # LossHistory keeps at most this many; past it, every other one


class LossHistory:
    """The run's (tokens seen, training loss) per step, oldest first. Past HISTORY_POINTS it
    drops every other point, so it spans the whole run at a coarser step (the fit's window is a
    share of the run, not a number of steps) and its size is bounded."""

    def __init__(self, tokens=(), losses=(), stride: int = 1):
        self.tokens = [int(t) for t in tokens]
        self.losses = [float(x) for x in losses]
        self.stride = int(stride)  # keep one step in `stride`
        self._skipped = 0

    def add(self, tokens: int, loss: float) -> None:
        if not math.isfinite(loss):  # a non-finite step is an alert of its own, not a point
            return
        if self.tokens and tokens <= self.tokens[-1]:  # a resume from an earlier step
            keep = np.searchsorted(self.tokens, tokens)
            del self.tokens[keep:], self.losses[keep:]
        self._skipped += 1
        if self._skipped < self.stride:
            return
        self._skipped = 0
        self.tokens.append(int(tokens))
        self.losses.append(float(loss))
        if len(self.tokens) > HISTORY_POINTS:
            del self.tokens[-2::-2], self.losses[-2::-2]  # keep the newest, drop every other
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "losses": self.losses, "stride": self.stride}

    @classmethod
    def from_dict(cls, d) -> LossHistory:
        return cls(d.get("tokens", ()), d.get("losses", ()), d.get("stride", 1))


@dataclass(frozen=True)
class TimeScale:
    """The loss curve's slope e-folding time at its newest point, from the fit above."""

    tau_tokens: float  # math.inf: a straight line over the window (no bend seen)
    at_tokens: int  # the newest point's tokens seen
    points: int  # losses in the window
    from_tokens: int  # the window's first point


def _shapes(t_end: float):
    """(τ at t_end, basis g(x) increasing in x = t/t_end) of every candidate curve's shape."""
    for beta in BETAS:  # the slope's power law: g′ = x^−β
        tau = math.inf if beta == 0 else t_end / beta
        if abs(beta - 1) < 1e-12:
            yield tau, np.log
        else:
            yield tau, lambda x, b=beta: (x ** (1 - b) - 1) / (1 - b)
    for s in EXP_TAUS:  # the exponential: g = −exp(−(x − 1)/s), τ = s·t_end
        yield s * t_end, lambda x, s=s: -np.exp(-(x - 1) / s)


def _fit(t: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """(the shortest τ at the newest point the losses cannot tell from the best fit's, the best
    rss) over the decreasing shapes, or None."""
    fits = []
    yc = y - y.mean()
    for tau, g in _shapes(float(t[-1])):
        gc = g(t / t[-1])
        gc = gc - gc.mean()
        ss = float(gc @ gc)
        if not ss > 0:
            continue
        a = float(gc @ yc) / ss
        if a >= 0:  # the loss would be rising or flat
            continue
        fits.append((tau, float(((yc - a * gc) ** 2).sum())))
    if not fits:
        return None
    best = min(rss for _, rss in fits)
    within = best * (1 + PROFILE_F / (t.size - 3))
    return min(tau for tau, rss in fits if rss <= within), best


def loss_time_scale(tokens, losses) -> TimeScale | str:
    """The time scale at the newest point, or why there is none (one line)."""
    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if t.size == 0:
        return "no training loss logged yet"
    window = t >= FIT_FROM * t[-1]
    t, y = t[window], y[window]
    if t.size < MIN_POINTS:
        return (
            f"{t.size} losses in the window of the run's last three quarters, {MIN_POINTS} needed"
        )
    best = _fit(t, y)
    flat = float(((y - y.mean()) ** 2).sum())
    n = t.size
    if best is None or best[1] <= 0 or (flat - best[1]) / 2 / (best[1] / (n - 3)) < F_MIN:
        return f"the training loss did not fall measurably over its last {n} points"
    return TimeScale(
        tau_tokens=best[0],
        at_tokens=int(t[-1]),
        points=int(n),
        from_tokens=int(t[0]),
    )


@dataclass(frozen=True)
class DeltaChoice:
    """A trial's Δ (before it is rounded to whole steps of every arm) and what it rests on."""

    tokens: int
    basis: str  # "loss curve" | "default" (no time scale: the loop's rule)
    note: str  # one sentence for the trial_start event
    tau_tokens: float | None = None
    expected_ratio: float | None = None  # of the control at `tokens`, by the exponential model

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["tau_tokens"] is not None and not math.isfinite(d["tau_tokens"]):
            d["tau_tokens"] = None  # JSON has no infinity: None with basis "loss curve"
        return d


def whole_units(tokens: float, unit: int) -> int:
    """tokens rounded up to a whole number of `unit` tokens (a unit: one step of every arm, so
    each arm of a trial runs whole steps)."""
    return -(-int(tokens) // unit) * unit


def retry_choice(
    delta: int, ratio: float | None, floor: int, unit: int, why: str = ""
) -> DeltaChoice:
    """Δ to try again at after a trial of Δ that judged nothing with the control's half-progress
    ratio `ratio` (module docstring, "The retry"), at least floor, rounded up to whole units.
    why: the sentence's opening (which trial, what it found)."""
    tau = None
    if ratio is None or ratio >= TARGET_HALF_PROGRESS:
        want, how = delta, "the same Δ"
    elif ratio <= 0:
        want, how = delta / 4, "Δ/4, as its second half made no progress"
    else:
        tau = delta / delta_over_tau(ratio)
        want = tau * delta_over_tau(TARGET_HALF_PROGRESS)
    tokens = whole_units(max(floor, want), unit)
    expected = None if tau is None else half_progress_ratio_at(tokens / tau)
    if tau is not None:
        how = f"its own τ ≈ {tau:,.0f} tokens expects a ratio of {expected:.2f} there"
    return DeltaChoice(
        tokens, "retry", f"{why}once more at Δ {tokens:,} tokens ({how})", tau, expected
    )


def choose_delta(tokens, losses, floor: int, ceiling: int, unit: int = 1) -> DeltaChoice:
    """Δ from the loss curve's time scale (module docstring), within [floor, ceiling] and rounded
    up to a whole number of `unit` tokens (whole steps of every arm); the ceiling (the loop's
    default) where there is no time scale."""
    if not 0 < floor <= ceiling or unit <= 0:
        raise ValueError(f"need 0 < floor <= ceiling and unit > 0, got {floor}, {ceiling}, {unit}")
    scale = loss_time_scale(tokens, losses)
    if isinstance(scale, str):
        return DeltaChoice(ceiling, "default", f"The default Δ, as no loss time scale: {scale}.")
    want = scale.tau_tokens * delta_over_tau(TARGET_HALF_PROGRESS)
    delta = whole_units(min(ceiling, max(floor, want)), unit)
    ratio = half_progress_ratio_at(delta / scale.tau_tokens)
    bound = "" if floor < want < ceiling else " (its floor)" if want <= floor else " (its cap)"
    tau = "no bend" if math.isinf(scale.tau_tokens) else f"τ ≈ {scale.tau_tokens:,.0f} tokens"
    note = (
        f"Δ from the loss curve{bound}: {tau} over its last {scale.points} points, expected "
        f"half-progress ratio {ratio:.2f} ({HALF_PROGRESS_MIN:.2f} needed)."
    )
    return DeltaChoice(delta, "loss curve", note, scale.tau_tokens, ratio)
