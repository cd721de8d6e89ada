"""GPU check: real training steps of a GPU preset against the fake-tensor memory plan: peak
reserved memory per per-device batch, tokens/s and MFU, plain vs chunked cross-entropy at the
largest batch that fits; prints markdown tables. `--cpu-smoke` runs the same path on the CPU.

    bash scripts/gpu_check.sh                  # gpu-0.7b, batches 8,16,32,64, bf16 autocast
    python bench/gpu_check.py --cpu-smoke      # test-tiny, batches 1,2,4, on the CPU

Order: start the plan in a child process (trainer.gpt_plan.start_plan, as the trainer does), then
measure the plain ladder in ascending batches until one runs out of memory, then chunked CE at
the largest batch that fit and, if the plan says it fits, at the next rung. Each configuration
builds a fresh model: warm steps (optimizer state, cuBLAS handles, cached blocks), then
reset_peak_memory_stats + one step gives the peak (reserved: what decides an OOM; allocated: what
the plan models), then timed steps give tokens/s and MFU, with
FLOPs/token = 6·N_matmul + 12·n_layer·d_model·seq_len (causal attention counted in full).
While the planner child runs, the device's used memory is sampled to see what its CUDA context
costs the training process's GPU. The whole run keeps to --budget-s (default 420 s).
On the CPU the "peak" is VmHWM - VmRSS after resetting the high-water mark (clear_refs), with
MALLOC_MMAP_THRESHOLD_ fixed so freed tensors leave the resident set (see memplan_bench.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

import torch

from bench.memplan_bench import _status_bytes, make_step, slope
from rampwatch.advisor import flops as advisor_flops
from rampwatch.trainer.config import PRESETS, matmul_params
from rampwatch.trainer.gpt_plan import _model_config, calibrate, start_plan
from rampwatch.trainer.model import GPT, configure_optimizer

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def flops_per_token(cfg) -> float:
    return advisor_flops.flops_per_token(matmul_params(cfg), cfg.n_layer, cfg.d_model, cfg.seq_len)


def run_config(
    cfg: dict,
    batch: int,
    variant: str,
    dev: torch.device,
    amp,
    warm: int,
    steps: int,
    peak_flops: float | None,
) -> dict:
    """Peak memory and speed of real steps at one (batch, variant); OOM reported, not raised."""
    mcfg = _model_config(cfg, variant)
    out = {"per_device_batch": batch, "variant": variant, "oom": False}
    model = opt = idx = tgt = step = None
    try:
        torch.manual_seed(0)
        with torch.device(dev):
            model = GPT(mcfg).train()
            idx = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len))
            tgt = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len))
        opt = configure_optimizer(model, "adamw", lr=1e-4)
        step = make_step(model, opt, idx, tgt, amp)

        for _ in range(warm):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            out["peak_reserved"] = torch.cuda.max_memory_reserved()
            out["peak_allocated"] = torch.cuda.max_memory_allocated()
            out["steady_allocated"] = torch.cuda.memory_allocated()
        else:
            gc.collect()
            base = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            step()
            out["peak_step_rss"] = _status_bytes("VmHWM") - base  # what the step added
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        out["step_s"] = dt
        out["tokens_per_s"] = batch * mcfg.seq_len / dt
        out["mfu"] = (
            advisor_flops.mfu(out["tokens_per_s"], flops_per_token(mcfg), peak_flops)
            if peak_flops
            else None
        )
    except OOM:
        out["oom"] = True
    finally:
        del model, opt, idx, tgt, step  # the step's closure held them too
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


class DeviceSampler:
    """Max of (device used - this process's reserved - its baseline): other processes' memory,
    here the planner child's CUDA context."""

    def __init__(self):
        self.stop, self.extra = threading.Event(), 0
        free, total = torch.cuda.mem_get_info()
        self.base = (total - free) - torch.cuda.memory_reserved()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.stop.wait(0.2):
            free, total = torch.cuda.mem_get_info()
            self.extra = max(self.extra, (total - free) - torch.cuda.memory_reserved() - self.base)


UNIT = ["GB", 1e9]  # MB for the CPU smoke run, whose figures are megabytes


def _gb(n) -> str:
    return "-" if n is None else f"{n / UNIT[1]:.2f}"


def _slope(points: dict[int, float]) -> float | None:
    return slope(points) if len(points) >= 2 else None


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpu-0.7b")
    ap.add_argument("--batches", default=None, help="plain ladder (default 8,16,32,64)")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--amp", default="bf16", choices=["bf16", "none"])
    ap.add_argument("--peak-flops", type=float, default=None, help="device peak, FLOP/s")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--cpu-smoke", action="store_true", help="test-tiny, tiny batches, CPU")
    return ap.parse_args(argv)


def _target(a: argparse.Namespace) -> tuple[str, list[int], torch.device] | None:
    """(preset, plain ladder, device); None: no CUDA device and no --cpu-smoke. The CPU smoke
    run restarts itself once with the malloc setting its RSS figures need."""
    if a.cpu_smoke:
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # RSS must follow live tensors
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="16384", OMP_NUM_THREADS="1")
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        preset, ladder, dev = "test-tiny", [1, 2, 4], torch.device("cpu")
        a.warm, a.steps = min(a.warm, 1), min(a.steps, 2)
        UNIT[:] = ["MB", 1e6]
    elif torch.cuda.is_available():
        preset, ladder, dev = a.preset, [8, 16, 32, 64], torch.device("cuda")
    else:
        return None
    if a.batches:
        ladder = [int(x) for x in a.batches.split(",")]
    return preset, ladder, dev


def _plain_ladder(ladder: list[int], handle, measure, left) -> list[dict]:
    """Plain cross-entropy at each batch, ascending, until the first OOM or the budget's end."""
    results = []
    for b in ladder:
        if left() < 60:
            print(f"(budget: skipped plain batch {b} and above)")
            break
        planner_running = not handle.done()
        r = measure(b, "plain")
        if r["oom"] and planner_running and left() > 90:
            # The planner child's CUDA context shares the device: rule it out before calling
            # this batch too big.
            handle.result(timeout=max(1.0, left() - 80))
            r = dict(measure(b, "plain"), note="OOM beside the planner; rerun alone")
        results.append(r)
        if r["oom"]:
            break
    return results


def _comparable(rows: list[dict], dev: torch.device) -> list[dict]:
    """The plan rows as the measurements see them: on the CPU the measured figure is what the
    step adds, so the plan's peak - steady."""
    if dev.type == "cuda":
        return rows
    return [
        dict(r, predicted_bytes=r["predicted_bytes"] - r["steady_bytes"])
        if r["error"] is None
        else r
        for r in rows
    ]


def _calibrated(cmp_rows: list[dict], measured_plain: dict[int, float]) -> dict:
    """{(batch, variant): calibrated bytes}, anchored on the smallest measured plain batch;
    empty when nothing was measured or a plan row failed."""
    if not (measured_plain and cmp_rows and all(r["error"] is None for r in cmp_rows)):
        return {}
    anchor = {min(measured_plain): measured_plain[min(measured_plain)]}
    return {
        (r["per_device_batch"], r["variant"]): r.get("calibrated_bytes")
        for r in calibrate(cmp_rows, anchor)
    }


def _chunked_runs(results: list[dict], cal: dict, capacity, measure, left) -> None:
    """Chunked cross-entropy at the largest plain batch that fit and, where the calibrated plan
    says it fits, at twice that batch: appended to results."""
    fits = [r["per_device_batch"] for r in results if not r["oom"]]
    if not fits or left() <= 45:
        return
    b = max(fits)
    results.append(measure(b, "chunked"))
    nxt = 2 * b
    predicted = cal.get((nxt, "chunked"))
    room = capacity * 0.97 if capacity else None
    if left() > 45 and predicted is not None and (room is None or predicted < room):
        results.append(measure(nxt, "chunked"))
    elif predicted is not None:
        print(
            f"(chunked at {nxt} not run: calibrated plan {_gb(predicted)} {UNIT[0]} > 97% "
            f"of {_gb(capacity)} {UNIT[0]})"
        )


def _print_header(preset: str, name: str, amp: str, rows: list[dict], plan_wall, sampler):
    print(
        f"### GPU check: `{preset}` on {name}, amp {amp}, "
        f"{torch.__version__}, PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}"
    )
    secs = [r["seconds"] for r in rows if r.get("seconds")]
    print(
        f"\nplan: {len(rows)} rows in a child process"
        + (f", {sum(secs) / len(secs):.1f} s per batch and variant" if secs else "")
        + (f" (done within {plan_wall:.0f} s of starting)" if plan_wall else "")
        + (
            f"; errors: {sorted({r['error'] for r in rows if r['error']})}"
            if any(r["error"] for r in rows)
            else ""
        )
    )
    if sampler is not None:
        print(f"planner child's extra device memory (max sampled): {_gb(sampler.extra)} {UNIT[0]}")


def _print_measurements(results: list[dict], plan: dict, cal: dict, meas_key: str, dev):
    U = UNIT[0]
    unit = f"peak reserved {U}" if dev.type == "cuda" else f"step RSS {U}"
    print(
        f"\n| batch | variant | plan {U} | plan calibrated {U} | measured {unit} | "
        f"measured allocated {U} | calibrated error | tokens/s | MFU |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        key = (r["per_device_batch"], r["variant"])
        p = plan.get(key, {}).get("predicted_bytes")
        c, m = cal.get(key), r.get(meas_key)
        err = f"{(c - m) / m:+.1%}" if c and m else "-"
        if r["oom"]:
            note = f" ({r['note']})" if r.get("note") else ""
            print(f"| {key[0]} | {key[1]} | {_gb(p)} | {_gb(c)} | OOM{note} | - | - | - | - |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        print(
            f"| {key[0]} | {key[1]} | {_gb(p)} | {_gb(c)} | {_gb(m)} | "
            f"{_gb(r.get('peak_allocated'))} | {err} | {r['tokens_per_s']:,.0f} | {mfu} |"
        )


def _print_slope(plan: dict, measured_plain: dict[int, float]):
    sp = _slope(
        {
            b: plan[(b, "plain")]["predicted_bytes"]
            for b in measured_plain
            if (b, "plain") in plan and plan[(b, "plain")]["predicted_bytes"]
        }
    )
    sm = _slope(measured_plain)
    if sp and sm:
        print(
            f"\nslope (plain, {UNIT[0]} per sequence): plan {_gb(sp)}, measured {_gb(sm)} "
            f"({(sp - sm) / sm:+.1%})"
        )


def _print_breakdown(rows: list[dict]):
    if not (rows and rows[0].get("breakdown")):
        return
    comps = list(rows[0]["breakdown"])
    print("\n| batch | variant | peak phase | " + " | ".join(comps) + f" | plan {UNIT[0]} |")
    print("|---:|---|---|" + "---:|" * (len(comps) + 1))
    for r in rows:
        if r["breakdown"]:
            print(
                f"| {r['per_device_batch']} | {r['variant']} | {r['peak_phase']} | "
                + " | ".join(_gb(r["breakdown"][c]) for c in comps)
                + f" | {_gb(r['predicted_bytes'])} |"
            )


def main(argv=None) -> int:
    a = _args(argv)
    t_start = time.monotonic()
    target = _target(a)
    if target is None:
        print("gpu_check: no CUDA device (use --cpu-smoke on the CPU)", file=sys.stderr)
        return 2
    preset, ladder, dev = target
    amp = torch.bfloat16 if a.amp == "bf16" else None
    cfg = PRESETS[preset].to_dict()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    peak = a.peak_flops or advisor_flops.peak_flops(name)
    capacity = torch.cuda.get_device_properties(0).total_memory if dev.type == "cuda" else None

    def left() -> float:
        return a.budget_s - (time.monotonic() - t_start)

    def measure(batch: int, variant: str) -> dict:
        return run_config(cfg, batch, variant, dev, amp, a.warm, a.steps, peak)

    # The planner runs beside the measurements, as it does beside a training loop.
    ladder_plan = sorted(set(ladder) | {2 * max(ladder)})
    t_plan = time.monotonic()
    handle = start_plan(
        cfg,
        ladder_plan,
        "adamw",
        dev.type,
        ("plain", "chunked"),
        amp=a.amp if amp is not None else None,
        timeout_s=max(60.0, a.budget_s - 30),
    )
    sampler = DeviceSampler() if dev.type == "cuda" else None
    results = _plain_ladder(ladder, handle, measure, left)
    rows = handle.result(timeout=max(1.0, left() - 30))
    plan_wall = time.monotonic() - t_plan if rows is not None else None
    if sampler is not None:
        sampler.stop.set()
    rows = rows or []
    meas_key = "peak_reserved" if dev.type == "cuda" else "peak_step_rss"
    measured_plain = {r["per_device_batch"]: r[meas_key] for r in results if not r["oom"]}
    cmp_rows = _comparable(rows, dev)
    cal = _calibrated(cmp_rows, measured_plain)
    _chunked_runs(results, cal, capacity, measure, left)

    plan = {(r["per_device_batch"], r["variant"]): r for r in cmp_rows}
    _print_header(preset, name, a.amp, rows, plan_wall, sampler)
    _print_measurements(results, plan, cal, meas_key, dev)
    _print_slope(plan, measured_plain)
    _print_breakdown(rows)
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")
    return 0 if results and any(not r["oom"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
