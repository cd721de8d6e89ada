"""Gradient statistics for the noise scale, read from .grad without extra passes or copies.

Within gradient accumulation of k micro-batches of b sequences each, after micro-batch j the
parameter .grad already holds the running sum S_j (scaled by 1/k and the loss scale), so the
squared norm of .grad after every backward is all the noise-scale estimator needs:
E|S_j/j|^2 = |G|^2 + tr(Sigma)/(j*b)  (McCandlish et al. 2018, App. A; docs/ARCHITECTURE.md "Gradient noise scale").

Norms are reduced in fp32 on the device and stay there; `collect()` moves the k values to the
host in one transfer per optimizer step, so no micro-step ever synchronizes with the device.

Under DDP (world size W) the running sums j < k are this rank's own (no_sync), while the last
backward's .grad is the all-reduced global mean. `RankNormHook`, a DDP communication hook, adds
the one missing point for free: |bucket|^2 of this rank's local full gradient S_k/k, taken just
before the standard all-reduce. `collect(..., world_size=W)` then averages the local points over
ranks in one small all-reduce (which also carries values the caller wants averaged or maxed over
ranks, e.g. the loss and the peak memory) and fits the line through
(j*b, |S_j/j|^2) for j <= k (rank averages) and (k*b*W, |global|^2). Averaging the local points
keeps their expectation |G|^2 + tr(Sigma)/(j*b), cuts their variance, and gives every rank the
same estimate (so a checkpoint written by any rank holds rank 0's noise-scale EMA).

A loop under torch.distributed without DDP whose optimizer averages the gradients inside
step() (nanochat's reduce-scatter) has .grad = this rank's own S_j/k after every backward, the
last included (no DDP hook attached): the fit then uses the rank averages of all k local points and no
global one; with k = 1 there is one batch size and nothing to fit. A loop that all-reduces .grad
itself before after_backward() breaks that assumption: wrap the model in DDP instead.

Micro-batches weighted other than 1/k (Hugging Face's num_items_in_batch divides each summed
token loss by the step's token count) pass their weight to after_backward; the points are then
token-weighted means over the tokens behind them. Under DDP each rank passes the weights of its
own micro-batches (which differ between ranks), each rank's points are its own means before they
are averaged, at the ranks' mean 1/B, and the global point divides the all-reduced .grad by the
ranks' mean total weight. Sharded gradients (FSDP's flat or DTensor parameters, ZeRO's missing .grad) set
`sharded`: their local norm is not the gradient's, so nothing is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist


@dataclass
class StepGradStats:
    """What one optimizer step's gradients say, in the units of the true mean gradient."""

    grad_norm: float  # |.grad| after the last micro-batch: before clipping, loss scale undone
    batch_sizes: list[int] = field(default_factory=list)  # sequences behind each point
    sq_norms: list[float] = field(default_factory=list)  # |S_j/j|^2 for each point
    rank_means: list[float] = field(default_factory=list)  # DDP: `rank_mean` values, averaged
    rank_maxes: list[float] = field(default_factory=list)  # DDP: `rank_max` values, max over ranks

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm) and all(math.isfinite(v) for v in self.sq_norms)


class RankNormHook:
    """State of the DDP communication hook: this rank's |local gradient|^2, summed over buckets.

    The hook sees each bucket's flat buffer before the all-reduce, i.e. this rank's accumulated
    .grad (S_k/k with the usual loss scaling), so the squared norm costs one reduction per bucket
    on the device and no extra backward. Then it runs the standard allreduce hook unchanged.
    """

    def __init__(self, process_group=None):
        self.process_group = process_group
        self._sq: torch.Tensor | None = None

    def register(self, ddp_model) -> None:
        ddp_model.register_comm_hook(self, _rank_norm_allreduce_hook)

    def take(self) -> torch.Tensor | None:
        value, self._sq = self._sq, None
        return value


def _rank_norm_allreduce_hook(state: RankNormHook, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # before the allreduce hook divides the buffer by the world size in place
    sq = torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float32).square()
    state._sq = sq if state._sq is None else state._sq + sq
    return default_hooks.allreduce_hook(state.process_group, bucket)


def _is_sharded_tensor(t: torch.Tensor) -> bool:
    # FSDP2 and tensor parallelism: DTensor gradients hold this rank's shard only
    return type(t).__name__ == "DTensor"


def _sharded(params) -> bool:
    """No .grad after a backward (ZeRO-2/3 keep gradients in their own partitioned buffers) or
    FSDP1's flat parameters: the norm of .grad would not be the gradient's norm."""
    return any(
        type(p).__name__ == "FlatParameter" or getattr(p, "ds_id", None) is not None for p in params
    ) or all(p.grad is None for p in params)


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ|g|² over gradients of any floating dtype, on their device: half and single precision
    accumulate in float32, double stays double (foreach_norm refuses to narrow it)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    total = None
    for dtype, group in by_dtype.items():
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        part = torch.stack(torch._foreach_norm(group, 2, dtype=wide)).square().sum()
        part = part.to(torch.float32) if len(by_dtype) > 1 else part
        total = part if total is None else total + part
    return total


class AccumulationStats:
    """Records |.grad|^2 after each backward of an accumulation cycle.

    Assumes the usual loss scaling: each micro-batch loss is divided by the accumulation count
    (`loss_divided_by_accum=True`), so after micro-batch j, .grad = S_j / k.
    """

    def __init__(self, params, loss_divided_by_accum: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.loss_divided_by_accum = loss_divided_by_accum
        self._sq_norms: list[torch.Tensor] = []
        self._weights: list[float | None] = []  # per backward: what its mean loss was scaled by
        self.sharded = False  # set when .grad is sharded (FSDP, ZeRO): no norm is taken
        self.rank_hook: RankNormHook | None = None  # set by attach_ddp (world size > 1)

    def attach_ddp(self, ddp_model, process_group=None) -> None:
        """Register the per-rank norm hook on a DistributedDataParallel model (before its first
        backward). Without it, collect(world_size > 1) takes every .grad as the rank's own."""
        self.rank_hook = RankNormHook(process_group)
        self.rank_hook.register(ddp_model)

    def after_backward(self, weight: float | torch.Tensor | None = None) -> None:
        """weight: the factor this micro-batch's mean loss was multiplied by before backward,
        when it is not 1/k (e.g. n_tokens_j / n_tokens_step, Hugging Face's num_items_in_batch).
        """
        grads = self._local_grads()
        if not grads:
            self.sharded = self.sharded or _sharded(self.params)
            return
        self._sq_norms.append(_squared_norm(grads))
        self._weights.append(weight)

    def record_final(self) -> bool:
        """For a loop that never calls after_backward: .grad as it stands at the optimizer step
        becomes the step's one point, so collect() still gives the gradient norm (one point: no
        noise scale). False when there is no .grad to read."""
        grads = self._local_grads()
        if grads:
            self._sq_norms.append(_squared_norm(grads))
            self._weights.append(None)
        return bool(grads)

    def _local_grads(self) -> list[torch.Tensor]:
        """The .grad tensors whose norm is the gradient's; none once they are known sharded."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and not self.sharded and _is_sharded_tensor(grads[0]):
            self.sharded = True
        return [] if self.sharded else grads

    def reset(self) -> None:
        """Forget the partial sums of an abandoned step (e.g. after an out-of-memory retry)."""
        self._sq_norms.clear()
        self._weights.clear()
        if self.rank_hook is not None:
            self.rank_hook.take()

    def _step_weights(self, k: int) -> list[float]:
        if self._weights and all(w is not None for w in self._weights):
            # device tensors (token counts the loop never synced) arrive in one transfer
            dev = next((w.device for w in self._weights if isinstance(w, torch.Tensor)), "cpu")
            return (
                torch.stack(
                    [
                        torch.as_tensor(w, dtype=torch.float64, device=dev).reshape(())
                        for w in self._weights
                    ]
                )
                .cpu()
                .tolist()
            )
        return [1.0 / k if self.loss_divided_by_accum else 1.0] * k

    @property
    def count(self) -> int:
        return len(self._sq_norms)

    def collect(
        self,
        micro_batch: int,
        grad_scale: float = 1.0,
        world_size: int = 1,
        *,
        rank_mean=(),
        rank_max=(),
    ) -> StepGradStats:
        """End of an optimizer step: one device-to-host copy, then per-point |S_j/j|^2.

        micro_batch: sequences per micro-batch on this rank; grad_scale: a loss scaler's current
        scale (gradients are divided by it to undo scaling). world_size > 1: DDP, or a loop that
        syncs inside the optimizer when no hook is attached (see the module docstring); every rank must call it, and rank_mean / rank_max (device tensors or floats)
        come back averaged / maxed over ranks in StepGradStats.rank_means / rank_maxes.
        """
        if not self._sq_norms:
            raise RuntimeError(
                "collect() called before any backward: call after_backward() "
                "after each micro-batch's loss.backward()"
            )
        if world_size > 1:
            return self._collect_ddp(micro_batch, grad_scale, world_size, rank_mean, rank_max)
        raw = torch.stack(self._sq_norms).double().cpu().tolist()
        sq_norms, sizes = self._points(raw, self._take_weights(), micro_batch, grad_scale)
        # the norm the clipper sees: .grad itself, loss scale undone
        return StepGradStats(
            grad_norm=math.sqrt(raw[-1]) / grad_scale, batch_sizes=sizes, sq_norms=sq_norms
        )

    def _take_weights(self) -> list[float]:
        weights = self._step_weights(len(self._sq_norms))
        self._sq_norms.clear()
        self._weights.clear()
        return weights

    @staticmethod
    def _points(
        raw: list[float], weights: list[float], micro_batch: int, grad_scale: float
    ) -> tuple[list[float], list[float]]:
        """(|mean gradient|², sequences behind it) after each backward of the step.

        .grad after backward j = Σ_{i<=j} w_i·g_i (g_i: micro-batch i's mean gradient), so
        .grad / W_j is the mean gradient over the W_j / w̄ micro-batches behind it: with w = 1/k
        that is S_j/j over j·b sequences; with token weights, a token-weighted mean."""
        inv_scale2 = 1.0 / (grad_scale * grad_scale)
        sq_norms, sizes, total, mean_w = [], [], 0.0, sum(weights) / len(weights)
        for value, w in zip(raw, weights, strict=True):
            total += w
            if total > 0:  # micro-batches of weight 0 so far (every label masked): no point yet
                sq_norms.append(value / (total * total) * inv_scale2)
                sizes.append(micro_batch * total / mean_w)
        return sq_norms, sizes

    def _collect_ddp(
        self, micro_batch: int, grad_scale: float, world: int, rank_mean, rank_max
    ) -> StepGradStats:
        own_grads = self.rank_hook is None  # no DDP: every point is this rank's own
        if own_grads:
            local, group = torch.stack(self._sq_norms), None
        else:
            local_full = self.rank_hook.take()
            if local_full is None:
                raise RuntimeError(
                    "collect(world_size > 1): the DDP norm hook saw no gradient this step "
                    "(attach_ddp(ddp_model) before the first backward)"
                )
            local = torch.stack([*self._sq_norms[:-1], local_full])
            group = self.rank_hook.process_group
        dev, f64 = local.device, torch.float64
        local = local.to(f64)
        k, n_max = len(self._sq_norms), len(rank_max)
        # Each rank's points as its own means before they are averaged: its weights (token
        # counts under Hugging Face) need not be the other ranks'. Point j's scale, 1 / its
        # weight so far squared, and 1/B (averaged: E of the mean point is |G|² + tr(Σ)·mean 1/B)
        synced = self._sq_norms[-1].to(f64).reshape(1)  # DDP: the all-reduced .grad's
        weights = self._take_weights()
        scales, inv_sizes, valid, total = [], [], [], 0.0
        for w in weights:
            total += w
            kept = total > 0  # micro-batches of weight 0 so far (every label masked): no point
            scales.append(1.0 / (total * total) if kept else 0.0)
            inv_sizes.append(sum(weights) / (len(weights) * micro_batch * total) if kept else 0.0)
            valid.append(float(kept))
        per_rank = torch.tensor([*scales, *inv_sizes, *valid, total], dtype=f64).to(dev)
        # One SUM all-reduce: the local points (averaged below), the values to average, and one
        # slot per rank for each value to max (a max via a sum of one-hot slots: no second op).
        means = [torch.as_tensor(v, device=dev).to(f64).reshape(1) for v in rank_mean]
        slots = torch.zeros(world * n_max, dtype=f64, device=dev)
        if n_max:
            rank = torch_dist.get_rank()
            slots[rank * n_max : (rank + 1) * n_max] = torch.tensor(
                [float(v) for v in rank_max], dtype=f64
            ).to(dev)
        vec = torch.cat([local * per_rank[:k], per_rank[k:], local[-1:], *means, slots])
        torch_dist.all_reduce(vec, group=group)
        # DDP: the last backward's .grad is already the global mean, the same on every rank
        host = torch.cat([vec, synced]).cpu().tolist()
        points, inv_b, n_valid = host[:k], host[k : 2 * k], host[2 * k : 3 * k]
        mean_total, raw_last = host[3 * k] / world, host[3 * k + 1] / world
        rest = host[3 * k + 2 :]
        inv_scale2 = 1.0 / (grad_scale * grad_scale)
        sq_norms, sizes = [], []
        for p, x, n in zip(points, inv_b, n_valid, strict=True):
            if n:
                sq_norms.append(p / n * inv_scale2)
                sizes.append(n / x)
        if own_grads:  # the norm reported: the ranks' RMS of their own full gradients
            global_sq = raw_last
        else:
            # the all-reduced .grad: the ranks' mean of Σ_j w_j·g_j, the global weighted mean
            # times the ranks' mean weight
            global_sq = rest[-1]
            sq_norms.append(global_sq / mean_total**2 * inv_scale2)
            sizes.append(micro_batch * k * world)
        n_mean = len(means)
        slot_values = rest[n_mean : n_mean + world * n_max]
        return StepGradStats(
            grad_norm=math.sqrt(global_sq * inv_scale2),
            batch_sizes=sizes,
            sq_norms=sq_norms,
            rank_means=[v / world for v in rest[:n_mean]],
            rank_maxes=[
                max(slot_values[r * n_max + i] for r in range(world)) for i in range(n_max)
            ],
        )
