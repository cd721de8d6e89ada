"""Store soak: one writer, three polling readers and a command submitter, for minutes, in
separate processes; prints rows expected vs stored, errors, reader latency and log() tails.

Not a test: a figure for the store under sustained concurrent load. The writer logs 20 metrics
at 200 steps/s and, at each step boundary, takes the commands its flusher claimed (the
non-blocking path) and applies them; 3 readers poll the run at 5 Hz each (a chart refresh:
run, incremental series, latest values); a submitter submits a ramp and cancels it (or lets
the writer apply it) once a second. `python bench/store_soak.py` runs 10 minutes; `--quick`
30 s; `--minutes M` any length. Run it on a quiet machine: the figures include its load.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

from rampwatch import store

N_METRICS, RATE, READERS, READ_HZ = 20, 200, 3, 5.0
NAMES = [f"metric_{j:02d}" for j in range(N_METRICS)]


def _writer(db: str, seconds: float, out: mp.Queue) -> None:
    w = store.RunWriter.start(db, "soak", run_id="soak", config={"per_device_batch": 8, "accum": 1})
    out.put(("started", None))
    lat, applied, step, t0 = [], 0, 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        delay = t0 + step / RATE - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for cmd in w.take_claimed_commands():  # never waits on the database
            w.command_applied(cmd.command_id, step)
            applied += 1
        vals = {n: step * 0.001 + j for j, n in enumerate(NAMES)}
        t = time.perf_counter_ns()
        w.log(step, vals)
        lat.append(time.perf_counter_ns() - t)
        step += 1
    ok = w.close()
    out.put(
        (
            "writer",
            {
                "steps": step,
                "log_ns": lat,
                "errors": w.errors,
                "closed": ok,
                "applied": applied,
                "stats": {k: v for k, v in w.stats().items() if k != "last_flush"},
            },
        )
    )


def _reader(db: str, seconds: float, out: mp.Queue) -> None:
    r = store.Reader(db)
    lat, errors, series, t0 = [], [], None, time.monotonic()
    while time.monotonic() - t0 < seconds:
        t = time.perf_counter()
        try:
            with r.session():
                r.get_run("soak")
                fresh = r.series(
                    "soak", NAMES[0], width=16, since_step=None if series is None else series.since
                )
                series = fresh if series is None else series.merge(fresh)
                r.latest("soak")
            lat.append(time.perf_counter() - t)
        except store.RunNotFoundError:
            pass
        except store.StoreError as e:
            errors.append(f"{type(e).__name__}: {e}")
        time.sleep(max(0.0, 1 / READ_HZ - (time.perf_counter() - t)))
    out.put(("reader", {"lat": lat, "errors": errors}))


def _submitter(db: str, seconds: float, out: mp.Queue) -> None:
    errors, submitted, cancelled, t0, i = [], 0, 0, time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        t = time.monotonic()
        try:
            cid = store.commands.submit(
                db, "soak", "ramp", {"per_device_batch": 8 + i % 2, "accum": 1}, "soak", key=f"k{i}"
            )
            submitted += 1
            try:
                store.commands.cancel(db, cid, "soak")
                cancelled += 1
            except store.CommandError:
                pass  # the writer claimed it first: it will be applied, which is fine
        except store.CommandError as e:
            if "already has ramp command" not in str(e) and "not running" not in str(e):
                errors.append(str(e))
        except store.StoreError as e:
            errors.append(f"{type(e).__name__}: {e}")
        i += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
    out.put(("submitter", {"submitted": submitted, "cancelled": cancelled, "errors": errors}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="30 s")
    a = p.parse_args()
    seconds = 30.0 if a.quick else a.minutes * 60
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "soak.duckdb")
        w = ctx.Process(target=_writer, args=(db, seconds, out))
        w.start()
        assert out.get(timeout=120)[0] == "started"
        others = [ctx.Process(target=_reader, args=(db, seconds, out)) for _ in range(READERS)]
        others.append(ctx.Process(target=_submitter, args=(db, seconds, out)))
        for proc in others:
            proc.start()
        results: dict[str, list] = {}
        for _ in range(len(others) + 1):
            kind, res = out.get(timeout=seconds + 300)
            results.setdefault(kind, []).append(res)
        for proc in [w, *others]:
            proc.join(timeout=60)
        wr = results["writer"][0]
        stored = store.export(db, "soak").num_rows
        alerts = [e.message for e in store.events(db, "soak", kinds=["alert"])]
        status = store.get_run(db, "soak").stored_status
    lat = np.array([x for r in results["reader"] for x in r["lat"]]) * 1e3
    log_us = np.array(wr["log_ns"]) / 1e3
    rerr = [e for r in results["reader"] for e in r["errors"]]
    sub = results["submitter"][0]
    print(
        f"store soak: {seconds:.0f} s, 1 writer x {N_METRICS} metrics at {RATE} steps/s, "
        f"{READERS} readers at {READ_HZ:g} Hz, 1 submit/cancel per s; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print("| measurement | value |\n|---|---|")
    print(f"| rows expected / stored | {wr['steps'] * N_METRICS} / {stored} |")
    print(f"| run status, closed cleanly | {status}, {wr['closed']} |")
    print(f"| writer errors / dropped | {wr['errors']} / {wr['stats']['dropped']} |")
    print(f"| alert events | {len(alerts)} |")
    print(f"| reader polls, errors | {len(lat)}, {len(rerr)} |")
    if len(lat):
        print(
            f"| reader latency p50 / p99 / max | {np.percentile(lat, 50):.1f} / "
            f"{np.percentile(lat, 99):.1f} / {lat.max():.1f} ms |"
        )
    print(
        f"| log() p50 / p99 / p99.9 / max | {np.percentile(log_us, 50):.1f} / "
        f"{np.percentile(log_us, 99):.1f} / {np.percentile(log_us, 99.9):.1f} / "
        f"{log_us.max():.0f} µs |"
    )
    print(
        f"| commands submitted / cancelled / applied, errors | {sub['submitted']} / "
        f"{sub['cancelled']} / {wr['applied']}, {len(sub['errors'])} |"
    )
    print(f"| writer busy visits | {wr['stats']['busy']} |")
    for e in (rerr + sub["errors"])[:5]:
        print("error:", e)
    if wr["stats"]["last_error"]:
        print("writer last error:", json.dumps(wr["stats"]["last_error"]))


if __name__ == "__main__":
    main()
