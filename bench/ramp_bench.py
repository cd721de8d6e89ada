"""Does following the noise scale pay? Constant-batch sweeps against `--ramp auto`, to one target.

    python bench/ramp_bench.py                  # seeds 0 1, batches 8..128, target val 1.75
    python bench/ramp_bench.py --quick          # one seed, batches 8..64, target val 2.0
    python bench/ramp_bench.py --keep DIR       # keep the runs; finished ones are not retrained

Every run is the reference trainer (`rampwatch train`, a child process, one thread) on
the `bench-tiny` preset, stopped by `--target-val-loss` (validation every ~160 sequences on a
fixed 64-sequence batch). Each constant batch B runs accumulation 2 (so its noise scale is
measured) at learning rates {½, 1, 2} × the √ rule from 3e-3 at B = 16, and keeps the LR with
the fewest steps to the target: a √-scaled LR alone would bias the fit.

Printed, per seed:
- steps S and sequences E to the target for each B, and the fit S = S_min(1 + B_crit/B)
  (McCandlish et al. 2018, §2.3, Fig. 4; advisor.gns.fit_critical_batch);
- the windowed noise scale with its 95% bounds along the fixed-16 run, and at its target beside
  B_crit;
- `--ramp auto` from 16 (√-rule LR, accumulation-only tiers with --no-plan) at the policy's
  ramp point (1× the batch: B in [B_noise, 2·B_noise]) and at 2× (B in [B_noise/2, B_noise]),
  against fixed 16 at the same LR and the fixed batch with the fewest steps, beside what
  eq. 2.11 predicts for each over the fixed-16 run's own noise-scale path.
Goal: auto ≤ 0.75× the steps of fixed 16 at ≤ 1.5× its sequences; B_crit / noise scale at the
target in [0.5, 4].
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.tiny_runs import train_tiny
from rampwatch.advisor.gns import fit_critical_batch
from rampwatch.advisor.policy import RampPolicy
from rampwatch.store import names as M
from rampwatch.store import reader

BASE_LR, BASE_BATCH = 3e-3, 16
LR_GRID = (0.5, 1.0, 2.0)
MAX_SEQUENCES = 160_000  # a run that has not reached the target by then is reported as such
AUTO_RAMP_AT = (1.0, 2.0)  # the policy's band, B in [B_noise, 2·B_noise]; and [B_noise/2, B_noise]


@dataclass
class Result:
    name: str
    batch: int  # starting batch (sequences per step)
    lr: float
    steps: int | None  # optimizer steps to the target (None: not reached)
    sequences: int | None
    db: Path
    wall_s: float


def run(
    out: Path,
    name: str,
    batch: int,
    lr: float,
    seed: int,
    target: float,
    ramp_at: float | None = None,
    preset: str = "bench-tiny",
) -> Result:
    """Train one run to the target; a finished run already in `out` (--keep) is read instead.
    ramp_at: `--ramp auto` with that ramp point (× the batch); None: a constant batch. The LR
    stays constant after warmup (--total-tokens 1e12: bench-tiny's default, not test-tiny's)."""
    ramp = ["--ramp", "off"] if ramp_at is None else ["--ramp", "auto", "--ramp-at", f"{ramp_at:g}"]
    db, wall = train_tiny(
        out,
        name,
        seed=seed,
        steps=MAX_SEQUENCES // batch,
        batch=batch,
        lr=lr,
        val_every=max(2, 160 // batch),
        extra=("--target-val-loss", str(target), "--total-tokens", str(10**12), *ramp),
        preset=preset,
    )
    return measured(db, name, batch, lr, target, wall)


def measured(db: Path, name: str, batch: int, lr: float, target: float, wall: float) -> Result:
    val = series(db, name, M.VAL_LOSS)
    hit = next((s for s, v in sorted(val.items()) if v <= target), None)
    seqs = None
    if hit is not None:
        batch_by_step = series(db, name, M.BATCH_SEQS)
        seqs = int(sum(v for s, v in batch_by_step.items() if s <= hit))
    return Result(name, batch, lr, hit, seqs, db, wall)


def series(db: Path, run_id: str, name: str) -> dict[int, float]:
    import pyarrow.compute as pc

    table = reader.export(db, run_id)
    rows = table.filter(pc.equal(table["name"], name))
    return dict(zip(rows["step"].to_pylist(), rows["value"].to_pylist(), strict=True))


def sweep(out: Path, seed: int, batches, target: float, jobs: int):
    """({batch: best Result over the LR grid}, {ramp_at: auto run}, every constant-batch Result)."""
    tasks = [
        (f"s{seed}-b{b}-lr{m:g}", b, BASE_LR * math.sqrt(b / BASE_BATCH) * m)
        for b in batches
        for m in LR_GRID
    ]
    with ThreadPoolExecutor(jobs) as pool:
        autos = {
            at: pool.submit(
                run, out, f"s{seed}-auto-at{at:g}", BASE_BATCH, BASE_LR, seed, target, at
            )
            for at in AUTO_RAMP_AT
        }
        results = list(pool.map(lambda t: run(out, t[0], t[1], t[2], seed, target), tasks))
        autos = {at: f.result() for at, f in autos.items()}
    best = {}
    for r in results:
        key = (r.steps is None, r.steps or 0)
        if r.batch not in best or key < (best[r.batch].steps is None, best[r.batch].steps or 0):
            best[r.batch] = r
    return best, autos, results


def predicted_by_eq_2_11(
    noise: dict[int, float], steps16: int, policy: RampPolicy
) -> tuple[float, float]:
    """(steps, sequences) of the policy relative to fixed 16, over the fixed-16 run's progress.

    Each fixed-16 step is dS_min = 1/(1 + B_noise/16) of progress; at batch B the same progress
    costs (1 + B_noise/B)·dS_min steps and B·(1 + B_noise/B)·dS_min sequences (eq. 2.11). B
    follows the policy: ×factor once B_noise >= ramp_at·B (hysteresis ignored)."""
    batch, s_auto, e_auto, known = BASE_BATCH, 0.0, 0.0, None
    for s in range(1, steps16 + 1):
        known = noise.get(s, known)
        if known is None:
            s_auto += 1.0
            e_auto += batch
            continue
        while known >= policy.ramp_at * batch:
            batch *= policy.factor
        progress = 1.0 / (1.0 + known / BASE_BATCH)
        s_auto += (1.0 + known / batch) * progress
        e_auto += (batch + known) * progress
    return s_auto / steps16, e_auto / (steps16 * BASE_BATCH)


def report(seed: int, best: dict, results: list[Result], autos: dict, target: float) -> dict:
    print(f"\n### seed {seed}: steps and sequences to val loss {target}\n")
    print("| batch | best LR | steps | sequences |\n|---|---|---|---|")
    for b, r in sorted(best.items()):
        print(
            f"| {b} | {r.lr:.3g} | {r.steps if r.steps else 'not reached'} | "
            f"{r.sequences if r.sequences else '—'} |"
        )
    reached = {b: r for b, r in best.items() if r.steps}
    fit = None
    if len(reached) >= 3:
        try:
            s_min, b_crit = fit_critical_batch(list(reached), [r.steps for r in reached.values()])
            fit = (s_min, b_crit)
            print(
                f"\nfit S = S_min(1 + B_crit/B): S_min = {s_min:.0f} steps, "
                f"B_crit = {b_crit:.1f} sequences"
            )
        except ValueError as e:
            print(f"\nno B_crit fit: {e}")
    r16 = best[BASE_BATCH]
    gns, low, high = (series(r16.db, r16.name, n) for n in (M.GNS, M.GNS_LOW, M.GNS_HIGH))
    print("\nnoise scale along fixed 16 (windowed, sequences; 95% one-sided bounds):\n")
    print("| step | val loss | noise scale | lower | upper |\n|---|---|---|---|---|")
    val = series(r16.db, r16.name, M.VAL_LOSS)
    end = r16.steps or max(val)
    for s in sorted({max(1, end * i // 8) for i in range(1, 9)}):
        near = max((k for k in low if k <= s), default=None)
        v = max((k for k in val if k <= s), default=None)
        if near is None:
            print(f"| {s} | {val.get(v, float('nan')):.3f} | — | — | — |")
            continue
        print(
            f"| {s} | {val.get(v, float('nan')):.3f} | {_fmt(gns.get(near))} | "
            f"{_fmt(low.get(near))} | {_fmt(high.get(near))} |"
        )
    at_target = gns.get(max((k for k in gns if k <= end), default=-1))
    ratio = fit[1] / at_target if fit and at_target else None
    if ratio is not None:
        print(
            f"\nat the target: noise scale {at_target:.1f}, B_crit {fit[1]:.1f}: "
            f"B_crit / noise scale = {ratio:.2f} (goal 0.5–4)"
        )
    policy = RampPolicy(original_batch=BASE_BATCH, original_lr=BASE_LR)
    same_lr = [r for r in results if r.batch == BASE_BATCH and math.isclose(r.lr, BASE_LR)]
    fixed16 = same_lr[0] if same_lr else r16
    fewest = min(reached.values(), key=lambda r: r.steps) if reached else None
    print(f"\n`--ramp auto` from 16 (policy: {policy.describe()}):\n")
    print(
        "| run | steps | sequences | steps / fixed 16 | sequences / fixed 16 |\n|---|---|---|---|---|"
    )
    rows = [("fixed 16 (same LR)", fixed16)]
    rows += [(f"auto from 16, ramp at {at:g}× the batch", r) for at, r in autos.items()]
    if fewest is not None:
        rows.append((f"fixed {fewest.batch} (fewest steps)", fewest))
    for label, r in rows:
        if r.steps and fixed16.steps:
            print(
                f"| {label} | {r.steps} | {r.sequences} | {r.steps / fixed16.steps:.2f} | "
                f"{r.sequences / fixed16.sequences:.2f} |"
            )
        else:
            print(f"| {label} | {r.steps or 'not reached'} | {r.sequences or '—'} | — | — |")
    out = {"ratio": ratio}
    noise = series(fixed16.db, fixed16.name, M.GNS) if fixed16.steps else {}
    for at, r in autos.items():
        if fixed16.steps:
            ps, pe = predicted_by_eq_2_11(noise, fixed16.steps, replace(policy, ramp_at=at))
            print(
                f"| eq. 2.11 for ramp at {at:g}× over fixed 16's noise scale | | | {ps:.2f} | "
                f"{pe:.2f} |"
            )
        out[at] = (
            (r.steps / fixed16.steps, r.sequences / fixed16.sequences)
            if r.steps and fixed16.steps
            else None
        )
    for at, r in autos.items():
        ramps = reader.events(r.db, r.name, kinds=[M.EVENT_RAMP])
        print(
            f"\nauto ramps (ramp at {at:g}×): "
            + (
                "; ".join(
                    f"step {e.step}: {e.data['before']['batch']} -> {e.data['after']['batch']}"
                    for e in ramps
                )
                or "none"
            )
        )
    return out


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--target", type=float, help="val loss (default 1.75; --quick 2.0)")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument(
        "--keep",
        type=Path,
        help="keep the run databases in this folder; finished "
        "runs already there are read, not trained again",
    )
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    target = a.target or (2.0 if a.quick else 1.75)
    batches = a.batches or ([8, 16, 32, 64] if a.quick else [8, 16, 32, 64, 128])
    seeds = a.seeds[:1] if a.quick else a.seeds
    if BASE_BATCH not in batches:
        raise SystemExit(f"ramp_bench: --batches must include {BASE_BATCH} (the auto run's start)")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    print(
        f"# ramp bench: bench-tiny, target val loss {target}, batches {batches}, seeds {seeds}, "
        f"LR grid {LR_GRID} × √ rule, {a.jobs} runs at once; load average {load:.2f}"
    )
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        out = a.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            best, autos, results = sweep(out, seed, batches, target, a.jobs)
            summary.append(report(seed, best, results, autos, target))
    print("\n### summary\n")
    for seed, s in zip(seeds, summary, strict=True):
        rt = "—" if s["ratio"] is None else f"{s['ratio']:.2f}"
        autos = "; ".join(
            f"ramp at {at:g}×: "
            + (
                "not reached"
                if s[at] is None
                else f"steps {s[at][0]:.2f}, sequences {s[at][1]:.2f}"
            )
            for at in AUTO_RAMP_AT
        )
        print(
            f"- seed {seed}: auto / fixed 16 — {autos} (goal: steps ≤ 0.75 at sequences ≤ 1.5); "
            f"B_crit / noise scale at target {rt} (goal 0.5–4)"
        )
    print(
        f"\nwall time {time.perf_counter() - t0:.0f} s on {os.cpu_count()} cores "
        f"(load average at start {load:.2f}, at end {os.getloadavg()[0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
