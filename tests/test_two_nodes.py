"""Two "nodes" on localhost: `torchrun --nnodes 2 --node-rank N --nproc-per-node 2` twice, four
gloo ranks of the reference trainer, as a two-machine launch runs it (static rendezvous at
node 0's address). Shown here: one run in the database with world size 4, every step logged once;
an approved ramp applied on all four ranks at the same step; then a trial that runs the same arms
on every rank and leaves them with the same weights.
"""

from __future__ import annotations

import subprocess

import pytest

from rampwatch.store import commands, reader
from rampwatch.store import names as M
from tests.procs import child_env, free_port, kill_group, spawn
from tests.test_dist import rank_lines
from tests.test_trial_dist import COMMON, trial_lines, watch
from tests.trainer_runs import metric, trainer_args

pytestmark = pytest.mark.slow

STEPS = 60  # room for a claim that arrives late on a loaded machine
# 4 ranks × 4 per device; after the ramp × accum 2: 32 sequences of 128 tokens a step
DELTA = 2 * 32 * 128  # 2 control steps at the ramped tier, 1 step at ×2


def node(db, ckpt, node_rank: int, port: int, out=subprocess.PIPE) -> subprocess.Popen:
    launch = ["-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}"]
    launch += ["--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
    args = trainer_args(db, ckpt, "--run-id", "n", "--steps", str(STEPS), *COMMON)
    return spawn(
        launch + args,
        env=child_env(RAMPWATCH_DEBUG_RANKS="1"),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def test_two_nodes_one_run_a_ramp_and_a_trial_on_all_four_ranks(tmp_path):
    db, ck, port = tmp_path / "runs.duckdb", tmp_path / "ckpt", free_port()
    with open(tmp_path / "node1.log", "wb") as log1:
        second = node(db, ck, 1, port, out=log1)
        first = node(db, ck, 0, port)
        sent: dict[str, int] = {}

        def on_line(line, _):  # node 0's output: its ranks 0 and 1
            if "ramp" not in sent and "rampwatch-rank rank=0 step=2 " in line:
                payload = {"per_device_batch": 4, "accum": 2}
                sent["ramp"] = commands.submit(db, "n", "ramp", payload, actor="test")
            ramped = "rampwatch-rank rank=0 " in line and "tier=4x2" in line
            if (
                ramped
                and "trial" not in sent
                and commands.get(db, sent["ramp"]).status == "applied"
            ):
                payload = {"factors": [2], "delta_tokens": DELTA}
                sent["trial"] = commands.submit(db, "n", "trial", payload, actor="test")

        try:
            out0 = watch(first, on_line, timeout=400)
            assert second.wait(timeout=60) == 0
        finally:
            kill_group(second)
    out = out0 + (tmp_path / "node1.log").read_text()
    assert set(sent) == {"ramp", "trial"}, out[-6000:]

    [run] = reader.list_runs(db)
    assert run.run_id == "n" and run.world_size == 4 and run.status == "finished"

    # the ramp: one switch, at the same step on every rank, recorded once
    ranks = rank_lines(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    tiers = {r: {s: (b, a) for s, (b, a, _) in ranks[r].items()} for r in ranks}
    assert tiers[0] == tiers[1] == tiers[2] == tiers[3], "the ranks disagree on a step's tier"
    ramp = commands.get(db, sent["ramp"])
    assert ramp.status == "applied"
    assert tiers[0][ramp.applied_step] == (4, 1) and tiers[0][ramp.applied_step + 1] == (4, 2)
    assert [e.step for e in reader.events(db, "n", kinds=[M.EVENT_RAMP])] == [ramp.applied_step]

    # the trial: the same start and kept arm on all four ranks, and equal weights after it
    rows = trial_lines(out)
    starts = {r["rank"]: r for r in rows if r["what"] == "start"}
    ends = {r["rank"]: r for r in rows if r["what"] == "end"}
    assert sorted(starts) == sorted(ends) == [0, 1, 2, 3], out[-6000:]
    assert len({(r["trial"], r["step"]) for r in starts.values()}) == 1
    assert len({(r["kept"], r["continue"], r["digest"]) for r in ends.values()}) == 1
    start, cont = starts[0]["step"], ends[0]["continue"]
    assert ramp.applied_step < start < cont < STEPS
    # every step once on every rank and in the store, but those inside the trial
    expected = [*range(1, start + 1), *range(cont + 1, STEPS + 1)]
    assert all(sorted(ranks[r]) == expected for r in ranks)
    assert sorted(metric(db, "n", M.LOSS)) == expected
    assert len(reader.events(db, "n", kinds=[M.EVENT_TRIAL_END])) == 1
