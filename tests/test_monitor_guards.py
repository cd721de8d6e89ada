"""The monitor in loops it does not control: micro-batches weighted by their token counts (the
Hugging Face Trainer's num_items_in_batch), FSDP2 on one process (measured; HSDP said not measured),
an error inside the monitor, which must never reach the training loop, and a loop that calls the
monitor wrongly (no after_backward(), step() twice): all it can still logged, the mistake named."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow.compute as pc
import pytest
import torch

from rampwatch import Monitor, store
from rampwatch.monitor.gradstats import AccumulationStats
from rampwatch.store import names as M
from tests.procs import REPO, child_env, free_port, run_torchrun
from tests.trainer_runs import metric


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


def _started(db, model, opt) -> Monitor:
    return Monitor.start(
        db,
        name="own-loop",
        config={},
        model=model,
        optimizer=opt,
        per_device_batch=4,
        accum=2,
        seq_len=8,
    )


def _backwards(model, mon: Monitor | None) -> torch.Tensor:
    """One step's two micro-batches; mon.after_backward() after each unless mon is None."""
    for _ in range(2):
        loss = model(torch.randn(4, 6)).square().mean()
        (loss / 2).backward()
        if mon is not None:
            mon.after_backward()
    return loss.detach()


def _alerts(db, run_id):
    return store.events(db, run_id, kinds=[M.EVENT_ALERT])


def test_an_error_inside_the_monitor_never_reaches_the_loop(tmp_path):
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 1)
    mon = _started(db, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in (1, 2):  # per-example losses where one number belongs: the monitor fails
        _backwards(model, mon)
        assert mon.step(step, loss=torch.ones(3)) == {}
        model.zero_grad()
    _backwards(model, mon)
    assert M.GNS_G2 in mon.step(3, loss=0.5)  # and the next proper step is measured
    mon.finish()
    [alert] = _alerts(db, mon.run_id)  # said once
    assert alert.message.startswith("rampwatch could not take this step's telemetry in step")
    assert "training goes on without it" in alert.message


def _three_steps(tmp_path):
    """A monitor after three plain steps of a small model: (its database, model, monitor)."""
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = _started(db, model, opt)
    for step in (1, 2, 3):
        mon.step(step, loss=_backwards(model, mon))
        opt.step()
        opt.zero_grad()
    return db, model, mon


def _step_4_peak_is_its_own(db, mon) -> None:
    mon.finish()
    peaks = metric(db, mon.run_id, M.MEM_PEAK)
    assert peaks[4] < max(peaks[s] for s in (1, 2, 3)) + 100e6, peaks


def test_a_step_redone_after_an_out_of_memory_logs_its_own_peak(tmp_path):
    """The attempt that ran out of memory (here: 400 MB, then the error) is no peak of the
    smaller tier the step is redone at: its measured memory row would say that tier is as large."""
    db, model, mon = _three_steps(tmp_path)
    torch.ones(100_000_000).add_(1)  # step 4's attempt at per-device batch 4, then
    mon.report_oom(4, step=3, message="injected")  # the loop's out-of-memory handler
    mon.set_tier(2, 4)  # the step redone at half the per-device batch
    mon.step(4, loss=_backwards(model, mon))
    _step_4_peak_is_its_own(db, mon)


def test_work_left_out_of_step_time_is_left_out_of_the_next_steps_peak(tmp_path):
    """Validation inside untimed() (here: 400 MB) is no peak of the training step after it:
    that step's row is the running tier's measured memory, read by the tier table."""
    db, model, mon = _three_steps(tmp_path)
    with mon.untimed():  # the loop's evaluation between steps 3 and 4
        torch.ones(100_000_000).add_(1)
    mon.step(4, loss=_backwards(model, mon))
    _step_4_peak_is_its_own(db, mon)


GNS_NAMES = {M.GNS_G2, M.GNS_TRACE, M.GNS_RAW, M.GNS, M.GNS_TOKENS, M.GNS_LOW, M.GNS_HIGH}
NO_AFTER_BACKWARD = (
    "mon.after_backward() was not called after each backward: the noise scale needs it; "
    "everything else is logged"
)


def test_a_loop_without_after_backward_logs_everything_but_the_noise_scale(tmp_path, capfd):
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    steps, norms = list(range(1, 6)), {}
    for step in steps:
        loss = _backwards(model, None)  # the loop forgets mon.after_backward()
        assert mon.step(step, loss=loss)
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    mon.finish()
    for name in (M.LOSS, M.LR, M.GRAD_NORM, M.TOKENS_SEEN, M.BATCH_TOKENS, M.MEM_PEAK):
        assert sorted(metric(db, mon.run_id, name)) == steps, name
    for name in (M.STEP_TIME, M.TOKENS_PER_S):  # from the second step, as in any run
        assert sorted(metric(db, mon.run_id, name)) == steps[1:], name
    assert metric(db, mon.run_id, M.TOKENS_SEEN) == {s: s * 4 * 2 * 8 for s in steps}
    assert metric(db, mon.run_id, M.GRAD_NORM) == pytest.approx(norms, rel=1e-5)  # clip's norm
    assert not GNS_NAMES & set(store.metric_names(db, mon.run_id))
    [alert] = _alerts(db, mon.run_id)
    assert alert.step == 1 and alert.message.startswith(NO_AFTER_BACKWARD), alert.message
    assert "call mon.after_backward() right after each micro-batch's loss.backward()" in (
        alert.message
    )
    err = capfd.readouterr().err  # printed once, though the loop passed no echo
    assert err.count(NO_AFTER_BACKWARD) == 1, err


def test_after_backward_after_zero_grad_is_said_as_the_loops_order_not_sharding(tmp_path, capfd):
    """mon.after_backward() once the optimizer has cleared .grad finds no gradient, as ZeRO-2/3
    would leave it: the alert names the call's place first (it was "sharded gradients:
    ... ZeRO-2/3", which misled a loop that uses neither), is printed to the loop's author,
    and the rest of each step is still logged."""
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    for step in range(1, 4):
        loss = _backwards(model, None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.after_backward()  # too late: .grad is gone
        mon.step(step, loss=loss)
    mon.finish()
    assert sorted(metric(db, mon.run_id, M.LOSS)) == [1, 2, 3]
    assert not GNS_NAMES & set(store.metric_names(db, mon.run_id))
    [alert] = _alerts(db, mon.run_id)
    assert "sharded gradients" not in alert.message, alert.message
    assert "mon.after_backward() found no .grad" in alert.message
    assert "right after each loss.backward(), before the optimizer's step() and zero_grad()" in (
        alert.message
    )
    assert "found no .grad" in capfd.readouterr().err


def test_a_loss_that_requires_grad_is_read_without_a_warning(tmp_path, recwarn):
    model = torch.nn.Linear(6, 3)
    mon = _started(tmp_path / "runs.duckdb", model, torch.optim.AdamW(model.parameters()))
    loss = model(torch.randn(4, 6)).square().mean()
    loss.backward()
    mon.after_backward()
    assert mon.step(1, loss=loss)[M.LOSS] == loss.item()
    mon.finish()
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]


def test_steps_that_start_again_each_epoch_are_said_once(tmp_path, capfd):
    """A loop that passes its batch index (1, 2, 3, then 1, 2, 3 in the next epoch) gets one
    alert naming that mistake; every step is still logged."""
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    for _epoch in range(2):
        for i in (1, 2, 3):
            assert mon.step(i, loss=_backwards(model, mon))
            opt.step()
            opt.zero_grad()
    mon.finish()
    assert len(store.export(db, mon.run_id).filter(pc.equal(pc.field("name"), M.LOSS))) == 6
    [alert] = _alerts(db, mon.run_id)
    assert alert.step == 1 and alert.message.startswith("mon.step(1) came after mon.step(3)")
    assert capfd.readouterr().err.count("came after") == 1


def test_an_extra_value_that_is_not_a_number_loses_nothing_else(tmp_path, capfd):
    """mon.step(..., extra={"note": "hi"}) failed the whole step's telemetry (float("hi")):
    the step logged nothing. Now that key alone is left out and said to the loop's author; so is
    a key that would replace one the monitor measured (extra={"loss": ...} replaced the loss)."""
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    for step in (1, 2):
        loss = _backwards(model, mon)
        extra = {"note": "hi", "tok_acc": torch.tensor(0.5), M.LOSS: 99.0}
        logged = mon.step(step, loss=loss, extra=extra)
        assert logged[M.LOSS] == float(loss) and logged["tok_acc"] == 0.5 and "note" not in logged
        opt.step()
        opt.zero_grad()
    mon.finish()
    assert metric(db, mon.run_id, "tok_acc") == {1: 0.5, 2: 0.5}
    assert sorted(metric(db, mon.run_id, M.GRAD_NORM)) == [1, 2]
    assert 99.0 not in metric(db, mon.run_id, M.LOSS).values()
    note, loss_alert = sorted(_alerts(db, mon.run_id), key=lambda a: a.message, reverse=True)
    assert "extra['note'] is not a number ('hi')" in note.message, note.message
    assert "extra['loss'] would replace the monitor's own 'loss'" in loss_alert.message
    err = capfd.readouterr().err
    assert err.count("extra['note']") == 1 and err.count("extra['loss']") == 1


def test_an_extra_value_without_a_name_is_said_and_left_out(tmp_path, capfd):
    """extra={"": 1.0} was stored under an empty name, a chart with no title."""
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    logged = mon.step(1, loss=_backwards(model, mon), extra={"": 1.0, " ": 2.0, 3: 3.0, "ok": 4})
    assert logged["ok"] == 4 and not {"", " ", 3} & set(logged)
    mon.finish()
    names = set(store.export(db, mon.run_id).column("name").to_pylist())
    assert "ok" in names and not {"", " ", "3"} & names
    said = sorted(a.message.split(": ", 1)[1] for a in _alerts(db, mon.run_id))
    assert [m.split(". ")[0] for m in said] == [
        "extra[' '] is left out: the name is empty",
        "extra[''] is left out: the name is empty",
        "extra[3] is left out: the name is not a str",
    ]
    assert capfd.readouterr().err.count("left out") == 3


@pytest.mark.parametrize("bad", ["2", 2.0, -1, torch.tensor(True)])
def test_a_step_that_is_not_a_step_count_is_said_and_never_raised(tmp_path, capfd, bad):
    """mon.step("2", ...) raised a ValueError into the loop: the guard that words a failure as
    an alert wrote that alert at the same bad step, which the store refused."""
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    assert mon.step(1, loss=_backwards(model, mon))
    opt.step()
    assert mon.step(bad, loss=_backwards(model, mon)) == {}
    assert mon.step(2, loss=_backwards(model, mon))  # the next good step is logged as ever
    mon.finish()
    assert sorted(metric(db, mon.run_id, M.LOSS)) == [1, 2]
    [alert] = _alerts(db, mon.run_id)
    assert alert.step == 1 and alert.message.startswith(f"mon.step({bad!r}, ...): step is ")
    assert "mon.step(" in capfd.readouterr().err


def test_steps_after_finish_are_said_once_and_not_reported_as_logged(tmp_path, capfd):
    """mon.step() after mon.finish() returned its values as if logged, and only the writer
    complained ("log() on a closed writer, or in a forked child"), once per step."""
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = _started(db, model, opt)
    assert mon.step(1, loss=_backwards(model, mon))
    mon.finish()
    capfd.readouterr()
    for step in (2, 3):
        assert mon.step(step, loss=_backwards(model, mon)) == {}
    mon.log(3, {"val_loss": 1.0})
    assert mon.ramp_due() is None
    err = capfd.readouterr().err
    assert err.count("came after mon.finish()") == 1 and "closed writer" not in err, err
    assert sorted(metric(db, mon.run_id, M.LOSS)) == [1]
    assert store.get_run(db, mon.run_id).status == "finished"


def test_a_ddp_loop_without_after_backward_logs_everything_but_the_noise_scale(tmp_path):
    """Two gloo ranks: the gradient norm and the rank-mean loss still ride on the one all-reduce
    per step; one alert, printed once (rank 0 has the writer)."""
    db = tmp_path / "runs.duckdb"
    done = run_torchrun(
        "-m",
        "tests.own_loop_child",
        str(db),
        str(tmp_path / "ddp.pt"),
        "--steps",
        "4",
        "--no-after-backward",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = store.list_runs(db)
    for name in (M.LOSS, M.LR, M.GRAD_NORM, M.TOKENS_SEEN, M.MEM_PEAK):
        assert sorted(metric(db, run.run_id, name)) == [1, 2, 3, 4], name
    assert not GNS_NAMES & set(store.metric_names(db, run.run_id))
    [alert] = _alerts(db, run.run_id)
    assert alert.message.startswith(NO_AFTER_BACKWARD), alert.message
    assert done.stderr.count(NO_AFTER_BACKWARD) == 1, done.stderr[-3000:]


def test_step_called_twice_for_one_step_is_said_and_logged_once(tmp_path, capfd):
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = _started(db, model, opt)
    for step in range(1, 5):
        loss = _backwards(model, mon)
        assert M.GNS_G2 in mon.step(step, loss=loss)
        if step == 2:
            assert mon.step(2, loss=loss) == {}  # the second call is ignored
        opt.step()
        opt.zero_grad()
    mon.finish()
    # one row per step (metric() checks), tokens counted once
    assert metric(db, mon.run_id, M.TOKENS_SEEN) == {s: s * 4 * 2 * 8 for s in range(1, 5)}
    assert sorted(metric(db, mon.run_id, M.GNS_G2)) == [1, 2, 3, 4]
    [alert] = _alerts(db, mon.run_id)
    assert alert.step == 2, alert
    assert alert.message.startswith(
        "mon.step(2) was called twice for step 2, with no mon.after_backward() in between"
    ), alert.message
    assert "call mon.step() once per optimizer step" in alert.message
    assert capfd.readouterr().err.count("called twice for step 2") == 1


def test_reduced_grad_after_step_is_said_and_ignored(tmp_path, capfd):
    """The optimizer's shards handed over after mon.step(): they belong to no recorded step, so
    they are dropped (not carried into the next step's fit) and the loop's author is told the
    order once."""
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = _started(db, model, opt)
    logged = []
    for step in range(1, 4):
        loss = _backwards(model, mon)
        logged.append(mon.step(step, loss=loss))
        mon.reduced_grad(*[p.grad for p in model.parameters()])  # too late
        opt.step()
        opt.zero_grad()
    mon.finish()
    assert all(M.GNS_G2 in m for m in logged)
    [alert] = _alerts(db, mon.run_id)
    assert alert.step == 1, alert
    assert "mon.reduced_grad() came with no backward recorded since mon.step()" in alert.message
    assert "mon.step() after the optimizer's step" in alert.message
    assert capfd.readouterr().err.count("mon.reduced_grad() came") == 1


def test_a_step_with_no_after_backward_since_the_last_is_said(tmp_path, capfd):
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = _started(db, model, opt)
    for step in range(1, 6):
        if step != 3:  # step 3: no backward (nor after_backward) since mon.step(2)
            loss = _backwards(model, mon)
        mon.step(step, loss=loss)
        opt.step()
        opt.zero_grad()
    mon.finish()
    assert sorted(metric(db, mon.run_id, M.LOSS)) == [1, 2, 3, 4, 5]
    assert sorted(metric(db, mon.run_id, M.GRAD_NORM)) == [1, 2, 4, 5]  # no stale .grad
    assert sorted(metric(db, mon.run_id, M.GNS_G2)) == [1, 2, 4, 5]
    [alert] = _alerts(db, mon.run_id)
    assert alert.step == 3, alert
    assert alert.message.startswith(
        "mon.step(3) was called with no mon.after_backward() since mon.step(2)"
    ), alert.message
    assert capfd.readouterr().err.count("since mon.step(2)") == 1


# FSDP2 on one process: `1d` (fully_shard's default mesh) is measured and logs what the same
# loop without FSDP logs (`plain`); `2d`, a 1 × 1 (replicate, shard) mesh, is HSDP: said not
# measured.
FSDP_CHILD = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from rampwatch import Monitor
dist.init_process_group("gloo")
for wrap in sys.argv[2:]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if wrap == "2d":
        fully_shard(model, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("r", "s")))
    elif wrap == "1d":
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor.start(sys.argv[1], name=wrap, config={}, model=model, optimizer=opt,
                        per_device_batch=4, accum=2, seq_len=1)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        for j in range(2):
            if wrap != "plain":  # FSDP2's accumulation without sync, then one sync
                model.set_requires_gradient_sync(j == 1)
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            (loss / 2).backward()
            mon.after_backward()
        mon.step(step, loss=loss.detach())
        opt.step()
        opt.zero_grad()
    mon.finish()
dist.destroy_process_group()
"""


def _one_process(db, *wraps: str) -> subprocess.CompletedProcess:
    env = child_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FSDP_CHILD), str(db), *wraps],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_fsdp2_on_one_process_is_measured_as_without_it_and_hsdp_is_not(tmp_path):
    db = tmp_path / "runs.duckdb"
    done = _one_process(db, "plain", "1d", "2d")
    assert done.returncode == 0, done.stderr
    runs = {run.name: run.run_id for run in store.list_runs(db)}
    for name in (M.GNS_G2, M.GNS_TRACE, M.GRAD_NORM, M.LOSS):
        plain, fsdp = metric(db, runs["plain"], name), metric(db, runs["1d"], name)
        assert sorted(fsdp) == sorted(plain) == [1, 2, 3], name
        assert list(fsdp.values()) == pytest.approx(list(plain.values()), rel=1e-5), name
    assert not store.events(db, runs["1d"], kinds=[M.EVENT_ALERT])
    names = set(store.metric_names(db, runs["2d"]))
    assert {M.LOSS, M.MEM_PEAK, M.ACCUM} <= names
    assert not names & {M.GNS_G2, M.GNS, M.GRAD_NORM}  # a shard's norm is not the gradient's
    [alert] = store.events(db, runs["2d"], kinds=[M.EVENT_ALERT])
    assert alert.message.startswith(
        "noise scale not measured: sharded gradients: FSDP2 on a 2-D device mesh"
    ), alert.message
    # what is measured and what is not, named
    assert "DistributedDataParallel" in alert.message and "FSDP2" in alert.message
    assert "DeepSpeed" in alert.message and "FSDP1" in alert.message


# A nanochat-style loop: no DDP wrapper; the optimizer averages .grad over the ranks inside
# step(), so before it every rank's .grad is its own. Each rank also prints its own |.grad|²
# after each backward, the recomputation the logged line must fit.
LOCAL_SYNC_CHILD = """
import sys, weakref, torch, torch.distributed as dist
from rampwatch import Monitor
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

class SyncingSGD(torch.optim.SGD):
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                dist.all_reduce(p.grad)
                p.grad /= world
        return super().step(closure)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = SyncingSGD(model.parameters(), lr=1e-2)
mon = Monitor.start(sys.argv[1], name="local-sync", config={}, model=model, optimizer=opt,
                    per_device_batch=4, accum=2, seq_len=1, lr_rule="linear")
gen = torch.Generator().manual_seed(1 + rank)
for step in range(1, 5):
    sq = []
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        (loss / 2).backward()
        mon.after_backward()
        sq.append(sum(p.grad.double().square().sum() for p in model.parameters()))
    means = torch.stack(sq)
    dist.all_reduce(means)
    if rank == 0:
        print("SQ", step, *(v / world for v in means.tolist()), flush=True)
    mon.step(step, loss=loss.detach())
    opt.step()
    opt.zero_grad()
side = weakref.ref(mon.ramps.channel.group)
mon.finish()
dist.destroy_process_group()
# a gloo group still alive after destroy_process_group() can abort the rank at exit
print("SIDE GROUP", "alive" if side() is not None else "freed", flush=True)
"""


def test_a_loop_that_syncs_inside_the_optimizer_gets_the_noise_scale_of_its_ranks(tmp_path):
    """Two gloo ranks, no DDP: the points are the ranks' own running sums (batch 4 and 8 per
    rank), averaged over ranks; the logged |G|² and tr(Σ) are the line through them. finish()
    lets go of the monitor's gloo side group, so the loop's destroy_process_group() frees it
    (one left alive aborted a rank at exit in 6 of 20 runs under load)."""
    db, child = tmp_path / "runs.duckdb", tmp_path / "child.py"
    child.write_text(textwrap.dedent(LOCAL_SYNC_CHILD))
    done = run_torchrun(str(child), str(db), timeout=240)
    assert done.stdout.count("SIDE GROUP freed") == 2, done.stdout[-3000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = store.list_runs(db)
    g2, trace = metric(db, run.run_id, M.GNS_G2), metric(db, run.run_id, M.GNS_TRACE)
    assert sorted(g2) == [1, 2, 3, 4]
    for line in done.stdout.splitlines():
        if line.startswith("SQ"):
            _, step, y1, y2 = line.split()
            # y = |G|² + tr(Σ)/B through (4, y1) and (8, y2): .grad is S_j/2, so |S_1|² = 4·sq
            y1, y2 = float(y1) * 4, float(y2)
            want_trace = (y1 - y2) / (1 / 4 - 1 / 8)
            assert trace[int(step)] == pytest.approx(want_trace, rel=1e-6)
            # |G|² is a small difference of the points (norms taken in fp32): their tolerance
            assert g2[int(step)] == pytest.approx(y2 - want_trace / 8, abs=1e-5 * y1)
    assert not store.events(db, run.run_id, kinds=[M.EVENT_ALERT])


def test_a_compiled_ddp_model_is_measured_as_ddp(tmp_path):
    """torch.compile(DDP(model)) passed to the monitor: it looks through the compile wrapper, so
    the per-rank norm hook adds the all-reduced point and accumulation 1 gets a noise scale."""
    db = tmp_path / "runs.duckdb"
    done = run_torchrun(
        "-m",
        "tests.own_loop_child",
        str(db),
        str(tmp_path / "out.pt"),
        "--compile",
        "--ramp",
        "off",
        "--steps",
        "4",
        "--batch",
        "4",
        "--accum",
        "1",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = store.list_runs(db)
    assert sorted(metric(db, run.run_id, M.GNS_TRACE)) == [1, 2, 3, 4]
    assert not store.events(db, run.run_id, kinds=[M.EVENT_ALERT])


# DDP with token weights that differ per rank (Hugging Face under torchrun: N counted over every
# rank, each rank's loss × W): each rank's points are its own token-weighted means, recomputed
# here from each micro-batch's own gradient (autograd.grad on the module, outside DDP).
WEIGHTED_DDP_CHILD = """
import contextlib, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from rampwatch import Monitor
from tests.procs import free_ddp
from rampwatch.advisor.gns import line_estimates
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
mon = Monitor.start(sys.argv[1], name="weighted-ddp", config={}, model=model, optimizer=opt,
                    per_device_batch=8, accum=2, seq_len=1, lr_rule="linear")
counts = [[2, 7], [6, 3]]  # rows of each micro-batch that count, per rank: unequal totals
N = sum(map(sum, counts))
gen = torch.Generator().manual_seed(1 + rank)
params = list(net.parameters())
flat = lambda gs: torch.cat([g.reshape(-1) for g in gs]).double()
for step in range(1, 4):
    own = []
    for j, m in enumerate(counts[rank]):
        x = torch.randn(8, 8, generator=gen)
        mean = (net(x) - x[:, :1]).pow(2)[:m, 0].mean()
        own.append(flat(torch.autograd.grad(mean, params)))  # this micro-batch's own gradient
        with model.no_sync() if j == 0 else contextlib.nullcontext():
            rows = (model(x) - x[:, :1]).pow(2)[:m, 0]
            (world * rows.sum() / N).backward()
        mon.after_backward(world * m / N)
    m = counts[rank]
    local = [own[0], (m[0] * own[0] + m[1] * own[1]) / sum(m)]  # token-weighted running means
    sizes = [8 * 2 * m[0] / sum(m), 8 * 2.0]
    vec = torch.tensor([float(v.square().sum()) for v in local] + [1 / b for b in sizes],
                       dtype=torch.float64)
    dist.all_reduce(vec)
    full = local[1] * sum(m)
    dist.all_reduce(full)
    points = [vec[0] / world, vec[1] / world, float((full / N).square().sum())]
    batches = [world / vec[2], world / vec[3], 8 * 2 * world]
    if rank == 0:
        print("FIT", step, *line_estimates([float(b) for b in batches], [float(p) for p in points]),
              flush=True)
    mon.step(step, loss=rows.sum().detach())
    opt.step()
    opt.zero_grad()
mon.finish()
del model, mon, opt  # DDP before the process group (tests.procs.free_ddp)
free_ddp()
dist.destroy_process_group()
"""


def test_ddp_points_are_each_ranks_own_token_weighted_means(tmp_path):
    """Two gloo ranks whose micro-batches count 2 + 7 and 6 + 3 rows: each point is a rank's own
    weighted mean (its |·|² averaged over ranks at the mean 1/B), the global one the weighted
    mean over all 18 rows; the logged |G|² and tr(Σ) are the line through them."""
    db, child = tmp_path / "runs.duckdb", tmp_path / "child.py"
    child.write_text(textwrap.dedent(WEIGHTED_DDP_CHILD))
    done = run_torchrun(str(child), str(db), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = store.list_runs(db)
    g2, trace = metric(db, run.run_id, M.GNS_G2), metric(db, run.run_id, M.GNS_TRACE)
    fits = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("FIT")]
    assert len(fits) == 3
    for step, want_g2, want_trace in fits:
        assert g2[int(step)] == pytest.approx(float(want_g2), rel=1e-5)
        assert trace[int(step)] == pytest.approx(float(want_trace), rel=1e-5)
