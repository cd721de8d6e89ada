"""monitor/ramp_protocol.py scale_lr: a ramp's LR move survives the loop's scheduler. For every schedule
whose LR is base × f(step), scaling at step s must give exactly the trajectory of a run started
with m × the base LR, from step s on (torch's own schedulers, chained and sequential ones, and
the Hugging Face warmup schedules, which are LambdaLR)."""

from __future__ import annotations

import pytest
import torch
from torch.optim import lr_scheduler as S

from rampwatch.monitor.ramp_protocol import scale_lr

SCHEDULES = {
    "lambda (HF warmup)": lambda o: S.LambdaLR(o, lambda t: min(1.0, (t + 1) / 5)),
    "cosine": lambda o: S.CosineAnnealingLR(o, T_max=20),
    "step": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "one cycle": lambda o: S.OneCycleLR(o, max_lr=o.param_groups[0]["lr"], total_steps=30),
    "sequential": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, 0.1, total_iters=4), S.CosineAnnealingLR(o, T_max=20)], milestones=[4]
    ),
    "chained": lambda o: S.ChainedScheduler([S.ExponentialLR(o, 0.9), S.StepLR(o, 4, 0.5)]),
}


def _lrs(make, base: float, scale_at: int | None, mult: float, steps: int = 16) -> list[list]:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW(
        [{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": base / 10}],
        lr=base,
    )
    sched = make(opt)
    out = []
    for t in range(steps):
        opt.step()
        sched.step()
        if t == scale_at:
            scale_lr(opt, mult, sched)
        out.append([g["lr"] for g in opt.param_groups])
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_scaling_mid_run_equals_starting_at_the_scaled_lr(name):
    make, s, m = SCHEDULES[name], 6, 2**0.5
    scaled, started_higher = _lrs(make, 1e-3, s, m), _lrs(make, 1e-3 * m, None, 1.0)
    for t in range(s, len(scaled)):  # both param groups, every step after the ramp
        assert scaled[t] == pytest.approx(started_higher[t], rel=1e-9), (name, t)


def test_a_bad_multiplier_is_refused_with_its_value():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="positive number, got nan"):
        scale_lr(opt, float("nan"))
    assert opt.param_groups[0]["lr"] == 0.1
