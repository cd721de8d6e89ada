"""The noise scale under FSDP2 (fully_shard) against DDP's, two gloo ranks on the CPU.

One torchrun of tests/fsdp_child.py trains the same tiny model on the same data once per
wrapping, each a run of one real database. Shown: accumulating without sync (sync only at the
last micro-step) logs per step the |G|², tr(Σ), B_simple, gradient norm and loss that DDP logs;
so does ZeroRedundancyOptimizer over DDP; syncing every micro-step (FSDP2's default) logs the
line through its own points (single micro-batches and global running sums) by brute force, and
DDP's values at accumulation 1; a torch.compile'd FSDP2 model is measured the same way, and
so is one in bfloat16 that reduces in float32; on frozen weights both agree with DDP in
expectation, each within 3 standard errors of the true |G|² and tr(Σ) over 400 steps; one
reducing in float64 (which FSDP2 divides
first) is said not measured; a loop without after_backward() still logs the global norm; a
loop whose optimizer reduce-scatters in step() (nanochat's) and hands its shards to
mon.reduced_grad logs what DDP logs.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rampwatch import store
from rampwatch.store import names as M
from tests.procs import run_torchrun

RUNS = [
    "ddp:3",
    "fsdp-nosync:3",
    "zero:3",
    "fsdp-sync:3",
    "ddp:1",
    "fsdp-sync:1",
    "fsdp-sync:2:compile",
    "fsdp-nosync:3:bf16",
    "fsdp-sync:1:f64",  # said not measured
    "fsdp-sync:2:no-after-backward",
    "nanochat:3",
    "ddp:3:frozen",
    "fsdp-sync:3:frozen",
]
PER_STEP = (M.GNS_G2, M.GNS_TRACE, M.GNS_RAW, M.GNS, M.GRAD_NORM, M.LOSS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(database, {run name: {metric: {step: value}}}, {(run name, step): brute-force points},
    {frozen run name: its weights' true (|G|², tr(Σ))})."""
    db = tmp_path_factory.mktemp("fsdp") / "runs.duckdb"
    done = run_torchrun("-m", "tests.fsdp_child", str(db), *RUNS, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    points, truth = {}, {}
    for line in done.stdout.splitlines():
        if line.startswith("POINTS "):
            _, spec, step, rest = line.split(" ", 3)
            points[spec, int(step)] = json.loads(rest)
        elif line.startswith("TRUTH "):
            _, spec, g2, trace = line.split()
            truth[spec] = float(g2), float(trace)
    logged = {run.name: _per_step(db, run.run_id) for run in store.list_runs(db)}
    return db, logged, points, truth


def _per_step(db, run_id: str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of one run's PER_STEP metrics, from its raw rows."""
    rows = store.export(db, run_id).to_pylist()
    out: dict[str, dict[int, float]] = {name: {} for name in PER_STEP}
    for row in rows:
        if row["name"] in out:
            assert row["step"] not in out[row["name"]], "a step logged twice"
            out[row["name"]][row["step"]] = row["value"]
    return out


def _logged(runs, name: str) -> dict[str, dict[int, float]]:
    return runs[1][name]


def _same(got: dict, want: dict, scale: float) -> None:
    """Each metric on the same steps and within float32 tolerance: |G|² is a small difference
    of the points, so its tolerance is the points' scale."""
    for name in PER_STEP:
        assert sorted(got[name]) == sorted(want[name]), name
        for step, value in want[name].items():
            tol = dict(abs=1e-5 * scale) if name == M.GNS_G2 else dict(rel=2e-5)
            assert got[name][step] == pytest.approx(value, **tol), (name, step)


def _fit(points) -> tuple[float, float]:
    """(|G|², tr(Σ)): least squares of |g_B|² on 1/B (McCandlish et al. 2018, App. A)."""
    sizes, sq = np.array(points, dtype=np.float64).T
    slope, intercept = np.polyfit(1.0 / sizes, sq, 1)
    return intercept, slope


def _matches_brute_force(runs, name: str, rel: float = 1e-4) -> None:
    """The logged |G|², tr(Σ) and gradient norm of every step are the fit through the points
    recomputed by hand (float64, from the same weights): rel is float32's tolerance."""
    points = runs[2]
    logged = _logged(runs, name)
    assert sorted(logged[M.GNS_G2]) == [1, 2, 3, 4]
    for step in logged[M.GNS_G2]:
        pts = points[name, step]
        g2, trace = _fit(pts)
        scale = max(v for _, v in pts)
        assert logged[M.GNS_TRACE][step] == pytest.approx(trace, rel=rel), (name, step)
        assert logged[M.GNS_G2][step] == pytest.approx(g2, abs=rel / 10 * scale), (name, step)
        # the gradient norm: the global point of the whole step, |.grad| of every rank's batch
        assert logged[M.GRAD_NORM][step] == pytest.approx(math.sqrt(pts[-1][1]), rel=rel / 10)


def _scale(runs, name: str) -> float:
    return max(v for (spec, _), pts in runs[2].items() if spec == name for _, v in pts)


def test_fsdp2_accumulating_without_sync_logs_what_ddp_logs(runs):
    """set_requires_gradient_sync(False) before the last micro-step: the local running sums,
    the local full gradient FSDP2 reduce-scatters and the global point from the summed shard
    norms are DDP's points, so every step's figures are DDP's; and both are the line through
    the points recomputed by hand."""
    _matches_brute_force(runs, "ddp:3")
    _same(_logged(runs, "fsdp-nosync:3"), _logged(runs, "ddp:3"), _scale(runs, "ddp:3"))
    assert _logged(runs, "ddp:3")[M.GNS], "B_simple: no windowed value to compare"


def test_zero_redundancy_optimizer_over_ddp_logs_what_ddp_logs(runs):
    """ZeroRedundancyOptimizer shards the optimizer state only: .grad stays whole under DDP."""
    _same(_logged(runs, "zero:3"), _logged(runs, "ddp:3"), _scale(runs, "ddp:3"))


def test_a_loop_that_reduce_scatters_in_its_optimizer_logs_what_ddp_logs(runs):
    """nanochat's structure, no DDP: the local running sums after each backward and the shard
    norms of the averaged gradient its optimizer hands to mon.reduced_grad are DDP's points."""
    _same(_logged(runs, "nanochat:3"), _logged(runs, "ddp:3"), _scale(runs, "ddp:3"))


def test_fsdp2_syncing_every_micro_step_fits_its_own_points(runs):
    """FSDP2's default accumulation: the points are each rank's single micro-batches (batch 16,
    rank averages) and the global running sums (32, 64, 96), recomputed by hand from a plain
    copy of the weights; not DDP's points, so not DDP's values step by step."""
    _matches_brute_force(runs, "fsdp-sync:3")
    sizes = sorted(b for b, _ in runs[2]["fsdp-sync:3", 1])
    assert sizes == [16, 16, 16, 32, 64, 96]
    sync, ddp = _logged(runs, "fsdp-sync:3"), _logged(runs, "ddp:3")
    assert sync[M.GRAD_NORM] == pytest.approx(ddp[M.GRAD_NORM], rel=1e-5)  # the same gradient
    assert sync[M.GNS_TRACE] != pytest.approx(ddp[M.GNS_TRACE], rel=1e-2)  # other points


def test_fsdp2_syncing_every_micro_step_agrees_with_ddp_in_expectation(runs):
    """Frozen weights, 400 steps of fresh data, accumulation 3: the per-step |G|² and tr(Σ)
    under FSDP2's default and under DDP, each averaged over the steps, are within 3 standard
    errors of the true values at those weights (per-example gradients of 200,000 other
    examples). Each setup's points are other batch sizes with other noise, unbiased alike."""
    for name in ("ddp:3:frozen", "fsdp-sync:3:frozen"):
        logged = _logged(runs, name)
        for metric, true in zip((M.GNS_G2, M.GNS_TRACE), runs[3][name], strict=True):
            values = np.array(list(logged[metric].values()))
            assert len(values) == 400, (name, metric)
            se = values.std(ddof=1) / math.sqrt(len(values))
            assert abs(values.mean() - true) < 3 * se, (name, metric, values.mean(), true, se)


def test_fsdp2_syncing_every_micro_step_at_accumulation_1_logs_what_ddp_logs(runs):
    _matches_brute_force(runs, "ddp:1")
    _same(_logged(runs, "fsdp-sync:1"), _logged(runs, "ddp:1"), _scale(runs, "ddp:1"))
    assert _logged(runs, "ddp:1")[M.GNS], "B_simple: no windowed value to compare"


def test_a_compiled_fsdp2_model_is_measured(runs):
    """torch.compile's wrapper hides the FSDPModules from type checks, not from modules()."""
    _matches_brute_force(runs, "fsdp-sync:2:compile")


def test_fsdp2_in_bfloat16_reducing_in_float32_reads_its_float32_accumulated_gradients(runs):
    """MixedPrecisionPolicy(bfloat16, float32): without sync FSDP2 accumulates the local
    gradients in a float32 copy of its own; the fit stays within bfloat16's error of the
    float64 recomputation (a copy missed or counted twice is off by far more)."""
    _matches_brute_force(runs, "fsdp-nosync:3:bf16", rel=3e-2)


def test_no_measured_run_has_an_alert(runs):
    db = runs[0]
    names = {run.run_id: run.name for run in store.list_runs(db)}
    assert sorted(names.values()) == sorted(RUNS)
    for run_id, name in names.items():
        if name not in ("fsdp-sync:1:f64", "fsdp-sync:2:no-after-backward"):
            assert not store.events(db, run_id, kinds=[M.EVENT_ALERT]), name


def test_fsdp2_reducing_in_float64_is_said_not_measured(runs):
    """FSDP2 divides a float64 (or float16) reduce-scatter's input before the op: its norm is
    not the local gradient's, so the run gets the alert and no noise scale, not a wrong one."""
    db = runs[0]
    [run_id] = [run.run_id for run in store.list_runs(db) if run.name == "fsdp-sync:1:f64"]
    logged = _logged(runs, "fsdp-sync:1:f64")
    assert sorted(logged[M.LOSS]) == [1, 2, 3, 4]
    assert not logged[M.GNS_G2] and not logged[M.GRAD_NORM]
    [alert] = store.events(db, run_id, kinds=[M.EVENT_ALERT])
    assert alert.message.startswith(
        "noise scale not measured: sharded gradients: FSDP2 reduces in a dtype it divides"
    ), alert.message


def test_fsdp2_without_after_backward_still_logs_the_global_gradient_norm(runs):
    """Never told of a backward, the monitor reads the shards at step(): the global norm."""
    db = runs[0]
    name = "fsdp-sync:2:no-after-backward"
    logged = _logged(runs, name)
    assert not logged[M.GNS_G2]
    assert sorted(logged[M.GRAD_NORM]) == [1, 2, 3, 4]
    for step, norm in logged[M.GRAD_NORM].items():
        assert norm == pytest.approx(math.sqrt(runs[2][name, step][-1][1]), rel=1e-5)
    [run_id] = [run.run_id for run in store.list_runs(db) if run.name == name]
    [alert] = store.events(db, run_id, kinds=[M.EVENT_ALERT])
    assert alert.message.startswith("mon.after_backward() was not called"), alert.message
