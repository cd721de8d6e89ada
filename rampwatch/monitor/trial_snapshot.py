"""Where a ramp trial keeps its copies of the run's state: host memory when they fit, else files.

Owns `Snapshot` (model, optimizer, scheduler and torch RNG state: restore() puts them back
exactly), `SnapshotPlace` and `place_snapshots` (host memory or a folder, decided once per trial
for all its copies), and `SnapshotsDoNotFit`.

A trial holds up to COPIES states at once (monitor/trial_runner.py: the snapshot, the control's
end, the passing chain's end, the arm being judged; one more with `keep`). In host memory each is
a CPU copy, and a restore passes through one more copy of the optimizer's state (load_state_dict
would otherwise alias the saved tensors on a CPU run); HOST_SHARE leaves room for it. That is the fast path, and the wrong one for a large run: Adam's state is 3 × the
parameters, so four copies of a 7B model's state in fp32 are ~340 GB, and eight ranks of a node
share one host. So the copies go to host memory only while they take at most HOST_SHARE of the
memory the kernel says is available (MemAvailable), divided among the node's ranks
(LOCAL_WORLD_SIZE); otherwise to files in the trial's folder (the reference trainer's: beside its
checkpoint), one torch.save per copy, which streams one tensor at a time through host memory. A
loop that gives no folder gets a plain refusal with the sizes instead of a host out-of-memory.
`mode` overrides the rule: "memory" (the loop knows it fits), "disk" (always files).

A file holds the state's tensors only, as a list; the structure around them stays in memory with
a slot per tensor, so a DTensor (FSDP2's sharded state) is saved as its local shard and rebuilt
on the live mesh at restore (torch.save cannot pickle a DeviceMesh). Tensors load back onto the
device they were saved from. Under torch.distributed every rank's choice is reduced (one small
all-reduce): if any rank needs files, every rank uses them, and if any rank cannot place its
copies, every rank refuses, since a rank that went on alone would pair its arms' collectives with
nothing.
"""

from __future__ import annotations

import copy
import fcntl
import itertools
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

__all__ = [
    "COPIES",
    "HOST_SHARE",
    "Snapshot",
    "SnapshotPlace",
    "SnapshotsDoNotFit",
    "place_snapshots",
    "remove_left_behind",
]

COPIES = 4  # the snapshot, the control's end, the passing chain's end, the arm being judged
HOST_SHARE = 0.5  # of the host memory available to a rank: the rest is the loop's and the OS's
MODES = ("auto", "memory", "disk")
FOLDER_PREFIX = "rampwatch-trial-"  # the only names place_snapshots creates and removes
LOCK = ".lock"  # in a trial folder: locked by its process while the trial runs


class SnapshotsDoNotFit(RuntimeError):
    """The trial's copies fit neither in host memory nor in the folder given (or none was)."""


@dataclass(frozen=True)
class SnapshotPlace:
    """Where one trial's copies live: host memory (folder None) or files in `folder`."""

    folder: Path | None
    state_bytes: int  # one copy: the model's and the optimizer's tensors on this rank
    copies: int
    lock: int | None = None  # the folder's lock file, held while the trial runs

    def describe(self) -> str:
        where = "host memory" if self.folder is None else f"files in {self.folder}"
        return f"{self.copies} × {_size(self.state_bytes)} in {where}"

    def take(self, model, optimizer, scheduler=None) -> Snapshot:
        return Snapshot.take(model, optimizer, scheduler, folder=self.folder)

    def close(self) -> None:
        """Remove the trial's folder (its files are no use once the kept arm is in place)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.lock is not None:
            os.close(self.lock)


def place_snapshots(
    model, optimizer, mode: str = "auto", parent: Path | str | None = None, copies: int = COPIES
) -> SnapshotPlace:
    """Decide where a trial's `copies` go (module docstring); with files, a fresh folder
    `parent/rampwatch-trial-<host>-<pid>-<n>` (ranks and runs that share `parent` never meet),
    locked while the trial runs, after removing those a killed trial left there.
    SnapshotsDoNotFit names the sizes and what to do."""
    if mode not in MODES:
        raise ValueError(f"snapshots={mode!r}: one of {', '.join(MODES)}")
    size = state_bytes(model, optimizer)
    need = copies * size
    host = available_host_bytes()
    share = None if host is None else int(HOST_SHARE * host / local_ranks())
    wants_disk = mode == "disk" or (mode == "auto" and share is not None and need > share)
    problem = _why_no_files(parent, need, copies, mode, share)
    to_disk, any_problem = _agreed(model, wants_disk, problem is not None)
    if not to_disk:
        return SnapshotPlace(None, size, copies)
    if any_problem:
        if problem is None:
            problem = "another rank cannot put its copies in files"
        elif not wants_disk and parent is None:  # fits here, but every rank goes the same way
            problem = (
                "another rank's copies do not fit its host memory and this rank has no folder "
                "for files: give every rank run_trial(..., snapshot_dir=DIR)"
            )
        raise SnapshotsDoNotFit(problem)
    folder = Path(parent) / f"{FOLDER_PREFIX}{socket.gethostname()}-{os.getpid()}-{next(_numbers)}"
    return SnapshotPlace(folder, size, copies, _locked(folder))


def _why_no_files(parent, need: int, copies: int, mode: str, share: int | None) -> str | None:
    """Why the copies cannot go to files in `parent` (none given, too little space), or None;
    a parent given is made, and what killed trials left there removed."""
    what = f"the trial's {copies} copies of the model and optimizer state need {_size(need)}"
    if parent is None:
        if mode == "disk":
            return "snapshots='disk' needs a folder: run_trial(..., snapshot_dir=DIR)"
        return (
            f"{what}, more than {_percent(HOST_SHARE)} of this rank's available host memory "
            f"({_size(share or 0)}): give the trial a folder on a local disk for them "
            "(run_trial(..., snapshot_dir=DIR))"
        )
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    remove_left_behind(parent)
    free = shutil.disk_usage(parent).free
    if need > free:
        return (
            f"{what} and {parent} has {_size(free)} free: free space there or give another folder"
        )
    return None


@dataclass(frozen=True)
class Snapshot:
    """Everything an arm's future depends on that torch holds: restore() puts it back exactly.
    In memory, `model` and `optimizer` are CPU copies; with a file, their structure with a
    `_Slot` per tensor, the tensors in `file`."""

    model: dict
    optimizer: dict
    scheduler: dict | None
    cpu_rng: torch.Tensor
    cuda_rng: list | None
    file: Path | None = None

    @classmethod
    def take(cls, model, optimizer, scheduler=None, folder: Path | None = None) -> Snapshot:
        rng = dict(
            scheduler=None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        )
        if folder is None:
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            return cls(state, _to_cpu(optimizer.state_dict()), **rng)
        tensors: list = []
        shapes = _hollow(model.state_dict(), tensors), _hollow(optimizer.state_dict(), tensors)
        file = folder / f"state-{next(_numbers)}.pt"
        torch.save(tensors, file)
        return cls(*shapes, **rng, file=file)

    def restore(self, model, optimizer, scheduler=None) -> None:
        if self.file is None:
            model.load_state_dict(self.model)
            # load_state_dict moves the state to the parameters' device and keeps our copy intact
            optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        else:
            tensors = torch.load(self.file, weights_only=True)  # fresh, on their own devices
            model.load_state_dict(_filled(self.model, tensors))
            optimizer.load_state_dict(_filled(self.optimizer, tensors))
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def drop(self) -> None:
        """Free its file now (a copy no longer kept); in memory, the garbage collector does."""
        if self.file is not None:
            self.file.unlink(missing_ok=True)


_numbers = itertools.count()


def remove_left_behind(parent: Path) -> None:
    """The trial folders in `parent` whose process is gone (a SIGKILL mid-trial): those whose
    lock file nobody holds. A lock, not the pid in the name: a restarted container's process
    often gets the killed one's pid."""
    for old in parent.glob(f"{FOLDER_PREFIX}*"):
        try:
            fd = os.open(old / LOCK, os.O_RDWR)
        except OSError:  # gone: a peer removed it first
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a running trial's
            continue
        else:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            os.close(fd)


def _locked(folder: Path) -> int:
    """A new trial folder, held: the descriptor of its lock file, locked until closed. Made under
    a name remove_left_behind does not match and renamed once locked, so no peer (a rank tidying
    the same parent as this one starts) ever sees it unlocked."""
    making = folder.with_name(f".{folder.name}")
    making.mkdir()
    fd = os.open(making / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    making.rename(folder)
    return fd


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a Snapshot's file; a DTensor's mesh and layout to rebuild it on."""

    index: int
    dtensor: tuple | None = None  # (mesh, placements, shape, stride)


def _mapped(state, leaf):
    """`state` with leaf(x) in place of each tensor (or _Slot) x: dicts, lists and tuples
    rebuilt, any other value deep-copied, so the result shares nothing mutable with `state`."""
    if isinstance(state, torch.Tensor | _Slot):
        return leaf(state)
    if isinstance(state, dict):
        return {k: _mapped(v, leaf) for k, v in state.items()}
    if isinstance(state, list):
        return [_mapped(v, leaf) for v in state]
    if type(state) is tuple:  # a named tuple keeps its type: deep-copied below
        return tuple(_mapped(v, leaf) for v in state)
    return copy.deepcopy(state)


def _hollow(state, tensors: list):
    """`state` with each tensor replaced by a _Slot, the tensors (local shards) appended."""

    def slot(t: torch.Tensor) -> _Slot:
        spec = None
        if _is_dtensor(t):
            spec = (t.device_mesh, t.placements, t.shape, t.stride())
            t = t.to_local()
        tensors.append(t.detach())
        return _Slot(len(tensors) - 1, spec)

    return _mapped(state, slot)


def _filled(state, tensors: list):
    """_hollow's inverse: each _Slot replaced by its tensor (a DTensor rebuilt on its mesh)."""

    def tensor(s: _Slot) -> torch.Tensor:
        if s.dtensor is None:
            return tensors[s.index]
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = s.dtensor
        return DTensor.from_local(tensors[s.index], mesh, placements, shape=shape, stride=stride)

    return _mapped(state, tensor)


def _to_cpu(state):
    """A CPU copy of every tensor in `state`; no deepcopy first, which would copy each device
    tensor on its device (a second optimizer state on the GPU) before moving it."""
    return _mapped(state, lambda t: t.detach().to("cpu", copy=True))


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def state_bytes(model, optimizer) -> int:
    """One copy's bytes on this rank, as the memory path copies them: every tensor of the
    model's state_dict and of the optimizer's state (a DTensor's local shard)."""
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        t = t.to_local() if _is_dtensor(t) else t
        total += t.numel() * t.element_size()

    _mapped(model.state_dict(), count)
    _mapped(optimizer.state_dict()["state"], count)
    return total


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux: free memory plus what the kernel can reclaim);
    elsewhere the free pages sysconf reports, or None where neither is known (then the copies
    go to host memory, as before this rule)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def local_ranks() -> int:
    """The ranks on this host that share its memory (torchrun's LOCAL_WORLD_SIZE), at least 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _agreed(model, to_disk: bool, problem: bool) -> tuple[bool, bool]:
    """(files, a problem with files) over every rank: the max of each (a no-op alone). Every
    rank then takes the same way: memory, files, or a refusal."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return to_disk, problem
    param = next(iter(model.parameters()), None)
    device = torch.device("cpu") if param is None else param.device
    if device.type == "cuda" and torch_dist.get_backend() == "gloo":
        device = torch.device("cpu")
    flags = torch.tensor([int(to_disk), int(problem)], dtype=torch.int64, device=device)
    torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def _size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"
