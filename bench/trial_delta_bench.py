"""The trainer's default trial Δ on the demo's run: the old fixed rule against Δ from the run's own
loss curve, from the same snapshot.

    python -m bench.trial_delta_bench                        # cpu-tiny, seeds 0 1 2, step 256
    python -m bench.trial_delta_bench --seeds 0 --step 200 --keep DIR
    python -m bench.trial_delta_bench --quick                # test-tiny, a smoke run

Per seed: the reference trainer (`rampwatch train`, bench/tiny_runs.train_tiny) trains the demo's
run (scripts/demo.sh: cpu-tiny, 4 × 2 sequences per step) to `--step` and checkpoints there (its
monitor's loss history rides in the checkpoint). Then, from copies of that database and
checkpoint, two resumes each take a "Test ×2 / ×4 first" command as the card sends it, within a
few steps of the snapshot (when the writer's flusher claims it): one with the old default Δ (trainer/config.py default_trial_delta_tokens,
given as the command's Δ), one with Δ left to the loop (null: chosen from the loss curve). Each
resume is stopped (SIGTERM: a checkpoint at the next boundary) once its trial has ended. The
table: Δ and what it rested on, the control's half-progress ratio with its one-sided 95% bounds,
the Δ check (advisor/trial.py: fine, too long, cannot tell; only "fine" judges the branches), the
verdict, the cost and seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.child import child_env
from bench.tiny_runs import train_tiny
from rampwatch.advisor.trial import HALF_PROGRESS_MIN, TrialVerdict
from rampwatch.store import commands, reader
from rampwatch.store import names as M
from rampwatch.store.errors import StoreError
from rampwatch.trainer.config import PRESET_RUN_DEFAULTS, PRESETS, default_trial_delta_tokens

BATCH = 8  # the demo's 4 × 2 sequences per step
POLL_S = 0.5


def snapshot_run(out: Path, seed: int, a) -> tuple[Path, str]:
    """The run to the trial's step, checkpointed there; (its folder, run id)."""
    base = out / f"s{seed}-to{a.step}"
    base.mkdir(parents=True, exist_ok=True)
    name = f"s{seed}"
    train_tiny(base, name, seed=seed, steps=a.step, batch=BATCH, extra=a.extra, preset=a.preset)
    return base, name


def trial_from(base: Path, name: str, into: Path, delta: int | None, a) -> dict:
    """Resume a copy of the snapshot run with a ×2/×4 trial command; its trial and events."""
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(base, into)
    db = into / f"{name}.duckdb"
    args = [sys.executable, "-m", "rampwatch", "train", "--preset", a.preset, "--db", str(db)]
    args += ["--resume", name, "--steps", str(a.step + 10_000), "--val-every", "0"]
    args += ["--checkpoint-dir", str(into / "ckpt"), "--checkpoint-every", "0"]
    args += ["--progress", "off", "--no-plan", *a.extra]
    env = child_env()
    log = open(into / "trainer.log", "wb")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=into)
    t0 = time.perf_counter()
    try:
        cid = None
        while cid is None:
            if proc.poll() is not None:
                raise SystemExit(f"the resume of {name} ended early: see {into / 'trainer.log'}")
            try:
                if reader.get_run(db, name).status == "running":
                    payload = {"factors": [2, 4], "delta_tokens": delta}
                    cid = commands.submit(db, name, "trial", payload, actor="trial_delta_bench")
            except StoreError:
                pass  # busy or not yet resumed: poll again
            time.sleep(POLL_S)
        while not any(t.command_id == cid and t.status != "running" for t in _trials(db, name)):
            if proc.poll() is not None:
                break
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        log.close()
    [trial] = [t for t in reader.trials(db, name) if t.command_id == cid] or [None]
    starts = [e for e in reader.events(db, name, kinds=[M.EVENT_TRIAL_START])]
    return {
        "trial": trial,
        "start": starts[-1] if starts else None,
        "wall": time.perf_counter() - t0,
    }


def _trials(db: Path, name: str):
    try:
        return reader.trials(db, name)
    except StoreError:
        return []


def row(seed: int, label: str, got: dict) -> str:
    t, start = got["trial"], got["start"]
    if t is None or t.verdict is None:
        why = "no trial" if t is None else f"{t.status}: {t.reason}"
        return f"| {seed} | {label} | | | | {why} | | |"
    v = TrialVerdict.from_dict(t.verdict)
    r = "—" if v.half_progress_ratio is None else f"{v.half_progress_ratio:.2f}"
    if v.half_progress_bounds is not None:
        lo, hi = v.half_progress_bounds
        r += f" ({lo:.2f}–{'∞' if hi is None else f'{hi:.2f}'})"
    choice = (start.data.get("delta_choice") or {}) if start else {}
    basis = choice.get("basis", "?")
    expected = choice.get("expected_ratio")
    basis += f", expected r {expected:.2f}" if expected is not None else ""
    judged = v.delta_check or ("fine" if v.delta_ok else "too long")
    if v.examples_to_tell is not None:
        judged += f" (~{v.examples_to_tell:,} examples would tell)"
    verdict = v.summary.split(" Cost:")[0]
    return (
        f"| {seed} | {label} | {t.start_step} | {t.delta_tokens:,} ({basis}) | {r} | {judged} | "
        f"{verdict} | {t.cost_tokens:,}, {got['wall']:.0f} s |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--step", type=int, default=256, help="the trials' snapshot step")
    ap.add_argument("--quick", action="store_true", help="test-tiny, step 60: a smoke run")
    ap.add_argument("--keep", type=Path, help="keep the runs here; finished ones are reused")
    a = ap.parse_args()
    a.preset = "test-tiny" if a.quick else "cpu-tiny"
    a.step = 60 if a.quick else a.step
    a.extra = ("--ramp", "manual") + (("--total-tokens", "10000000000") if a.quick else ())
    seq_len = PRESETS[a.preset].seq_len
    total = 10**10 if a.quick else PRESET_RUN_DEFAULTS[a.preset].total_tokens
    old = default_trial_delta_tokens(BATCH, seq_len, total)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    print(
        f"# trial Δ bench ({a.preset}, {BATCH} sequences per step): ×2/×4 trials from step "
        f"{a.step}, the old default Δ {old:,} vs Δ from the loss curve; seeds {a.seeds}; "
        f"load average {load:.2f}\n"
    )
    print(
        f"| seed | default | step | Δ tokens (from) | control's r, 95% bounds "
        f"({HALF_PROGRESS_MIN:.2f} needed) | Δ check | verdict | cost tokens, wall |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    checks = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = a.keep or Path(tmp)
        for seed in a.seeds:
            base, name = snapshot_run(out, seed, a)
            for label, delta in (("old", old), ("new", None)):
                got = trial_from(base, name, out / f"s{seed}-{label}", delta, a)
                t = got["trial"]
                v = TrialVerdict.from_dict(t.verdict) if t is not None and t.verdict else None
                checks[label].append("no verdict" if v is None else v.delta_check)
                print(row(seed, label, got), flush=True)
    n = len(a.seeds)
    for label, name in (("old", "old default"), ("new", "from the loss curve")):
        got = ", ".join(f"{c} {checks[label].count(c)}" for c in sorted(set(checks[label])))
        print(f"\nΔ check, {name}: {got} (of {n})", end="")
    print()
    print(
        f"wall time {time.perf_counter() - t0:.0f} s on {os.cpu_count()} cores "
        f"(load average at start {load:.2f}, at end {os.getloadavg()[0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
