"""The online gradient noise scale, proven on real torch models through the trainer's own path:
Monitor.after_backward (AccumulationStats: |.grad|² after each backward) → Monitor.step
(collect → advisor.gns.line_estimates → advisor.gns_window.NoiseScaleWindow).

1. least squares with frozen weights, where |G|² and tr(Σ) are known exactly;
2. the reference GPT (test-tiny) with frozen weights: each step's estimate against the same
   sequences' gradients recomputed one by one (the statistical check: bench/noise_brute_bench.py);
3. a real training run: B_simple grows as the loss falls;
4. a non-finite gradient is left out of the window, logs no smoothed value, and is reported;
5. accumulation 1 on one device says, once, that there is no second batch size.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.noise_brute_bench import frozen_gpt, frozen_online, gpt_loss, online_vs_brute
from rampwatch.advisor.gns import two_batch_estimates
from rampwatch.advisor.gns_window import NoiseScaleWindow
from rampwatch.monitor import Monitor
from rampwatch.store import names as M
from rampwatch.store import reader
from tests.trainer_runs import metric, run_trainer

torch.set_num_threads(1)


def _batch_means_se(g2: np.ndarray, tr: np.ndarray, n_batches: int = 40) -> dict[str, float]:
    """Standard errors of mean |G|², mean tr(Σ) and their ratio, from consecutive batch means
    (each batch's ratio of means is one draw of B_simple)."""
    gb = g2[: len(g2) // n_batches * n_batches].reshape(n_batches, -1).mean(axis=1)
    tb = tr[: len(tr) // n_batches * n_batches].reshape(n_batches, -1).mean(axis=1)
    root = math.sqrt(n_batches)
    return {
        "g2": gb.std(ddof=1) / root,
        "trace": tb.std(ddof=1) / root,
        "b_simple": (tb / gb).std(ddof=1) / root,
    }


# ------------------------------------------------------------------ 1. closed form


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


def _least_squares(n=4096, d_in=64, d_out=128, seed=0):
    """A linear model (weights frozen off the optimum) on fixed data, and the exact population
    |G|², tr(Σ) of the per-example gradients of F.mse_loss (mean over the d_out outputs):
    ∇_W ℓ_i = (2/d_out)·r_i x_iᵀ, ∇_b ℓ_i = (2/d_out)·r_i, with r_i = W x_i + b − y_i.
    Σ is the population covariance (1/N) Σ_i (g_i − G)(g_i − G)ᵀ, so tr(Σ) = mean|g_i|² − |G|²."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w_star = torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in)
    y = x @ w_star.T + 0.5 * torch.randn(n, d_out, generator=g)
    model = torch.nn.Linear(d_in, d_out)
    with torch.no_grad():
        model.weight.copy_(w_star + torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in))
        model.bias.zero_()
    with torch.no_grad():  # exact, in float64, for the float32 model and data actually used
        xd, w, bias = x.double(), model.weight.double(), model.bias.double()
        r = xd @ w.T + bias - y.double()
        c = 2.0 / d_out
        grad_w, grad_b = c * r.T @ xd / n, c * r.mean(0)
        g2 = float(grad_w.square().sum() + grad_b.square().sum())
        per_example_sq = c * c * r.square().sum(1) * (xd.square().sum(1) + 1.0)
        trace = float(per_example_sq.mean()) - g2
    return model, x, y, g2, trace


def test_closed_form_matches_per_example_autograd():
    """The closed form of test 2 against torch.func's per-example gradients of the same loss."""
    from torch.func import functional_call, grad, vmap

    model, x, y, g2, trace = _least_squares(n=512)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return _mse(lambda inp: functional_call(model, p, (inp,)), xi[None], yi[None])

    pg = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([pg["weight"].flatten(1), pg["bias"]], 1).double()
    mean = flat.mean(0)
    assert float(mean @ mean) == pytest.approx(g2, rel=1e-4)
    assert float((flat - mean).square().sum(1).mean()) == pytest.approx(trace, rel=1e-4)


def test_least_squares_online_estimate_matches_exact():
    """Micro-batches of b examples drawn i.i.d. WITH replacement from the N examples, so
    E|g_B|² = |G|² + tr(Σ)/B holds exactly for every running sum S_j/j (B = j·b) with Σ the
    population covariance; the trainer's estimator must recover the exact values."""
    model, x, y, g2_exact, tr_exact = _least_squares()
    b_exact = tr_exact / g2_exact  # ≈ 81 examples: the sizes 32..128 bracket it
    b, k, steps = 32, 4, 2000
    idx = torch.randint(len(x), (steps, k, b), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # never stepped: weights frozen
    mon, g2, tr = frozen_online(
        model, opt, lambda s, j: (x[idx[s, j]], y[idx[s, j]]), _mse, b=b, k=k, steps=steps
    )

    assert mon.noise.updates == steps and mon.noise.skipped == 0
    # the smoothed value is the ratio of sums over its window of the logged per-step estimates
    last = mon.noise.latest
    assert last.g2 == pytest.approx(g2[-last.steps :].mean(), rel=1e-9)
    assert last.trace == pytest.approx(tr[-last.steps :].mean(), rel=1e-9)
    # steps are independent, so batch means give honest standard errors; they must be well
    # under the 5% tolerance (measured: |G|² 0.21%, tr(Σ) 0.26%, B_simple 0.43% of exact; the
    # errors themselves were -0.04%, -0.09%, -0.05%)
    se = _batch_means_se(g2, tr)
    assert se["g2"] < 0.01 * g2_exact and se["trace"] < 0.01 * tr_exact, se
    assert se["b_simple"] < 0.01 * b_exact, (se, b_exact)

    assert g2.mean() == pytest.approx(g2_exact, rel=0.05)
    assert tr.mean() == pytest.approx(tr_exact, rel=0.05)
    # the windowed estimate at the end (its default window, not all 2000 steps): within 10%,
    # and its interval covers the exact value
    assert mon.noise_scale == pytest.approx(b_exact, rel=0.10)
    assert mon.last_metrics[M.GNS] == pytest.approx(b_exact, rel=0.10)
    assert mon.last_metrics[M.GNS_LOW] <= b_exact <= mon.last_metrics[M.GNS_HIGH]


def test_frozen_least_squares_sharpens_as_the_steady_steps_add_up():
    """Nothing drifts, so the window keeps growing past 200 steps: B_simple 36.5 (28 inputs, 32
    outputs), 8 micro-batches of 8; the logged values of the last 1,000 of 3,000 steps have a
    median error <= 5% and their interval covers the exact value at >= 80% of them."""
    model, x, y, g2_exact, tr_exact = _least_squares(d_in=28, d_out=32)
    b_exact = tr_exact / g2_exact
    b, k, steps = 8, 8, 3000
    idx = torch.randint(len(x), (steps, k, b), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    logged: list[dict] = []
    mon, _, _ = frozen_online(
        model,
        opt,
        lambda s, j: (x[idx[s, j]], y[idx[s, j]]),
        _mse,
        b=b,
        k=k,
        steps=steps,
        logged=logged,
    )
    last = logged[-1000:]
    errors = [abs(m[M.GNS] / b_exact - 1) for m in last]
    covered = [m[M.GNS_LOW] <= b_exact <= m.get(M.GNS_HIGH, math.inf) for m in last]
    assert np.median(errors) <= 0.05, (np.median(errors), b_exact)
    assert np.mean(covered) >= 0.80, np.mean(covered)
    assert mon.noise.latest.steps > 2000  # the window the issue saw stopped at 200


def test_a_ramp_marks_the_noise_window_and_the_buffer_holds_4000_steps():
    """Monitor.ramp_applied tells the window that a change may start with the next step."""
    from rampwatch.advisor.tiers import Tier
    from rampwatch.monitor.ramp_protocol import Ramp

    model, *_ = _least_squares(n=256, d_in=8, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = Monitor(None, model=model, optimizer=opt, per_device_batch=4, accum=2, seq_len=1)
    assert mon.noise.max_steps == 4000 and mon.noise.since_mark is None
    mon.ramp_applied(Ramp(Tier(8, 2), 1.0, 0.0, step=0, source="test", before=Tier(4, 2)))
    assert mon.noise.since_mark == 0


# ------------------------------------------------------------------ 2. the reference GPT

GPT_STEPS = 6


def test_gpt_per_step_estimates_equal_brute_force_on_the_same_sequences():
    """test-tiny as the trainer builds it (seq_len 128), weights frozen, accumulation 2 x 1
    sequence: each step's logged |G|² and tr(Σ) are the two-point line through |g_1|² and
    |(g_1 + g_2)/2|² of that step's own two sequences, each gradient recomputed alone here.
    Exact up to float32 (1e-4): a parameter left out, a missed weight or a point from the step
    before would show. Whether the estimator is right on average on this model (its sequences
    are heavy-tailed) takes ~10,700 backward passes: bench/noise_brute_bench.py, README."""
    cfg, data, model, opt = frozen_gpt(seed=0)

    def micro(s, j):
        x, y, _ = data.batch(2 * s + j, 1)
        return x, y

    mon, g2, tr = frozen_online(
        model, opt, micro, gpt_loss, b=1, k=2, steps=GPT_STEPS, seq_len=cfg.seq_len
    )
    assert mon.noise.updates == GPT_STEPS
    for s in range(GPT_STEPS):
        grads = []
        for j in range(2):
            model.zero_grad(set_to_none=True)
            gpt_loss(model, *micro(s, j)).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
        one, mean = grads[0].square().sum(), ((grads[0] + grads[1]) / 2).square().sum()
        g2_brute, tr_brute = two_batch_estimates(1, float(one), 2, float(mean))
        assert g2[s] == pytest.approx(g2_brute, rel=1e-4), s
        assert tr[s] == pytest.approx(tr_brute, rel=1e-4), s
        assert abs(tr_brute) > 0.01 * g2_brute  # the premise: no rounding residue (one step's
        # trace estimate may be negative; its mean over steps is not)


def test_the_brute_force_bench_runs():
    """bench/noise_brute_bench.py on a few steps and gradients: the numbers it prints exist."""
    r = online_vs_brute(seed=0, online_steps=12, small_n=12, big_n=3)
    assert r["updates"] == 12
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("online", "brute", "se_online"))


# ------------------------------------------------------------------ 3. growth in a real run

GROWTH_STEPS = 90


@pytest.mark.slow
def test_noise_scale_grows_as_the_loss_falls(tmp_path):
    """The real trainer (a child process), test-tiny at 4 × 4 sequences per step (points at
    4, 8, 12, 16 sequences bracket B_simple from ~0.7 at initialization to ~10-20 once the loss
    has fallen from 5.5 to ~2.2), 90 steps. B_simple of each third is its ratio of summed
    per-step estimates; the windowed value is logged at every step of the last third."""
    db = tmp_path / "runs.duckdb"
    done = run_trainer(
        db,
        tmp_path / "ckpt",
        "--run-id",
        "grow",
        "--steps",
        str(GROWTH_STEPS),
        "--no-plan",
        "--seed",
        "0",
        "--per-device-batch",
        "4",
        "--accum",
        "4",
        "--checkpoint-every",
        "0",
    )
    assert done.returncode == 0, done.stdout
    g2, tr = metric(db, "grow", M.GNS_G2), metric(db, "grow", M.GNS_TRACE)
    gns, loss = metric(db, "grow", M.GNS), metric(db, "grow", M.LOSS)
    third = GROWTH_STEPS // 3

    def b_simple(steps):
        return sum(tr[s] for s in steps) / sum(g2[s] for s in steps)

    first = b_simple(range(1, third + 1))
    last = b_simple(range(GROWTH_STEPS - third + 1, GROWTH_STEPS + 1))
    windowed = [gns.get(s) for s in range(GROWTH_STEPS - third + 1, GROWTH_STEPS + 1)]
    assert sum(v is not None for v in windowed) >= 0.8 * third, windowed
    assert all(v > 0 and math.isfinite(v) for v in windowed if v is not None)
    early_loss = np.median([loss[s] for s in range(1, third + 1)])
    late_loss = np.median([loss[s] for s in range(GROWTH_STEPS - third + 1, GROWTH_STEPS + 1)])
    assert late_loss < early_loss - 0.5, (early_loss, late_loss)  # the premise: it learned
    assert last > 1.5 * first, (first, last)


# ------------------------------------------------------------------ 4. non-finite gradients


def _started(db, model, opt, *, b: int, k: int) -> Monitor:
    return Monitor.start(
        db,
        name="gns-test",
        config={"test": True},
        model=model,
        optimizer=opt,
        per_device_batch=b,
        accum=k,
        seq_len=1,
        noise_window=NoiseScaleWindow(min_steps=3),
    )


def _alerts(db, run_id):
    return reader.events(db, run_id, kinds=[M.EVENT_ALERT])


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_gradient_is_left_out_of_the_window_and_reported(tmp_path, poison):
    db = tmp_path / "runs.duckdb"
    model, x, y, _, _ = _least_squares(n=256, d_in=8, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = _started(db, model, opt, b=8, k=3)
    bad_step = 4
    states, metrics = {}, {}
    for step in range(1, 7):
        for j in range(3):
            i = torch.arange(8) + 8 * (3 * step + j)
            loss = _mse(model, x[i], y[i])
            if step == bad_step and j == 1:  # one poisoned micro-batch, mid-accumulation
                loss = loss * poison
            (loss / 3).backward()
            mon.after_backward()
        metrics[step] = mon.step(step, 0.0)
        states[step] = mon.noise.to_dict()
        model.zero_grad(set_to_none=True)
    mon.finish()

    # the window did not see the bad step: its state is exactly the step before's
    assert states[bad_step] == states[bad_step - 1]
    assert states[bad_step]["updates"] == bad_step - 1 and states[6]["updates"] == 5
    # no new estimate, so no smoothed value either: nothing stale is logged as current
    assert not {M.GNS_G2, M.GNS_TRACE, M.GNS, M.GNS_LOW} & set(metrics[bad_step])
    assert M.GNS in metrics[bad_step - 1] and M.GNS in metrics[bad_step + 1]
    assert math.isfinite(metrics[bad_step + 1][M.GNS_G2])  # and the next step counts again

    # reported: an alert at that step, and the non-finite gradient norm in the store
    alerts = _alerts(db, mon.run_id)
    assert [(a.step, a.data["nonfinite_steps"]) for a in alerts] == [(bad_step, 1)], alerts
    assert "non-finite gradient" in alerts[0].message
    logged = metric(db, mon.run_id, M.GRAD_NORM)
    assert not math.isfinite(logged[bad_step])
    assert sorted(metric(db, mon.run_id, M.GNS_G2)) == [s for s in range(1, 7) if s != bad_step]
    assert sorted(metric(db, mon.run_id, M.GNS)) == [3, 5, 6]  # from the third estimate on


# ------------------------------------------------------------------ 5. accumulation 1


def test_accumulation_1_gives_one_point_and_one_clear_alert(tmp_path):
    from rampwatch.monitor.gradstats import AccumulationStats

    model, x, y, _, _ = _least_squares(n=256, d_in=8, d_out=4)
    stats = AccumulationStats(model.parameters())
    _mse(model, x[:4], y[:4]).backward()
    stats.after_backward()
    one = stats.collect(micro_batch=4)
    assert one.batch_sizes == [4] and len(one.sq_norms) == 1 and one.finite
    model.zero_grad(set_to_none=True)

    db = tmp_path / "runs.duckdb"
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = _started(db, model, opt, b=4, k=1)
    for step in range(1, 6):
        i = torch.arange(4) + 4 * step
        _mse(model, x[i], y[i]).backward()
        mon.after_backward()
        m = mon.step(step, 0.0)
        model.zero_grad(set_to_none=True)
        assert not {M.GNS_G2, M.GNS_TRACE, M.GNS, M.GNS_TOKENS, M.GNS_LOW} & set(m), m
    mon.finish()
    alerts = _alerts(db, mon.run_id)
    assert len(alerts) == 1 and alerts[0].step == 1, alerts  # said once, at the first step
    assert alerts[0].message.startswith("noise scale not measured: accumulation 1 on one device")
    assert "--split-micro" in alerts[0].message and "accumulation ≥ 2" in alerts[0].message
    # each host's own setting: a Lightning or Hugging Face user has no --split-micro
    assert "accumulate_grad_batches" in alerts[0].message
    assert "gradient_accumulation_steps" in alerts[0].message


def test_accumulation_2_or_split_micro_has_no_such_alert(tmp_path):
    from rampwatch.cli import build_parser
    from rampwatch.trainer.cli import resolve_defaults

    args = resolve_defaults(
        build_parser().parse_args(
            [
                "train",
                "--preset",
                "test-tiny",
                "--per-device-batch",
                "8",
                "--accum",
                "1",
                "--split-micro",
            ]
        )
    )
    assert (args.per_device_batch, args.accum) == (4, 2)  # two half micro-batches

    db = tmp_path / "runs.duckdb"
    model, x, y, _, _ = _least_squares(n=256, d_in=8, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = _started(db, model, opt, b=4, k=2)
    for step in range(1, 4):
        for j in range(2):
            i = torch.arange(4) + 4 * (2 * step + j)
            (_mse(model, x[i], y[i]) / 2).backward()
            mon.after_backward()
        m = mon.step(step, 0.0)
        model.zero_grad(set_to_none=True)
        assert M.GNS_G2 in m and M.GNS_TRACE in m
    mon.finish()
    assert _alerts(db, mon.run_id) == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_monitor_works_in_every_dtype(tmp_path, dtype):
    """A float64 model used to crash the loop inside after_backward (foreach_norm refused to
    narrow double); every dtype now gives the same |G|² as float64 (to its precision)."""
    results = {}
    for dt in (torch.float64, dtype):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(dt)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        mon = _started(tmp_path / f"{dt}.duckdb", model, opt, b=4, k=2)
        g = torch.Generator().manual_seed(1)
        for step in range(1, 4):
            for _ in range(2):
                x = torch.randn(4, 8, generator=g).to(dt)
                (model(x).square().mean() / 2).backward()
                mon.after_backward()
            m = mon.step(step, loss=0.0)
            opt.zero_grad(set_to_none=True)
        mon.finish()
        results[dt] = m
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    assert results[dtype][M.GRAD_NORM] == pytest.approx(
        results[torch.float64][M.GRAD_NORM], rel=tol
    )
    assert results[dtype][M.GNS_G2] == pytest.approx(results[torch.float64][M.GNS_G2], rel=tol * 4)


def test_monitor_with_float16_autocast_and_grad_scaler(tmp_path):
    """float16 autocast with a GradScaler: pass the scale, get the unscaled norm."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = _started(tmp_path / "fp16.duckdb", model, opt, b=4, k=2)
    x = torch.randn(2, 4, 8)
    for j in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x[j]).float().square().mean() / 2
        scaler.scale(loss).backward()
        mon.after_backward()
    m = mon.step(1, loss=0.0, grad_scale=scaler.get_scale())
    mon.finish()
    plain = torch.nn.Linear(8, 4)
    plain.load_state_dict(model.state_dict())
    for j in range(2):
        (plain(x[j]).square().mean() / 2).backward()
    want = torch.sqrt(sum(p.grad.double().square().sum() for p in plain.parameters()))
    assert m[M.GRAD_NORM] == pytest.approx(float(want), rel=2e-2)
