"""Ramp trials on real training: bench-tiny (or test-tiny) at batch 16, a trial at each of a few
steps, its bracket beside the constant-batch sweep's critical batch at the same loss and beside
B_simple.

    python -m bench.trial_tiny_bench                       # seed 0, trials at steps 100 250 450
    python -m bench.trial_tiny_bench --seeds 0 1 --keep DIR
    python -m bench.trial_tiny_bench --preset test-tiny    # 128-token sequences, sweep to 1.5
    python -m bench.trial_tiny_bench --no-sweep            # the trials only

The trial run is the reference trainer (`rampwatch train`, bench/tiny_runs.train_tiny) at 16
sequences per step (2 × 8, √-rule LR 3e-3, validation every 10 steps on 64 fixed sequences).
When its logged step reaches a point, the bench queues a "trial" command (factors ×2 ×4 ×8,
Δ tokens per arm), as the card's button does; `--trial-keep 1` makes every trial continue from
its control, so the run stays at 16 and the next point is trained like the first. The trials
table (store.reader.trials) gives the step it started at, the verdict, its cost in tokens, % of
the run's tokens and seconds. `--delta-tokens 0` leaves Δ to the trainer (from its loss curve);
`--eval-batch N` sets the trials' held-out batch (the trainer's default: 256).

Beside each trial, from a constant-batch sweep (ramp_bench.run at batches 8-64, each at the
√-rule LR from 3e-3 at 16: one LR per batch, not ramp_bench's best of three, to fit the time; run
to val loss 1.65 on bench-tiny, 1.5 on test-tiny, below every point's loss less the local drop;
the LR constant after warmup on both): at the validation loss L the
trial run had at the trial's step, the steps to L from the start for each batch and their fit
S = S_min(1 + B_crit/B) (advisor.gns.fit_critical_batch), and the local fit over the steps from L
to L − `--local-drop`. B_simple is the run's own logged gns_b_simple (windowed) at that step.

--auto (bench-tiny) adds ramp_bench's comparison to val loss 1.75: fixed 16 (the sweep's run), noise-gated
`--ramp auto` and trial-gated `--ramp auto --ramp-gate trial` (Δ 8,192 tokens; 0: the trainer's
own, from the loss curve; `--auto-eval-batch N`: the trials' held-out batch), their steps and
sequences to the target, the sequences of the trials' discarded arms counted apart.
`--auto-only` runs that comparison alone (fixed 16 by ramp_bench.run, no trial run or sweep).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.ramp_bench import BASE_BATCH, BASE_LR, MAX_SEQUENCES, measured, run, series
from bench.tiny_runs import train_tiny
from bench.trial_bench import bracket_text, ratio_text
from rampwatch.advisor.gns import fit_critical_batch
from rampwatch.advisor.trial import TrialVerdict
from rampwatch.store import commands, reader
from rampwatch.store import names as M
from rampwatch.store.errors import CommandError, StoreError
from rampwatch.trainer.config import PRESETS

POINTS = (100, 250, 450)
FACTORS = (2, 4, 8)
DELTA_STEPS = 16  # Δ: 16 steps of the control, 2 of ×8 (Δ must be whole steps of every arm)
STEPS = 650  # the last point + room for the ~1-2 s (up to ~100 steps idle) a claim takes
SWEEP = (8, 16, 32, 64)
# the sweep's val loss per preset: below the last point's loss less the local drop
TARGETS = {"bench-tiny": 1.65, "test-tiny": 1.5}
POLL_S = 0.2
AUTO_TARGET = 1.75  # ramp_bench's target for the auto comparison
AUTO_DELTA_TOKENS = 8_192  # the trial-gated run's Δ: 8 steps of 16, whole steps of ×4


def trial_run(out: Path, seed: int, args) -> tuple[Path, str, float]:
    """Train the batch-16 run, queueing one trial at each point; (db, run id, wall seconds)."""
    name = f"{_prefix(args.preset)}s{seed}-trials-b16-d{args.delta_tokens}"
    flags = ("--ramp", "manual", "--trial-keep", "1", "--total-tokens", str(10**12))
    if args.eval_batch:
        name += f"-e{args.eval_batch}"
        flags += ("--trial-eval-batch", str(args.eval_batch))
    db = out / f"{name}.duckdb"
    if db.exists() and reader.get_run(db, name).status == "finished":  # --keep: read, not trained
        return db, name, 0.0
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            train_tiny,
            out,
            name,
            seed=seed,
            steps=args.steps,
            batch=BASE_BATCH,
            lr=BASE_LR,
            val_every=10,
            extra=flags,
            preset=args.preset,
        )
        payload = {"factors": list(args.factors)}
        if args.delta_tokens:  # 0: the trainer's own Δ, from its loss curve
            payload["delta_tokens"] = args.delta_tokens
        for point in args.points:
            command = None
            while not job.done() and command is None:
                if logged_step(db, name) >= point:
                    try:
                        command = commands.submit(
                            db, name, "trial", payload, actor="trial_tiny_bench"
                        )
                    except CommandError as e:  # the run ended first: say so, keep the rest
                        print(f"no trial at step {point}: {e} (give more --steps)")
                        break
                time.sleep(POLL_S)
            while command is not None and not job.done() and not trial_over(db, name, command):
                time.sleep(POLL_S)
        _, wall = job.result()
    return db, name, wall


def logged_step(db: Path, name: str) -> int:
    """The newest step in the store, -1 before the run is there."""
    if not db.exists():
        return -1
    try:
        return reader.latest(db, name, [M.LOSS]).get(M.LOSS, (-1, 0.0))[0]
    except StoreError:  # the run is not registered yet
        return -1


def trial_over(db: Path, name: str, command: int) -> bool:
    return any(t.command_id == command and t.status != "running" for t in reader.trials(db, name))


def at_or_before(values: dict[int, float], step: int) -> float | None:
    near = max((s for s in values if s <= step), default=None)
    return None if near is None else values[near]


def steps_to(db: Path, name: str, loss: float) -> int | None:
    """The first validated step at or below `loss` (None: never)."""
    val = series(db, name, M.VAL_LOSS)
    return next((s for s, v in sorted(val.items()) if v <= loss), None)


def b_crit(steps: dict[int, int | None]) -> str:
    """The fit S = S_min(1 + B_crit/B) over the batches that reached, as text."""
    got = {b: s for b, s in steps.items() if s}
    if len(got) < 3:
        return "— (fewer than 3 batches)"
    try:
        return f"{fit_critical_batch(list(got), list(got.values()))[1]:.0f}"
    except ValueError:  # e.g. S_min < 0: the steps do not fall as 1 + B_crit/B
        return "— (no fit)"


def _prefix(preset: str) -> str:
    """Run names: bench-tiny's as before (a --keep folder of older runs still reads)."""
    return "" if preset == "bench-tiny" else f"{preset}-"


def sweep(out: Path, seed: int, batches, target: float, jobs: int, preset: str) -> dict:
    """{batch: ramp_bench Result} at the √-rule LR, each run to the target."""
    with ThreadPoolExecutor(jobs) as pool:
        futures = {
            b: pool.submit(
                run,
                out,
                f"{_prefix(preset)}s{seed}-b{b}-lr1-t{target:g}",
                b,
                BASE_LR * math.sqrt(b / BASE_BATCH),
                seed,
                target,
                preset=preset,
            )
            for b in batches
        }
        return {b: f.result() for b, f in futures.items()}


def report(seed: int, db: Path, name: str, wall: float, runs: dict | None, a) -> None:
    """The trials' table and summaries; beside them the sweep's fits at each trial's loss."""
    drop = a.local_drop
    run_tokens = a.steps * BASE_BATCH * reader.get_run(db, name).config["seq_len"]
    val, gns = series(db, name, M.VAL_LOSS), series(db, name, M.GNS)
    trials = sorted(reader.trials(db, name), key=lambda t: t.start_step or 0)
    trained = f"{wall:.0f} s of training" if wall else "reused from --keep"
    print(f"\n### seed {seed}: trials along fixed 16 ({trained})\n")
    print(
        "| step | val loss | B_simple (logged) | bracket, the control's half-progress ratio | ×2 / ×4 / ×8: mean diff, bound, "
        "tolerance | cost: tokens, % of the run's, s | B_crit to L (sweep) | local B_crit L→L−"
        f"{drop:g} |\n|---|---|---|---|---|---|---|---|"
    )
    for t in trials:
        if t.verdict is None:
            print(f"| {t.start_step} | | | {t.status}: {t.reason} | | | | |")
            continue
        v = TrialVerdict.from_dict(t.verdict)
        loss, noise = at_or_before(val, t.start_step), at_or_before(gns, t.start_step)
        arms = "; ".join(
            [
                f"{r.mean_diff:+.4f} ≤ {r.bound:+.4f} vs {r.tolerance:.4f} "
                f"{'pass' if r.passed else 'fail'}"
                for r in v.branches
            ]
            + [f"×{k} not run" for k in v.not_run]
        )
        bracket = f"{bracket_text(v.bracket)}, Δ check {ratio_text(v)}"
        share = t.cost_tokens / run_tokens  # the trainer's own fraction is of --total-tokens
        cost = f"{t.cost_tokens:,}, {100 * share:.1f}%, {t.cost_seconds:.1f}"
        to_l = local = "—"
        if runs and loss is not None:
            first = {b: steps_to(r.db, r.name, loss) for b, r in runs.items()}
            later = {b: steps_to(r.db, r.name, loss - drop) for b, r in runs.items()}
            to_l = b_crit(first)
            local = b_crit(
                {
                    b: later[b] - first[b]
                    for b in runs
                    if first[b] and later[b] and later[b] > first[b]
                }
            )
        print(
            f"| {t.start_step} | {loss:.3f} | {noise:.1f} | {bracket} | {arms} | {cost} | "
            f"{to_l} | {local} |"
        )
    print()
    for t in trials:
        if t.verdict is not None:
            print(f"- step {t.start_step}: {TrialVerdict.from_dict(t.verdict).summary}")
    if runs:
        print(f"\nsweep (√-rule LR): steps to each trial's loss L (+ steps on to L − {drop:g})\n")
        losses = [at_or_before(val, t.start_step) for t in trials]
        print("| batch | LR | " + " | ".join(f"L = {x:.3f}" for x in losses if x) + " |")
        print("|---|---|" + "---|" * len([x for x in losses if x]))
        for b, r in sorted(runs.items()):
            cells = [
                (steps_to(r.db, r.name, x), steps_to(r.db, r.name, x - drop)) for x in losses if x
            ]
            print(
                f"| {b} | {r.lr:.3g} | "
                + " | ".join(f"{s or '—'} (+{e - s if s and e else '—'})" for s, e in cells)
                + " |"
            )


def autos(out: Path, seed: int, fixed16, target: float, delta: int, eval_batch: int) -> None:
    """Trial-gated auto vs noise-gated auto vs fixed 16 (ramp_bench's method): steps, sequences
    and the last validation loss at the target; a trial's discarded arms counted apart. delta 0:
    the trainer's own Δ; eval_batch 0: its own held-out batch."""
    noise = run(out, f"s{seed}-auto-at1", BASE_BATCH, BASE_LR, seed, target, ramp_at=1.0)
    name = f"s{seed}-auto-trial-d{delta}-e{eval_batch}"
    trial_flags = ("--trial-delta-tokens", str(delta)) if delta else ()
    trial_flags += ("--trial-eval-batch", str(eval_batch)) if eval_batch else ()
    db, wall = train_tiny(
        out,
        name,
        seed=seed,
        steps=MAX_SEQUENCES // BASE_BATCH,
        batch=BASE_BATCH,
        lr=BASE_LR,
        val_every=10,
        extra=("--target-val-loss", str(target), "--ramp", "auto", "--ramp-gate", "trial")
        + trial_flags,
    )
    gated = measured(db, name, BASE_BATCH, BASE_LR, target, wall)
    fixed = measured(fixed16.db, fixed16.name, BASE_BATCH, fixed16.lr, target, 0.0)
    print(f"\n### seed {seed}: to val loss {target}\n")
    print(
        "| run | steps | sequences | + trial arms (sequences) | val loss at the hit | "
        "steps / fixed 16 | sequences (with arms) / fixed 16 | ramps |\n|---|---|---|---|---|---|---|---|"
    )
    for label, r in (("fixed 16", fixed), ("noise-gated auto", noise), ("trial-gated auto", gated)):
        val = series(r.db, r.name, M.VAL_LOSS)
        seq_len = reader.get_run(r.db, r.name).config["seq_len"]
        done = [t for t in reader.trials(r.db, r.name) if t.status == "finished"]
        arms = sum(t.cost_tokens or 0 for t in done) // seq_len
        kept = sum(t.delta_tokens for t in done if r.steps and t.start_step < r.steps) // seq_len
        seqs = (r.sequences or 0) + kept  # the kept arm's steps log no batch
        ramps = "; ".join(
            f"{e.step}: {e.data['before']['batch']}→{e.data['after']['batch']}"
            for e in reader.events(r.db, r.name, kinds=[M.EVENT_RAMP])
        )
        if not (r.steps and fixed.steps):
            print(f"| {label} | not reached | | {arms} | | | | {ramps or 'none'} |")
            continue
        print(
            f"| {label} | {r.steps} | {seqs} | {arms} | {val[r.steps]:.3f} | "
            f"{r.steps / fixed.steps:.2f} | {(seqs + arms) / fixed.sequences:.2f} | "
            f"{ramps or 'none'} |"
        )
    for t in reader.trials(db, name):
        v = TrialVerdict.from_dict(t.verdict) if t.verdict else None
        held_out = f", {v.examples:,} held-out" if v else ""
        print(
            f"- trial-gated, step {t.start_step} ({t.source}{held_out}): {v.summary if v else t.reason}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--points", type=int, nargs="+", default=list(POINTS))
    ap.add_argument("--factors", type=int, nargs="+", default=list(FACTORS))
    ap.add_argument("--preset", choices=sorted(TARGETS), default="bench-tiny")
    ap.add_argument("--delta-tokens", type=int, help=f"default: {DELTA_STEPS} steps of the control")
    ap.add_argument("--eval-batch", type=int, default=0, help="the trials' held-out batch")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batches", type=int, nargs="+", default=list(SWEEP))
    ap.add_argument("--target", type=float, help="the sweep's val loss (default: the preset's)")
    ap.add_argument("--local-drop", type=float, default=0.1)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--auto", action="store_true", help="also trial- vs noise-gated auto vs 16")
    ap.add_argument("--auto-delta-tokens", type=int, default=AUTO_DELTA_TOKENS)
    ap.add_argument("--auto-eval-batch", type=int, default=0)
    ap.add_argument("--auto-only", action="store_true", help="the --auto comparison alone")
    ap.add_argument("--jobs", type=int, default=2, help="sweep runs at once (one thread each)")
    ap.add_argument("--keep", type=Path, help="keep the runs here; finished ones are reused")
    a = ap.parse_args()
    seq_len = PRESETS[a.preset].seq_len
    if a.delta_tokens is None:
        a.delta_tokens = DELTA_STEPS * BASE_BATCH * seq_len
    a.target = a.target or TARGETS[a.preset]
    load, t0 = os.getloadavg()[0], time.perf_counter()
    print(
        f"# trial bench ({a.preset}, {seq_len}-token sequences): batch 16, trials ×{a.factors} at steps {a.points}, "
        f"Δ {f'{a.delta_tokens:,}' if a.delta_tokens else 'the trainer’s own'} tokens per arm, "
        f"{a.steps} steps; seeds {a.seeds}; "
        f"load average {load:.2f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = a.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for seed in a.seeds:
            if a.auto_only:
                fixed = run(out, f"s{seed}-b{BASE_BATCH}", BASE_BATCH, BASE_LR, seed, AUTO_TARGET)
                autos(out, seed, fixed, AUTO_TARGET, a.auto_delta_tokens, a.auto_eval_batch)
                continue
            db, name, wall = trial_run(out, seed, a)
            runs = None if a.no_sweep else sweep(out, seed, a.batches, a.target, a.jobs, a.preset)
            report(seed, db, name, wall, runs, a)
            if a.auto and runs and BASE_BATCH in runs and a.preset == "bench-tiny":
                autos(
                    out, seed, runs[BASE_BATCH], AUTO_TARGET, a.auto_delta_tokens, a.auto_eval_batch
                )
    print(
        f"\nwall time {time.perf_counter() - t0:.0f} s on {os.cpu_count()} cores "
        f"(load average at start {load:.2f}, at end {os.getloadavg()[0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
