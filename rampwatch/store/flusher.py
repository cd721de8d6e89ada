"""A writer's trips to the database: the Flusher, which owns the spool the writer appends to.

Owns the flusher thread, each visit's exactly-once ingest of the spool, spool rotation, the
held records and drop counts written straight into the database, the commands it claims for
the trainer at its visits, and what close() checks before a spool may go. All of its state is
its own attributes (no mixin): RunWriter (store/writer.py) creates one Flusher per writer,
hands it the spool and the append lock, and reads the spool and counters back through them.

Once a spool is fully ingested and over ROTATE_BYTES, the flusher continues in a fresh one and
deletes the old, so a long run's spool does not grow without bound. It remembers the spool
offsets it committed; should the database ever hand back older ones (or none), it refuses to
ingest (SpoolOffsetsError, reported to the writer's errors and logged as an error) rather than
insert rows twice, and at close sets that spool aside as `<session>.corrupt` instead of leaving
it to recovery, which would trust the stale offsets.

A visit shortens the interpreter's switch interval while it runs (`prompt_handoffs`). DuckDB's
Python client takes the GIL back after every task of a query, to check for Ctrl-C (duckdb PR
#12512's execute loop), so a visit asks for the GIL again and again. CPython hands the GIL to a
waiting thread only when the holder lets go or the switch interval (5 ms) passes without a
hand-over, and a thread that lets go briefly (log()'s os.write, for one) usually takes it right
back. So a loop that holds the GIL and lets go briefly more often than every 5 ms starves the
visit: with log() every 200 µs, one visit took 11.7 s of wall clock for 0.42 s of CPU (about
2,300 waits of 5 ms). A loop that lets go less often waits up to 5 ms each time the visit asks.
At 50 µs a visit takes about 0.1 s and the loop waits microseconds (bench/store_bench.py,
README). The previous interval is restored when no visit is running.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

from rampwatch.store import ingest, recovery, spool
from rampwatch.store import spool_format as fmt
from rampwatch.store.command_rows import Command, claim_pending
from rampwatch.store.db import read_connection, spool_root, write_connection
from rampwatch.store.errors import SpoolOffsetsError, StoreBusyError, StoreError
from rampwatch.store.outbox import Outbox
from rampwatch.store.schema import first

_log = logging.getLogger("rampwatch.store")
_now = time.time
RECOVER_EVERY = 30.0  # seconds between a live writer's sweeps for other writers' dead spools
ROTATE_BYTES = 64 << 20  # a fully ingested spool this big is replaced by a fresh one
VISIT_SWITCH_INTERVAL: float | None = 50e-6  # seconds, while a visit runs; None: leave it

_switch_lock = threading.RLock()  # RLock: a SIGTERM handler may flush inside a main-thread visit
_switch_visits = 0  # visits running now, in all writers of this process
_switch_saved = _switch_set = 0.0  # the interval before the first of them, and the one set


@contextlib.contextmanager
def prompt_handoffs():
    """The switch interval at VISIT_SWITCH_INTERVAL while any visit runs (the module docstring
    says why), then back to what it was, unless someone else changed it meanwhile."""
    global _switch_visits, _switch_saved, _switch_set
    if VISIT_SWITCH_INTERVAL is None:
        yield
        return
    with _switch_lock:
        if _switch_visits == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, VISIT_SWITCH_INTERVAL))
            _switch_set = sys.getswitchinterval()
        _switch_visits += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_visits -= 1
            if _switch_visits == 0 and sys.getswitchinterval() == _switch_set:
                sys.setswitchinterval(_switch_saved)


class Flusher:
    """Moves one writer's spool into the database, from its thread, flush() and close()."""

    def __init__(
        self,
        db,
        run_id: str,
        files: spool.SpoolFiles,
        *,
        lock: threading.RLock,
        outbox: Outbox,
        last_step: Callable[[], int | None],
        note_error: Callable[[str], None],
        interval: float,
        lock_timeout: float,
        actor: str,
        rotate_bytes: int = ROTATE_BYTES,
    ):
        self.db, self.run_id = db, run_id
        self.files = files  # the spool log() appends to; swapped under `lock` at rotation
        self.lock = lock  # the writer's append lock
        self.outbox = outbox
        self._last_step, self._note_error = last_step, note_error
        self.interval, self.lock_timeout, self.actor = interval, lock_timeout, actor
        self.rotate_bytes = rotate_bytes
        self.retired: list[spool.SpoolFiles] = []  # rotated out, tail not yet ingested
        # spool name -> the (bin, jsonl) offsets last committed for it: an ingest that reads
        # older stored offsets refuses rather than insert those rows again
        self.committed: dict[str, tuple[int, int]] = {}
        self.refused: set[str] = set()  # spools whose last ingest raised SpoolOffsetsError
        self.damaged: set[str] = set()  # spools in which ingest stepped over damage
        self.offsets_alarm = False  # SpoolOffsetsError logged as an error already
        self.backlog = False  # the last ingest stopped at the per-transaction cap
        self.ending = False  # set by close: no rotation, no more claims
        self.last_recover = time.monotonic()
        # commands claimed at the visits once the trainer asked (auto_claim), not yet taken
        self.auto_claim = False
        self.claimed: collections.deque[Command] = collections.deque()
        # what stats() reports
        self.ingested_records = 0
        self.flushes = 0
        self.busy = 0  # visits that found the database locked for too long (records waited)
        self.last_busy: str | None = None
        self.last_flush: float | None = None
        # RLock: the SIGTERM handler may interrupt flush() in the main thread
        self._visit_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"rampwatch-flush-{self.run_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        # A visit waits at most a couple of intervals for the lock: records simply wait.
        timeout = min(self.lock_timeout, max(0.5, 2 * self.interval))
        wait = self.interval
        while not self._stop.wait(wait):
            self.visit(timeout, drain=False)
            # A backlog (after a busy spell) goes in one chunk per visit, with the lock let go
            # in between so that readers are not locked out for the whole backlog.
            wait = 0.05 if self.backlog else self.interval

    def end(self) -> None:
        """No more rotation or claims, and the thread stops after its current visit."""
        self.ending = True
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 3 * self.interval))

    # ---- commands -----------------------------------------------------------------------
    def take_claimed(self) -> list[Command]:
        """The commands claimed since the last call, oldest first; from the first call on, each
        visit claims the run's pending commands (before it, none is claimed behind the
        trainer's back)."""
        self.auto_claim = True
        out = []
        while self.claimed:
            out.append(self.claimed.popleft())
        return out

    # ---- visits -------------------------------------------------------------------------
    def note_committed(self, files: spool.SpoolFiles, res: ingest.IngestResult) -> None:
        if res.stored:
            self.committed[files.path.name] = (res.bin_offset, res.jsonl_offset)
        self.refused.discard(files.path.name)

    def _ingest_all(
        self, con, files: spool.SpoolFiles, drain: bool = True, final: bool = False
    ) -> ingest.IngestResult:
        while True:
            res = ingest.ingest_spool(
                con,
                files.path,
                heartbeat=_now(),
                final=final,
                expect=self.committed.get(files.path.name),
            )
            self.note_committed(files, res)
            self.ingested_records += res.records
            self.backlog = res.more
            if res.damaged:  # reported as an alert by ingest; the bytes are kept at close
                self.damaged.add(files.path.name)
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
            with self.lock:  # log() waits for the swap only
                old = self.files
                for name in sorted(old.name_ids, key=old.name_ids.get):
                    new.name_id(name)  # same ids in the same order: cached templates stay valid
                self.files = new
        except BaseException:
            new.close(remove=True)
            raise
        self.retired.append(old)
        self._drain_retired(con)  # the old tail first: rows reach the tables in step order
        self._ingest_all(con, new)  # and the new spool's offsets row ties it to the run at once

    def _drain_retired(self, con) -> None:
        # Nothing is appended to a retired spool any more: ingest its tail, then delete it.
        while self.retired:
            self._ingest_all(con, self.retired[0], final=True)
            done = self.retired.pop(0)
            self._release(done, remove=True)
            self.committed.pop(done.path.name, None)

    def _release(self, files: spool.SpoolFiles, remove: bool) -> None:
        """Close a spool; delete it only if asked and nothing in it was damaged."""
        if remove and files.path.name in self.damaged:
            self._set_aside(files, "it held damaged records (see the run's alert events)")
            remove = False
        files.close(remove=remove)

    def _write_outbox(self, con) -> bool:
        """Rare records the spool could not take, and unreported drops, straight into the
        database (one transaction); True if nothing is left waiting."""
        records, drops = self.outbox.snapshot()
        alert = self.outbox.alert(drops, self._last_step(), _now())
        todo = records + ([alert] if alert is not None else [])
        if not todo:
            return True
        for reason in ingest.apply_records(con, self.run_id, todo):
            self._note_error(f"a held record could not be applied: {reason}")
        self.outbox.committed(len(records), drops)
        return True

    def visit(self, timeout: float, drain: bool = True, final: bool = False) -> bool:
        """One trip to the database; True if every record spooled before it is now ingested.

        drain=False ingests at most one chunk (ingest.MAX_RECORDS) of this spool's backlog.
        final=True once nothing will be appended any more (close).
        """
        if not self._visit_lock.acquire(timeout=timeout):
            return False
        try:
            target = (self.files.size(), os.fstat(self.files.rec_fd).st_size)
            with prompt_handoffs(), write_connection(self.db, timeout) as con:
                if time.monotonic() - self.last_recover > RECOVER_EVERY:
                    self.last_recover = time.monotonic()
                    recovery.recover_dead(con, self.db)
                self._drain_retired(con)
                res = self._ingest_all(con, self.files, drain, final)
                # done: less than one whole record is left (a torn or damaged tail waits)
                done = res.bin_offset + fmt.SIZE > target[0] and res.jsonl_offset >= target[1]
                if done and target[0] >= self.rotate_bytes and not self.ending:
                    self._rotate(con)
                done = self._write_outbox(con) and done
                if self.auto_claim and not self.ending:
                    # handed over right after the claim commits: nothing in between can fail
                    self.claimed.extend(claim_pending(con, self.run_id, self.actor))
            self.flushes += 1
            self.last_flush = _now()
            return done
        except StoreBusyError as e:  # not an error: the records wait in the spool
            self.busy += 1
            self.last_busy = str(e)
            return False
        except SpoolOffsetsError as e:  # the database disagrees with what we committed
            self.refused.add(e.spool)
            if not self.offsets_alarm:
                self.offsets_alarm = True
                _log.error("rampwatch writer %s: %s", self.run_id, e)
            self._note_error(f"flush refused, records wait in the spool: {e}")
            return False
        except Exception as e:
            self._note_error(f"flush failed, records wait in the spool: {e!r}")
            return False
        finally:
            self._visit_lock.release()

    # ---- close --------------------------------------------------------------------------
    def final_visits(self, timeout: float) -> bool:
        """Visits until everything is ingested and reads back, or `timeout` runs out."""
        deadline = time.monotonic() + timeout
        ok = self.visit(max(0.1, deadline - time.monotonic()), final=True)
        while not ok and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))  # a failing database
            ok = self.visit(max(0.1, deadline - time.monotonic()), final=True)  # no spinning
        if ok:
            ok = self._readable_back()
        return ok

    def release_spools(self, ingested: bool) -> None:
        """The last step of close: a spool goes only if `ingested` (and was not damaged);
        otherwise it stays for recovery, or is set aside where recovery would trust stale
        offsets. What waits in memory goes to the spool first, if the database stayed away."""
        if not ingested:
            self._outbox_to_spool()
        for files in [*self.retired, *([] if ingested else [self.files])]:
            if files.path.name in self.refused:  # recovery would trust the stale offsets
                self._set_aside(files, "its stored offsets disagree with what it committed")
        for files in self.retired:  # only if the last visits failed: recovery finishes them
            files.close(remove=False)
        self._release(self.files, remove=ingested)

    def _readable_back(self) -> bool:
        """Before its spool goes, read back from the database what this writer committed (a
        file that took the writes but cannot return them must not cost the only copy)."""
        name = self.files.path.name
        want = self.committed.get(name)
        try:
            with read_connection(self.db, self.lock_timeout) as con:
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
        records, drops = self.outbox.snapshot()
        alert = self.outbox.alert(drops, self._last_step(), _now())
        for rec in records + ([alert] if alert is not None else []):
            try:
                self.files.append_json(rec)
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
