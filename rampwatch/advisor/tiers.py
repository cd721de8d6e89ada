"""Batch tiers: how far the batch can grow in memory.

Owns `Tier` and `candidate_tiers` (effective batch ×2/×4/×8 split into per-device batch ×
accumulation × world size under a memory model) and `accumulation_tiers` (the same without a
memory model: accumulation only). They follow docs/ARCHITECTURE.md "Tier": prefer the largest
per-device batch that fits, make up the rest with accumulation; a per-device batch that ran out
of memory stays infeasible.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from rampwatch.advisor.checks import positive_int as _pos_int
from rampwatch.advisor.lr import lr_multiplier, rule_for
from rampwatch.advisor.memory import MemoryModel, format_gb, usable_bytes
from rampwatch.advisor.policy import default

__all__ = ["Tier", "candidate_tiers", "accumulation_tiers"]


@dataclass(frozen=True)
class Tier:
    """One way to run an effective batch: per-device batch × accumulation × world size."""

    per_device_batch: int
    accum: int
    world_size: int
    seq_len: int
    predicted_peak_bytes: float | None = None
    fits: bool = True
    reason: str = ""
    lr_multiplier: float = 1.0  # relative to the current batch, by the optimizer's rule
    factor: int = 1  # effective batch / current effective batch

    @property
    def measures_noise(self) -> bool:
        """Two batch sizes per step (accumulation >= 2 or several ranks): the noise scale goes on."""
        return self.accum >= 2 or self.world_size >= 2

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.per_device_batch * self.accum * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.effective_batch * self.seq_len

    def to_dict(self) -> dict:
        d = asdict(self)
        d["effective_batch"] = self.effective_batch
        d["tokens_per_step"] = self.tokens_per_step
        return d


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
) -> list[Tier]:
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
    device_batch = _pos_int("per_device_batch", per_device_batch)
    acc = _pos_int("accum", accum)
    world = _pos_int("world_size", world_size)
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
    current = device_batch * acc * world
    tiers = []
    for f in factors:
        factor = _pos_int("factor", f)
        per_rank = factor * device_batch * acc
        divisors = [d for d in _divisors(per_rank) if cap is None or d <= cap]
        if keep_noise_scale and world == 1 and per_rank >= 2:
            divisors = [d for d in divisors if d <= per_rank // 2]
        allowed = [d for d in divisors if d not in bad]
        pred = {d: memory_model.predict(d) for d in divisors}

        def fits(d: int) -> bool:
            return (running_ok and d <= device_batch) or pred[d] <= usable

        fitting = [d for d in allowed if fits(d)]
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
            tiers.append(Tier(p, per_rank // p, world, seq, pred[p], True, reason, mult, factor))
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
        tiers.append(Tier(p, per_rank // p, world, seq, pred.get(p), False, reason, mult, factor))
    return tiers


def accumulation_tiers(
    per_device_batch: int,
    accum: int,
    world_size: int,
    seq_len: int,
    factors: Iterable[int] = (2, 4, 8),
    infeasible: Iterable[int] = (),
    rule: str = "sqrt",
) -> list[Tier]:
    """Tiers without a memory model: only the running per-device batch is known to fit, so each
    factor is made up by accumulation alone (which also keeps two batch sizes per step)."""
    device_batch, acc = _pos_int("per_device_batch", per_device_batch), _pos_int("accum", accum)
    world, seq = _pos_int("world_size", world_size), _pos_int("seq_len", seq_len)
    ok = device_batch not in set(infeasible)
    reason = (
        "accumulation only: the running per-device batch fits; no memory model to judge a "
        "larger one"
        if ok
        else f"per-device batch {device_batch} ran out of memory"
    )
    current = device_batch * acc * world
    return [
        Tier(
            device_batch,
            acc * f,
            world,
            seq,
            None,
            ok,
            reason,
            lr_multiplier(current, current * f, rule),
            f,
        )
        for f in (_pos_int("factor", f) for f in factors)
    ]


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
