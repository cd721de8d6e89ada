"""Module names say what a module is wherever they are read: no two files in the package share
a name, but each subpackage's own `__init__` and `cli` (its command line)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import rampwatch

PER_SUBPACKAGE = {"__init__.py", "cli.py"}


def test_no_two_modules_share_a_name():
    root = Path(rampwatch.__file__).parent
    names = Counter(p.name for p in root.rglob("*.py") if p.name not in PER_SUBPACKAGE)
    assert [n for n, k in names.items() if k > 1] == []
