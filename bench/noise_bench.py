"""What the online noise-scale estimator costs a real training step; prints markdown tables.

    python bench/noise_bench.py            # test-tiny 8 x 4 and cpu-tiny 4 x 4, 15 rounds
    python bench/noise_bench.py --quick    # 7 rounds, cpu-tiny at 2 x 4

A training step here is the reference loop's: `accum` micro-batches of real data (forward,
backward of loss/accum), gradient clipping, AdamW step, zero_grad. Three variants of it:
- off:   no noise-scale work at all;
- on:    what Monitor does for the noise scale: AccumulationStats.after_backward() after each
         backward (|.grad|^2 via one fused norm, kept on the device), and at the step's end one
         collect() (one transfer), line_estimates and NoiseScaleWindow.update;
- naive: a separate small-batch gradient, i.e. one extra forward + backward of `per_device_batch`
         sequences per step, its |g|^2 read before the accumulation starts, then the same
         two-batch estimate (what one does without the running-sum trick).
Variants are interleaved step by step (A B C, then B C A, ...) so drift of a shared machine hits
all alike; "vs off" is the median over rounds of (variant step / same round's 'off' step) - 1.
Each step is timed by wall clock and by this process's CPU time: on a machine that other
processes share, CPU time (one torch thread) is the steadier figure.
The isolated cost (the estimator's calls alone, on the model's real gradients, many repeats) is
printed too: an A/B difference below the machine's noise is still bounded by it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from rampwatch.advisor.gns import line_estimates, two_batch_estimates
from rampwatch.advisor.gns_window import NoiseScaleWindow
from rampwatch.monitor.gradstats import AccumulationStats
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data import prepare
from rampwatch.trainer.model import GPT, configure_optimizer

VARIANTS = ("off", "on", "naive")


class Bench:
    def __init__(self, preset: str, b: int, k: int, seed: int = 0):
        self.name, self.b, self.k = preset, b, k
        self.cfg = PRESETS[preset]
        self.data = prepare(self.cfg, seed=seed)
        torch.manual_seed(seed)
        self.model = GPT(self.cfg).train()
        self.opt = configure_optimizer(self.model, "adamw", lr=1e-3)
        self.stats = AccumulationStats(self.model.parameters())
        self.window = NoiseScaleWindow()
        self.next_id = 0

    def _batch(self, n: int):
        x, y, _ = self.data.batch(self.next_id, n)
        self.next_id += n
        return x, y

    def step(self, variant: str) -> float:
        b, k, model = self.b, self.k, self.model
        t0 = time.perf_counter()
        small = None
        if variant == "naive":  # the extra backward: a separate small-batch gradient
            x, y = self._batch(b)
            model(x, y).backward()
            small = self._sq_norm()
            self.opt.zero_grad(set_to_none=True)
        for _ in range(k):
            x, y = self._batch(b)
            (model(x, y) / k).backward()
            if variant == "on":
                self.stats.after_backward()
        if variant == "on":
            st = self.stats.collect(b)
            g2, trace = line_estimates(st.batch_sizes, st.sq_norms)
            self.window.update(g2, trace)
        elif variant == "naive":
            g2, trace = two_batch_estimates(b, small, b * k, self._sq_norm())
            self.window.update(g2, trace)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def _sq_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum())

    def isolated_cost(self, repeats: int = 200) -> float:
        """Seconds per optimizer step of the estimator's own calls: k after_backward() on the
        model's real gradients, one collect(), line_estimates, one window update."""
        x, y = self._batch(self.b)
        (self.model(x, y) / self.k).backward()
        t0 = time.perf_counter()
        for _ in range(repeats):
            for _ in range(self.k):
                self.stats.after_backward()
            st = self.stats.collect(self.b)
            g2, trace = line_estimates(st.batch_sizes, st.sq_norms)
            self.window.update(g2, trace)
        dt = (time.perf_counter() - t0) / repeats
        self.opt.zero_grad(set_to_none=True)
        return dt


def run(bench: Bench, rounds: int, warmup: int) -> dict:
    """rounds x one step of each variant, order rotated every round (A B C, B C A, C A B, ...).
    Each step is timed twice: wall clock, and this process's CPU time (on a shared machine the
    CPU time is what other processes disturb least: with one torch thread it is our work only)."""
    for v in VARIANTS:
        for _ in range(warmup):
            bench.step(v)
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            c0 = time.process_time()
            wall[v].append(bench.step(v))
            cpu[v].append(time.process_time() - c0)
    return {"wall": wall, "cpu": cpu, "isolated": bench.isolated_cost()}


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def _paired(times: dict[str, list[float]], v: str) -> list[float]:
    """Per round: this variant's step over the same round's 'off' step, minus 1."""
    return [a / o - 1.0 for a, o in zip(times[v], times["off"], strict=True)]


def table(bench: Bench, res: dict) -> str:
    rows = [
        f"### {bench.name}: per-device batch {bench.b} x accumulation {bench.k} "
        f"(seq_len {bench.cfg.seq_len}, {sum(p.numel() for p in bench.model.parameters()):,} "
        "parameters)",
        "",
        "| variant | clock | median step (ms) | quartiles (ms) | vs off: median of paired "
        "ratios | paired quartiles |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for clock in ("cpu", "wall"):
        for v in VARIANTS:
            lo, med, hi = _quartiles(res[clock][v])
            if v == "off":
                vs, spread = "-", "-"
            else:
                plo, pmed, phi = _quartiles(_paired(res[clock], v))
                vs, spread = _pct(pmed), f"{_pct(plo)} .. {_pct(phi)}"
            rows.append(f"| {v} | {clock} | {_ms(med)} | {_ms(lo)}-{_ms(hi)} | {vs} | {spread} |")
    off = statistics.median(res["cpu"]["off"])
    rows += [
        "",
        f"Estimator's own calls, isolated: {res['isolated'] * 1e3:.3f} ms per step "
        f"= {res['isolated'] / off * 100:.2f}% of the median 'off' step (CPU). "
        f"Naive: one more micro-batch of {bench.b}, so ~{100 / bench.k:.0f}% by design.",
        "",
    ]
    return "\n".join(rows)


def machine(threads: int) -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return (
        f"Machine: CPU only, {os.cpu_count()} cores ({model}); torch {torch.__version__} on "
        f"{threads} thread(s); load average {', '.join(f'{x:.2f}' for x in load)} "
        "(1/5/15 min: other processes share the cores)"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="7 rounds, cpu-tiny at 2 x 4")
    p.add_argument("--rounds", type=int, help="interleaved rounds (each runs every variant once)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (7 if args.quick else 15)
    setups = [("test-tiny", 8, 4), ("cpu-tiny", 2 if args.quick else 4, 4)]
    print("## Noise-scale estimator: cost per training step\n")
    print(machine(args.threads) + "\n")
    print(
        f"{rounds} interleaved rounds of one step per variant (order rotated each round), after "
        "2 warm-up steps each; target: 'on' within 3% of 'off'.\n"
    )
    verdicts = []
    for preset, b, k in setups:
        bench = Bench(preset, b, k)
        res = run(bench, rounds, warmup=2)
        print(table(bench, res))
        verdicts.append((preset, res))
    print("### Summary (median of paired ratios; CPU time, then wall clock)\n")
    print(
        "| model | on vs off (CPU) | naive vs off (CPU) | on vs off (wall) | "
        "naive vs off (wall) | isolated estimator cost |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for preset, res in verdicts:
        med = {
            (c, v): statistics.median(_paired(res[c], v))
            for c in ("cpu", "wall")
            for v in ("on", "naive")
        }
        iso, off = res["isolated"], statistics.median(res["cpu"]["off"])
        print(
            f"| {preset} | {_pct(med['cpu', 'on'])} | {_pct(med['cpu', 'naive'])} | "
            f"{_pct(med['wall', 'on'])} | {_pct(med['wall', 'naive'])} | "
            f"{iso * 1e3:.3f} ms ({iso / off * 100:.2f}%) |"
        )
    print("\n" + machine(args.threads).replace("Machine:", "Machine at the end:"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
