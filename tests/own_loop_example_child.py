"""examples/own_loop.py exactly as written (runpy), with one knob for the tests: the loop waits at
one step boundary until the test's command has been claimed (it would otherwise finish first).

    python -m tests.own_loop_example_child WAIT_AT DB [auto] [trials]

Prints "run ID" at the first boundary, before any wait.
"""

from __future__ import annotations

import runpy
import sys

from rampwatch import Monitor
from tests.procs import REPO, wait_for_ramp

EXAMPLE = REPO / "examples" / "own_loop.py"


def main() -> None:
    wait_at, args = int(sys.argv[1]), sys.argv[2:]
    ramp_due = Monitor.ramp_due

    def waiting_ramp_due(mon):
        if mon.last_step == 1:
            print(f"run {mon.run_id}", flush=True)
        asked = []

        def claimed():  # a ramp, or a trial that the loop's trial_due() will hand out next
            asked.append(ramp_due(mon))
            return asked[-1] or mon.ramps.trials.pending

        wait_for_ramp(claimed, mon.last_step == wait_at)
        return asked[-1]

    Monitor.ramp_due = waiting_ramp_due
    sys.argv = [str(EXAMPLE), *args]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
