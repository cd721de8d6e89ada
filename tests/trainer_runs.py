"""Helpers for tests that run the reference trainer as a real child process."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np

from rampwatch.store import reader
from tests.procs import kill_group, spawn

QUICK = ["--preset", "test-tiny", "--progress", "off", "--val-every", "0"]


def trainer_args(db: Path, ckpt: Path, *extra: str) -> list[str]:
    return [
        "-m",
        "trainer",
        "train",
        "--db",
        str(db),
        "--checkpoint-dir",
        str(ckpt),
        *QUICK,
        *extra,
    ]


def run_trainer(
    db: Path, ckpt: Path, *extra: str, timeout: float = 240, **popen_kwargs
) -> subprocess.CompletedProcess:
    """Run a trainer to completion; fail with its output if it does not finish in time.
    popen_kwargs: e.g. a preexec_fn that sets a resource limit in the child."""
    proc = spawn(
        trainer_args(db, ckpt, *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **popen_kwargs,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(f"trainer did not finish within {timeout}s: {extra}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), "")


def wait_for_step(db: Path, run_id: str, step: int, proc=None, timeout: float = 120) -> int:
    """Poll the database until the run has logged `step` (the trainer is a separate process)."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} before step {step}")
        try:
            last = reader.get_run(db, run_id).last_step or -1
        except Exception:  # noqa: BLE001 - not created yet, or busy: poll again
            last = -1
        if last >= step:
            return last
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} reached step {last}, not {step}, within {timeout}s")


def metric(db: Path, run_id: str, name: str) -> dict[int, float]:
    """{step: value} of one metric, from the raw rows (one row per step expected)."""
    import pyarrow.compute as pc

    table = reader.export(db, run_id)
    rows = table.filter(pc.equal(table["name"], name))
    steps = rows["step"].to_numpy()
    values = rows["value"].to_numpy()
    assert len(np.unique(steps)) == len(steps), f"{name}: a step logged twice"
    return dict(zip(steps.tolist(), values.tolist(), strict=True))
