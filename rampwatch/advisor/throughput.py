"""Throughput of batch tiers: what the run measured at each tier it ran, and a model of the rest.

Owns `MeasuredSpeed` (one tier's median tokens/s and MFU over the last steps it ran),
`measure_tiers` (per-step tier and tokens/s → those medians), `TierSpeed` (a tier's tokens/s,
step time and MFU, and whether they were measured, modelled or are unknown) and
`ThroughputModel` (fitted on the measured tiers; `speed(tier)` for any tier of the run's world),
and `recent_throughput` (the run's tokens/s now, which the card and the monitor time costs at).

The model. An optimizer step of a tier runs `accum` micro-batches of b sequences on each rank,
then work done once per step whatever the accumulation (the gradient all-reduce under DDP's
no_sync, clipping, the optimizer step, zero_grad):

    step_time(b, accum) = accum · t_micro(b) + overhead
    t_micro(b)          = c0 + c1·b          (c0, c1 ≥ 0)

t_micro is the affine cost of one call on b items, a fixed latency plus a per-item time: Hockney's
α–β form ("The communication challenge for MPP", Parallel Computing 20(3), 1994), here for a
forward-backward pass (kernel launches and weight reads are paid per call, FLOPs per sequence).
Its tokens/s per rank, b·seq/(c0 + c1·b), rises with b and saturates at seq/c1: a GPU that is
compute-bound gains little from a larger micro-batch (the seed table of issue 27 on one H200:
16 → 32 sequences per device at accumulation 16, 129K → 135K tokens/s).

Fitting. The monitor logs tokens/s = tokens per step / step time, so a tier's median tokens/s
gives its step time. t_micro is known at each measured per-device batch; `overhead` is
estimated only when one per-device batch was measured at two accumulations (then least squares
over every measured tier, one t_micro per b and one shared overhead); otherwise it is taken as 0
and the notes say so. With ≥ 2 measured per-device batches the line c0 + c1·b through their
t_micro gives the others (c0 < 0 from noise is refitted through the origin: tokens/s flat in b);
with one, another per-device batch is unknown while the same one at another accumulation is not.
MFU is linear in tokens/s (advisor/flops.py `mfu_at`): a modelled tier's MFU is its tokens/s ×
the run's measured MFU per token/s. Cheap (a few tiers, one small least squares): the card and
`rampwatch plan --db` fit it per refresh, never the monitor's per-step path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from rampwatch.advisor.checks import ols_line, positive_int
from rampwatch.advisor.flops import mfu_at
from rampwatch.advisor.tiers import Tier

__all__ = ["MeasuredSpeed", "TierSpeed", "ThroughputModel", "measure_tiers", "recent_throughput"]

MEASURED, MODEL, UNKNOWN = "measured", "model", "unknown"
RECENT = 32  # the last tokens/s values the run's throughput now is the median of


def recent_throughput(tokens_per_s: Iterable) -> float | None:
    """The run's tokens/s now: the median of the last RECENT positive, finite values (a median:
    one slow step, a checkpoint or a validation, or one fast step does not move it); None
    without any."""
    recent = np.asarray(list(tokens_per_s), np.float64)[-RECENT:]
    recent = recent[np.isfinite(recent) & (recent > 0)]
    return float(np.median(recent)) if recent.size else None


@dataclass(frozen=True)
class MeasuredSpeed:
    """The median tokens/s (all ranks) and MFU (None: not logged) of the last steps a tier ran."""

    tier: Tier
    tokens_per_s: float
    mfu: float | None
    samples: int  # steps (or chart buckets: one step each) the medians are over


@dataclass(frozen=True)
class TierSpeed:
    """A tier's throughput: measured where it ran, else modelled, else unknown (all None)."""

    tokens_per_s: float | None
    step_time_s: float | None
    mfu: float | None
    source: str  # MEASURED, MODEL or UNKNOWN
    note: str = ""  # what a modelled figure rests on, or why it is unknown

    @property
    def known(self) -> bool:
        return self.tokens_per_s is not None


def measure_tiers(
    per_device_batch: Iterable,
    accum: Iterable,
    tokens_per_s: Iterable,
    mfu: Iterable | None,
    world_size: int,
) -> dict[Tier, MeasuredSpeed]:
    """The medians per tier of per-step values (aligned arrays in step order; NaN where a step
    logged none), over each tier's last RECENT timed steps: the running tier's tokens/s is then
    `recent_throughput` of its own steps, the figure trial costs and the forecast are timed at.

    A step counts when its tier is known and its tokens/s positive and finite (the first step
    of a run or a resume has none: nothing times it); MFU's median is over the steps that
    logged one."""
    b = np.asarray(per_device_batch, np.float64)
    a = np.asarray(accum, np.float64)
    tps = np.asarray(tokens_per_s, np.float64)
    util = np.full(tps.shape, np.nan) if mfu is None else np.asarray(mfu, np.float64)
    if not (b.shape == a.shape == tps.shape == util.shape):
        raise ValueError(
            f"per-step arrays must be aligned, got lengths {b.size}, {a.size}, {tps.size}, "
            f"{util.size}"
        )
    world = positive_int("world_size", world_size)
    ok = np.isfinite(b) & np.isfinite(a) & (b >= 1) & (a >= 1) & np.isfinite(tps) & (tps > 0)
    ok &= (b == np.round(b)) & (a == np.round(a))
    out = {}
    keys = np.stack([b[ok], a[ok]], axis=1) if ok.any() else np.zeros((0, 2))
    for key in np.unique(keys, axis=0):
        rows = np.flatnonzero(ok & (b == key[0]) & (a == key[1]))[-RECENT:]
        tier = Tier(int(key[0]), int(key[1]), world)
        u = util[rows]
        u = u[np.isfinite(u) & (u > 0)]
        med_mfu = float(np.median(u)) if u.size else None
        out[tier] = MeasuredSpeed(tier, float(np.median(tps[rows])), med_mfu, rows.size)
    return out


@dataclass(frozen=True)
class ThroughputModel:
    """step_time = accum · t_micro(b) + overhead, fitted on the measured tiers of one world size
    (module docstring). Build it with `fit`."""

    seq_len: int
    world_size: int
    measured: dict[Tier, MeasuredSpeed]
    micro_s: dict[int, float]  # t_micro at each measured per-device batch, seconds
    overhead_s: float
    line: tuple[float, float] | None  # (c0, c1) of t_micro(b) = c0 + c1·b; None: no line
    mfu_like: tuple[float, float] | None  # (MFU, tokens/s) of a measured tier: MFU's scale
    notes: list[str] = field(default_factory=list)  # what the model assumes, in words

    @classmethod
    def fit(
        cls, measured: Mapping[Tier, MeasuredSpeed], seq_len: int, world_size: int
    ) -> ThroughputModel:
        seq = positive_int("seq_len", seq_len)
        world = positive_int("world_size", world_size)
        here = {t: m for t, m in measured.items() if t.world_size == world}
        notes = []
        if len(here) < len(measured):
            notes.append(f"tiers measured at another world size than {world} are left out")
        step = {t: t.batch * seq / m.tokens_per_s for t, m in here.items()}
        micro, overhead, why = _micro_times(step)
        notes += why
        line, why = _micro_line(micro)
        notes += why
        with_mfu = sorted((m for m in here.values() if m.mfu), key=lambda m: -m.samples)
        like = (with_mfu[0].mfu, with_mfu[0].tokens_per_s) if with_mfu else None
        return cls(seq, world, here, micro, overhead, line, like, notes)

    def speed(self, tier: Tier) -> TierSpeed:
        """The tier's tokens/s, step time and MFU: measured, modelled, or unknown and why."""
        m = self.measured.get(tier)
        if m is not None:
            note = f"median of its last {m.samples} steps"
            return TierSpeed(m.tokens_per_s, self.step_time(m), m.mfu, MEASURED, note)
        if tier.world_size != self.world_size:
            return TierSpeed(
                None, None, None, UNKNOWN, f"no tier measured at world {tier.world_size}"
            )
        b = tier.per_device_batch
        if b in self.micro_s:
            t_micro, basis = self.micro_s[b], f"per-device batch {b} as measured"
        elif self.line is not None:
            t_micro, basis = self.line[0] + self.line[1] * b, self._line_basis()
        else:
            return TierSpeed(None, None, None, UNKNOWN, self._unknown_why(b))
        step_time = tier.accum * t_micro + self.overhead_s
        tps = tier.batch * self.seq_len / step_time
        util = mfu_at(tps, *self.mfu_like) if self.mfu_like else None
        return TierSpeed(tps, step_time, util, MODEL, basis)

    def step_time(self, m: MeasuredSpeed) -> float:
        return m.tier.batch * self.seq_len / m.tokens_per_s

    def _line_basis(self) -> str:
        bs = ", ".join(str(b) for b in sorted(self.micro_s))
        return f"a line in the per-device batch through {bs}"

    def _unknown_why(self, b: int) -> str:
        if not self.micro_s:
            return "no tier of this run has measured tokens/s yet"
        if len(self.micro_s) == 1:
            [only] = self.micro_s
            return (
                f"only per-device batch {only} was measured: per-device batch {b} needs a "
                "second one measured"
            )
        return self.notes[-1] if self.notes else "no model of the per-device batch"


def _micro_times(step: Mapping[Tier, float]) -> tuple[dict[int, float], float, list[str]]:
    """t_micro per measured per-device batch and the per-step overhead (least squares when a
    per-device batch ran at two accumulations, else 0), and what was assumed."""
    if not step:
        return {}, 0.0, []
    bs = sorted({t.per_device_batch for t in step})
    accums = {b: {t.accum for t in step if t.per_device_batch == b} for b in bs}
    paired = [b for b in bs if len(accums[b]) >= 2]
    if paired:
        tiers = list(step)
        design = np.array(
            [[t.accum * (t.per_device_batch == b) for b in bs] + [1.0] for t in tiers], np.float64
        )
        times = np.array([step[t] for t in tiers])
        sol = np.linalg.lstsq(design, times, rcond=None)[0]
        overhead = float(sol[-1])
        if overhead >= 0:
            micro = {b: float(v) for b, v in zip(bs, sol[:-1], strict=True)}
            pairs = "; ".join(
                f"{b} at accumulation {', '.join(map(str, sorted(accums[b])))}" for b in paired
            )
            return micro, overhead, [f"per-step overhead {overhead:.3g} s, from {pairs}"]
        why = "the per-step overhead fitted below 0 (noise in the step times): taken as 0"
    else:
        why = (
            "per-step overhead taken as 0: no per-device batch was measured at two "
            "accumulations, so accumulation's own cost is not known"
        )
    micro = {}
    for b in bs:  # least squares of step = accum · t with no overhead
        mine = [t for t in step if t.per_device_batch == b]
        micro[b] = sum(t.accum * step[t] for t in mine) / sum(t.accum**2 for t in mine)
    return micro, 0.0, [why]


def _micro_line(micro: Mapping[int, float]) -> tuple[tuple[float, float] | None, list[str]]:
    """t_micro(b) = c0 + c1·b through the measured per-device batches (≥ 2 of them)."""
    if len(micro) < 2:
        return None, []
    bs = sorted(micro)
    c0, c1 = ols_line(bs, [micro[b] for b in bs])
    if c1 <= 0 or not math.isfinite(c1):
        shown = ", ".join(f"{b}: {micro[b]:.3g} s" for b in bs)
        return None, [
            f"micro-batch time does not grow with the per-device batch ({shown}): no model "
            "for per-device batches that did not run"
        ]
    if c0 < 0:  # tokens/s cannot fall as the micro-batch grows in this model
        c1 = sum(b * micro[b] for b in bs) / sum(b * b for b in bs)
        return (0.0, c1), ["tokens/s taken as flat in the per-device batch (the fit's c0 < 0)"]
    return (c0, c1), []
