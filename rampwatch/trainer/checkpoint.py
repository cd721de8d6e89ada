"""Checkpoints: everything a run needs to continue as the same run (id, tier, data position).

One file per run (`<dir>/<run_id>.pt`), written to a temporary name and renamed, so a kill
during a save leaves the previous checkpoint whole. The temporary name is per process: under
DDP a rank that ran out of memory may write while rank 0 saves (the last rename wins, and
either file is a whole checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rampwatch.store.naming import check_run_id


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    blob = {
        "state": state.to_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": config,
    }
    if note is not None:
        blob["note"] = note
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}: check --checkpoint-dir and the run id, "
            "or start a new run without --resume"
        )
    blob = torch.load(path, map_location="cpu", weights_only=False)
    state = dict(blob["state"])
    state.pop("noise_ema", None)  # the EMA of older checkpoints: the window refills instead
    blob["state"] = TrainState(**state)
    return blob


def retier(
    path: Path,
    per_device_batch: int,
    accum: int,
    infeasible: int,
    note: dict[str, Any] | None = None,
) -> None:
    """Rewrite a checkpoint's tier (after an OOM that stopped the run) so resume uses it."""
    blob = torch.load(path, map_location="cpu", weights_only=False)
    blob["state"]["per_device_batch"] = per_device_batch
    blob["state"]["accum"] = accum
    blob["state"]["infeasible_batches"] = sorted({*blob["state"]["infeasible_batches"], infeasible})
    if note is not None:
        blob["note"] = note
    tmp = _tmp(path)
    torch.save(blob, tmp)
    os.replace(tmp, path)
