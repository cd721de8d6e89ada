"""A ramp trial on a plain torch model and optimizer: snapshot, run each arm, restore, judge, keep.

Owns `Snapshot` (model, optimizer, scheduler and torch RNG state, deep-copied into host memory)
and `run_trial`. The judgement is advisor/trial.py's; the LR of a branch moves by
ramp_protocol.scale_lr, the same call a ramp makes. The loop owns its data: it hands in
`train_step(model, optimizer, start, count)`, one optimizer step on examples start..start+count
of the trial's data, so every arm reads the same examples (the control in plan.steps(1) steps of
B, branch k in plan.steps(k) steps of k·B), and `evaluate(model)`, one loss per held-out example
in a fixed order.

Arms run one after another from the same snapshot: the control first (the tolerance needs its
progress), then each k. The control is also evaluated at Δ/2 (Δ is a whole number of ×2 steps, so
its step count is even), which tells the judgement whether Δ is too long; that eval runs under
its own RNG fork, so the control's second half draws what a run that never paused would. The end state of the control and of the longest passing chain of branches
are kept (at most three copies beside the snapshot, while an arm is judged); the model ends in the kept arm's state, ready
to continue at its batch, on the examples after the trial's Δ.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rampwatch.advisor.trial import TrialPlan, TrialVerdict, judge
from rampwatch.monitor.ramp_protocol import scale_lr

__all__ = ["Snapshot", "run_trial"]


@dataclass(frozen=True)
class Snapshot:
    """Everything an arm's future depends on that torch holds: restore() puts it back exactly."""

    model: dict
    optimizer: dict
    scheduler: dict | None
    cpu_rng: torch.Tensor
    cuda_rng: list | None

    @classmethod
    def take(cls, model, optimizer, scheduler=None) -> Snapshot:
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return cls(
            model=state,
            optimizer=_to_cpu(copy.deepcopy(optimizer.state_dict())),
            scheduler=None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        )

    def restore(self, model, optimizer, scheduler=None) -> None:
        model.load_state_dict(self.model)
        # load_state_dict moves the state to the parameters' device and keeps our copy intact
        optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _to_cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    return state


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
) -> tuple[TrialVerdict, dict]:
    """Run the control and every branch of `plan` from the current state; leave the model,
    optimizer and scheduler in the kept arm's end state. Returns the verdict and, per arm k
    (1 = the control; 0: at the snapshot; "midway": the control's at Δ/2), its held-out losses
    (numpy). on_step(k, steps done, what train_step
    returned) after each step, on_arm(k, losses) after each arm's evaluation: progress. Any
    error restores the snapshot before it propagates: never a half-trained arm left in place.
    keep: end in this arm whatever the verdict (a testing aid: the trainer's --trial-keep).
    cap: no branch at or past this factor is kept (advisor/trial.py `judge`)."""
    snapshot = Snapshot.take(model, optimizer, scheduler)
    state = (model, optimizer, scheduler)

    def run_arm(k: int):
        """Arm k from the snapshot; the control's held-out losses at Δ/2 (None for a branch)."""
        snapshot.restore(*state)
        midway = []
        at_half = (lambda: midway.append(_eval_aside(evaluate, model))) if k == 1 else None
        _run_arm(plan, k, *state, train_step, start, on_step, at_half)
        return midway[0] if midway else None

    try:
        losses, kept = _arms(plan, state, run_arm, evaluate, on_arm, keep, cap)
    except BaseException:
        snapshot.restore(*state)
        raise
    branches = {k: losses[k] for k in plan.ks}
    verdict = judge(plan, losses[0], losses[1], branches, b_simple, losses["midway"], cap)
    k, end = kept.get("forced") or kept.get("branch", kept[1])
    assert k == (keep or verdict.kept_k), (k, keep, verdict.kept_k)
    end.restore(*state)
    return verdict, losses


def _arms(plan, state, run_arm, evaluate, on_arm, keep, cap) -> tuple[dict, dict]:
    """Every arm from the snapshot: held-out losses per arm (0: at the snapshot; "midway": the
    control's at Δ/2) and the end states worth keeping (the control's, the longest passing
    chain's, the forced one's)."""
    model = state[0]
    losses = {0: _eval(evaluate, model)}
    kept = {}
    for k in (1, *plan.ks):
        midway = run_arm(k)
        if k == 1:
            losses["midway"] = midway
        end = Snapshot.take(*state)  # before evaluate, which may draw RNG
        losses[k] = _eval(evaluate, model)
        if on_arm is not None:
            on_arm(k, losses[k])
        if k == keep:
            kept["forced"] = (k, end)
        if k == 1 or _passes_chain(plan, losses, k, cap):
            kept[1 if k == 1 else "branch"] = (k, end)
    return losses, kept


def _passes_chain(plan, losses, k, cap) -> bool:
    """Whether k and every smaller planned k pass (k below the cap), judged on what has run."""
    done = tuple(j for j in plan.ks if j <= k)
    branches = {j: losses[j] for j in done}
    verdict = judge(
        replace(plan, ks=done), losses[0], losses[1], branches, None, losses["midway"], cap
    )
    return verdict.k_star == k


def _eval_aside(evaluate, model):
    """_eval inside a fork of torch's RNG: what the eval draws is not the training's."""
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        return _eval(evaluate, model)


def _eval(evaluate, model):
    with torch.no_grad():
        out = evaluate(model)
    return out.detach().double().cpu().numpy() if isinstance(out, torch.Tensor) else out
