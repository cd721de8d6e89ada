"""The tier table: each tier of one `Advice` with its memory, throughput, steps, hours and LR.

Owns `TierRow` (a tier's predicted and measured peak, its tokens/s, step time and MFU from
advisor/throughput.py — measured where it ran, else modelled, else unknown —, tokens per step,
steps of the whole run at it and steps left to the run's token budget, ETA = steps left × step
time (under a step limit, at most the steps it leaves: the run stops there whatever the batch),
LR multiplier and new base LR), `tier_rows` (the running tier, then the advice's tiers
×2, ×4, ×8 as advise() chose them, then tiers this run ran earlier and measured, then each
per-device batch the memory evidence knows at the running accumulation) and the one
text form of the rows (`COLUMNS`, `cells`, `text_table`: GB, K tokens/s, %, s, h, "unknown"
where nothing is known) that the card (dashboard/card.py) and `rampwatch plan --db` both show.

It reads the question of issue 27's seed table off one run: at the same tokens/s, twice the
tokens per step halves the steps, and the ETA moves only by the difference in throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rampwatch.advisor.advice import Advice
from rampwatch.advisor.lr import lr_multiplier
from rampwatch.advisor.memory import GB, format_gb
from rampwatch.advisor.throughput import UNKNOWN, ThroughputModel, TierSpeed
from rampwatch.advisor.tiers import Tier, per_device_candidates

__all__ = ["TierRow", "tier_rows", "COLUMNS", "NOT_KNOWN", "cells", "hours_text", "text_table"]

CURRENT, FITS, NO_FIT = "current", "fits", "does not fit"  # current: the tier it runs or ended at


@dataclass(frozen=True)
class TierRow:
    kind: str  # "now", "×2" … (the advice's factors), "ran" (measured earlier), "per-device 64"
    tier: Tier
    seq_len: int | None
    status: str  # CURRENT, FITS or NO_FIT
    reason: str
    predicted_peak_bytes: float | None
    measured_peak_bytes: int | None  # the largest measured at this per-device batch
    out_of_memory: bool  # this per-device batch ran out of memory in this run
    capacity_bytes: float | None
    speed: TierSpeed
    total_steps: int | None  # the whole token budget at this tier, from step 0 (≤ step limit)
    steps_left: int | None  # the budget's tokens not yet seen, at this tier (≤ the limit's)
    lr_multiplier: float  # vs the running batch, by the policy's rule
    new_base_lr: float | None

    @property
    def current(self) -> bool:
        return self.status == CURRENT

    @property
    def label(self) -> str:
        return f"{self.kind}: {self.tier.per_device_batch} × {self.tier.accum}"

    @property
    def tokens_per_step(self) -> int | None:
        return self.tier.batch * self.seq_len if self.seq_len else None

    @property
    def eta_s(self) -> float | None:
        """Seconds to the end of the budget at this tier: steps left × step time."""
        if self.steps_left is None or self.speed.step_time_s is None:
            return None
        return self.steps_left * self.speed.step_time_s

    def to_dict(self) -> dict:
        """One flat row for scripts (`rampwatch plan --db … --json`): numbers, None = unknown."""
        t, s = self.tier, self.speed
        return {
            "kind": self.kind,
            "per_device_batch": t.per_device_batch,
            "accum": t.accum,
            "world_size": t.world_size,
            "status": self.status,
            "reason": self.reason,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "out_of_memory": self.out_of_memory,
            "tokens_per_s": s.tokens_per_s,
            "mfu": s.mfu,
            "step_time_s": s.step_time_s,
            "speed_source": s.source,
            "speed_note": s.note,
            "tokens_per_step": self.tokens_per_step,
            "total_steps": self.total_steps,
            "steps_left": self.steps_left,
            "eta_s": self.eta_s,
            "lr_multiplier": self.lr_multiplier,
            "new_base_lr": self.new_base_lr,
        }


def steps_to_limit(step_limit: int, last_step: int | None) -> int:
    """Steps a run has left before its step limit, the last step it logs (the trainer's steps
    count from 1), after its newest step (None: none yet)."""
    return max(0, step_limit - (last_step or 0))


def tier_rows(
    advice: Advice,
    speeds: ThroughputModel | None,
    tokens_seen: float | None,
    total_tokens: int | None,
    knows_lr: bool = True,
    step_limit: int | None = None,
    last_step: int | None = None,
) -> list[TierRow]:
    """The table's rows: the running tier, the advice's tiers, tiers measured earlier, then
    the per-device batches of `_per_device_rows` (each group by effective batch after the first).

    speeds: the run's throughput model (None: nothing timed); tokens_seen: the run's tokens so
    far (None: none logged, read as 0); total_tokens: its token budget (run config
    `total_tokens`; None: steps and ETA unknown); knows_lr: the run recorded its original LR
    (else no new base LR); step_limit: the last step the run logs whatever its tokens (run
    config `step_limit`, the trainer's --steps), which leaves step_limit − last_step (the run's
    newest step; None: none yet)."""
    cur, policy = advice.current, advice.policy
    seq = cur.seq_len
    budget = total_tokens if total_tokens and total_tokens > 0 else None
    seen = max(0.0, float(tokens_seen or 0))
    why = "no step of this run was timed yet" if seq else "the run records no sequence length"
    unknown = TierSpeed(None, None, None, UNKNOWN, why)

    def row(kind, tier, status, reason, predicted, mult, base_lr, speed=None) -> TierRow:
        b = tier.per_device_batch
        if predicted is None and advice.memory_model is not None:
            predicted = advice.memory_model.predict(b)
        step_tokens = tier.batch * seq if seq else None
        total = left = None
        if budget and step_tokens:
            total = math.ceil(budget / step_tokens)
            left = math.ceil(max(0.0, budget - seen) / step_tokens)
        if step_limit:
            total = min(total or step_limit, step_limit)
            to_limit = steps_to_limit(step_limit, last_step)
            left = to_limit if left is None else min(left, to_limit)
        return TierRow(
            kind,
            tier,
            seq,
            status,
            reason,
            predicted,
            advice.memory.measured.get(b),
            b in advice.memory.infeasible,
            cur.capacity_bytes,
            speed or (speeds.speed(tier) if speeds is not None else unknown),
            total,
            left,
            mult,
            base_lr,
        )

    def base_lr(batch: int) -> float | None:
        return policy.new_base_lr(batch) if knows_lr else None

    rows = [row("now", cur.tier, CURRENT, "the running tier", None, 1.0, base_lr(cur.batch))]
    for t in advice.tiers:
        o = t.option
        if any(r.tier == o.tier for r in rows):
            continue
        status = FITS if o.fits else NO_FIT
        rows.append(
            row(
                f"×{o.factor}",
                o.tier,
                status,
                o.reason,
                o.predicted_peak_bytes,
                o.lr_multiplier,
                t.new_base_lr,
            )
        )
    ran = [] if speeds is None else sorted(speeds.measured, key=lambda t: (t.batch, t.accum))
    for tier in ran:
        if any(r.tier == tier for r in rows):
            continue
        refusal = advice.refusal(tier)
        rows.append(
            row(
                "ran",
                tier,
                FITS if refusal is None else NO_FIT,
                "ran earlier in this run" + (f"; now: {refusal}" if refusal else ""),
                None,
                lr_multiplier(cur.batch, tier.batch, policy.lr_rule),
                base_lr(tier.batch),
            )
        )
    for tier, status, reason in _per_device_rows(advice):
        if any(r.tier == tier for r in rows):
            continue
        oom = status == NO_FIT  # a tier that cannot run has no throughput to show
        rows.append(
            row(
                f"per-device {tier.per_device_batch}",
                tier,
                status,
                reason,
                None,
                lr_multiplier(cur.batch, tier.batch, policy.lr_rule),
                base_lr(tier.batch),
                TierSpeed(None, None, None, UNKNOWN, reason) if oom else None,
            )
        )
    return rows


def _per_device_rows(advice: Advice) -> list[tuple[Tier, str, str]]:
    """(tier, status, reason) for each per-device batch the memory evidence knows, at the
    running accumulation and world size, by effective batch: those measured, those that ran
    out of memory, and those of candidate_tiers' candidates up to the largest offered factor
    that advice.refusal (its memory model against the usable memory) lets run."""
    cur, memory = advice.current.tier, advice.memory
    factors = [t.option.factor for t in advice.tiers]
    top = cur.per_device_batch * max(factors, default=1)
    out = []
    for b in sorted({*memory.measured, *memory.infeasible, *per_device_candidates(cur, factors)}):
        tier = Tier(b, cur.accum, cur.world_size)
        if b in memory.infeasible:
            out.append((tier, NO_FIT, "ran out of memory"))
        elif b in memory.measured:
            out.append((tier, FITS, "measured in this run"))
        elif cur.per_device_batch < b <= top and advice.refusal(tier) is None:
            need = format_gb(advice.memory_model.predict(b))
            out.append((tier, FITS, f"predicted {need} <= {format_gb(advice.usable_bytes)} usable"))
    return out


# ------------------------------------------------------------------------- the table as text

# The answer to "is it worth it in hours?" first (a card's width shows about ten columns).
COLUMNS = (
    "tier",
    "status",
    "peak predicted (GB)",
    "peak measured (GB)",
    "tokens/s (K)",
    "step time (s)",
    "steps left",
    "ETA (h)",
    "LR ×",
    "MFU (%)",
    "tokens/step",
    "steps (run)",
    "base LR",
    "throughput from",
    "why",
)
NOT_KNOWN = "unknown"
NO_NOISE_SCALE = "measures no noise scale (one batch size per step)"


def _gb(n_bytes: float | None, capacity: float | None) -> str:
    if n_bytes is None:
        return NOT_KNOWN
    share = f" ({n_bytes / capacity:.0%})" if capacity else ""
    return f"{n_bytes / GB:.1f}{share}"


def _num(x: float | None, fmt: str) -> str:
    return NOT_KNOWN if x is None else format(x, fmt)


def _seconds(s: float | None) -> str:
    return NOT_KNOWN if s is None else f"{s:.2f}" if s < 10 else f"{s:.1f}"


def hours_text(s: float | None) -> str:
    """Seconds as hours: 0.25, 31.2; "unknown" for None."""
    return NOT_KNOWN if s is None else f"{s / 3600:.2f}" if s < 3600 else f"{s / 3600:.1f}"


def _source(speed: TierSpeed) -> str:
    return f"{speed.source}: {speed.note}" if speed.note else speed.source


def cells(row: TierRow) -> dict[str, str]:
    """The row in COLUMNS' units, every cell text ("unknown" where nothing is known)."""
    s = row.speed
    measured = "OOM" if row.out_of_memory else _gb(row.measured_peak_bytes, row.capacity_bytes)
    values = (
        ("▶ " if row.current else "") + row.label,
        row.status,
        _gb(row.predicted_peak_bytes, row.capacity_bytes),
        measured,
        _num(None if s.tokens_per_s is None else s.tokens_per_s / 1e3, ".1f"),
        _seconds(s.step_time_s),
        _num(row.steps_left, ","),
        hours_text(row.eta_s),
        f"{row.lr_multiplier:.3f}",
        _num(None if s.mfu is None else 100 * s.mfu, ".1f"),
        _num(row.tokens_per_step, ","),
        _num(row.total_steps, ","),
        _num(row.new_base_lr, ".3g"),
        _source(s),
        row.reason + ("" if row.tier.measures_noise else "; " + NO_NOISE_SCALE),
    )
    return dict(zip(COLUMNS, values, strict=True))


def text_table(rows: list[TierRow]) -> str:
    """The rows as aligned plain text (the last column, the reason, left unpadded)."""
    table = [list(COLUMNS)] + [list(cells(r).values()) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
        for line in table
    )
