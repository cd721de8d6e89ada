"""Checkpoints: everything a run needs to continue as the same run (id, tier, data position).

One file per run (`<dir>/<run_id>.pt`), written to a temporary name (`.<run_id>.pt.<pid>.tmp`),
synced and renamed, so a kill or a full disk during a save leaves the previous checkpoint
whole. The temporary name is per process: under DDP a rank that ran out of memory may write
while rank 0 saves (the last rename wins, and either file is a whole checkpoint).
`remove_stale_tmp` (at the trainer's start) removes the temporary files of writers that died.

A checkpoint holds plain data (dicts, lists, numbers, strings) and tensors only, and is read
with `torch.load(weights_only=True)`: a file planted where a resume looks cannot run code, it
is refused (`CheckpointError`: one line naming the file; `rampwatch train` exits 2).

A save that fails (a full disk, a file-size limit, an I/O error) removes its temporary file and
raises `SaveFailed`: one line with the path, the reason ("No space left on device") and the
space it needs. Whether that stops the run is the loop's call (trainer/loop.py,
Trainer.save_checkpoint): a periodic save or a ramp's that fails is an alert and the run goes
on, since the older checkpoint still resumes it; a save the run cannot end without (the final
one, at the end or at a stop, and an out-of-memory stop's) ends the run failed, exit 3.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rampwatch.advisor.tiers import Tier
from rampwatch.store.naming import check_run_id
from rampwatch.trainer.data_formats import DataError

KEYS = ("state", "model", "optimizer", "config")  # in every checkpoint; a "note" is optional


class CheckpointError(DataError):
    """A checkpoint that is missing, unreadable or holds more than plain data and tensors: one
    line naming the file (a DataError, so `rampwatch train` prints it and exits 2)."""


class SaveFailed(Exception):
    """A save that did not happen: one line naming the path, the reason and the space needed.
    The previous checkpoint, if any, is untouched."""


@dataclass
class TrainState:
    """The loop's position; saved with the weights and restored on resume."""

    run_id: str
    step: int = 0  # optimizer steps completed
    next_sample: int = 0  # the id of the first sample of the next step (data position)
    tokens_seen: int = 0
    per_device_batch: int = 1
    accum: int = 1
    base_lr: float = 0.0  # the schedule's base; ramps move it, the schedule shapes it
    infeasible_batches: list[int] = field(default_factory=list)  # per-device batches that OOMed
    noise_window: dict[str, Any] = field(default_factory=dict)  # NoiseScaleWindow.to_dict()
    # TrialProtocol.state_dict(): the latest trial's evidence, the retry due, the held-out batch
    # the next trial asks for, the loss curve a trial's Δ is chosen from
    trials: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # the tier is kept as its two fields, as every checkpoint has it (the world is the launch's)
    def tier(self, world_size: int) -> Tier:
        return Tier(self.per_device_batch, self.accum, world_size)

    def set_tier(self, tier: Tier) -> None:
        self.per_device_batch, self.accum = tier.per_device_batch, tier.accum


def checkpoint_path(directory: str | os.PathLike, run_id: str) -> Path:
    """`<directory>/<run_id>.pt`; InvalidNameError (a ValueError) for an id that is not a name,
    so no id (`../../x`) reaches a file outside the directory."""
    return Path(directory) / f"{check_run_id(run_id)}.pt"


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def save(
    path: Path,
    *,
    state: TrainState,
    model: torch.nn.Module,
    optimizer,
    config: dict[str, Any],
    note: dict[str, Any] | None = None,
) -> None:
    """note: what the next resume should record as an event (e.g. why the tier changed)."""
    blob = {
        "state": state.to_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": config,
    }
    if note is not None:
        blob["note"] = note
    _write(blob, path)


def load(path: Path) -> dict[str, Any]:
    blob = _read(path)
    try:
        state = dict(blob["state"])
        state.pop("noise_ema", None)  # the EMA of older checkpoints: the window refills instead
        history = state.pop("loss_history", None)  # older checkpoints kept the loss curve alone
        if history is not None and "trials" not in state:
            state["trials"] = {"loss_history": history}
        blob["state"] = TrainState(**state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a rampwatch checkpoint: its state: {e}") from None
    return blob


def retier(
    path: Path,
    per_device_batch: int,
    accum: int,
    infeasible: int,
    note: dict[str, Any] | None = None,
) -> None:
    """Rewrite a checkpoint's tier (after an OOM that stopped the run) so resume uses it."""
    blob = _read(path)
    blob["state"]["per_device_batch"] = per_device_batch
    blob["state"]["accum"] = accum
    blob["state"]["infeasible_batches"] = sorted({*blob["state"]["infeasible_batches"], infeasible})
    if note is not None:
        blob["note"] = note
    _write(blob, path)


def remove_stale_tmp(path: Path) -> list[Path]:
    """Remove the temporary files of this checkpoint whose writer is gone (killed mid-save) and
    return them; a live process's file is a save in progress and stays. Pids are looked up on
    this machine: called at start, when no other host of the run is saving yet."""
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):  # another start removed it first
            tmp.unlink()
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # nothing saves yet at start: an earlier process had our pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# -- the file ---------------------------------------------------------------------------------
def _read(path: Path) -> dict[str, Any]:
    """The checkpoint's dict, read as plain data and tensors only (never code)."""
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint at {path}: check --checkpoint-dir and the run id, "
            "or start a new run without --resume"
        )
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only met something else than plain data
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(
                f"refusing to load checkpoint {path}: it asks for {found.group(1)} while "
                "loading, which can run code (a rampwatch checkpoint holds only tensors and "
                "plain data); check where the file came from, or start a new run without --resume"
            ) from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
        raise CheckpointError(
            f"cannot read checkpoint {path}: {detail.group(1) if detail else _first_line(e)}; "
            "it is damaged or not a torch checkpoint"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"cannot read checkpoint {path}: {_first_line(e)}; it is damaged or not a torch "
            "checkpoint"
        ) from None
    if not isinstance(blob, dict) or not all(k in blob for k in KEYS):
        raise CheckpointError(f"{path} is not a rampwatch checkpoint: it needs {', '.join(KEYS)}")
    return blob


def _write(blob: dict[str, Any], path: Path) -> None:
    """Write to the temporary name, sync, rename; on any failure remove the temporary file."""
    tmp = _tmp(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(blob, f)  # through a Python file, so a failed write keeps its errno
            f.flush()
            os.fsync(f.fileno())  # a full disk may only show here (delayed allocation)
        os.replace(tmp, path)
    except BaseException as e:  # a second Ctrl-C mid-save leaves no partial file either
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not isinstance(e, Exception):
            raise
        raise SaveFailed(_failure_line(path, e, blob)) from e


def _failure_line(path: Path, error: BaseException, blob: dict[str, Any]) -> str:
    """Where, why (the errno's words, which torch's own error leaves out) and how much space
    it takes: the size of the checkpoint already there, else the tensors' bytes."""
    needed = path.stat().st_size if path.exists() else _tensor_bytes(blob)
    free = ""
    with contextlib.suppress(OSError):
        free = f", {shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there"
    kept = "the previous checkpoint is kept" if path.exists() else "there is no checkpoint yet"
    return (
        f"cannot save checkpoint {path}: {_reason(error)} (it needs about "
        f"{needed / 2**20:.1f} MiB{free}); {kept}"
    )


def _reason(error: BaseException) -> str:
    """The strerror of the first OSError in the chain (torch wraps a failed write in a
    RuntimeError), else the error's first line."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    """The first sentence (torch's errors run to paragraphs of advice)."""
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0] if text else type(error).__name__


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
