"""The online noise scale on the reference GPT against a brute-force estimate; prints markdown.

    OMP_NUM_THREADS=1 python -m bench.noise_brute_bench               # seeds 0 and 1
    OMP_NUM_THREADS=1 python -m bench.noise_brute_bench --seeds 0 1 2 3 4 5

test-tiny as the trainer builds it (seq_len 128), at initialization, weights frozen.
Online: the Monitor over 4000 steps of accumulation 2 x 1 sequence (points at 1 and 2), through
the trainer's own path (after_backward, step: collect, line_estimates), all steps averaged.
Brute force: 2700 independent gradients at B=1 and 200 at B=16 (disjoint sample ids, none
shared with the online run), two_batch_estimates on the two mean squared norms.
Why these sizes: B_simple here is ~0.7 sequences, below any batch, so tr(Σ) is a small
difference on top of |G|²; and per-sequence gradients vary a lot in size (|g_1|² has a
standard deviation of ~70% of its mean and correlates 0.9 with the share of repeated adjacent
bytes: runs of indentation give large, aligned gradients). Every estimate is then costly:
~10,700 backward passes of one sequence per seed. Standard errors by the delta method.
The suite checks the same path exactly, step by step, on a few steps (tests/test_noise_scale.py)
and the estimator's expectation against closed forms; this is the statistical check on a real
model, too slow for the suite.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from bench.noise_bench import machine
from rampwatch.advisor.gns import two_batch_estimates
from rampwatch.monitor import Monitor
from rampwatch.store import names as M
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data import prepare
from rampwatch.trainer.model import GPT, configure_optimizer

ONLINE_STEPS = 4000  # accumulation 2 micro-batches of 1 sequence: 8000 sequences
SMALL, SMALL_N = 1, 2700
BIG, BIG_N = 16, 200


def frozen_online(
    model,
    optimizer,
    micro_batches,
    loss_fn,
    *,
    b: int,
    k: int,
    steps: int,
    seq_len: int = 1,
    logged: list | None = None,
):
    """The trainer's accumulation loop with frozen weights (no optimizer step): returns the
    Monitor and the per-step (|G|², tr(Σ)) estimates it logged; logged, when given, gets each
    step's metrics."""
    mon = Monitor(
        None, model=model, optimizer=optimizer, per_device_batch=b, accum=k, seq_len=seq_len
    )
    g2, tr = np.empty(steps), np.empty(steps)
    for s in range(steps):
        for j in range(k):
            x, y = micro_batches(s, j)
            loss = loss_fn(model, x, y)
            (loss / k).backward()
            mon.after_backward()
        m = mon.step(s + 1, float(loss.detach()))
        g2[s], tr[s] = m[M.GNS_G2], m[M.GNS_TRACE]
        if logged is not None:
            logged.append(m)
        model.zero_grad(set_to_none=True)
    return mon, g2, tr


def sq_grad_norm(model) -> float:
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).double().square().sum())


def brute_sq_norms(model, data, batch: int, n: int, first_id: int) -> np.ndarray:
    """|g_B|² of n independent batches of `batch` sequences (disjoint sample ids, not nested)."""
    out = np.empty(n)
    for i in range(n):
        x, y, _ = data.batch(first_id + i * batch, batch)
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        out[i] = sq_grad_norm(model)
    model.zero_grad(set_to_none=True)
    return out


def frozen_gpt(seed: int):
    """test-tiny's data and model at initialization, as the trainer builds them for `seed`."""
    cfg = PRESETS["test-tiny"]
    data = prepare(cfg, seed=seed)
    torch.manual_seed(seed)
    model = GPT(cfg).train()
    return cfg, data, model, configure_optimizer(model, "adamw", lr=1e-3)


def gpt_loss(model, x, y):
    return model(x, y)


def online_vs_brute(seed: int = 0, online_steps=ONLINE_STEPS, small_n=SMALL_N, big_n=BIG_N) -> dict:
    cfg, data, model, opt = frozen_gpt(seed)
    b, k = 1, 2
    # disjoint ranges of sample ids: online, small batches, big batches (all in epoch 0)
    online_first = 0
    small_first = online_first + online_steps * b * k
    big_first = small_first + small_n * SMALL
    assert big_first + big_n * BIG <= data.epoch_samples

    def micro(s, j):
        x, y, _ = data.batch(online_first + (s * k + j) * b, b)
        return x, y

    mon, g2, tr = frozen_online(
        model, opt, micro, gpt_loss, b=b, k=k, steps=online_steps, seq_len=cfg.seq_len
    )
    ys = brute_sq_norms(model, data, SMALL, small_n, small_first)
    yb = brute_sq_norms(model, data, BIG, big_n, big_first)
    g2_brute, tr_brute = two_batch_estimates(SMALL, ys.mean(), BIG, yb.mean())

    # standard errors (relative) of both B_simple estimates, delta method on the means: online,
    # B = mean tr / mean |G|² over independent steps; brute, log B as a function of (ys, yb)
    c = np.cov(tr, g2) / online_steps
    t_m, g_m = tr.mean(), g2.mean()
    se_online = math.sqrt(c[0, 0] / t_m**2 + c[1, 1] / g_m**2 - 2 * c[0, 1] / (t_m * g_m))

    def log_b(small_mean, big_mean):
        g, t = two_batch_estimates(SMALL, small_mean, BIG, big_mean)
        return math.log(t / g)

    h = 1e-6
    d_s = (log_b(ys.mean() * (1 + h), yb.mean()) - log_b(ys.mean(), yb.mean())) / (ys.mean() * h)
    d_b = (log_b(ys.mean(), yb.mean() * (1 + h)) - log_b(ys.mean(), yb.mean())) / (yb.mean() * h)
    se_brute = math.sqrt(d_s**2 * ys.var(ddof=1) / small_n + d_b**2 * yb.var(ddof=1) / big_n)
    return {
        "online": t_m / g_m,
        "online_g2": g_m,
        "brute": tr_brute / g2_brute,
        "brute_g2": g2_brute,
        "se_online": se_online,
        "se_brute": se_brute,
        "updates": mon.noise.updates,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("## The online noise scale on test-tiny against brute force\n")
    print(f"{machine(1)}\n")
    print(
        "| seed | B_simple online | brute force | online / brute | se online | se brute "
        "| \\|G\\|² online / brute | minutes |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        t0 = time.perf_counter()
        r = online_vs_brute(seed)
        print(
            f"| {seed} | {r['online']:.3f} | {r['brute']:.3f} | {r['online'] / r['brute']:.3f} "
            f"| {r['se_online']:.1%} | {r['se_brute']:.1%} "
            f"| {r['online_g2'] / r['brute_g2']:.3f} | {(time.perf_counter() - t0) / 60:.1f} |",
            flush=True,
        )
    print(f"\n{machine(1)}")


if __name__ == "__main__":
    main()
