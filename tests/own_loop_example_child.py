"""examples/own_loop.py exactly as written (runpy), with one knob for the tests: the loop waits at
one step boundary until the test's command has been claimed (it would otherwise finish first).

    python -m tests.own_loop_example_child WAIT_AT DB [auto] [trials]

Prints "run ID" at the first boundary, before any wait.
"""

from __future__ import annotations

import runpy
import sys

from tests.procs import REPO, wait_at_boundary

EXAMPLE = REPO / "examples" / "own_loop.py"


def main() -> None:
    wait_at, args = int(sys.argv[1]), sys.argv[2:]
    wait_at_boundary(wait_at)
    sys.argv = [str(EXAMPLE), *args]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
