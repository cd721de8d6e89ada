"""A ramp trial on a plain torch model and optimizer: snapshot, run each arm, restore, judge, keep.

Owns `run_trial`; the copies of the run's state it takes are monitor/trial_snapshot.py's (in host
memory, or files where the caller's `place` says). The judgement is advisor/trial.py's; the LR of a branch moves by
ramp_protocol.scale_lr, the same call a ramp makes. The loop owns its data: it hands in
`train_step(model, optimizer, start, count)`, one optimizer step on examples start..start+count
of the trial's data, so every arm reads the same examples (the control in plan.steps(1) steps of
B, branch k in plan.steps(k) steps of k·B), and `evaluate(model)`, one loss per held-out example
in a fixed order.

Arms run one after another from the same snapshot: the control first (the tolerance needs its
progress), then each k while its result could still change the verdict (advisor/trial.py
`arms_left`: after a branch fails, or from the cap up, the rest are not run and cost nothing).
The control is also evaluated at Δ/2 (Δ is a whole number of ×2 steps, so its step count is
even), which tells the judgement whether Δ is too long; that eval runs under its own RNG fork,
so the control's second half draws what a run that never paused would. The end
state of the control and of the longest passing chain of branches are kept (at most three copies
beside the snapshot, while an arm is judged: trial_snapshot.COPIES; a copy no longer kept is
dropped at once); the model ends in the kept arm's state, ready to continue at its batch, on the
examples after the trial's Δ.

The second stage (Stein 1945; advisor/trial.py "What would tell"): a loop that hands in
`grow_eval` gets one more copy at Δ/2 (the snapshot, it and the control's end: three at most),
and when the control's three evaluations cannot tell whether Δ is too long, all three run
again on the held-out batch that would tell, before any branch; the branches are judged on it
too, and the first stage's losses are set aside (the verdict keeps their count). The copy is
dropped before the branches run. The larger batch is sized from the first stage's spread and
judged on its own examples with their own spread, not pooled with the first (whose examples it
may share: the reference trainer's held-out windows are spread evenly over its val split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from rampwatch.advisor.trial import (
    TrialPlan,
    TrialVerdict,
    arms_left,
    examples_to_judge_delta,
    judge,
)
from rampwatch.monitor.ramp_protocol import scale_lr
from rampwatch.monitor.trial_snapshot import COPIES, SnapshotPlace

__all__ = ["run_trial"]


def _run_arm(plan, k, model, optimizer, scheduler, train_step, start, on_step, at_half=None):
    """Train arm k for Δ; at_half() after half its steps (the control's midway eval)."""
    if k > 1:
        scale_lr(optimizer, plan.lr_factor(k), scheduler)
    count = k * plan.batch
    for i in range(plan.steps(k)):
        out = train_step(model, optimizer, start + i * count, count)
        if on_step is not None:
            on_step(k, i + 1, out)
        if at_half is not None and i + 1 == plan.steps(k) // 2:
            at_half()


def run_trial(
    plan: TrialPlan,
    model,
    optimizer,
    train_step: Callable,
    evaluate: Callable,
    start: int = 0,
    scheduler=None,
    b_simple: float | None = None,
    on_step: Callable | None = None,
    on_arm: Callable | None = None,
    keep: int | None = None,
    cap: int | None = None,
    place: SnapshotPlace | None = None,
    grow_eval: Callable | None = None,
    on_stage: Callable | None = None,
) -> tuple[TrialVerdict, dict]:
    """Run the control and every branch of `plan` from the current state; leave the model,
    optimizer and scheduler in the kept arm's end state. Returns the verdict and, per arm k
    (1 = the control; 0: at the snapshot; "midway": the control's at Δ/2), its held-out losses
    (numpy). on_step(k, steps done, what train_step
    returned) after each step, on_arm(k, losses) after each arm's evaluation: progress. Any
    error restores the snapshot before it propagates: never a half-trained arm left in place.
    keep: end in this arm whatever the verdict (a testing aid: the trainer's --trial-keep).
    cap: no branch at or past this factor is kept (advisor/trial.py `judge`). place: where the
    copies go (trial_snapshot.place_snapshots; None: host memory); the caller closes it.
    grow_eval(n): from now on evaluate() scores n held-out examples, or as many as it can;
    returns how many. Given, a control whose three evaluations cannot tell whether Δ is too long
    is evaluated again on the batch that would tell before any branch runs (the second stage,
    module docstring); on_stage(first, examples) says so before it starts."""
    place = place or SnapshotPlace(None, 0, COPIES)
    state = (model, optimizer, scheduler)
    snapshot = place.take(*state)
    stages = _Stages(evaluate, grow_eval, on_stage, snapshot) if grow_eval else None

    def run_arm(k: int):
        """Arm k from the snapshot; the control's held-out losses at Δ/2 (None for a branch)."""
        snapshot.restore(*state)
        midway = []

        def at_half():
            midway.append(_eval_aside(evaluate, model))
            if stages is not None:
                stages.midway = place.take(*state)

        _run_arm(plan, k, *state, train_step, start, on_step, at_half if k == 1 else None)
        return midway[0] if midway else None

    try:
        losses, kept = _arms(plan, state, place, run_arm, evaluate, on_arm, keep, cap, stages)
    except BaseException:
        snapshot.restore(*state)
        raise
    finally:
        if stages is not None:
            stages.drop_midway()
    branches = {k: losses[k] for k in plan.ks if k in losses}
    verdict = judge(plan, losses[0], losses[1], branches, b_simple, losses["midway"], cap)
    if stages is not None and stages.first is not None:
        verdict = replace(verdict, first_examples=stages.first)
    k, end = kept.get("forced") or kept.get("branch", kept[1])
    assert k == (keep or verdict.kept_k), (k, keep, verdict.kept_k)
    end.restore(*state)
    return verdict, losses


def _arms(plan, state, place, run_arm, evaluate, on_arm, keep, cap, stages) -> tuple[dict, dict]:
    """The arms from the snapshot, in order, while one could change the verdict (advisor/
    trial.py `arms_left`; `keep` runs up to its arm whatever): held-out losses per arm (0: at
    the snapshot; "midway": the control's at Δ/2) and the end states worth keeping (the
    control's, the longest passing chain's, the forced one's); a copy kept by none of them is
    dropped."""
    model = state[0]
    losses = {0: _eval(evaluate, model)}
    kept, so_far = {}, None  # so_far: the verdict on the arms run so far (None before any)
    for k in (1, *plan.ks):
        if k > 1 and (keep is None or k > keep) and k not in arms_left(so_far):
            break
        midway = run_arm(k)
        if k == 1:
            losses["midway"] = midway
        end = place.take(*state)  # before evaluate, which may draw RNG
        losses[k] = _eval(evaluate, model)
        if k == 1 and stages is not None:
            stages.second(plan, losses, state, end)
        if on_arm is not None:
            on_arm(k, losses[k])
        so_far = _so_far(plan, losses, cap)
        held = [copy for _, copy in kept.values()]
        if k == keep:
            kept["forced"] = (k, end)
        if k == 1 or so_far.k_star == k:  # k and every smaller k passed
            kept[1 if k == 1 else "branch"] = (k, end)
        for copy in (*held, end):
            if all(copy is not other for _, other in kept.values()):
                copy.drop()
    return losses, kept


class _Stages:
    """The second stage: when the control's evaluations at the snapshot, Δ/2 and Δ cannot tell
    whether Δ is too long, all three again on the held-out batch that would tell (advisor/
    trial.py `examples_to_judge_delta`), from the snapshot, a copy taken at Δ/2 and the
    control's end; the branches are then evaluated on that batch too. `first`: the examples
    the first stage scored, once a second ran."""

    def __init__(self, evaluate, grow_eval, on_stage, snapshot):
        self.evaluate, self.grow_eval, self.on_stage = evaluate, grow_eval, on_stage
        self.snapshot, self.midway, self.first = snapshot, None, None

    def second(self, plan, losses, state, end) -> None:
        n = len(losses[1])
        want = examples_to_judge_delta(plan, losses[0], losses["midway"], losses[1])
        got = 0 if want is None or self.midway is None else self.grow_eval(want)
        if got <= n:
            self.drop_midway()
            return
        if self.on_stage is not None:
            self.on_stage(n, got)
        again = {}
        for key, copy in ((0, self.snapshot), ("midway", self.midway), (1, end)):
            copy.restore(*state)
            again[key] = _eval_aside(self.evaluate, state[0])
        if len({len(v) for v in again.values()}) != 1 or len(again[1]) <= n:
            raise ValueError(
                f"evaluate() scored {[len(v) for v in again.values()]} held-out examples at the "
                f"snapshot, Δ/2 and Δ after grow_eval({want}) said {got}: every "
                "evaluation of a trial's second stage must score the same, larger batch"
            )
        losses.update(again)
        self.first = n
        self.drop_midway()

    def drop_midway(self) -> None:
        if self.midway is not None:
            self.midway.drop()
            self.midway = None


def _so_far(plan, losses, cap) -> TrialVerdict:
    """The verdict on the arms run so far."""
    branches = {k: losses[k] for k in plan.ks if k in losses}
    return judge(plan, losses[0], losses[1], branches, None, losses["midway"], cap, partial=True)


def _eval_aside(evaluate, model):
    """_eval inside a fork of torch's RNG: what the eval draws is not the training's."""
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        return _eval(evaluate, model)


def _eval(evaluate, model):
    with torch.no_grad():
        out = evaluate(model)
    return out.detach().double().cpu().numpy() if isinstance(out, torch.Tensor) else out
