"""`rampwatch train …`: the reference trainer's command line (run config as argparse)."""
from __future__ import annotations

import argparse
import os

from rampwatch.trainer.config import PRESET_RUN_DEFAULTS, PRESETS


def add_arguments(t: argparse.ArgumentParser) -> None:
    """The run config of `rampwatch train`."""
    t.add_argument("--db", default=os.environ.get("RAMPWATCH_DB", "runs.duckdb"),
                   help="DuckDB file (default $RAMPWATCH_DB or runs.duckdb)")
    t.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    t.add_argument("--name", help="run name shown on the dashboard (default: the run id)")
    t.add_argument("--run-id", help="id for a new run (default: random)")
    t.add_argument("--resume", metavar="RUN_ID", help="continue this run from its checkpoint")
    t.add_argument("--checkpoint-dir", default="checkpoints")
    t.add_argument("--checkpoint-every", type=int, default=100, help="steps; 0 = only at the end")
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    t.add_argument("--seed", type=int, default=0)
    batch = t.add_argument_group("batch and schedule (defaults: the preset's)")
    batch.add_argument("--per-device-batch", type=int)
    batch.add_argument("--accum", type=int)
    batch.add_argument("--split-micro", action="store_true",
                       help="with accumulation 1: run each step as two half micro-batches, so "
                            "the noise scale has a second batch size")
    batch.add_argument("--lr", type=float)
    batch.add_argument("--optimizer", choices=("adamw", "sgd"))
    batch.add_argument("--weight-decay", type=float)
    batch.add_argument("--betas", type=float, nargs=2)
    batch.add_argument("--grad-clip", type=float)
    batch.add_argument("--warmup-tokens", type=int)
    batch.add_argument("--total-tokens", type=int)
    batch.add_argument("--steps", type=int, help="stop after this many optimizer steps")
    t.add_argument("--val-every", type=int, default=50)
    t.add_argument("--target-val-loss", type=float,
                   help="stop once the validation loss is at or below this (a sweep's target)")
    t.add_argument("--val-batch", type=int, default=16, help="sequences in the fixed val batch")
    t.add_argument("--capacity-bytes", type=int,
                   help="device capacity to report and plan against (default: the device's)")
    t.add_argument("--chunked-ce", action="store_true", help="chunked lm_head + cross-entropy")
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument("--gns-window", type=int, default=200,
                   help="longest window of steps behind the smoothed noise scale")
    ramp = t.add_argument_group("ramps")
    ramp.add_argument("--ramp", default="manual", choices=("manual", "auto", "off"))
    ramp.add_argument("--ramp-hysteresis", type=int,
                      help="estimates above the ramp point before a ramp (default: the policy's)")
    ramp.add_argument("--ramp-min-samples", type=int,
                      help="noise-scale estimates before any ramp (default: the policy's)")
    ramp.add_argument("--ramp-at", type=float,
                      help="ramp once the noise scale is >= this × the batch (default: the "
                           "policy's 1, i.e. keep the batch within [B_noise, 2·B_noise])")
    ramp.add_argument("--no-plan", dest="plan", action="store_false",
                      help="skip the fake-tensor memory plan")
    t.add_argument("--progress", default="auto", choices=("auto", "on", "off"),
                   help="auto: a bar on a terminal, else a line every 50 steps (log files)")
    t.add_argument("--inject-oom", metavar="STEP:MICRO:PHASE",
                   help="testing aid: raise out-of-memory once (phase forward|backward|optimizer)")


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset run options from the preset's defaults; ValueError names a bad combination."""
    d = PRESET_RUN_DEFAULTS[args.preset]
    for key, value in d.to_dict().items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.split_micro:
        if args.accum != 1 or args.per_device_batch % 2:
            raise ValueError("--split-micro needs --accum 1 and an even --per-device-batch")
        args.per_device_batch, args.accum = args.per_device_batch // 2, 2
    for key in ("per_device_batch", "accum", "warmup_tokens", "total_tokens"):
        if getattr(args, key) <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    return args


def run(args: argparse.Namespace) -> int:
    """Train; arguments are already checked (resolve_defaults)."""
    from rampwatch.trainer.loop import main as train_main  # torch only once arguments are good
    return train_main(args)
