"""The noise-scale window on recorded runs of three presets, beside the estimator it replaced.

    python -m bench.noise_robust_bench                   # bench-, test-, cpu-tiny × seeds 0 1 2
    python -m bench.noise_robust_bench --out DIR --steps 500 --seeds 0 1 2 --baseline REV

Each run is the reference trainer, ramps off, constant LR after warmup (--total-tokens 1e12),
recorded once into --out by bench.tiny_runs.train_tiny (finished runs are reused). bench-tiny and
test-tiny run their presets' batches; cpu-tiny runs 4 × 2 sequences per step instead of 8 × 4
(500 steps took ~15 minutes on a shared core at 4 × 2; 8 × 4 would take about four times that). Two estimators replay the same logged
per-step gns_g2 / gns_trace: `new`, advisor.gns_window as it is, and `old`, that module as it
was at --baseline (read from git). Scored from step 100 on, per run and over all runs:
- trailing: share of logged values within 2× of the trailing 100-step ratio of sums (target ≥ 95%);
- centred: the same against the centred ±75-step ratio of sums, where it exists (≥ 95%);
- flips: share of consecutive logged values differing by more than 2× (≤ 0.5%);
- lag: the shift that best aligns it with the centred reference (steps); noise: median |Δ log|
  from step to step; values: share of steps with a logged value.
A raw ratio of sums is itself carried by one spike (one micro-batch's huge gradient: that step's
|G|² far below zero, its tr Σ far above): `one-step refs` is the share of scored steps whose
trailing reference moves by more than 20% when one of its steps is left out, and `where no step
carries it` repeats both agreements on the other steps. An estimator that one step moves by at
most 20% cannot follow a reference that one step moves by 2×.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

from bench.noise_window_bench import HALF_WIDTH, centred, recorded, score, window_path
from bench.tiny_runs import train_tiny

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("bench-tiny", "test-tiny", "cpu-tiny")
TRAILING = 100
FIRST = 100  # steps before this are the start of training, not scored
BASELINE = "477ea36"  # the last commit with the v2 window (shortest window meeting 20% SE)


def baseline_window(rev: str):
    """NoiseScaleWindow as advisor/gns_window.py defined it at git revision rev."""
    path = "rampwatch/advisor/gns_window.py"
    done = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"noise_robust_bench: cannot read {path} at {rev}: {done.stderr.strip()}")
    module = types.ModuleType("gns_window_baseline")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(done.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module.NoiseScaleWindow


def trailing(g2, trace) -> np.ndarray:
    """Ratio of sums over the newest TRAILING steps at each step (NaN where not positive)."""
    cg = np.concatenate([[0.0], np.cumsum(g2)])
    ct = np.concatenate([[0.0], np.cumsum(trace)])
    lo = np.maximum(0, np.arange(1, len(g2) + 1) - TRAILING)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (ct[1:] - ct[lo]) / (cg[1:] - cg[lo])
    return np.where(ratio > 0, ratio, np.nan)


def one_step_carries(g2, trace, bounds) -> np.ndarray:
    """Per step: does leaving one step out move its reference (the ratio of sums over
    bounds(i) = (lo, hi)) by more than 20%, or out of the positive?"""
    out = np.zeros(len(g2), bool)
    for i in range(len(g2)):
        lo, hi = bounds(i)
        g, t = g2[lo:hi], trace[lo:hi]
        ratio = t.sum() / g.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            moved = np.abs(np.log((t.sum() - t) / (g.sum() - g) / ratio))
        out[i] = not (ratio > 0 and np.all(moved <= math.log(1.2)))
    return out


def agreement(path, ref, first: int = FIRST, last: int | None = None, skip=None) -> tuple[int, int]:
    """(values within 2× of ref, values compared) over steps first..last-1, but those in skip."""
    idx = np.arange(len(path))
    ok = np.isfinite(path) & np.isfinite(ref) & (idx >= first) & (idx < (last or len(path)))
    if skip is not None:
        ok &= ~skip
    within = np.abs(np.log(path[ok] / ref[ok])) <= math.log(2)
    return int(within.sum()), int(ok.sum())


def flips(path, first: int = FIRST) -> tuple[int, int]:
    """(consecutive logged values differing by more than 2×, consecutive pairs) from first on."""
    p = path[first:]
    pair = np.isfinite(p[1:]) & np.isfinite(p[:-1])
    jump = np.abs(np.log(p[1:][pair] / p[:-1][pair])) > math.log(2)
    return int(jump.sum()), int(pair.sum())


def carried(g2, trace) -> tuple[np.ndarray, np.ndarray]:
    """one_step_carries for the trailing and the centred reference."""
    n = len(g2)
    return (
        one_step_carries(g2, trace, lambda i: (max(0, i + 1 - TRAILING), i + 1)),
        one_step_carries(g2, trace, lambda i: (max(0, i - HALF_WIDTH), min(n, i + HALF_WIDTH + 1))),
    )


def measure(steps, g2, trace, window, carried_by_one) -> dict:
    path = window_path(g2, trace, window)
    last = len(path) - HALF_WIDTH
    by_trailing, by_centred = carried_by_one
    ref_t, ref_c = trailing(g2, trace), centred(g2, trace)
    return {
        "trailing": agreement(path, ref_t),
        "centred": agreement(path, ref_c, last=last),
        "trailing_clean": agreement(path, ref_t, skip=by_trailing),
        "centred_clean": agreement(path, ref_c, last=last, skip=by_centred),
        "one_step": (int(by_trailing[FIRST:].sum()), len(path) - FIRST),
        "flips": flips(path),
        **score(steps, path, ref_c),
    }


def record(out: Path, preset: str, seed: int, steps: int) -> tuple[Path, str]:
    name = f"{preset}-s{seed}"
    batch = 8 if preset == "cpu-tiny" else None
    extra = ("--ramp", "off", "--total-tokens", str(10**12))
    db, _ = train_tiny(out, name, seed=seed, steps=steps, preset=preset, batch=batch, extra=extra)
    return db, name


def share(pairs) -> str:
    hit, total = map(sum, zip(*pairs, strict=True))
    return f"{hit / total:.1%}" if total else "—"


def row(run: str, label: str, ms: list[dict], lag, noise, coverage) -> str:
    def cell(key: str) -> str:
        return share(m[key] for m in ms)

    return (
        f"| {run} | {label} | {cell('trailing')} | {cell('centred')} | {cell('one_step')} | "
        f"{cell('trailing_clean')}, {cell('centred_clean')} | {cell('flips')} | {lag:g} | "
        f"{noise:.4f} | {coverage:.0%} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "noise")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the old estimator")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from rampwatch.advisor.gns_window import NoiseScaleWindow

    windows = {"new": NoiseScaleWindow, "old": baseline_window(a.baseline)}
    rows = {label: [] for label in windows}
    print(
        f"# noise-scale window, {a.steps} steps, ramps off, scored from step {FIRST}; old = "
        f"{a.baseline}\n"
    )
    print(
        "| run | estimator | within 2× trailing 100 | within 2× centred ±75 | one-step refs | "
        "where no step carries it: trailing, centred | flips > 2× | lag (steps) | "
        "median abs step change | steps with a value |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in a.presets:
        for seed in a.seeds:
            db, name = record(a.out, preset, seed, a.steps)
            steps, g2, trace, _ = recorded(db, name)
            carried_by_one = carried(g2, trace)
            for label, window in windows.items():
                m = measure(steps, g2, trace, window, carried_by_one)
                rows[label].append(m)
                print(row(name, label, [m], m["lag"], m["noise"], m["coverage"]))
    for label, ms in rows.items():
        lag, noise = np.median([m["lag"] for m in ms]), np.median([m["noise"] for m in ms])
        print(row("all", label, ms, lag, noise, np.mean([m["coverage"] for m in ms])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
