"""Work on a connection the caller already holds: one transaction block, and the first row of
a result.

A leaf of the store (it imports only duckdb), so that every module that runs SQL inside someone
else's connection (schema's migrations, ingest, recovery, the command rows) can use the one
BEGIN … COMMIT without importing db.py, which opens connections and imports schema itself.
"""

from __future__ import annotations

import contextlib

import duckdb


def first(result):
    """The first row of a result, or None. Reads it to the end: DuckDB 2.0 refuses register()
    and some other calls on a connection whose last result was not fetched completely."""
    rows = result.fetchall()
    return rows[0] if rows else None


@contextlib.contextmanager
def transaction(con):
    """BEGIN … COMMIT on `con`, ROLLBACK if the block raises."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except duckdb.Error:
            pass  # the connection is being torn down anyway; the original error matters
        raise
    con.execute("COMMIT")
