"""What a ramped run that keeps its token budget shows in its database, against an unramped run of
the same schedule (tests/test_own_loop_ramps.py, test_integration_transformers.py,
test_integration_lightning.py): it ends at the budget its config records (± one step), and the
LR it logged at every token is the unramped run's at that token × the multiplier of every ramp
before it (the unramped LR interpolated by tokens: the runs' steps end at different tokens)."""

from __future__ import annotations

import math

import numpy as np

from rampwatch import store
from rampwatch.store import names as M


def _per_step(db, run_id) -> dict[str, np.ndarray]:
    out = {}
    for name in (M.LR, M.TOKENS_SEEN, M.BATCH_TOKENS):
        s = store.series(db, run_id, name, width=1)
        out["step"], out[name] = s.step, s.last
    out["before"] = out[M.TOKENS_SEEN] - out[M.BATCH_TOKENS]  # the tokens the step's LR is at
    return out


def assert_keeps_budget(db, run_id, unramped_db, unramped_id) -> dict[str, np.ndarray]:
    """Asserts both; returns the ramped run's per-step series (step, lr, tokens, before)."""
    budget = store.get_run(db, run_id).config["total_tokens"]
    assert store.get_run(unramped_db, unramped_id).config["total_tokens"] == budget
    ramped, plain = _per_step(db, run_id), _per_step(unramped_db, unramped_id)
    end, last_step = ramped[M.TOKENS_SEEN][-1], ramped[M.BATCH_TOKENS][-1]
    assert budget <= end < budget + last_step, (budget, end, last_step)
    assert plain[M.TOKENS_SEEN][-1] == budget
    mult = np.ones(len(ramped["step"]))
    for e in store.events(db, run_id, kinds=[M.EVENT_RAMP]):  # each ramp's LR multiplier
        mult[ramped["step"] > e.step] *= e.data["after"]["base_lr"] / e.data["before"]["base_lr"]
    assert not math.isclose(mult[-1], 1.0), "no ramp moved the LR"
    want = np.interp(ramped["before"], plain["before"], plain[M.LR]) * mult
    assert ramped["before"][-1] <= plain["before"][-1]  # inside the unramped run: no extrapolation
    np.testing.assert_allclose(ramped[M.LR], want, rtol=1e-9, err_msg="LR at the same token")
    return ramped
