"""The compare page's arithmetic over downsampled series (no Streamlit, no store).

Owns: flattening nested run configs and keeping only keys that differ; putting a metric on a
step, tokens or wall-time axis; steps/tokens/time to a target loss (first step whose *smoothed*
loss is <= target); whether a run's batch stayed constant; and the critical-batch fit
S = S_min(1 + B_crit/B) over runs at >= 3 different constant batches
(advisor.gns.fit_critical_batch).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rampwatch.advisor.gns import fit_critical_batch
from rampwatch.dashboard.buckets import Buckets
from rampwatch.dashboard.smoothing import debiased_ema, first_crossing

MISSING = "—"


def flatten(config: Mapping | None, prefix: str = "") -> dict[str, object]:
    """{'model.d_model': 128, 'betas': '[0.9, 0.95]', ...}: nested dicts become dotted keys."""
    out: dict[str, object] = {}
    for k, v in (config or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple, Mapping)):
            out[key] = json.dumps(v, sort_keys=True)
        else:
            out[key] = v
    return out


def config_diff(configs: Mapping[str, Mapping | None]) -> list[dict]:
    """Rows {'key': k, <run label>: value, ...} for keys whose values differ among the runs
    (a key missing in some runs differs). Empty when every config is the same."""
    flat = {label: flatten(c) for label, c in configs.items()}
    keys = sorted(set().union(*[set(f) for f in flat.values()])) if flat else []
    rows = []
    for k in keys:
        vals = [f.get(k, MISSING) for f in flat.values()]
        if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1:
            rows.append(
                {"key": k, **{label: _cell(f.get(k, MISSING)) for label, f in flat.items()}}
            )
    return rows


def _cell(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def _finite_xy(b: Buckets | None):
    if b is None or not len(b):
        return None
    ok = np.isfinite(b.last)
    if not ok.any():
        return None
    return b.steps[ok].astype(np.float64), b.last[ok]


def tokens_at(steps, tokens: Buckets | None) -> np.ndarray | None:
    """tokens_seen at the given steps, interpolated between its buckets' last values."""
    xy = _finite_xy(tokens)
    if xy is None:
        return None
    return np.interp(np.asarray(steps, np.float64), *xy)


def elapsed_at(steps, step_time: Buckets | None) -> tuple[np.ndarray | None, str]:
    """Seconds since the start at the given steps, and how they were obtained: the cumulative
    step_time (training time, validation excluded), each bucket counted as its last value × its
    steps — exact for steady step times, an estimate across slow-downs.
    """
    if step_time is None or not len(step_time):
        return None, "no step_time logged"
    per = np.where(np.isfinite(step_time.last), step_time.last, 0.0) * (
        step_time.n - step_time.nonfinite
    )
    cum = np.cumsum(per)
    return np.interp(
        np.asarray(steps, np.float64), step_time.steps.astype(np.float64), cum
    ), "training time (cumulative step_time)"


def constant_batch(batch: Buckets | None, config: Mapping | None = None) -> float | None:
    """The batch in sequences if it never changed during the run, else None."""
    if batch is not None and len(batch):
        lo, hi = np.nanmin(np.r_[batch.lo, np.inf]), np.nanmax(np.r_[batch.hi, -np.inf])
        if math.isfinite(lo) and math.isfinite(hi):
            return float(lo) if lo == hi else None
    cfg = config or {}
    try:
        return float(cfg["per_device_batch"] * cfg["accum"] * (cfg.get("world_size") or 1))
    except (KeyError, TypeError):
        return None


def batch_label(batch: Buckets | None, config: Mapping | None = None) -> str:
    const = constant_batch(batch, config)
    if const is not None:
        return f"{const:g}"
    if batch is not None and len(batch):
        return f"ramped {np.nanmin(batch.lo):g}→{np.nanmax(batch.hi):g}"
    return "?"


@dataclass(frozen=True)
class ToTarget:
    label: str
    batch: float | None  # constant batch, or None when it changed
    batch_text: str
    step: int | None
    tokens: float | None
    seconds: float | None
    best: float | None  # lowest smoothed loss reached

    @property
    def reached(self) -> bool:
        return self.step is not None


def to_target(
    label: str,
    loss: Buckets | None,
    target: float,
    smoothing: float,
    tokens: Buckets | None = None,
    step_time: Buckets | None = None,
    batch: Buckets | None = None,
    config: Mapping | None = None,
) -> ToTarget:
    """First step whose smoothed loss <= target, with the tokens and time it took."""
    const, text = constant_batch(batch, config), batch_label(batch, config)
    if loss is None or not len(loss):
        return ToTarget(label, const, text, None, None, None, None)
    smooth = debiased_ema(loss.last, smoothing, counts=np.maximum(loss.n - loss.nonfinite, 1))
    best = float(np.nanmin(smooth)) if np.isfinite(smooth).any() else None
    i = first_crossing(smooth, target)
    if i is None:
        return ToTarget(label, const, text, None, None, None, best)
    step = int(loss.steps[i])
    tok = tokens_at([step], tokens)
    secs, _ = elapsed_at([step], step_time)
    return ToTarget(
        label,
        const,
        text,
        step,
        None if tok is None else float(tok[0]),
        None if secs is None else float(secs[0]),
        best,
    )


@dataclass(frozen=True)
class CriticalBatch:
    s_min: float | None
    b_crit: float | None
    used: list[ToTarget]
    message: str


def critical_batch(rows: Sequence[ToTarget], target: float) -> CriticalBatch:
    """Fit S = S_min(1 + B_crit/B) when >= 3 distinct constant batches reached the target."""
    used = [r for r in rows if r.reached and r.batch is not None and r.step and r.step > 0]
    distinct = sorted({r.batch for r in used})
    if len(distinct) < 3:
        ramped = [r.label for r in rows if r.reached and r.batch is None]
        short = [r.label for r in rows if not r.reached]
        bits = [
            f"needs runs at >= 3 different constant batch sizes that reached loss {target:g}; "
            f"have {len(distinct)}"
            + (f" ({', '.join(f'{b:g}' for b in distinct)})" if distinct else "")
        ]
        if short:
            bits.append(f"not reached by: {', '.join(short)}")
        if ramped:
            bits.append(f"batch changed during: {', '.join(ramped)}")
        return CriticalBatch(None, None, used, "; ".join(bits))
    try:
        s_min, b_crit = fit_critical_batch([r.batch for r in used], [r.step for r in used])
    except ValueError as e:
        return CriticalBatch(None, None, used, str(e))
    return CriticalBatch(
        s_min,
        b_crit,
        used,
        f"fit over {len(used)} runs at batches {', '.join(f'{b:g}' for b in distinct)}",
    )


def default_target(bests: Sequence[float | None]) -> float | None:
    """A target every run reached: the highest of the runs' best smoothed losses, rounded up."""
    vals = [b for b in bests if b is not None and math.isfinite(b)]
    if not vals:
        return None
    return math.ceil(max(vals) * 1000) / 1000
