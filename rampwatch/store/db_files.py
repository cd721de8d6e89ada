"""The Rampwatch databases under a directory: every `*.duckdb` file in it or below it, for a
team's directory of runs (`rampwatch dashboard DIR`, `rampwatch info DIR`).

Owns which files count: names ending in `.duckdb`, found recursively, sorted by path. It skips
what sits beside a live database but is not one (a writer's `<db>.spool/` folder, `<db>.wal`,
`<db>.lock`) and hidden entries (rsync's and editors' temporary files, `.git`), and it never
follows a symbolic link to a folder (a link back up would loop). It opens no file: whether each
one is a Rampwatch database is for the reader to say, file by file (store/db.py's first-contact
check), so one damaged or foreign file never hides the others.
"""

from __future__ import annotations

import os
from pathlib import Path

SUFFIX = ".duckdb"
SPOOL_SUFFIX = ".spool"  # store/db.py spool_root: <db>.spool/


def database_files(root) -> list[Path]:
    """The `*.duckdb` files under root, sorted; OSError when root itself cannot be listed (a
    folder below it that cannot be read is left out: the others are still the team's runs)."""
    root = Path(root)
    found: list[Path] = []
    todo = [root]
    while todo:
        folder = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            if folder == root:
                raise
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            try:
                if e.is_dir(follow_symlinks=False):
                    if not e.name.endswith(SPOOL_SUFFIX):
                        todo.append(Path(e.path))
                elif e.name.endswith(SUFFIX) and e.is_file():
                    found.append(Path(e.path))
            except OSError:  # gone between the listing and the look (a rename by rsync)
                continue
    return sorted(found)
