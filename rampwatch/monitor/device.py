"""What the monitor reads from the device and the process: capacity, name, memory per step, the
distributed job it runs in, and whether the model's gradients are sharded.

Owns: `device_capacity_bytes`, `device_name`, `CpuPeak` (peak RSS between steps on Linux),
`memory_metrics`, `distributed` (rank, world size) and `unmeasured_sharding` (FSDP1 / DeepSpeed;
FSDP2 is measured: monitor/fsdp_norms.py).
No store writes here: monitor.py and memprobe.py call these and log what they return.
"""

from __future__ import annotations

import contextlib
import math
import os

try:
    import resource  # Unix only; CpuPeak reads through it on Linux
except ImportError:  # pragma: no cover - Windows
    resource = None

import psutil
import torch
import torch.distributed as torch_dist

from rampwatch.store import names as M

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
    """Peak resident memory between steps on Linux: the high-water mark, reset through
    /proc/self/clear_refs.

    Every step reads the resident set from /proc/self/statm and the peak from getrusage's
    ru_maxrss, the same mark as /proc/self/status's VmHWM at a fraction of its cost (in a
    training loop here: status 22 µs, statm 2, getrusage 1 to 5). But ru_maxrss never reads
    below a floor the kernel sets at exec, the high-water mark of the image that exec'd (a
    trainer spawned by a 2 GB notebook reads 2 GB). So it is the peak only where it must be
    the process's own: above a known upper bound of that floor, or while the resident set is
    at or above that bound. Otherwise status is read, as before, and the bound tightened: any
    ru_maxrss is one, and the tightest is read just after a reset (the floor or the resident
    set, whichever is larger). statm, status and clear_refs stay open and are re-read in place
    (os.pread at offset 0 makes the kernel write them afresh); clear_refs is written when
    there is a peak to reset. A forked child opens its own."""

    def __init__(self) -> None:
        self.resettable = os.path.exists("/proc/self/clear_refs") and resource is not None
        self.proc = psutil.Process()
        self.status_reads = 0  # steps whose peak came from /proc/self/status
        self._pid = -1  # the process the open files are of
        self._statm = self._status = self._clear = -1  # their descriptors; -1: not open
        self._clear_id = (0, 0)  # clear_refs' (device, inode): written only while it is that
        self._floor = math.inf  # an upper bound of ru_maxrss's floor, in bytes

    def __getstate__(self) -> dict:
        """A copy (copy, deepcopy, pickle) opens its own files: none are shared."""
        return {**self.__dict__, "_pid": -1, "_statm": -1, "_status": -1, "_clear": -1}

    def read_and_reset(self) -> tuple[int, int]:
        if self.resettable and (self._pid == os.getpid() or self._open()):
            try:
                return self._read_open()
            except (OSError, ValueError, IndexError):
                # not the files opened (closed behind our back, the number reused): forget them
                # without closing what may be someone else's now, and read as below
                self._pid = -1
                self._statm = self._status = self._clear = -1
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

    def _open(self) -> bool:
        """Open /proc's files for this process; False (and none open) where one cannot be."""
        self.close()
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.close()
            return False
        self._pid = os.getpid()
        self._floor = math.inf  # a new process (a forked child): its floor is not known
        return True

    def _read_open(self) -> tuple[int, int]:
        statm = os.pread(self._statm, 256, 0)  # "size resident shared ..." in pages
        rss = int(statm.split(None, 2)[1]) * _PAGE
        peak = _maxrss_bytes()
        floor_may_show = peak <= self._floor and rss < self._floor
        if floor_may_show:  # status's own peak, and the floor's bound from this reading
            self._floor = min(self._floor, peak)
            peak = max(self._status_peak(), rss)
            self.status_reads += 1
        # a peak at the resident set now needs no reset: the next read's peak is then the next
        # step's alone, as after one (most steps, where freed memory stays resident)
        if peak > rss:
            self._reset()
            if floor_may_show:  # right after a reset: the floor or the resident set, the tightest
                self._floor = min(self._floor, _maxrss_bytes())
        return rss, peak

    def _status_peak(self) -> int:
        status = os.pread(self._status, 4096, 0)  # ~1.5 kB; a larger read costs more
        if len(status) == 4096:  # perhaps not all of it (a long Groups line): all of it
            status = os.pread(self._status, 1 << 22, 0)
        if not status.startswith(b"Name:"):
            raise ValueError("not /proc/self/status")
        peak = _status_bytes(status, b"\nVmHWM:")
        if peak is None:
            raise ValueError("no VmHWM in /proc/self/status")
        return peak

    def _reset(self) -> None:
        """The high-water mark back to the current resident set, through the kept clear_refs."""
        if self._clear < 0:  # as a fresh open each step: tried again while it fails
            with contextlib.suppress(OSError):
                self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
                st = os.fstat(self._clear)
                self._clear_id = (st.st_dev, st.st_ino)
        if self._clear >= 0:
            st = os.fstat(self._clear)  # never a "5" into a file that is not clear_refs
            if (st.st_dev, st.st_ino) != self._clear_id:
                raise ValueError("not /proc/self/clear_refs")
            with contextlib.suppress(OSError):
                os.write(self._clear, b"5")  # resets VmHWM to the current RSS

    def close(self) -> None:
        """Close the files (a later read opens them again)."""
        fds = (self._statm, self._status, self._clear)
        self._pid = -1
        self._statm = self._status = self._clear = -1
        for fd in fds:
            if fd >= 0:  # a forked child closes its own copies
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone
            pass


def _maxrss_bytes() -> int:
    """getrusage's ru_maxrss (kB on Linux) in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(status: bytes, key: bytes) -> int | None:
    """A "kB" figure of /proc/self/status in bytes; key: b"\\nVmRSS:" (the first line that
    starts with it)."""
    at = status.find(key)
    return None if at < 0 else int(status[at + len(key) :].split(None, 1)[0]) * 1024


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
