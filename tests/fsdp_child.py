"""An own loop under two gloo ranks that trains the same tiny model on the same data several
times, each run wrapped another way, through rampwatch.Monitor into one database
(tests/test_fsdp.py):

    torchrun --standalone --nproc_per_node=2 -m tests.fsdp_child DB RUN [RUN …]

RUN is WRAP:K[:OPTION…], K the accumulation: `ddp` (DistributedDataParallel, no_sync on the
micro-steps before the last), `zero` (the same with ZeroRedundancyOptimizer), `fsdp-nosync`
(fully_shard on the first layer and the root, set_requires_gradient_sync(False) before the
last micro-step), `fsdp-sync` (FSDP2's default: every backward reduce-scatters) and `nanochat`
(no wrapper: the optimizer reduce-scatters the gradients in step(), as nanochat's does, and hands
its shards to mon.reduced_grad; mon.step() after it); `compile`
wraps the FSDP2 model in torch.compile (eager backend: no C++ compiler needed), `bf16` gives it
MixedPrecisionPolicy(bfloat16, float32), `f64` trains it in float64, `no-after-backward` is a
loop that never calls mon.after_backward(), `frozen` runs FROZEN_STEPS steps at LR 0 and rank 0
prints the weights' true |G|² and tr(Σ) from per-example gradients of POPULATION fresh examples
(`TRUTH RUN g2 trace`). Each run is
named after its RUN. Every step, rank 0 prints the brute-force points the monitor's fit must go
through, from a plain copy of the model with the same weights and per-rank autograd:
`POINTS RUN STEP [[batch, |mean gradient|²], …]`.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.distributed as dist

from rampwatch import Monitor
from rampwatch.advisor.gns_window import NoiseScaleWindow
from tests.procs import free_ddp

B, STEPS, LR = 16, 4, 0.05  # per-device batch, optimizer steps, SGD learning rate
FROZEN_STEPS, POPULATION = 400, 200_000


def model_and_data(n: int, seed: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return model, x, x[:, :1] * 2 + 0.3 * torch.randn(n, 1, generator=g)


def true_noise(model) -> tuple[float, float]:
    """(|G|², tr(Σ)) of the mean-squared-error gradient at these weights, from per-example
    gradients of POPULATION examples the runs never see: tr(Σ) = E|g_i|² − |G|²."""
    from torch.func import functional_call, grad, vmap

    _, x, y = model_and_data(POPULATION, seed=2)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi[None],))
        return torch.nn.functional.mse_loss(out, yi[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.double().flatten(1) for g in per_example.values()], dim=1)
    mean = flat.mean(0)
    g2 = float(mean.square().sum())
    return g2, float(flat.square().sum(1).mean()) - g2


def sync_in_step(optimizer_cls):
    """optimizer_cls with nanochat's structure: .grad stays this rank's own until step(), which
    reduce-scatters the flat gradient (mean over ranks), hands this rank's shard to the monitor
    (mon_of(): the Monitor, once it exists) and all-gathers the shards back before the update."""

    class SyncInStep(optimizer_cls):
        def __init__(self, params, mon_of, **kw):
            super().__init__(params, **kw)
            self.mon_of = mon_of

        @torch.no_grad()
        def step(self, closure=None):
            params = [p for g in self.param_groups for p in g["params"]]
            world = dist.get_world_size()
            flat = torch.cat([p.grad.flatten() for p in params])
            flat = torch.cat([flat, flat.new_zeros(-len(flat) % world)])
            shard = flat.new_empty(len(flat) // world)
            dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.AVG)
            self.mon_of().reduced_grad(shard)
            dist.all_gather_into_tensor(flat, shard)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            return super().step(closure)

    SyncInStep.__name__ = f"ReduceScatter{optimizer_cls.__name__}"
    return SyncInStep


def wrapped(wrap: str, model, options: list[str], mon_of):
    """(model to train, optimizer)."""
    if wrap == "nanochat":
        return model, sync_in_step(torch.optim.SGD)(model.parameters(), mon_of, lr=LR)
    if wrap.startswith("fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if "bf16" in options else None
        kw = {"mp_policy": mp} if mp else {}
        fully_shard(model[0], **kw)
        fully_shard(model, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        return (torch.compile(model, backend="eager") if "compile" in options else model), opt
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if wrap == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=LR)
    return ddp, torch.optim.SGD(model.parameters(), lr=LR)


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def brute_points(ref, xs, ys, sync_every: bool, world: int) -> list[list[float]]:
    """The points by hand: this rank's micro-batch gradients g_j of the plain model, the local
    ones averaged over ranks, the global ones summed over ranks (in float64)."""
    k = len(xs)
    grads = []
    for x, y in zip(xs, ys, strict=True):
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        grads.append(flat_grad(ref))
    local_sums = grads if sync_every else list(torch.stack(grads).cumsum(0))
    local = torch.stack([s.square().sum() for s in local_sums])
    dist.all_reduce(local)
    points = []
    for j, value in enumerate((local / world).tolist()):
        n = 1 if sync_every else j + 1
        points.append([B * n, value / n**2])
    glob = torch.stack(grads)
    dist.all_reduce(glob)
    running = (glob / world).cumsum(0)
    for j in range(k) if sync_every else [k - 1]:
        points.append([B * (j + 1) * world, float(running[j].square().sum()) / (j + 1) ** 2])
    return points


def run(db: str, spec: str, rank: int, world: int) -> None:
    wrap, k, *rest = spec.split(":")
    k, steps = int(k), FROZEN_STEPS if "frozen" in rest else STEPS
    model, x_all, y_all = model_and_data(steps * k * world * B)
    ref, _, _ = model_and_data(1)  # the same weights, never wrapped
    if "f64" in rest:  # FSDP2 divides float64 before its reduce-scatter: not measured
        model, ref, x_all, y_all = model.double(), ref.double(), x_all.double(), y_all.double()
    train, opt = wrapped(wrap, model, rest, lambda: mon)
    if "frozen" in rest:
        for group in opt.param_groups:
            group["lr"] = 0.0
        if rank == 0:
            print("TRUTH", spec, *true_noise(ref), flush=True)
    mon = Monitor.start(
        db,
        name=spec,
        config={},
        model=train,
        optimizer=opt,
        per_device_batch=B,
        accum=k,
        seq_len=1,
        lr_rule="linear",
        noise_window=NoiseScaleWindow(min_steps=3),  # B_simple from step 3 on
    )
    for step in range(1, steps + 1):
        # this rank's micro-batches: micro-step j takes the r-th of world slices of B
        starts = [((step - 1) * k + j) * world * B + rank * B for j in range(k)]
        xs = [x_all[i : i + B] for i in starts]
        ys = [y_all[i : i + B] for i in starts]
        full = {n: getattr(p, "full_tensor", p.detach)() for n, p in model.named_parameters()}
        ref.load_state_dict(full)
        points = brute_points(ref, xs, ys, wrap == "fsdp-sync", world)
        if rank == 0:
            print("POINTS", spec, step, json.dumps(points), flush=True)
        total = torch.zeros(())
        for j, (x, y) in enumerate(zip(xs, ys, strict=True)):
            last = j == k - 1
            if wrap == "fsdp-nosync":
                model.set_requires_gradient_sync(last)
            ctx = (
                train.no_sync()
                if wrap in ("ddp", "zero") and not last
                else contextlib.nullcontext()
            )
            with ctx:
                loss = torch.nn.functional.mse_loss(train(x), y)
                (loss / k).backward()
            if "no-after-backward" not in rest:
                mon.after_backward()
            total += loss.detach() / k
        if wrap == "nanochat":  # the global gradient exists inside opt.step() only
            opt.step()
            mon.step(step, loss=total)
        else:
            mon.step(step, loss=total)
            opt.step()
        opt.zero_grad(set_to_none=True)
    mon.finish()


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    db, specs = argv[0], argv[1:]
    for spec in specs:
        run(db, spec, rank, world)
    free_ddp()  # the runs' DDP models, before the process group
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
