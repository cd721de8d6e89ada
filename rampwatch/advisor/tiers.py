"""Batch tiers: what a run runs per optimizer step, and how far it can grow in memory.

Owns `Tier` (per-device batch × accumulation × world size: the one value every part of
Rampwatch passes around for "a tier", with its sizes, its sentence and its command payload),
`RAMP_MAX_FACTOR` (policy.py's, the most one ramp may grow the batch: the store refuses
more, the candidates never offer more), `TierOption` (a candidate tier with its predictions), `candidate_tiers`
(effective batch ×2/×4/×8 split into per-device batch × accumulation × world size under a memory
model), `per_device_candidates` (the per-device batches it weighs) and `accumulation_tiers` (the
same without a memory model: accumulation only). They follow
docs/ARCHITECTURE.md "Tier": prefer the largest per-device batch that fits, make up the rest
with accumulation; a per-device batch that ran out of memory stays infeasible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rampwatch.advisor.checks import positive_int as _pos_int
from rampwatch.advisor.lr import lr_multiplier, rule_for
from rampwatch.advisor.memory import MemoryModel, format_gb, usable_bytes
from rampwatch.advisor.policy import RAMP_MAX_FACTOR, default

__all__ = [
    "RAMP_MAX_FACTOR",
    "Tier",
    "TierOption",
    "candidate_tiers",
    "accumulation_tiers",
    "per_device_candidates",
]


@dataclass(frozen=True)
class Tier:
    """One optimizer step: `accum` micro-batches of `per_device_batch` sequences on each of
    `world_size` ranks."""

    per_device_batch: int
    accum: int
    world_size: int = 1
    PAYLOAD: ClassVar[tuple[str, str]] = ("per_device_batch", "accum")  # a ramp command's keys

    def __post_init__(self):
        for name in ("per_device_batch", "accum", "world_size"):
            object.__setattr__(self, name, _pos_int(name, getattr(self, name)))

    @property
    def per_rank(self) -> int:
        """Sequences per rank per optimizer step."""
        return self.per_device_batch * self.accum

    @property
    def batch(self) -> int:
        """Effective batch: sequences per optimizer step, all ranks together."""
        return self.per_rank * self.world_size

    @property
    def measures_noise(self) -> bool:
        """Two batch sizes per step (accumulation >= 2 or several ranks): the noise scale goes on."""
        return self.accum >= 2 or self.world_size >= 2

    def describe(self, seq_len: int | None = None) -> str:
        tok = f" = {self.batch * seq_len:,} tokens" if seq_len else ""
        return (
            f"{self.per_device_batch} per device × {self.accum} accumulation × "
            f"{self.world_size} device(s) = {self.batch} sequences{tok}"
        )

    def to_payload(self) -> dict:
        """{"per_device_batch", "accum"}: a ramp command's tier, and the tier of events and
        checkpoints (the world size is the run's, never sent)."""
        return {k: getattr(self, k) for k in self.PAYLOAD}

    @classmethod
    def from_payload(cls, payload: Mapping, world_size: int = 1) -> Tier:
        return cls(payload["per_device_batch"], payload["accum"], world_size)


@dataclass(frozen=True)
class TierOption:
    """A candidate tier and what is predicted of it at the run's sequence length."""

    tier: Tier
    seq_len: int
    predicted_peak_bytes: float | None = None
    fits: bool = True
    reason: str = ""
    lr_multiplier: float = 1.0  # relative to the current batch, by the optimizer's rule
    factor: int = 1  # effective batch / current effective batch

    @property
    def tokens_per_step(self) -> int:
        return self.tier.batch * self.seq_len

    def to_dict(self) -> dict:
        """The keys the `rampwatch plan` CLI prints and writes (one flat row)."""
        t = self.tier
        return {
            "per_device_batch": t.per_device_batch,
            "accum": t.accum,
            "world_size": t.world_size,
            "seq_len": self.seq_len,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fits": self.fits,
            "reason": self.reason,
            "lr_multiplier": self.lr_multiplier,
            "factor": self.factor,
            "effective_batch": t.batch,
            "tokens_per_step": self.tokens_per_step,
        }


def _divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def per_device_candidates(tier: Tier, factors: Iterable[int]) -> list[int]:
    """The per-device batches candidate_tiers weighs for `factors` × this tier's effective
    batch: every divisor of factor × its per-rank batch, ascending."""
    return sorted({d for f in factors for d in _divisors(_factor(f) * tier.per_rank)})


def candidate_tiers(
    per_device_batch: int,
    accum: int,
    world_size: int,
    seq_len: int,
    memory_model: MemoryModel,
    capacity_bytes: float,
    margin: float = default("margin"),
    factors: Iterable[int] = default("offered_factors"),
    infeasible: Iterable[int] = (),
    optimizer: str | None = "adamw",
    max_per_device: int | None = None,
    rule: str | None = None,
    keep_noise_scale: bool = False,
) -> list[TierOption]:
    """A tier for each factor × the current effective batch, in the order of `factors`.

    For target effective batch E' = factor·E the per-rank batch is R = E'/world_size; the
    per-device batch p must divide R (accumulation R/p). Among divisors not in `infeasible` (ran
    out of memory before) and <= max_per_device, the largest that fits is chosen. A divisor fits
    when its predicted peak is <= capacity·(1 − margin), or when it is <= the current per-device
    batch and the current one is not known infeasible (it is running, and memory grows with the
    batch): an accumulation-only ramp needs no new memory. A tier that cannot fit has fits=False
    and a reason. lr_multiplier is relative to the current batch (rule from `optimizer`, or
    `rule` if given). keep_noise_scale on one device: only per-device batches with accumulation
    >= 2, so every step still has two batch sizes for the noise scale (accumulation 1 on one
    device has one); the reason says what the larger per-device batch would have cost.
    """
    running = Tier(per_device_batch, accum, world_size)
    device_batch, world = running.per_device_batch, running.world_size
    seq = _pos_int("seq_len", seq_len)
    if not isinstance(memory_model, MemoryModel):
        raise ValueError(
            f"memory_model must be an advisor.memory.MemoryModel, got {type(memory_model).__name__}"
        )
    usable = usable_bytes(capacity_bytes, margin)
    cap = None if max_per_device is None else _pos_int("max_per_device", max_per_device)
    bad = {_pos_int("infeasible per-device batch", b) for b in infeasible}
    lr_rule = rule_for(optimizer, rule)
    running_ok = (
        device_batch not in bad
    )  # the current per-device batch is running, so it and smaller fit
    current = running.batch
    tiers = []
    for f in factors:
        factor = _factor(f)
        per_rank = factor * running.per_rank
        divisors = [d for d in _divisors(per_rank) if cap is None or d <= cap]
        if keep_noise_scale and world == 1 and per_rank >= 2:
            divisors = [d for d in divisors if d <= per_rank // 2]
        allowed = [d for d in divisors if d not in bad]
        pred = {d: memory_model.predict(d) for d in divisors}
        fitting = [d for d in allowed if (running_ok and d <= device_batch) or pred[d] <= usable]
        mult = lr_multiplier(current, current * factor, lr_rule)
        if fitting:
            p = fitting[-1]
            reason = _fit_reason(p, device_batch, pred[p], usable, divisors, bad, pred, running_ok)
            if (
                keep_noise_scale
                and world == 1
                and p == per_rank // 2
                and per_rank >= 2
                and (
                    (running_ok and per_rank <= device_batch)
                    or memory_model.predict(per_rank) <= usable
                )
            ):
                reason += (
                    f"; {per_rank} × 1 would fit too but measures no noise scale (one batch "
                    f"size per step): accumulation 2 keeps it, at the cost of smaller "
                    f"micro-batches"
                )
            tier = Tier(p, per_rank // p, world)
            tiers.append(TierOption(tier, seq, pred[p], True, reason, mult, factor))
            continue
        if allowed:
            p = allowed[0]
            reason = (
                f"even per-device batch {p} needs {format_gb(pred[p])} > {format_gb(usable)} usable"
            )
            if bad:
                reason += f" (known to run out of memory: {_list(sorted(bad))})"
        else:
            p = divisors[0] if divisors else 1
            why = []
            if bad & set(_divisors(per_rank)):
                why.append(
                    f"ran out of memory before: {_list(sorted(bad & set(_divisors(per_rank))))}"
                )
            if cap is not None:
                why.append(f"max per-device batch {cap}")
            reason = f"every per-device batch dividing {per_rank} is excluded ({'; '.join(why)})"
        tier = Tier(p, per_rank // p, world)
        tiers.append(TierOption(tier, seq, pred.get(p), False, reason, mult, factor))
    return tiers


def accumulation_tiers(
    per_device_batch: int,
    accum: int,
    world_size: int,
    seq_len: int,
    factors: Iterable[int] = default("offered_factors"),
    infeasible: Iterable[int] = (),
    rule: str = "sqrt",
) -> list[TierOption]:
    """Tiers without a memory model: only the running per-device batch is known to fit, so each
    factor is made up by accumulation alone (which also keeps two batch sizes per step)."""
    running = Tier(per_device_batch, accum, world_size)
    seq = _pos_int("seq_len", seq_len)
    ok = running.per_device_batch not in set(infeasible)
    reason = (
        "accumulation only: the running per-device batch fits; no memory model to judge a "
        "larger one"
        if ok
        else f"per-device batch {running.per_device_batch} ran out of memory"
    )
    return [
        TierOption(
            Tier(running.per_device_batch, running.accum * f, running.world_size),
            seq,
            None,
            ok,
            reason,
            lr_multiplier(running.batch, running.batch * f, rule),
            f,
        )
        for f in (_factor(f) for f in factors)
    ]


def _factor(f) -> int:
    factor = _pos_int("factor", f)
    if factor > RAMP_MAX_FACTOR:
        raise ValueError(
            f"factor must be at most {RAMP_MAX_FACTOR} (RAMP_MAX_FACTOR: the store refuses a "
            f"larger ramp), got {f!r}"
        )
    return factor


def _list(xs: Sequence[int]) -> str:
    return ", ".join(str(x) for x in xs)


def _fit_reason(p, device_batch, peak, usable, divisors, bad, pred, running_ok) -> str:
    if p > device_batch:
        reason = f"per-device batch {p}: predicted {format_gb(peak)} <= {format_gb(usable)} usable"
    elif p == device_batch:
        reason = f"accumulation only: per-device batch {p} is already running"
    elif not running_ok:  # then fitting means predicted <= usable
        reason = (
            f"per-device batch {p}: predicted {format_gb(peak)} <= {format_gb(usable)} usable "
            f"(the current {device_batch} ran out of memory)"
        )
    else:
        reason = f"per-device batch {p}: at the per-device cap, below the running {device_batch}"
    bigger = [d for d in divisors if d > p]
    if bigger and not (bigger[0] == device_batch and not running_ok):
        nxt = bigger[0]
        if nxt in bad:
            reason += f"; per-device {nxt} ran out of memory before"
        elif pred[nxt] > usable:
            reason += f"; per-device {nxt} would need {format_gb(pred[nxt])} > {format_gb(usable)}"
    return reason
