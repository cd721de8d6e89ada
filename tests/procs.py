"""Child processes for tests: each in its own process group, killed as a group, torch single-threaded."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rampwatch_command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m rampwatch ARGS…` from the checkout, as a user runs it: its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "rampwatch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bench_output(module: str, *args: str, timeout: float) -> str:
    """`python -m bench.MODULE ARGS…` from the checkout, as the README runs it: its stdout; fails
    with the end of its stderr when it exits non-zero."""
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def wait_until(condition, timeout: float = 60.0, every: float = 0.2) -> None:
    """Poll condition() until it is true; AssertionError after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout:g} s: {condition}")
        time.sleep(every)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def torchrun(*args: str, nproc: int = 2, restarts: int = 0) -> list[str]:
    """spawn() arguments of `torchrun --standalone --nproc_per_node=N ARGS…` (gloo on the CPU:
    the child picks its backend), e.g. torchrun("-m", "tests.lightning_child", DB, OUT)."""
    return [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}",
        *args,
    ]


def spawn(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """Start `python args...` from the repository root in a new process group."""
    popen_kwargs.setdefault("env", child_env())
    popen_kwargs.setdefault("cwd", REPO)
    return subprocess.Popen([sys.executable, *args], start_new_session=True, **popen_kwargs)


def run_torchrun(*args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `torchrun ARGS…` (torchrun() above) to its end from the checkout; its output as text."""
    return subprocess.run(
        [sys.executable, *torchrun(*args, nproc=nproc)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
    """Signal the child's whole process group (DataLoader workers, planners) and reap it."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=wait)


@contextlib.contextmanager
def children():
    """A spawner: children.spawn([...]) starts one; any still alive at the end is killed as a
    group (the `procs` fixture's, and a module fixture's)."""
    started = []

    class _Spawner:
        def spawn(self, args, **kw):
            p = spawn(args, **kw)
            started.append(p)
            return p

    try:
        yield _Spawner()
    finally:
        for p in started:
            if p.poll() is None:
                kill_group(p)


def start_loop(spawner, args: list[str]) -> tuple[subprocess.Popen, str]:
    """Start a training loop child whose first line is "run ID" (tests/own_loop_child.py and
    the example children); returns it and the run id, once the run is in the database."""
    proc = spawner.spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.startswith("run "), first + proc.stderr.read()
    return proc, first.split()[1]


def loop_parser(steps: int = 20, batch: int = 4, accum: int = 2) -> argparse.ArgumentParser:
    """The arguments every test training loop takes (tests/own_loop_child.py, lightning_child.py):
    DB OUT [--ramp MODE] [--steps N] [--batch B] [--accum A] [--wait-ramp-at S ...] [--policy
    JSON]."""
    p = argparse.ArgumentParser()
    p.add_argument("db")
    p.add_argument("out")
    p.add_argument("--ramp", default="manual")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--accum", type=int, default=accum)
    p.add_argument(
        "--wait-ramp-at",
        type=int,
        action="append",
        default=[],
        help="block at this step boundary until a ramp arrives (the test sends one)",
    )
    p.add_argument("--policy", default="{}", help="RampPolicy fields as JSON")
    return p


def free_ddp() -> None:
    """Collect a DistributedDataParallel model the caller has let go of (its reducer and hooks
    sit in reference cycles), so it is gone before destroy_process_group(). Destroyed after the
    process group, at interpreter exit, gloo aborted the rank ("terminate called without an
    active exception", exit -6) in 12 of 20 runs of a plain two-rank DDP loop on this 2-core
    machine under load, and in 0 of 15 with the model collected first (torch 2.13, CPU)."""
    import gc

    gc.collect()


def rank_line(text: str) -> None:
    """One write of the line and its newline, flushed: torchrun's ranks share one stdout, and
    print() writes the newline separately, so two ranks' lines could merge into one."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def wait_for_ramp(ask, wait: bool, timeout: float = 120.0):
    """ask() once, or, when wait, until it returns a ramp (or timeout seconds pass)."""
    ramp, deadline = ask(), time.monotonic() + timeout
    while ramp is None and wait and time.monotonic() < deadline:
        time.sleep(0.1)
        ramp = ask()
    return ramp


def wait_at_boundary(wait_at: int) -> None:
    """Patch Monitor.ramp_due for a loop run as written (runpy): print "run ID" at the first
    boundary, and at boundary `wait_at` wait until the test's ramp or trial command is claimed
    (the loop would otherwise finish first)."""
    from rampwatch import Monitor

    ramp_due = Monitor.ramp_due

    def waiting_ramp_due(mon):
        if mon.last_step == 1:
            print(f"run {mon.run_id}", flush=True)
        asked = []

        def claimed():  # a ramp, or a trial that the loop's trial_due() will hand out next
            asked.append(ramp_due(mon))
            return asked[-1] or mon.ramps.trials.pending

        wait_for_ramp(claimed, mon.last_step == wait_at)
        return asked[-1]

    Monitor.ramp_due = waiting_ramp_due
