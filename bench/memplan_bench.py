"""CPU truth for the memory plan: the real peak of one training step (VmHWM of a fresh process)
against trainer/gpt_plan.py's fake-tensor plan, per per-device batch; prints markdown tables.

    python bench/memplan_bench.py            # cpu-tiny at per-device batches 4, 8, 16
    python bench/memplan_bench.py --quick    # 2, 4, 8, plain variant only
    python bench/memplan_bench.py --batches 1,2,4 --config '{"vocab_size": 8192, "tokenizer":
        "bpe", "n_layer": 2, "d_model": 128, "ce_chunk_tokens": 256}'   # logits-dominated

What is compared, and why it is fair: each batch runs in its own fresh process (a process's
high-water mark only ever grows, and freed heap is not returned, so one process cannot measure
three batches). There, the model and optimizer are built and two real steps run (optimizer state
exists, lazy initialisation is done); the resident set *then* is the baseline: interpreter,
libraries, parameters, optimizer state, the batch. Writing "5" to /proc/self/clear_refs resets
VmHWM to the current RSS, one more step runs, and VmHWM - baseline is what the step added. The
plan's counterpart is predicted_bytes - steady_bytes (its peak minus what lives between steps).
glibc's malloc would otherwise keep freed chunks below a *dynamic* mmap threshold (it rises to
32 MB after the first large free) in the heap, so the baseline would carry whatever the warm-up
steps left behind; MALLOC_MMAP_THRESHOLD_ fixes the threshold, making every tensor of >= 16 KiB
its own mapping, given back on free, so RSS follows the live tensors.
The slope (bytes per extra sequence) is the figure that matters: advisor/memory.py anchors the
plan's slope on one measured peak. Target: within 10%.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.child import child_env

MMAP_THRESHOLD = 16384


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # "kB" in /proc means KiB
    raise KeyError(key)


def make_step(model, opt, idx, tgt, amp=None):
    """One real training step, the one trainer/gpt_plan.py plans: forward (under autocast when
    `amp` is a dtype), backward, clip, optimizer step. Shared with bench/gpu_check.py."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        with torch.autocast(idx.device.type, dtype=amp, enabled=amp is not None):
            loss = model(idx, tgt)
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _measure_here(cfg: dict, batch: int, optimizer: str, warm_steps: int = 2) -> dict:
    """In this (fresh) process: the bytes one real training step adds on top of the steady state."""
    import torch

    from rampwatch.store.names import loss_variant
    from rampwatch.trainer.gpt_plan import (
        _model_config,  # the plan's own config mapping, so both agree
    )
    from rampwatch.trainer.model import GPT, configure_optimizer

    torch.manual_seed(0)
    mcfg = _model_config(cfg, loss_variant(cfg.get("chunked_ce")))
    model = GPT(mcfg).train()
    opt = configure_optimizer(model, optimizer, lr=1e-3)
    idx = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len))
    tgt = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len))
    step = make_step(model, opt, idx, tgt)

    for _ in range(warm_steps):
        step()
    gc.collect()
    base = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    hwm = _status_bytes("VmHWM")
    return {
        "per_device_batch": batch,
        "baseline_rss": base,
        "hwm": hwm,
        "step_bytes": hwm - base,
        "step_seconds": round(seconds, 3),
    }


def measure(cfg: dict, batch: int, optimizer: str = "adamw", timeout: float = 300) -> dict:
    """measured step bytes at `batch`, in a fresh child process (see the module docstring)."""
    env = child_env(
        MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_ARENA_MAX="1"
    )
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--measure-child",
            json.dumps({"cfg": cfg, "batch": batch, "optimizer": optimizer}),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def slope(points: dict[int, float]) -> float:
    """Least-squares bytes per sequence through {batch: bytes}."""
    xs, ys = list(points), list(points.values())
    xm, ym = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - xm) * (y - ym) for x, y in points.items()) / sum((x - xm) ** 2 for x in xs)


def compare(
    cfg: dict, batches: list[int], optimizer: str = "adamw", variants: tuple[str, ...] = ("plain",)
) -> dict:
    """Plan (in process) + measurement (one child per batch and variant) -> figures."""
    from rampwatch.trainer.gpt_plan import plan_in_process

    t0 = time.perf_counter()
    rows = plan_in_process(cfg, batches, optimizer, "cpu", variants)
    plan_s = time.perf_counter() - t0
    bad = [r["error"] for r in rows if r["error"]]
    if bad:
        raise RuntimeError(f"plan failed: {bad[0]}")
    out = {"rows": rows, "plan_seconds": plan_s, "variants": {}}
    for v in variants:
        vcfg = dict(cfg, chunked_ce=v == "chunked")
        meas = {b: measure(vcfg, b, optimizer) for b in batches}
        prow = {r["per_device_batch"]: r for r in rows if r["variant"] == v}
        planned = {b: prow[b]["predicted_bytes"] - prow[b]["steady_bytes"] for b in batches}
        measured = {b: meas[b]["step_bytes"] for b in batches}
        sp, sm = slope(planned), slope(measured)
        out["variants"][v] = {
            "measured": meas,
            "planned": planned,
            "plan_rows": prow,
            "slope_planned": sp,
            "slope_measured": sm,
            "slope_error": (sp - sm) / sm,
        }
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(name: str, res: dict) -> str:
    lines = [
        f"### Memory plan vs CPU truth: `{name}`",
        "",
        f"plan: {len(res['rows'])} rows in {res['plan_seconds']:.1f} s "
        f"({res['plan_seconds'] / len(res['rows']):.2f} s per batch and variant)",
        "",
        "| variant | per-device batch | planned step MiB | measured step MiB | error | "
        "measured step s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v, r in res["variants"].items():
        for b in r["planned"]:
            p, m = r["planned"][b], r["measured"][b]["step_bytes"]
            lines.append(
                f"| {v} | {b} | {_mb(p)} | {_mb(m)} | {(p - m) / m:+.1%} | "
                f"{r['measured'][b]['step_seconds']:.2f} |"
            )
    lines += [
        "",
        "| variant | slope planned MiB/seq | slope measured MiB/seq | error | within 10% |",
        "|---|---:|---:|---:|:---:|",
    ]
    for v, r in res["variants"].items():
        ok = "yes" if abs(r["slope_error"]) <= 0.10 else "**no**"
        lines.append(
            f"| {v} | {_mb(r['slope_planned'])} | {_mb(r['slope_measured'])} | "
            f"{r['slope_error']:+.1%} | {ok} |"
        )
    comps = ("parameters", "gradients", "optimizer", "activations", "logits")
    lines += [
        "",
        "Plan breakdown at the peak (MiB; the components sum to the peak):",
        "",
        "| variant | batch | peak phase | " + " | ".join(comps) + " | peak | steady |",
        "|---|---:|---|" + "---:|" * (len(comps) + 2),
    ]
    for row in res["rows"]:
        bd = row["breakdown"]
        lines.append(
            f"| {row['variant']} | {row['per_device_batch']} | {row['peak_phase']} | "
            + " | ".join(_mb(bd[c]) for c in comps)
            + f" | {_mb(row['predicted_bytes'])} | {_mb(row['steady_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--batches", default=None, help="comma-separated (default 4,8,16; quick 2,4,8)")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument(
        "--config",
        default=None,
        help='JSON overrides of the preset, e.g. a head-heavy shape: \'{"vocab_size": '
        '8192, "tokenizer": "bpe", "n_layer": 2, "d_model": 128, '
        '"ce_chunk_tokens": 256}\'',
    )
    ap.add_argument("--quick", action="store_true", help="smaller batches, plain variant only")
    ap.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    ap.add_argument("--measure-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.measure_child:
        req = json.loads(a.measure_child)
        print(json.dumps(_measure_here(req["cfg"], req["batch"], req["optimizer"])))
        return 0
    from rampwatch.trainer.config import PRESETS

    cfg = dict(PRESETS[a.preset].to_dict(), **json.loads(a.config or "{}"))
    batches = [int(x) for x in (a.batches or ("2,4,8" if a.quick else "4,8,16")).split(",")]
    variants = ("plain",) if a.quick else ("plain", "chunked")
    res = compare(cfg, batches, a.optimizer, variants)
    print(report(a.preset + (" + " + a.config if a.config else ""), res))
    if a.json:
        print(json.dumps(res, default=str))
    return 0 if all(abs(r["slope_error"]) <= 0.10 for r in res["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
