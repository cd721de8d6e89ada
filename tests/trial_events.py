"""Trial events as the loop writes them (the issue-26 contract), for the store and page tests:
built with a real verdict (advisor/trial.py) and written through a real RunWriter."""

from __future__ import annotations

from rampwatch.store import names as M

TRIALS_ON = {"trial_delta_tokens": 65_536}
TRIAL = {"factors": [2, 4], "delta_tokens": None}


def verdict(flattened: bool = False, stalled: bool = False, first_fails: bool = False) -> dict:
    """A real verdict's dict (advisor/trial.py), as the loop's trial_end event carries it.
    flattened: the control made all its progress by Δ/2, so Δ was too long (nothing judged);
    stalled: the control did not learn over Δ (held-out loss up), so nothing is bracketed;
    first_fails: ×2 fell behind, so ×4 was not run."""
    from rampwatch.advisor.trial import TrialPlan, judge

    plan = TrialPlan(batch=16, ks=(2, 4), delta_tokens=65_536, rule="sqrt", tokens_per_example=128)
    snapshot, control = [3.0, 3.1, 2.9, 3.0], [2.0, 2.2, 1.9, 2.1]
    if stalled:
        snapshot = [1.99, 2.19, 1.89, 2.09]
    midway = [2.05, 2.2, 1.95, 2.1] if flattened else None
    branches = {2: [2.0, 2.2, 1.9, 2.1], 4: [2.6, 2.9, 2.5, 2.8]}
    if first_fails:
        branches = {2: branches[4]}
    return judge(plan, snapshot, control, branches, midway_losses=midway).to_dict()


def start(trial_id=7, command_id=7, step=399) -> dict:
    return dict(
        step=step,
        kind=M.EVENT_TRIAL_START,
        message="trial ×2, ×4 from step 399: 2 × 65,536 tokens discarded at most (1.3% of the "
        "run, ~2 min)",
        data={
            "trial_id": trial_id,
            "command_id": command_id,
            "tier": {"per_device_batch": 8, "accum": 2, "world_size": 1},
            "factors": [2, 4],
            "delta_tokens": 65_536,
            "seq_len": 128,
            "lr_rule": "sqrt",
            "cost_tokens": 131_072,
            "cost_fraction": 0.013,
            "cost_seconds": 120.0,
            "source": f"command {command_id}",
        },
    )


def arms(trial_id=7, step=399) -> list[dict]:
    out = []
    for factor in (1, 2, 4):
        for tokens, loss in ((32_768, 2.4), (65_536, 2.3)):
            done = tokens == 65_536
            data = {"trial_id": trial_id, "factor": factor, "tokens": tokens}
            data.update(loss=loss + 0.01 * factor, eval_loss=2.35 if done else None, done=done)
            out.append(dict(step=step, kind=M.EVENT_TRIAL_ARM, message=None, data=data))
    return out


def end(
    trial_id=7, continue_step=415, flattened: bool = False, stalled: bool = False,
    first_fails: bool = False,
) -> dict:  # fmt: skip
    v = verdict(flattened, stalled, first_fails)
    kept = 1 if flattened or stalled or first_fails else 2
    data = {"trial_id": trial_id, "verdict": v, "kept_factor": kept, "continue_step": continue_step}
    data.update(cost_tokens=65_536, cost_seconds=58.5)
    return dict(step=continue_step, kind=M.EVENT_TRIAL_END, message="kept ×2", data=data)


def write(w, events) -> None:
    for e in events:
        w.event(e["kind"], e["message"], step=e["step"], data=e["data"])
    assert w.flush(), w.stats()
