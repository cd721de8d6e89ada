"""The README's own-loop snippet with trials, as written (examples/own_loop.py run by
tests/own_loop_example_child.py against a real DuckDB file): a "Test ×2 / ×4 first" command
sent from another process runs in the loop, ends in trial_end, and the command is applied at the
step the run continues from; the run then logs on from there to its token budget."""

from __future__ import annotations

import pytest

from rampwatch import store
from rampwatch.store import commands
from rampwatch.store import names as M
from tests.procs import REPO, start_loop
from tests.trainer_runs import metric

pytestmark = pytest.mark.timeout(300)

WAIT_AT = 5


def trial_lines() -> list[str]:
    """The example's trial block: from `if trial :=` to the line that continues the run."""
    lines = (REPO / "examples" / "own_loop.py").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "if trial := mon.trial_due()" in line)
    last = next(i for i, line in enumerate(lines) if "mon.trial_ended(out)" in line)
    return lines[first : last + 1]


def test_the_readme_shows_the_trial_block_as_the_example_runs_it():
    block = "\n".join(trial_lines())
    assert block in (REPO / "README.md").read_text(), "README's trial lines differ from the example"
    assert len(trial_lines()) <= 10


def test_a_trial_command_in_the_readme_loop_ends_in_trial_end_with_the_command_applied(
    tmp_path, procs
):
    db = tmp_path / "runs.duckdb"
    proc, run_id = start_loop(
        procs, ["-m", "tests.own_loop_example_child", str(WAIT_AT), str(db), "trials"]
    )
    cid = commands.submit(db, run_id, "trial", {"factors": [2, 4]}, actor="test")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err

    cmd = commands.get(db, cid)
    assert cmd.status == "applied", cmd
    events = store.events(db, run_id)
    [start] = [e for e in events if e.kind == M.EVENT_TRIAL_START]
    assert (start.step, start.data["trial_id"], start.data["factors"]) == (WAIT_AT, cid, [2, 4])
    done = {e.data["factor"] for e in events if e.kind == M.EVENT_TRIAL_ARM and e.data["done"]}
    assert done == {1, 2, 4}
    [end] = [e for e in events if e.kind == M.EVENT_TRIAL_END]
    assert end.step == end.data["continue_step"] == cmd.applied_step > WAIT_AT
    kept = end.data["kept_factor"]
    assert kept == end.data["verdict"]["kept_k"]
    # the kept arm's steps are the run's, logged once its verdict is in: no gap in the curve,
    # no step twice, no discarded arm's; their losses are the ones its progress points showed
    losses = metric(db, run_id, M.LOSS)
    run = store.get_run(db, run_id)
    assert sorted(losses) == list(range(1, run.last_step + 1))
    unit = start.data["delta_tokens"] // (cmd.applied_step - WAIT_AT)  # the kept arm's step
    points = {
        WAIT_AT + e.data["tokens"] // unit: e.data["loss"]
        for e in events
        if e.kind == M.EVENT_TRIAL_ARM and e.data["factor"] == kept and e.data["loss"] is not None
    }
    assert points and all(losses[s] == pytest.approx(v, rel=1e-6) for s, v in points.items())
    assert max(points) == cmd.applied_step
    tokens = metric(db, run_id, M.TOKENS_SEEN)
    assert tokens[cmd.applied_step] - tokens[WAIT_AT] == start.data["delta_tokens"]
    assert set(metric(db, run_id, M.LR)).isdisjoint(range(WAIT_AT + 1, cmd.applied_step + 1))
    assert run.stored_status == "finished"
    # to the run's token budget (the trial's Δ counted in it), whatever tier it kept
    tokens, last = metric(db, run_id, M.TOKENS_SEEN), metric(db, run_id, M.BATCH_TOKENS)
    budget = run.config["total_tokens"]
    assert budget <= tokens[run.last_step] < budget + last[run.last_step]
    ramps = store.events(db, run_id, kinds=[M.EVENT_RAMP])
    assert [e.data["source"] for e in ramps] == ([f"trial {cid}"] if kept > 1 else [])
    accum = store.series(db, run_id, M.ACCUM, width=1)
    tier = dict(zip(accum.step.tolist(), accum.last.tolist(), strict=True))
    arms = {a["factor"]: a["accum"] for a in start.data["arms"]}
    assert tier[cmd.applied_step + 1] == arms.get(kept, 4)  # the kept arm's tier runs on
