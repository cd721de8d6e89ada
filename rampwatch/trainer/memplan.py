"""Memory plan: the peak memory of one training step per per-device batch, predicted on fake
tensors (no real memory), with a per-component breakdown; run in a child process for the loop.

Owns: `plan_in_process` (the planner), `start_plan` / `PlanHandle` (the same in a child process,
never raising into the caller), `plan_points` and `calibrate` (plan rows -> advisor/memory.py),
and `python -m rampwatch.trainer.memplan` (prints the rows as JSON).

How (docs/ARCHITECTURE.md, "Memory model"): build the GPT and its optimizer under FakeTensorMode, run two
training iterations (forward, backward, clip, optimizer step) under MemTracker, with
`reset_mod_stats()` between them; the peak of the *second* iteration is the plan, since only then
does optimizer state exist. A row is plain data (JSON-able):
    {"per_device_batch", "variant", "predicted_bytes", "breakdown", "steady_bytes", "peak_phase",
     "seq_len", "device_type", "amp", "accum_steps", "seconds", "error"}
(an error row keeps the first two and "error", with None for the figures).
breakdown = {parameters, gradients, optimizer, activations, logits}, taken at the moment of the
peak, and sums exactly to predicted_bytes. "logits" is what is alive at the peak that was created
inside the loss head (lm_head + cross-entropy: the module `loss_head`, else `lm_head`) in forward,
or in backward before the head has handed the gradient back to the trunk; "activations" is every
other activation or backward temporary, and the batch itself. steady_bytes is what lives between
two steps (parameters, buffers, optimizer state, the batch; gradients too when accumulating), so
peak - steady is what one step adds on top of it (what bench/memplan_bench.py measures).
The plan excludes constants (CUDA context, allocator caching, kernel workspaces): calibrate them
against a measured peak (`calibrate`, which defers to advisor.memory.fit_memory_model).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "logits")
VARIANTS = ("plain", "chunked")
# The folder holding the rampwatch package (a checkout or site-packages): the child imports the
# very code the parent runs, whichever directory the parent was started from.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# MemTracker keys snapshots by its _MemRefType enum; we read them by value so a renamed member
# (private API) fails loudly in _breakdown instead of silently landing in the wrong component.
_CATEGORY = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
             "Optstate": "optimizer", "Activation": "activations", "Temp": "activations",
             "Other": "activations"}


@functools.lru_cache(maxsize=None)
def _tracker_class():
    # Imported lazily: torch.distributed._tools pulls in DTensor, ~1 s that a loop importing
    # this module only to call start_plan() should not pay.
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker

    class PlanTracker(MemTracker):
        """MemTracker that also (1) records the breakdown at the peak of the recorded iteration
        only, and (2) tags storages created inside the loss head, to know how many logits bytes
        are alive at that peak. Uses only MemTracker's public surface (dispatch, snapshots)."""

        def __init__(self, head: torch.nn.Module, params: Sequence[torch.Tensor]):
            super().__init__()
            self._workspace = _workspace_ops()
            self.recording = False
            self.phase = "setup"
            self.peak_total = -1
            self.peak: dict[str, Any] = {}
            self.tagging = False           # inside the loss head's region
            self._pending = 0              # head inputs whose gradient has not arrived yet
            self._tagged: dict[int, tuple[Any, int]] = {}
            self.tagged_bytes = 0
            self._handles = [head.register_forward_pre_hook(self._head_pre),
                             head.register_forward_hook(self._head_post)]
            for p in params:  # a parameter's gradient is "gradients", never "logits"
                self._handles.append(p.register_hook(self._untag))
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p: self._untag(p.grad)))

        def remove_hooks(self):
            for h in self._handles:
                h.remove()

        # -- region of the loss head -------------------------------------------------------
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

        def begin_backward(self):
            self.tagging = self._pending > 0

        def end_backward(self):
            self.tagging, self._pending = False, 0

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
            seen = {id(st) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                    for st in get_untyped_storages(t)}
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
            scratch = None
            if func in self._workspace and args and isinstance(args[0], torch.Tensor):
                # The op allocates an input-sized temporary inside its kernel, which a fake
                # kernel never does: allocate it where MemTracker sees it, for the op's duration.
                scratch = super().__torch_dispatch__(torch.ops.aten.empty_like.default, types,
                                                     (args[0],), {})
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
                    self.peak = {"snapshot": snap, "logits": self.tagged_bytes,
                                 "phase": self.phase}
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


def _breakdown(snapshot: dict, logits_alive: int) -> tuple[int, dict[str, int]]:
    """(total, breakdown) from a MemTracker snapshot {device: {reftype: bytes, 'Total': bytes}}."""
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
    # Logits are carved out of activations + temporaries; clamp in case a tagged storage was
    # re-categorized (e.g. as a gradient) without our hook seeing it.
    out["logits"] = max(0, min(logits_alive, out["activations"]))
    out["activations"] -= out["logits"]
    return total, out


def _model_config(cfg: Mapping[str, Any], variant: str):
    from rampwatch.trainer.config import ModelConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown plan variant {variant!r} (one of {VARIANTS})")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: v for k, v in dict(cfg).items() if k in names}
    kw["chunked_ce"] = variant == "chunked"
    return ModelConfig(**kw)


def _amp_dtype(amp: str | None):
    if amp in (None, "", "none", "fp32"):
        return None
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
            "fp16": torch.float16, "float16": torch.float16}[amp]


def plan_one(cfg: Mapping[str, Any], per_device_batch: int, variant: str = "plain",
             optimizer_name: str = "adamw", device_type: str = "cpu", *, amp: str | None = None,
             accum_steps: int = 1, grad_clip: float | None = 1.0) -> dict:
    """Plan one (per-device batch, variant): a row (see the module docstring); raises on error.

    accum_steps > 1 plans a micro-batch after the first, whose backward adds to gradients that
    already exist (the larger peak; the same for any accum >= 2).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rampwatch.trainer.model import GPT, configure_optimizer

    t0 = time.perf_counter()
    mcfg = _model_config(cfg, variant)
    b, T, V = int(per_device_batch), mcfg.seq_len, mcfg.vocab_size
    if b <= 0:
        raise ValueError(f"per_device_batch must be positive, got {per_device_batch!r}")
    dt = _amp_dtype(amp)
    dev = torch.device(device_type)
    if dev.type == "cuda" and not torch.cuda.is_available():
        # Faking a device this torch lacks can abort the whole process (docs/ARCHITECTURE.md, "Memory model"): refuse.
        raise ValueError("fake 'cuda' needs a CUDA build of torch and a visible GPU; plan on 'cpu'")
    with FakeTensorMode():
        with torch.device(dev):  # only around creation: it taxes every torch call it wraps
            model = GPT(mcfg)
            idx = torch.randint(0, V, (b, T))
            tgt = torch.randint(0, V, (b, T))
        model.train()
        opt = configure_optimizer(model, optimizer_name, lr=1e-3)
        # The head whose region is "logits": trainer/model.py puts lm_head and the loss in
        # `loss_head`; a model with a bare `lm_head` gets only the projection tagged.
        head = getattr(model, "loss_head", None)
        head = model.lm_head if head is None else head
        params = [p for p in model.parameters() if p.requires_grad]
        tracker = _tracker_class()(head, params)
        # The batch counts too (as 'Other', i.e. activations): the real step holds it.
        tracker.track_external(model, opt, idx, tgt)
        steady = 0
        try:
            with tracker:
                for it in range(2):
                    if it == 1:
                        tracker.reset_mod_stats()  # MemTracker refuses a second root forward
                        steady = sum(d["Total"] for d in tracker.get_tracker_snapshot().values())
                        tracker.recording = True
                    tracker.phase = "forward"
                    amp_ctx = (torch.autocast(dev.type, dtype=dt) if dt is not None
                               else contextlib.nullcontext())
                    with amp_ctx:
                        loss = model(idx, tgt)
                    tracker.phase = "backward"
                    tracker.begin_backward()
                    loss.backward()
                    tracker.end_backward()
                    del loss
                    tracker.phase = "optimizer"
                    if grad_clip:
                        torch.nn.utils.clip_grad_norm_(params, grad_clip)
                    opt.step()
                    if it == 1 or accum_steps <= 1:
                        opt.zero_grad(set_to_none=True)
        finally:
            tracker.remove_hooks()
    total, parts = _breakdown(tracker.peak["snapshot"], tracker.peak["logits"])
    return {"per_device_batch": b, "variant": variant, "predicted_bytes": int(total),
            "breakdown": parts, "steady_bytes": int(steady), "peak_phase": tracker.peak["phase"],
            "seq_len": T, "device_type": dev.type, "amp": amp, "accum_steps": int(accum_steps),
            "seconds": round(time.perf_counter() - t0, 3), "error": None}


def _error_row(b, variant: str, device_type: str, msg: str) -> dict:
    return {"per_device_batch": b, "variant": variant, "predicted_bytes": None, "breakdown": None,
            "steady_bytes": None, "peak_phase": None, "device_type": device_type,
            "seconds": None, "error": msg}


def plan_in_process(cfg: Mapping[str, Any], batches: Sequence[int], optimizer_name: str = "adamw",
                    device_type: str = "cpu", variants: Sequence[str] = VARIANTS, **kw) -> list[dict]:
    """Rows for every (batch, variant), batches outer. A failing pair becomes an error row
    (the others still plan): one variant the model cannot run must not hide the rest."""
    rows = []
    for b in batches:
        for v in variants:
            try:
                rows.append(plan_one(cfg, b, v, optimizer_name, device_type, **kw))
            except Exception as e:  # noqa: BLE001 - surfaced as data, never raised
                rows.append(_error_row(b, v, device_type, f"{type(e).__name__}: {e}"))
    return rows


# -- child process --------------------------------------------------------------------------

def _child_env(device_type: str) -> dict[str, str]:
    env = dict(os.environ)
    # The planner must not compete with the loop for cores (it is single-threaded work anyway).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(_PACKAGE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if device_type.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        # A fake CUDA tensor makes a real 1-element tensor (a CUDA context) on the current
        # device: put it on the loop's GPU, not on GPU 0 of every rank.
        cur = torch.cuda.current_device()
        visible = env.get("CUDA_VISIBLE_DEVICES")
        parts = [p for p in visible.split(",") if p.strip()] if visible else []
        env["CUDA_VISIBLE_DEVICES"] = parts[cur] if cur < len(parts) else str(cur)
    return env


class PlanHandle:
    """A plan running in a child process. done() never blocks; result() returns rows (error
    rows if the child failed, timed out or was cancelled) and never raises."""

    def __init__(self, request: dict, timeout_s: float):
        self.request, self.timeout_s = request, timeout_s
        self.started = time.monotonic()
        self._rows: list[dict] | None = None
        self._error: str | None = None
        self._done = threading.Event()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rampwatch.trainer.memplan", "--request", json.dumps(request),
                 "--watch-parent", str(os.getpid())],
                env=_child_env(request["device_type"]), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except Exception as e:  # noqa: BLE001
            self.proc = None
            self._error = f"could not start the planner: {type(e).__name__}: {e}"
            self._done.set()
            return
        # communicate() in a thread drains both pipes (a chatty child cannot block on a full
        # pipe) while the caller's loop keeps stepping.
        threading.Thread(target=self._wait, name="memplan-wait", daemon=True).start()

    def _wait(self):
        try:
            out, err = self.proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.cancel()
            out, err = self.proc.communicate()
            self._error = f"planner timed out after {self.timeout_s:.0f} s"
        except Exception as e:  # noqa: BLE001
            self._error = f"planner wait failed: {type(e).__name__}: {e}"
            out, err = b"", b""
        if self._error is None:
            try:
                lines = out.decode(errors="replace").strip().splitlines()
                rows = json.loads(lines[-1] if lines else "null")  # a stray print goes above
                if not isinstance(rows, list):
                    raise ValueError("no rows")
                self._rows = rows
            except ValueError:
                tail = err.decode(errors="replace").strip().splitlines()[-5:]
                self._error = (f"planner exited with code {self.proc.returncode}: "
                               + (" | ".join(tail) or "no output"))
        self._done.set()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[dict] | None:
        """Rows, or None if still running after `timeout` seconds (None: wait until done)."""
        if not self._done.wait(timeout):
            return None
        if self._rows is not None:
            return self._rows
        r = self.request
        return [_error_row(b, v, r["device_type"], self._error or "unknown planner failure")
                for b in r["batches"] for v in r["variants"]]

    def cancel(self) -> None:
        """Kill the child (and anything it started); result() then reports an error."""
        if self.proc is not None and self.proc.poll() is None:
            self._error = self._error or "planner cancelled"  # before the kill wakes _wait
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)


def start_plan(cfg: Mapping[str, Any], batches: Sequence[int], optimizer_name: str = "adamw",
               device_type: str = "cpu", variants: Sequence[str] = VARIANTS, *,
               amp: str | None = None, accum_steps: int = 1, grad_clip: float | None = 1.0,
               timeout_s: float = 900.0) -> PlanHandle:
    """Plan in a child process (seconds per batch for a large model) while the loop runs on."""
    request = {"cfg": dict(cfg), "batches": [int(b) for b in batches],
               "optimizer_name": optimizer_name, "device_type": device_type,
               "variants": list(variants), "amp": amp, "accum_steps": int(accum_steps),
               "grad_clip": grad_clip}
    return PlanHandle(request, timeout_s)


# -- rows -> advisor ------------------------------------------------------------------------

def plan_points(rows: Sequence[Mapping], variant: str = "plain") -> dict[int, int]:
    """{per-device batch: predicted peak bytes} of one variant, error rows skipped: the
    `planned` argument of advisor.memory.fit_memory_model."""
    return {int(r["per_device_batch"]): int(r["predicted_bytes"]) for r in rows
            if r.get("variant") == variant and r.get("error") is None}


def calibrate(rows: Sequence[Mapping], measured: Mapping[int, int], variant: str = "plain"
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
        if r.get("error") is None:
            if r["variant"] == variant:
                r["calibrated_bytes"] = int(model.predict(b))
            elif b in base:
                r["calibrated_bytes"] = int(model.predict(b) - base[b] + r["predicted_bytes"])
        r["memory_model"] = model.to_dict()
        out.append(r)
    return out


# -- command line ---------------------------------------------------------------------------

def _watch_parent(pid: int) -> None:
    # An orphaned planner would hold memory (and on CUDA, a context) for nothing.
    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != pid:
                os._exit(3)
    threading.Thread(target=loop, name="memplan-parent", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rampwatch.trainer.memplan", description=__doc__.split("\n")[0])
    ap.add_argument("--request", help="JSON request (what start_plan sends)")
    ap.add_argument("--preset", help="a trainer.config.PRESETS name")
    ap.add_argument("--batches", default="1,2,4", help="comma-separated per-device batches")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--device", default=None, help="fake device type (default: cuda if available)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--amp", default=None, help="bf16 | fp16 (autocast dtype), default none")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--watch-parent", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.watch_parent:
        _watch_parent(a.watch_parent)
        with contextlib.suppress(OSError):
            os.nice(10)
    if a.request:
        req = json.loads(a.request)
    else:
        from rampwatch.trainer.config import PRESETS

        if not a.preset:
            ap.error("--preset or --request is required")
        req = {"cfg": PRESETS[a.preset].to_dict(),
               "batches": [int(x) for x in a.batches.split(",")],
               "optimizer_name": a.optimizer,
               "device_type": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
               "variants": [v for v in a.variants.split(",") if v], "amp": a.amp,
               "accum_steps": a.accum}
    rows = plan_in_process(req["cfg"], req["batches"], req["optimizer_name"], req["device_type"],
                           req["variants"], amp=req.get("amp"),
                           accum_steps=req.get("accum_steps", 1),
                           grad_clip=req.get("grad_clip", 1.0))
    json.dump(rows, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
