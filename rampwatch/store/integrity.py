"""Checking a DuckDB file before trusting it: a truncated file, and DuckDB's own corruption
errors, become one DatabaseCorruptError that names the file and says what to do.

Why: DuckDB opens a truncated file without complaint as long as its catalog is intact, accepts
writes (into its WAL) and fails only when a later read reaches a missing block; by then a
writer had deleted its spool. So on first contact (db._precheck, once per process and file)
every block the file says it uses, the catalog's metadata blocks (pragma_metadata_info) and
each table's column segments (pragma_storage_info), must lie inside the file: 3 header pages of
4 KiB, then blocks of block_size bytes. A cheaper test of the header's block count alone is
not enough: DuckDB counts free blocks at the end that it has already cut off the file.
"""

from __future__ import annotations

import re
from pathlib import Path

from rampwatch.store.errors import DatabaseCorruptError

HEADER_BYTES = 3 * 4096
_MARKERS = (
    "corrupt database file",
    "could not read enough bytes",
    "checksum",
    "not enough bytes",
    "failed to read",
    "invalid block",
    "malformed",
)


def corrupt(db, detail: str) -> DatabaseCorruptError:
    return DatabaseCorruptError(
        f"{db} is damaged ({detail}). Rampwatch will not write to it or trust what it reads "
        "from it. Keep the file for inspection, restore it from a backup, or point the run at "
        "a new database (another path); spools beside it are kept and can be ingested into a "
        "restored copy with `rampwatch recover DB`."
    )


def check_blocks(con, db: Path, size: int) -> None:
    """DatabaseCorruptError if a block the file uses lies beyond its end (con: read-only)."""
    [(block_size,)] = con.execute("SELECT block_size FROM pragma_database_size()").fetchall()
    in_file = (size - HEADER_BYTES) // int(block_size) if size > HEADER_BYTES else 0
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
            "AND table_catalog = current_database()"
        ).fetchall()
    ]
    top = [r[0] for r in con.execute("SELECT max(block_id) FROM pragma_metadata_info()").fetchall()]
    for t in tables:
        top += [
            r[0]
            for r in con.execute("SELECT max(block_id) FROM pragma_storage_info(?)", [t]).fetchall()
        ]
    used = max((b for b in top if b is not None), default=-1)
    if used >= in_file:
        raise corrupt(
            db,
            f"truncated: it uses block {used} of {block_size} bytes, but its "
            f"{size} bytes hold {in_file} blocks",
        )


def is_corruption(exc: BaseException) -> bool:
    """Does a DuckDB error say the file's contents are damaged (not busy, not a bad query)?"""
    text = str(exc).lower()
    # "lock" as a word: a checksum error names its "block", which is damage all the same
    return any(m in text for m in _MARKERS) and re.search(r"\block\b", text) is None
