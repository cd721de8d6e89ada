"""Memory model: peak device memory as a line in the per-device batch, fitted to what is known.

Owns: `MemoryModel` (intercept + bytes per sequence, and where they came from), `fit_memory_model`
(measured peaks, a fake-tensor plan, or both), and `usable_bytes` (capacity minus a safety margin).

Peak memory of one training step grows linearly in the per-device batch b: parameters, gradients
and optimizer state are constant, while activations and the logits (b·seq, vocab) scale with b.
So peak(b) ≈ intercept + slope·b (docs/ARCHITECTURE.md, "Memory model"). Sources, in order of trust:
  1. >= 2 measured peaks: their least-squares line, intercept raised until no measurement lies
     above it (a conservative line: it never predicts less than was seen).
  2. 1 measured peak + a plan: the plan's slope (least squares over its points), anchored on the
     measurement (the plan's constant misses the CUDA context, allocator rounding, kernels).
  3. a plan alone: its own line.
Bytes everywhere; "GB" in messages means 10^9 bytes. On CUDA, measure peak *reserved* memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rampwatch.advisor.checks import ols_line, positive_int
from rampwatch.advisor.policy import default

__all__ = ["MemoryModel", "fit_memory_model", "usable_bytes", "format_gb", "GB"]

GB = 10**9  # an int, so whole-GB figures (80 * GB) stay exact byte counts


def format_gb(n_bytes: float) -> str:
    """'150.2 GB' (10^9 bytes)."""
    return f"{n_bytes / GB:.1f} GB"


@dataclass(frozen=True)
class MemoryModel:
    """peak(b) = intercept_bytes + bytes_per_sequence · b, for a per-device batch of b sequences."""

    intercept_bytes: float
    bytes_per_sequence: float
    source: str  # 'measured line (2 points)', 'measured peak + plan slope', 'plan (3 points)', ...

    def __post_init__(self):
        for name in ("intercept_bytes", "bytes_per_sequence"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"MemoryModel.{name} must be finite, got {getattr(self, name)!r}")
        if self.bytes_per_sequence < 0:
            raise ValueError(
                f"MemoryModel.bytes_per_sequence must be >= 0 (memory does not shrink as the batch "
                f"grows), got {self.bytes_per_sequence!r}"
            )

    def predict(self, batch: int) -> float:
        """Predicted peak bytes at per-device batch `batch`."""
        b = _batch(batch)
        return self.intercept_bytes + self.bytes_per_sequence * b

    def to_dict(self) -> dict:
        return {
            "intercept_bytes": self.intercept_bytes,
            "bytes_per_sequence": self.bytes_per_sequence,
            "source": self.source,
        }


def _batch(batch) -> int:
    return positive_int("a per-device batch (an integer number of sequences)", batch)


def _points(name: str, data: Mapping | None) -> dict[int, float]:
    if not data:
        return {}
    out = {}
    for b, peak in data.items():
        bb = _batch(b)
        p = float(peak)
        if not math.isfinite(p) or p <= 0:
            raise ValueError(
                f"{name} peak for per-device batch {bb} must be positive bytes, got {peak!r}"
            )
        out[bb] = p
    return out


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of peak on batch."""
    return ols_line(list(points), list(points.values()))


def _anchor(points: dict[int, float], slope: float) -> float:
    """Smallest intercept for `slope` with no point above the line."""
    return max(p - slope * b for b, p in points.items())


def fit_memory_model(
    measured: Mapping[int, int] | None, planned: Mapping[int, int] | None = None
) -> MemoryModel:
    """Fit peak bytes against per-device batch from measured peaks and/or a memory plan.

    measured: {per-device batch: measured peak bytes} (peak reserved on CUDA), possibly empty.
    planned:  {per-device batch: planned peak bytes} from the fake-tensor plan, or None.
    See the module docstring for which source wins. Raises ValueError naming what is missing.
    """
    m = _points("measured", measured)
    p = _points("planned", planned)
    if len(m) >= 2:
        intercept, slope = _line(m)
        if slope >= 0:
            return MemoryModel(_anchor(m, slope), slope, f"measured line ({len(m)} points)")
        if len(p) < 2:
            raise ValueError(
                f"measured peaks {_show(m)} shrink as the batch grows (slope {slope:.3g} B/sequence): "
                "measure the peak after a full optimizer step (reset peak stats first), or pass a "
                "memory plan to borrow its slope"
            )
        # A non-positive measured slope is noise: fall back on the plan's slope, anchored on all
        # measurements (conservative).
        _, pslope = _line(p)
        if pslope < 0:
            raise ValueError(
                f"both measured peaks {_show(m)} and plan {_show(p)} shrink with the batch"
            )
        return MemoryModel(
            _anchor(m, pslope), pslope, "measured peaks + plan slope (measured slope < 0)"
        )
    if len(m) == 1:
        if len(p) < 2:
            raise ValueError(
                f"one measured peak ({_show(m)}) gives no slope: measure a second per-device batch, "
                f"or pass a memory plan with >= 2 batch sizes (got {len(p)})"
            )
        _, pslope = _line(p)
        if pslope < 0:
            raise ValueError(
                f"the memory plan {_show(p)} shrinks as the batch grows: re-run the plan"
            )
        return MemoryModel(_anchor(m, pslope), pslope, "measured peak + plan slope")
    if len(p) >= 2:
        intercept, slope = _line(p)
        if slope < 0:
            raise ValueError(
                f"the memory plan {_show(p)} shrinks as the batch grows: re-run the plan"
            )
        return MemoryModel(intercept, slope, f"plan ({len(p)} points)")
    raise ValueError(
        "no memory data to fit: pass measured peaks at >= 2 per-device batches, or one measured "
        f"peak plus a memory plan with >= 2 batch sizes, or a plan alone (got {len(m)} measured, "
        f"{len(p)} planned)"
    )


def _show(points: dict[int, float]) -> str:
    return "{" + ", ".join(f"{b}: {format_gb(v)}" for b, v in sorted(points.items())) + "}"


def usable_bytes(capacity: float, margin: float = default("margin")) -> float:
    """capacity·(1 − margin): the most a tier may be predicted to use (default: the policy's)."""
    c = float(capacity)
    if not math.isfinite(c) or c <= 0:
        raise ValueError(f"capacity must be positive bytes, got {capacity!r}")
    mg = float(margin)
    if not (0.0 <= mg < 1.0):
        raise ValueError(
            f"margin must be a fraction in [0, 1) of capacity (0.05 = 5%), got {margin!r}"
        )
    return c * (1.0 - mg)
