"""What the monitor reads from the device and the process: capacity, name, memory per step, the
distributed job it runs in, and whether the model's gradients are sharded.

Owns: `device_capacity_bytes`, `device_name`, `CpuPeak` (peak RSS between steps on Linux),
`memory_metrics`, `distributed` (rank, world size) and `unmeasured_sharding` (FSDP1 / DeepSpeed;
FSDP2 is measured: monitor/fsdp_norms.py).
No store writes here: monitor.py and memprobe.py call these and log what they return.
"""

from __future__ import annotations

import contextlib
import os

import psutil
import torch
import torch.distributed as torch_dist

from rampwatch.store import names as M


def device_capacity_bytes(device: torch.device) -> int:
    """What one device can hold: CUDA total memory, or the machine's RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


class CpuPeak:
    """Peak resident memory between steps on Linux: VmHWM, reset through /proc/self/clear_refs."""

    def __init__(self) -> None:
        self.resettable = os.path.exists("/proc/self/clear_refs")
        self.proc = psutil.Process()

    def read_and_reset(self) -> tuple[int, int]:
        rss = self.proc.memory_info().rss
        peak = rss
        if self.resettable:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = int(line.split()[1]) * 1024
                        break
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        return rss, peak


def distributed() -> tuple[int, int]:
    """(rank, world size) of an initialized torch.distributed job, else (0, 1)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank(), torch_dist.get_world_size()
    return 0, 1


def memory_metrics(
    device: torch.device, cpu_peak: CpuPeak | None, capacity: int
) -> dict[str, float]:
    """One step's memory metrics, peaks reset for the next: CUDA allocator figures (peak
    *reserved*, what an out-of-memory is decided against) or the process's RSS and peak RSS."""
    if device.type == "cuda":
        out = {
            M.MEM_ALLOCATED: torch.cuda.memory_allocated(device),
            M.MEM_RESERVED: torch.cuda.memory_reserved(device),
            M.MEM_PEAK: torch.cuda.max_memory_reserved(device),
        }
        torch.cuda.reset_peak_memory_stats(device)
    else:
        rss, peak = cpu_peak.read_and_reset()
        out = {M.MEM_RSS: rss, M.MEM_PEAK: peak}
    out[M.MEM_CAPACITY] = capacity
    return out


def unmeasured_sharding(model: torch.nn.Module) -> str | None:
    """Why a wrapper's gradients cannot be measured: FSDP1's FullyShardedDataParallel or
    DeepSpeed's engine (their .grad is a shard, or none); None otherwise."""
    names = {type(m).__name__ for m in (model, getattr(model, "module", model))}
    if "FullyShardedDataParallel" in names:
        return "FSDP1 (FullyShardedDataParallel) keeps a flat shard of .grad per rank"
    if "DeepSpeedEngine" in names:
        return "DeepSpeed ZeRO keeps its gradients partitioned, outside .grad"
    return None
