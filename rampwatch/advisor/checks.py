"""The advisor's small shared pieces: its argument checks ("a positive integer", "a positive
number", one message shape: "<name> must be …, got <value>") and the least-squares line that the
noise scale, the memory model and the critical-batch fit all draw."""

from __future__ import annotations

import math
import operator


def positive_int(name: str, value) -> int:
    """value as an int ≥ 1 (ints and numpy integers; never a bool or a float like 16.5)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if isinstance(value, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return v


def positive_number(name: str, value, what: str = "positive finite number") -> float:
    """value as a finite float > 0; `what` names the kind in the message ("positive batch
    size")."""
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a {what}, got {value!r}")
    return v


def ols_line(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of ordinary least squares of ys on xs (at least two distinct xs).
    In plain floats: every fit here has a handful of points (a step's batch sizes, a few tiers),
    where numpy's calls cost more than the sums (issue 29: once per optimizer step)."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sxx = 0.0
    for x, y in zip(xs, ys, strict=True):
        dx = x - mx
        sxy += dx * (y - my)
        sxx += dx * dx
    slope = sxy / sxx
    return my - slope * mx, slope
