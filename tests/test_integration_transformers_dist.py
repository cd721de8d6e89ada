"""The Hugging Face Trainer integration under torchrun (rampwatch/integrations/transformers.py):
two gloo ranks of tests/hf_child.py on the CPU, a tiny GPT-2 built in code, a real DuckDB file.
One run of 2 per device × 2 accumulation × 2 ranks gets an approved ramp to 4 × 2 × 2 at step 3:
every rank saves and exits 75 at that step, the same torchrun command run again continues the
run at the new tier on both ranks to the token budget. Shown here: rank 0 alone logs each step,
with the noise scale; the ramp lands on both ranks at one step, the LR moved by the √ rule; the
samples the ranks trained, in order, are the sampler's stream with none skipped or repeated
across an epoch's end; the run and its card say world size 2. The test process never imports
transformers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import threading

import pytest
import torch

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed
from tests.procs import kill_group, spawn, torchrun

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")),
        reason="the transformers extra (and accelerate, which its Trainer needs)",
    ),
]
EXIT_RAMP = 75  # rampwatch.integrations.transformers.EXIT_RAMP
SEQ, SEED, LR, WARMUP = 16, 42, 3e-3, 2  # tests/hf_child.py's
N, STEPS, RAMP_AT = 48, 9, 3  # samples; max_steps of the first tier (its budget); the ramp's step


def command(db, out) -> list[str]:
    return torchrun(
        *("-m", "tests.hf_child", "hf", str(db), str(out), "--record", "--direct", "--plan"),
        *("--steps", str(STEPS), "--samples", str(N), "--wait-ramp-at", str(RAMP_AT)),
    )


def stream(n: int, count: int) -> list[int]:
    """The first `count` samples of accelerate's SeedableRandomSampler read as one stream of
    epochs (randperm seeded with seed + epoch, data_loader.py:73-107)."""
    out, epoch = [], 0
    while len(out) < count:
        g = torch.Generator().manual_seed(SEED + epoch)
        out += torch.randperm(n, generator=g).tolist()
        epoch += 1
    return out[:count]


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hfdist")
    db, out = tmp / "runs.duckdb", tmp / "hf"
    first = spawn(command(db, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, run_id, cid = [], None, None
    watchdog = threading.Timer(150, kill_group, [first])  # reading stdout could block forever
    watchdog.start()
    try:
        for raw in first.stdout:
            lines.append(raw.decode())
            if lines[-1].startswith("run "):
                run_id = lines[-1].split()[1]
            if cid is None and lines[-1].startswith(f"waiting at {RAMP_AT}"):
                payload = {"per_device_batch": 4, "accum": 2}
                cid = commands.submit(db, run_id, "ramp", payload, actor="test")
        first.wait(timeout=60)
    finally:
        watchdog.cancel()
        if first.poll() is None:
            kill_group(first)
    first_log = "".join(lines)
    (tmp / "first.log").write_text(first_log)  # for a failure's reader
    assert cid is not None, first_log[-6000:]
    second = spawn(command(db, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # the same command again
        second_log = second.communicate(timeout=150)[0].decode()
    finally:
        if second.poll() is None:
            kill_group(second)
    (tmp / "second.log").write_text(second_log)
    assert second.returncode == 0, second_log[-6000:]
    samples = {
        r: [json.loads(x) for x in (out / f"samples.rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    }
    return {
        "db": db,
        "out": out,
        "run_id": run_id,
        "cid": cid,
        "first": first_log,
        "first_rc": first.returncode,
        "second": second_log,
        "samples": samples,
    }


def seqs_tokens(step: int) -> int:
    """Tokens of the step: 8 sequences a step before the ramp, 16 after."""
    return (8 if step <= RAMP_AT else 16) * SEQ


def series(db, run_id, name) -> dict[int, float]:
    s = store.series(db, run_id, name, width=1)
    return dict(zip(s.step.tolist(), s.last.tolist(), strict=True))


def test_rank_0_alone_logs_every_step_with_the_noise_scale(ramped):
    db, run_id = ramped["db"], ramped["run_id"]
    [run] = store.list_runs(db)  # one run: rank 1 opened none, the restart continued it
    assert (run.run_id, run.world_size, run.stored_status) == (run_id, 2, "finished")
    seqs = series(db, run_id, M.BATCH_SEQS)
    assert seqs == {s: 8 if s <= RAMP_AT else 16 for s in range(1, 7)}  # × 2 ranks
    g2, trace = series(db, run_id, M.GNS_G2), series(db, run_id, M.GNS_TRACE)
    assert sorted(g2) == sorted(trace) == list(range(1, 7))  # every step, both tiers
    assert all(math.isfinite(v) for v in (*g2.values(), *trace.values()))
    assert all(v > 0 for v in series(db, run_id, M.GRAD_NORM).values())
    # step 1 from each micro-batch's own gradient: each rank's token-weighted means (their
    # token counts differ), the DDP hook's global point; 1/k weights would be far off
    direct = json.loads((ramped["out"] / "direct.json").read_text())
    assert direct["rank_tokens"][0] != direct["rank_tokens"][1]  # [m_r1, m_r2] per rank
    assert g2[1] == pytest.approx(direct["weighted"]["g2"], rel=1e-4)
    assert trace[1] == pytest.approx(direct["weighted"]["trace"], rel=1e-4)
    assert abs(trace[1] - direct["unweighted"]["trace"]) > 0.05 * abs(trace[1])


def test_an_approved_ramp_lands_on_both_ranks_at_one_step_with_the_lr_by_the_rule(ramped):
    db, run_id, out = ramped["db"], ramped["run_id"], ramped["out"]
    assert ramped["first_rc"] != 0  # torchrun reports its workers' exit 75 as a failure
    for r in (0, 1):
        assert f"rank {r} exit {EXIT_RAMP}" in ramped["first"], ramped["first"][-4000:]
    cmd = commands.get(db, ramped["cid"])
    assert (cmd.status, cmd.applied_step) == ("applied", RAMP_AT)
    state = json.loads((out / f"checkpoint-{RAMP_AT}" / "rampwatch.json").read_text())
    assert (state["step"], state["per_device_batch"], state["accum"]) == (RAMP_AT, 4, 2)
    assert state["world_size"] == 2  # a restart on another world size is refused
    assert state["samples_seen"] == RAMP_AT * 8  # every rank's samples
    assert series(db, run_id, M.PER_DEVICE_BATCH) == {
        s: 2 if s <= RAMP_AT else 4 for s in range(1, 7)
    }
    [ramp] = store.events(db, run_id, kinds=[M.EVENT_RAMP])
    assert ramp.step == RAMP_AT and ramp.data["after"]["batch"] == 16
    mult = ramp.data["after"]["base_lr"] / ramp.data["before"]["base_lr"]
    assert mult == pytest.approx(math.sqrt(2), rel=1e-12)  # 8 -> 16 sequences, Adam: √
    # the LR of each step: the unramped linear warmup and decay (transformers optimization.py,
    # get_linear_schedule_with_warmup) at the tokens before it, in steps of the first tier
    lr = series(db, run_id, M.LR)
    seen = series(db, run_id, M.TOKENS_SEEN)
    for s in range(1, 7):
        x = (seen[s] - seqs_tokens(s)) / (8 * SEQ)
        f = x / WARMUP if x < WARMUP else max(0.0, (STEPS - x) / (STEPS - WARMUP))
        assert lr[s] == pytest.approx(LR * f * (mult if s > RAMP_AT else 1.0), rel=1e-9), s
    assert seen[6] == STEPS * 8 * SEQ  # the restart ends at the token budget
    # both ranks ran the same updates
    ranks = [torch.load(out / f"final.rank{r}.pt") for r in (0, 1)]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_ranks_trained_the_sampler_stream_with_no_sample_skipped_or_repeated(ramped):
    """Each micro-step takes the next 2 × b samples of the stream, rank r the r-th b of them;
    the resumed ranks read on from sample 24 at b = 4, across the end of epoch 0 (48 samples)."""
    samples = ramped["samples"]
    by_step = {r: {} for r in samples}
    for r, rows in samples.items():
        for row in rows:
            by_step[r].setdefault(row["step"], []).append(row["ids"])
    assert sorted(by_step[0]) == sorted(by_step[1]) == list(range(1, 7))
    order = []
    for s in range(1, 7):
        assert len(by_step[0][s]) == len(by_step[1][s]) == 2  # accumulation 2 on each rank
        for j in range(2):
            order += by_step[0][s][j] + by_step[1][s][j]
    assert [len(x) for x in by_step[0][RAMP_AT + 1]] == [4, 4]
    assert order == stream(N, STEPS * 8)  # 72 samples: all of epoch 0, 24 of epoch 1
    epoch0 = order[:N]
    assert sorted(epoch0) == list(range(N))


def test_the_card_says_world_size_2(ramped, monkeypatch):
    text = seed.texts(seed.app(monkeypatch, ramped["db"]))
    assert "At its last step: 4 per device × 2 accumulation × 2 device(s) = 16 sequences" in text
    assert store.get_run(ramped["db"], ramped["run_id"]).world_size == 2
