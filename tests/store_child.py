"""Child processes for the store tests: a logging trainer stand-in, a polling reader, a lock holder.

Run as `python tests/store_child.py MODE …` from the repository root (tests.procs.spawn does).
  log   start (or resume) a run, log steps, print `ACK <step>` after each log() returns
  read  poll a run at a fixed rate and print one JSON line of counts per poll
  hold  hold the database's exclusive lock for a while (a busy database)
  readloop  take read connections back to back (readers that never leave the lock free)
  diskfull  log and send events while the spool cannot grow (RLIMIT_FSIZE), then with room
            again; print `ACK`/`DROP <step>` for each log() and `ROOM` when the limit is lifted
  seeded  tests/seed.py's live run (a ramp is due) with its writer kept open in this process:
          print `READY <run id>`, then flush about 3× a second (heartbeats, claims) and print
          `CLAIMED <id> <payload JSON>` for each command the writer takes, until killed
Value of metric j at step s in generation g: g * 1e6 + s * 100 + j (exact in float64).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def value(gen: int, step: int, j: int) -> float:
    return gen * 1e6 + step * 100 + j


def metric(j: int) -> str:
    return f"m{j:02d}"


def _log(a) -> int:
    from rampwatch.store import RunWriter

    got_sigterm = []
    if a.exit_mode == "sigterm-user":  # the program's own handler, installed before the writer

        def handler(signum, frame):
            print(f"USER HANDLER ingested={w.ingested_records}", flush=True)
            got_sigterm.append(signum)

        signal.signal(signal.SIGTERM, handler)
    w = RunWriter.start(
        a.db,
        a.name,
        run_id=a.run_id,
        resume_step=a.resume,
        flush_interval=a.flush_interval,
        config={"gen": a.gen},
        rotate_bytes=a.rotate_bytes,
    )
    print(f"STARTED {w.run_id}", flush=True)
    t0 = time.monotonic()
    for i, step in enumerate(range(a.first, a.last + 1)):
        if a.rate:
            delay = t0 + i / a.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        w.log(step, {metric(j): value(a.gen, step, j) for j in range(a.metrics)})
        print(f"ACK {step}", flush=True)
        if step == a.flush_at:
            print(f"FLUSHED {w.flush()}", flush=True)
    for i in range(a.events):
        w.event("tick", f"event {i}")
    print("STATS " + json.dumps(w.stats()), flush=True)
    if a.exit_mode == "close":
        ok = w.close()
        print(f"CLOSED {ok} errors={w.errors}", flush=True)
    elif a.exit_mode == "wait":
        print("WAITING", flush=True)
        time.sleep(3600)  # until killed
    elif a.exit_mode == "raise":
        raise RuntimeError("training blew up")
    elif a.exit_mode == "sigterm-self":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    elif a.exit_mode == "sigterm-user":
        os.kill(os.getpid(), signal.SIGTERM)
        while not got_sigterm:  # the handler runs in this (main) thread, between bytecodes
            time.sleep(0.01)
        print("GRACEFUL EXIT", flush=True)
    # "exit": fall off the end without close(); atexit must finish the run
    return 0


def _read(a) -> int:
    from rampwatch.store import Reader, RunNotFoundError

    r = Reader(a.db)
    deadline = time.monotonic() + a.duration
    series = None
    period = 1.0 / a.hz
    polls = 0
    while time.monotonic() < deadline:
        t = time.monotonic()
        try:
            run = r.get_run(a.run_id)
        except RunNotFoundError:
            time.sleep(period)
            continue
        fresh = r.series(
            a.run_id, metric(0), width=1, since_step=None if series is None else series.since
        )
        series = fresh if series is None else series.merge(fresh)
        rows = r.export(a.run_id).num_rows
        latest = r.latest(a.run_id)
        polls += 1
        print(
            json.dumps(
                {
                    "rows": rows,
                    "series_count": int(series.count.sum()),
                    "series_buckets": len(series.step),
                    "status": run.status,
                    "last_step": run.last_step,
                    "latest_m00": latest.get(metric(0)),
                    "polls": polls,
                }
            ),
            flush=True,
        )
        if run.stored_status != "running" and rows >= a.expect:
            return 0
        time.sleep(max(0.0, period - (time.monotonic() - t)))
    print("READER TIMEOUT", flush=True)
    return 3


def _diskfull(a) -> int:
    import resource

    from rampwatch.store import RunWriter

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    w = RunWriter.start(a.db, a.name, run_id=a.run_id, flush_interval=1000)
    print(f"STARTED {w.run_id}", flush=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Spool files hit the limit; the database file, written only at flushes, is not written
    # while it holds.
    resource.setrlimit(resource.RLIMIT_FSIZE, (a.limit, hard))
    step = 0
    for phase in ("full", "room"):
        for i in range(a.last):
            before = w.errors  # log() counts an error for each call it could not keep whole
            w.log(step, {metric(j): value(a.gen, step, j) for j in range(a.metrics)})
            print(f"{'ACK' if w.errors == before else 'DROP'} {step}", flush=True)
            if i % 20 == 0:  # events of ~4 KB fill the rare-records file too
                w.event("tick", f"{phase} {i} " + "x" * 4000)
                print(f"EVENT {phase} {i}", flush=True)
            step += 1
        if phase == "full":
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            print("ROOM", flush=True)
    print("STATS " + json.dumps(w.stats()), flush=True)
    if a.exit_mode == "close":
        print(f"CLOSED {w.close()}", flush=True)
    else:
        print("WAITING", flush=True)
        time.sleep(3600)
    return 0


def _readloop(a) -> int:
    """Back-to-back read connections, each held a while: with two of these, the shared lock is
    never free, and only the writers' turnstile lets a writer in."""
    from rampwatch.store.db import read_connection

    end = time.monotonic() + a.duration
    n = 0
    while time.monotonic() < end:
        with read_connection(a.db) as con:
            con.execute("SELECT count(*) FROM runs").fetchall()
            if n == 0:
                print("READING", flush=True)
            time.sleep(a.hold)
        n += 1
    print(f"READS {n}", flush=True)
    return 0


def _seeded(a) -> int:
    from tests import seed

    run = seed.live_run(a.db, name=a.name, run_id=a.run_id)
    w = run.writer
    print(f"READY {run.run_id}", flush=True)
    while True:
        for c in w.take_claimed_commands():  # the first call hands claims to the flusher
            print(f"CLAIMED {c.command_id} {json.dumps(c.payload)}", flush=True)
        w.flush()
        time.sleep(0.3)


def _hold(a) -> int:
    from rampwatch.store.db import write_connection

    with write_connection(a.db) as con:
        con.execute("SELECT 1").fetchall()
        print("HOLDING", flush=True)
        time.sleep(a.duration)
    print("RELEASED", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["log", "read", "hold", "readloop", "diskfull", "seeded"])
    p.add_argument("db")
    p.add_argument("--run-id")
    p.add_argument("--name", default="child")
    p.add_argument("--resume", type=int)
    p.add_argument("--gen", type=int, default=1)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--last", type=int, default=99)
    p.add_argument("--metrics", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--flush-interval", type=float, default=1.0)
    p.add_argument("--flush-at", type=int, default=-1)
    p.add_argument("--rotate-bytes", type=int, default=64 << 20)
    p.add_argument(
        "--exit-mode",
        default="close",
        choices=["close", "wait", "exit", "raise", "sigterm-self", "sigterm-user"],
    )
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--hz", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=0.05)
    p.add_argument("--expect", type=int, default=0)
    p.add_argument("--events", type=int, default=0)
    p.add_argument("--limit", type=int, default=(64 << 10) + 13)  # mid-record, mid-line
    a = p.parse_args()
    return {
        "log": _log,
        "read": _read,
        "hold": _hold,
        "readloop": _readloop,
        "diskfull": _diskfull,
        "seeded": _seeded,
    }[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
