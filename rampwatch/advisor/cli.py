"""`rampwatch plan`: batch tiers that fit in memory, for people (table) or scripts (--json).

Owns the command line only; the math lives in advisor.memory, advisor.tiers, advisor.ramp_point and
advisor.lr. GB on this command line means 10^9 bytes (torch.cuda.max_memory_reserved() / 1e9).
From flags it judges memory; with --db it prints a run's tier table as the card shows it
(advisor/tier_table.py; rampwatch/cli.py reads the run as the card does, `tier_table_text`
prints it): measured and modelled throughput, steps, ETA to the token budget, LR.

Examples:
    rampwatch plan --measured 16:70.2 --measured 32:131.5 --capacity-gb 141 \\
        --seq-len 2048 --per-device-batch 16 --accum 16 --noise-scale 600
    rampwatch plan --db runs.duckdb --run my-run
"""

from __future__ import annotations

import argparse
import json
import math

from rampwatch.advisor.lr import noise_scale_warning, rule_for
from rampwatch.advisor.memory import GB, fit_memory_model, format_gb, usable_bytes
from rampwatch.advisor.policy import default
from rampwatch.advisor.ramp_point import predicted_effect
from rampwatch.advisor.tier_table import TierRow, text_table
from rampwatch.advisor.tiers import Tier, candidate_tiers

FROM_FLAGS = ("capacity_gb", "seq_len", "per_device_batch")  # needed unless --db names a run


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _margin(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in [0, 1) such as 0.05, got {text!r}"
        )
    return v


def _batch_gb(text: str) -> tuple[int, float]:
    batch, sep, gb = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected BATCH:GB such as 16:70.5, got {text!r}")
    try:
        return _positive_int(batch.strip()), _positive_float(gb.strip())
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"in {text!r} (BATCH:GB): {e}") from None


def _factors(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive_int(t.strip()) for t in text.split(",") if t.strip()) or (2, 4, 8)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(
            f"--factors takes positive integers like 2,4,8: {e}"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `rampwatch plan`."""
    p.add_argument(
        "--measured",
        action="append",
        type=_batch_gb,
        default=[],
        metavar="BATCH:GB",
        help="measured peak at a per-device batch (repeatable), e.g. 16:70.5",
    )
    p.add_argument(
        "--planned",
        action="append",
        type=_batch_gb,
        default=[],
        metavar="BATCH:GB",
        help="planned (fake-tensor) peak at a per-device batch (repeatable)",
    )
    p.add_argument(
        "--db",
        help="a Rampwatch database: print that run's tier table (throughput, steps, ETA) as "
        "the card shows it; the memory flags are then read from the run",
    )
    p.add_argument("--run", help="with --db: the run id (needed when the file holds several)")
    p.add_argument("--capacity-gb", type=_positive_float, help="device memory, GB (10^9 bytes)")
    p.add_argument("--seq-len", type=_positive_int, help="tokens per sequence")
    p.add_argument("--per-device-batch", type=_positive_int, help="current per-device batch")
    p.add_argument(
        "--accum", type=_positive_int, default=1, help="current gradient accumulation (default 1)"
    )
    p.add_argument(
        "--world", type=_positive_int, default=1, help="data-parallel world size (default 1)"
    )
    p.add_argument(
        "--noise-scale",
        type=_positive_float,
        default=None,
        help="smoothed gradient noise scale B_simple, in sequences",
    )
    p.add_argument(
        "--optimizer", default="adamw", help="optimizer name for the LR rule (default adamw)"
    )
    p.add_argument(
        "--lr-rule",
        choices=("sqrt", "linear", "none"),
        default=None,
        help="LR rule, overriding the optimizer's",
    )
    p.add_argument(
        "--margin",
        type=_margin,
        default=default("margin"),
        help=f"safety margin, fraction of capacity ({default('margin')})",
    )
    p.add_argument(
        "--factors",
        type=_factors,
        default=default("offered_factors"),
        help="batch multiples, e.g. 2,4,8",
    )
    p.add_argument(
        "--infeasible",
        action="append",
        type=_positive_int,
        default=[],
        metavar="BATCH",
        help="per-device batch known to run out of memory (repeatable)",
    )
    p.add_argument(
        "--max-per-device", type=_positive_int, default=None, help="cap on the per-device batch"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(plan_parser=p)  # so errors found after parsing name the subcommand


def _duplicates(pairs: list[tuple[int, float]], flag: str, parser) -> dict[int, int]:
    out: dict[int, int] = {}
    for b, gb in pairs:
        if b in out:
            parser.error(f"{flag} gives per-device batch {b} twice: pass one peak per batch")
        out[b] = int(round(gb * GB))
    return out


def plan(args) -> dict:
    """The plan as a JSON-safe dict; bad input ends the process with exit 2 and one line."""
    sub = args.plan_parser
    missing = [f"--{k.replace('_', '-')}" for k in FROM_FLAGS if getattr(args, k) is None]
    if missing:
        sub.error(f"the following arguments are required without --db: {', '.join(missing)}")
    if args.run is not None:
        sub.error("--run names a run of --db: pass --db DB too")
    measured = _duplicates(args.measured, "--measured", sub)
    planned = _duplicates(args.planned, "--planned", sub)
    if not measured and not planned:
        sub.error("no memory data: pass --measured BATCH:GB (twice, or once with --planned points)")
    try:
        rule = rule_for(args.optimizer, args.lr_rule)
    except ValueError:
        sub.error(
            f"no learning-rate rule known for optimizer {args.optimizer!r}: pass --lr-rule sqrt, linear or none"
        )
    try:
        model = fit_memory_model(measured, planned or None)
        capacity = args.capacity_gb * GB
        usable = usable_bytes(capacity, args.margin)
        tiers = candidate_tiers(
            args.per_device_batch,
            args.accum,
            args.world,
            args.seq_len,
            model,
            capacity,
            margin=args.margin,
            factors=args.factors,
            infeasible=args.infeasible,
            optimizer=args.optimizer,
            max_per_device=args.max_per_device,
            rule=args.lr_rule,
        )
    except ValueError as e:
        sub.error(str(e))
    current = Tier(args.per_device_batch, args.accum, args.world).batch
    rows = []
    for t in tiers:
        row = t.to_dict()
        if args.noise_scale is not None:
            row["effect"] = predicted_effect(current, t.tier.batch, args.noise_scale).to_dict()
            row["warning"] = noise_scale_warning(t.tier.batch, args.noise_scale)
        rows.append(row)
    return {
        "current": {
            "per_device_batch": args.per_device_batch,
            "accum": args.accum,
            "world_size": args.world,
            "seq_len": args.seq_len,
            "effective_batch": current,
            "tokens_per_step": current * args.seq_len,
            "predicted_peak_bytes": model.predict(args.per_device_batch),
        },
        "memory_model": model.to_dict(),
        "capacity_bytes": capacity,
        "margin": args.margin,
        "usable_bytes": usable,
        "lr_rule": rule,
        "noise_scale": args.noise_scale,
        "tiers": rows,
    }


def _table(result: dict) -> str:
    cur = result["current"]
    mm = result["memory_model"]
    lines = [
        f"current: per-device {cur['per_device_batch']} × accum {cur['accum']} × world {cur['world_size']}"
        f" = {cur['effective_batch']} sequences ({cur['tokens_per_step']:,} tokens/step),"
        f" predicted peak {format_gb(cur['predicted_peak_bytes'])}",
        f"memory: {format_gb(mm['intercept_bytes'])} + {mm['bytes_per_sequence'] / 1e6:.1f} MB/sequence"
        f" ({mm['source']}); usable {format_gb(result['usable_bytes'])} of {format_gb(result['capacity_bytes'])}"
        f" (margin {result['margin']:.0%}); LR rule {result['lr_rule']} ('LR ×' is vs the current batch)",
        "",
    ]
    effect = result["noise_scale"] is not None
    head = ["factor", "per-device", "accum", "tokens/step", "peak", "fits", "LR ×"]
    if effect:
        head += ["steps saved", "more examples"]
    head.append("why")
    body = []
    for t in result["tiers"]:
        row = [
            f"×{t['factor']}",
            str(t["per_device_batch"]),
            str(t["accum"]),
            f"{t['tokens_per_step']:,}",
            "-" if t["predicted_peak_bytes"] is None else format_gb(t["predicted_peak_bytes"]),
            "yes" if t["fits"] else "NO",
            f"{t['lr_multiplier']:.3f}",
        ]
        if effect:
            row += [f"{t['effect']['step_savings']:.0%}", f"{t['effect']['example_cost']:.0%}"]
        row.append(
            t["reason"] + (f" [warning: {t['warning']}]" if effect and t.get("warning") else "")
        )
        body.append(row)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
    for r in [head, *body]:
        lines.append(
            "  ".join(c.rjust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        )
    if effect:
        lines.append("")
        lines.append(
            f"noise scale {result['noise_scale']:g} sequences: 'steps saved' = 1 − S'/S and 'more examples' = E'/E − 1 "
            "to the same loss, from S/S_min = 1 + B_noise/B, E/E_min = 1 + B/B_noise (McCandlish et al. 2018)"
        )
    return "\n".join(lines)


RUN_HAS = (  # flags a run in --db already answers (those with defaults cannot be told apart)
    "measured",
    "planned",
    "capacity_gb",
    "seq_len",
    "per_device_batch",
    "noise_scale",
    "infeasible",
    "max_per_device",
    "lr_rule",
)


def check_db_args(args) -> None:
    """With --db the run gives the tier, memory and policy: a flag that would say otherwise is
    refused (exit 2, one line) rather than silently ignored."""
    given = [f"--{k.replace('_', '-')}" for k in RUN_HAS if getattr(args, k) not in (None, [])]
    if given:
        args.plan_parser.error(
            f"--db reads the tier, memory and policy from the run: drop {', '.join(given)}"
        )


def tier_table_text(head: list[str], rows: list[TierRow], notes: list[str]) -> str:
    """A run's tier table for people: its head lines, the rows, then what they assume."""
    return "\n".join([*head, "", text_table(rows), "", *notes]).rstrip()


def tier_table_json(head: dict, rows: list[TierRow], notes: list[str]) -> str:
    return json.dumps({**head, "tiers": [r.to_dict() for r in rows], "notes": notes}, indent=2)


def run(args: argparse.Namespace) -> int:
    result = plan(args)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0
