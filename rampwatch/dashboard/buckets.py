"""Downsampled series on the dashboard side, and the incremental fetch that keeps them current.

Owns: `Buckets` (one metric of one run as power-of-two step buckets: min, max, last, counts,
non-finite counts; numpy columns), `width_for` (the bucket width for a run length and a chart
width), and `SeriesCache` (what a live page keeps in session state: the buckets it has, merged
with a refetch of only the last, partial bucket onward; coarsened locally when the run outgrows
the width, which is exact because buckets are aligned powers of two).

No Streamlit and no store here: the fetch is a function passed in (dashboard/store_access.py
supplies the store-backed one), so the merge logic is unit-tested against a full fetch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["Buckets", "width_for", "SeriesCache", "Fetch"]

_FLOATS = ("lo", "hi", "last")
_INTS = ("bucket", "last_step", "n", "nonfinite")


@dataclass(frozen=True)
class Buckets:
    """Bucket i covers steps [bucket[i]·width, (bucket[i]+1)·width); sorted by bucket.

    lo/hi: min/max of the finite values (NaN when the bucket has none); last: the value at
    last_step (may be non-finite); n: rows; nonfinite: rows whose value was NaN or ±inf.
    """

    width: int
    bucket: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lo: np.ndarray = field(default_factory=lambda: np.zeros(0))
    hi: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last: np.ndarray = field(default_factory=lambda: np.zeros(0))
    n: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    nonfinite: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def from_columns(cls, width: int, **cols) -> Buckets:
        """Build from any sequences (lists, arrays, Arrow columns); None becomes NaN."""
        out = {}
        size = None
        for name in _INTS + _FLOATS:
            if name not in cols or cols[name] is None:
                continue
            col = cols[name]
            if name in _INTS:
                arr = np.asarray(col, dtype=np.int64)
            else:
                arr = (
                    np.array([np.nan if x is None else x for x in col], dtype=np.float64)
                    if isinstance(col, list)
                    else np.asarray(col, dtype=np.float64)
                )
            out[name] = arr
            size = len(arr)
        size = size or 0
        if "nonfinite" not in out:
            out["nonfinite"] = np.zeros(size, np.int64)
        b = cls(int(width), **out)
        b._check()
        return b

    def _check(self) -> None:
        sizes = {len(getattr(self, c)) for c in _INTS + _FLOATS}
        if len(sizes) != 1:
            raise ValueError(f"bucket columns differ in length: {sizes}")
        if self.width < 1 or self.width & (self.width - 1):
            raise ValueError(f"bucket width must be a power of two, got {self.width}")

    def __len__(self) -> int:
        return len(self.bucket)

    @property
    def steps(self) -> np.ndarray:
        """x position of each bucket: its last step."""
        return self.last_step

    @property
    def max_step(self) -> int | None:
        return int(self.last_step[-1]) if len(self) else None

    def take(self, mask_or_index) -> Buckets:
        return replace(self, **{c: getattr(self, c)[mask_or_index] for c in _INTS + _FLOATS})

    def before(self, bucket_index: int) -> Buckets:
        """Buckets with index < bucket_index."""
        return self.take(self.bucket < bucket_index)

    def concat(self, other: Buckets) -> Buckets:
        if other.width != self.width:
            raise ValueError(f"cannot join buckets of width {self.width} and {other.width}")
        return replace(
            self,
            **{c: np.concatenate([getattr(self, c), getattr(other, c)]) for c in _INTS + _FLOATS},
        )

    def coarsen(self, width: int) -> Buckets:
        """The same data at a larger power-of-two width: exact (min of mins, max of maxes, ...)."""
        if width == self.width:
            return self
        if width < self.width or width & (width - 1):
            raise ValueError(
                f"can only coarsen width {self.width} to a larger power of two, got {width}"
            )
        shift = (width // self.width).bit_length() - 1
        if not len(self):
            return Buckets(width)
        groups = self.bucket >> shift
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        ends = np.r_[starts[1:], len(self)] - 1
        with np.errstate(invalid="ignore"):
            lo = np.fmin.reduceat(self.lo, starts)
            hi = np.fmax.reduceat(self.hi, starts)
        return Buckets(
            width,
            groups[starts],
            self.last_step[ends],
            lo,
            hi,
            self.last[ends],
            np.add.reduceat(self.n, starts),
            np.add.reduceat(self.nonfinite, starts),
        )


def width_for(last_step: int | None, target_buckets: int) -> int:
    """Smallest power of two w with (last_step + 1)/w <= target_buckets (1 for short runs)."""
    if last_step is None or last_step < 0:
        return 1
    need = -(-(int(last_step) + 1) // max(1, int(target_buckets)))
    return 1 << max(0, (need - 1).bit_length())


Fetch = Callable[[int, int], Buckets]  # (since_step, width) -> buckets whose steps >= since_step


@dataclass
class SeriesCache:
    """One series kept current by fetching only from its last (possibly partial) bucket onward.

    refresh(fetch, run_last_step) chooses the width for the run's length, coarsens what it has if
    the run outgrew the old width, asks `fetch` for buckets from the start of its last bucket, and
    replaces that bucket and anything after it. A run whose last step went *down* (resumed from
    an earlier checkpoint: the store deleted the later rows) is refetched in full, as is one whose
    `epoch` (the number of resume events) changed.
    """

    target_buckets: int = 1000
    data: Buckets | None = None
    run_last_step: int | None = None
    epoch: int = 0
    fetches: list[tuple[int, int]] = field(default_factory=list)  # (since_step, width), for tests
    _pending: tuple | None = field(default=None, repr=False, compare=False)  # begin() → finish()

    def refresh(self, fetch: Fetch, run_last_step: int | None, epoch: int = 0) -> Buckets:
        since, width = self.begin(run_last_step, epoch)
        return self.finish(fetch(since, width))

    def begin(self, run_last_step: int | None, epoch: int = 0) -> tuple[int, int]:
        """refresh() in two halves, for fetches of several series at once: (since_step, width)
        to fetch, then finish(what was fetched)."""
        width = width_for(run_last_step, self.target_buckets)
        stale = (
            self.data is None
            or epoch != self.epoch
            or (
                run_last_step is not None
                and self.run_last_step is not None
                and run_last_step < self.run_last_step
            )
        )
        if stale:
            self.data = None
        elif width > self.data.width:
            self.data = self.data.coarsen(width)
        elif width < self.data.width:  # cannot happen without a resume, but never go finer
            width = self.data.width
        if self.data is None or not len(self.data):
            since = 0
            kept = Buckets(width)
        else:
            last_bucket = int(self.data.bucket[-1])
            since = last_bucket * width
            kept = self.data.before(last_bucket)
        self._pending = (since, width, kept, run_last_step, epoch)
        return since, width

    def finish(self, fresh: Buckets) -> Buckets:
        since, width, kept, run_last_step, epoch = self._pending
        self._pending = None
        if fresh.width != width:
            raise ValueError(f"fetch returned width {fresh.width}, asked for {width}")
        self.fetches.append((since, width))
        fresh = fresh.take(fresh.bucket * width >= since)
        self.data = kept.concat(fresh)
        self.run_last_step = run_last_step
        self.epoch = epoch
        return self.data
