"""RunWriter: what a training process logs through, without ever waiting on the database.

Owns the trainer's side of the store: `log()` appends fixed binary records to this session's
spool with one os.write and returns in microseconds. It never raises: a record it cannot take
(a step that is not a non-negative integer, a value float() refuses, a full disk) is dropped,
counted by reason in `stats()['dropped']`, and reported as an 'alert' event on the run at the
next flush (store/outbox.py). Rare records (events, memory-plan rows, run updates, the final
status, command results) go to the spool's rare-records file, or, when it cannot be written,
are held in memory and written straight into the database by the next visit. A daemon thread
moves new records into DuckDB about once a second (store/ingest.py), records the run's
heartbeat, claims the run's pending commands for the trainer (take_claimed_commands: nothing at
a step boundary waits on the database) and now and then recovers dead writers' spools. At exit (atexit) and on
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

import collections
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path

from rampwatch.store import commands, fs, ingest, lifecycle, recovery, spool
from rampwatch.store import spool_format as fmt
from rampwatch.store.db import (
    DEFAULT_TIMEOUT,
    first,
    read_connection,
    resolve,
    spool_root,
    write_connection,
)
from rampwatch.store.errors import RunNotFoundError, SpoolOffsetsError, StoreBusyError, StoreError
from rampwatch.store.outbox import Outbox
from rampwatch.store.steps import MAX_STEP, as_step, step_problem
from rampwatch.store.writer_records import RareRecords, json_ready

_log = logging.getLogger("rampwatch.store")
_now = time.time
RECOVER_EVERY = 30.0  # seconds between a live writer's sweeps for other writers' dead spools
ROTATE_BYTES = 64 << 20  # a fully ingested spool this big is replaced by a fresh one


class RunWriter(RareRecords):
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
        self.db, self.run_id, self._files = db, run_id, files
        self._retired: list[spool.SpoolFiles] = []  # rotated out, tail not yet ingested
        # spool name -> the (bin, jsonl) offsets this writer last committed for it: an ingest
        # that reads older stored offsets refuses rather than insert those rows again
        self._committed: dict[str, tuple[int, int]] = {}
        self._offsets_alarm = False  # SpoolOffsetsError logged as an error already
        self._refused: set[str] = set()  # spools whose last ingest raised SpoolOffsetsError
        self._rotate_bytes = rotate_bytes
        self._interval, self._lock_timeout, self._actor = flush_interval, lock_timeout, actor
        self._lock = threading.RLock()  # spool appends (RLock: the SIGTERM handler may
        self._visit_lock = threading.RLock()  # interrupt log() or flush() in the main thread)
        self._templates: dict[tuple, fmt.Template] = {}
        self._pid = os.getpid()
        self._closed = False
        self._usable = True  # False once closed, and in a forked child (checked per log())
        self._last_step: int | None = None
        self._pending: list[commands.Command] = []
        self._auto_claim = False  # set by the first take_claimed_commands()
        self._claimed: collections.deque[commands.Command] = collections.deque()
        self._outbox = Outbox()
        self._damaged: set[str] = set()  # spools in which ingest stepped over damage
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
        """
        db = resolve(db)
        json_ready(config, "config")
        if resume_step is not None:
            if run_id is None:
                raise ValueError("resume_step needs the run_id of the run to resume")
            if not (type(resume_step) is int and resume_step == -1):  # -1: before step 0
                resume_step = as_step(resume_step, "resume_step")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
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
                    f"run {run_id!r} already exists in {db} ({row[0]}); pass "
                    "resume_step=S to resume it, or omit run_id for a new run"
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
                pending = commands.pending(con, run_id)
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
        w._note_committed(files, res)
        w._pending = pending
        w._last_step = resume_step
        lifecycle.register(w, handle_sigterm)
        w._thread = threading.Thread(
            target=w._flusher, name=f"rampwatch-flush-{run_id}", daemon=True
        )
        w._thread.start()
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
                tpl = self._templates.get(keys)
                if tpl is None:
                    tpl = self._template(keys)
                rec = tpl.fill(step, _now(), [float(v) for v in metrics.values()])
                try:
                    self._files.append_records(rec)
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

    def _template(self, keys: tuple) -> fmt.Template:
        tpl = fmt.Template([self._files.name_id(k) for k in keys])  # names reach the disk first
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
            t, parts, bad = _now(), [], []
            for k, v in items:
                try:
                    parts.append(fmt.encode_one(step, t, float(v), self._files.name_id(k)))
                except OSError as e:  # a new name could not be written: its record waits never
                    bad.append((_write_reason(e), f"{k!r}: {e!r}"))
                except Exception as e:
                    reason = (
                        "name is not a str" if not isinstance(k, str) else "value is not a number"
                    )
                    bad.append((reason, f"{k!r}: {e}"))
            try:
                if parts:
                    self._files.append_records(b"".join(parts))
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

    def _ingest_all(
        self, con, files: spool.SpoolFiles, drain: bool = True, final: bool = False
    ) -> ingest.IngestResult:
        while True:
            res = ingest.ingest_spool(
                con,
                files.path,
                heartbeat=_now(),
                final=final,
                expect=self._committed.get(files.path.name),
            )
            self._note_committed(files, res)
            self.ingested_records += res.records
            self._backlog = res.more
            if res.damaged:  # reported as an alert by ingest; the bytes are kept at close
                self._damaged.add(files.path.name)
            if not (res.more and drain):
                return res

    def _rotate(self, con) -> None:
        """Continue in a new spool so a long run's spool stops growing; drop the old one."""
        new = spool.SpoolFiles.create(spool_root(self.db), uuid.uuid4().hex)
        try:
            new.append_json(
                {
                    "k": "segment",
                    "run_id": self.run_id,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "t": _now(),
                }
            )
            with self._lock:  # log() waits for the swap only
                old = self._files
                for name in sorted(old.name_ids, key=old.name_ids.get):
                    new.name_id(name)  # same ids in the same order: cached templates stay valid
                self._files = new
        except BaseException:
            new.close(remove=True)
            raise
        self._retired.append(old)
        self._drain_retired(con)  # the old tail first: rows reach the tables in step order
        self._ingest_all(con, new)  # and the new spool's offsets row ties it to the run at once

    def _drain_retired(self, con) -> None:
        # Nothing is appended to a retired spool any more: ingest its tail, then delete it.
        while self._retired:
            self._ingest_all(con, self._retired[0], final=True)
            done = self._retired.pop(0)
            self._release(done, remove=True)
            self._committed.pop(done.path.name, None)

    def _release(self, files: spool.SpoolFiles, remove: bool) -> None:
        """Close a spool; delete it only if asked and nothing in it was damaged."""
        if remove and files.path.name in self._damaged:
            self._set_aside(files, "it held damaged records (see the run's alert events)")
            remove = False
        files.close(remove=remove)

    def _write_outbox(self, con) -> bool:
        """Rare records the spool could not take, and unreported drops, straight into the
        database (one transaction); True if nothing is left waiting."""
        records, drops = self._outbox.snapshot()
        alert = self._outbox.alert(drops, self._last_step, _now())
        todo = records + ([alert] if alert is not None else [])
        if not todo:
            return True
        for reason in ingest.apply_records(con, self.run_id, todo):
            self._note_error(f"a held record could not be applied: {reason}")
        self._outbox.committed(len(records), drops)
        return True

    def _visit(self, timeout: float, drain: bool = True, final: bool = False) -> bool:
        """One trip to the database; True if every record spooled before it is now ingested.

        drain=False ingests at most one chunk (ingest.MAX_RECORDS) of this spool's backlog.
        final=True once nothing will be appended any more (close).
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
                res = self._ingest_all(con, self._files, drain, final)
                # done: less than one whole record is left (a torn or damaged tail waits)
                done = res.bin_offset + fmt.SIZE > target[0] and res.jsonl_offset >= target[1]
                if done and target[0] >= self._rotate_bytes and not self._closed:
                    self._rotate(con)
                done = self._write_outbox(con) and done
                if self._auto_claim and not self._closed:
                    # handed over right after the claim commits: nothing in between can fail
                    self._claimed.extend(commands.claim_pending(con, self.run_id, self._actor))
                else:
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
            if self._closed or self._pid != os.getpid():
                return False
            self._closed = True  # log() is refused from here on: nothing follows the status
            self._usable = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 3 * self._interval))
        with self._lock:
            while self._claimed:
                cmd = self._claimed.popleft()
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
        deadline = time.monotonic() + (self._lock_timeout if timeout is None else timeout)
        ok = self._visit(max(0.1, deadline - time.monotonic()), final=True)
        while not ok and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))  # a failing database
            ok = self._visit(max(0.1, deadline - time.monotonic()), final=True)  # no spinning
        if ok:
            ok = self._readable_back()
        lifecycle.unregister(self)
        if not ok:
            self._outbox_to_spool()
        for files in [*self._retired, *([] if ok else [self._files])]:
            if files.path.name in self._refused:  # recovery would trust the stale offsets
                self._set_aside(files, "its stored offsets disagree with what it committed")
        for files in self._retired:  # only if the last visits failed: recovery finishes them
            files.close(remove=False)
        self._release(self._files, remove=ok)
        return ok

    def _readable_back(self) -> bool:
        """Before its spool goes, read back from the database what this writer committed (a
        file that took the writes but cannot return them must not cost the only copy)."""
        name = self._files.path.name
        want = self._committed.get(name)
        try:
            with read_connection(self.db, self._lock_timeout) as con:
                row = first(
                    con.execute(
                        "SELECT bin_offset, jsonl_offset FROM spool_offsets WHERE spool = ?", [name]
                    )
                )
                con.execute(
                    "SELECT count(*), max(step) FROM metrics WHERE run_id = ?", [self.run_id]
                ).fetchall()
        except StoreError as e:  # damaged, busy, gone: the spool stays for recovery
            self._note_error(f"the database could not be read back, the spool is kept: {e}")
            return False
        if want is not None and (row is None or (int(row[0]), int(row[1])) != want):
            self._note_error(
                f"the database reads back offsets {row} for spool {name}, not the "
                f"{want} committed; the spool is kept"
            )
            return False
        return True

    def _outbox_to_spool(self) -> None:
        """The database stayed out of reach at close: give what waits in memory to the spool
        (the disk may have room again), where recovery will find it."""
        records, drops = self._outbox.snapshot()
        alert = self._outbox.alert(drops, self._last_step, _now())
        for rec in records + ([alert] if alert is not None else []):
            try:
                self._files.append_json(rec)
            except OSError as e:
                _log.error(
                    "rampwatch writer %s: %s record lost at close: %r", self.run_id, rec.get("k"), e
                )

    def _set_aside(self, files: spool.SpoolFiles, why: str) -> None:
        if not files.path.exists():
            return
        try:
            dest = spool.set_aside(files.path)
        except OSError as e:
            _log.error(
                "rampwatch writer %s: could not set spool %s aside: %r", self.run_id, files.path, e
            )
            return
        _log.error(
            "rampwatch writer %s: %s, so its spool is kept at %s for inspection and "
            "not left for recovery",
            self.run_id,
            why,
            dest,
        )

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
            "claimed_not_taken": len(self._claimed),
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
