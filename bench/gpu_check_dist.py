"""NCCL part of the GPU check (2+ GPUs): the reference GPT trained a few steps from the same seed
on the same data under DDP and under FSDP2, both through rampwatch's Monitor into one database;
prints the per-step noise-scale figures of each with their relative difference, and the peak
memory per device of each beside the fake-tensor plan's replica prediction for the DDP tier.

    torchrun --standalone --nproc_per_node=N -m bench.gpu_check_dist            # gpu-0.7b, nccl
    torchrun --standalone --nproc_per_node=2 -m bench.gpu_check_dist --cpu-smoke   # test-tiny, gloo

Why: with accumulation k ≥ 2 and FSDP2 told not to sync before the last micro-step
(set_requires_gradient_sync(False)), the monitor's points are DDP's (monitor/gradstats.py,
"FSDP2"), so the logged |G|², tr(Σ) and B_simple per step must equal DDP's within float
rounding (the two wrappers reduce in another order; bf16 autocast widens that). tests/test_fsdp.py
shows it on gloo with a two-layer model; this runs it on NCCL with the GPT.

Each run: torch.manual_seed(0) builds the GPT on this rank's device, wrapped in
DistributedDataParallel or with fully_shard on every block and on the root; AdamW (lr 1e-4),
clip 1.0; `--steps` optimizer steps of `--accum` micro-batches of `--batch` sequences, micro-step
j of rank r taking the r-th of W slices of the same seeded random tokens. The peak per device is
the monitor's logged mem_peak (CUDA: max_memory_reserved since the previous step, maxed over
ranks; CPU: the process's peak RSS, which holds the interpreter and the earlier run, so not the
plan's figure); on CUDA the peak allocated (what the plan models) is read before each step() and
maxed over ranks too. The plan (trainer/gpt_plan.py start_plan: one process, no DDP buckets)
runs in a child of rank 0 beside the training. FSDP2's peak is measured only: the planner models
a replica. Rank 0 checks the figures agree within --rtol (|G|² on the scale of its points,
|G|² + tr(Σ)/b) and the exit status says so (0 agree, 1 not, 2 cannot run).
Budget: the whole device check has 15 minutes of device time, the one-GPU part 8 of them;
this part keeps to --budget-s (default 150 s, scripts/gpu_check.sh stops it at 180 s with
torchrun's start): the FSDP2 run is skipped, and the check fails saying so, when the time left
after DDP is under twice the DDP run's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rampwatch import store
from rampwatch.advisor.gns_window import NoiseScaleWindow
from rampwatch.monitor import Monitor
from rampwatch.store import names as M
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.gpt_plan import _model_config, start_plan
from rampwatch.trainer.model import GPT, configure_optimizer

WRAPS = ("ddp", "fsdp2")
NOISE = (M.GNS_G2, M.GNS_TRACE, M.GNS_RAW, M.GNS)  # per step; GNS (windowed) from step 3
LABEL = {M.GNS_G2: r"\|G\|²", M.GNS_TRACE: "tr(Σ)", M.GNS_RAW: "B_simple", M.GNS: "B_simple window"}


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="default gpu-0.7b (CUDA), test-tiny (CPU)")
    ap.add_argument("--batch", type=int, default=None, help="per-device micro-batch (8; CPU 2)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step, at least 2")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run, at least 3")
    ap.add_argument("--amp", default=None, choices=["bf16", "none"], help="bf16 on CUDA")
    ap.add_argument("--rtol", type=float, default=None, help="agreement (1e-4; bf16 2e-2)")
    ap.add_argument("--db", default=None, help="database file (default: a temporary one)")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--cpu-smoke", action="store_true", help="test-tiny, gloo, on the CPU")
    a = ap.parse_args(argv)
    if a.accum < 2:
        ap.error("--accum must be at least 2 (no local running sums to compare otherwise)")
    if a.steps < 3:
        ap.error("--steps must be at least 3 (the windowed B_simple starts at step 3)")
    if a.preset is not None and a.preset not in PRESETS:
        ap.error(f"unknown --preset {a.preset!r} (one of {', '.join(PRESETS)})")
    cuda = not a.cpu_smoke
    a.device_type = "cuda" if cuda else "cpu"
    a.preset = a.preset or ("gpu-0.7b" if cuda else "test-tiny")
    a.batch = a.batch or (8 if cuda else 2)
    if a.batch < 1:
        ap.error("--batch must be positive")
    a.amp = a.amp or ("bf16" if cuda else "none")
    a.rtol = a.rtol or (2e-2 if a.amp == "bf16" else 1e-4)
    return a


def _data(cfg, a, world: int):
    """(inputs, targets): every micro-batch of every rank and step, from one seeded generator."""
    g = torch.Generator().manual_seed(1)
    n = a.steps * a.accum * world * a.batch
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _wrap(wrap: str, model: torch.nn.Module, dev: torch.device):
    if wrap == "ddp":
        ids = [dev.index] if dev.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def run(wrap: str, a, db: str, dev: torch.device, rank: int, world: int) -> dict:
    """Train one wrapping; {"run_id" (rank 0), "wall_s", "peak_allocated" (CUDA, max over
    ranks)}."""
    mcfg = _model_config(PRESETS[a.preset].to_dict(), "plain")
    xs, ys = _data(mcfg, a, world)
    amp = torch.bfloat16 if a.amp == "bf16" else None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    dist.barrier()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(mcfg).train()
    train = _wrap(wrap, model, dev)
    opt = configure_optimizer(model, "adamw", lr=1e-4)
    mon = Monitor.start(
        db,
        name=f"gpu-check-dist {wrap}",
        config={"preset": a.preset, "wrap": wrap, "amp": a.amp},
        model=train,
        optimizer=opt,
        per_device_batch=a.batch,
        accum=a.accum,
        seq_len=mcfg.seq_len,
        lr_rule="sqrt",
        noise_window=NoiseScaleWindow(min_steps=3),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    peak_alloc = 0
    k = a.accum
    for step in range(1, a.steps + 1):
        total = torch.zeros((), device=dev)
        for j in range(k):
            last = j == k - 1
            i = ((step - 1) * k + j) * world * a.batch + rank * a.batch
            x, y = xs[i : i + a.batch].to(dev), ys[i : i + a.batch].to(dev)
            if wrap == "fsdp2":
                model.set_requires_gradient_sync(last)
            ctx = train.no_sync() if wrap == "ddp" and not last else contextlib.nullcontext()
            with ctx:
                with torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext():
                    loss = train(x, y)
                (loss / k).backward()
            mon.after_backward()
            total += loss.detach() / k
        if dev.type == "cuda":  # the window the monitor's step() reads and resets
            peak_alloc = max(peak_alloc, torch.cuda.max_memory_allocated(dev))
        mon.step(step, loss=total)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    run_id = mon.run_id
    mon.finish()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    peak = torch.tensor([peak_alloc], dtype=torch.float64, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.barrier()
    out = {"run_id": run_id, "wall_s": time.perf_counter() - t0, "peak_allocated": peak.item()}
    del mon, opt, train, model, params, total, loss
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _per_step(db: str, run_id: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {n: {} for n in (*NOISE, M.MEM_PEAK, M.LOSS)}
    for row in store.export(db, run_id).to_pylist():
        if row["name"] in out:
            out[row["name"]][row["step"]] = row["value"]
    return out


def _differences(name: str, a: float, b: float, trace: float, batch: int) -> tuple[float, float]:
    """(relative, on the points' scale) difference of FSDP2's b from DDP's a. |G|² is a small
    difference of points |G|² + tr(Σ)/(j·b), so it is compared on their scale |G|² + tr(Σ)/b;
    B_simple = tr(Σ)/|G|² through 1/B_simple on (|G|² + tr(Σ)/b)/tr(Σ) = 1/B_simple + 1/b,
    the same scale made dimensionless."""
    rel = (b - a) / abs(a) if a else float("inf")
    if name == M.GNS_G2:
        scale = abs(a) + abs(trace) / batch
        return rel, (b - a) / scale if scale else float("inf")
    if name in (M.GNS_RAW, M.GNS):
        if not (a and b):
            return rel, float("inf")
        return rel, (1 / a - 1 / b) / (abs(1 / a) + 1 / batch)
    return rel, rel


def noise_table(logged: dict, batch: int, rtol: float) -> list[str]:
    """Prints markdown rows (metric, step, DDP, FSDP2, relative difference, difference on the
    points' scale); returns the failures: a value missing, or a scaled difference over rtol."""
    ddp, fsdp = logged["ddp"], logged["fsdp2"]
    print("\n| metric | step | DDP | FSDP2 | relative difference | on the points' scale |")
    print("|---|---:|---:|---:|---:|---:|")
    bad = []
    for name in NOISE:
        steps = sorted(set(ddp[name]) | set(fsdp[name]))
        if not steps:
            bad.append(f"{LABEL[name]}: not logged")
        for s in steps:
            a, b = ddp[name].get(s), fsdp[name].get(s)
            if a is None or b is None:
                print(f"| {LABEL[name]} | {s} | {a} | {b} | missing | missing |")
                bad.append(f"{LABEL[name]} step {s}: missing")
                continue
            rel, scaled = _differences(name, a, b, ddp[M.GNS_TRACE].get(s, 0.0), batch)
            print(f"| {LABEL[name]} | {s} | {a:.6g} | {b:.6g} | {rel:+.2e} | {scaled:+.2e} |")
            if not abs(scaled) <= rtol:
                bad.append(f"{LABEL[name]} step {s}: {scaled:+.2e}")
    return bad


UNIT = ["GB", 1e9]  # MB in the CPU smoke run, whose figures are megabytes


def _gb(n) -> str:
    return "-" if n is None else f"{n / UNIT[1]:.2f}"


def memory_table(logged: dict, results: dict, plan_rows, cuda: bool) -> None:
    U = UNIT[0]
    unit = f"peak reserved {U}" if cuda else f"peak RSS {U} (whole process)"
    row = (plan_rows or [{}])[0]
    plan = row.get("predicted_bytes")
    plan_txt = _gb(plan) if plan else f"- ({row.get('error') or 'no plan'})"
    print(
        f"\n| wrapping | measured {unit}, max over ranks | measured peak allocated {U} | "
        f"plan {U} (one replica, allocated) |"
    )
    print("|---|---:|---:|---|")
    for wrap in WRAPS:
        if wrap not in logged:
            print(f"| {wrap} | not run | - | - |")
            continue
        peaks = logged[wrap][M.MEM_PEAK].values()
        measured = max(peaks) if peaks else None
        alloc = results[wrap]["peak_allocated"] if cuda else None
        if wrap == "ddp":
            err = f" ({(plan - alloc) / alloc:+.1%} vs allocated)" if plan and alloc else ""
            cell = f"{plan_txt}{err}"
        else:
            cell = "measured only (the plan models a replica)"
        print(f"| {wrap} | {_gb(measured)} | {_gb(alloc)} | {cell} |")
    if not cuda:
        print("\n(CPU: RSS holds the interpreter and the earlier run; not comparable to the plan)")


def _report(a, db: str, results: dict, plan_rows, world: int, name: str) -> int:
    logged = {w: _per_step(db, r["run_id"]) for w, r in results.items()}
    print(
        f"### GPU check, NCCL part: `{a.preset}` on {world} × {name}, "
        f"{'nccl' if a.device_type == 'cuda' else 'gloo'}, amp {a.amp}, torch {torch.__version__}"
    )
    print(
        f"\nper-device batch {a.batch}, accumulation {a.accum}, {a.steps} steps, "
        f"tier {a.batch}×{a.accum}×{world} = {a.batch * a.accum * world} sequences; "
        f"FSDP2 syncs at the last micro-step only; tolerance {a.rtol:g}"
    )
    bad = []
    if "fsdp2" in logged:
        bad = noise_table(logged, a.batch, a.rtol)
    else:
        bad = ["FSDP2 not run (budget)"]
    memory_table(logged, results, plan_rows, a.device_type == "cuda")
    print("\n| wrapping | wall s (build, steps, finish) |\n|---|---:|")
    for wrap, r in results.items():
        print(f"| {wrap} | {r['wall_s']:.1f} |")
    print("\nDDP and FSDP2 agree" if not bad else "\nDISAGREE: " + "; ".join(bad))
    return 0 if not bad else 1


def main(argv=None) -> int:
    a = _args(argv)
    t_start = time.monotonic()
    if "LOCAL_RANK" not in os.environ:
        print(
            "gpu_check_dist: run it under torchrun "
            "(torchrun --standalone --nproc_per_node=N -m bench.gpu_check_dist)",
            file=sys.stderr,
        )
        return 2
    cuda = a.device_type == "cuda"
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
            print("gpu_check_dist: no CUDA device for this rank (--cpu-smoke)", file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not cuda:
        UNIT[:] = ["MB", 1e6]
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = tempfile.TemporaryDirectory(prefix="gpu-check-dist-") if a.db is None else None
    db = a.db or str(Path(tmp.name) / "runs.duckdb")
    handle = None
    if rank == 0:  # the plan beside the training, as the trainer runs it
        handle = start_plan(
            PRESETS[a.preset].to_dict(),
            [a.batch],
            "adamw",
            a.device_type,
            ("plain",),
            amp=a.amp if a.amp != "none" else None,
            accum_steps=a.accum,
            timeout_s=max(30.0, a.budget_s - 20),
        )
    results = {"ddp": run("ddp", a, db, dev, rank, world)}
    left = a.budget_s - (time.monotonic() - t_start)
    go = torch.tensor([float(left > 2 * results["ddp"]["wall_s"])], device=dev)
    dist.broadcast(go, 0)  # every rank makes rank 0's choice
    if go.item():
        results["fsdp2"] = run("fsdp2", a, db, dev, rank, world)
    status = 0
    if rank == 0:
        left = a.budget_s - (time.monotonic() - t_start)
        plan_rows = handle.result(timeout=max(1.0, left - 5))
        if plan_rows is None:
            handle.cancel()
        name = torch.cuda.get_device_name(dev) if cuda else "CPU"
        status = _report(a, db, results, plan_rows, world, name)
        print(f"\ntotal {time.monotonic() - t_start:.0f} s (budget {a.budget_s:.0f} s)")
    code = torch.tensor([float(status)], device=dev)
    dist.broadcast(code, 0)
    dist.destroy_process_group()
    if tmp is not None:
        tmp.cleanup()
    return int(code.item())


if __name__ == "__main__":
    sys.exit(main())
