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
last included (no DDP hook attached): all k points are local, DDP's k local points. The global
one exists only inside the optimizer's step(), reduce-scattered: when the optimizer hands its
averaged shards to `add_reduced` (Monitor.reduced_grad), |shard|² summed over ranks is the
global point, one more slot of the same all-reduce, and the points are exactly DDP's. Without
it the fit has the local points only; with k = 1 there is then one batch size and nothing to
fit. A loop that all-reduces .grad itself before after_backward() breaks that assumption: wrap
the model in DDP instead.

Micro-batches weighted other than 1/k (Hugging Face's num_items_in_batch divides each summed
token loss by the step's token count) pass their weight to after_backward; the points are then
token-weighted means over the tokens behind them. Under several ranks each rank passes the
weights of its own micro-batches (under Hugging Face they differ between ranks): each rank's
points are its own means before they are averaged, at the ranks' mean 1/B, and a global point
divides the synced .grad by the ranks' mean weight so far.

FSDP2 (`fully_shard`, monitor/fsdp_norms.py: where each figure comes from) gives the same kinds
of point. A backward that syncs reduce-scatters this rank's local gradient of the micro-batches
since the last sync (`attach_fsdp`'s reduce-scatter takes its |.|², the analog of RankNormHook)
and leaves the global running sum sharded in .grad: |shard|² summed over ranks is |.grad|²,
one more slot of the same all-reduce. A backward that does not sync
(`set_requires_gradient_sync(False)`) leaves this rank's running sum unsharded, read after it.
So each backward j gives a local point over the micro-batches since the last synced backward,
and each synced one a global point over all j·b·W sequences so far:
- sync only at the last backward (no-sync on j < k): local running sums (j·b, j <= k) and the
  global point (k·b·W): exactly DDP's points, so the same data and weights log the same
  |G|², tr(Sigma) and B_simple as under DDP.
- sync every backward (FSDP2's default): each micro-batch's local gradient is reduce-scattered
  and freed before the next backward adds to it (post_backward), so the local running sums
  S_j, j >= 2, never exist on any rank. The points are instead the k single micro-batches
  (b, rank averages) and the k global running sums (j·b·W). Each has the same expectation
  |G|^2 + tr(Sigma)/B as DDP's, and least squares is unbiased for any correlation of the
  points (advisor/gns.py line_estimates), so the estimates agree with DDP's in expectation,
  not step by step: other batch sizes, other noise. With k = 1 both lists are DDP's.
The logged gradient norm is sqrt of the summed |shard|², the global norm, as under DDP.
FSDP2 on one rank runs no reduce-scatter and its .grad is the whole gradient: the single
process case. What cannot be measured sets `sharded`, with the reason in `sharded_why`:
FSDP1's flat parameters, DeepSpeed ZeRO (no .grad), DTensor gradients without FSDP2 (tensor
parallel), FSDP2 on a 2-D mesh (HSDP) or reducing in a dtype it pre-divides (fp16, fp64).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as torch_dist

from rampwatch.monitor.fsdp_norms import Fsdp2Norms


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
        return math.isfinite(self.grad_norm) and all(map(math.isfinite, self.sq_norms))


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
    # tensor parallelism (FSDP2 is attached instead): DTensor gradients hold this rank's shard
    return type(t).__name__ == "DTensor"


# after_backward() found every .grad None: called before backward or after zero_grad(), or
# ZeRO-2/3, which keeps gradients in its own buffers. The monitor words it (the loop's order
# first): nothing here can tell the two apart.
NO_GRAD = "no .grad after a backward"


def _sharded(params) -> str | None:
    """Why the norm of .grad would not be the gradient's: FSDP1's flat parameters, DeepSpeed's
    partitioned parameters, or NO_GRAD; None when .grad is whole."""
    if any(type(p).__name__ == "FlatParameter" for p in params):
        return "FSDP1's flat parameters hold a shard of .grad per rank"
    if any(getattr(p, "ds_id", None) is not None for p in params):
        return "DeepSpeed ZeRO keeps its gradients partitioned"
    if all(p.grad is None for p in params):
        return NO_GRAD
    return None


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
        self.sharded = False  # set when .grad is sharded (FSDP1, ZeRO): no norm is taken
        self.sharded_why = ""  # what made it so, for the alert
        self.rank_hook: RankNormHook | None = None  # set by attach_ddp (world size > 1)
        self.fsdp: Fsdp2Norms | None = None  # set by attach_fsdp
        self._synced: dict[int, torch.Tensor] = {}  # FSDP2: backward index -> |shard of .grad|²
        self._reduced: torch.Tensor | None = None  # add_reduced: |this rank's averaged shards|²

    def attach_ddp(self, ddp_model, process_group=None) -> None:
        """Register the per-rank norm hook on a DistributedDataParallel model (before its first
        backward). Without it, collect(world_size > 1) takes every .grad as the rank's own."""
        self.rank_hook = RankNormHook(process_group)
        self.rank_hook.register(ddp_model)

    def attach_fsdp(self, model, world_size: int) -> None:
        """Wrap the reduce-scatter of every FSDPModule of an FSDP2 model (before its first
        backward); or, where its gradients cannot be measured, mark them sharded and say why."""
        try:
            norms = Fsdp2Norms.attach(model, world_size)
        except Exception as e:  # an FSDP2 the monitor does not know: no noise scale, no crash
            norms = f"the monitor could not attach to FSDP2: {type(e).__name__}: {e}"
        if isinstance(norms, str):
            self.mark_sharded(norms)
        else:
            self.fsdp = norms

    def mark_sharded(self, why: str) -> None:
        """Nothing is measured from now on; `why` names the first cause."""
        self.sharded = True
        self.sharded_why = self.sharded_why or why

    def after_backward(self, weight: float | torch.Tensor | None = None) -> None:
        """weight: the factor this micro-batch's mean loss was multiplied by before backward,
        when it is not 1/k (e.g. n_tokens_j / n_tokens_step, Hugging Face's num_items_in_batch).
        """
        if self.sharded:
            return
        if self.fsdp is not None:
            self._record_fsdp(weight)
            return
        grads = self._local_grads()
        if not grads:
            why = _sharded(self.params)
            if why:
                self.mark_sharded(why)
            return
        self._sq_norms.append(_squared_norm(grads))
        self._weights.append(weight)

    def _record_fsdp(self, weight) -> None:
        """FSDP2: this backward's local point and, when it synced, its shard of the global one."""
        fsdp = self.fsdp
        seen = fsdp.take()  # the local gradient this backward reduce-scattered
        if not fsdp.undivided or fsdp.failed:
            self.mark_sharded(
                f"FSDP2's reduce-scatter input gave no norm ({fsdp.failed})"
                if fsdp.failed
                else "FSDP2 reduces in a dtype it divides before the reduce-scatter (float16, "
                "float64), so the local norm is not the gradient's"
            )
            return
        shard = None
        if seen is not None:
            local, shard = seen, fsdp.shard_sq(_squared_norm)
        else:  # no sync: the rank's running sum, unsharded; one rank: .grad is all of it
            local = fsdp.unsharded_sq(_squared_norm)
            if local is None and fsdp.world == 1:
                local = fsdp.shard_sq(_squared_norm)
        if local is None or (seen is not None and shard is None):
            self.mark_sharded(
                "FSDP2 left neither a reduce-scattered nor an unsharded gradient to read "
                "(a reduce-scatter set after Monitor.start, or torch's internals changed)"
            )
            return
        if shard is not None:
            self._synced[len(self._sq_norms)] = shard
        self._sq_norms.append(local)
        self._weights.append(weight)

    def add_reduced(self, shards) -> bool:
        """A loop that syncs inside its optimizer: this rank's part of the rank-averaged
        gradient of the step whose backwards were recorded (no DDP, no FSDP2). False, and
        nothing kept, when there is no such step: the shards came after collect()."""
        if not self._sq_norms or self.rank_hook is not None or self.fsdp is not None:
            return False
        sq = _squared_norm([s.detach() for s in shards])
        self._reduced = sq if self._reduced is None else self._reduced + sq
        return True

    def record_final(self) -> bool:
        """For a loop that never calls after_backward: .grad as it stands at the optimizer step
        becomes the step's one point, so collect() still gives the gradient norm (one point: no
        noise scale). False when there is no .grad to read."""
        if self.fsdp is not None:
            self._record_fsdp(None)
            return not self.sharded
        grads = self._local_grads()
        if grads:
            self._sq_norms.append(_squared_norm(grads))
            self._weights.append(None)
        return bool(grads)

    def _local_grads(self) -> list[torch.Tensor]:
        """The .grad tensors whose norm is the gradient's; none once they are known sharded."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and not self.sharded and _is_sharded_tensor(grads[0]):
            self.mark_sharded("DTensor gradients without FSDP2 (tensor parallel) are shards")
        return [] if self.sharded else grads

    def reset(self) -> None:
        """Forget the partial sums of an abandoned step (e.g. after an out-of-memory retry)."""
        self._sq_norms.clear()
        self._weights.clear()
        self._synced.clear()
        self._reduced = None
        if self.rank_hook is not None:
            self.rank_hook.take()
        if self.fsdp is not None:
            self.fsdp.take()

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
        # tolist() widens any float dtype to a Python float exactly: no .double() copy needed
        raw = torch.stack(self._sq_norms).cpu().tolist()
        scales, inv_sizes, valid = _step_scales(tuple(self._take_weights()), micro_batch)
        inv_scale2 = 1.0 / (grad_scale * grad_scale)
        sq_norms = [v * c * inv_scale2 for v, c, n in zip(raw, scales, valid, strict=True) if n]
        sizes = [1.0 / x for x, n in zip(inv_sizes, valid, strict=True) if n]
        # the norm the clipper sees: .grad itself, loss scale undone
        return StepGradStats(
            grad_norm=math.sqrt(raw[-1]) / grad_scale, batch_sizes=sizes, sq_norms=sq_norms
        )

    def _take_weights(self) -> list[float]:
        weights = self._step_weights(len(self._sq_norms))
        self._sq_norms.clear()
        self._weights.clear()
        self._synced.clear()
        self._reduced = None
        return weights

    def _rank_points(self):
        """(this rank's local points, global values to sum over ranks, a global value already
        summed, the process group) of the step, by who synced the gradients."""
        if self.fsdp is not None:  # FSDP2: each synced backward's shard of the global point
            last = len(self._sq_norms) - 1
            if last not in self._synced:
                raise RuntimeError(
                    "collect(world_size > 1): under FSDP2 the step's last backward did not "
                    "sync its gradients (set_requires_gradient_sync(True) before it)"
                )
            return torch.stack(self._sq_norms), dict(self._synced), None, None
        if self.rank_hook is None:  # no DDP: every point is this rank's own, and the global
            # one the optimizer's reduce-scatter handed over, as shards
            last = {} if self._reduced is None else {len(self._sq_norms) - 1: self._reduced}
            return torch.stack(self._sq_norms), last, None, None
        local_full = self.rank_hook.take()
        if local_full is None:
            raise RuntimeError(
                "collect(world_size > 1): the DDP norm hook saw no gradient this step "
                "(attach_ddp(ddp_model) before the first backward)"
            )
        # DDP: the last backward's .grad is already the global mean, the same on every rank
        local = torch.stack([*self._sq_norms[:-1], local_full])
        return local, {}, self._sq_norms[-1], self.rank_hook.process_group

    def _collect_ddp(
        self, micro_batch: int, grad_scale: float, world: int, rank_mean, rank_max
    ) -> StepGradStats:
        local, to_sum, summed, group = self._rank_points()
        dev, f64 = local.device, torch.float64
        local = local.to(f64)
        k, n_max, synced = len(self._sq_norms), len(rank_max), sorted(to_sum)
        weights = self._take_weights()
        # the global points: FSDP2's synced backwards, or DDP's all-reduced last one
        global_at = [k - 1] if summed is not None else synced
        scales, inv_sizes, valid = _rank_scales(weights, micro_batch, frozenset(global_at))
        totals = list(itertools.accumulate(weights))
        per_rank = [*scales, *inv_sizes, *valid, *(totals[j] for j in global_at)]
        per_rank = torch.tensor(per_rank, dtype=f64).to(dev)
        # One SUM all-reduce: each rank's local points as its own means, their 1/B and count,
        # its weight behind each global point, its last raw value, the shards of the global
        # points (FSDP2: a squared norm is the sum of its shards'), the values to average, and
        # one slot per rank for each value to max (a max via a sum of one-hot slots).
        shards = [to_sum[j].to(dev, f64).reshape(1) for j in synced]
        means = [torch.as_tensor(v, device=dev).to(f64).reshape(1) for v in rank_mean]
        slots = torch.zeros(world * n_max, dtype=f64, device=dev)
        if n_max:
            rank = torch_dist.get_rank()
            slots[rank * n_max : (rank + 1) * n_max] = torch.tensor(
                [float(v) for v in rank_max], dtype=f64
            ).to(dev)
        vec = torch.cat([local * per_rank[:k], per_rank[k:], local[-1:], *shards, *means, slots])
        torch_dist.all_reduce(vec, group=group)
        tail = [] if summed is None else [summed.to(dev, f64).reshape(1)]
        host = torch.cat([vec, *tail]).cpu().tolist()
        g, n_shard, n_mean = len(global_at), len(shards), len(means)
        points, inv_b, n_valid = host[:k], host[k : 2 * k], host[2 * k : 3 * k]
        mean_totals = [v / world for v in host[3 * k : 3 * k + g]]
        raw_last = host[3 * k + g] / world  # the ranks' mean of their own last |.grad|²
        rest = host[3 * k + g + 1 :]
        global_raw = [host[-1]] if summed is not None else rest[:n_shard]
        inv_scale2 = 1.0 / (grad_scale * grad_scale)
        sq_norms, sizes = [], []
        for p, x, n in zip(points, inv_b, n_valid, strict=True):
            if n:  # each over the micro-batches since the last sync on every rank
                sq_norms.append(p / n * inv_scale2)
                sizes.append(n / x)
        for j, value, total in zip(global_at, global_raw, mean_totals, strict=True):
            if total > 0:  # all micro-batches so far on every rank
                sq_norms.append(value / (total * total) * inv_scale2)
                sizes.append(micro_batch * (j + 1) * world)
        # the norm reported: the global gradient's; without a sync, the ranks' RMS of their own
        last_sq = global_raw[-1] if global_at else raw_last
        slot_values = rest[n_shard + n_mean : n_shard + n_mean + world * n_max]
        return StepGradStats(
            grad_norm=math.sqrt(last_sq * inv_scale2),
            batch_sizes=sizes,
            sq_norms=sq_norms,
            rank_means=[v / world for v in rest[n_shard : n_shard + n_mean]],
            rank_maxes=[
                max(slot_values[r * n_max + i] for r in range(world)) for i in range(n_max)
            ],
        )


@lru_cache(maxsize=64)
def _step_scales(weights: tuple[float, ...], micro_batch: int) -> tuple[tuple[float, ...], ...]:
    """_rank_scales of a step on one device, kept: a loop that passes no weights has the same
    ones every step."""
    return tuple(map(tuple, _rank_scales(weights, micro_batch, frozenset())))


def _rank_scales(weights: list[float], micro_batch: int, restart_after: frozenset[int]):
    """Per backward j of this rank: the factor that makes |.grad|² the squared norm of a mean
    gradient (1 / the weight behind it, squared), that mean's 1/B, and 1 where there is a point
    (0 while every weight so far is 0: every label masked).

    .grad after backward j = Σ_{i<=j} w_i·g_i (g_i: micro-batch i's mean gradient), so
    .grad / W_j is the mean gradient over the W_j / w̄ micro-batches behind it: with w = 1/k that
    is S_j/j over j·b sequences; with token weights, a token-weighted mean. restart_after: the
    backwards after which the sum starts again from zero (FSDP2 frees the local gradient it
    reduce-scatters), so a point holds the micro-batches since."""
    scales, inv_sizes, valid, total = [], [], [], 0.0
    mean_w = sum(weights) / len(weights)
    for j, w in enumerate(weights):
        total += w
        kept = total > 0
        scales.append(1.0 / (total * total) if kept else 0.0)
        inv_sizes.append(mean_w / (micro_batch * total) if kept else 0.0)
        valid.append(float(kept))
        if j in restart_after:
            total = 0.0
    return scales, inv_sizes, valid
