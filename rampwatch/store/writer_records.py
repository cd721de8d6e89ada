"""RunWriter's rare records and command hand-over: events, memory-plan rows, run updates,
commands claimed for the trainer and the trainer's results, none of which waits on the database.

A mixin of RunWriter (store/writer.py), which owns the state these methods use: the spool
(`_files`), its lock, the outbox of records the spool could not take, the deque of commands
its flusher claimed, and `_note_error`. Kept apart so that each file keeps to one concern: this
one is everything a training loop sends besides metric values.
"""

from __future__ import annotations

import json
import operator
import time

from rampwatch.store.command_rows import Command, as_command_id
from rampwatch.store.naming import check_run_name
from rampwatch.store.steps import as_step

PLAN_SOURCES = ("plan", "measured", "oom", "probe")
_now = time.time


def json_ready(obj, what: str):
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be JSON-serializable (dicts, lists, str, numbers): {e}"
        ) from None
    return obj


class RareRecords:
    # ---- rare records -------------------------------------------------------------------
    def _append(self, rec: dict, after_close: bool = False) -> None:
        """Spool a rare record; if the spool cannot take it, the next visit writes it."""
        try:
            with self._lock:
                if self._closed and not after_close:
                    raise RuntimeError("writer is closed")
                try:
                    self._files.append_json(rec)
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
        claimed but never taken are refused at close. Do not mix with pending_commands()/claim().
        """
        self._auto_claim = True
        self._pending = []  # the flusher claims them now: never offer one to claim() too
        out = []
        while self._claimed:
            out.append(self._claimed.popleft())
        return out

    def pending_commands(self) -> list[Command]:
        """This run's pending commands as of the last flush (claim one before acting on it).

        The older, blocking way: claim() waits on the database. Prefer take_claimed_commands().
        """
        return list(self._pending)

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
