"""`python -m store info|recover|upgrade DB`: look at, repair or upgrade a database.

Owns the command line: exit 0 on success, 1 when the database stays busy, 2 on anything else
that stops it (usage, a missing, foreign, too-new, too-old-to-read or damaged file, a file that
cannot be read), always with a one-line message naming the file and what to do, never a
traceback. `info` only reads: it changes nothing in or beside the file, whatever its schema.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import duckdb

import store
from store.errors import StoreBusyError, StoreError


def _age(t: float | None) -> str:
    return "-" if t is None else f"{time.time() - t:.0f}s ago"


def _info(db: str) -> None:
    version = store.schema_version(db, read_only=True)
    runs = store.list_runs(db, read_only=True)
    print(f"database {db}: Rampwatch schema version {version}, {len(runs)} run(s)")
    if version < store.CURRENT_VERSION:
        print(f"(read as it is; this Rampwatch writes version {store.CURRENT_VERSION} and "
              f"upgrades the file when it next opens it for writing, or now with "
              f"`python -m store upgrade {db}`)")
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


def _upgrade(db: str) -> None:
    if not os.path.exists(db):  # write_connection would create a new database there
        raise store.DatabaseMissingError(f"no Rampwatch database at {db}: the file does not "
                                         "exist; check the path")
    t0 = time.time()
    with store.write_connection(db) as con:  # opening it for writing upgrades it
        now = [v for (v,) in con.execute("SELECT version FROM rampwatch_schema "
                                         "WHERE applied_at >= ? ORDER BY 1", [t0]).fetchall()]
        [(version,)] = con.execute("SELECT max(version) FROM rampwatch_schema").fetchall()
    print(f"database {db}: Rampwatch schema version {version}"
          + (f" (applied now: {', '.join(map(str, now))})" if now else " (already current)"))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m store", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("info", "schema version and runs (reads only, changes nothing)"),
                        ("recover", "ingest dead writers' spools; mark their runs killed"),
                        ("upgrade", "bring an older file to this Rampwatch's schema")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("db", help="path of the Rampwatch DuckDB file")
    args = parser.parse_args(argv)  # exits 2 on bad usage
    try:
        {"info": _info, "recover": _recover, "upgrade": _upgrade}[args.cmd](args.db)
    except StoreBusyError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    except StoreError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (duckdb.Error, OSError) as e:  # not foreseen above: still one line, no traceback
        print(f"error: could not {args.cmd} {args.db}: {_one_line(e)}. If the file is damaged, "
              "restore it from a backup or start a new database at another path.",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
