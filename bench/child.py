"""The environment of a bench's child process: this checkout's rampwatch first on its path, one
thread. A child started in another folder would otherwise import whatever rampwatch the
environment has installed (an editable install may point at another checkout), and the bench
would time or judge that code instead of this one."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child_env(**more: str) -> dict[str, str]:
    """os.environ with REPO first on PYTHONPATH, OMP_NUM_THREADS=1, and `more`."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **more}
