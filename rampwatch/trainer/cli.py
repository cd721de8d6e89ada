"""`rampwatch train …`: the reference trainer's command line (run config as argparse), and
`rampwatch train --make-shards OUT --data TEXT…` (text → token shards, trainer/shards.py).

Every mistake is one line and exit 2: numbers out of range and paths that name nothing are
found before torch is imported (resolve_defaults); what only the set-up finds (the store's
refusals, --resume without a checkpoint, no CUDA) is caught in run()."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from rampwatch.advisor.policy import GATES
from rampwatch.store.naming import check_run_id, check_run_name
from rampwatch.trainer.config import PRESET_RUN_DEFAULTS, PRESETS, TRIAL_EVAL_GROWTH

# config.POLICY_FLAGS as spelled before they took the policy's names: hidden aliases.
OLD_POLICY_FLAGS = {"--ramp-hysteresis": "hysteresis_steps", "--ramp-min-samples": "min_estimates"}


def add_arguments(t: argparse.ArgumentParser) -> None:
    """The run config of `rampwatch train`."""
    t.add_argument(
        "--db",
        default=os.environ.get("RAMPWATCH_DB", "runs.duckdb"),
        help="DuckDB file (default $RAMPWATCH_DB or runs.duckdb)",
    )
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
    batch.add_argument(
        "--split-micro",
        action="store_true",
        help="with accumulation 1: run each step as two half micro-batches, so "
        "the noise scale has a second batch size",
    )
    batch.add_argument("--lr", type=float)
    batch.add_argument("--optimizer", choices=("adamw", "sgd"))
    batch.add_argument("--weight-decay", type=float)
    batch.add_argument("--betas", type=float, nargs=2)
    batch.add_argument("--grad-clip", type=float)
    batch.add_argument("--warmup-tokens", type=int)
    batch.add_argument("--total-tokens", type=int)
    batch.add_argument("--steps", type=int, help="stop after this many optimizer steps")
    t.add_argument("--val-every", type=int, default=50)
    t.add_argument(
        "--target-val-loss",
        type=float,
        help="stop once the validation loss is at or below this (a sweep's target)",
    )
    t.add_argument("--val-batch", type=int, default=16, help="sequences in the fixed val batch")
    t.add_argument(
        "--capacity-bytes",
        type=int,
        help="device capacity to report and plan against (default: the device's)",
    )
    t.add_argument("--chunked-ce", action="store_true", help="chunked lm_head + cross-entropy")
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument(
        "--gns-window",
        type=int,
        help="most steps behind the smoothed noise scale (default 4,000: with no change "
        "in training the window keeps growing)",
    )
    ramp = t.add_argument_group("ramps")
    ramp.add_argument("--ramp", default="manual", choices=("manual", "auto", "off"))
    ramp.add_argument(
        "--ramp-at",
        type=float,
        help="ramp once the noise scale is >= this × the batch (default: the "
        "policy's 1, i.e. keep the batch within [B_noise, 2·B_noise])",
    )
    ramp.add_argument(
        "--hysteresis-steps",
        type=int,
        help="estimates above the ramp point before a ramp (default: the policy's)",
    )
    ramp.add_argument(
        "--min-estimates",
        type=int,
        help="noise-scale estimates before any ramp (default: the policy's)",
    )
    ramp.add_argument(
        "--ramp-gate",
        dest="gate",
        choices=GATES,
        help="what --ramp auto ramps on: the noise scale (the policy's default), or 'trial': "
        "only a ramp trial that passes, started when the calibrated noise scale says the "
        "critical batch passed 2x the batch or every --trial-interval-tokens",
    )
    ramp.add_argument(
        "--trial-interval-tokens",
        type=int,
        help="with --ramp-gate trial: tokens between trials the evidence did not call, and "
        "the wait after a trial that kept the control (default: 100 x the trial's delta)",
    )
    for old, knob in OLD_POLICY_FLAGS.items():  # a user's old command line still works
        ramp.add_argument(old, dest=knob, type=int, help=argparse.SUPPRESS)
    ramp.add_argument(
        "--no-plan", dest="plan", action="store_false", help="skip the fake-tensor memory plan"
    )
    ramp.add_argument(
        "--trial-delta-tokens",
        type=int,
        help="tokens each arm of a ramp trial trains (default: chosen at each trial from the "
        "run's training-loss curve, at most whole steps of the x4 branch, as many as keep a "
        "x2, x4 trial's discarded arms within 2%% of --total-tokens, 1 to 16)",
    )
    ramp.add_argument(
        "--trial-eval-batch",
        type=int,
        default=256,
        help="held-out sequences (of the val split, at most as many as it holds without "
        "overlap) every arm of a trial is judged on: 2048 tells more often where a pass over "
        "them is cheap against the trial's arms (README); a control whose evaluations cannot "
        "tell whether the trial's length is too long is evaluated again, in the same trial, on "
        f"the batch that would tell, up to {TRIAL_EVAL_GROWTH}x this",
    )
    ramp.add_argument(
        "--trial-snapshots",
        choices=("auto", "memory", "disk"),
        default="auto",
        help="where a trial keeps its copies of the model and optimizer state (up to 4): host "
        "memory while they take at most half of what this rank's share of it has available, "
        "else files beside the checkpoint (auto); always one or the other",
    )
    ramp.add_argument(  # testing aid: the kept-branch tests need a known arm
        "--trial-keep", type=int, metavar="FACTOR", help=argparse.SUPPRESS
    )
    t.add_argument(
        "--progress",
        default="auto",
        choices=("auto", "on", "off"),
        help="auto: a bar on a terminal, else a line every 50 steps (log files)",
    )
    t.add_argument(
        "--inject-oom",
        metavar="STEP:MICRO:PHASE",
        help="testing aid: raise out-of-memory once (phase forward|backward|optimizer)",
    )
    _add_data_arguments(t)


def _add_data_arguments(t: argparse.ArgumentParser) -> None:
    d = t.add_argument_group(
        "data (default: the Python standard library's sources)",
        "Token files: llm.c/modded-nanogpt shards (256 x int32 header), raw uint16/uint32 arrays "
        "(nanoGPT's train.bin; dtype from --data-dtype or FILE.json / meta.json beside them: "
        '{"dtype": "uint16", "vocab_size": 50257}), .npy. Text: .txt/.md (a file is a document), '
        ".jsonl, .parquet (--text-column), tokenized with the preset's tokenizer and cached. "
        "Files are read in the order given as one stream; windows span file boundaries.",
    )
    d.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        help="a file, a directory (its token files, else its text files; or a Hugging Face "
        "save_to_disk directory) or a glob; repeatable",
    )
    d.add_argument(
        "--val-data",
        action="append",
        metavar="PATH",
        help="validation files (repeatable). Default: files named like val.bin or "
        "*_val_*.bin among --data, else the last --val-fraction of the tokens",
    )
    d.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="hold out the last F of the --data tokens for validation (default 0.05 "
        "when no file is named as validation)",
    )
    d.add_argument(
        "--data-dtype",
        choices=("uint16", "uint32"),
        help="token dtype of raw token files without a sidecar",
    )
    d.add_argument(
        "--data-vocab",
        type=int,
        metavar="N",
        help="vocabulary the token files were made with (for --vocab-from-data; "
        "default: the sidecar's vocab_size, else the largest id + 1)",
    )
    d.add_argument(
        "--vocab-from-data",
        action="store_true",
        help="the model's vocab_size follows the data instead of the preset",
    )
    d.add_argument(
        "--text-column",
        default="text",
        metavar="NAME",
        help="the JSONL field / Parquet column that holds the text (default: text)",
    )
    d.add_argument(
        "--make-shards",
        metavar="OUT_DIR",
        help="do not train: tokenize the --data text with the preset's tokenizer into "
        "llm.c-layout shards (and meta.json) in OUT_DIR",
    )
    d.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="tokens per shard for --make-shards (default 100M, as llm.c's)",
    )


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
    _check_numbers(args)
    _check_names(args)
    _check_data_arguments(args)
    return args


def _check_names(args: argparse.Namespace) -> None:
    """Run ids are names, never paths (they name the checkpoint file); run names are readable:
    the store's one rule (store/naming.py), said before torch is imported."""
    for run_id in (args.run_id, args.resume):
        if run_id is not None:
            check_run_id(run_id)  # InvalidNameError, a ValueError: one line, exit 2
    if args.name is not None:
        check_run_name(args.name)


def _positive(x) -> bool:
    return math.isfinite(x) and x > 0


def _non_negative(x) -> bool:
    return math.isfinite(x) and x >= 0


# What each number of the run config must be, as "--flag must be …, got x". An optional flag
# left unset (None) means "the default", which is not checked.
NUMBERS = {
    "per_device_batch": (_positive, "positive"),
    "accum": (_positive, "positive"),
    "warmup_tokens": (_positive, "positive"),
    "total_tokens": (_positive, "positive"),
    "steps": (_positive, "positive"),
    "val_batch": (_positive, "positive"),
    "capacity_bytes": (_positive, "positive (bytes)"),
    "checkpoint_every": (_non_negative, "0 (only at the end) or more"),
    "val_every": (_non_negative, "0 (only at the end) or more"),
    "lr": (_positive, "a positive number"),
    "weight_decay": (_non_negative, "a number >= 0"),
    "grad_clip": (_non_negative, "a number >= 0 (0: no clipping)"),
    "target_val_loss": (math.isfinite, "a finite number"),
    "ramp_at": (_positive, "a positive number"),
    "hysteresis_steps": (lambda n: n >= 1, "at least 1 (estimates in a row)"),
    "min_estimates": (_non_negative, "0 or more"),
    "trial_delta_tokens": (_positive, "a positive number of tokens"),
    "trial_interval_tokens": (_positive, "a positive number of tokens"),
    "trial_eval_batch": (lambda n: n >= 2, "at least 2 (the trial's paired test)"),
    "trial_keep": (lambda n: n >= 1, "a factor of the trial (1: the control)"),
}


def _check_numbers(args: argparse.Namespace) -> None:
    """Every number in range before torch is imported: a NaN or a negative count would
    otherwise train on nonsense, or fail deep inside with a traceback."""
    from rampwatch.advisor.gns_window import NoiseScaleWindow  # numpy only

    for key, (ok, what) in NUMBERS.items():
        value = getattr(args, key)
        if value is not None and not ok(value):
            raise ValueError(f"--{key.replace('_', '-')} must be {what}, got {value}")
    if not all(0 <= b < 1 for b in args.betas):  # NaN fails too
        raise ValueError(
            f"--betas must be two numbers in [0, 1) (Adam's decay rates, SGD's momentum), "
            f"got {' '.join(map(str, args.betas))}"
        )
    shortest = NoiseScaleWindow().min_steps  # the smoother's own shortest window
    if args.gns_window is not None and args.gns_window < shortest:
        raise ValueError(
            f"--gns-window must be at least {shortest} steps (the noise scale's shortest "
            f"window), got {args.gns_window}"
        )


def _check_data_arguments(args: argparse.Namespace) -> None:
    """What can be said before torch is imported: flags that need --data, and paths that name
    nothing. The files' contents are checked by data_files.prepare_files (still exit 2)."""
    needs_data = [
        flag
        for flag, on in (
            ("--val-data", args.val_data),
            ("--val-fraction", args.val_fraction is not None),
            ("--data-dtype", args.data_dtype),
            ("--data-vocab", args.data_vocab),
            ("--vocab-from-data", args.vocab_from_data),
            ("--make-shards", args.make_shards),
        )
        if on
    ]
    if needs_data and not args.data and not args.resume:
        raise ValueError(f"{needs_data[0]} needs --data")
    if args.val_data and args.val_fraction is not None:
        raise ValueError("--val-data and --val-fraction: pick one")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    if args.data_vocab is not None and args.data_vocab <= 0:
        raise ValueError(f"--data-vocab must be positive, got {args.data_vocab}")
    if args.shard_tokens < 1 or args.shard_tokens >= 2**31:
        raise ValueError(
            f"--shard-tokens must be 1 to 2^31-1 (llm.c's header), got {args.shard_tokens}"
        )
    from rampwatch.trainer.data_formats import DataError, expand  # numpy only: no torch yet

    for flag, paths in (("--data", args.data), ("--val-data", args.val_data)):
        try:
            expand(paths or [])  # DataError (a ValueError) names the path
        except OSError as e:  # a folder or file this user may not read
            raise DataError(
                f"{flag}: cannot read {e.filename} ({e.strerror}); check the path and its "
                "permissions"
            ) from None


def run(args: argparse.Namespace) -> int:
    """Train (or make shards); arguments are already checked (resolve_defaults). What only the
    set-up can find (bad data, a --db the store refuses, a run id taken or still being written,
    --resume without a checkpoint, no CUDA) is one line and exit 2 like any other mistake on the
    command line, before a step or a checkpoint is written; a store error is worded and given its
    exit status as `rampwatch info` does (1 while the database stays busy)."""
    from rampwatch.store import cli as store_cli
    from rampwatch.store.errors import StoreError
    from rampwatch.trainer.data_formats import DataError

    refuse = _refuser(args)
    try:
        if args.make_shards:
            from rampwatch.trainer.shards import main as shards_main

            return shards_main(args)
        return _train(args, refuse)
    except DataError as e:
        refuse(str(e))
    except StoreError as e:  # the store's own message and exit status, as `rampwatch info`'s
        return store_cli.report("train", e)


def _refuser(args: argparse.Namespace):
    """The subcommand parser's error(): one line, exit 2 (the same without that parser)."""
    parser = getattr(args, "command_parser", None)
    if parser is not None:
        return parser.error

    def refuse(message: str):
        print(f"rampwatch train: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    return refuse


def _train(args: argparse.Namespace, refuse) -> int:
    try:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        refuse(
            f"--checkpoint-dir {args.checkpoint_dir}: cannot make that folder ({e.strerror}); "
            "name a folder, or a path where one can be made"
        )
    import torch

    from rampwatch.trainer.loop import Trainer  # torch only once arguments are good

    if args.device == "cuda" and not torch.cuda.is_available():
        refuse(
            f"--device cuda, but torch {torch.__version__} sees no CUDA device here; "
            "use --device cpu, or auto (a GPU when there is one)"
        )
    try:
        trainer = Trainer(args)
    except FileNotFoundError as e:  # --resume of a run without a checkpoint (ckpt.load says so)
        refuse(str(e))
    return trainer.run()
