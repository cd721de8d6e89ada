"""Recorded training runs for the benches that measure the science on real training: one
`bench-tiny` run of the reference trainer in a child process, into out/NAME.duckdb, reused when a
finished one is already there (--keep).

Owns: `train_tiny`. forecast_bench, ramp_bench and noise_window_bench record their runs with it,
so each bench's run differs from the others only in the flags it names.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.child import child_env
from rampwatch.store import reader


def train_tiny(
    out: Path,
    name: str,
    *,
    seed: int,
    steps: int,
    batch: int | None = None,
    lr: float | None = None,
    val_every: int = 0,
    extra: tuple[str, ...] = ("--ramp", "off"),
    preset: str = "bench-tiny",
) -> tuple[Path, float]:
    """Train (or reuse) out/NAME.duckdb; returns the database and the seconds training took (0.0
    for a reused run). batch: sequences per step as 2 micro-batches of batch/2 (the preset's when
    None); extra: further `rampwatch train` flags (default: no ramps); preset: the model."""
    db = out / f"{name}.duckdb"
    if db.exists():
        if reader.get_run(db, name).status == "finished":
            return db, 0.0
        for leftover in out.glob(f"{name}.duckdb*"):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    args = [sys.executable, "-m", "rampwatch", "train", "--preset", preset]
    args += ["--db", str(db), "--run-id", name, "--seed", str(seed), "--steps", str(steps)]
    if batch is not None:
        args += ["--per-device-batch", str(batch // 2), "--accum", "2"]
    if lr is not None:
        args += ["--lr", f"{lr:.6g}"]
    if val_every:
        args += ["--val-every", str(val_every), "--val-batch", "64"]
    else:
        args += ["--val-every", "0"]
    args += ["--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "0"]
    args += ["--progress", "off", "--no-plan", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(args, env=child_env(), capture_output=True, text=True, cwd=out)
    if done.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return db, time.perf_counter() - t0
