"""Data parallel under torchrun on the CPU: two gloo processes of the reference trainer.

Each run is `python -m torch.distributed.run --standalone --nproc_per_node=2 -m trainer train`
started as its own process group. Shown here: every step is logged once and the run records
world size 2; at step 1 the global gradient, |G|^2 and the loss equal a single-process run of the
same effective batch, and the per-rank noise-scale points (partial sums and the comm-hook norm)
equal an in-process recomputation; an approved ramp takes effect on both ranks at the same step;
resuming on one process keeps the effective batch; an out-of-memory on one rank stops both and
`torchrun --max-restarts` resumes the run at the halved tier.
"""

from __future__ import annotations

import math
import re
import subprocess
import threading

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from tests import procs
from tests.procs import child_env, kill_group, spawn
from tests.trainer_runs import metric, trainer_args

pytestmark = pytest.mark.slow

RANK_LINE = re.compile(r"rampwatch-rank rank=(\d+) step=(\d+) tier=(\d+)x(\d+) first_sample=(\d+)")
# SGD with lr 1 and no decay or clipping: the step-1 update is exactly minus the gradient
SGD = [
    "--optimizer",
    "sgd",
    "--lr",
    "1",
    "--warmup-tokens",
    "1",
    "--grad-clip",
    "0",
    "--weight-decay",
    "0",
    "--no-plan",
]


def torchrun(db, ckpt, *extra, restarts: int = 0) -> list[str]:
    return procs.torchrun(*trainer_args(db, ckpt, *extra), restarts=restarts)


def finish(proc: subprocess.Popen, timeout: float = 150) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(f"{proc.args} did not finish within {timeout}s") from None
    out = out.decode()
    assert proc.returncode == 0, out[-6000:]
    return out


def run(args, timeout: float = 150, **env) -> str:
    return finish(
        spawn(args, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT), timeout
    )


def rank_lines(out: str) -> dict[int, dict[int, tuple[int, int, int]]]:
    """{rank: {step: (per-device batch, accum, this rank's first sample id)}}"""
    seen: dict[int, dict[int, tuple[int, int, int]]] = {}
    for m in RANK_LINE.finditer(out):
        rank, step, b, a, first = map(int, m.groups())
        assert step not in seen.setdefault(rank, {}), f"rank {rank} ran step {step} twice"
        seen[rank][step] = (b, a, first)
    return seen


def load_model(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["model"]


# -- step 1 against one process ----------------------------------------------------------------
@pytest.fixture(scope="module")
def step1(tmp_path_factory):
    """One step of the same 32 sequences: 2 ranks x 8 x accum 2, and 1 process x 8 x accum 4."""
    d = tmp_path_factory.mktemp("step1")
    db, ck = d / "runs.duckdb", d / "ckpt"
    run(
        torchrun(
            db,
            ck,
            "--run-id",
            "ddp",
            "--steps",
            "1",
            "--per-device-batch",
            "8",
            "--accum",
            "2",
            *SGD,
        )
    )
    run(
        trainer_args(
            db,
            ck,
            "--run-id",
            "one",
            "--steps",
            "1",
            "--per-device-batch",
            "8",
            "--accum",
            "4",
            *SGD,
        )
    )
    return db, ck


def test_step1_gradient_and_g2_match_one_process(step1):
    db, ck = step1
    assert reader.get_run(db, "ddp").world_size == 2 and reader.get_run(db, "one").world_size == 1
    assert metric(db, "ddp", M.BATCH_SEQS) == metric(db, "one", M.BATCH_SEQS) == {1: 32}
    ddp, one = load_model(ck / "ddp.pt"), load_model(ck / "one.pt")
    # parameters after step 1 = init - gradient, so their difference is the gradients'
    worst = max((ddp[k] - one[k]).abs().max().item() for k in one)
    assert worst < 1e-5, f"global gradient differs by {worst:.3g}"
    g_ddp, g_one = metric(db, "ddp", M.GRAD_NORM)[1], metric(db, "one", M.GRAD_NORM)[1]
    assert g_one > 1.0
    assert abs(g_ddp**2 - g_one**2) / g_one**2 < 1e-5, (g_ddp, g_one)
    loss_ddp, loss_one = metric(db, "ddp", M.LOSS)[1], metric(db, "one", M.LOSS)[1]
    assert abs(loss_ddp - loss_one) < 1e-5, "the logged loss is the mean over ranks"


def test_per_rank_noise_points_match_a_recomputation(step1):
    """The DDP estimate fits (8, rank mean of |g_r1|^2), (16, rank mean of |local gradient|^2
    from the comm hook) and (32, |global gradient|^2); recompute those here and compare."""
    import torch

    from rampwatch.advisor.gns import line_estimates
    from rampwatch.trainer.config import PRESETS
    from rampwatch.trainer.data import prepare
    from rampwatch.trainer.model import GPT

    db, ck = step1
    cfg = PRESETS["test-tiny"]
    torch.manual_seed(0)  # what the trainer does before building its data and model
    data = prepare(cfg, seed=0)
    model = GPT(cfg)

    def grad(first: int) -> list[torch.Tensor]:
        x, y, _ = data.batch(first, 8)
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        return [p.grad.detach().double().clone() for p in model.parameters()]

    def sq(vectors) -> float:
        return sum(float(v.square().sum()) for v in vectors)

    g = [[grad(rank * 16 + j * 8) for j in range(2)] for rank in range(2)]  # g[rank][micro]
    mean = lambda *gs: [sum(parts) / len(gs) for parts in zip(*gs, strict=True)]  # noqa: E731
    points = [
        sum(sq(g[r][0]) for r in range(2)) / 2,
        sum(sq(mean(*g[r])) for r in range(2)) / 2,
        sq(mean(*g[0], *g[1])),
    ]
    # the recomputation starts from the trainer's own initial weights
    one = load_model(ck / "one.pt")
    init_minus_grad = [
        p.detach().double() - q for p, q in zip(model.parameters(), mean(*g[0], *g[1]), strict=True)
    ]
    assert (
        max(
            float((a - one[k].double()).abs().max())
            for a, k in zip(init_minus_grad, one, strict=True)
        )
        < 1e-5
    )
    g2, trace = line_estimates([8, 16, 32], points)
    assert metric(db, "ddp", M.GRAD_NORM)[1] ** 2 == pytest.approx(points[2], rel=1e-5)
    assert metric(db, "ddp", M.GNS_G2)[1] == pytest.approx(g2, rel=3e-4)  # fp32 vs fp64
    assert metric(db, "ddp", M.GNS_TRACE)[1] == pytest.approx(trace, rel=3e-4)


def test_keep_effective_batch_across_world_sizes():
    from rampwatch.trainer.checkpoint import TrainState
    from rampwatch.trainer.dist import keep_effective_batch

    def moved(b, a, old, new):
        st = keep_effective_batch(TrainState("x", per_device_batch=b, accum=a), old, new)
        return st.per_device_batch, st.accum

    assert moved(8, 4, 2, 1) == (8, 8)  # fewer ranks: more accumulation
    assert moved(8, 4, 1, 2) == (8, 2)
    assert moved(8, 1, 2, 4) == (4, 1)  # never a per-device batch above the share
    assert moved(8, 3, 1, 2) == (6, 2)  # 24 = 2 x 6 x 2: a smaller divisor keeps it exact
    assert moved(8, 1, 1, 3) == (8, 1)  # 8 sequences on 3 ranks: rounds up to 24


# -- a ramp on both ranks, then one process ------------------------------------------------------
# Steps of the two-rank run. A ramp submitted at step 2 waits for a flusher visit (about once a
# second) and then one boundary: step 15 on an idle machine, so 48 leaves room under load.
STEPS = 48


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    """A 2-rank run that gets an approved ramp (8 x 2 -> 8 x 4) while it runs, then the same run
    resumed on one process."""
    d = tmp_path_factory.mktemp("ramp")
    db, ck = d / "runs.duckdb", d / "ckpt"
    proc = spawn(
        torchrun(
            db, ck, "--run-id", "r", "--steps", str(STEPS), "--no-plan", "--checkpoint-every", "0"
        ),
        env=child_env(RAMPWATCH_DEBUG_RANKS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines, command_id = [], None
    watchdog = threading.Timer(150, kill_group, [proc])  # reading stdout could block forever
    watchdog.start()
    try:
        for raw in proc.stdout:  # submit once rank 0 is training, so the run is 'running'
            lines.append(raw.decode())
            if command_id is None and "rampwatch-rank rank=0 step=2 " in lines[-1]:
                command_id = commands.submit(
                    db, "r", "ramp", {"per_device_batch": 8, "accum": 4}, actor="test"
                )
    finally:
        watchdog.cancel()
        out = "".join(lines) + finish(proc, timeout=60)
    assert command_id is not None, out[-6000:]
    resumed = run(
        trainer_args(db, ck, "--resume", "r", "--steps", str(STEPS + 3), "--no-plan"),
        RAMPWATCH_DEBUG_RANKS="1",
    )
    return db, out, command_id, resumed


def test_ramp_applies_on_both_ranks_at_the_same_step(ramped):
    db, out, command_id, _ = ramped
    ranks = rank_lines(out)
    assert sorted(ranks) == [0, 1] and sorted(ranks[0]) == sorted(ranks[1]) == list(
        range(1, STEPS + 1)
    )
    tiers = {r: {s: (b, a) for s, (b, a, _) in ranks[r].items()} for r in ranks}
    assert tiers[0] == tiers[1], "the ranks disagree on the tier of some step"
    switch = [s for s in range(2, STEPS + 1) if tiers[0][s] != tiers[0][s - 1]]
    assert len(switch) == 1 and tiers[0][switch[0] - 1] == (8, 2) and tiers[0][switch[0]] == (8, 4)
    print(f"ramp submitted at step 2 took effect at step {switch[0]} on both ranks")
    cmd = commands.get(db, command_id)
    assert cmd.status == "applied" and cmd.applied_step == switch[0] - 1  # last step at 8 x 2
    # the store agrees, and each step's data is one contiguous range split between the ranks
    accum = metric(db, "r", M.ACCUM)  # (steps past STEPS come from the one-process resume)
    done = range(1, STEPS + 1)
    assert {s: accum[s] for s in done} == {s: tiers[0][s][1] for s in done}
    first = metric(db, "r", M.FIRST_SAMPLE)
    for s in done:
        b, a, first0 = ranks[0][s]
        assert first0 == first[s] and ranks[1][s][2] == first0 + b * a
        if s > 1:
            assert first[s] == first[s - 1] + 2 * b * tiers[0][s - 1][1]
    ramps = reader.events(db, "r", kinds=[M.EVENT_RAMP])
    assert [e.step for e in ramps] == [switch[0] - 1]
    # exactly once: a re-ingested spool would repeat the command result as an error event
    assert reader.events(db, "r", kinds=["error"]) == []


def test_resume_on_one_process_keeps_the_effective_batch(ramped):
    db, _, _, resumed = ramped
    run_ = reader.get_run(db, "r")
    last, after = STEPS, STEPS + 1
    assert run_.world_size == 1 and run_.status == "finished" and run_.last_step == STEPS + 3
    batch, accum = metric(db, "r", M.BATCH_SEQS), metric(db, "r", M.ACCUM)
    assert batch[last] == batch[after] == 64 and accum[last] == 4 and accum[after] == 8
    assert sorted(rank_lines(resumed)[0]) == [after, after + 1, after + 2]
    first = metric(db, "r", M.FIRST_SAMPLE)
    assert sorted(first) == list(range(1, STEPS + 4))  # each step exactly once, none missing
    assert first[after] == first[last] + 64
    notes = [e.message for e in reader.events(db, "r", kinds=[M.EVENT_RESUME])]
    assert any("world size 2 -> 1" in m for m in notes), notes


# -- out of memory on one rank -------------------------------------------------------------------
def test_oom_on_one_rank_stops_both_and_torchrun_resumes_at_half_the_tier(tmp_path):
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    out = run(
        torchrun(
            db,
            ck,
            "--run-id",
            "o",
            "--steps",
            "5",
            "--no-plan",
            "--inject-oom",
            "3:0:forward",
            restarts=1,
        ),
        RAMPWATCH_DEBUG_RANKS="1",
        RAMPWATCH_INJECT_OOM_RANK="1",
    )
    assert "out of memory on rank 1" in out and "restart 1: resuming run o" in out
    ranks = rank_lines(out)
    for r in (0, 1):
        assert {s: (b, a) for s, (b, a, _) in ranks[r].items()} == {
            1: (8, 2),
            2: (8, 2),
            3: (4, 4),
            4: (4, 4),
            5: (4, 4),
        }
    run_ = reader.get_run(db, "o")
    assert run_.status == "finished" and run_.last_step == 5 and run_.world_size == 2
    assert metric(db, "o", M.PER_DEVICE_BATCH) == {1: 8, 2: 8, 3: 4, 4: 4, 5: 4}
    assert set(metric(db, "o", M.BATCH_SEQS).values()) == {32}
    [oom] = reader.events(db, "o", kinds=[M.EVENT_OOM])
    assert (
        oom.step == 2
        and oom.data["rank"] == 1
        and oom.data["after"] == {"per_device_batch": 4, "accum": 4}
    )


def test_card_and_trainer_agree_on_the_new_lr_after_a_resume_on_another_world_size(ramped):
    """The card reads the ramp policy the trainer wrote into the run config: after the resume on
    one process (config world size 1, per-device 8 × accumulation 2), the original batch is still
    the first step's 32 sequences, so the card's new base LR is the trainer's."""
    from rampwatch.advisor.policy import RampPolicy
    from rampwatch.dashboard.recommend import build_card

    db = ramped[0]
    run_ = reader.get_run(db, "r")
    latest = {name: value for name, (_, value) in reader.latest(db, "r").items()}
    card = build_card(
        {
            "run_id": "r",
            "config": run_.config,
            "world_size": run_.world_size,
            "capacity_bytes": run_.capacity_bytes,
            "last_step": run_.last_step,
        },
        latest,
        [],
        [],
        [],
        [],
    )
    first_batch = metric(db, "r", M.BATCH_SEQS)[1]
    lr = run_.config["lr"]
    assert card.current.batch == 64 and first_batch == 32 and run_.world_size == 1
    x2 = card.suggested
    assert x2.option.tier.batch == 128
    assert x2.new_base_lr == pytest.approx(lr * math.sqrt(128 / first_batch), rel=1e-12)
    # the trainer applied its ramp (at world size 2) with the same policy: same number, exactly
    [ramp] = reader.events(db, "r", kinds=[M.EVENT_RAMP])
    policy = RampPolicy.from_config(run_.config)
    assert policy.new_base_lr(ramp.data["after"]["batch"]) == ramp.data["after"]["base_lr"]
