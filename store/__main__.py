"""`python -m store info DB` and `python -m store recover DB`: look at or repair a database.

Owns the command line: exit 0 on success, 2 on bad input (usage, missing, foreign or too-new
file) with a one-line message saying what to do, 1 when the database stays busy.
"""
from __future__ import annotations

import argparse
import sys
import time

import store
from store.errors import StoreBusyError, StoreError


def _age(t: float | None) -> str:
    return "-" if t is None else f"{time.time() - t:.0f}s ago"


def _info(db: str) -> None:
    version = store.schema_version(db)
    runs = store.list_runs(db)
    print(f"database {db}: Rampwatch schema version {version}, {len(runs)} run(s)")
    if runs:
        print(f"{'run_id':<28} {'status':<9} {'last_step':>10} {'heartbeat':>12}  name")
        for r in runs:
            last = "-" if r.last_step is None else str(r.last_step)
            print(f"{r.run_id:<28} {r.status:<9} {last:>10} {_age(r.heartbeat):>12}  "
                  f"{r.name or ''}")


def _recover(db: str) -> None:
    report = store.recover(db)
    for s in report.spools:
        state = f"set aside as corrupt: {s.corrupt}" if s.corrupt else "ingested and removed"
        print(f"spool {s.spool} (run {s.run_id}): {s.records} metric records {state}")
    for run_id in report.killed_runs:
        print(f"run {run_id}: marked killed")
    if report.refused_commands:
        print(f"{report.refused_commands} open command(s) refused: run killed")
    if not (report.spools or report.killed_runs):
        print("nothing to recover")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m store", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("info", "schema version and runs"),
                        ("recover", "ingest dead writers' spools; mark their runs killed")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("db", help="path of the Rampwatch DuckDB file")
    args = parser.parse_args(argv)  # exits 2 on bad usage
    try:
        (_info if args.cmd == "info" else _recover)(args.db)
    except StoreBusyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
