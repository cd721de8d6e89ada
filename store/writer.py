"""RunWriter: what a training process logs through, without ever waiting on the database.

Owns the trainer's side of the store: `log()` appends fixed binary records to this session's
spool with one os.write and returns in microseconds (it never raises: problems are counted in
`errors` and shown in `last_error`); rare records (events, memory-plan rows, run updates, the
final status, command results) go to the spool's JSON-lines file. A daemon thread moves new
records into DuckDB about once a second (store/ingest.py), records the run's heartbeat, reads
its pending commands and now and then recovers dead writers' spools. At exit (atexit) and on
SIGTERM the writer flushes what is left; if the database stays busy, the spool stays for
recovery, so nothing acknowledged is lost. Once a spool is fully ingested and over
ROTATE_BYTES, the writer continues in a fresh one and deletes the old, so a long run's spool
does not grow without bound. Starting a writer opens the database for writing
synchronously: a foreign or too-new file fails there, with a clear error. The writer remembers
the spool offsets it committed; should the database ever hand back older ones (or none), it
refuses to ingest (SpoolOffsetsError, in `errors`/`last_error` and logged as an error) rather
than insert rows twice, and at close sets that spool aside as `<session>.corrupt` instead of
leaving it to recovery, which would trust the stale offsets.
"""
from __future__ import annotations

import json
import logging
import operator
import os
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from store import commands, ingest, lifecycle, recovery, spool
from store.db import DEFAULT_TIMEOUT, first, resolve, spool_root, write_connection
from store.errors import RunNotFoundError, SpoolOffsetsError, StoreBusyError, StoreError

_log = logging.getLogger("rampwatch.store")
_now = time.time
_RECORD = struct.Struct("<qddii")  # the slow path; must match spool.RECORD
PLAN_SOURCES = ("plan", "measured", "oom")
RECOVER_EVERY = 30.0  # seconds between a live writer's sweeps for other writers' dead spools
ROTATE_BYTES = 64 << 20  # a fully ingested spool this big is replaced by a fresh one


def _as_step(step) -> int:
    try:
        return operator.index(step)  # int, numpy integer, 0-d integer tensor
    except TypeError:
        f = float(step)
        if not f.is_integer():
            raise TypeError(f"step must be an integer, got {step!r}") from None
        return int(f)


def _json_ready(obj, what: str):
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable (dicts, lists, str, numbers): {e}") \
            from None
    return obj


class RunWriter:
    """Logs one run into a Rampwatch database. Create with RunWriter.start(...)."""

    def __init__(self, db: Path, run_id: str, files: spool.SpoolFiles, *, flush_interval: float,
                 lock_timeout: float, actor: str, rotate_bytes: int = ROTATE_BYTES):
        self.db, self.run_id, self._files = db, run_id, files
        self._retired: list[spool.SpoolFiles] = []  # rotated out, tail not yet ingested
        # spool name -> the (bin, jsonl) offsets this writer last committed for it: an ingest
        # that reads older stored offsets refuses rather than insert those rows again
        self._committed: dict[str, tuple[int, int]] = {}
        self._offsets_alarm = False  # SpoolOffsetsError logged as an error already
        self._refused: set[str] = set()  # spools whose last ingest raised SpoolOffsetsError
        self._rotate_bytes = rotate_bytes
        self._interval, self._lock_timeout, self._actor = flush_interval, lock_timeout, actor
        self._lock = threading.RLock()        # spool appends (RLock: the SIGTERM handler may
        self._visit_lock = threading.RLock()  # interrupt log() or flush() in the main thread)
        self._templates: dict[tuple, np.ndarray] = {}
        self._pid = os.getpid()
        self._closed = False
        self._usable = True  # False once closed, and in a forked child (checked per log())
        self._last_step: int | None = None
        self._pending: list[commands.Command] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_recover = time.monotonic()
        self._backlog = False  # the last ingest stopped at the per-transaction cap
        self.errors = 0
        self.last_error: str | None = None
        self.logged_records = 0
        self.ingested_records = 0
        self.flushes = 0
        self.busy = 0  # visits that found the database locked for too long (records waited)
        self.last_busy: str | None = None
        self.last_flush: float | None = None

    # ---- starting -----------------------------------------------------------------------
    @classmethod
    def start(cls, db, name: str | None = None, *, config: dict | None = None,
              device: str | None = None, capacity_bytes: int | None = None,
              world_size: int | None = None, run_id: str | None = None,
              resume_step: int | None = None, flush_interval: float = 1.0,
              lock_timeout: float = DEFAULT_TIMEOUT, actor: str = "trainer",
              handle_sigterm: bool = True, rotate_bytes: int = ROTATE_BYTES) -> "RunWriter":
        """Start a new run (run_id=None, or a new id), or resume one from its checkpoint step.

        Resuming (run_id=existing, resume_step=S) deletes the run's metrics and events with
        step > S and records a 'resume' event, in the transaction of its first ingest, after
        ingesting what dead writers of the run left in their spools.
        """
        db = resolve(db)
        _json_ready(config, "config")
        if resume_step is not None:
            if run_id is None:
                raise ValueError("resume_step needs the run_id of the run to resume")
            resume_step = _as_step(resume_step)
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        # Random from the first character: DuckDB's zone maps keep an 8-byte prefix of strings,
        # so ids that differ early let a query skip other runs' row groups.
        run_id = run_id or uuid.uuid4().hex[:12]
        start = {"k": "start", "run_id": run_id, "name": name, "config": config,
                 "device": device, "capacity_bytes": capacity_bytes, "world_size": world_size,
                 "t": _now(), "resume_step": resume_step, "pid": os.getpid(),
                 "host": socket.gethostname()}
        with write_connection(db, lock_timeout) as con:
            recovery.recover_dead(con, db)
            row = first(con.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]))
            if resume_step is None and row is not None:
                raise StoreError(f"run {run_id!r} already exists in {db} ({row[0]}); pass "
                                 "resume_step=S to resume it, or omit run_id for a new run")
            if resume_step is not None and row is None:
                raise RunNotFoundError(f"cannot resume run {run_id!r}: {db} has no such run; "
                                       f"`python -m store info {db}` lists the runs")
            if resume_step is not None and recovery.live_spools(con, db, run_id):
                raise StoreError(f"run {run_id!r} is still being written by a live process; "
                                 "stop it before resuming the run")
            files = spool.SpoolFiles.create(spool_root(db), uuid.uuid4().hex)
            try:
                files.append_json(start)
                res = ingest.ingest_spool(con, files.path, heartbeat=_now())
                pending = commands.pending(con, run_id)
            except BaseException:
                files.close(remove=True)
                raise
        w = cls(db, run_id, files, flush_interval=flush_interval, lock_timeout=lock_timeout,
                actor=actor, rotate_bytes=rotate_bytes)
        w._note_committed(files, res)
        w._pending = pending
        w._last_step = resume_step
        lifecycle.register(w, handle_sigterm)
        w._thread = threading.Thread(target=w._flusher, name=f"rampwatch-flush-{run_id}",
                                     daemon=True)
        w._thread.start()
        return w

    # ---- the hot path -------------------------------------------------------------------
    def log(self, step, metrics: dict) -> None:
        """Append {name: value} at `step`. Never raises; problems are counted in `errors`.

        Values are anything float() accepts: Python and numpy numbers, 0-d tensors (float() of
        a CUDA tensor waits for the GPU, as .item() does: pass numbers you already have).
        """
        try:
            if type(step) is not int:
                step = _as_step(step)
            with self._lock:
                if not self._usable:
                    raise RuntimeError("log() on a closed writer, or in a forked child process "
                                       "(only the process that started the writer may log)")
                keys = tuple(metrics)
                rec = self._templates.get(keys)
                if rec is None:
                    rec = self._template(keys)
                rec["step"] = step
                rec["t"] = _now()
                rec["value"] = [float(v) for v in metrics.values()]
                try:
                    self._files.append_records(rec)
                except OSError as e:  # not retried: part of it may be on disk already
                    return self._note_error(f"log(step={step}) lost: spool write failed: {e!r}")
                self._last_step = step
                self.logged_records += len(keys)
        except Exception as e:  # never into the training loop
            self._log_slow(step, metrics, e)

    def _template(self, keys: tuple) -> np.ndarray:
        ids = [self._files.name_id(k) for k in keys]  # names reach the disk before records
        rec = np.zeros(len(keys), spool.RECORD)
        rec["name_id"] = ids
        rec["magic"] = spool.MAGIC
        if len(self._templates) >= 256:  # key sets that keep changing: bound the cache
            self._templates.clear()
        self._templates[keys] = rec
        return rec

    def _log_slow(self, step, metrics, first_error: Exception) -> None:
        """Per-item path after the fast one failed: keep every value that can be kept."""
        with self._lock:
            if not self._usable or not isinstance(step, int):
                return self._note_error(f"log(step={step!r}) dropped: {first_error}")
            try:
                items = list(metrics.items())
            except Exception:
                return self._note_error(f"log(step={step}) dropped: metrics must be a dict of "
                                        f"name: value, got {type(metrics).__name__}")
            t, parts, bad = _now(), [], []
            for k, v in items:
                try:
                    parts.append(_RECORD.pack(step, t, float(v), self._files.name_id(k),
                                              spool.MAGIC))
                except Exception as e:
                    bad.append(f"{k!r}: {e}")
            try:
                if parts:
                    self._files.append_records(b"".join(parts))
                    self._last_step = step
                    self.logged_records += len(parts)
            except Exception as e:
                return self._note_error(f"log(step={step}) lost: spool write failed: {e!r}")
            self._note_error(f"log(step={step}) dropped " + "; ".join(bad) if bad else
                             f"log(step={step}) slow path after: {first_error!r}")

    def _note_error(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        if self.errors == 1 or self.errors % 1000 == 0:
            _log.warning("rampwatch writer %s: %s (%d errors so far)", self.run_id, message,
                         self.errors)

    # ---- rare records -------------------------------------------------------------------
    def _append(self, rec: dict) -> None:
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("writer is closed")
                self._files.append_json(rec)
        except Exception as e:
            self._note_error(f"{rec.get('k')} record lost: {e!r}")

    def event(self, kind: str, message: str = "", *, step: int | None = None,
              data: dict | None = None) -> None:
        """An event (ramp, oom, checkpoint, alert …) at `step` (default: the last logged)."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        self._append({"k": "event", "run_id": self.run_id, "kind": kind, "message": str(message),
                      "step": self._last_step if step is None else _as_step(step), "t": _now(),
                      "data": _json_ready(data, "event data")})

    def memory_plan(self, per_device_batch: int, *, variant: str = "plain",
                    predicted_bytes: int | None = None, measured_bytes: int | None = None,
                    source: str = "plan", feasible: bool | None = None,
                    breakdown: dict | None = None, step: int | None = None) -> None:
        """A memory-plan row: predicted and/or measured peak bytes at a per-device batch."""
        if source not in PLAN_SOURCES:
            raise ValueError(f"memory_plan source must be one of {PLAN_SOURCES}, got {source!r}")
        self._append({"k": "plan", "run_id": self.run_id, "per_device_batch":
                      operator.index(per_device_batch), "variant": str(variant),
                      "predicted_bytes": None if predicted_bytes is None else int(predicted_bytes),
                      "measured_bytes": None if measured_bytes is None else int(measured_bytes),
                      "source": source, "feasible": None if feasible is None else bool(feasible),
                      "breakdown": _json_ready(breakdown, "breakdown"),
                      "step": self._last_step if step is None else _as_step(step), "t": _now()})

    def update_run(self, *, name: str | None = None, config: dict | None = None,
                   device: str | None = None, capacity_bytes: int | None = None,
                   world_size: int | None = None) -> None:
        """Change run details known only after start (device, capacity …); None keeps a field."""
        self._append({"k": "run", "run_id": self.run_id, "name": name,
                      "config": _json_ready(config, "config"), "device": device,
                      "capacity_bytes": capacity_bytes, "world_size": world_size})

    # ---- commands -----------------------------------------------------------------------
    def pending_commands(self) -> list[commands.Command]:
        """This run's pending commands as of the last flush (claim one before acting on it)."""
        return list(self._pending)

    def claim(self, command_id: int) -> commands.Command:
        """Claim a pending command (synchronous: raises CommandError if it is gone)."""
        cmd = commands.claim(self.db, command_id, self._actor, self._lock_timeout)
        self._pending = [c for c in self._pending if c.command_id != command_id]
        return cmd

    def command_applied(self, command_id: int, step: int) -> None:
        """Record, without waiting, that a claimed command took effect at `step`."""
        self._append({"k": "cmd", "command_id": int(command_id), "to": "applied",
                      "step": _as_step(step), "actor": self._actor, "t": _now()})

    def command_refused(self, command_id: int, reason: str) -> None:
        """Record, without waiting, that a command was refused, and why."""
        self._append({"k": "cmd", "command_id": int(command_id), "to": "refused",
                      "reason": str(reason), "actor": self._actor, "t": _now(),
                      "step": self._last_step})

    # ---- flushing -----------------------------------------------------------------------
    def _flusher(self) -> None:
        # A visit waits at most a couple of intervals for the lock: records simply wait.
        timeout = min(self._lock_timeout, max(0.5, 2 * self._interval))
        wait = self._interval
        while not self._stop.wait(wait):
            self._visit(timeout, drain=False)
            # A backlog (after a busy spell) goes in one chunk per visit, with the lock let go
            # in between so that readers are not locked out for the whole backlog.
            wait = 0.05 if self._backlog else self._interval

    def _note_committed(self, files: spool.SpoolFiles, res: ingest.IngestResult) -> None:
        if res.stored:
            self._committed[files.path.name] = (res.bin_offset, res.jsonl_offset)
        self._refused.discard(files.path.name)

    def _ingest_all(self, con, files: spool.SpoolFiles, drain: bool = True) -> ingest.IngestResult:
        while True:
            res = ingest.ingest_spool(con, files.path, heartbeat=_now(),
                                      expect=self._committed.get(files.path.name))
            self._note_committed(files, res)
            self.ingested_records += res.records
            self._backlog = res.more
            if not (res.more and drain):
                return res

    def _rotate(self, con) -> None:
        """Continue in a new spool so a long run's spool stops growing; drop the old one."""
        new = spool.SpoolFiles.create(spool_root(self.db), uuid.uuid4().hex)
        try:
            new.append_json({"k": "segment", "run_id": self.run_id, "pid": os.getpid(),
                             "host": socket.gethostname(), "t": _now()})
            with self._lock:  # log() waits for the swap only
                old = self._files
                for name in sorted(old.name_ids, key=old.name_ids.get):
                    new.name_id(name)  # same ids in the same order: cached templates stay valid
                self._files = new
        except BaseException:
            new.close(remove=True)
            raise
        self._retired.append(old)
        self._drain_retired(con)    # the old tail first: rows reach the tables in step order
        self._ingest_all(con, new)  # and the new spool's offsets row ties it to the run at once

    def _drain_retired(self, con) -> None:
        # Nothing is appended to a retired spool any more: ingest its tail, then delete it.
        while self._retired:
            self._ingest_all(con, self._retired[0])
            done = self._retired.pop(0)
            done.close(remove=True)
            self._committed.pop(done.path.name, None)

    def _visit(self, timeout: float, drain: bool = True) -> bool:
        """One trip to the database; True if every record spooled before it is now ingested.

        drain=False ingests at most one chunk (ingest.MAX_RECORDS) of this spool's backlog.
        """
        if not self._visit_lock.acquire(timeout=timeout):
            return False
        try:
            target = (self._files.size(), os.fstat(self._files.rec_fd).st_size)
            with write_connection(self.db, timeout) as con:
                if time.monotonic() - self._last_recover > RECOVER_EVERY:
                    self._last_recover = time.monotonic()
                    recovery.recover_dead(con, self.db)
                self._drain_retired(con)
                res = self._ingest_all(con, self._files, drain)
                whole = target[0] - target[0] % spool.RECORD.itemsize
                done = res.bin_offset >= whole and res.jsonl_offset >= target[1]
                if done and target[0] >= self._rotate_bytes and not self._closed:
                    self._rotate(con)
                self._pending = commands.pending(con, self.run_id)
            self.flushes += 1
            self.last_flush = _now()
            return done
        except StoreBusyError as e:  # not an error: the records wait in the spool
            self.busy += 1
            self.last_busy = str(e)
            return False
        except SpoolOffsetsError as e:  # the database disagrees with what we committed
            self._refused.add(e.spool)
            if not self._offsets_alarm:
                self._offsets_alarm = True
                _log.error("rampwatch writer %s: %s", self.run_id, e)
            self._note_error(f"flush refused, records wait in the spool: {e}")
            return False
        except Exception as e:
            self._note_error(f"flush failed, records wait in the spool: {e!r}")
            return False
        finally:
            self._visit_lock.release()

    def flush(self, timeout: float | None = None) -> bool:
        """Ingest everything logged so far now; False if the database stayed busy or failed."""
        return self._visit(self._lock_timeout if timeout is None else timeout)

    def close(self, status: str = "finished", message: str | None = None,
              timeout: float | None = None) -> bool:
        """Final status, final flush, spool removed once fully ingested. True if all ingested.

        If the database stays busy, the spool stays: recovery ingests it later, final status
        included, so a closed run is never mistaken for a killed one.
        """
        if status not in ("finished", "failed", "killed"):
            raise ValueError(f"close status must be finished, failed or killed, got {status!r}")
        with self._lock:
            if self._closed or self._pid != os.getpid():
                return False
            self._files.append_json({"k": "status", "status": status, "message": message,
                                     "t": _now(), "step": self._last_step})
            self._closed = True
            self._usable = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 3 * self._interval))
        deadline = time.monotonic() + (self._lock_timeout if timeout is None else timeout)
        ok = self._visit(max(0.1, deadline - time.monotonic()))
        while not ok and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))  # a failing database
            ok = self._visit(max(0.1, deadline - time.monotonic()))     # must not spin a core
        lifecycle.unregister(self)
        for files in [*self._retired, *([] if ok else [self._files])]:
            if files.path.name in self._refused:  # recovery would trust the stale offsets
                self._set_aside(files)
        for files in self._retired:  # only if the last visits failed: recovery finishes them
            files.close(remove=False)
        self._files.close(remove=ok)
        return ok

    def _set_aside(self, files: spool.SpoolFiles) -> None:
        try:
            dest = spool.set_aside(files.path)
        except OSError as e:
            _log.error("rampwatch writer %s: could not set spool %s aside: %r", self.run_id,
                       files.path, e)
            return
        _log.error("rampwatch writer %s: its stored offsets disagree with what it committed, "
                   "so its spool is kept at %s for inspection, not left for recovery (which "
                   "would ingest it again from the stored offsets)", self.run_id, dest)

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close("finished")
        else:
            self.close(*lifecycle.status_for(exc))

    def stats(self) -> dict:
        return {"run_id": self.run_id, "logged_records": self.logged_records,
                "ingested_records": self.ingested_records, "flushes": self.flushes,
                "busy": self.busy, "last_busy": self.last_busy, "errors": self.errors,
                "last_error": self.last_error,
                "last_flush": self.last_flush, "closed": self._closed}
