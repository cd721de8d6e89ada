"""Deleting a run: every row recorded for it, in every table, in one transaction.

Refused while a writer is logging to the run. Dead writers are recovered first: a dead writer's
spool left on disk would otherwise bring the deleted run back at the next recovery.
"""

from __future__ import annotations

from rampwatch.store.db import write_connection
from rampwatch.store.errors import StoreError
from rampwatch.store.recovery import live_spools, recover_dead
from rampwatch.store.schema import RUN_TABLES
from rampwatch.store.txn import transaction


def delete_run(db, run_id: str, timeout: float = 60.0) -> None:
    """Delete a run and everything recorded for it; refused while a writer is logging to it."""
    with write_connection(db, timeout) as con:
        recover_dead(con, db)
        if live_spools(con, db, run_id):
            raise StoreError(f"run {run_id!r} has a live writer; stop it before deleting the run")
        with transaction(con):
            con.execute(
                "DELETE FROM command_log WHERE command_id IN "
                "(SELECT command_id FROM commands WHERE run_id = ?)",
                [run_id],
            )
            for table in RUN_TABLES:  # our constants, never input
                con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
