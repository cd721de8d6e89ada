"""monitor/memplan.py and monitor/memprobe.py: the memory plan of a model that is not the GPT
(tests/plan_models.py), in real child processes: its breakdown, its slope against the measured
probe, the models fake tensors cannot follow (an error row naming the probe), setups that cannot
be imported, a setup in the running script, and the probe stopping at the first out-of-memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.memplan_bench import slope
from rampwatch import Monitor, store
from rampwatch.monitor.memplan import COMPONENTS, plan_in_process, probe, start_plan
from rampwatch.store import names as M
from tests import plan_models
from tests.procs import REPO, child_env, wait_until

SETUP = "tests.plan_models:setup_mlp"
BATCHES = [256, 512, 1024]
HAS_VMHWM = os.access("/proc/self/clear_refs", os.W_OK)


@pytest.fixture(scope="module")
def plan_and_probe():
    """The plan in its child while the probe measures in another: (plan rows, probe rows)."""
    handle = start_plan(SETUP, BATCHES)
    measured = probe(SETUP, BATCHES) if HAS_VMHWM else None
    return handle.result(timeout=180), measured


def test_plan_of_any_model_breaks_down_and_grows_linearly(plan_and_probe):
    rows, _ = plan_and_probe
    assert [r["error"] for r in rows] == [None] * len(BATCHES)
    assert [r["per_device_batch"] for r in rows] == BATCHES
    n = sum(p.numel() for p in plan_models.mlp().parameters())
    peaks = [r["predicted_bytes"] for r in rows]
    acts = [r["breakdown"]["activations"] for r in rows]
    assert peaks[0] < peaks[1] < peaks[2]
    # Each batch is twice the last: activations (and so the peak) grow by twice as much.
    assert acts[2] - acts[1] == pytest.approx(2 * (acts[1] - acts[0]), rel=0.02)
    assert peaks[2] - peaks[1] == pytest.approx(2 * (peaks[1] - peaks[0]), rel=0.02)
    for r in rows:
        bd = r["breakdown"]
        assert tuple(bd) == COMPONENTS  # no loss head traced: no "logits"
        assert sum(bd.values()) == r["predicted_bytes"]  # taken at one moment: exact
        assert bd["parameters"] == 4 * n
        assert 8 * n <= bd["optimizer"] < 8 * n + 1024  # AdamW's two moments (+ step scalars)
        assert r["peak_phase"] in ("forward", "backward", "optimizer")
        assert r["source"] == "plan" and r["device_type"] == "cpu"
    # The child plans exactly what this process does with the function itself.
    here = plan_in_process(plan_models.setup_mlp, BATCHES)
    assert [r["breakdown"] for r in here] == [r["breakdown"] for r in rows]


def test_accumulation_keeps_gradients_although_train_step_zeroes_them():
    one, acc = (plan_in_process(SETUP, [256], accum_steps=k)[0] for k in (1, 4))
    n = sum(p.numel() for p in plan_models.mlp().parameters())
    assert acc["error"] is None and acc["breakdown"]["gradients"] == 4 * n
    assert acc["predicted_bytes"] > one["predicted_bytes"]


@pytest.mark.skipif(not HAS_VMHWM, reason="the CPU probe reads Linux's VmHWM")
def test_plan_slope_matches_the_measured_probe(plan_and_probe):
    rows, measured = plan_and_probe
    assert [r["feasible"] for r in measured] == [True] * len(BATCHES)
    assert all(r["source"] == "probe" and r["error"] is None for r in measured)
    peaks = [r["measured_bytes"] for r in measured]
    assert peaks[0] < peaks[1] < peaks[2]
    # What one step adds on top of what lives between steps, planned and measured.
    planned = {r["per_device_batch"]: r["predicted_bytes"] - r["steady_bytes"] for r in rows}
    real = {r["per_device_batch"]: r["measured_bytes"] - r["steady_bytes"] for r in measured}
    assert slope(planned) == pytest.approx(slope(real), rel=0.10)  # measured: ~1%
    for b in BATCHES:
        assert planned[b] == pytest.approx(real[b], rel=0.15)


@pytest.mark.parametrize(
    "name, op",
    [
        ("setup_gated", "aten._local_scalar_dense"),  # .item()
        ("setup_routed", "aten.nonzero"),
    ],
)
def test_what_fake_tensors_cannot_follow_is_an_error_row_naming_the_probe(name, op):
    rows = plan_in_process(f"tests.plan_models:{name}", [2, 4])
    assert [r["predicted_bytes"] for r in rows] == [None, None]
    for r in rows:
        assert "fake tensors cannot run this model" in r["error"] and op in r["error"]
        assert "probe(setup, batches)" in r["error"]


@pytest.mark.skipif(not HAS_VMHWM, reason="the CPU probe reads Linux's VmHWM")
def test_the_probe_measures_what_the_plan_cannot():
    rows = probe("tests.plan_models:setup_gated", [64, 512])
    assert [r["feasible"] for r in rows] == [True, True], rows
    assert rows[0]["measured_bytes"] < rows[1]["measured_bytes"]


@pytest.mark.skipif(not HAS_VMHWM, reason="the CPU probe reads Linux's VmHWM")
def test_the_probe_stops_at_the_first_out_of_memory():
    rows = probe(plan_models.setup_blowup, [16, 2, 8, 4])  # probed ascending
    assert [r["per_device_batch"] for r in rows] == [2, 4, 8]  # nothing after the OOM
    assert [r["feasible"] for r in rows] == [True, True, False]
    assert "out of memory at per-device batch 8" in rows[2]["error"]
    assert rows[2]["measured_bytes"] is None


def test_a_setup_that_cannot_be_imported_is_an_error_row_not_an_exception():
    handle = start_plan("tests.plan_models:no_such_setup", [1, 2])
    rows = handle.result(timeout=120)
    assert handle.pid is not None and [r["per_device_batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["predicted_bytes"] is None
        assert "cannot import setup" in r["error"] and "no_such_setup" in r["error"]
    # What cannot cross a process boundary never starts a child.
    for bad in (lambda b: None, "no colon", plan_models.Gated().forward):
        h = start_plan(bad, [1])
        assert h.pid is None and h.done()
        assert "ValueError" in h.result()[0]["error"]
    rows = plan_in_process("no_such_package.models:setup", [1])
    assert "No module named 'no_such_package'" in rows[0]["error"]
    rows = probe("no_such_package.models:setup", [1, 2])
    assert [r["feasible"] for r in rows] == [None, None]
    assert all("cannot import setup" in r["error"] for r in rows)


SCRIPT = """
import json, os, sys
import torch
from rampwatch.monitor.memplan import start_plan

def step(model, opt, batch):
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    opt.step()

def setup(b):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), (torch.randn(b, 32), torch.randn(b, 1)), step

if __name__ == "__main__":
    open(os.path.join(sys.argv[1], f"ran-{os.getpid()}"), "w").close()
    print(json.dumps(start_plan(setup, [4, 8]).result(timeout=120)))
"""


def test_a_setup_in_the_running_script_plans_without_rerunning_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=tmp_path,
        env=child_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["error"] for r in rows] == [None, None]
    assert rows[0]["predicted_bytes"] < rows[1]["predicted_bytes"]
    assert len(list(tmp_path.glob("ran-*"))) == 1  # the child loaded it, guarded block not run


def test_a_loops_monitor_plans_its_model_and_the_card_gets_the_rows(tmp_path):
    """Monitor.plan_memory: the plan runs in a child while the loop goes on, and its rows reach
    the store at a later ramp_due(); a model fake tensors cannot run raises an alert naming the
    probe, and probe_memory() then measures it."""
    db = tmp_path / "runs.duckdb"
    model = plan_models.mlp()
    mon = Monitor.start(
        db,
        name="planned",
        config={},
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        per_device_batch=8,
        accum=2,
        seq_len=1,
    )
    mon.plan_memory(plan_models.setup_mlp, [4, 8, 16])

    def plan_in() -> bool:
        mon.ramp_due()
        return not mon.ramps.plan_pending

    wait_until(plan_in, timeout=120)
    mon.plan_memory("tests.plan_models:setup_gated", [8])
    wait_until(plan_in, timeout=120)
    probed = mon.probe_memory(plan_models.setup_gated, [2, 4])
    mon.finish()
    rows = store.memory_plan(db, mon.run_id)
    planned = {
        r.per_device_batch: r.predicted_bytes
        for r in rows
        if r.source == "plan" and r.predicted_bytes
    }
    assert sorted(planned) == [4, 8, 16] and planned[4] < planned[8] < planned[16]
    [alert] = store.events(db, mon.run_id, kinds=[M.EVENT_ALERT])
    assert "memory plan failed at per-device batch 8" in alert.message and "probe" in alert.message
    assert [r["per_device_batch"] for r in probed] == [2, 4]
    assert {r.per_device_batch for r in rows if r.source == "probe" and r.measured_bytes} == {2, 4}
