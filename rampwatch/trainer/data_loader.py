"""The reference trainer's loader: micro-batches by sample id, made ahead of need in one
background thread (in pinned host memory on CUDA) and copied to the device without blocking.

Batches are keyed by (first sample id, count), so prefetching cannot change what a step sees:
the loop says which keys this step and (if its tier holds) the next step need; a key it no
longer wants (a ramp, an out-of-memory redo, a world-size change) is dropped and the one asked
for instead is made on demand, the same windows as TokenDataset.batch gives. One worker thread
is the only caller of the dataset, so its epoch cache needs no lock. `wait_s` is the time the
loop spent waiting for data (including the copy), the loader's share of each step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Prefetcher:
    def __init__(self, data, device: torch.device | str):
        self.data, self.device = data, torch.device(device)
        # Page-locked buffers make the host→device copy a DMA that does not block the host.
        self.pin = self.device.type == "cuda"
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rampwatch-data")
        self.pending: dict[tuple[int, int], Future] = {}
        self.wait_s, self.gets, self.misses = 0.0, 0, 0

    def _make(self, first: int, n: int):
        x, y, _ids = self.data.batch(first, n)
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def want(self, keys: list[tuple[int, int]]) -> None:
        """Queue these (first id, count) batches, in order; drop queued ones not among them."""
        keep = set(keys)
        for key in [k for k in self.pending if k not in keep]:
            self.pending.pop(key).cancel()  # one already running finishes and is thrown away
        for key in keys:
            if key not in self.pending:
                self.pending[key] = self.pool.submit(self._make, *key)

    def get(self, first: int, n: int):
        """x, y of samples [first, first + n) on the device (waits if not made yet)."""
        t0 = time.perf_counter()
        fut = self.pending.pop((first, n), None)
        if fut is None:
            self.misses += 1
            fut = self.pool.submit(self._make, first, n)
        x, y = fut.result()
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        self.gets += 1
        self.wait_s += time.perf_counter() - t0
        return x, y

    def close(self) -> None:
        for fut in self.pending.values():
            fut.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
