"""A batch schedule entered by hand, such as issue 27's "2M → 4M at 70% → 8M at 90%": read,
checked and laid on the run in tokens.

Owns `parse_plan` (text → `PlanStep`s, or `PlanError`: one line naming the step and what to
write instead), `place` (→ `HandPlan`: each step's batch in sequences and where it starts in
tokens, from token 0 to the budget), `HandPlan.segments_from` (the part still to run, which
advisor/schedule.py's `walk` counts in steps and hours) and `HandPlan.due` (the step the run
has reached, or will within DUE_LEAD_STEPS, at a batch larger than it runs), and `format_batch`
(tokens per step written back as BATCH reads them).

What it reads. Steps are joined by "→" or "->"; the first is a batch, each later one
"BATCH at POINT".
- BATCH in tokens per step: a number (commas allowed) with K = 1,024 or M = 1,024², since a
  batch in tokens is sequences × a power-of-two sequence length: "1M" is 1,048,576 (the seed
  table's 512 × 2,048) and "0.5M" 524,288. It must make whole sequences. Or in sequences:
  "1024 seq" ("seqs", "sequences"; K and M the same).
- POINT: "N%" of the run's token budget, "N tokens" or "N steps", where K, M, B, T count
  thousands (budgets are said so: "20B tokens"). A step the run has run is placed where its
  tokens stood then; a later one is reached from now at the plan's batches.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DUE_LEAD_STEPS",
    "DueStep",
    "HandPlan",
    "PlanError",
    "PlanStep",
    "format_batch",
    "parse_plan",
    "place",
]

# a step is offered this many steps before its point: an approval is claimed at the writer's
# next visit (about a second) and applied at the step boundary after it
DUE_LEAD_STEPS = 10

ARROW = re.compile(r"\s*(?:→|->)\s*")
AT = re.compile(r"\s+at(?:\s+|$)", re.IGNORECASE)
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
BATCH = re.compile(
    rf"(?P<num>{NUMBER})\s*(?P<suffix>[KkMm])?\s*(?P<unit>tokens?|seqs?|sequences?)?",
    re.IGNORECASE,
)
POINT = re.compile(
    rf"(?P<num>{NUMBER})\s*(?:(?P<pct>%)|(?P<suffix>[KkMmBbTt])?\s*(?P<unit>tokens?|steps?))",
    re.IGNORECASE,
)
BINARY = {"k": 1024, "m": 1024**2}
DECIMAL = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
EXAMPLE = "e.g. '2M → 4M at 70% → 8M at 90%'"


class PlanError(ValueError):
    """A plan that cannot be read or placed: the message is one line, naming the step."""


@dataclass(frozen=True)
class PlanStep:
    """One step as written: its batch (tokens per step, or sequences) and its point."""

    text: str
    tokens_per_step: float | None  # None: given in sequences
    sequences: float | None  # None: given in tokens
    at: str | None  # "percent", "tokens" or "steps"; None: the first step
    at_value: float | None = None


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _batch(piece: str, where: str) -> tuple[float | None, float | None]:
    m = BATCH.fullmatch(piece)
    if m is None:
        raise PlanError(
            f"{where}: {piece!r} is not a batch; write tokens per step (2M, 524288) or "
            "sequences (1024 seq)"
        )
    value = _number(m["num"]) * BINARY.get((m["suffix"] or "").lower(), 1)
    if value <= 0:
        raise PlanError(f"{where}: a batch of {piece!r} is no batch; give a positive one")
    unit = (m["unit"] or "tokens").lower()
    return (None, value) if unit.startswith("seq") else (value, None)


def _point(text: str, where: str) -> tuple[str, float]:
    m = POINT.fullmatch(text)
    if m is None:
        raise PlanError(
            f"{where}: 'at {text}' is no point; write 'at 70%' (of the token budget), "
            "'at 1.5B tokens' or 'at 20000 steps'"
        )
    value = _number(m["num"])
    if m["pct"]:
        return "percent", value
    value *= DECIMAL.get((m["suffix"] or "").lower(), 1)
    return ("steps" if m["unit"].lower().startswith("step") else "tokens"), value


def parse_plan(text: str) -> list[PlanStep]:
    """The steps of a plan as written (module docstring); [] for an empty text."""
    text = (text or "").strip()
    if not text:
        return []
    if "\n" in text:
        raise PlanError(f"a plan is one line of steps joined by → or ->, {EXAMPLE}")
    steps = []
    for i, piece in enumerate(ARROW.split(text), start=1):
        where = f"plan step {i}"
        if not piece:
            raise PlanError(f"{where} is empty: an arrow with no batch beside it, {EXAMPLE}")
        parts = AT.split(piece, maxsplit=1)
        batch_text = parts[0].strip()
        where = f"plan step {i} ({piece!r})"
        tokens, seqs = _batch(batch_text, where)
        if len(parts) == 1:
            if i > 1:
                raise PlanError(f"{where} has no point: write '{batch_text} at 70%'")
            steps.append(PlanStep(piece, tokens, seqs, None))
            continue
        if i == 1:
            raise PlanError(
                f"{where}: the first step is the batch the plan starts with, with no 'at', "
                f"{EXAMPLE}"
            )
        if not parts[1].strip():
            raise PlanError(f"{where}: nothing after 'at'; write '{batch_text} at 70%'")
        kind, value = _point(parts[1].strip(), where)
        steps.append(PlanStep(piece, tokens, seqs, kind, value))
    return steps


@dataclass(frozen=True)
class DueStep:
    """A plan step the run has reached (or will within the lead) at a larger batch."""

    number: int  # 1-based, as the plan is written
    text: str
    batch: int  # sequences
    start_tokens: float


@dataclass(frozen=True)
class HandPlan:
    """The plan on the run: step i runs `batches[i]` sequences a step from `starts[i]` tokens."""

    steps: tuple[PlanStep, ...]
    starts: tuple[float, ...]  # the first is 0
    batches: tuple[int, ...]
    budget: int
    seq_len: int

    def index_at(self, tokens: float) -> int:
        """The step in effect at `tokens`."""
        return max(i for i, s in enumerate(self.starts) if s <= max(0.0, tokens))

    def segments_from(self, now_tokens: float) -> list[tuple[float, int]]:
        """(start tokens, batch) of what is left: the step in effect now from now, then the rest."""
        i = self.index_at(now_tokens)
        rest = [(s, b) for s, b in zip(self.starts, self.batches, strict=True) if s > now_tokens]
        return [(float(now_tokens), self.batches[i]), *rest]

    def points(self) -> list[tuple[float, int]]:
        """(start tokens, batch tokens per step) of every step, for the chart."""
        return [(s, b * self.seq_len) for s, b in zip(self.starts, self.batches, strict=True)]

    def due(
        self, now_tokens: float, running_batch: int, lead_tokens: float = 0.0
    ) -> DueStep | None:
        """The step in effect at now + lead when its batch is larger than the running one."""
        i = self.index_at(now_tokens + lead_tokens)
        if self.batches[i] <= running_batch:
            return None
        return DueStep(i + 1, self.steps[i].text, self.batches[i], self.starts[i])

    def words(self) -> str:
        """How each step was read: its batch in tokens and sequences, and where it starts."""
        out = []
        for s, b, start in zip(self.steps, self.batches, self.starts, strict=True):
            where = "from the start" if s.at is None else f"from {start / self.budget:.1%}"
            tok = b * self.seq_len
            out.append(f"{format_batch(tok)} = {tok:,} tokens ({b:,} sequences) {where}")
        return "; ".join(out)


def format_batch(tokens: float) -> str:
    """Tokens per step as a plan writes them (the inverse of BATCH): 2K, 512K, 1M where exact
    (K = 1,024), else the number with separators."""
    n = int(round(tokens))
    for unit, size in (("M", 1024**2), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size:,}{unit}"
    return f"{n:,}"


def _sequences(step: PlanStep, seq_len: int, where: str) -> int:
    if step.sequences is not None:
        seqs = step.sequences
        if seqs != int(seqs):
            raise PlanError(f"{where}: {seqs:g} sequences is not a whole number; give one")
        return int(seqs)
    seqs = step.tokens_per_step / seq_len
    if abs(seqs - round(seqs)) > 1e-9 * max(1.0, seqs):
        near = [n for n in (math.floor(seqs), math.ceil(seqs)) if n > 0]
        raise PlanError(
            f"{where}: {step.tokens_per_step:,.0f} tokens a step is not a whole number of "
            f"{seq_len:,}-token sequences ({seqs:,.1f}); write it in sequences, e.g. "
            f"'{near[-1]} seq'"
        )
    return int(round(seqs))


def place(
    steps: Sequence[PlanStep],
    seq_len: int,
    budget: int,
    now_step: int | None,
    now_tokens: float,
    run_steps: Sequence[float] = (),
    run_tokens: Sequence[float] = (),
) -> HandPlan:
    """The steps on the run: batches in sequences, points in tokens (module docstring).
    now_step / now_tokens: the run's newest step and tokens seen then; run_steps / run_tokens:
    its history (steps increasing), where a step point it has passed is placed."""
    if not steps:
        raise PlanError(f"the plan has no steps, {EXAMPLE}")
    past_s, past_t = np.asarray(run_steps, np.float64), np.asarray(run_tokens, np.float64)
    now_s = -1 if now_step is None else int(now_step)
    cursor = (float(now_s), float(now_tokens))  # the latest point at or after now: (step, tokens)
    batches, starts = [], []
    for i, step in enumerate(steps, start=1):
        where = f"plan step {i} ({step.text!r})"
        batch = _sequences(step, seq_len, where)
        if step.at is None:
            start = 0.0
        else:
            start = _start(
                step, where, budget, now_s, cursor, batches[-1] * seq_len, past_s, past_t
            )
            if start <= starts[-1]:
                raise PlanError(
                    f"{where} starts at {start:,.0f} tokens, not after step {i - 1}: a plan's "
                    "points must increase"
                )
            if start >= budget:
                raise PlanError(
                    f"{where} starts at {start:,.0f} tokens, at or past the budget of "
                    f"{budget:,}: nothing would run at it; move it earlier"
                )
            if start >= cursor[1]:
                steps_to = (start - cursor[1]) / (batches[-1] * seq_len)
                cursor = (cursor[0] + steps_to, start)
        batches.append(batch)
        starts.append(start)
    return HandPlan(tuple(steps), tuple(starts), tuple(batches), int(budget), int(seq_len))


def _start(step, where, budget, now_s, cursor, prev_tokens, past_s, past_t) -> float:
    """Where a step's point is in tokens."""
    if step.at == "percent":
        if not 0 < step.at_value < 100:
            raise PlanError(f"{where}: {step.at_value:g}% is outside the budget; give 0–100%")
        return budget * step.at_value / 100
    if step.at == "tokens":
        return step.at_value
    if step.at_value > now_s:  # ahead: from the latest point at the plan's batch since then
        return cursor[1] + (step.at_value - cursor[0]) * prev_tokens
    if not past_s.size:
        raise PlanError(f"{where}: the run's steps so far are not read yet; give the point in %")
    return float(np.interp(step.at_value, past_s, past_t))
