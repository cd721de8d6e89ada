"""RunWriter: what a training process logs through, without ever waiting on the database.

Owns the calls a training loop makes: start, log, the rare records, the command hand-over, close. Starting a writer opens the
database for writing synchronously: a foreign or too-new file fails there, with a clear error.
`log()` appends fixed binary records to this session's spool with one os.write and returns in
microseconds. It never raises: a record it cannot take (a step that is not a non-negative
integer, a value float() refuses, a full disk) is dropped, counted by reason in
`stats()['dropped']`, and reported as an 'alert' event on the run at the next flush
(store/outbox.py). Rare records (events, memory-plan rows, run updates, the final status,
command results) go to the spool's rare-records file, or, when it cannot be written, are held
in memory and written straight into the database by the next visit. The writer owns a Flusher
(store/flusher.py), whose daemon thread moves new records into DuckDB about once a second,
records the run's heartbeat, claims the run's pending commands for the trainer
(take_claimed_commands: nothing at a step boundary waits on the database), rotates the spool
and now and then recovers dead writers' spools. At exit (atexit) and on SIGTERM (store/lifecycle.py) the writer
flushes what is left; if the database stays busy, the spool stays for recovery, so nothing
acknowledged is lost.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path

from rampwatch.store import fs, ingest, lifecycle, names, recovery, spool
from rampwatch.store import spool_format as fmt
from rampwatch.store.command_rows import Command, as_command_id
from rampwatch.store.db import DEFAULT_TIMEOUT, resolve, spool_root, write_connection
from rampwatch.store.errors import RunNotFoundError, StoreError
from rampwatch.store.flusher import ROTATE_BYTES, Flusher
from rampwatch.store.naming import check_run_id, check_run_name
from rampwatch.store.outbox import Outbox
from rampwatch.store.schema import first
from rampwatch.store.steps import MAX_STEP, as_step, step_problem

PLAN_SOURCES = ("plan", "measured", "oom", "probe")
_log = logging.getLogger("rampwatch.store")
_now = time.time


def json_ready(obj, what: str):
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be JSON-serializable (dicts, lists, str, numbers): {e}"
        ) from None
    return obj


class RunWriter:
    """Logs one run into a Rampwatch database. Create with RunWriter.start(...)."""

    def __init__(
        self,
        db: Path,
        run_id: str,
        files: spool.SpoolFiles,
        *,
        flush_interval: float,
        lock_timeout: float,
        actor: str,
        rotate_bytes: int = ROTATE_BYTES,
    ):
        self.db, self.run_id = db, run_id
        self._lock_timeout, self._actor = lock_timeout, actor
        # spool appends (RLock: the SIGTERM handler may interrupt log() in the main thread)
        self._lock = threading.RLock()
        self._templates: dict[tuple, fmt.Template] = {}
        self._pid = os.getpid()
        self._closed = False
        self._usable = True  # False once closed, and in a forked child (checked per log())
        self._last_step: int | None = None
        self._outbox = Outbox()
        self.errors = 0
        self.last_error: str | None = None
        self.logged_records = 0
        self._flusher = Flusher(
            db,
            run_id,
            files,
            lock=self._lock,
            outbox=self._outbox,
            last_step=lambda: self._last_step,
            note_error=self._note_error,
            interval=flush_interval,
            lock_timeout=lock_timeout,
            actor=actor,
            rotate_bytes=rotate_bytes,
        )

    # what the flusher counts, read as the writer's own (stats() reports them too)
    ingested_records = property(lambda self: self._flusher.ingested_records)
    flushes = property(lambda self: self._flusher.flushes)
    busy = property(lambda self: self._flusher.busy)  # visits that found the database locked
    last_busy = property(lambda self: self._flusher.last_busy)
    last_flush = property(lambda self: self._flusher.last_flush)

    # ---- starting -----------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        db,
        name: str | None = None,
        *,
        config: dict | None = None,
        device: str | None = None,
        capacity_bytes: int | None = None,
        world_size: int | None = None,
        run_id: str | None = None,
        resume_step: int | None = None,
        flush_interval: float = 1.0,
        lock_timeout: float = DEFAULT_TIMEOUT,
        actor: str = "trainer",
        handle_sigterm: bool = True,
        rotate_bytes: int = ROTATE_BYTES,
    ) -> "RunWriter":
        """Start a new run (run_id=None, or a new id), or resume one from its checkpoint step.

        Resuming (run_id=existing, resume_step=S) deletes the run's metrics and events with
        step > S and records a 'resume' event, in the transaction of its first ingest, after
        ingesting what dead writers of the run left in their spools. S is a step (>= 0), or -1
        for a run resumed before its first checkpoint (everything is discarded).
        run_id must be a name and `name` readable whole (store/naming.py): InvalidNameError, a
        ValueError, otherwise, before anything is written.
        """
        db = resolve(db)
        json_ready(config, "config")
        if resume_step is not None:
            if run_id is None:
                raise ValueError("resume_step needs the run_id of the run to resume")
            if not (type(resume_step) is int and resume_step == -1):  # -1: before step 0
                resume_step = as_step(resume_step, "resume_step")
        if run_id is not None:
            check_run_id(run_id)  # a name, never a path: it names checkpoint files
        check_run_name(name)
        # Random from the first character: DuckDB's zone maps keep an 8-byte prefix of strings,
        # so ids that differ early let a query skip other runs' row groups.
        run_id = run_id or uuid.uuid4().hex[:12]
        start = {
            "k": "start",
            "run_id": run_id,
            "name": name,
            "config": config,
            "device": device,
            "capacity_bytes": capacity_bytes,
            "world_size": world_size,
            "t": _now(),
            "resume_step": resume_step,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        with write_connection(db, lock_timeout) as con:
            recovery.recover_dead(con, db)
            row = first(con.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]))
            if resume_step is None and row is not None:
                raise StoreError(
                    f"run {run_id!r} already exists in {db} ({row[0]}): resume it "
                    "(`rampwatch train --resume`, or resume_step=S), or choose another run id "
                    "(or none) for a new run"
                )
            if resume_step is not None and row is None:
                raise RunNotFoundError(
                    f"cannot resume run {run_id!r}: {db} has no such run; "
                    f"`rampwatch info {db}` lists the runs"
                )
            if resume_step is not None and recovery.live_spools(con, db, run_id):
                raise StoreError(
                    f"run {run_id!r} is still being written by a live process; "
                    "stop it before resuming the run"
                )
            files = spool.SpoolFiles.create(spool_root(db), uuid.uuid4().hex)
            try:
                files.append_json(start)
                res = ingest.ingest_spool(con, files.path, heartbeat=_now())
            except BaseException:
                files.close(remove=True)
                raise
        w = cls(
            db,
            run_id,
            files,
            flush_interval=flush_interval,
            lock_timeout=lock_timeout,
            actor=actor,
            rotate_bytes=rotate_bytes,
        )
        w._flusher.note_committed(files, res)
        w._last_step = resume_step
        lifecycle.register(w, handle_sigterm)
        w._flusher.start()
        w._warn_if_shared()
        return w

    def _warn_if_shared(self) -> None:
        """Locks are unreliable on network filesystems: say so where people look."""
        m = fs.shared_mount(self.db.parent)
        if m is not None:
            text = fs.warning_text(self.db, m)
            warnings.warn(text, fs.SharedFilesystemWarning, stacklevel=3)
            self.event(
                "alert",
                text,
                data={"filesystem": m.fstype, "mount_point": m.point, "source": m.source},
            )

    # ---- the hot path -------------------------------------------------------------------
    def log(self, step, metrics: dict) -> None:
        """Append {name: value} at `step`. Never raises; what it drops is counted by reason.

        step: a non-negative integer (int, numpy integer, 0-d integer tensor); anything else
        (negative, bool, float, str) drops the whole record. Values are anything float()
        accepts: Python and numpy numbers, 0-d tensors (float() of a CUDA tensor waits for the
        GPU, as .item() does: pass numbers you already have).
        """
        try:
            if type(step) is not int or step < 0 or step > MAX_STEP:
                step, problem = step_problem(step)
                if problem is not None:
                    return self._drop(_count(metrics), problem, f"log() dropped: {problem}")
            with self._lock:
                if not self._usable:
                    raise RuntimeError(
                        "log() on a closed writer, or in a forked child process "
                        "(only the process that started the writer may log)"
                    )
                keys = tuple(metrics)
                files = self._flusher.files
                tpl = self._templates.get(keys)
                if tpl is None:
                    tpl = self._template(files, keys)
                rec = tpl.fill(step, _now(), list(map(float, metrics.values())))
                try:
                    files.append_records(rec)
                except OSError as e:  # cut back to the last whole record by the spool
                    return self._drop(
                        len(keys),
                        _write_reason(e),
                        f"log(step={step}) lost: spool write failed: {e!r}",
                    )
                self._last_step = step
                self.logged_records += len(keys)
        except Exception as e:  # never into the training loop
            self._log_slow(step, metrics, e)

    def _template(self, files: spool.SpoolFiles, keys: tuple) -> fmt.Template:
        tpl = fmt.Template([files.name_id(k) for k in keys])  # names reach the disk first
        if len(self._templates) >= 256:  # key sets that keep changing: bound the cache
            self._templates.clear()
        self._templates[keys] = tpl
        return tpl

    def _log_slow(self, step, metrics, first_error: Exception) -> None:
        """Per-item path after the fast one failed: keep every value that can be kept."""
        with self._lock:
            if not self._usable:
                return self._drop(
                    _count(metrics),
                    "writer closed or in a forked child",
                    f"log(step={step!r}) dropped: {first_error}",
                )
            try:
                items = list(metrics.items())
            except Exception:
                return self._drop(
                    1,
                    "metrics is not a dict",
                    f"log(step={step}) dropped: metrics must be a dict of "
                    f"name: value, got {type(metrics).__name__}",
                )
            files, t, parts, bad = self._flusher.files, _now(), [], []
            for k, v in items:
                try:
                    parts.append(fmt.encode_one(step, t, float(v), files.name_id(k)))
                except OSError as e:  # a new name could not be written: its record waits never
                    bad.append((_write_reason(e), f"{k!r}: {e!r}"))
                except Exception as e:
                    reason = names.name_problem(k) or "value is not a number"
                    bad.append((reason, f"{k!r}: {e}"))
            try:
                if parts:
                    files.append_records(b"".join(parts))
                    self._last_step = step
                    self.logged_records += len(parts)
            except OSError as e:
                return self._drop(
                    len(parts) + len(bad),
                    _write_reason(e),
                    f"log(step={step}) lost: spool write failed: {e!r}",
                )
            if not bad:
                return self._note_error(f"log(step={step}) slow path after: {first_error!r}")
            for reason, _ in bad:
                self._outbox.drop(reason, 1)
            self._note_error(f"log(step={step}) dropped " + "; ".join(m for _, m in bad))

    def _drop(self, n: int, reason: str, message: str) -> None:
        self._outbox.drop(reason, n, message)
        self._note_error(message)

    def _note_error(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        if self.errors == 1 or self.errors % 1000 == 0:
            _log.warning(
                "rampwatch writer %s: %s (%d errors so far)", self.run_id, message, self.errors
            )

    # ---- rare records -------------------------------------------------------------------
    def _append(self, rec: dict, after_close: bool = False) -> None:
        """Spool a rare record; if the spool cannot take it, the next visit writes it."""
        try:
            with self._lock:
                if self._closed and not after_close:
                    raise RuntimeError("writer is closed")
                try:
                    self._flusher.files.append_json(rec)
                except OSError as e:  # disk full: held in memory, written by the next visit
                    if self._outbox.add(rec):
                        self._note_error(
                            f"{rec.get('k')} record not spooled ({e!r}); it waits "
                            "in memory for the next flush"
                        )
        except Exception as e:
            self._note_error(f"{rec.get('k')} record lost: {e!r}")

    def event(
        self, kind: str, message: str = "", *, step: int | None = None, data: dict | None = None
    ) -> None:
        """An event (ramp, oom, checkpoint, alert …) at `step` (default: the last logged)."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        self._append(
            {
                "k": "event",
                "run_id": self.run_id,
                "kind": kind,
                "message": str(message),
                "step": self._last_step if step is None else as_step(step),
                "t": _now(),
                "data": json_ready(data, "event data"),
            }
        )

    def memory_plan(
        self,
        per_device_batch: int,
        *,
        variant: str = "plain",
        predicted_bytes: int | None = None,
        measured_bytes: int | None = None,
        source: str = "plan",
        feasible: bool | None = None,
        breakdown: dict | None = None,
        step: int | None = None,
    ) -> None:
        """A memory-plan row: predicted and/or measured peak bytes at a per-device batch."""
        if source not in PLAN_SOURCES:
            raise ValueError(f"memory_plan source must be one of {PLAN_SOURCES}, got {source!r}")
        self._append(
            {
                "k": "plan",
                "run_id": self.run_id,
                "per_device_batch": operator.index(per_device_batch),
                "variant": str(variant),
                "predicted_bytes": None if predicted_bytes is None else int(predicted_bytes),
                "measured_bytes": None if measured_bytes is None else int(measured_bytes),
                "source": source,
                "feasible": None if feasible is None else bool(feasible),
                "breakdown": json_ready(breakdown, "breakdown"),
                "step": self._last_step if step is None else as_step(step),
                "t": _now(),
            }
        )

    def update_run(
        self,
        *,
        name: str | None = None,
        config: dict | None = None,
        device: str | None = None,
        capacity_bytes: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """Change run details known only after start (device, capacity …); None keeps a field."""
        check_run_name(name)
        self._append(
            {
                "k": "run",
                "run_id": self.run_id,
                "name": name,
                "config": json_ready(config, "config"),
                "device": device,
                "capacity_bytes": capacity_bytes,
                "world_size": world_size,
            }
        )

    # ---- commands -----------------------------------------------------------------------
    def take_claimed_commands(self) -> list[Command]:
        """Commands the flusher has claimed for this run since the last call, oldest first.

        Never touches the database: call it at every step boundary. The first call switches the
        writer over: from then on its flusher claims each pending command of the run (pending →
        claimed, actor = this writer's actor) at its visits, about once a second, and hands it
        over here. Report each one with command_applied() or command_refused(). Commands
        claimed but never taken are refused at close.
        """
        return self._flusher.take_claimed()

    def command_applied(self, command_id: int, step: int) -> None:
        """Record, without waiting, that a claimed command took effect at `step`.

        Queued (spooled, or held in memory when the disk is full) and written by the flusher at
        its next visit, retried until written, and at close."""
        self._append(
            {
                "k": "cmd",
                "command_id": as_command_id(command_id),
                "to": "applied",
                "step": as_step(step),
                "actor": self._actor,
                "t": _now(),
            }
        )

    def command_refused(self, command_id: int, reason: str) -> None:
        """Record, without waiting, that a command was refused, and why (queued as above)."""
        self._append(
            {
                "k": "cmd",
                "command_id": as_command_id(command_id),
                "to": "refused",
                "reason": str(reason),
                "actor": self._actor,
                "t": _now(),
                "step": self._last_step,
            }
        )

    # ---- ending -------------------------------------------------------------------------
    def close(
        self, status: str = "finished", message: str | None = None, timeout: float | None = None
    ) -> bool:
        """Final status, final flush, spool removed once fully ingested. True if all ingested.

        If the database stays busy, the spool stays: recovery ingests it later, final status
        included, so a closed run is never mistaken for a killed one. Commands the flusher
        claimed that the trainer never took are refused.
        """
        if status not in ("finished", "failed", "killed"):
            raise ValueError(f"close status must be finished, failed or killed, got {status!r}")
        with self._lock:
            if self._closed or not self.started_here:
                return False
            self._closed = True  # log() is refused from here on: nothing follows the status
            self._usable = False
            self._flusher.end()
        self._flusher.join()
        with self._lock:
            for cmd in self._flusher.take_claimed():
                self._append(
                    {
                        "k": "cmd",
                        "command_id": cmd.command_id,
                        "to": "refused",
                        "reason": f"the run ended ({status}) before the trainer took the command",
                        "actor": self._actor,
                        "t": _now(),
                        "step": self._last_step,
                    },
                    after_close=True,
                )
            self._append(
                {
                    "k": "status",
                    "status": status,
                    "message": message,
                    "t": _now(),
                    "step": self._last_step,
                },
                after_close=True,
            )
        ok = self._flusher.final_visits(self._lock_timeout if timeout is None else timeout)
        lifecycle.unregister(self)
        self._flusher.release_spools(ingested=ok)
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Ingest everything logged so far now; False if the database stayed busy or failed."""
        return self._flusher.visit(self._lock_timeout if timeout is None else timeout)

    # ---- what the process-wide hooks (lifecycle.py) ask of a writer ---------------------
    @property
    def started_here(self) -> bool:
        """True in the process that started the writer, False in a forked child's copy."""
        return self._pid == os.getpid()

    @property
    def lock_timeout(self) -> float:
        """How long a flush waits for the database by default (start's lock_timeout)."""
        return self._lock_timeout

    def disown_in_forked_child(self) -> None:
        """This copy, in a forked child, has neither the flusher thread nor the spool's lock:
        log() refuses from now on, and the child must not close or flush it."""
        self._usable = False

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close("finished")
        else:
            self.close(*lifecycle.status_for(exc))

    def stats(self) -> dict:
        return {
            "run_id": self.run_id,
            "logged_records": self.logged_records,
            "ingested_records": self.ingested_records,
            "flushes": self.flushes,
            "busy": self.busy,
            "last_busy": self.last_busy,
            "errors": self.errors,
            "last_error": self.last_error,
            "dropped": dict(self._outbox.dropped),
            "held_in_memory": len(self._outbox),
            "claimed_not_taken": len(self._flusher.claimed),
            "last_flush": self.last_flush,
            "closed": self._closed,
        }


def _count(metrics) -> int:
    """How many values a dropped log() call held (1 if it is not even a dict)."""
    try:
        return max(1, len(metrics))
    except Exception:
        return 1


def _write_reason(e: OSError) -> str:
    """A drop reason that groups writes failing the same way (disk full, file too large …)."""
    return f"spool write failed ({e.strerror or type(e).__name__})"
