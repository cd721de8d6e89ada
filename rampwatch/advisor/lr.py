"""Learning-rate rules for a batch ramp: which rule an optimizer gets, and the new base LR.

Owns: the optimizer → rule table, `rule_for` (`rule_for_type`: by class and base class), `lr_multiplier`, `scaled_base_lr`, `ramp_lr`
(base LR plus a warning past the noise scale).

Rules:
  'linear' lr ∝ B      SGD / SGD with momentum (Goyal et al. 2017, "Accurate, Large Minibatch
                       SGD", §2.1 linear scaling rule).
  'sqrt'   lr ∝ √B     Adam-family and other adaptive optimizers (Malladi et al. 2022, "On the
                       SDEs and Scaling Rules for Adaptive Gradient Algorithms", NeurIPS: their
                       square-root scaling rule for RMSprop and Adam; Hoffer et al. 2017 argue
                       √ from matching the update's variance).
  'none'   lr fixed.

Exactness: the new LR is always computed from the ORIGINAL base LR and ORIGINAL batch of the run
(`scaled_base_lr(original_base, original_batch, new_batch, rule)`), never by compounding the
previous value. So any sequence of ramps that returns to the original batch restores the original
base LR bit for bit (the ratio is exactly 1.0 and x·1.0 == x in IEEE arithmetic), and going to the
same batch by different routes gives the same float. Scale the scheduler's *base* LR (e.g.
`scheduler.base_lrs` / `group['initial_lr']`), not the current, already-scheduled value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rampwatch.advisor.checks import positive_number
from rampwatch.advisor.gns import examples_ratio, steps_ratio
from rampwatch.advisor.gns_window import significant

__all__ = [
    "RULES",
    "OPTIMIZER_RULES",
    "rule_for",
    "rule_for_type",
    "lr_multiplier",
    "scaled_base_lr",
    "noise_scale_warning",
    "LRChange",
    "ramp_lr",
]

RULES = ("sqrt", "linear", "none")

# Normalized optimizer name (lower case, letters and digits only) -> rule.
OPTIMIZER_RULES: dict[str, str] = {
    **dict.fromkeys(
        (
            "adam",
            "adamw",
            "nadam",
            "nadamw",
            "radam",
            "adamax",
            "sparseadam",
            "amsgrad",
            "lamb",
            "adafactor",
            "rmsprop",
            "adabelief",
            "adan",
            "fusedadam",
            "fusedlamb",
            "fusedadamw",  # apex / DeepSpeed
            "adam8bit",
            "adamw8bit",
            "pagedadam",
            "pagedadamw",
            "pagedadamw8bit",  # bitsandbytes
            "cpuadam",
            "deepspeedcpuadam",
        ),
        "sqrt",
    ),
    **dict.fromkeys(
        ("sgd", "sgdmomentum", "sgdm", "sgdnesterov", "nesterov", "momentum"), "linear"
    ),
}


def _normalize(name: str) -> str:
    # 'torch.optim.AdamW' -> 'adamw'; 'sgd-momentum' -> 'sgdmomentum'
    return re.sub(r"[^a-z0-9]", "", str(name).rsplit(".", 1)[-1].lower())


def rule_for(optimizer: str | None = None, rule: str | None = None) -> str:
    """The LR rule to use: `rule` if named ('sqrt', 'linear', 'none'), else the optimizer's.

    Optimizer names are case-insensitive and may be torch class names ('AdamW', 'SGD') or dotted
    paths ('torch.optim.AdamW'). An optimizer without a known rule is refused: name a rule.
    """
    if rule is not None:
        r = str(rule).strip().lower()
        if r not in RULES:
            raise ValueError(f"unknown LR rule {rule!r}: use one of {', '.join(RULES)}")
        return r
    if optimizer is None or not str(optimizer).strip():
        raise ValueError(
            "no optimizer and no LR rule given: pass optimizer='adamw' (or 'sgd'), or rule='sqrt'/'linear'/'none'"
        )
    key = _normalize(optimizer)
    if key in RULES:  # a rule name passed where the optimizer goes
        return key
    if key not in OPTIMIZER_RULES:
        raise ValueError(
            f"no learning-rate rule known for optimizer {optimizer!r}: pass the rule explicitly "
            "(rule='sqrt' for adaptive optimizers, 'linear' for SGD, 'none' to keep the LR)"
        )
    return OPTIMIZER_RULES[key]


def rule_for_type(optimizer_type: type, rule: str | None = None) -> str:
    """rule_for of an optimizer class: its own name's rule, else its nearest base class's (a
    loop's own AdamW subclass moves the LR as AdamW does), else refused under its own name."""
    if rule is None:
        for cls in optimizer_type.__mro__:
            if (key := _normalize(cls.__name__)) in OPTIMIZER_RULES:
                return OPTIMIZER_RULES[key]
    return rule_for(optimizer_type.__name__, rule)


def _batch(name: str, value) -> float:
    return positive_number(name, value, "positive batch size")


def lr_multiplier(old_batch: float, new_batch: float, rule: str) -> float:
    """LR factor for going from old_batch to new_batch: √(B'/B), B'/B or 1."""
    r = rule_for(rule=rule)
    ratio = _batch("new_batch", new_batch) / _batch("old_batch", old_batch)
    if r == "sqrt":
        return math.sqrt(ratio)
    if r == "linear":
        return ratio
    return 1.0


def scaled_base_lr(
    original_base: float, original_batch: float, new_batch: float, rule: str
) -> float:
    """The base LR for `new_batch`, computed from the run's original base LR and batch.

    Always relative to the original (never compounded), so returning to the original batch gives
    `original_base` exactly.
    """
    base = float(original_base)
    if not math.isfinite(base) or base < 0:
        raise ValueError(
            f"original_base must be a finite learning rate >= 0, got {original_base!r}"
        )
    return base * lr_multiplier(original_batch, new_batch, rule)


def noise_scale_warning(new_batch: float, b_noise: float | None, beyond: float = 1.0) -> str | None:
    """A note when the new batch exceeds `beyond` × the gradient noise scale, else None.

    beyond: where the warning starts, as a multiple of the noise scale; the card passes the top
    of the ramp policy's band (RampPolicy.band_cost's batch_high), so the policy's own ramp
    never warns against itself."""
    if b_noise is None or not math.isfinite(float(b_noise)) or b_noise <= 0:
        return None
    nb = _batch("new_batch", new_batch)
    edge = float(beyond) * float(b_noise)
    if nb <= edge:
        return None
    saves = 1 - steps_ratio(2 * edge, b_noise) / steps_ratio(edge, b_noise)
    costs = examples_ratio(2 * edge, b_noise) / examples_ratio(edge, b_noise) - 1
    times = "" if beyond == 1 else f"{beyond:g}× "
    band = "" if beyond == 1 else ", the top of the policy's band"
    return (
        f"batch {nb:g} exceeds {times}the gradient noise scale ({significant(float(b_noise))} "
        f"sequences){band}: a doubling there saves at most {saves:.0%} of the steps for at least "
        f"{costs:.0%} more examples (McCandlish et al. 2018, §2.3), and the scaled learning rate "
        "may be too high; watch the loss"
    )


@dataclass(frozen=True)
class LRChange:
    """What a ramp does to the learning rate."""

    rule: str
    multiplier: float  # relative to the ORIGINAL batch of the run
    base_lr: float  # new base LR of the schedule
    warning: str | None


def ramp_lr(
    original_base_lr: float,
    original_batch: float,
    new_batch: float,
    optimizer: str | None = None,
    rule: str | None = None,
    b_noise: float | None = None,
) -> LRChange:
    """New schedule base LR for a ramp to `new_batch` (sequences), with a noise-scale warning."""
    r = rule_for(optimizer, rule)
    mult = lr_multiplier(original_batch, new_batch, r)
    return LRChange(
        rule=r,
        multiplier=mult,
        base_lr=scaled_base_lr(original_base_lr, original_batch, new_batch, r),
        warning=noise_scale_warning(new_batch, b_noise),
    )
