"""RunWriter's trips to the database: the flusher thread, each visit's exactly-once ingest of
the spool, spool rotation, the held records and drop counts written straight into the
database, and what close() checks before a spool may go.

Once a spool is fully ingested and over ROTATE_BYTES, the writer continues in a fresh one and
deletes the old, so a long run's spool does not grow without bound. The writer remembers the
spool offsets it committed; should the database ever hand back older ones (or none), it refuses
to ingest (SpoolOffsetsError, in `errors`/`last_error` and logged as an error) rather than
insert rows twice, and at close sets that spool aside as `<session>.corrupt` instead of leaving
it to recovery, which would trust the stale offsets.

A mixin of RunWriter (store/writer.py), which owns the state these methods use: the spool
(`_files`) and the retired ones, the offsets it committed per spool, the outbox, the locks and
the counters of stats(). Kept apart so that each file keeps to one concern: writer.py is what
the training loop calls (start, log, claim, close), this one is the visits to the database that
move the spool in (from the flusher thread, flush() and close()).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from rampwatch.store import ingest, recovery, spool
from rampwatch.store import spool_format as fmt
from rampwatch.store.command_rows import claim_pending, pending
from rampwatch.store.db import read_connection, spool_root, write_connection
from rampwatch.store.errors import SpoolOffsetsError, StoreBusyError, StoreError
from rampwatch.store.txn import first

_log = logging.getLogger("rampwatch.store")
_now = time.time
RECOVER_EVERY = 30.0  # seconds between a live writer's sweeps for other writers' dead spools
ROTATE_BYTES = 64 << 20  # a fully ingested spool this big is replaced by a fresh one


class SpoolFlusher:
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
                    self._claimed.extend(claim_pending(con, self.run_id, self._actor))
                else:
                    self._pending = pending(con, self.run_id)
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
