"""Data parallel under torchrun: process group set-up, the DDP wrapper, no_sync for accumulation.

Outside torchrun (no WORLD_SIZE in the environment) everything here is a no-op for one process.
gloo on the CPU, NCCL on CUDA. Only rank 0 writes to the store.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(requested_device: str = "auto") -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(requested_device, local_rank)
    if world > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local_rank, device)


def wrap(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel
    ids = [info.local_rank] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def no_sync_unless(model: torch.nn.Module, last_micro_batch: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last of a step."""
    if last_micro_batch or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def keep_effective_batch(state, old_world: int, new_world: int):
    """Resume with another world size: keep per-device batch x accumulation x world when it
    divides, else keep the per-device batch and round accumulation up."""
    total = state.per_device_batch * state.accum * old_world
    per_rank = total // new_world
    if total % new_world == 0 and per_rank % state.per_device_batch == 0:
        state.accum = per_rank // state.per_device_batch
    else:
        state.accum = max(1, -(-total // (new_world * state.per_device_batch)))
    return state


def teardown(info: DistInfo) -> None:
    if info.enabled and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
