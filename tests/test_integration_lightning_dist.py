"""RampwatchCallback under DDP: tests/lightning_child.py under torchrun, two gloo ranks, Lightning's
Trainer(strategy="ddp", accelerator="cpu", devices=2) against a real DuckDB file.

One fit at 4 per device × 2 accumulation × 2 ranks is sent two ramps through the store's command
API, as tests/test_integration_lightning.py sends them to one process: accumulation 4 (due at
step 5, applied at 6), then 2 per device × 16 (a new loader: applied at the epoch end after 9).
Shown here: rank 0 alone writes, each step once, and the run says world size 2 on the card; the
monitor hooks Lightning's DistributedDataParallel, and step 1's |G|² and tr(Σ) equal a
recomputation from the samples each rank trained on (as tests/test_dist.py checks the reference
trainer's); both ranks switch at the same steps with the LR moved by the √ rule and the weights
equal; Lightning's DistributedSampler keeps dealing each epoch out across the ramps, no sample
read twice. A fit resumed from its checkpoint into another database starts a new run there on
every rank alike (only rank 0 can look for the old one).
"""

from __future__ import annotations

import math
import subprocess
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed
from tests.procs import kill_group, spawn, torchrun, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# a budget of 52 steps of 16: 6 of 4 x 2 x 2, 3 of 4 x 4 x 2, then 10 of 2 x 16 x 2
BUDGET_STEPS, STEPS = 52, 19
EPOCH = 192  # samples per epoch (96 per rank): epoch 0 ends after step 9, then 3 steps each
TIERS = {s: (4, 2) for s in range(1, 7)} | {s: (4, 4) for s in range(7, 10)}
TIERS |= {s: (2, 16) for s in range(10, STEPS + 1)}  # step -> (per-device batch, accumulation)


def series(db, run_id, name) -> dict[int, float]:
    s = store.series(db, run_id, name, width=1)
    return dict(zip(s.step.tolist(), s.last.tolist(), strict=True))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    db = tmp / "runs.duckdb"
    proc = spawn(
        torchrun(
            "-m",
            "tests.lightning_child",
            str(db),
            str(tmp / "l.pt"),
            "--wait-ramp-at",
            "5",
            "--wait-ramp-at",
            "7",
            "--steps",
            str(BUDGET_STEPS),
            "--epoch-samples",
            str(EPOCH),
            "--reload",
            "--checkpoint-dir",
            str(tmp / "ck"),
            "--checkpoint-every",
            "6",
            "--then-resume",  # once it ends: its step-6 checkpoint into another database
            str(tmp / "ck" / "epoch=0-step=6.ckpt"),
            str(tmp / "other.duckdb"),
            str(tmp / "again.pt"),
            "--then-stop-after",
            "9",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()  # rank 0's, once its monitor is up
        assert first.startswith("run "), first + proc.stderr.read()[-6000:]
        run_id = first.split()[1]
        accum = commands.submit(
            db, run_id, "ramp", {"per_device_batch": 4, "accum": 4}, actor="test"
        )
        wait_until(lambda: commands.get(db, accum).status == "applied", timeout=120)
        batch = commands.submit(
            db, run_id, "ramp", {"per_device_batch": 2, "accum": 16}, actor="test"
        )
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    done = [tmp / f"l.pt.rank{r}" for r in (0, 1)]  # the first fit's (the second one's: below)
    assert all(path.exists() for path in done), err[-6000:]
    return SimpleNamespace(
        db=db,
        tmp=tmp,
        run_id=run_id,
        accum=accum,
        batch=batch,
        log=first + out + err,
        returncode=proc.returncode,
        ranks=[torch.load(path) for path in done],
    )


def steps_of(result) -> dict[int, list[tuple[int, list[int]]]]:
    """{step: [(accumulate_grad_batches, sample ids) of each of its batches]} of one rank."""
    out = defaultdict(list)
    for step, accum, ids in result["batches"]:
        out[step].append((accum, ids))
    return dict(out)


def test_rank_0_writes_each_step_once_and_the_card_says_two_devices(ddp, monkeypatch):
    (run,) = store.list_runs(ddp.db)
    assert (run.run_id, run.status, run.last_step) == (ddp.run_id, "finished", STEPS)
    assert run.world_size == 2 and run.config["world_size"] == 2
    assert run.config["integration"] == "lightning"
    for name in (M.LOSS, M.GRAD_NORM, M.GNS_G2, M.GNS_TRACE, M.LR, M.TOKENS_SEEN, M.MEM_PEAK):
        assert sorted(series(ddp.db, ddp.run_id, name)) == list(range(1, STEPS + 1)), name
    # one event per ramp (not one per rank), and nothing went wrong on either rank
    assert [e.step for e in store.events(ddp.db, ddp.run_id, kinds=[M.EVENT_RAMP])] == [6, 9]
    assert store.events(ddp.db, ddp.run_id, kinds=[M.EVENT_ALERT, "error"]) == []
    lines = [line for line in ddp.log.splitlines() if line.startswith("run ")]
    assert lines[0] == f"run {ddp.run_id}" and "run None" not in lines  # rank 1 has no writer
    text = seed.texts(seed.app(monkeypatch, ddp.db))
    assert "At its last step: 2 per device × 16 accumulation × 2 device(s) = 64 sequences" in text
    assert f"Ramp #{ddp.batch} to 2 per device × 16 accumulation was applied at step 9." in text


def test_step_1_noise_scale_matches_a_recomputation_from_each_ranks_samples(ddp):
    """DDP's points: (4, rank mean of |g_r1|²), (8, rank mean of |local gradient|²: the comm
    hook on Lightning's DistributedDataParallel) and (16, |global gradient|²)."""
    from rampwatch.advisor.gns import line_estimates
    from tests.own_loop_child import build, data

    assert [r["rank_hook"] for r in ddp.ranks] == [True, True]
    net, _, _ = build(steps=BUDGET_STEPS)  # the child's initial weights
    x, y = data(4 * 2 * BUDGET_STEPS * 16 * 2)  # and its samples

    def grad(ids) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x[ids]), y[ids]).backward()
        return [p.grad.detach().double().clone() for p in net.parameters()]

    def sq(vectors) -> float:
        return sum(float(v.square().sum()) for v in vectors)

    def mean(*gs):
        return [sum(parts) / len(gs) for parts in zip(*gs, strict=True)]

    g = [[grad(ids) for _, ids in steps_of(r)[1]] for r in ddp.ranks]  # g[rank][micro]
    assert [len(micro) for micro in g] == [2, 2]
    points = [
        sum(sq(g[r][0]) for r in range(2)) / 2,
        sum(sq(mean(*g[r])) for r in range(2)) / 2,
        sq(mean(*g[0], *g[1])),
    ]
    g2, trace = line_estimates([4, 8, 16], points)
    assert series(ddp.db, ddp.run_id, M.GRAD_NORM)[1] ** 2 == pytest.approx(points[2], rel=1e-5)
    assert series(ddp.db, ddp.run_id, M.GNS_TRACE)[1] == pytest.approx(trace, rel=1e-4)
    # |G|² is a small difference of the points (norms taken in fp32): their tolerance
    assert series(ddp.db, ddp.run_id, M.GNS_G2)[1] == pytest.approx(g2, abs=1e-5 * points[0])
    with torch.no_grad():
        ids = [
            i for micro in steps_of(ddp.ranks[0])[1] + steps_of(ddp.ranks[1])[1] for i in micro[1]
        ]
        loss = float(torch.nn.functional.mse_loss(net(x[ids]), y[ids]))
    assert series(ddp.db, ddp.run_id, M.LOSS)[1] == pytest.approx(loss, rel=1e-5)  # rank mean


def test_approved_ramps_land_on_both_ranks_at_the_same_step_with_the_lr_by_the_rule(ddp):
    r0, r1 = ddp.ranks
    assert r0["applied"] == r1["applied"] == [6, 9], ddp.log
    for cid, step in ((ddp.accum, 6), (ddp.batch, 9)):
        cmd = commands.get(ddp.db, cid)
        assert (cmd.status, cmd.applied_step) == ("applied", step)
    for r in ddp.ranks:  # what each rank trained each step on
        ran = {s: (len(b[0][1]), b[0][0]) for s, b in steps_of(r).items()}
        assert ran == TIERS and all(len(b) == TIERS[s][1] for s, b in steps_of(r).items())
        assert (r["steps"], r["stale"]) == (STEPS, 0)  # the budget's steps, each from zero_grad
    accum, batch = (
        series(ddp.db, ddp.run_id, M.ACCUM),
        series(ddp.db, ddp.run_id, M.PER_DEVICE_BATCH),
    )
    assert {s: (batch[s], accum[s]) for s in accum} == TIERS
    assert series(ddp.db, ddp.run_id, M.TOKENS_SEEN)[STEPS] == BUDGET_STEPS * 16
    for a, b in zip(r0["params"], r1["params"], strict=True):  # DDP kept the ranks together
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # √ rule from the first 16 sequences: 32 -> 1e-2·√2, 64 -> 1e-2·2 (warmup done by then)
    ramps = store.events(ddp.db, ddp.run_id, kinds=[M.EVENT_RAMP])
    assert [e.data["after"]["batch"] for e in ramps] == [32, 64]
    assert [e.data["after"]["base_lr"] for e in ramps] == pytest.approx(
        [1e-2 * math.sqrt(2), 2e-2], rel=1e-12
    )
    assert r0["lr"] == r1["lr"] == pytest.approx(2e-2, rel=1e-12)
    lr = series(ddp.db, ddp.run_id, M.LR)
    assert lr[7] == pytest.approx(lr[6] / 0.6 * 0.7 * math.sqrt(2), rel=1e-9)  # warmup × √2


def test_each_rank_reads_its_share_of_each_epoch_and_no_sample_twice(ddp):
    """Lightning's DistributedSampler (shuffled, seed 0, set_epoch per epoch) deals each epoch's
    slice out to the ranks; the per-device batch ramp at the epoch end gets a new loader whose
    sampler continues at the next epoch on both ranks."""
    from torch.utils.data import DistributedSampler

    seen = []
    for rank, r in enumerate(ddp.ranks):
        by_epoch = defaultdict(list)
        for _, _, ids in r["batches"]:
            by_epoch[ids[0] // EPOCH].extend(ids)
        assert sorted(by_epoch) == list(range(len(by_epoch)))  # epochs in order, none skipped
        for epoch, ids in by_epoch.items():
            sampler = DistributedSampler(range(EPOCH), 2, rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            order = [epoch * EPOCH + i for i in sampler]
            assert ids == order[: len(ids)], (rank, epoch)
        seen += [i for _, _, ids in r["batches"] for i in ids]
    assert len(seen) == len(set(seen)) == BUDGET_STEPS * 16  # no repeats: the budget's samples
    epoch0 = [i for r in ddp.ranks for s, _, ids in r["batches"] if s <= 9 for i in ids]
    assert sorted(epoch0) == list(range(EPOCH))  # the epoch before the batch ramp, all of it


def test_a_resume_into_another_database_starts_afresh_on_every_rank(ddp):
    """Only rank 0 opens the database, so only rank 0 finds the checkpoint's run missing: every
    rank must then start afresh, or rank 1 alone would continue the saved tokens (its LR clock,
    its max_steps) and the ranks would part. (The child's second fit, in the same processes.)"""
    returncode, log = ddp.returncode, ddp.log
    assert returncode == 0, log[-6000:]  # the second fit's: the first one's outputs are there
    other, out = ddp.tmp / "other.duckdb", ddp.tmp / "again.pt"
    (run,) = store.list_runs(other)
    assert run.run_id != ddp.run_id and run.world_size == 2
    assert sorted(series(other, run.run_id, M.LOSS)) == [7, 8, 9]
    r0, r1 = (torch.load(f"{out}.rank{r}") for r in (0, 1))
    assert r0["monitor_at_start"] == r1["monitor_at_start"]
    assert r0["steps"] == r1["steps"] == 3 and r0["lr"] == r1["lr"]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
