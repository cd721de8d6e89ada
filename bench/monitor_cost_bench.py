"""The monitor's own cost per step on the main thread, and its flusher's CPU; prints markdown.

    OMP_NUM_THREADS=1 python -m bench.monitor_cost_bench            # nanogpt 3000 steps, cpu-tiny 150
    OMP_NUM_THREADS=1 python -m bench.monitor_cost_bench --quick    # a few steps: a smoke run
    OMP_NUM_THREADS=1 python -m bench.monitor_cost_bench --profile  # + where step() spends it
    OMP_NUM_THREADS=1 python -m bench.monitor_cost_bench --window-against REV  # the window alone

Two models, each in its own loop, with Monitor.start writing into a real DuckDB file (temp dir):
- nanogpt: examples/nanogpt_loop.py's TinyLM (vocab 64, width 64; 41k parameters) in its
  nanoGPT loop (get_lr() into every param group times mon.lr_scale, AdamW in two groups,
  clipping), batch 8 x block 16, accumulation 2: a step of a few ms, so the monitor's share
  is as large as it gets;
- cpu-tiny: the reference trainer's preset (4 layers, d_model 192, seq 256; ~1.9M parameters)
  on its own data, at per-device batch 1 x accumulation 4 (the preset runs 8 x 4: the monitor's
  work does not depend on the batch, only the step time does).
Bare steps (the same loop and model, no monitor) and monitored steps alternate, the order
flipped every round, so drift of a shared machine hits both alike. In each monitored step the
main thread times every monitor call, by wall clock (perf_counter_ns) and by its own CPU
(thread_time_ns): after_backward() summed over the micro-batches, step() (of which the
writer's log(), timed by wrapping it), ramp_due(). after_backward() takes |.grad|^2 with
torch._foreach_norm; the same kernel (gradstats._squared_norm) is timed again on the same
gradients right beside it (before or after, alternately: one of the two finds warm caches), so
"beyond the norm kernels" is each step's after_backward sum minus its kernel sum. On a GPU the
kernel is asynchronous and costs the host only its launch; on a CPU it runs inline.
The flusher thread's CPU (its per-thread CPU clock) over the monitored phase's wall time is
its CPU-seconds per second; Python's gen-2 garbage collections in that phase are counted.
Then a few more monitored steps with what step() calls wrapped and timed (step()'s parts, in
the loop's cold caches), and with --profile a cProfile of the monitor's calls.
With --window-against REV only the noise-scale window is timed, alone (warm caches): its
update() on a steady recorded-like stream, this code and advisor/gns_window.py at git revision
REV in alternate rounds, split into the steps that scan for a change point and the others.
Figures depend on the machine's load: the load average is printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.noise_bench import machine
from bench.noise_robust_bench import baseline_window
from bench.store_bench import GcPauses
from rampwatch.advisor.gns_window import NoiseScaleWindow
from rampwatch.monitor import Monitor
from rampwatch.monitor import monitor as monitor_module
from rampwatch.monitor.gradstats import _squared_norm
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data import prepare
from rampwatch.trainer.model import GPT, configure_optimizer

GOAL_MS = 0.2  # the main thread's goal per step beyond the norm kernels (issue 29)


class TinyLM(torch.nn.Module):
    """examples/nanogpt_loop.py's stand-in for nanoGPT's GPT: model(X, Y) -> (logits, loss)."""

    def __init__(self, vocab_size: int = 64, n_embd: int = 64):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, n_embd)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(n_embd, 4 * n_embd),
            torch.nn.GELU(),
            torch.nn.Linear(4 * n_embd, n_embd),
        )
        self.lm_head = torch.nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        x = self.wte(idx)
        logits = self.lm_head(x + self.mlp(x))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


def _call(prof: cProfile.Profile | None, fn, *args, **kwargs) -> tuple:
    """fn's result, wall ns, this thread's CPU ns (both 0 under the profiler, which only
    records). The wall time holds two thread_time_ns() calls, under 1 µs together here."""
    if prof is not None:
        prof.enable()
        try:
            return fn(*args, **kwargs), 0, 0
        finally:
            prof.disable()
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    out = fn(*args, **kwargs)
    c1 = time.thread_time_ns()
    return out, time.perf_counter_ns() - t0, c1 - c0


class Setup:
    """One model, its optimizer and data, and one training step with or without the monitor."""

    def __init__(self, name: str, batch: int, accum: int, seq_len: int, model, opt, next_batch):
        self.name, self.batch, self.accum, self.seq_len = name, batch, accum, seq_len
        self.model, self.opt, self.next_batch = model, opt, next_batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.it = 0  # the loop's own iteration counter (get_lr's argument)
        self.mon: Monitor | None = None
        self.mon_step = 0
        self.log_ns = 0  # the writer's log() inside the last step()

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def get_lr(self, it: int) -> float:
        """nanoGPT's: linear warmup, cosine decay to a tenth, then flat."""
        lr, warmup, decay = 1e-3, 10, 10_000
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = min(1.0, (it - warmup) / (decay - warmup))
        return 0.1 * lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9 * lr

    def attach(self, db: Path) -> None:
        self.mon = Monitor.start(
            db,
            name=f"monitor-cost-{self.name}",
            config={"bench": "monitor_cost"},
            model=self.model,
            optimizer=self.opt,
            per_device_batch=self.batch,
            accum=self.accum,
            seq_len=self.seq_len,
        )
        writer = self.mon.writer
        log = writer.log

        def timed_log(step, metrics):  # the writer's share of step(), on the same clock
            t0 = time.perf_counter_ns()
            log(step, metrics)
            self.log_ns = time.perf_counter_ns() - t0

        writer.log = timed_log

    def step(self, monitored: bool, prof: cProfile.Profile | None = None) -> dict[str, int]:
        """One optimizer step; returns its wall time and, monitored, each call's ns."""
        clock = time.perf_counter_ns
        mon = self.mon if monitored else None
        out = dict.fromkeys(("ab", "ab_cpu", "kernel", "st", "st_cpu", "due", "due_cpu"), 0)
        t_step = clock()
        lr = self.get_lr(self.it) * (mon.lr_scale if mon is not None else 1.0)
        for group in self.opt.param_groups:
            group["lr"] = lr
        total = torch.zeros(())
        for j in range(self.accum):
            x, y = self.next_batch()
            _, loss = self.model(x, y)
            loss = loss / self.accum
            loss.backward()
            if mon is not None:
                kernel_first = (self.mon_step + j) % 2 == 0
                if kernel_first:
                    out["kernel"] += self._kernel()
                _, wall, cpu_ns = _call(prof, mon.after_backward)
                out["ab"] += wall
                out["ab_cpu"] += cpu_ns
                if not kernel_first:
                    out["kernel"] += self._kernel()
            total += loss.detach()
        if mon is not None:
            self.mon_step += 1
            _, out["st"], out["st_cpu"] = _call(prof, mon.step, self.mon_step, loss=total)
            out["log"] = self.log_ns
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if mon is not None:
            ramp, out["due"], out["due_cpu"] = _call(prof, mon.ramp_due, self.mon_step)
            assert ramp is None  # nobody approves one here
        self.it += 1
        out["wall"] = clock() - t_step - out["kernel"]  # the extra kernel is not the loop's
        return out

    def _kernel(self) -> int:
        grads = [p.grad for p in self.params if p.grad is not None]
        t0 = time.perf_counter_ns()
        _squared_norm(grads)
        return time.perf_counter_ns() - t0


def nanogpt_setup(seed: int = 0) -> Setup:
    torch.manual_seed(seed)
    vocab, batch, block, accum = 64, 8, 16, 2
    successors = torch.randint(vocab, (vocab, 4)).tolist()  # the example's token stream
    choices, stream = torch.randint(4, (20_000,)).tolist(), [0]
    for c in choices[1:]:
        stream.append(successors[stream[-1]][c])
    data = torch.tensor(stream)
    model = TinyLM(vocab).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.99),
    )

    def get_batch():
        ix = torch.randint(len(data) - block - 1, (batch,))
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
        return x, y

    return Setup("nanogpt", batch, accum, block, model, opt, get_batch)


class _GPTPair(torch.nn.Module):
    """The trainer's GPT returns the loss; the loop above expects (logits, loss)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        return None, self.gpt(x, y)


def cpu_tiny_setup(batch: int, accum: int = 4, seed: int = 0) -> Setup:
    cfg = PRESETS["cpu-tiny"]
    data = prepare(cfg, seed=seed)
    torch.manual_seed(seed)
    gpt = GPT(cfg).train()
    opt = configure_optimizer(gpt, "adamw", lr=1e-3)
    pos = [0]

    def next_batch():
        x, y, _ = data.batch(pos[0], batch)
        pos[0] += batch
        return x, y

    return Setup("cpu-tiny", batch, accum, cfg.seq_len, _GPTPair(gpt), opt, next_batch)


def _thread_cpu_ns(thread) -> int:
    """CPU time of another thread of this process (Linux: its per-thread CPU clock)."""
    return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))


def run(setup: Setup, db: Path, steps: int, warmup: int) -> dict:
    """`steps` bare and `steps` monitored steps, alternating; the monitor's calls per step."""
    setup.attach(db)
    for _ in range(warmup):  # warm-up: allocator, first flusher visits, the spike window
        setup.step(False)
        setup.step(True)
    flusher = setup.mon.writer._flusher
    visits0, rows0 = flusher.flushes, flusher.ingested_records
    f0, w0 = _thread_cpu_ns(flusher._thread), time.perf_counter_ns()
    bare, mon = [], []
    with GcPauses() as gcp:
        for r in range(steps):
            for monitored in (False, True) if r % 2 == 0 else (True, False):
                (mon if monitored else bare).append(setup.step(monitored))
    wall_s = (time.perf_counter_ns() - w0) / 1e9
    flusher_s = (_thread_cpu_ns(flusher._thread) - f0) / 1e9
    visits = flusher.flushes - visits0
    rows = flusher.ingested_records - rows0
    return {
        "bare": bare,
        "mon": mon,
        "wall_s": wall_s,
        "flusher_s": flusher_s,
        "visits": visits,
        "rows": rows,
        "errors": setup.mon.writer.errors,
        "gc": gcp.summary(),
        "window": setup.mon.noise.length,
    }


def step_parts(setup: Setup, steps: int) -> str:
    """What step() spends its time on, in the loop (caches as a training step leaves them):
    what it calls, wrapped and timed for `steps` more monitored steps (not the figures above).
    A name the monitor no longer has is left out."""
    mon = setup.mon
    targets = [
        (monitor_module, "memory_metrics", "memory metrics (statm, getrusage, clear_refs)"),
        (monitor_module, "line_estimates", "line_estimates (the step's G² and trace)"),
        (mon.noise, "update", "NoiseScaleWindow.update"),
        (mon.grads, "collect", "AccumulationStats.collect (the one transfer)"),
        (mon.ramps, "observe", "the ramp protocol's observe"),
    ]
    took: dict[str, list[int]] = {}
    undo = []
    for owner, name, label in targets:
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                took.setdefault(_label, []).append(time.perf_counter_ns() - t0)

        undo.append((owner, name, name in vars(owner), fn))
        setattr(owner, name, timed)
    st = []
    try:
        for _ in range(steps):
            out = setup.step(True)
            st.append(out["st"])
            took.setdefault("the writer's log()", []).append(out["log"])
    finally:
        for owner, name, own, fn in undo:
            if own:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # the class's method shows through again
    step = float(np.median(st)) / 1e3
    rows = [f"| step(), all of it | {_us(step)} | 100% |"]
    for label, ns in sorted(took.items(), key=lambda kv: -float(np.median(kv[1]))):
        us = float(np.median(ns)) / 1e3
        rows.append(f"| {label} | {_us(us)} | {us / step * 100:.0f}% |")
    return "\n".join(
        [
            f"step()'s parts over {steps} more monitored steps (medians, µs; each part wrapped "
            "and timed in the loop):",
            "",
            "| part of step() | µs | share |",
            "|---|---:|---:|",
            *rows,
            "",
        ]
    )


def profile(setup: Setup, steps: int, top: int = 30) -> str:
    """cProfile of the monitor's calls only (enabled around each call), `steps` steps, by
    cumulative time (the profiler's own overhead inflates every figure: read the shares)."""
    prof = cProfile.Profile()
    for _ in range(steps):
        setup.step(True, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("cumulative").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return "\n".join(lines[start:])


def _series(res: dict) -> dict[str, np.ndarray]:
    """Per monitored step, µs: each call, its CPU, and the derived sums."""
    m = res["mon"]

    def col(k):
        return np.array([s[k] for s in m], dtype=np.float64) / 1e3

    out = {k: col(k) for k in ("ab", "ab_cpu", "kernel", "st", "st_cpu", "log", "due", "due_cpu")}
    out["beyond"] = out["ab"] - out["kernel"]
    out["total"] = out["ab"] + out["st"] + out["due"]
    out["total_cpu"] = out["ab_cpu"] + out["st_cpu"] + out["due_cpu"]
    out["total_beyond"] = out["total"] - out["kernel"]
    out["wall"] = col("wall")
    out["bare"] = np.array([s["wall"] for s in res["bare"]], dtype=np.float64) / 1e3
    return out


def _q(a: np.ndarray) -> tuple[float, float, float, float]:
    """Median, p99, max and mean: the mean holds the every-few-steps work (the noise-scale
    window's scan every 4th step, its refresh) that the median steps over."""
    return float(np.median(a)), float(np.percentile(a, 99)), float(a.max()), float(a.mean())


def _us(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def table(setup: Setup, res: dict) -> tuple[str, dict]:
    s = _series(res)
    n = len(res["mon"])
    rows = [
        f"### {setup.name}: batch {setup.batch} x accumulation {setup.accum}, seq_len "
        f"{setup.seq_len}, {setup.n_params:,} parameters; {n} monitored + {n} bare steps",
        "",
        "| per optimizer step, main thread | wall p50 (µs) | wall p99 | wall max | wall mean "
        "| CPU p50 (µs) | CPU mean |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    labels = [
        (f"after_backward() x{setup.accum}", "ab", "ab_cpu"),
        ("  of which the norm kernel (timed beside it)", "kernel", None),
        ("  after_backward() beyond the kernel", "beyond", None),
        ("step()", "st", "st_cpu"),
        ("  of which the writer's log()", "log", None),
        ("ramp_due()", "due", "due_cpu"),
        ("all three", "total", "total_cpu"),
        ("all three beyond the norm kernels", "total_beyond", None),
    ]
    for label, key, cpu_key in labels:
        walls = " | ".join(_us(x) for x in _q(s[key]))
        cpu = s[cpu_key] if cpu_key else None
        c = "" if cpu is None else f"{_us(float(np.median(cpu)))} | {_us(float(cpu.mean()))}"
        rows.append(f"| {label} | {walls} | {c or ' | '} |")
    for label, key in (("bare step (no monitor)", "bare"), ("monitored step", "wall")):
        rows.append(f"| {label} | " + " | ".join(_us(x) for x in _q(s[key])) + " | | |")
    bare, mon = float(np.median(s["bare"])), float(np.median(s["wall"]))
    quarter = max(1, n // 4)
    first, last = float(np.median(s["st"][:quarter])), float(np.median(s["st"][-quarter:]))
    total = float(np.median(s["total"]))
    beyond = float(np.median(s["total_beyond"]))
    beyond_mean = float(s["total_beyond"].mean())
    fl = res["flusher_s"] / res["wall_s"]
    per_visit = res["flusher_s"] / res["visits"] * 1e3 if res["visits"] else float("nan")
    rows += [
        "",
        f"Monitor calls: {_us(total)} µs per step (median) = {total / bare * 100:.2f}% of the "
        f"median bare step; beyond the norm kernels {_us(beyond)} µs "
        f"(goal ≤ {GOAL_MS * 1e3:.0f} µs: {'met' if beyond <= GOAL_MS * 1e3 else 'missed'}), "
        f"mean {_us(beyond_mean)} µs "
        f"({'met' if beyond_mean <= GOAL_MS * 1e3 else 'missed'}). "
        f"Monitored step vs bare, medians: {(mon / bare - 1) * 100:+.1f}%.",
        f"Flusher thread: {res['flusher_s'] * 1e3:,.0f} ms CPU in {res['wall_s']:.1f} s = "
        f"{fl * 1e3:.1f} ms CPU per second ({fl * 100:.2f}% of a core); {res['visits']} visits "
        f"({per_visit:.1f} ms CPU each), {res['rows']:,} rows ingested; writer errors "
        f"{res['errors']}. Garbage collection in these steps: {res['gc']}.",
        f"The noise-scale window held {res['window']:,} steps at the end (its median, MAD and "
        f"change-point scan cover them all, but not every step): step() median {_us(first)} µs "
        f"over the first quarter of these steps, {_us(last)} µs over the last.",
        "",
    ]
    summary = {
        "total": total,
        "beyond": beyond,
        "beyond_mean": beyond_mean,
        "bare": bare,
        "flusher_ms_per_s": fl * 1e3,
        "kernel": float(np.median(s["kernel"])),
        "step": float(np.median(s["st"])),
        "due": float(np.median(s["due"])),
        "ab_beyond": float(np.median(s["beyond"])),
    }
    return "\n".join(rows), summary


def window_alone(window_cls, warm: int, steps: int, seed: int) -> dict[str, float]:
    """µs per update() of a window grown `warm` steps on a steady log-normal stream: median over
    the steps that scan, over the others, and the mean over all."""
    rng = np.random.default_rng(seed)
    g2 = (2.0 * np.exp(rng.normal(0, 0.5, warm + steps))).tolist()
    trace = (60.0 * np.exp(rng.normal(0, 0.3, warm + steps))).tolist()
    w = window_cls()
    for i in range(warm):
        w.update(g2[i], trace[i])
    scans, others = [], []
    for i in range(warm, warm + steps):
        scanning = (w.updates + 1) % w.scan_every == 0
        t0 = time.perf_counter_ns()
        w.update(g2[i], trace[i])
        (scans if scanning else others).append((time.perf_counter_ns() - t0) / 1e3)
    return {
        "scan": float(np.median(scans)),
        "other": float(np.median(others)),
        "mean": (sum(scans) + sum(others)) / steps,
        "length": w.length,
    }


def window_against(rev: str, rounds: int = 6, steps: int = 400) -> str:
    """The window alone, this code against revision `rev`, rounds alternating their order."""
    kinds = {"this code": NoiseScaleWindow, rev: baseline_window(rev)}
    rows = [
        "| window grown | code | steps that scan (median µs) | others | mean of all |",
        "|---:|---|---:|---:|---:|",
    ]
    for warm in (600, 1200, 3500):
        got = {k: [] for k in kinds}
        for r in range(rounds):
            for name in list(kinds)[:: 1 if r % 2 == 0 else -1]:
                got[name].append(window_alone(kinds[name], warm, steps, seed=r))
        for name, runs in got.items():
            med = {k: float(np.median([x[k] for x in runs])) for k in ("scan", "other", "mean")}
            rows.append(
                f"| {warm:,} ({runs[-1]['length']:,} in the window) | {name} | "
                f"{med['scan']:.1f} | {med['other']:.1f} | {med['mean']:.1f} |"
            )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few steps of each: a smoke run")
    p.add_argument("--steps", type=int, help="monitored steps of nanogpt (default 3000)")
    p.add_argument("--cpu-tiny-steps", type=int, help="monitored steps of cpu-tiny (default 150)")
    p.add_argument("--cpu-tiny-batch", type=int, default=1, help="its per-device batch")
    p.add_argument("--only", choices=("nanogpt", "cpu-tiny"), help="one model only")
    p.add_argument("--profile", action="store_true", help="also cProfile the monitor's calls")
    p.add_argument("--dir", help="where the temporary database goes (default: a temp dir)")
    p.add_argument("--window-against", metavar="REV", help="time the noise window alone vs REV")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.window_against:
        print("## The noise-scale window's update(), alone\n")
        print("At the start. " + machine(1) + "\n")
        print(window_against(a.window_against))
        print("\nAt the end. " + machine(1))
        return 0
    steps = a.steps or (6 if a.quick else 3000)
    tiny_steps = a.cpu_tiny_steps or (3 if a.quick else 150)
    warmup = 2 if a.quick else 20
    print("## The monitor's own cost per step\n")
    print("At the start. " + machine(torch.get_num_threads()) + "\n")
    tmp = Path(tempfile.mkdtemp(prefix="monitor_cost_", dir=a.dir))
    summaries = []
    try:
        plans = [("nanogpt", steps), ("cpu-tiny", tiny_steps)]
        for name, n in plans:
            if a.only and name != a.only:
                continue
            setup = nanogpt_setup() if name == "nanogpt" else cpu_tiny_setup(a.cpu_tiny_batch)
            res = run(setup, tmp / f"{name}.duckdb", n, warmup if name == "nanogpt" else 5)
            text, summary = table(setup, res)
            print(text)
            print(step_parts(setup, 3 if a.quick else (300 if name == "nanogpt" else 30)))
            if a.profile:
                k = 3 if a.quick else (300 if name == "nanogpt" else 30)
                print(f"cProfile of the monitor's calls over {k} more steps (cumulative):\n")
                print("```\n" + profile(setup, k) + "\n```\n")
            setup.mon.finish()
            assert setup.mon.writer.errors == 0, setup.mon.writer.last_error
            summaries.append((name, summary))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("### Summary (medians per step, µs; flusher: ms CPU per wall second)\n")
    print(
        "| model | bare step | monitor calls | share | norm kernels | beyond them (goal ≤ 200) "
        "| their mean | step() | ramp_due() | flusher |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in summaries:
        print(
            f"| {name} | {_us(s['bare'])} | {_us(s['total'])} | "
            f"{s['total'] / s['bare'] * 100:.2f}% | {_us(s['kernel'])} | {_us(s['beyond'])} | "
            f"{_us(s['beyond_mean'])} | {_us(s['step'])} | {_us(s['due'])} | "
            f"{s['flusher_ms_per_s']:.1f} |"
        )
    print("\nAt the end. " + machine(torch.get_num_threads()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
