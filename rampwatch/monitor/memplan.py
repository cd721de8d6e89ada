"""Memory plan for any model: the peak memory of one training step per per-device batch,
predicted on fake tensors (no real memory), with a per-component breakdown; in a child process
for a running loop. `probe` (monitor/memprobe.py) is the measured alternative.

Owns: `plan_in_process` and `start_plan` (the plan of a user's setup), `trace_step` (the tracing
of two iterations that trainer/memplan.py's GPT plan shares), `plan_points` and `calibrate`
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
import functools
import math
import sys
import time
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten

from rampwatch.monitor.memprobe import probe
from rampwatch.monitor.planproc import (
    PlanHandle,
    check_setup,
    child_main,
    error_row,
    request_base,
    resolve_setup,
)

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

COMPONENTS = ("parameters", "gradients", "optimizer", "activations")
HEAD = "logits"  # the extra component of a traced head (trainer/memplan.py's loss head)
# MemTracker keys snapshots by its _MemRefType enum; we read them by value so a renamed member
# (private API) fails loudly in _breakdown instead of silently landing in the wrong component.
_CATEGORY = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Other": "activations",
}
PROBE_HINT = (
    "measure it instead with rampwatch.monitor.memplan.probe(setup, batches), which "
    "runs real steps on the device and stops at the first out-of-memory"
)


@functools.lru_cache(maxsize=None)
def _tracker_class():
    # Imported lazily: torch.distributed._tools pulls in DTensor, ~1 s that a loop importing
    # this module only to call start_plan() should not pay.
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker

    class PlanTracker(MemTracker):
        """MemTracker that also (1) records the breakdown at the peak of the recorded iteration
        only, with the phase of the step (forward, backward, optimizer: told apart by autograd's
        graph task, so train_step stays a black box), and (2) given a `head` module, tags the
        storages created inside it, to know how many of its bytes are alive at that peak. Uses
        only MemTracker's public surface (dispatch, snapshots)."""

        def __init__(self, head: torch.nn.Module | None, params: Sequence[torch.Tensor]):
            super().__init__()
            self._workspace = _workspace_ops()
            self.recording = False
            self.phase = "setup"
            self.peak_total = -1
            self.peak: dict[str, Any] = {}
            self.tagging = False  # inside the head's region
            self._pending = 0  # head inputs whose gradient has not arrived yet
            self._tagged: dict[int, tuple[Any, int]] = {}
            self.tagged_bytes = 0
            self._handles = []
            if head is None:
                return
            self._handles += [
                head.register_forward_pre_hook(self._head_pre),
                head.register_forward_hook(self._head_post),
            ]
            for p in params:  # a parameter's gradient is "gradients", never the head's
                self._handles.append(p.register_hook(self._untag))
                self._handles.append(
                    p.register_post_accumulate_grad_hook(lambda p: self._untag(p.grad))
                )

        def remove_hooks(self):
            for h in self._handles:
                h.remove()

        # -- phases of one iteration -------------------------------------------------------
        def start_iteration(self):
            self.phase = "forward"

        def _follow_phase(self):
            in_backward = torch._C._current_graph_task_id() != -1
            if in_backward and self.phase != "backward":
                self.phase = "backward"
                self.tagging = self._pending > 0  # backward runs through the head first
            elif not in_backward and self.phase == "backward":
                self.phase = "optimizer"  # clipping, the step, anything after backward
                self.tagging, self._pending = False, 0

        # -- region of the head ------------------------------------------------------------
        def _head_pre(self, module, inputs):
            self.tagging = True
            h = inputs[0] if inputs else None
            if isinstance(h, torch.Tensor) and h.requires_grad and torch.is_grad_enabled():
                self._pending += 1
                h.register_hook(self._head_grad_done)

        def _head_post(self, module, inputs, output):
            self.tagging = False

        def _head_grad_done(self, grad):
            # The gradient w.r.t. the head's input exists: backward has left the head.
            self._pending -= 1
            if self._pending <= 0:
                self.tagging = False

        # -- storage bookkeeping -----------------------------------------------------------
        def _untag(self, t):
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    entry = self._tagged.pop(id(st), None)
                    if entry is not None:
                        self.tagged_bytes -= entry[1]

        def _forget(self, key, ref):
            entry = self._tagged.get(key)
            if entry is not None and entry[0] is ref:
                del self._tagged[key]
                self.tagged_bytes -= entry[1]

        def _tag_new_outputs(self, args, kwargs, res):
            seen = {
                id(st)
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)
                for st in get_untyped_storages(t)
            }
            for t in tree_flatten(res)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                for st in get_untyped_storages(t):
                    key = id(st)
                    if key in seen or key in self._tagged:
                        continue  # a view or an in-place result: its storage is not new
                    n = st.nbytes()
                    if t.device.type == "cuda":  # the same 512-byte rounding as MemTracker
                        n = math.ceil(n / 512) * 512
                    ref = weakref.ref(st, lambda r, k=key: self._forget(k, r))
                    self._tagged[key] = (ref, n)
                    self.tagged_bytes += n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.recording or self._handles:
                self._follow_phase()
            scratch = None
            if func in self._workspace and args and isinstance(args[0], torch.Tensor):
                # The op allocates an input-sized temporary inside its kernel, which a fake
                # kernel never does: allocate it where MemTracker sees it, for the op's duration.
                scratch = super().__torch_dispatch__(
                    torch.ops.aten.empty_like.default, types, (args[0],), {}
                )
                if self.tagging:
                    self._tag_new_outputs((), {}, scratch)
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if res is NotImplemented:
                return res
            if self.tagging:
                self._tag_new_outputs(args, kwargs, res)
            if self.recording:
                snap = self.get_tracker_snapshot()
                total = sum(d["Total"] for d in snap.values())
                if total > self.peak_total:  # strict: the first moment of the peak, as MemTracker
                    self.peak_total = total
                    self.peak = {"snapshot": snap, "head": self.tagged_bytes, "phase": self.phase}
            del scratch
            return res

    return PlanTracker


def _workspace_ops() -> frozenset:
    """Ops whose real kernel holds a temporary the size of its first input (measured on the
    CPU with bench/memplan_bench.py): logsumexp computes exp(x - max) into a new tensor before
    reducing it (ATen's logsumexp_out_impl, the same on CUDA). Chunked cross-entropy calls it on
    each chunk's fp32 logits, so without this the plan misses one chunk of logits."""
    aten = torch.ops.aten
    return frozenset({aten.logsumexp.default})


def _breakdown(snapshot: dict, head_alive: int | None) -> tuple[int, dict[str, int]]:
    """(total, breakdown) from a MemTracker snapshot {device: {reftype: bytes, 'Total': bytes}};
    head_alive None: no head was traced, no "logits" component."""
    out = dict.fromkeys(COMPONENTS, 0)
    total = 0
    for dev_snap in snapshot.values():
        for key, n in dev_snap.items():
            name = getattr(key, "value", key)
            if name == "Total":
                total += n
            elif name in _CATEGORY:
                out[_CATEGORY[name]] += n
            else:
                raise KeyError(f"unknown MemTracker memory category {name!r}")
    if head_alive is not None:
        # The head's bytes are carved out of activations + temporaries; clamp in case a tagged
        # storage was re-categorized (e.g. as a gradient) without our hook seeing it.
        out[HEAD] = max(0, min(head_alive, out["activations"]))
        out["activations"] -= out[HEAD]
    return total, out


def amp_dtype(amp: str | None):
    if amp in (None, "", "none", "fp32"):
        return None
    return {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }[amp]


def fake_device(device_type: str) -> torch.device:
    dev = torch.device(device_type)
    if dev.type == "cuda" and not torch.cuda.is_available():
        # Faking a device this torch lacks can abort the whole process: refuse.
        raise ValueError("fake 'cuda' needs a CUDA build of torch and a visible GPU; plan on 'cpu'")
    return dev


def trace_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    train_step: Callable[[], Any],
    *,
    head: torch.nn.Module | None = None,
    accum_steps: int = 1,
) -> dict:
    """Two iterations of train_step() on fake tensors (the caller's FakeTensorMode) under the
    tracker: {"predicted_bytes", "breakdown", "steady_bytes", "peak_phase"} of the second.
    accum_steps > 1 keeps the first iteration's gradients, so the second backward adds to them
    (the larger peak; the same for any accum >= 2). Raises what train_step raises."""
    params = [p for p in model.parameters() if p.requires_grad]
    tracker = _tracker_class()(head, params)
    # The batch counts too (as 'Other', i.e. activations): the real step holds it.
    tracker.track_external(
        model, optimizer, *[t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    )
    zero_grad, asked, own = optimizer.zero_grad, [], optimizer.__dict__.get("zero_grad")
    optimizer.zero_grad = lambda *a, **k: asked.append((a, k))  # deferred to between iterations
    steady = 0
    try:
        with tracker:
            for it in range(2):
                if it == 1:
                    tracker.reset_mod_stats()  # MemTracker refuses a second root forward
                    steady = sum(d["Total"] for d in tracker.get_tracker_snapshot().values())
                    tracker.recording = True
                tracker.start_iteration()
                train_step()
                if it == 1 or accum_steps <= 1:
                    a, k = asked[-1] if asked else ((), {"set_to_none": True})
                    zero_grad(*a, **k)
    finally:
        tracker.remove_hooks()
        del optimizer.zero_grad  # the instance attribute: the class's method again
        if own is not None:
            optimizer.zero_grad = own
    if not tracker.peak:
        raise RuntimeError("train_step ran no tensor operation")
    total, parts = _breakdown(tracker.peak["snapshot"], tracker.peak["head"] if head else None)
    return {
        "predicted_bytes": int(total),
        "breakdown": parts,
        "steady_bytes": int(steady),
        "peak_phase": tracker.peak["phase"],
    }


def _autocast_forward(model: torch.nn.Module, device_type: str, dtype) -> None:
    """The model's forward runs under autocast (what a mixed-precision loop does)."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward


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
            _autocast_forward(model, dev.type, dt)
        try:
            fig = trace_step(
                model, opt, batch, lambda: step(model, opt, batch), accum_steps=accum_steps
            )
        except Exception as e:  # noqa: BLE001 - reworded for the row
            raise RuntimeError(_fake_failure(e, "train_step", b)) from e
    return {
        "per_device_batch": b,
        "variant": "plain",
        **fig,
        "device_type": dev.type,
        "amp": amp,
        "accum_steps": int(accum_steps),
        "seconds": round(time.perf_counter() - t0, 3),
        "source": "plan",
        "error": None,
    }


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
            yield error_row(b, "plain", device_type, msg, source="plan")
        return
    for b in batches:
        try:
            yield plan_one(fn, b, device_type=device_type, amp=amp, accum_steps=accum_steps)
        except Exception as e:  # noqa: BLE001 - surfaced as data, never raised
            msg = str(e) if isinstance(e.__cause__, Exception) else f"{type(e).__name__}: {e}"
            yield error_row(b, "plain", device_type, msg, source="plan")


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
