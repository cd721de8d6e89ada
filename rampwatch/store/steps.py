"""What a step is: a non-negative integer (an optimizer step count, from 0 as Lightning and HF
count), and the reason a value is not one.

Why strict: a step is a row key and a chart's x axis. A float step (2.0 from a division), a bool
(True from a flag passed in the wrong slot) or a string ("23" read from a file name) is a bug in
the caller that would otherwise be stored under a step nobody meant; a negative one broke
bucket-width choices. int, numpy integers and 0-d integer tensors are accepted (they implement
__index__); everything else is refused with the reason, which RunWriter.log() counts (it never
raises into the training loop) and the other entry points raise as ValueError.
"""

from __future__ import annotations

import operator

MAX_STEP = (1 << 62) - 1  # BIGINT with headroom: step >> k and bucket arithmetic never overflow


def step_problem(step) -> tuple[int | None, str | None]:
    """(step as int, None), or (None, a short reason naming what is wrong)."""
    if type(step) is int:  # the hot path: no bool (type(True) is bool)
        value = step
    else:
        if isinstance(step, bool) or "bool" in str(getattr(step, "dtype", "")):
            return None, "step is a bool"
        if isinstance(step, (str, bytes)):
            return None, f"step is a {type(step).__name__}"
        try:
            value = operator.index(step)  # int subclasses, numpy integers, 0-d int tensors
        except TypeError:
            kind = (
                "float"
                if isinstance(step, float) or "float" in str(getattr(step, "dtype", ""))
                else type(step).__name__
            )
            return None, f"step is a {kind}"
    if value < 0:
        return None, "step is negative"
    if value > MAX_STEP:
        return None, "step is too large"
    return value, None


def as_step(step, what: str = "step") -> int:
    """The step as an int, or ValueError saying what is wrong and what to pass."""
    value, problem = step_problem(step)
    if problem is not None:
        raise ValueError(
            f"{what} must be a non-negative integer (an optimizer step count, "
            f"0 .. {MAX_STEP}); got {step!r}: {problem}"
        )
    return value
