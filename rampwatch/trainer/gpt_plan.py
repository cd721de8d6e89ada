"""Memory plan of the reference GPT: its peak memory of one training step per per-device batch,
predicted on fake tensors, with plain and chunked cross-entropy; run in a child process for the
loop. The mechanism is monitor/memplan.py's (any model); this module adds what is the GPT's.

Owns: building the GPT from a config dict (`_model_config`, `plan_one`), its loss head's
"logits" component, the plain/chunked variants, `plan_in_process` / `start_plan` for a config,
and `python -m rampwatch.trainer.gpt_plan` (prints the rows as JSON). `plan_points`, `calibrate`
and `PlanHandle` are monitor/memplan.py's, re-exported for the trainer's callers.

How (docs/ARCHITECTURE.md, "Memory model"): build the GPT and its optimizer under FakeTensorMode
and trace two training iterations (forward, backward, clip, optimizer step) with
monitor.memplan.trace_step; the peak of the second is the plan. A row is monitor/memplan.py's
plus "seq_len", with breakdown = {parameters, gradients, optimizer, activations, logits}, taken at
the moment of the peak and summing exactly to predicted_bytes. "logits" is what is alive at the
peak that was created inside the loss head (lm_head + cross-entropy: the module `loss_head`, else
`lm_head`) in forward, or in backward before the head has handed the gradient back to the trunk;
"activations" is every other activation or backward temporary, and the batch itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from typing import Any, Iterator, Mapping, Sequence

import torch

from rampwatch.monitor import memplan as any_model
from rampwatch.monitor.memplan import calibrate, plan_points
from rampwatch.monitor.memtrace import HEAD, amp_dtype, fake_device, trace_step
from rampwatch.monitor.planproc import PlanHandle, child_main, error_row, plan_row
from rampwatch.store import names as M

__all__ = [
    "COMPONENTS",
    "VARIANTS",
    "PlanHandle",
    "calibrate",
    "plan_in_process",
    "plan_one",
    "plan_points",
    "start_plan",
]

COMPONENTS = (*any_model.COMPONENTS, HEAD)
VARIANTS = M.LOSS_VARIANTS


def _model_config(cfg: Mapping[str, Any], variant: str):
    from rampwatch.trainer.config import ModelConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown plan variant {variant!r} (one of {VARIANTS})")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: v for k, v in dict(cfg).items() if k in names}
    kw["chunked_ce"] = variant == M.CHUNKED_CE
    return ModelConfig(**kw)


def plan_one(
    cfg: Mapping[str, Any],
    per_device_batch: int,
    variant: str = "plain",
    optimizer_name: str = "adamw",
    device_type: str = "cpu",
    *,
    amp: str | None = None,
    accum_steps: int = 1,
    grad_clip: float | None = 1.0,
) -> dict:
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
    dt = amp_dtype(amp)
    dev = fake_device(device_type)
    with FakeTensorMode():
        with torch.device(dev):  # only around creation: it taxes every torch call it wraps
            model = GPT(mcfg)
            idx = torch.randint(0, V, (b, T))
            tgt = torch.randint(0, V, (b, T))
        model.train()
        opt = configure_optimizer(model, optimizer_name, lr=1e-3)
        params = [p for p in model.parameters() if p.requires_grad]
        # The head whose region is "logits": trainer/model.py puts lm_head and the loss in
        # `loss_head`; a model with a bare `lm_head` gets only the projection tagged.
        head = getattr(model, "loss_head", None)
        head = model.lm_head if head is None else head

        def train_step():
            with torch.autocast(dev.type, dtype=dt) if dt is not None else contextlib.nullcontext():
                loss = model(idx, tgt)
            loss.backward()
            del loss
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()

        fig = trace_step(model, opt, (idx, tgt), train_step, head=head, accum_steps=accum_steps)
    return plan_row(b, variant, fig, dev.type, amp, accum_steps, t0, seq_len=T)


def iter_plan(
    cfg: Mapping[str, Any],
    batches: Sequence[int],
    optimizer_name: str = "adamw",
    device_type: str = "cpu",
    variants: Sequence[str] = VARIANTS,
    **kw,
) -> Iterator[dict]:
    """Rows for every (batch, variant), batches outer, one at a time. A failing pair becomes an
    error row (the others still plan): one variant the model cannot run must not hide the rest."""
    for b in batches:
        for v in variants:
            try:
                yield plan_one(cfg, b, v, optimizer_name, device_type, **kw)
            except Exception as e:  # noqa: BLE001 - surfaced as data, never raised
                yield error_row(b, v, device_type, f"{type(e).__name__}: {e}")


def plan_in_process(
    cfg: Mapping[str, Any],
    batches: Sequence[int],
    optimizer_name: str = "adamw",
    device_type: str = "cpu",
    variants: Sequence[str] = VARIANTS,
    **kw,
) -> list[dict]:
    """Rows for every (batch, variant), batches outer; error rows, never an exception."""
    return list(iter_plan(cfg, batches, optimizer_name, device_type, variants, **kw))


def start_plan(
    cfg: Mapping[str, Any],
    batches: Sequence[int],
    optimizer_name: str = "adamw",
    device_type: str = "cpu",
    variants: Sequence[str] = VARIANTS,
    *,
    amp: str | None = None,
    accum_steps: int = 1,
    grad_clip: float | None = 1.0,
    timeout_s: float = 900.0,
) -> PlanHandle:
    """Plan in a child process (seconds per batch for a large model) while the loop runs on."""
    request = {
        "cfg": dict(cfg),
        "batches": [int(b) for b in batches],
        "optimizer_name": optimizer_name,
        "device_type": device_type,
        "variants": list(variants),
        "amp": amp,
        "accum_steps": int(accum_steps),
        "grad_clip": grad_clip,
    }
    return PlanHandle(request, timeout_s, "rampwatch.trainer.gpt_plan")


# -- command line (and the child of start_plan) ---------------------------------------------


def _run_request(req: dict) -> Iterator[dict]:
    return iter_plan(
        req["cfg"],
        req["batches"],
        req["optimizer_name"],
        req["device_type"],
        req["variants"],
        amp=req.get("amp"),
        accum_steps=req.get("accum_steps", 1),
        grad_clip=req.get("grad_clip", 1.0),
    )


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m rampwatch.trainer.gpt_plan"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--preset", help="a trainer.config.PRESETS name")
    ap.add_argument("--batches", default="1,2,4", help="comma-separated per-device batches")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--device", default=None, help="fake device type (default: cuda if available)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--amp", default=None, help="bf16 | fp16 (autocast dtype), default none")
    ap.add_argument("--accum", type=int, default=1)

    def from_args(a):
        from rampwatch.trainer.config import PRESETS

        if not a.preset:
            ap.error("--preset or --request is required")
        return {
            "cfg": PRESETS[a.preset].to_dict(),
            "batches": [int(x) for x in a.batches.split(",")],
            "optimizer_name": a.optimizer,
            "device_type": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
            "variants": [v for v in a.variants.split(",") if v],
            "amp": a.amp,
            "accum_steps": a.accum,
        }

    return child_main(argv, prog, _run_request, ap, from_args)


if __name__ == "__main__":
    sys.exit(main())
