"""Downsampled series against a numpy reference, incremental refresh against a full fetch.

Data goes in through the real writer with flushes at random points (so the rollup's open and
complete buckets fall everywhere), including rows that arrive late for complete buckets, and
comes out through every read path: raw rows (width < 8), the fine rollup (8 <= width < 64)
and the coarse one (width >= 64).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rampwatch import store
from rampwatch.store.schema import ROLLUP_SHIFT

pytestmark = pytest.mark.timeout(180)  # pytest.ini says 300 s; these are far shorter

WIDTHS = (1, 4, 8, 32, 64, 128, 1024)  # raw rows, the fine rollup, the coarse one
SPECIAL = [math.nan, math.inf, -math.inf]


def reference(steps: np.ndarray, values: np.ndarray, width: int, since: int | None = None):
    """min/max over finite values (NaN when none), last at the largest step, counts."""
    k = width.bit_length() - 1
    keep = steps >= ((since >> k) << k) if since is not None else np.ones(len(steps), bool)
    steps, values = steps[keep], values[keep]
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    out = {f: [] for f in ("step", "min", "max", "last", "last_step", "count", "nonfinite")}
    for b in np.unique(steps >> k):
        sel = (steps >> k) == b
        v, finite = values[sel], np.isfinite(values[sel])
        out["step"].append(b << k)
        out["min"].append(v[finite].min() if finite.any() else math.nan)
        out["max"].append(v[finite].max() if finite.any() else math.nan)
        out["last"].append(v[-1])
        out["last_step"].append(steps[sel][-1])
        out["count"].append(sel.sum())
        out["nonfinite"].append((~finite).sum())
    return out


def assert_matches(s: store.Series, ref: dict, context: str = "") -> None:
    for f, want in ref.items():
        got = getattr(s, f)
        assert len(got) == len(want), f"{context} {f}: {len(got)} buckets, want {len(want)}"
        np.testing.assert_array_equal(
            got, np.asarray(want, dtype=got.dtype), err_msg=f"{context} width {s.width} field {f}"
        )


@st.composite
def histories(draw):
    n = draw(st.integers(1, 300))
    start = draw(st.integers(0, 3000))
    steps = start + np.sort(
        np.array(
            draw(st.lists(st.integers(0, 4 * n), min_size=n, max_size=n, unique=True)),
            dtype=np.int64,
        )
    )
    values = np.array(
        draw(
            st.lists(
                st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from(SPECIAL)),
                min_size=n,
                max_size=n,
            )
        ),
        dtype=np.float64,
    )
    # arrival order: mostly increasing, some rows held back and logged later (late rows)
    late = draw(st.lists(st.integers(0, n - 1), max_size=max(1, n // 10), unique=True))
    order = [i for i in range(n) if i not in set(late)] + late
    flush_after = sorted(set(draw(st.lists(st.integers(0, n - 1), max_size=4))))
    return steps, values, order, flush_after


# No shrinking: each example costs a database and several connections, and shrinking a
# failure would take minutes; the failing example is printed as found.
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(histories())
def test_series_match_numpy_and_incremental_refresh_matches_full(history):
    steps, values, order, flush_after = history
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "s.duckdb"
        w = store.RunWriter.start(db, "series", flush_interval=1000)
        try:
            _check_history(db, w, steps, values, order, flush_after)
        finally:
            w.close(timeout=2)


def _check_history(db, w, steps, values, order, flush_after):
    live = {}  # width -> series kept up to date by incremental refreshes
    done = []
    since_refresh = []  # steps logged since the last refresh
    for pos, i in enumerate(order):
        # a second metric runs ahead, so late rows of 'x' land in complete rollup buckets
        w.log(int(steps[i]), {"x": float(values[i]), "ahead": 0.0})
        done.append(i)
        since_refresh.append(int(steps[i]))
        if pos in flush_after or pos == len(order) - 1:
            w.log(int(steps.max()) + 200, {"ahead": 1.0})
            assert w.flush()
            got_s, got_v = steps[done], values[done]
            for width in (1, 16, 128):
                # A refresh reads from the last bucket on: a row logged out of order before
                # it waits for a full fetch (see Series.since), as a page would do.
                if (
                    width in live
                    and live[width].since is not None
                    and min(since_refresh) >= live[width].since
                ):
                    fresh = store.series(
                        db, w.run_id, "x", width=width, since_step=live[width].since
                    )
                    assert_matches(
                        fresh, reference(got_s, got_v, width, live[width].since), "refresh"
                    )
                    live[width] = live[width].merge(fresh)
                else:
                    live[width] = store.series(db, w.run_id, "x", width=width)
                assert_matches(live[width], reference(got_s, got_v, width), "merged")
            since_refresh = []
    assert w.close()
    r = store.Reader(db)
    with r.session():
        for width in WIDTHS:
            full = r.series(w.run_id, "x", width=width)
            assert_matches(full, reference(steps, values, width), "full")
            cut = int(steps[len(steps) // 2])
            assert_matches(
                r.series(w.run_id, "x", width=width, since_step=cut),
                reference(steps, values, width, cut),
                "since",
            )
        for buckets in (1, 7, 50, 2000):
            s = r.series(w.run_id, "x", buckets=buckets)
            assert 1 <= len(s.step) <= buckets and s.width & (s.width - 1) == 0
            assert_matches(s, reference(steps, values, s.width), f"buckets={buckets}")
        [stats] = r.metric_stats(["x"]).values()
        assert_stats(stats["x"], steps, values)
        np.testing.assert_equal(
            r.latest(w.run_id, ["x"]), {"x": (stats["x"].last_step, stats["x"].last)}
        )


def assert_stats(got: store.MetricStats, steps: np.ndarray, values: np.ndarray) -> None:
    """min/max over finite values (None when none), the value at the largest step."""
    finite = values[np.isfinite(values)]
    assert got.min == (float(finite.min()) if finite.size else None)
    assert got.max == (float(finite.max()) if finite.size else None)
    assert got.last_step == int(steps.max())
    np.testing.assert_equal(got.last, values[np.argmax(steps)])


def test_width_choice_and_empty_and_bad_arguments(db_path):
    w = store.RunWriter.start(db_path, "w", flush_interval=1000)
    for s in range(1000, 3000):
        w.log(s, {"a": s})
    assert w.close()
    s = store.series(db_path, w.run_id, "a", buckets=2000)
    assert s.width == 2 and len(s.step) == 1000  # 2000 steps need width 2 for <= 2000 buckets
    s = store.series(db_path, w.run_id, "a", buckets=10)
    assert s.width == 256 and s.width >= 2000 / 10 and len(s.step) <= 10
    empty = store.series(db_path, w.run_id, "never-logged")
    assert len(empty.step) == 0 and empty.since is None
    with pytest.raises(ValueError, match="power of two"):
        store.series(db_path, w.run_id, "a", width=3)


def test_rollup_layout_serves_wide_buckets(db_path):
    """Wide buckets are answered from the rollup: its complete buckets are 64 steps each, in
    order, and the open ones are few."""
    w = store.RunWriter.start(db_path, "layout", flush_interval=1000)
    for s in range(1000):
        w.log(s, {f"m{j}": s * j for j in range(5)})
        if s % 97 == 0:
            w.flush()
    assert w.close()
    import duckdb

    con = duckdb.connect(str(db_path), read_only=True)
    complete = con.execute("SELECT name, bucket, n FROM metrics_rollup ORDER BY rowid").fetchall()
    partial = con.execute("SELECT count(*) FROM rollup_partial").fetchall()[0][0]
    fine = con.execute("SELECT n, count(*) FROM metrics_rollup_fine GROUP BY n").fetchall()
    fine_partial = con.execute("SELECT count(*) FROM rollup_partial_fine").fetchall()[0][0]
    con.close()
    assert fine == [(8, 5 * (999 >> 3))] and fine_partial == 5
    assert len(complete) == 5 * (999 >> ROLLUP_SHIFT) and partial == 5
    assert all(n == 64 for _, _, n in complete)
    buckets = [b for _, b, _ in complete]
    assert buckets == sorted(buckets)  # appended in bucket order: zone maps prune on refresh


def test_every_run_at_once_equals_one_run_at_a_time(db_path):
    """metric_stats and events_of_runs answer for all runs in one query what latest, series and
    events answer per run; a run or metric without rows is absent; run_ids and names filter."""
    rng = np.random.default_rng(1)
    data = {}
    for i in range(4):
        w = store.RunWriter.start(db_path, f"r{i}", flush_interval=1000, handle_sigterm=False)
        steps = np.arange(0, 150 * (i + 1), dtype=np.int64)
        values = rng.normal(size=len(steps))
        values[rng.integers(0, len(steps), 5)] = np.nan
        for s, v in zip(steps.tolist(), values.tolist(), strict=True):
            w.log(s, {"loss": v, **({"tokens": s * 10.0} if i != 2 else {})})
            if s % 97 == 0:
                w.flush()  # open and complete rollup buckets everywhere
        w.event("alert", f"alert of run {i}", step=3, data={"dropped": i})
        w.event("checkpoint", "ckpt", step=5)
        assert w.close() if i != 3 else w.flush()  # run 3 stays open: its buckets are open
        data[w.run_id] = (w, steps, values)
    try:
        r = store.Reader(db_path)
        with r.session():
            stats = r.metric_stats(["loss", "tokens", "never"])
            assert set(stats) == set(data)
            for rid, (_, steps, values) in data.items():
                assert_stats(stats[rid]["loss"], steps, values)
                whole = r.series(rid, "loss", buckets=1)
                assert stats[rid]["loss"].min == whole.min[0]
                latest = r.latest(rid)
                assert set(stats[rid]) == set(latest) - {"never"}
                for name, (step, value) in latest.items():
                    assert (stats[rid][name].last_step, stats[rid][name].last) == (step, value)
            assert "tokens" not in stats[list(data)[2]] and "never" not in stats[list(data)[0]]
            some = list(data)[1:3]
            assert set(r.metric_stats(["loss"], run_ids=some)) == set(some)
            assert r.metric_stats(["loss"], run_ids=[]) == {}
            alerts = r.events_of_runs(["alert"])
            for rid in data:
                assert alerts[rid] == r.events(rid, kinds=["alert"])
                assert r.events_of_runs(run_ids=[rid]) == {rid: r.events(rid)}
            assert r.events_of_runs(["no such kind"]) == {}
    finally:
        for w, _, _ in data.values():
            w.close()


def _spans(db) -> dict:
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        stored = con.execute("SELECT run_id, metrics_t_min, metrics_t_max FROM runs").fetchall()
        rows = con.execute("SELECT run_id, min(t), max(t) FROM metrics GROUP BY run_id").fetchall()
    return {r: (lo, hi) for r, lo, hi in stored}, {r: (lo, hi) for r, lo, hi in rows}


def test_the_span_of_a_runs_rows_is_kept_by_ingest_and_backfilled(db_path):
    """Schema v8: each run's stored t span is exactly its metric rows' (raw reads are bounded by
    it); kept over flushes of interleaved runs, and backfilled when a v7 file is upgraded."""
    import duckdb

    from rampwatch.store import schema

    a = store.RunWriter.start(db_path, "a", flush_interval=1000, handle_sigterm=False)
    b = store.RunWriter.start(db_path, "b", flush_interval=1000, handle_sigterm=False)
    for s in range(300):
        (a if s % 3 else b).log(s, {"x": float(s)})
        if s % 50 == 49:
            assert a.flush() and b.flush()
    a.event("checkpoint", "no rows in this visit", step=5)
    assert a.close() and b.close()
    stored, rows = _spans(db_path)
    assert stored == rows and set(rows) == {a.run_id, b.run_id}
    for w, steps in ((a, [s for s in range(300) if s % 3]), (b, list(range(0, 300, 3)))):
        got = store.series(db_path, w.run_id, "x", width=1)
        assert got.step.tolist() == steps and got.last.tolist() == [float(s) for s in steps]

    old = db_path.parent / "v7.duckdb"
    schema.create_at_version(old, 7)
    with duckdb.connect(str(old)) as con:
        con.execute("INSERT INTO runs (run_id, status, created_at) VALUES ('r', 'finished', 1)")
        con.execute("INSERT INTO runs (run_id, status, created_at) VALUES ('e', 'finished', 1)")
        con.execute("INSERT INTO metrics VALUES ('r', 1, 10.0, 'x', 1.0), ('r', 2, 12.5, 'x', 2.0)")
    got = store.series(old, "r", "x", width=1, read_only=True)  # v7 as it is: no bound
    assert got.step.tolist() == [1, 2] and store.schema_version(old, read_only=True) == 7
    assert store.series(old, "r", "x", width=1).last.tolist() == [1.0, 2.0]  # upgraded
    stored, _ = _spans(old)
    assert stored == {"r": (10.0, 12.5), "e": (None, None)}
    assert len(store.series(old, "e", "x", width=1).step) == 0


def test_many_series_at_once_equal_each_one_alone(db_path):
    """series_many answers for several runs and metrics what series answers for each, whatever
    the width (chosen, raw, rollups), since_step, interleaved runs (their spans overlap), a
    metric or run without rows; its raw reads of all runs are one query."""
    rng = np.random.default_rng(7)
    lengths = (300, 2000, 40, 9000)  # run 3 is long: its chosen width is read from a rollup
    writers = [
        store.RunWriter.start(db_path, f"r{i}", flush_interval=1000, handle_sigterm=False)
        for i in range(len(lengths))
    ]
    for s in range(max(lengths)):
        for w, n in zip(writers, lengths, strict=True):
            if s < n:
                v = rng.normal() if s % 37 else math.nan
                w.log(s + 5 * (w is writers[2]), {"loss": v, **({"lr": s * 1e-3} if s % 3 else {})})
        if s % 700 == 0:
            assert all(w.flush() for w in writers)
    assert all(w.close() for w in writers[:3]) and writers[3].flush()  # run 3: open buckets
    ids = [w.run_id for w in writers]
    wanted = [(r, n) for r in [*ids, "no-such-run"] for n in ("loss", "lr", "never")]
    wanted += [
        store.Wanted(r, n, width, since)
        for r in ids
        for n in ("loss", "lr")
        for width, since in ((1, None), (1, 0), (2, 150), (4, 1999), (16, 33), (128, None))
    ]
    r = store.Reader(db_path)
    try:
        with r.session():
            for buckets in (2000, 100):
                got = r.series_many(wanted, buckets=buckets)
                assert len(got) == len(wanted)
                for want, s in zip(wanted, got, strict=True):
                    w = store.Wanted(*want)
                    one = r.series(w.run_id, w.name, buckets, w.width, w.since_step)
                    assert (s.run_id, s.name, s.width, s.start) == (
                        one.run_id,
                        one.name,
                        one.width,
                        one.start,
                    )
                    for f in ("step", "min", "max", "last", "last_step", "count", "nonfinite"):
                        np.testing.assert_array_equal(getattr(s, f), getattr(one, f), err_msg=f)
            assert [len(s.step) for s in r.series_many([(i, "loss") for i in ids])] == [
                300,
                2000,
                40,
                9000 >> 3,  # 9,000 steps in <= 2,000 buckets: width 8, the fine rollup
            ]
            assert r.series_many([]) == []
            con, sql = r._local.con, []

            class Counting:  # the session's connection, counting statements
                def execute(self, q, *a):
                    sql.append(q)
                    return con.execute(q, *a)

            r._local.con = Counting()
            r.series_many([(i, "loss") for i in ids[:1]])
            one = len(sql)
            r.series_many([(i, n) for i in ids[:3] for n in ("loss", "lr")])
            assert len(sql) - one == one <= 3  # extents, spans, rows: whatever the run count
            r._local.con = con
            with pytest.raises(ValueError, match="power of two"):
                r.series_many([(ids[0], "loss", 3)])
    finally:
        writers[3].close()
