"""Lag and noise of the smoothed noise scale on a recorded run: the window against EMAs.

    python bench/noise_window_bench.py                    # trains bench-tiny 16 seq/step, 1,500 steps
    python bench/noise_window_bench.py --db RUNS --run ID # any run that logged gns_g2 / gns_trace

The per-step estimates (|G|², tr Σ) the run logged are replayed through each smoother:
- window: advisor.gns_window.NoiseScaleWindow with its defaults (what the monitor logs);
- EMA h: the bias-corrected per-sample EMAs of numerator and denominator that Rampwatch used
  before (McCandlish et al. 2018, App. A.1), half-life h sequences (2,000 was the default).
The reference is the centred ratio of sums over ±75 steps (it uses the future, so no causal
smoother can match it). Printed per smoother: the shift (lag, steps) that best aligns it with the
reference, its median |log error| against the reference, its median |Δ log| from step to step
(noise), the share of steps with a value, and the first step at which it reaches 16, 32 and 64.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.tiny_runs import train_tiny
from rampwatch.advisor.gns_window import NoiseScaleWindow
from rampwatch.store import names as M
from rampwatch.store import reader

HALF_WIDTH = 75  # steps either side of the centred reference
THRESHOLDS = (16, 32, 64)


def recorded(db: Path, run_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The run's steps with per-step estimates: steps, |G|², tr(Σ), sequences per step."""
    import pyarrow.compute as pc

    table = reader.export(db, run_id)
    cols = {}
    for name in (M.GNS_G2, M.GNS_TRACE, M.BATCH_SEQS):
        rows = table.filter(pc.equal(table["name"], name))
        cols[name] = dict(zip(rows["step"].to_pylist(), rows["value"].to_pylist(), strict=True))
    steps = sorted(set(cols[M.GNS_G2]) & set(cols[M.GNS_TRACE]))
    return (
        np.array(steps),
        np.array([cols[M.GNS_G2][s] for s in steps]),
        np.array([cols[M.GNS_TRACE][s] for s in steps]) if steps else np.zeros(0),
        np.array([cols[M.BATCH_SEQS].get(s, 16) for s in steps]),
    )


def window_path(g2, trace, window=NoiseScaleWindow) -> np.ndarray:
    """The logged gns_b_simple of a replay through window() (NaN where none is logged)."""
    w = window()
    out = np.full(len(g2), np.nan)
    for i, (g, t) in enumerate(zip(g2, trace, strict=True)):
        est = w.update(g, t)
        if est is not None and est.b_simple is not None:
            out[i] = est.b_simple
    return out


def ema_path(g2, trace, batch, half_life: float) -> np.ndarray:
    """Bias-corrected EMAs decayed per sequence, as Rampwatch's NoiseScaleEMA computed them."""
    m_g = m_t = weight = 0.0
    out = np.full(len(g2), np.nan)
    for i, (g, t, b) in enumerate(zip(g2, trace, batch, strict=True)):
        fresh = -math.expm1(math.log(0.5) * b / half_life)
        weight = (1 - fresh) * weight + fresh
        m_g += fresh / weight * (g - m_g)
        m_t += fresh / weight * (t - m_t)
        if m_g > 0 and m_t >= 0:
            out[i] = m_t / m_g
    return out


def centred(g2, trace) -> np.ndarray:
    n = len(g2)
    ref = np.full(n, np.nan)
    for i in range(n):
        lo, hi = max(0, i - HALF_WIDTH), min(n, i + HALF_WIDTH + 1)
        ratio = trace[lo:hi].sum() / g2[lo:hi].sum()
        ref[i] = ratio if ratio > 0 else np.nan
    return ref


def score(steps, path, ref) -> dict:
    n = len(path)
    idx = np.arange(n)
    ok = np.isfinite(path) & (path > 0) & (idx >= 100) & (idx < n - HALF_WIDTH)
    best = (0, math.inf)
    for lag in range(0, 400, 5):
        m = ok & (idx - lag >= 0)
        if not m.any():
            break
        shifted = ref[idx[m] - lag]
        good = np.isfinite(shifted)
        if not good.any():  # no reference that far back: nothing to compare at this lag
            continue
        err = float(np.median(np.abs(np.log(path[m][good]) - np.log(shifted[good]))))
        if err < best[1]:
            best = (lag, err)
    good = ok & np.isfinite(ref)
    firsts = {t: next((int(steps[i]) for i in range(n) if path[i] >= t), None) for t in THRESHOLDS}
    return {
        "lag": best[0],
        "err": float(np.median(np.abs(np.log(path[good]) - np.log(ref[good])))),
        "noise": float(np.median(np.abs(np.diff(np.log(path[ok]))))),
        "coverage": float(np.isfinite(path).mean()),
        "first": firsts,
    }


def train_one(out: Path, steps: int, seed: int) -> tuple[Path, str]:
    db, _ = train_tiny(out, "rec", seed=seed, steps=steps)
    return db, "rec"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--db", type=Path)
    ap.add_argument("--run")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db, run_id = (a.db, a.run) if a.db else train_one(Path(tmp), a.steps, a.seed)
        steps, g2, trace, batch = recorded(db, run_id)
    if len(steps) < 300:
        raise SystemExit(
            f"noise_window_bench: run {run_id} has {len(steps)} steps with per-step "
            "estimates; need 300 or more"
        )
    ref = centred(g2, trace)
    paths = {"window (default)": window_path(g2, trace)}
    for h in (2000, 320):
        paths[f"EMA, half-life {h} seq"] = ema_path(g2, trace, batch, h)
    print(
        f"# smoothed noise scale on run {run_id}: {len(steps)} steps, batch "
        f"{int(np.median(batch))} sequences; reference: centred sums over ±{HALF_WIDTH} steps\n"
    )
    print(
        "| smoother | lag (steps) | median abs log error | median abs step change | steps with a value | "
        + " | ".join(f"first >= {t}" for t in THRESHOLDS)
        + " |"
    )
    print("|---" * (5 + len(THRESHOLDS)) + "|")
    rows = [("centred reference", None)] + list(paths.items())
    for label, path in rows:
        if path is None:
            first = {
                t: next((int(steps[i]) for i in range(len(ref)) if ref[i] >= t), None)
                for t in THRESHOLDS
            }
            print(
                f"| {label} | — | — | — | — | "
                + " | ".join(str(first[t]) for t in THRESHOLDS)
                + " |"
            )
            continue
        sc = score(steps, path, ref)
        print(
            f"| {label} | {sc['lag']} | {sc['err']:.3f} | {sc['noise']:.4f} | "
            f"{sc['coverage']:.0%} | " + " | ".join(str(sc["first"][t]) for t in THRESHOLDS) + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
