"""A loop that computes its own LR (examples/nanogpt_loop.py: nanoGPT's get_lr() writes every
param group's lr each iteration, no torch scheduler), run as a real child process against a real
DuckDB file (tests/nanogpt_child.py): the README's code for such loops moves the LR by the ramp's
multiplier at every step after it; a loop that ignores the multiplier (issue 27: get_lr() alone,
with the own-loop snippet's ramp.scale_lr()) keeps its LR, and gets the alert, a record that does
not claim the change, and the card saying so. float16's GradScaler: grad_scale= undoes it.
"""

from __future__ import annotations

import json
import math

import pytest

from rampwatch import store
from rampwatch.advisor.lr_check import HEADLINE
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed
from tests.procs import REPO, children, start_loop

pytestmark = pytest.mark.timeout(300)

RAMP_AT = 20  # the boundary the child waits at for the test's command (past the 10-step warmup)
STEPS = 60  # the example's max_iters
RAMP = {"per_device_batch": 8, "accum": 4}  # ×2 by accumulation from 8 × 2: AdamW's √2


def run(procs, tmp_path, variant: str, *args: str, ramp: bool = True):
    """The example (variant: tests/nanogpt_child.py) to the end; with ramp, the test's ramp
    command is sent at its first boundary and taken at RAMP_AT. Returns (db, run id, out, log)."""
    db, out = tmp_path / f"{variant}.duckdb", tmp_path / f"{variant}.json"
    wait_at = RAMP_AT if ramp else 0
    proc, run_id = start_loop(
        procs, ["-m", "tests.nanogpt_child", str(wait_at), str(out), variant, str(db), *args]
    )
    cid = commands.submit(db, run_id, "ramp", RAMP, actor="test") if ramp else None
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    if cid is not None:
        cmd = commands.get(db, cid)
        assert (cmd.status, cmd.applied_step) == ("applied", RAMP_AT), cmd
    return db, run_id, json.loads(out.read_text()), stdout + stderr


def lr_by_step(db, run_id) -> dict[int, float]:
    s = store.series(db, run_id, M.LR, width=1)
    return dict(zip(s.step.tolist(), s.last.tolist(), strict=True))


def lr_alerts(db, run_id):
    return [
        e
        for e in store.events(db, run_id, kinds=[M.EVENT_ALERT])
        if (e.data or {}).get("cause") == "lr_check"
    ]


@pytest.fixture(scope="module")
def unramped(tmp_path_factory):
    """The same loop with no ramp: the schedule the ramped runs are measured against."""
    with children() as procs:
        db, run_id, out, _ = run(procs, tmp_path_factory.mktemp("unramped"), "readme", ramp=False)
    return lr_by_step(db, run_id), db, run_id, out


@pytest.mark.parametrize("variant", ["readme", "constants"])
def test_the_readme_code_moves_the_lr_by_the_multiplier_at_every_step(
    tmp_path, procs, unramped, variant
):
    """readme: lr = get_lr(it) * mon.lr_scale, as the example and the README write it;
    constants: the schedule's learning_rate and min_lr times ramp.lr_multiplier."""
    base, *_ = unramped
    db, run_id, out, _ = run(procs, tmp_path, variant)
    lr = lr_by_step(db, run_id)
    assert sorted(lr) == sorted(base) == list(range(1, STEPS + 1))
    for step in lr:  # the unramped schedule, then that schedule × √2 from the first ramped step
        want = base[step] * (math.sqrt(2) if step > RAMP_AT else 1.0)
        assert lr[step] == pytest.approx(want, rel=1e-9), step
    ramps = store.events(db, run_id, kinds=[M.EVENT_RAMP])
    assert [e.step for e in ramps] == [RAMP_AT]
    assert lr_alerts(db, run_id) == []  # the check found the change where it should be
    assert out["lr_scale"] == pytest.approx(math.sqrt(2), rel=1e-12)
    accum = store.series(db, run_id, M.ACCUM, width=1)
    assert [int(v) for v in accum.last] == [2] * RAMP_AT + [4] * (STEPS - RAMP_AT)


def test_a_loop_that_ignores_the_multiplier_gets_the_alert_and_an_honest_record(
    tmp_path, procs, unramped, monkeypatch
):
    base, *_ = unramped
    db, run_id, out, log = run(procs, tmp_path, "ignored")
    lr = lr_by_step(db, run_id)
    for step in lr:  # issue 27's symptom: the batch doubled, the LR never moved
        assert lr[step] == pytest.approx(base[step], rel=1e-9), step
    [alert] = lr_alerts(db, run_id)
    assert alert.step == RAMP_AT + 2 and alert.message.startswith(HEADLINE + ": the LR was ×")
    assert alert.data["outcome"] == "not reached" and alert.data["ramp_step"] == RAMP_AT
    ratios = alert.data["lr_ratios"]  # against the schedule extended past the ramp: about 1
    assert sorted(ratios) == [str(RAMP_AT + 1), str(RAMP_AT + 2)]
    assert all(v == pytest.approx(1.0, abs=0.01) for v in ratios.values())
    # the record: the ramp's event as written, then the alert; the run's base LR is the old one
    ramps = store.events(db, run_id, kinds=[M.EVENT_RAMP])
    assert [e.step for e in ramps] == [RAMP_AT]
    assert alert.data["base_lr"] == out["base_lr"] == pytest.approx(1e-2)
    assert out["lr_scale"] == 1.0
    assert log.count(HEADLINE) == 1  # on stderr too (the example passes no echo)
    at = seed.app(monkeypatch, db)
    text = seed.texts(at)
    assert f"Ramp #1 to 8 per device × 4 accumulation was applied at step {RAMP_AT}." in text
    assert f"The ramp at step {RAMP_AT}: {HEADLINE}: the LR was ×" in text
    assert any(HEADLINE in str(w.value) for w in at.warning)


def test_auto_ramps_stop_when_the_loop_did_not_carry_the_lr(tmp_path, procs):
    """ramp='auto' and a loop that ignores the multiplier: after the failed check no further
    ramp is taken on its own (each would grow the batch at the old LR again); the alert says
    so and how to go on, and the pause is in the monitor's state (a resume keeps it)."""
    db, run_id, out, _ = run(procs, tmp_path, "ignored", "auto")
    [alert] = lr_alerts(db, run_id)
    assert alert.data["outcome"] == "not reached" and alert.data["auto_paused"] is True
    assert "auto ramps are paused" in alert.message and "approve" in alert.message
    assert out["auto_paused"] is True
    ramps = store.events(db, run_id, kinds=[M.EVENT_RAMP])
    assert [e.step for e in ramps] == [RAMP_AT]


def test_float16_with_a_grad_scaler_logs_the_unscaled_gradient(tmp_path, procs, unramped):
    """The example's float16 path on the CPU: autocast and a live GradScaler (scale 2^16, so a
    norm left scaled would be 65,536 times too large); grad_scale= gives the float32 norm."""
    _, db32, run32, _ = unramped
    db, run_id, out, _ = run(procs, tmp_path, "readme", "float16", ramp=False)
    assert out["grad_scale"] > 1.0
    norm16 = store.series(db, run_id, M.GRAD_NORM, width=1).last[0]
    norm32 = store.series(db32, run32, M.GRAD_NORM, width=1).last[0]
    assert norm16 == pytest.approx(norm32, rel=1e-2)


def test_the_readme_shows_the_examples_loop_as_it_is():
    readme = (REPO / "README.md").read_text()
    code = (REPO / "examples/nanogpt_loop.py").read_text().split("# --- the integration")[1]
    body = [line for line in code.splitlines()[1:] if line.strip()]
    missing = [line for line in body if line not in readme]
    assert not missing, f"README's nanoGPT snippet differs from examples/nanogpt_loop.py: {missing}"
