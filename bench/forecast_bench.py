"""Does the card's forecast crossing come true? The advisor replayed on recorded runs.

    python -m bench.forecast_bench --keep DIR              # record the runs into DIR (reused), replay
    python -m bench.forecast_bench --keep DIR --runs RB    # also replay ramp_bench's kept runs (RB)
    python -m bench.forecast_bench --runs RB --no-record   # replay recorded runs only
    python -m bench.forecast_bench --quick                 # one short run: a smoke test

Recorded runs: the reference trainer (`rampwatch train`, a child process, one thread, one at a
time) on the `bench-tiny` preset at a constant batch with accumulation 2, `--ramp off`, the √ rule
from 3e-3 at 16 (RECORD: seeds and batches). `--runs DIR` adds every constant-batch run of the
bench-tiny preset in DIR's databases (bench/ramp_bench.py --keep DIR leaves 30: batches 8–128,
seeds 0 and 1, three learning rates each; each stops at its target validation loss).

Replay: for each run and each ramp point k in RAMP_POINTS (the policy's `ramp_at`: the card of a
run whose policy ramps at k × the batch B), the card's inputs at every QUERY_EVERY-th step t with
an estimate — the last 2,048 steps of `gns_b_simple` and `gns_b_simple_low`, as
dashboard/store_access.py reads them — go through RampPolicy.decide, as dashboard/recommend.py
calls it.
A query is a step before the first crossing at which the card shows a trend forecast. The truth
is the run's first step after t whose estimate is above k·B (a point above it, or no point and a
lower bound above it: what ramp_decision calls above). Pairs (run, k) that never crossed before
the run ended are censored: counted apart.

Printed: before (the ±1.96 SE delta-method range, `ramp_decision(calibration=None)`), after
(the shipped FORECAST_CALIBRATION) and the live page's schedule (advisor/schedule.py's power law
of the tokens, its slope ± Z SE, fitted on the run's estimates up to the query): coverage overall,
by stated horizon and by run, the median absolute error of the point, and how often no forecast
is given; then the calibration refitted
on these runs, with its coverage leave-one-run-out, to paste into advisor/forecast.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.tiny_runs import train_tiny
from rampwatch.advisor import schedule
from rampwatch.advisor.forecast import (
    FORECAST_CALIBRATION,
    ForecastCalibration,
    calibrated_forecast,
)
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.ramp_point import ramp_decision
from rampwatch.store import names as M
from rampwatch.store import reader

# (seed, batch) of the runs recorded here, and their lengths: about 1,200 16-sequence steps each
RECORD = ((2, 16), (3, 16), (4, 16), (5, 8), (6, 8), (7, 16), (8, 8), (9, 32), (10, 32), (11, 16))
STEPS = {8: 1400, 16: 900, 32: 600}
BASE_LR, BASE_BATCH = 3e-3, 16  # the √ rule from 3e-3 at 16, as bench/ramp_bench.py
RAMP_POINTS = (1, 2, 4)  # the policy's ramp_at: forecasts of crossing k × the batch
QUERY_EVERY = 2  # query every other step with an estimate
CARD_STEPS = 2048  # dashboard/store_access.py GNS_WINDOW: the raw steps the card reads
LEVEL = 0.90  # the coverage the range must reach with each run left out
HORIZONS = ((1, 10), (10, 30), (30, 100), (100, 300), (300, 10**9))


# ------------------------------------------------------------------------------------ runs


def record(out: Path, seed: int, batch: int, steps: int) -> tuple[Path, float]:
    """Train one constant-batch run into out/NAME.duckdb; a finished one there is reused."""
    lr = BASE_LR * math.sqrt(batch / BASE_BATCH)
    return train_tiny(
        out, f"s{seed}-b{batch}", seed=seed, steps=steps, batch=batch, lr=lr, val_every=100
    )


@dataclass
class Run:
    name: str
    seed: int
    batch: int
    steps: list[int]  # steps with an estimate (each logs a lower bound)
    points: list[float | None]
    lower: list[float]
    last_step: int


def constant_runs(db: Path) -> list[Run]:
    """The database's finished bench-tiny runs at one batch throughout, as the card reads them."""
    out = []
    for r in reader.list_runs(db):
        if r.status != "finished" or (r.config or {}).get("preset") != "bench-tiny":
            continue
        if reader.events(db, r.run_id, kinds=[M.EVENT_RAMP]):
            continue
        batches = reader.series(db, r.run_id, M.BATCH_SEQS, width=1)
        if len(set(batches.last.tolist())) != 1:
            continue
        pts = reader.series(db, r.run_id, M.GNS, width=1)
        low = reader.series(db, r.run_id, M.GNS_LOW, width=1)
        by_step = dict(zip(pts.last_step.tolist(), pts.last.tolist(), strict=True))
        steps = low.last_step.tolist()
        out.append(
            Run(
                r.run_id,
                int(r.config.get("seed", -1)),
                int(batches.last[0]),
                steps,
                [by_step.get(s) for s in steps],
                low.last.tolist(),
                int(r.last_step),
            )
        )
    return out


# ---------------------------------------------------------------------------------- replay


@dataclass
class Query:
    run: str
    k: int
    t: int  # the query step
    n: int  # estimates the card has
    trend: int  # the log-linear trend's crossing step (the old point)
    old: tuple[int, int | None]  # the ±1.96 SE delta range
    new: tuple[int, int] | None  # the shipped calibration's range (None: withheld)
    new_point: int | None
    truth: int | None  # first step above k·B; None: not before the run ended
    end: int  # the run's last step
    law: tuple[int, int | None] | None = None  # the schedule's power law: early, late crossing
    law_point: int | None = None  # ... and its central crossing (None: no fit, or never)


def replay(run: Run, k: int, every: int = QUERY_EVERY) -> list[Query]:
    policy = RampPolicy(original_batch=run.batch, original_lr=1.0, ramp_at=float(k))
    target = k * run.batch
    truth = next(
        (
            s
            for s, v, lo in zip(run.steps, run.points, run.lower, strict=True)
            if (v > target if v is not None else lo > target)
        ),
        None,
    )
    out = []
    first = 0
    for i in range(0, len(run.steps), every):
        t = run.steps[i]
        if truth is not None and t >= truth:
            break
        while run.steps[first] <= t - CARD_STEPS:
            first += 1
        sl = slice(first, i + 1)
        args = (run.steps[sl], run.points[sl], run.lower[sl], run.batch, None)
        old = decide_with(policy, args, None)
        if old.ready or old.forecast_range is None or old.evidence.steps_above:
            continue  # no trend forecast on the card at this step
        new = policy.decide(*args)
        law_point, law = schedule_forecast(run, i, target)
        out.append(
            Query(
                run.name,
                k,
                t,
                old.evidence.n_samples,
                old.forecast_step,
                old.forecast_range,
                new.forecast_range,
                new.forecast_step,
                truth,
                run.last_step,
                law,
                law_point,
            )
        )
    return out


def schedule_forecast(run: Run, i: int, target: float):
    """The live page's schedule at estimate i: its power law (advisor/schedule.py, fitted on the
    estimates since FIT_FROM of the tokens seen; tokens ∝ step + 1 at a constant batch) and the
    step where it, its early (+Z SE) and late (−Z SE) slopes reach the target. (point, (early,
    late)); the point None where there is no fit or the law never reaches it."""
    pts = [
        (s + 1, v)
        for s, v in zip(run.steps[: i + 1], run.points[: i + 1], strict=True)
        if v is not None
    ]
    now = run.steps[i] + 1
    law, _ = schedule.fit_power_law([p[0] for p in pts], [p[1] for p in pts], now)
    if law is None:
        return None, None
    step = [law.reaches(target, now, z) for z in (0.0, schedule.Z, -schedule.Z)]
    at = [None if math.isinf(x) else max(run.steps[i] + 1, math.ceil(x) - 1) for x in step]
    return at[0], (at[1], at[2]) if at[1] is not None else None


def decide_with(policy: RampPolicy, args, calibration):
    """RampPolicy.decide with another calibration (None: the old delta-method range)."""
    steps, values, lower, batch, since = args
    return ramp_decision(
        steps,
        values,
        batch,
        ramp_at=policy.ramp_at,
        bound_at=policy.bound_at,
        hysteresis_steps=policy.hysteresis_steps,
        min_estimates=policy.min_estimates,
        factor=policy.factor,
        since_step=since,
        lower=lower,
        calibration=calibration,
    )


# ---------------------------------------------------------------------------------- figures


def outcome(rng, truth: int | None, end: int) -> bool | None:
    """Did the range hold? None: not known (no crossing by the run's end, and the range goes on
    past it). A range that ended before the run did, with no crossing, is a certain miss."""
    lo, hi = rng
    if truth is not None:
        return lo <= truth and (hi is None or truth <= hi)
    return None if hi is None or hi > end else False


def summary(qs: list[Query], which: str) -> dict:
    """Coverage of the 'old', 'new' or 'law' range, its point's error, and how often none is
    given (for 'law': no fit, or a range that never starts)."""
    point_of = {"old": "trend", "new": "new_point", "law": "law_point"}[which]
    given = [q for q in qs if getattr(q, which) is not None]
    got = [outcome(getattr(q, which), q.truth, q.end) for q in given]
    known = [(q, o) for q, o in zip(given, got, strict=True) if o is not None]
    hit = np.array([o for _, o in known], bool)
    by_run: dict[str, list[bool]] = {}
    for q, o in known:
        by_run.setdefault(q.run, []).append(o)
    stated = np.array(
        [(getattr(q, point_of) or q.end * 10**6) - q.t for q, _ in known], float
    )  # a law that never crosses: the longest horizon
    rows = []
    for a, b in HORIZONS:
        m = (stated >= a) & (stated < b)
        rows.append((a, b, int(m.sum()), float(hit[m].mean()) if m.any() else None))
    seen = [q for q in given if q.truth is not None and getattr(q, point_of) is not None]
    point = np.array([getattr(q, point_of) for q in seen], float)
    truth = np.array([q.truth for q in seen], float)
    t = np.array([q.t for q in seen], float)
    return {
        "queries": len(qs),
        "given": len(given),
        "known": len(known),
        "runs": len(by_run),
        "coverage": float(hit.mean()) if len(hit) else None,
        "censored_misses": sum(1 for q, o in known if q.truth is None),
        "run_cov": sorted(float(np.mean(v)) for v in by_run.values()),
        "mae": float(np.median(np.abs(point - truth))) if len(seen) else None,
        "rel": float(np.median(np.abs(np.log((truth - t) / np.maximum(point - t, 1)))))
        if len(seen)
        else None,
        "horizons": rows,
    }


def _num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def print_summary(label: str, s: dict) -> None:
    rc = s["run_cov"]
    print(
        f"\n**{label}**: coverage {_num(s['coverage'], '.1%')} of {s['known']:,} queries on "
        f"{s['runs']} runs whose outcome is known ({s['censored_misses']:,} of them ranges that "
        f"ended before a run that never crossed: certain misses); "
        f"{s['given'] - s['known']:,} more ran past a run that never crossed (unknown); "
        f"{s['queries'] - s['given']:,} of {s['queries']:,} queries withheld; per run "
        f"{'—' if not rc else f'min {rc[0]:.0%}, median {rc[len(rc) // 2]:.0%}, max {rc[-1]:.0%}'}; "
        f"median |error| of the point {_num(s['mae'], '.0f')} steps (median |log ratio| of "
        f"horizons {_num(s['rel'], '.2f')})\n"
    )
    print("| stated horizon (steps) | queries | coverage |\n|---|---|---|")
    for a, b, n, c in s["horizons"]:
        print(f"| {a}–{'' if b > 10**8 else b} | {n:,} | {_num(c, '.1%')} |")


# -------------------------------------------------------------------------------------- fit


@dataclass
class Table:
    """The queries as arrays: t, x = log(h_trend/t), the truth (nan: none), end, run, n."""

    t: np.ndarray
    x: np.ndarray
    truth: np.ndarray
    end: np.ndarray
    run: np.ndarray
    n: np.ndarray

    @classmethod
    def of(cls, qs: list[Query]) -> Table:
        t = np.array([max(1, q.t) for q in qs], float)
        return cls(
            t,
            np.log(np.maximum(np.array([q.trend for q in qs], float) - t, 1) / t),
            np.array([np.nan if q.truth is None else q.truth for q in qs], float),
            np.array([q.end for q in qs], float),
            np.array([q.run for q in qs]),
            np.array([q.n for q in qs]),
        )

    def take(self, m) -> Table:
        return Table(*(getattr(self, f)[m] for f in ("t", "x", "truth", "end", "run", "n")))


def fit(tab: Table, level: float):
    """(intercept, slope, low, mid, high): OLS of log(h/t) on x over the crossings seen, and
    quantiles of its residual."""
    seen = ~np.isnan(tab.truth)
    x, y = tab.x[seen], np.log((tab.truth[seen] - tab.t[seen]) / tab.t[seen])
    slope, intercept = np.polyfit(x, y, 1)
    low, mid, high = np.quantile(y - intercept - slope * x, [(1 - level) / 2, 0.5, (1 + level) / 2])
    return float(intercept), float(slope), float(low), float(mid), float(high)


def held_out(tab: Table, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Each query's outcome (1 held, 0 missed, nan unknown) under the range fitted on the other
    runs, rounded as calibrated_forecast rounds it; and the horizon of that fit's point."""
    out, horizon = np.full(len(tab.t), np.nan), np.zeros(len(tab.t))
    for r in np.unique(tab.run):
        m = tab.run == r
        a, b, lo, mid, hi = fit(tab.take(~m), level)
        t, centre = tab.t[m], a + b * tab.x[m]
        first = np.maximum(t + 1, np.floor(t + t * np.exp(centre + lo)))
        last = np.maximum(t + 1, np.ceil(t + t * np.exp(centre + hi)))
        truth, end = tab.truth[m], tab.end[m]
        seen = ~np.isnan(truth)
        out[m] = np.where(
            seen, (first <= truth) & (truth <= last), np.where(last <= end, 0.0, np.nan)
        )
        horizon[m] = np.maximum(1, np.round(t * np.exp(centre + mid)))
    return out, horizon


def calibrate(
    qs: list[Query], min_estimates: int
) -> tuple[ForecastCalibration | None, float, np.ndarray]:
    """The calibration refitted on these queries: the smallest quantile level (from LEVEL up)
    at which the range, fitted with each run left out in turn, holds for >= LEVEL of the queries
    whose outcome is known; its support is the 1st–99th percentile of x over the crossings."""
    tab = Table.of(qs)
    tab = tab.take(tab.n >= min_estimates)
    seen = ~np.isnan(tab.truth)
    x_min, x_max = np.quantile(tab.x[seen], [0.01, 0.99])
    tab = tab.take((tab.x >= x_min) & (tab.x <= x_max))
    level = LEVEL
    while True:
        res, horizon = held_out(tab, level)
        if np.nanmean(res) >= LEVEL or level >= 0.99:
            break
        level = round(level + 0.01, 2)
    a, b, lo, mid, hi = fit(tab, level)
    known = ~np.isnan(res)
    cal = ForecastCalibration(
        round(a, 3),
        round(b, 3),
        round(lo, 3),
        round(mid, 3),
        round(hi, 3),
        round(float(x_min), 2),
        round(float(x_max), 2),
        min_estimates,
        round(float(np.nanmean(res)), 3),
        len(np.unique(tab.run[known])),
        int(known.sum()),
    )
    print("\n| stated horizon (steps), each run left out | queries | coverage |\n|---|---|---|")
    for first, last in HORIZONS:
        m = known & (horizon >= first) & (horizon < last)
        print(
            f"| {first}–{'' if last > 10**8 else last} | {int(m.sum()):,} | "
            f"{_num(float(res[m].mean()) if m.any() else None, '.1%')} |"
        )
    return (cal if np.nanmean(res) >= LEVEL else None), level, res


def with_calibration(qs: list[Query], cal: ForecastCalibration) -> list[Query]:
    """The queries with the range `cal` states (calibrated_forecast, as ramp_decision calls it)."""
    out = []
    for q in qs:
        point, rng = calibrated_forecast(q.t, q.trend, q.n, cal)
        out.append(replace(q, new=rng if point is not None else None, new_point=point))
    return out


# ------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--keep", type=Path, help="record into this folder; finished runs there are reused"
    )
    ap.add_argument(
        "--runs",
        type=Path,
        action="append",
        default=[],
        help="also replay the constant-batch runs in this folder's databases",
    )
    ap.add_argument("--no-record", action="store_true", help="record nothing; replay --runs only")
    ap.add_argument("--quick", action="store_true", help="one 300-step run, queries every 10 steps")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    plan = () if a.no_record else (RECORD[:1] if a.quick else RECORD)
    print(
        f"# forecast bench: bench-tiny constant batches, ramp points {RAMP_POINTS}, recorded "
        f"{[f's{s}-b{b}' for s, b in plan]}, also {[str(p) for p in a.runs]}; "
        f"{os.cpu_count()} cores, load average {load:.2f}"
    )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = a.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for seed, batch in plan:
            db, wall = record(out, seed, batch, 300 if a.quick else STEPS[batch])
            print(f"- recorded s{seed}-b{batch}: {wall:.0f} s" if wall else f"- reused {db}")
            runs += constant_runs(db)
        for folder in a.runs:
            for db in sorted(folder.glob("*.duckdb")):
                runs += constant_runs(db)
    every = 10 if a.quick else QUERY_EVERY
    qs = [q for r in runs for k in RAMP_POINTS for q in replay(r, k, every)]
    seeds = sorted({r.seed for r in runs})
    crossed = {(q.run, q.k) for q in qs if q.truth is not None}
    print(
        f"\n{len(runs)} runs (seeds {seeds}, batches {sorted({r.batch for r in runs})}); "
        f"{len(qs):,} queries; {len(crossed)} (run, ramp point) pairs crossed, "
        f"{len({(q.run, q.k) for q in qs}) - len(crossed)} never did before the run ended"
    )
    print_summary("before: ±1.96 SE delta range (trend point)", summary(qs, "old"))
    print_summary(
        "after: FORECAST_CALIBRATION as shipped, through RampPolicy.decide", summary(qs, "new")
    )
    print_summary(
        "the schedule's power law (advisor/schedule.py): central crossing, range ± Z SE",
        summary(qs, "law"),
    )
    if len(crossed) >= 3:
        cal, level, res = calibrate(qs, FORECAST_CALIBRATION.min_estimates)
        print(
            f"\nrefitted on these runs: quantile level {level:.2f}, the smallest whose range, "
            f"fitted with each run left out, held for >= {LEVEL:.0%} of the queries whose outcome "
            f"is known ({np.nanmean(res):.1%} of {int(np.sum(~np.isnan(res))):,}):\n\n    {cal!r}"
        )
        if cal is not None:
            print_summary("refitted, in sample", summary(with_calibration(qs, cal), "new"))
    print(
        f"\nwall time {time.perf_counter() - t0:.0f} s (load average at start {load:.2f}, at end "
        f"{os.getloadavg()[0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
