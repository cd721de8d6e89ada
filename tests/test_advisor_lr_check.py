"""advisor.lr_check: whether a ramp's LR change reached the optimizer, on the schedules loops use
(nanoGPT's get_lr(), a torch warmup, the reference trainer's schedule in tokens, a step decay),
for loops that carry the change out, ignore it, carry it out a step late or let it be undone."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from rampwatch.advisor.lr_check import (
    HEADLINE,
    NOT_REACHED,
    REACHED,
    TOLERANCE,
    UNCONFIRMED,
    UNCONFIRMED_HEADLINE,
    UNDONE,
    LrCheck,
)
from rampwatch.trainer.loop import lr_schedule

SQRT2 = math.sqrt(2)


def nanogpt(lr, min_lr, warmup, decay):
    """nanoGPT's get_lr(it); step s (1-based) runs iteration s − 1."""

    def get_lr(s):
        it = s - 1
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        if it > decay:
            return min_lr
        ratio = (it - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    return get_lr


def judge(schedule, ramp_step: int, m: float, logged):
    """Run the check of a ramp at ramp_step: `logged(s)` is the LR the loop logs at step s > S."""
    check = LrCheck.start(ramp_step, m, schedule(ramp_step), schedule(ramp_step - 1))
    if check is None:
        return None
    for s in range(ramp_step + 1, ramp_step + 10):
        outcome = check.observe(s, logged(s))
        if outcome is not None:
            return outcome
    raise AssertionError("no outcome")


@settings(max_examples=300, deadline=None)
@given(
    warmup=st.integers(10, 300),
    decay_extra=st.integers(40, 3000),
    ramp_at=st.integers(10, 4000),
    m=st.sampled_from([SQRT2, 2.0, 1 / SQRT2, 4.0]),
)
def test_nanogpt_get_lr_reached_when_scaled_not_reached_when_ignored(
    warmup, decay_extra, ramp_at, m
):
    """Past step 10 a nanoGPT schedule (any warmup ≥ 10, a cosine of 40 steps or more, flat
    min_lr; the warmup's end and the decay's end included) always gets a check, and it tells the
    two loops apart. A shorter cosine to lr/10 moves the LR by more than the tolerance within a
    step: test_a_schedule_steeper_than_the_tolerance_gets_no_check."""
    get_lr = nanogpt(1e-3, 1e-4, warmup, warmup + decay_extra)
    scaled = judge(get_lr, ramp_at, m, lambda s: get_lr(s) * m)
    ignored = judge(get_lr, ramp_at, m, get_lr)
    assert (scaled, ignored) == (REACHED, NOT_REACHED)


def test_a_schedule_steeper_than_the_tolerance_gets_no_check():
    """Cosine from 1e-3 to 1e-4 over 10 steps (hypothesis found it): mid-decay one step moves
    the LR by more than a third of log √2, so no check, rather than a guess."""
    get_lr = nanogpt(1e-3, 1e-4, 10, 20)
    assert judge(get_lr, 15, SQRT2, lambda s: get_lr(s) * SQRT2) is None
    assert judge(get_lr, 15, SQRT2, get_lr) is None


def test_a_step_late_change_passes_and_an_undone_one_does_not():
    get_lr = nanogpt(1e-3, 1e-4, 100, 2000)
    late = judge(get_lr, 500, SQRT2, lambda s: get_lr(s) * (SQRT2 if s > 501 else 1))
    undone = judge(get_lr, 500, SQRT2, lambda s: get_lr(s) * (SQRT2 if s == 501 else 1))
    assert (late, undone) == (REACHED, UNDONE)


def test_torch_warmup_as_in_the_own_loop_example():
    """examples/own_loop.py's LambdaLR, min(1, (s + 1)/10): step s runs at s/10 × the base."""
    sched = lambda s: 1e-2 * min(1.0, s / 10)  # noqa: E731
    assert judge(sched, 5, SQRT2, lambda s: sched(s) * SQRT2) is None  # warmup too steep to tell
    for at in (12, 30):
        assert judge(sched, at, SQRT2, lambda s: sched(s) * SQRT2) == REACHED
        assert judge(sched, at, SQRT2, sched) == NOT_REACHED


def test_the_reference_trainers_schedule_in_tokens():
    """The trainer's LR at step s is base × lr_schedule(tokens before s); a ramp ×2 at S doubles
    the tokens of each later step and moves the base by √2. At any step, never a false alarm;
    past its steep first steps, always a check (warmup end and cosine included)."""
    batch, warmup, total = 64, 64 * 40, 64 * 200

    for ramp_at in range(2, 150):

        def lr(s, base_mult=1.0, ramped=False, at=ramp_at):
            later = max(0, s - 1 - at) if ramped else 0  # steps at twice the batch
            return 3e-4 * base_mult * lr_schedule((s - 1 + later) * batch, warmup, total)

        scaled = judge(lr, ramp_at, SQRT2, lambda s, lr=lr: lr(s, SQRT2, True))
        ignored = judge(lr, ramp_at, SQRT2, lambda s, lr=lr: lr(s, 1.0, True))
        want = (None, None) if ramp_at <= 10 else (REACHED, NOT_REACHED)
        assert (scaled, ignored) in {want, (REACHED, NOT_REACHED)}, ramp_at


def test_no_check_where_it_cannot_tell():
    const = lambda s: 1e-3  # noqa: E731
    assert judge(const, 20, 1.0, const) is None  # rule 'none': the LR is not meant to move
    assert judge(const, 20, 1.03, const) is None  # within MIN_CHANGE
    assert LrCheck.start(20, SQRT2, 1e-3, 0.0) is None  # warmup from 0: no schedule to extend
    assert LrCheck.start(20, SQRT2, 0.0, 1e-3) is None
    warm = lambda s: 1e-3 * s  # noqa: E731  a linear warmup from 0
    edge = math.ceil(1 + 1 / math.expm1(TOLERANCE * math.log(SQRT2)))  # S/(S-1) within it
    assert judge(warm, edge - 1, SQRT2, warm) is None
    assert judge(warm, edge, SQRT2, warm) == NOT_REACHED


def test_a_step_decay_right_at_the_ramp_is_unconfirmed_and_said():
    sched = lambda s: 1e-2 * (0.1 if s > 30 else 1.0)  # noqa: E731  StepLR, gamma 0.1 at 31
    check = LrCheck.start(30, SQRT2, sched(30), sched(29))
    assert check.observe(31, sched(31) * SQRT2) is None
    outcome = check.observe(32, sched(32) * SQRT2)
    assert outcome == UNCONFIRMED
    assert check.message(outcome).startswith(UNCONFIRMED_HEADLINE + ": the LR was ×0.1414 at ")


def test_the_alert_says_what_was_logged_and_the_fix():
    check = LrCheck.start(40, SQRT2, 1e-3, 1e-3)
    check.observe(41, 1e-3)
    outcome = check.observe(42, 1e-3)
    text = check.message(outcome)
    assert outcome == NOT_REACHED and text.startswith(HEADLINE + ": ")
    assert "×1.0000 at step 41, ×1.0000 at step 42" in text and "not ×1.414" in text
    assert "get_lr(it) * mon.lr_scale" in text
    assert check.message(REACHED) is None
