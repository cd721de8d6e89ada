"""examples/nanogpt_loop.py in a child process, as written or with its LR lines changed the way a
user might write them, waiting at one step boundary until the test's command has been claimed.

    python -m tests.nanogpt_child WAIT_AT OUT.json VARIANT DB [auto] [float16]

VARIANT: `readme` (the example as written: get_lr(it) * mon.lr_scale), `constants` (the
schedule's own constants times ramp.lr_multiplier instead) or `ignored` (what the issue's user
wrote: get_lr(it) alone and the own-loop snippet's ramp.scale_lr(optimizer), which the next
iteration's get_lr() overwrites). Prints "run ID" at the first boundary; OUT.json gets the
monitor's lr_scale and base LR and the GradScaler's scale at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.procs import REPO, wait_at_boundary

EXAMPLE = REPO / "examples" / "nanogpt_loop.py"
LR_LINE = "lr = get_lr(it) * mon.lr_scale"
APPLIED = "        mon.ramp_applied(ramp)"
VARIANTS = {
    "readme": [],
    "constants": [
        (LR_LINE, "lr = get_lr(it)"),
        (
            APPLIED,
            "        learning_rate, min_lr = (learning_rate * ramp.lr_multiplier, "
            "min_lr * ramp.lr_multiplier)\n" + APPLIED,
        ),
    ],
    "ignored": [
        (LR_LINE, "lr = get_lr(it)"),
        (APPLIED, "        ramp.scale_lr(optimizer)\n" + APPLIED),
    ],
}


def source(variant: str) -> str:
    text = EXAMPLE.read_text()
    for old, new in VARIANTS[variant]:
        if text.count(old) != 1:  # the example changed: this variant no longer tests anything
            raise SystemExit(f"{EXAMPLE.name} has {text.count(old)} copies of {old.strip()!r}")
        text = text.replace(old, new)
    return text


def main() -> None:
    wait_at, out, variant, args = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    wait_at_boundary(wait_at)
    sys.argv = [str(EXAMPLE), *args]
    scope = {"__name__": "__main__", "__file__": str(EXAMPLE)}
    exec(compile(source(variant), str(EXAMPLE), "exec"), scope)
    mon = scope["mon"]
    out.write_text(
        json.dumps(
            {
                "lr_scale": mon.lr_scale,
                "base_lr": mon.state_dict()["base_lr"],
                "auto_paused": mon.state_dict().get("auto_paused"),
                "grad_scale": scope["scaler"].get_scale(),
            }
        )
    )


if __name__ == "__main__":
    main()
