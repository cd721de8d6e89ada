"""monitor/device.py CpuPeak: /proc's files kept open give the figures a fresh read gives."""

from __future__ import annotations

import copy
import json
import mmap
import os
import resource
import subprocess
import sys

import psutil
import pytest

from rampwatch.monitor.device import CpuPeak

pytestmark = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux clear_refs"
)


def _fresh_peak() -> int:
    """VmHWM as the code before kept-open files read it: a fresh open of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _resident(size: int) -> mmap.mmap:
    """`size` bytes of fresh pages, each touched so that it is resident; close() gives them
    back. A bytes object would not do: malloc may serve it from freed memory the process still
    holds (a test worker's heap grows to hundreds of MB), which raises no peak."""
    pages = mmap.mmap(-1, size)
    for at in range(0, size, mmap.PAGESIZE):
        pages[at] = 1
    return pages


def _spike(size: int) -> None:
    """Raise the resident set by `size` bytes, then give them back."""
    _resident(size).close()


def test_rss_and_peak_are_psutils_and_the_status_files():
    cpu = CpuPeak()
    held = []
    for i in range(20):
        held.append(b"x" * (4 << 20))  # RSS grows by 4 MiB a round (every page written)
        if i % 5 == 4:
            held.clear()
        fresh = _fresh_peak()
        rss, peak = cpu.read_and_reset()
        assert cpu._status >= 0  # read through the kept files
        # the same figures, to the few pages Python may touch between two reads
        assert abs(rss - psutil.Process().memory_info().rss) <= 1 << 20
        assert abs(peak - fresh) <= 1 << 20
        _spike(32 << 20)  # a peak between two reads
        rss2, peak2 = cpu.read_and_reset()
        assert peak2 >= rss2 + (24 << 20), (rss2, peak2)  # found, then reset
        assert cpu.read_and_reset()[1] < peak2 - (24 << 20)


def test_a_copy_opens_its_own_files():
    cpu = CpuPeak()
    cpu.read_and_reset()
    twin = copy.copy(cpu)
    assert twin._status == -1
    twin.read_and_reset()
    assert twin._status >= 0 and twin._status != cpu._status
    del twin
    assert cpu.read_and_reset()[0] > 0  # its own files are still open


def test_a_reused_descriptor_is_never_written(tmp_path):
    # clear_refs is written only when the peak is above the resident set: a spike makes one
    cpu = CpuPeak()
    _spike(32 << 20)
    cpu.read_and_reset()
    os.close(cpu._clear)  # closed behind its back, and the number given to another file
    victim = os.open(tmp_path / "victim", os.O_RDWR | os.O_CREAT)
    try:
        assert victim == cpu._clear
        _spike(32 << 20)
        rss, peak = cpu.read_and_reset()
        assert rss > 0 and peak >= rss + (24 << 20)
        assert os.path.getsize(tmp_path / "victim") == 0
        assert cpu._clear == -1  # forgotten, not closed: the descriptor is the victim's
        _spike(32 << 20)
        cpu.read_and_reset()
        assert cpu._clear >= 0 and cpu._clear != victim
    finally:
        os.close(victim)


def test_a_forked_child_reads_its_own_process():
    cpu = CpuPeak()
    cpu.read_and_reset()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            cpu.read_and_reset()
            ok = cpu._pid == os.getpid()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cpu._pid == os.getpid() and cpu.read_and_reset()[0] > 0


_CHILD = """
import json, mmap, sys
from rampwatch.monitor.device import CpuPeak

def fresh_peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

cpu = CpuPeak()
out = []
for i in range(8):
    if i % 2:
        with mmap.mmap(-1, 64 << 20) as pages:
            for at in range(0, 64 << 20, mmap.PAGESIZE):
                pages[at] = 1
    fresh = fresh_peak()
    rss, peak = cpu.read_and_reset()
    out.append([rss, peak, fresh])
print(json.dumps({"reads": out, "status_reads": cpu.status_reads}))
"""


def test_a_child_of_a_larger_process_reads_its_own_peak():
    # getrusage's ru_maxrss, the cheap peak, never reads below the high-water mark of the image
    # that exec'd the process: here the parent's 1 GiB. The child's figures are still its own.
    ballast = _resident(1 << 30)
    try:
        run = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120
        )
    finally:
        ballast.close()
    assert run.returncode == 0, run.stderr
    reads = json.loads(run.stdout)["reads"]
    for i, (rss, peak, fresh) in enumerate(reads):
        assert peak < 768 << 20, (i, peak)  # not the parent's
        assert abs(peak - fresh) <= 1 << 20, (i, peak, fresh)
        assert peak >= rss
        if i % 2:
            assert peak >= rss + (48 << 20), (i, rss, peak)  # the spike, found


def _above_the_exec_floor() -> mmap.mmap | None:
    """Pages that lift the resident set above ru_maxrss's floor, where it is below it: a test
    worker spawned by a large pytest can sit under the floor its parent left (CpuPeak then
    reads status every step, as it must), which is no steady process. Just after a reset,
    ru_maxrss is the floor or the resident set, whichever is larger."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    short = floor - psutil.Process().memory_info().rss
    if short <= 0:
        return None
    return _resident((short + (64 << 20)) // mmap.PAGESIZE * mmap.PAGESIZE)


def test_a_steady_process_reads_the_peak_without_status():
    ballast = _above_the_exec_floor()
    try:
        cpu = CpuPeak()
        for i in range(40):
            if i % 4 == 3:
                _spike(32 << 20)
            fresh = _fresh_peak()
            rss, peak = cpu.read_and_reset()
            assert abs(peak - fresh) <= 1 << 20, (i, peak, fresh)
        # status, the costly read, only until the floor is known (the first read or two)
        assert cpu.status_reads <= 2, cpu.status_reads
    finally:
        if ballast is not None:
            ballast.close()
