"""Memory plan for any model: the peak memory of one training step per per-device batch,
predicted on fake tensors (no real memory), with a per-component breakdown; in a child process
for a running loop. `probe` (monitor/memprobe.py) is the measured alternative.

Owns: `plan_in_process` and `start_plan` (the plan of a user's setup, traced by
monitor/memtrace.py, which trainer/gpt_plan.py's GPT plan shares), `plan_points` and `calibrate`
(plan rows -> advisor/memory.py), and `python -m rampwatch.monitor.memplan` (prints the rows).

A user describes the model with one module-level function (docs/ARCHITECTURE.md, "Memory model"):

    def setup(per_device_batch):              # in mypkg/train.py (or the running script)
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        batch = (torch.randn(per_device_batch, 784), torch.randint(0, 10, (per_device_batch,)))
        return model, opt, batch, train_step  # train_step(model, opt, batch): forward,
                                              # backward, opt.step()
    handle = start_plan(setup, [8, 16, 32])   # or "mypkg.train:setup"; handle.result() -> rows

setup runs under `with torch.device(...)` (the planned device), so plain factory calls land
there; its function crosses to the child by reference (monitor/planproc.py). The plan runs setup
under FakeTensorMode, then two iterations of train_step under a MemTracker subclass with
`reset_mod_stats()` between them: the peak of the *second* iteration is the plan, since only then
does optimizer state exist. The planner calls optimizer.zero_grad itself between iterations (a
call inside train_step is deferred to then), so with accum_steps > 1 the second backward adds to
the first one's gradients. train_step must not read values (no `loss.item()` for a log line, no
GradScaler: fake tensors have none). A row is plain data (JSON-able):
    {"per_device_batch", "variant", "predicted_bytes", "breakdown", "steady_bytes", "peak_phase",
     "device_type", "amp", "accum_steps", "seconds", "source", "error"}
(an error row has None for the figures and says why). breakdown = {parameters, gradients,
optimizer, activations} (+ "logits" for a traced loss head, the GPT's), taken at the moment of the
peak: it sums exactly to predicted_bytes. "activations" is every activation or backward
temporary, and the batch. steady_bytes is what lives between two steps, so peak - steady is what
one step adds. The plan excludes constants (CUDA context, allocator caching, kernel workspaces):
calibrate them against a measured peak (`calibrate`). Fake tensors have no values: a model that
reads them (.item(), .tolist(), a tensor in an `if`), makes data-dependent shapes (nonzero,
boolean masks) or calls kernels without a fake implementation gets an error row that says so and
names `probe`; the plan never guesses.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Callable, Iterator, Mapping, Sequence

import torch

from rampwatch.monitor.memprobe import probe
from rampwatch.monitor.memtrace import (
    COMPONENTS,
    amp_dtype,
    autocast_forward,
    fake_device,
    trace_step,
)
from rampwatch.monitor.planproc import (
    PlanHandle,
    check_setup,
    child_main,
    error_row,
    plan_row,
    request_base,
    resolve_setup,
)
from rampwatch.store import names as M

__all__ = [
    "COMPONENTS",
    "PlanHandle",
    "calibrate",
    "plan_in_process",
    "plan_points",
    "probe",
    "start_plan",
    "trace_step",
]

PROBE_HINT = (
    "measure it instead with rampwatch.monitor.memplan.probe(setup, batches), which "
    "runs real steps on the device and stops at the first out-of-memory"
)


def _fake_failure(e: BaseException, stage: str, b: int) -> str:
    from torch._subclasses import fake_tensor as ft

    what = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]
    beyond = (
        ft.DataDependentOutputException,
        ft.DynamicOutputShapeException,
        ft.UnsupportedOperatorException,
        ft.UnsupportedFakeTensorException,
    )
    if isinstance(e, beyond) or "tensor subclass" in str(e):
        return (
            f"fake tensors cannot run this model ({stage} at per-device batch {b}: {what}): "
            "it reads tensor values (.item(), .tolist(), a tensor in an if), makes "
            "data-dependent shapes (nonzero, boolean masks) or calls a kernel without a "
            f"fake implementation, so there is no plan; {PROBE_HINT}"
        )
    return (
        f"the fake-tensor plan failed in {stage} at per-device batch {b}: {what}. If this "
        f"setup runs on real tensors, fake tensors cannot follow the model: {PROBE_HINT}"
    )


def plan_one(
    setup: str | Callable,
    per_device_batch: int,
    *,
    device_type: str = "cpu",
    amp: str | None = None,
    accum_steps: int = 1,
) -> dict:
    """Plan setup at one per-device batch: a row (see the module docstring); raises on error
    (a message already saying what failed, for the row)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    b = int(per_device_batch)
    if b <= 0:
        raise ValueError(f"per_device_batch must be positive, got {per_device_batch!r}")
    dev, dt, fn = fake_device(device_type), amp_dtype(amp), resolve_setup(setup)
    with FakeTensorMode():
        stage = f"setup({b})"
        try:
            with torch.device(dev):  # only around creation: it taxes every torch call it wraps
                built = fn(b)
        except Exception as e:  # noqa: BLE001 - reworded for the row
            raise RuntimeError(_fake_failure(e, stage, b)) from e
        model, opt, batch, step = check_setup(built)
        if dt is not None:
            autocast_forward(model, dev.type, dt)
        try:
            fig = trace_step(
                model, opt, batch, lambda: step(model, opt, batch), accum_steps=accum_steps
            )
        except Exception as e:  # noqa: BLE001 - reworded for the row
            raise RuntimeError(_fake_failure(e, "train_step", b)) from e
    return plan_row(b, M.PLAIN_CE, fig, dev.type, amp, accum_steps, t0)


def iter_plan(
    setup: str | Callable,
    batches: Sequence[int],
    *,
    device_type: str = "cpu",
    amp: str | None = None,
    accum_steps: int = 1,
) -> Iterator[dict]:
    """plan_in_process's rows, one at a time (the child writes each as it is ready)."""
    try:
        fn = resolve_setup(setup)
    except Exception as e:  # noqa: BLE001 - surfaced as data, never raised
        msg = (
            f"cannot import setup {setup!r} in the planner's process: {type(e).__name__}: "
            f"{e} (setup must be a module-level function of an importable module, or of "
            "the running script, or a 'package.module:function' string)"
        )
        for b in batches:
            yield error_row(b, M.PLAIN_CE, device_type, msg, source="plan")
        return
    for b in batches:
        try:
            yield plan_one(fn, b, device_type=device_type, amp=amp, accum_steps=accum_steps)
        except Exception as e:  # noqa: BLE001 - surfaced as data, never raised
            msg = str(e) if isinstance(e.__cause__, Exception) else f"{type(e).__name__}: {e}"
            yield error_row(b, M.PLAIN_CE, device_type, msg, source="plan")


def plan_in_process(
    setup: str | Callable,
    batches: Sequence[int],
    *,
    device_type: str = "cpu",
    amp: str | None = None,
    accum_steps: int = 1,
) -> list[dict]:
    """Rows for every per-device batch, in this process (seconds per batch for a large model).
    A failing batch becomes an error row; nothing is raised. setup is a module-level function
    or a "package.module:function" string (module docstring)."""
    return list(
        iter_plan(setup, batches, device_type=device_type, amp=amp, accum_steps=accum_steps)
    )


def start_plan(
    setup: str | Callable,
    batches: Sequence[int],
    *,
    device_type: str = "cpu",
    amp: str | None = None,
    accum_steps: int = 1,
    timeout_s: float = 900.0,
) -> PlanHandle:
    """The same in a child process while the loop runs on: handle.done(), handle.result()."""
    try:
        request = request_base(setup, batches, device_type)
    except (TypeError, ValueError) as e:
        return PlanHandle(
            {"batches": list(batches), "device_type": device_type},
            timeout_s,
            error=f"{type(e).__name__}: {e}",
        )
    request.update(amp=amp, accum_steps=int(accum_steps))
    return PlanHandle(request, timeout_s, "rampwatch.monitor.memplan")


# -- rows -> advisor ------------------------------------------------------------------------


def plan_points(rows: Sequence[Mapping], variant: str = "plain") -> dict[int, int]:
    """{per-device batch: predicted peak bytes} of one variant, error rows skipped: the
    `planned` argument of advisor.memory.fit_memory_model."""
    return {
        int(r["per_device_batch"]): int(r["predicted_bytes"])
        for r in rows
        if r.get("variant") == variant
        and r.get("error") is None
        and r.get("predicted_bytes") is not None
    }


def calibrate(
    rows: Sequence[Mapping], measured: Mapping[int, int], variant: str = "plain"
) -> list[dict]:
    """Copies of rows with "calibrated_bytes": advisor.memory's fit (one measured peak + plan
    slope, or the measured line) for the running `variant`; another variant keeps the plan's
    difference to it at the same batch (what switching would save is a plan figure).
    Raises ValueError as fit_memory_model does when the data cannot give a line."""
    from rampwatch.advisor.memory import fit_memory_model

    model = fit_memory_model(measured, plan_points(rows, variant))
    base = plan_points(rows, variant)
    out = []
    for r in rows:
        r = dict(r)
        b = r.get("per_device_batch")
        if r.get("error") is None and r.get("predicted_bytes") is not None:
            if r["variant"] == variant:
                r["calibrated_bytes"] = int(model.predict(b))
            elif b in base:
                r["calibrated_bytes"] = int(model.predict(b) - base[b] + r["predicted_bytes"])
        r["memory_model"] = model.to_dict()
        out.append(r)
    return out


# -- command line (and the child of start_plan) ---------------------------------------------


def _run_request(req: dict) -> Iterator[dict]:
    return iter_plan(
        req["setup"],
        req["batches"],
        device_type=req["device_type"],
        amp=req.get("amp"),
        accum_steps=req.get("accum_steps", 1),
    )


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m rampwatch.monitor.memplan"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("setup", nargs="?", help="package.module:function (or script.py:function)")
    ap.add_argument("--batches", default="1,2,4", help="comma-separated per-device batches")
    ap.add_argument("--device", default="cpu", help="fake device type (cpu | cuda)")
    ap.add_argument("--amp", default=None, help="bf16 | fp16 (autocast dtype), default none")
    ap.add_argument("--accum", type=int, default=1)

    def from_args(a):
        if not a.setup:
            ap.error("a setup reference or --request is required")
        return {
            "setup": a.setup,
            "batches": [int(x) for x in a.batches.split(",")],
            "device_type": a.device,
            "amp": a.amp,
            "accum_steps": a.accum,
            "sys_path": [""],
        }

    return child_main(argv, prog, _run_request, ap, from_args)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
