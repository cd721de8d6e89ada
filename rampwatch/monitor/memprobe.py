"""The measured alternative to the fake-tensor plan: real training steps at increasing
per-device batches on the real device, in a child process, until the first out-of-memory (what
Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size do).

Owns: `probe` and `python -m rampwatch.monitor.memprobe` (its child). The setup is the plan's
(monitor/memplan.py): setup(per_device_batch) -> (model, optimizer, batch, train_step), built
under `with torch.device(device)`. Per batch, ascending: build, one warm step (optimizer state,
lazy initialisation), then one measured step. The measured peak is what Monitor logs
(docs/ARCHITECTURE.md, "Memory model"): on CUDA max_memory_reserved after reset_peak_memory_stats;
on the CPU the child's VmHWM, reset through /proc/self/clear_refs (monitor/device.py's CpuPeak, the peak Monitor logs), with
glibc's mmap threshold fixed (as bench/memplan_bench.py does) so freed tensors leave the resident
set and one batch does not inherit the last one's heap. A row:
    {"per_device_batch", "variant": "plain", "measured_bytes", "steady_bytes", "feasible",
     "source": "probe", "device_type", "seconds", "error"}
steady_bytes is the resident (CPU) or reserved (CUDA) memory before the measured step, so
measured - steady is what the step adds (the plan's predicted - steady). The first batch that
runs out of memory gets feasible False and ends the probe (larger batches get no row); a child
killed outright (the kernel's OOM killer) marks the batch it was running the same way.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Callable, Iterator, Sequence

import torch

from rampwatch.monitor.device import CpuPeak  # the peak Monitor logs on the CPU
from rampwatch.monitor.planproc import (
    PlanHandle,
    check_setup,
    child_env,
    child_main,
    request_base,
    resolve_setup,
)

MMAP_THRESHOLD = 16384  # bytes: every tensor of at least this size is its own mapping


def _row(b: int, device_type: str, t0: float, **kw) -> dict:
    row = {
        "per_device_batch": b,
        "variant": "plain",
        "measured_bytes": None,
        "steady_bytes": None,
        "feasible": None,
        "source": "probe",
        "device_type": device_type,
        "seconds": round(time.perf_counter() - t0, 3),
        "error": None,
    }
    row.update(kw)
    return row


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    text = str(e)
    return (
        isinstance(e, (oom, MemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def _complete(request: dict, rows: list[dict], error: str) -> list[dict]:
    """Rows the child did not write: a kill (by signal, not by us) marks the batch it was
    running infeasible; otherwise every missing batch carries the error."""
    if rows and rows[-1].get("feasible") is False:
        return rows
    done = {r.get("per_device_batch") for r in rows}
    missing = [b for b in request["batches"] if b not in done]
    dev = request["device_type"]
    out = list(rows)
    for i, b in enumerate(missing):
        if i == 0 and "killed by signal" in error:
            out.append(
                _row(
                    b,
                    dev,
                    time.perf_counter(),
                    feasible=False,
                    seconds=None,
                    error=f"{error} (at per-device batch {b}: most likely out of memory)",
                )
            )
            break
        out.append(_row(b, dev, time.perf_counter(), seconds=None, error=error))
    return out


def probe(
    setup: str | Callable, batches: Sequence[int], *, device: str = "cpu", timeout_s: float = 600.0
) -> list[dict]:
    """Measured rows for the batches (ascending) on `device` ("cpu" | "cuda": the current
    CUDA device), in a child process; never raises. Blocks until done (or timeout_s)."""
    bs = sorted({int(b) for b in batches})
    dev = torch.device(device).type
    try:
        if dev not in ("cpu", "cuda"):
            raise ValueError(f"probe device must be 'cpu' or 'cuda', got {device!r}")
        request = request_base(setup, bs, dev)
    except (TypeError, ValueError) as e:
        return _complete({"batches": bs, "device_type": dev}, [], f"{type(e).__name__}: {e}")
    env = child_env(dev)
    env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_ARENA_MAX="1")
    handle = PlanHandle(
        request, timeout_s, "rampwatch.monitor.memprobe", env=env, complete=_complete
    )
    return handle.result()


# -- the child ------------------------------------------------------------------------------


def _probe_one(fn: Callable, b: int, dev: torch.device, cpu_peak) -> dict:
    t0 = time.perf_counter()
    model = opt = batch = step = None
    try:
        with torch.device(dev):
            model, opt, batch, step = check_setup(fn(b))
        step(model, opt, batch)  # warm: optimizer state exists, lazy initialisation is done
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            steady = torch.cuda.memory_reserved(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        else:
            steady, _ = cpu_peak.read_and_reset()
        step(model, opt, batch)
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_reserved(dev)
        else:
            _, peak = cpu_peak.read_and_reset()
        return _row(
            b, dev.type, t0, measured_bytes=int(peak), steady_bytes=int(steady), feasible=True
        )
    except Exception as e:  # noqa: BLE001 - surfaced as data, never raised
        what = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]
        if _is_oom(e):
            return _row(
                b,
                dev.type,
                t0,
                feasible=False,
                error=f"out of memory at per-device batch {b}: {what}",
            )
        return _row(b, dev.type, t0, error=f"the probe failed at per-device batch {b}: {what}")
    finally:
        del model, opt, batch, step
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _run_request(req: dict) -> Iterator[dict]:
    dev = torch.device(req["device_type"])
    t0 = time.perf_counter()
    error = None
    try:
        fn = resolve_setup(req["setup"])
    except Exception as e:  # noqa: BLE001
        error = (
            f"cannot import setup {req['setup']!r} in the probe's process: {type(e).__name__}: {e}"
        )
    if error is None and dev.type == "cuda" and not torch.cuda.is_available():
        error = "probe on 'cuda' needs a CUDA build of torch and a visible GPU"
    if error is None and dev.type == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        error = "the CPU probe reads Linux's VmHWM (/proc/self/clear_refs); probe on 'cuda'"
    if error is not None:
        for b in req["batches"]:
            yield _row(b, dev.type, t0, seconds=None, error=error)
        return
    cpu_peak = CpuPeak() if dev.type == "cpu" else None
    for b in req["batches"]:
        row = _probe_one(fn, b, dev, cpu_peak)
        yield row
        if row["feasible"] is False:
            return


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(argv, "python -m rampwatch.monitor.memprobe", _run_request)


if __name__ == "__main__":
    sys.exit(main())
