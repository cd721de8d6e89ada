"""Tracing one training step on fake tensors: the peak memory of its second iteration, split by
component, from torch's MemTracker (no real memory is allocated).

Owns: `trace_step` (two iterations of a train_step under a MemTracker subclass, the second's peak
is the plan: only then does optimizer state exist), `COMPONENTS` / `HEAD` (what a breakdown
holds), `amp_dtype` and `fake_device`. monitor/memplan.py turns traces into plan rows for any
model; trainer/gpt_plan.py traces the GPT with its loss head as the extra `HEAD` component.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

COMPONENTS = ("parameters", "gradients", "optimizer", "activations")
HEAD = "logits"  # the extra component of a traced head (trainer/gpt_plan.py's loss head)
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


class _PlanTracking:
    """What PlanTracker adds to torch's MemTracker: it records the breakdown at the peak of the
    recorded iteration only, with the phase of the step (forward, backward, optimizer: told apart
    by autograd's graph task, so train_step stays a black box), and, given a `head` module, tags
    the storages created inside it, to know how many of its bytes are alive at that peak. Uses
    only MemTracker's public surface (dispatch, snapshots). A mixin, so that this module can be
    imported without torch.distributed._tools: _tracker_class joins it to MemTracker."""

    _storages: Callable  # get_untyped_storages, given by _tracker_class (imported lazily there)

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

    # -- phases of one iteration -----------------------------------------------------------
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

    def _record_peak(self):
        snap = self.get_tracker_snapshot()
        total = sum(d["Total"] for d in snap.values())
        if total > self.peak_total:  # strict: the first moment of the peak, as MemTracker
            self.peak_total = total
            self.peak = {"snapshot": snap, "head": self.tagged_bytes, "phase": self.phase}

    # -- region of the head ----------------------------------------------------------------
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

    # -- storage bookkeeping ---------------------------------------------------------------
    def _untag(self, t):
        if isinstance(t, torch.Tensor):
            for st in self._storages(t):
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
            for st in self._storages(t)
        }
        for t in tree_flatten(res)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for st in self._storages(t):
                key = id(st)
                if key in seen or key in self._tagged:
                    continue  # a view or an in-place result: its storage is not new
                n = st.nbytes()
                if t.device.type == "cuda":  # the same 512-byte rounding as MemTracker
                    n = math.ceil(n / 512) * 512
                ref = weakref.ref(st, lambda r, k=key: self._forget(k, r))
                self._tagged[key] = (ref, n)
                self.tagged_bytes += n


@functools.lru_cache(maxsize=None)
def _tracker_class():
    # Imported lazily: torch.distributed._tools pulls in DTensor, ~1 s that a loop importing
    # this module only to call start_plan() should not pay.
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker

    class PlanTracker(_PlanTracking, MemTracker):
        """_PlanTracking on MemTracker; its dispatch also holds what fake kernels skip."""

        _storages = staticmethod(get_untyped_storages)

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
                self._record_peak()
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


def autocast_forward(model: torch.nn.Module, device_type: str, dtype) -> None:
    """The model's forward runs under autocast (what a mixed-precision loop does)."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
