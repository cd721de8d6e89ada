"""Gradient statistics for the noise scale, read from .grad without extra passes or copies.

Within gradient accumulation of k micro-batches of b sequences each, after micro-batch j the
parameter .grad already holds the running sum S_j (scaled by 1/k and the loss scale), so the
squared norm of .grad after every backward is all the noise-scale estimator needs:
E|S_j/j|^2 = |G|^2 + tr(Sigma)/(j*b)  (McCandlish et al. 2018, App. A; DESIGN.md "The math").

Norms are reduced in fp32 on the device and stay there; `collect()` moves the k values to the
host in one transfer per optimizer step, so no micro-step ever synchronizes with the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class StepGradStats:
    """What one optimizer step's gradients say, in the units of the true mean gradient."""

    grad_norm: float  # |.grad| after the last micro-batch: before clipping, loss scale undone
    batch_sizes: list[int] = field(default_factory=list)  # sequences behind each point
    sq_norms: list[float] = field(default_factory=list)  # |S_j/j|^2 for each point

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm) and all(math.isfinite(v) for v in self.sq_norms)


class AccumulationStats:
    """Records |.grad|^2 after each backward of an accumulation cycle.

    Assumes the usual loss scaling: each micro-batch loss is divided by the accumulation count
    (`loss_divided_by_accum=True`), so after micro-batch j, .grad = S_j / k.
    """

    def __init__(self, params, loss_divided_by_accum: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.loss_divided_by_accum = loss_divided_by_accum
        self._sq_norms: list[torch.Tensor] = []

    def after_backward(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        self._sq_norms.append(torch.stack(norms).square().sum())

    def reset(self) -> None:
        """Forget the partial sums of an abandoned step (e.g. after an out-of-memory retry)."""
        self._sq_norms.clear()

    @property
    def count(self) -> int:
        return len(self._sq_norms)

    def collect(self, micro_batch: int, grad_scale: float = 1.0) -> StepGradStats:
        """End of an optimizer step: one device-to-host copy, then per-point |S_j/j|^2.

        micro_batch: sequences per micro-batch on this rank; grad_scale: a loss scaler's current
        scale (gradients are divided by it to undo scaling).
        """
        if not self._sq_norms:
            raise RuntimeError("collect() called before any backward: call after_backward() "
                               "after each micro-batch's loss.backward()")
        raw = torch.stack(self._sq_norms).double().cpu().tolist()
        self._sq_norms.clear()
        k = len(raw)
        inv_scale2 = 1.0 / (grad_scale * grad_scale)
        sq_norms, sizes = [], []
        for j, value in enumerate(raw, start=1):
            # .grad = S_j/k (loss divided by k) or S_j (not divided); we want |S_j/j|^2
            factor = (k / j) ** 2 if self.loss_divided_by_accum else 1.0 / (j * j)
            sq_norms.append(value * factor * inv_scale2)
            sizes.append(j * micro_batch)
        # the norm the clipper sees: .grad itself, loss scale undone
        return StepGradStats(grad_norm=math.sqrt(raw[-1] * inv_scale2),
                             batch_sizes=sizes, sq_norms=sq_norms)
