"""The live page's incremental fetch: after more rows arrive, the buckets kept in session state
merged with a refetch from the last partial bucket equal a full fetch, across width changes
(local coarsening), resumes, and the store's raw and rollup paths."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampwatch.dashboard.buckets import Buckets, SeriesCache, width_for
from rampwatch.dashboard.live_data import (
    LIVE_METRICS,
    LiveState,
    buckets_from,
    refresh_series,
    refresh_series_many,
)
from rampwatch.store import Reader, RunWriter
from rampwatch.store import names as M

COLS = ("bucket", "last_step", "lo", "hi", "last", "n", "nonfinite")


def reference(steps: np.ndarray, values: np.ndarray, since: int, width: int) -> Buckets:
    """Buckets of raw (step, value) rows with step >= since, computed the slow obvious way."""
    rows = sorted((int(s), float(v)) for s, v in zip(steps, values, strict=True) if s >= since)
    out = {c: [] for c in COLS}
    for b in sorted({s // width for s, _ in rows}):
        vals = [(s, v) for s, v in rows if s // width == b]
        fin = [v for _, v in vals if math.isfinite(v)]
        out["bucket"].append(b)
        out["last_step"].append(vals[-1][0])
        out["lo"].append(min(fin) if fin else math.nan)
        out["hi"].append(max(fin) if fin else math.nan)
        out["last"].append(vals[-1][1])
        out["n"].append(len(vals))
        out["nonfinite"].append(len(vals) - len(fin))
    return Buckets.from_columns(width, **out)


def assert_same(a: Buckets, b: Buckets) -> None:
    assert a.width == b.width
    for c in COLS:
        np.testing.assert_array_equal(getattr(a, c), getattr(b, c), err_msg=c)


def test_width_for():
    assert width_for(None, 1000) == 1
    assert width_for(999, 1000) == 1
    assert width_for(1000, 1000) == 2
    assert width_for(1_000_000, 1000) == 1024
    assert width_for(1_000_000 - 1, 1000) == 1024


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    target=st.sampled_from([4, 16, 100]),
    nan_every=st.integers(3, 50),
    seed_=st.integers(0, 1000),
)
def test_incremental_equals_full_fetch(chunks, target, nan_every, seed_):
    rng = np.random.default_rng(seed_)
    total = sum(chunks)
    steps = np.arange(total)
    values = rng.standard_normal(total)
    values[::nan_every] = np.nan
    values[1 :: nan_every * 2] = np.inf
    cache = SeriesCache(target)
    upto = 0
    for c in chunks:
        upto += c
        visible_s, visible_v = steps[:upto], values[:upto]
        prev = cache.data
        width = width_for(upto - 1, target)
        got = cache.refresh(partial(reference, visible_s, visible_v), upto - 1)
        assert_same(got, reference(visible_s, visible_v, 0, width))
        if prev is not None:  # refetched only from the start of the last (partial) bucket
            last_start = int(prev.bucket[-1]) * prev.width
            assert cache.fetches[-1] == (last_start - last_start % width, width)


def test_resume_to_an_earlier_step_refetches_everything():
    steps = np.arange(500)
    vals = np.linspace(5, 1, 500)
    cache = SeriesCache(50)
    cache.refresh(lambda s, w: reference(steps, vals, s, w), 499)
    # resumed from step 299: rows after it were deleted, new ones written with other values
    steps2 = np.arange(350)
    vals2 = np.r_[vals[:300], np.full(50, 9.0)]
    got = cache.refresh(lambda s, w: reference(steps2, vals2, s, w), 349, epoch=1)
    assert cache.fetches[-1][0] == 0
    assert_same(got, reference(steps2, vals2, 0, width_for(349, 50)))


def test_coarsen_is_exact():
    rng = np.random.default_rng(1)
    steps = np.arange(1000)
    vals = rng.standard_normal(1000)
    vals[rng.integers(0, 1000, 40)] = np.nan
    fine = reference(steps, vals, 0, 4)
    for w in (8, 64, 1024):
        assert_same(fine.coarsen(w), reference(steps, vals, 0, w))
    with pytest.raises(ValueError):
        fine.coarsen(2)


def test_live_state_against_the_real_store(db_path):
    """Real writer, real reader: raw path (width < 64) then rollup path, incremental == full."""
    w = RunWriter.start(db_path, name="grow", handle_sigterm=False, flush_interval=3600.0)
    state = LiveState(target_buckets=8, gns_window=100)
    reader = Reader(db_path)
    rng = np.random.default_rng(0)
    step = 0
    try:
        for chunk in (5, 40, 300, 900, 2000, 1):
            for _ in range(chunk):
                v = float(rng.standard_normal())
                w.log(
                    step,
                    {
                        M.LOSS: v if step % 97 else math.nan,
                        M.GNS: abs(v) * 100,
                        M.BATCH_SEQS: 16,
                        M.MEM_PEAK: 1e9 + step,
                    },
                )
                step += 1
            assert w.flush()
            fetches_before = state.fetches
            snap = state.refresh(reader, w.run_id)
            assert state.fetches - fetches_before == len(LIVE_METRICS) + 2  # + raw GNS and bound
            width = width_for(step - 1, 8)
            for name in (M.LOSS, M.GNS, M.BATCH_SEQS, M.MEM_PEAK, M.VAL_LOSS):
                full = buckets_from(reader.series(w.run_id, name, width=width))
                assert_same(snap.series[name], full)
            assert list(snap.gns_steps) == list(range(max(0, step - 100), step))
            assert snap.latest[M.MEM_PEAK] == 1e9 + step - 1
        assert width >= 256  # the rollup path was exercised
        since = [s for s, _ in state.caches[M.LOSS].fetches]
        assert since == sorted(since) and since[-1] == (step - 1) // width * width
    finally:
        w.close()


def test_many_runs_refreshed_at_once_equal_one_at_a_time(db_path):
    """refresh_series_many (one series_many for several runs, as the compare page reads) keeps
    each cache as refresh_series keeps its own copy, through raw and rollup widths; runs of
    different lengths, one of them not logging every metric."""
    writers = [
        RunWriter.start(db_path, name=f"r{i}", handle_sigterm=False, flush_interval=3600.0)
        for i in range(3)
    ]
    names = (M.LOSS, M.TOKENS_SEEN, M.STEP_TIME)
    many = {w.run_id: {n: SeriesCache(16) for n in names} for w in writers}
    alone = {w.run_id: {n: SeriesCache(16) for n in names} for w in writers}
    reader = Reader(db_path)
    step = 0
    try:
        for chunk in (3, 30, 100, 900, 1):
            for _ in range(chunk):
                for i, w in enumerate(writers):
                    if step < 400 * (i + 1):  # run 0 stops first
                        w.log(step, {M.LOSS: math.sin(step + i), M.TOKENS_SEEN: step * 10.0})
                        if i != 1:
                            w.log(step, {M.STEP_TIME: 1.0 + (step % 7 == 0) * math.nan})
                step += 1
            assert all(w.flush() for w in writers)
            with reader.session():
                runs = {r.run_id: r for r in reader.list_runs()}
                refresh_series_many(
                    reader, [(rid, c, runs[rid].last_step, 0) for rid, c in many.items()]
                )
                for rid, caches in alone.items():
                    refresh_series(reader, rid, caches, runs[rid].last_step, 0)
            for rid in many:
                for n in names:
                    assert many[rid][n].fetches == alone[rid][n].fetches, (rid, n)
                    assert_same(many[rid][n].data, alone[rid][n].data)
        assert {c.data.width for c in many[writers[2].run_id].values()} == {128}  # rollups
        assert len(many[writers[1].run_id][M.STEP_TIME].data) == 0
    finally:
        for w in writers:
            w.close()
