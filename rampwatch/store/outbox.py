"""What a writer owes the database besides its spool: rare records the spool could not take
(disk full), and how many records it dropped and why, written as an 'alert' event on the run.

Why: a dropped record used to be a Python warning and a counter nobody read; the run then ended
'finished' as if nothing was lost. Every drop is counted by reason here; the writer's flusher
writes the counts not yet reported as one alert event at its next visit (and at close), straight
into the database, since the usual reason for drops, a full disk, also stops the spool. Records
wait here, in memory, until a visit commits them; OUTBOX_LIMIT bounds that memory.
"""

from __future__ import annotations

import threading

OUTBOX_LIMIT = 10_000  # rare records held in memory while the spool cannot be written


class Outbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self.dropped: dict[str, int] = {}  # reason -> metric values (or records) dropped
        self._reported: dict[str, int] = {}
        self.last_detail: str | None = None

    def add(self, rec: dict) -> bool:
        """Hold a rare record for the next visit; False (and counted) when the outbox is full."""
        with self._lock:
            if len(self._records) < OUTBOX_LIMIT:
                self._records.append(rec)
                return True
        self.drop(f"{rec.get('k')} record: spool and outbox full", 1)
        return False

    def drop(self, reason: str, n: int, detail: str | None = None) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            if detail is not None:
                self.last_detail = detail

    def __len__(self) -> int:
        return len(self._records)

    def snapshot(self) -> tuple[list[dict], dict[str, int]]:
        """(records held now, drop counts now): pass both to committed() once written."""
        with self._lock:
            return list(self._records), dict(self.dropped)

    def alert(self, drops: dict[str, int], step: int | None, t: float) -> dict | None:
        """The event record reporting drops not yet reported, or None."""
        with self._lock:
            new = {
                r: n - self._reported.get(r, 0)
                for r, n in drops.items()
                if n > self._reported.get(r, 0)
            }
            detail = self.last_detail
        if not new:
            return None
        count, total = sum(new.values()), sum(drops.values())
        why = "; ".join(f"{n} × {r}" for r, n in sorted(new.items(), key=lambda x: -x[1]))
        message = (
            f"{count} record{'s' if count != 1 else ''} dropped by the writer since the "
            f"last report ({total} in "
            f"this session): {why}. They are not in the database."
        )
        if detail:
            message += f" Last: {detail}"
        return {
            "k": "event",
            "kind": "alert",
            "message": message,
            "step": step,
            "t": t,
            "data": {"dropped": count, "dropped_total": total, "reasons": new},
        }

    def committed(self, n_records: int, drops: dict[str, int]) -> None:
        """The first n_records held and the drops counted up to `drops` are in the database."""
        with self._lock:
            del self._records[:n_records]
            self._reported = dict(drops)

    def pending_drops(self) -> bool:
        with self._lock:
            return any(n > self._reported.get(r, 0) for r, n in self.dropped.items())
