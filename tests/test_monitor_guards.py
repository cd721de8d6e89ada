"""The monitor in loops it does not control: micro-batches weighted by their token counts (the
Hugging Face Trainer's num_items_in_batch), sharded gradients (FSDP2, in a real process group),
and an error inside the monitor, which must never reach the training loop."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from rampwatch import Monitor, store
from rampwatch.monitor.gradstats import AccumulationStats
from rampwatch.store import names as M
from tests.procs import REPO, child_env, free_port


def _per_example_losses(model, x, y):
    return (model(x) - y).square().mean(dim=1)


def test_token_weighted_micro_batches_give_the_weighted_mean_gradients():
    """Each micro-batch's summed loss divided by the step's total count N (HF's
    num_items_in_batch): the point after micro-batch j must be |mean gradient over the first T_j
    examples|², at a batch size of T_j/N of the step's sequences."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).double()
    sizes = [3, 8, 5, 16]  # unequal micro-batches: padding, masked labels
    n, b, k = sum(sizes), 8, len(sizes)
    x, y = torch.randn(n, 6, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
    stats = AccumulationStats(model.parameters())
    start = 0
    for size in sizes:
        losses = _per_example_losses(model, x[start : start + size], y[start : start + size])
        (losses.sum() / n).backward()
        stats.after_backward(weight=size / n)
        start += size
    got = stats.collect(b)
    expected, seen = [], 0
    for size in sizes:  # brute force: the gradient of the mean loss over the first T_j examples
        seen += size
        model.zero_grad()
        _per_example_losses(model, x[:seen], y[:seen]).mean().backward()
        expected.append(sum(float(p.grad.square().sum()) for p in model.parameters()))
    assert got.sq_norms == pytest.approx(expected, rel=1e-12)
    assert got.batch_sizes == pytest.approx([b * k * t / n for t in (3, 11, 16, 32)])


def test_equal_weights_are_the_default_path():
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2).double()
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    results = []
    for weight in (None, 1 / 3):
        stats = AccumulationStats(model.parameters())
        for j in range(3):
            (
                _per_example_losses(model, x[4 * j : 4 * j + 4], y[4 * j : 4 * j + 4]).mean() / 3
            ).backward()
            stats.after_backward(weight=weight)
        results.append(stats.collect(4))
        model.zero_grad()
    assert results[0].sq_norms == pytest.approx(results[1].sq_norms, rel=1e-12)
    assert results[0].batch_sizes == pytest.approx(results[1].batch_sizes)


def test_an_error_inside_the_monitor_never_reaches_the_loop(tmp_path):
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor.start(
        db,
        name="guarded",
        config={},
        model=model,
        optimizer=opt,
        per_device_batch=2,
        accum=2,
        seq_len=1,
    )
    assert mon.step(1, loss=1.0) == {}  # no backward before it: the monitor's error, said once
    assert mon.step(2, loss=1.0) == {}
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        mon.after_backward()
    assert M.GNS_G2 in mon.step(3, loss=0.5)  # and the next proper step is measured
    mon.finish()
    alerts = store.events(db, mon.run_id, kinds=[M.EVENT_ALERT])
    assert len(alerts) == 1 and "training goes on without it" in alerts[0].message
    assert "collect() called before any backward" in alerts[0].message


FSDP_CHILD = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rampwatch import Monitor
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = Monitor.start(sys.argv[1], name="fsdp", config={}, model=model, optimizer=opt,
                    per_device_batch=4, accum=2, seq_len=1)
for step in range(1, 4):
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        (loss / 2).backward()
        mon.after_backward()
    mon.step(step, loss=loss.detach())
    opt.step()
    opt.zero_grad()
mon.finish()
dist.destroy_process_group()
"""


def test_sharded_gradients_are_said_not_measured(tmp_path):
    db = tmp_path / "runs.duckdb"
    env = child_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FSDP_CHILD), str(db)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    [run] = store.list_runs(db)
    names = set(store.metric_names(db, run.run_id))
    assert {M.LOSS, M.MEM_PEAK, M.ACCUM} <= names
    assert not names & {M.GNS_G2, M.GNS, M.GRAD_NORM}  # a shard's norm is not the gradient's
    [alert] = store.events(db, run.run_id, kinds=[M.EVENT_ALERT])
    assert alert.message.startswith("noise scale not measured: sharded gradients")
