"""Reading for the dashboard: runs, downsampled series, latest values, events, plans, trials,
exports.

Owns every read query. Each call opens a read-only connection under the shared lock and closes
it (`Reader.session()` keeps one for a few calls in a row); nothing holds the file between
calls, so the trainer's writer is never locked out for long.

Connecting costs more than any query a page makes (DuckDB's connect, the same for an empty
database; the README's "Benchmarks" has the figures), so what a page shows for many runs comes
from one query over all of them: `list_runs` (their spools looked up at once), `metric_stats`
(each run's min, max and latest value of some metrics, from the coarse rollup) and
`events_of_runs`; `series_many` reads several runs' curves with one query for their extents,
one for their spans and one for all their raw rows.

Charts are downsampled per bucket: min and max over finite values, last (the value at the largest
step), count and count of non-finite values; in SQL from the rollups, and in numpy from raw rows
(widths 1-4, at most 4 rows a bucket), where DuckDB's GROUP BY cost 3 times the scan. Bucket
widths are powers of two in steps and buckets are aligned to multiples of the width, so a live
page keeps the buckets it has and refetches only from the last, partial one
(`since_step=series.since`, then `merge`).

Why rollups and not a sorted copy of the raw rows: a sorted layout needs compaction, which stalls
the writer for seconds while it sorts a chunk, while rollups fold in on each ingest
(store/rollup.py); the 8-step level keeps raw reads to runs of at most 8K steps. The README's
"Store layout" has the measurements behind the choice. A run compacted by `rampwatch compact`
has raw rows only from a step on (rollup.RAW_SHIFT's mark): a series whose width is chosen
(width=None) is then drawn at 8 steps or more, from the rollups, whatever its length. A raw
read still scans the metrics table of every run, whose row groups hold several runs each (their
run_id zone maps span most ids), so it also bounds `t` by the run's stored span (schema v8, `_row_span`): rows are appended in
ingest order, t's zone maps are tight, and the read skips every row group written while the run
wrote nothing, so its cost follows the rows written during the run's life, not the file's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from rampwatch.store import names as M
from rampwatch.store import schema, spool
from rampwatch.store.db import DEFAULT_TIMEOUT, read_connection, spool_root
from rampwatch.store.errors import RunNotFoundError
from rampwatch.store.rollup import LEVELS, RAW_SHIFT, Level
from rampwatch.store.schema import (
    EVENTS,
    MEMORY_PLAN,
    RUNS,
    TRIALS,
    Event,
    PlanRow,
    Run,
    Trial,
    first,
    json_int,
)

STALE_AFTER = 30.0  # seconds without a heartbeat before a running run shows as stale
_NO_START = -(1 << 62)

# Below the finest rollup a bucket holds at most 4 raw rows, so the rows themselves are read
# and bucketed in numpy (_raw_buckets): DuckDB's GROUP BY with these aggregates took 4.4 ms for
# one run's 2,000 rows where reading them took 1.1 ms (a 100-run file, 2026-12-05).
_ROWS_RAW = """
    SELECT step, value
    FROM metrics WHERE run_id = $run AND name = $name AND step >= $start
      AND t >= $t_min AND t <= $t_max"""


def _rolled(lv: Level) -> str:
    """One metric's buckets at one rollup level, complete and open (table names: constants)."""
    cols = "bucket, vmin, vmax, last_step, last_value, n, n_nonfinite"
    where = "run_id = $run AND name = $name AND bucket >= $start"
    return (
        f"SELECT {cols} FROM {lv.complete} WHERE {where} "
        f"UNION ALL SELECT {cols} FROM {lv.partial} WHERE {where}"
    )


_BUCKETS_ROLLUP = {
    lv.shift: f"""
    SELECT bucket >> $k AS b,
           coalesce(min(vmin), 'NaN'::DOUBLE) AS min, coalesce(max(vmax), 'NaN'::DOUBLE) AS max,
           arg_max(last_value, last_step) AS last, max(last_step) AS last_step,
           sum(n)::BIGINT AS count, sum(n_nonfinite)::BIGINT AS nonfinite
    FROM ({_rolled(lv)}) GROUP BY b ORDER BY b"""
    for lv in LEVELS
}
_COARSE = LEVELS[-1]  # the fewest rows: extents, names and latest values come from it
_FINEST = LEVELS[0]
# and the first step whose raw rows are all kept (rollup.RAW_SHIFT; NULL: never compacted)
_EXTENT = f"""SELECT min(bucket), max(last_step),
    (SELECT max(through) FROM rollup_state WHERE run_id = $run AND shift = {RAW_SHIFT})
    FROM ({_rolled(_COARSE)})"""


# Of several runs and metrics at once (Reader.series_many): each pair's extent, and the raw rows
# of several runs in one scan, bounded by the union of their stored spans (a row of a run
# asked for lies in that run's span, so the union loses none; t's zone maps prune on each term).
_MANY = "run_id = ANY($runs::VARCHAR[]) AND name = ANY($names::VARCHAR[])"
_EXTENTS = f"""SELECT e.run_id, e.name, e.lo, e.hi, s.through
    FROM (SELECT run_id, name, min(bucket) AS lo, max(last_step) AS hi
          FROM (SELECT run_id, name, bucket, last_step FROM {_COARSE.complete} WHERE {_MANY}
                UNION ALL
                SELECT run_id, name, bucket, last_step FROM {_COARSE.partial} WHERE {_MANY})
          GROUP BY run_id, name) e
    LEFT JOIN (SELECT run_id, max(through) AS through FROM rollup_state
               WHERE shift = {RAW_SHIFT} AND run_id = ANY($runs::VARCHAR[]) GROUP BY run_id) s
    ON e.run_id = s.run_id"""


def _rows_many_sql(spans: int) -> str:
    """Raw rows of the runs and metrics $runs and $names, from step $start on, inside any of
    `spans` t ranges ($t_min0, $t_max0, …); r and n: 1-based positions in $runs and $names."""
    within = " OR ".join(f"(t >= $t_min{j} AND t <= $t_max{j})" for j in range(spans))
    return f"""
    SELECT list_position($runs::VARCHAR[], run_id) AS r,
           list_position($names::VARCHAR[], name) AS n, step, value
    FROM metrics WHERE {_MANY} AND step >= $start AND ({within})"""


def _stats_sql(where: str) -> str:
    """Per run and metric: min, max, latest step and value over the coarse rollup's rows that
    `where` keeps ($names NULL: every metric)."""
    cols = "run_id, name, vmin, vmax, last_step, last_value"
    where = f"({where}) AND ($names::VARCHAR[] IS NULL OR name = ANY($names::VARCHAR[]))"
    return f"""
    SELECT run_id, name, min(vmin), max(vmax), max(last_step), arg_max(last_value, last_step)
    FROM (SELECT {cols} FROM {_COARSE.complete} WHERE {where}
          UNION ALL SELECT {cols} FROM {_COARSE.partial} WHERE {where})
    GROUP BY run_id, name"""


_EVENTS = f"""{EVENTS.select}
    WHERE ({{runs}}) AND ($s::BIGINT IS NULL OR step >= $s)
      AND ($k::VARCHAR[] IS NULL OR list_contains($k::VARCHAR[], kind))
    ORDER BY step NULLS FIRST, t"""
# one run: an equality, which DuckDB's zone maps prune on; several: a list ($runs NULL: all)
_STATS_ONE = _stats_sql("run_id = $run")
_STATS_MANY = _stats_sql("$runs::VARCHAR[] IS NULL OR run_id = ANY($runs::VARCHAR[])")


@dataclass(frozen=True)
class Series:
    """One metric downsampled to buckets of `width` steps; bucket i covers step[i] .. +width-1."""

    run_id: str
    name: str
    width: int
    start: int | None  # first step this fetch covered (None: the whole history)
    step: np.ndarray  # int64 bucket start
    min: np.ndarray  # float64, over finite values; NaN if the bucket has none
    max: np.ndarray
    last: np.ndarray  # value at the bucket's largest step
    last_step: np.ndarray  # int64
    count: np.ndarray  # int64 values in the bucket
    nonfinite: np.ndarray  # int64 NaN/±inf values in the bucket

    @property
    def since(self) -> int | None:
        """since_step for the next live refresh: the start of the last (partial) bucket.

        A refresh sees rows logged at steps from there on; a row logged out of order at an
        earlier step shows up at the next full fetch.
        """
        return int(self.step[-1]) if len(self.step) else self.start

    def merge(self, newer: "Series") -> "Series":
        """This series updated with a refresh fetched from since_step=self.since."""
        if newer.width != self.width:
            raise ValueError(
                f"cannot merge series of width {newer.width} into width "
                f"{self.width}; refetch the whole history"
            )
        if newer.start is None:
            return newer
        keep = self.step < newer.start
        cols = {
            f: np.concatenate([getattr(self, f)[keep], getattr(newer, f)])
            for f in ("step", "min", "max", "last", "last_step", "count", "nonfinite")
        }
        return replace(self, **cols)


class Wanted(NamedTuple):
    """One series of Reader.series_many: what Reader.series takes besides `buckets`."""

    run_id: str
    name: str
    width: int | None = None
    since_step: int | None = None


@dataclass(frozen=True)
class TrialPoint:
    """One point of a trial's arm (its trial_arm event): the branch chart's data."""

    factor: int  # 1 = the control
    tokens: int  # done in this arm
    loss: float | None  # train loss of that step
    eval_loss: float | None  # held-out mean, at the arm's end only
    done: bool  # the arm's last point
    # a second stage: the control is evaluated again on `examples`; `first` could not tell
    examples: int | None = None
    first: int | None = None


@dataclass(frozen=True)
class MetricStats:
    """One metric of one run over its whole history (from the coarse rollup: exact, as every
    rollup aggregate merges exactly)."""

    min: float | None  # lowest finite value; None when the run logged none
    max: float | None  # highest finite value
    last_step: int
    last: float  # the value at last_step (may be non-finite)


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _trial_point(data: dict) -> TrialPoint | None:
    factor, tokens = json_int(data.get("factor")), json_int(data.get("tokens"))
    if factor is None or tokens is None:
        return None  # a point without its arm or position cannot be drawn
    loss, eval_loss = _number(data.get("loss")), _number(data.get("eval_loss"))
    examples, first = (json_int(data.get(k)) for k in ("eval_examples", "first_examples"))
    if examples is None or first is None:
        examples = first = None
    return TrialPoint(factor, tokens, loss, eval_loss, bool(data.get("done")), examples, first)


def _empty_series(run_id, name, width, start) -> Series:
    i, f = np.zeros(0, np.int64), np.zeros(0, np.float64)
    return Series(run_id, name, width, start, i, f, f, f, i, i, i)


def _raw_buckets(step: np.ndarray, value: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Raw rows (any order) in buckets of 2**k steps, as the rollups aggregate them (schema
    RAW_AGGREGATES): min and max over finite values (NaN when none), the value at the largest
    step, counts; in bucket order."""
    order = np.argsort(step, kind="stable")
    step = np.asarray(step, np.int64)[order]
    value = np.asarray(value, np.float64)[order]
    if not len(step):
        return {
            "b": step,
            "min": value,
            "max": value,
            "last": value,
            "last_step": step,
            "count": step,
            "nonfinite": step,
        }
    b = step >> k
    starts = np.flatnonzero(np.concatenate(([True], b[1:] != b[:-1])))
    ends = np.append(starts[1:], len(b)) - 1
    finite = np.isfinite(value)
    count = np.diff(np.append(starts, len(b)))
    nonfinite = np.add.reduceat(~finite, starts, dtype=np.int64)
    some = count > nonfinite
    lo = np.minimum.reduceat(np.where(finite, value, np.inf), starts)
    hi = np.maximum.reduceat(np.where(finite, value, -np.inf), starts)
    return {
        "b": b[starts],
        "min": np.where(some, lo, np.nan),
        "max": np.where(some, hi, np.nan),
        "last": value[ends],
        "last_step": step[ends],
        "count": count,
        "nonfinite": nonfinite,
    }


def _width_shift_for(lo: int, hi: int, buckets: int) -> int:
    """log2 of the smallest power-of-two width giving at most `buckets` aligned buckets.

    Total: returns for any integers. An empty range (hi < lo) needs width 1 (k = 0). Aligned
    buckets that must hold both -1 and 0 can never be fewer than two, so the search stops at
    the width where every step of the range falls in at most two buckets.
    """
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"buckets must be an integer >= 1, got {buckets!r}")
    lo, hi = int(lo), int(hi)
    if hi <= lo:
        return 0
    # From the width that the span alone needs (one below, as alignment may add a bucket) up
    # to the one beyond which shifting changes nothing: at most ~3 steps of the loop.
    k = max(0, ((hi - lo) // buckets).bit_length() - 1)
    top = max(lo.bit_length(), hi.bit_length())  # from there on every step >> k is 0 or -1
    while k < top and (hi >> k) - (lo >> k) + 1 > buckets:
        k += 1
    return k


def _check_series_args(buckets, width) -> None:
    if width is not None and (not isinstance(width, int) or width < 1 or width & (width - 1)):
        raise ValueError(f"width must be a power of two >= 1, got {width!r}")
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"buckets must be an integer >= 1, got {buckets!r}")


def _shift_of_extent(lo, hi, raw_from, buckets: int) -> int | None:
    """log2 of the width series() chooses for a metric whose coarse rollup spans buckets lo..
    and steps ..hi, raw rows kept from raw_from on (None: all); None when it has no rows."""
    if lo is None:
        return None
    k = _width_shift_for(lo << _COARSE.shift, hi, buckets)
    if raw_from is not None and raw_from > lo << _COARSE.shift:
        k = max(k, _FINEST.shift)  # compacted: the raw rows no longer span the run
    return k


def _series_of(run_id: str, name: str, k: int, start: int | None, cols) -> Series:
    return Series(
        run_id,
        name,
        1 << k,
        start,
        np.asarray(cols["b"], np.int64) << k,
        *(np.asarray(cols[c], np.float64) for c in ("min", "max", "last")),
        *(np.asarray(cols[c], np.int64) for c in ("last_step", "count", "nonfinite")),
    )


class Reader:
    """Read queries on one database; each call connects and closes unless inside session()."""

    def __init__(
        self,
        db,
        timeout: float = DEFAULT_TIMEOUT,
        stale_after: float = STALE_AFTER,
        read_only: bool | None = None,
    ):
        """read_only: write nothing, not even a schema upgrade or a lock file (None: the
        process setting, store.set_read_only)."""
        self.db, self.timeout, self.stale_after = db, timeout, stale_after
        self.read_only = read_only
        self._local = threading.local()  # a session belongs to the thread that opened it

    @contextlib.contextmanager
    def session(self):
        """Share one read connection among several calls; keep the block short."""
        with read_connection(self.db, self.timeout, read_only=self.read_only) as con:
            self._local.con, self._local.version = con, None
            try:
                yield self
            finally:
                self._local.con = self._local.version = None

    @contextlib.contextmanager
    def _connection(self):
        con = getattr(self._local, "con", None)
        if con is not None:
            yield con
        else:
            with read_connection(self.db, self.timeout, read_only=self.read_only) as con:
                yield con

    def _version(self, con) -> int:
        """The file's schema version, read once per session: no upgrade can happen while a
        read connection is open (an upgrade needs the exclusive lock)."""
        in_session = getattr(self._local, "con", None) is con
        cached = getattr(self._local, "version", None)
        if in_session and cached is not None:
            return cached
        version = schema.read_version(con, self.db)
        if in_session:
            self._local.version = version
        return version

    def _run(self, values: dict, now: float, spools: dict[str, list[str]]) -> Run:
        run_id, heartbeat = values["run_id"], values["heartbeat"]
        status = stored = values["stored_status"]
        if stored == "running":
            quiet = heartbeat is None or now - heartbeat > self.stale_after
            root = spool_root(self.db)
            if quiet or not any(spool.is_live(root / s) for s in spools.get(run_id, ())):
                status = "stale"
        return Run(status=status, **values)

    @staticmethod
    def _spools(con, run_ids: list[str]) -> dict[str, list[str]]:
        """{run_id: its spools' names} for these runs, in one query (whose writers are alive
        is then asked of the spools themselves)."""
        out: dict[str, list[str]] = {}
        if run_ids:
            rows = con.execute(
                "SELECT run_id, spool FROM spool_offsets WHERE run_id = ANY(?::VARCHAR[])",
                [run_ids],
            ).fetchall()
            for run_id, s in rows:
                out.setdefault(run_id, []).append(s)
        return out

    def _runs(self, con, rows) -> list[Run]:
        values = [RUNS.values(r) for r in rows]
        running = [v["run_id"] for v in values if v["stored_status"] == "running"]
        spools, now = self._spools(con, running), time.time()
        return [self._run(v, now, spools) for v in values]

    def list_runs(self) -> list[Run]:
        """Every run, newest first."""
        with self._connection() as con:
            rows = con.execute(f"{RUNS.select} ORDER BY created_at DESC, run_id").fetchall()
            return self._runs(con, rows)

    def get_run(self, run_id: str) -> Run:
        with self._connection() as con:
            row = first(con.execute(f"{RUNS.select} WHERE run_id = ?", [run_id]))
            if row is None:
                raise RunNotFoundError(
                    f"no run {run_id!r} in {self.db}; `rampwatch info {self.db}` lists the runs"
                )
            return self._runs(con, [row])[0]

    def metric_names(self, run_id: str) -> list[str]:
        with self._connection() as con:
            rows = con.execute(
                f"SELECT DISTINCT name FROM (SELECT name FROM {_COARSE.partial} WHERE run_id = $r "
                f"UNION ALL SELECT name FROM {_COARSE.complete} WHERE run_id = $r) ORDER BY name",
                {"r": run_id},
            ).fetchall()
        return [r[0] for r in rows]

    def series(
        self,
        run_id: str,
        name: str,
        buckets: int = 2000,
        width: int | None = None,
        since_step: int | None = None,
    ) -> Series:
        """One metric in at most ~`buckets` buckets (or of the given power-of-two `width`).

        since_step: fetch only buckets from the one holding since_step on (live refresh:
        pass the previous result's `.since` and its `width`, then `.merge` the two).
        """
        _check_series_args(buckets, width)
        with self._connection() as con:
            if width is None:
                [(lo, hi, raw_from)] = con.execute(
                    _EXTENT, {"run": run_id, "name": name, "start": _NO_START}
                ).fetchall()
                k = _shift_of_extent(lo, hi, raw_from, buckets)
                if k is None:
                    return _empty_series(run_id, name, 1, since_step)
            else:
                k = width.bit_length() - 1
            start = None if since_step is None else (int(since_step) >> k) << k
            if k >= _FINEST.shift:
                return self._rolled_series(con, run_id, name, k, start)
            t_min, t_max = self._row_span(con, run_id)
            params = {
                "run": run_id,
                "name": name,
                "start": _NO_START if start is None else start,
                "t_min": t_min,
                "t_max": t_max,
            }
            rows = con.execute(_ROWS_RAW, params).fetchnumpy()
        return _series_of(run_id, name, k, start, _raw_buckets(rows["step"], rows["value"], k))

    def series_many(self, wanted, buckets: int = 2000) -> list[Series]:
        """series(run_id, name, buckets, width, since_step) of each of `wanted` (Wanted, or
        tuples of its fields), in order, equal to what series() returns for each; in one
        connection and few queries whatever their number: one for the extents of those whose
        width is chosen, one for the spans and one for the raw rows of all read at widths
        below the finest rollup (a raw read of 10 runs costs about what one run's did); wider
        ones are read one by one, from the rollups, as series() reads them."""
        wanted = [Wanted(*w) for w in wanted]
        _check_series_args(buckets, None)
        for w in wanted:
            _check_series_args(buckets, w.width)
        out: list[Series | None] = [None] * len(wanted)
        with self._connection() as con:
            shifts: dict[tuple[str, str], int | None] = {}
            chosen = [w for w in wanted if w.width is None]
            if chosen:
                runs = list(dict.fromkeys(w.run_id for w in chosen))
                names = list(dict.fromkeys(w.name for w in chosen))
                rows = con.execute(_EXTENTS, {"runs": runs, "names": names}).fetchall()
                extents = {(r, n): (lo, hi, raw_from) for r, n, lo, hi, raw_from in rows}
                for w in chosen:
                    lo, hi, raw_from = extents.get((w.run_id, w.name), (None, None, None))
                    shifts[w.run_id, w.name] = _shift_of_extent(lo, hi, raw_from, buckets)
            raw: list[tuple[int, Wanted, int, int | None]] = []
            for i, w in enumerate(wanted):
                k = w.width.bit_length() - 1 if w.width else shifts[w.run_id, w.name]
                if k is None:
                    out[i] = _empty_series(w.run_id, w.name, 1, w.since_step)
                    continue
                start = None if w.since_step is None else (int(w.since_step) >> k) << k
                if k >= _FINEST.shift:
                    out[i] = self._rolled_series(con, w.run_id, w.name, k, start)
                else:
                    raw.append((i, w, k, start))
            if raw:
                self._raw_many(con, raw, out)
        return out

    def _raw_many(self, con, raw: list, out: list) -> None:
        """out[i] = the raw-level series of each (i, Wanted, k, start) in `raw`, read in one
        query bounded by the runs' spans."""
        runs = list(dict.fromkeys(w.run_id for _, w, _, _ in raw))
        names = list(dict.fromkeys(w.name for _, w, _, _ in raw))
        spans = list(dict.fromkeys(self._row_spans(con, runs).values()))
        starts = [_NO_START if start is None else start for _, _, _, start in raw]
        params = {"runs": runs, "names": names, "start": min(starts)}
        for j, (t_min, t_max) in enumerate(spans):
            params[f"t_min{j}"], params[f"t_max{j}"] = t_min, t_max
        rows = con.execute(_rows_many_sql(len(spans)), params).fetchnumpy()
        # one integer per (run, metric): the rows of each series together, each in file order
        n = len(names) + 1
        key = np.asarray(rows["r"], np.int64) * n + np.asarray(rows["n"], np.int64)
        order = np.argsort(key, kind="stable")
        key, step, value = key[order], rows["step"][order], rows["value"][order]
        run_at = {r: j for j, r in enumerate(runs, 1)}
        name_at = {m: j for j, m in enumerate(names, 1)}
        for (i, w, k, start), lo in zip(raw, starts, strict=True):
            at = run_at[w.run_id] * n + name_at[w.name]
            a, b = np.searchsorted(key, [at, at + 1])
            keep = step[a:b] >= lo
            cols = _raw_buckets(step[a:b][keep], value[a:b][keep], k)
            out[i] = _series_of(w.run_id, w.name, k, start, cols)

    def _rolled_series(self, con, run_id: str, name: str, k: int, start: int | None) -> Series:
        """The series at width 2**k >= the finest rollup's, from the coarsest level that fits."""
        lv = next(lv for lv in reversed(LEVELS) if lv.shift <= k)
        params = {
            "run": run_id,
            "name": name,
            "k": k - lv.shift,
            "start": _NO_START if start is None else start >> lv.shift,
        }
        cols = con.execute(_BUCKETS_ROLLUP[lv.shift], params).fetchnumpy()
        return _series_of(run_id, name, k, start, cols)

    def latest(self, run_id: str, names: list[str] | None = None) -> dict[str, tuple[int, float]]:
        """{name: (step, value)} at each metric's largest step (all metrics, or `names`)."""
        with self._connection() as con:
            rows = con.execute(_STATS_ONE, {"run": run_id, "names": names}).fetchall()
        return {n: (int(s), float(v)) for _, n, _, _, s, v in rows}

    def metric_stats(
        self, names: list[str] | None = None, run_ids: list[str] | None = None
    ) -> dict[str, dict[str, MetricStats]]:
        """{run_id: {name: MetricStats}} of every run (or `run_ids`) and every metric (or
        `names`), in one query: a run or metric without rows is absent."""
        with self._connection() as con:
            rows = con.execute(_STATS_MANY, {"runs": run_ids, "names": names}).fetchall()
        out: dict[str, dict[str, MetricStats]] = {}
        for run_id, name, lo, hi, step, last in rows:
            out.setdefault(run_id, {})[name] = MetricStats(
                None if lo is None else float(lo),
                None if hi is None else float(hi),
                int(step),
                float(last),
            )
        return out

    def events(
        self, run_id: str, since_step: int | None = None, kinds: list[str] | None = None
    ) -> list[Event]:
        """Events in step order (those with step >= since_step; of the given kinds)."""
        with self._connection() as con:
            rows = con.execute(
                _EVENTS.format(runs="run_id = $r"), {"r": run_id, "s": since_step, "k": kinds}
            ).fetchall()
        return [Event(**EVENTS.values(r)) for r in rows]

    def events_of_runs(
        self, kinds: list[str] | None = None, run_ids: list[str] | None = None
    ) -> dict[str, list[Event]]:
        """{run_id: its events in step order} of every run (or `run_ids`) that has any of the
        given kinds, in one query."""
        where = "$r::VARCHAR[] IS NULL OR run_id = ANY($r::VARCHAR[])"
        with self._connection() as con:
            rows = con.execute(
                _EVENTS.format(runs=where), {"r": run_ids, "s": None, "k": kinds}
            ).fetchall()
        out: dict[str, list[Event]] = {}
        for r in rows:
            e = Event(**EVENTS.values(r))
            out.setdefault(e.run_id, []).append(e)
        return out

    def memory_plan(self, run_id: str) -> list[PlanRow]:
        with self._connection() as con:
            rows = con.execute(
                f"{MEMORY_PLAN.select} WHERE run_id = ? ORDER BY t", [run_id]
            ).fetchall()
        return [PlanRow(**MEMORY_PLAN.values(r)) for r in rows]

    def trials(self, run_id: str) -> list[Trial]:
        """The run's ramp trials, oldest first; none in a file older than schema v7."""
        with self._connection() as con:
            if self._version(con) < schema.TRIALS_VERSION:
                return []
            rows = con.execute(
                f"{TRIALS.select} WHERE run_id = ? ORDER BY start_step NULLS LAST, updated_at",
                [run_id],
            ).fetchall()
        return [Trial(**TRIALS.values(r)) for r in rows]

    def trial_points(self, run_id: str, trial_id: int) -> list[TrialPoint]:
        """A trial's arm points (its trial_arm events) in the order they were written."""
        out = []
        for e in self.events(run_id, kinds=[M.EVENT_TRIAL_ARM]):
            data = e.data if isinstance(e.data, dict) else {}
            point = _trial_point(data) if data.get("trial_id") == trial_id else None
            if point is not None:
                out.append(point)
        return out

    def _row_span(self, con, run_id: str) -> tuple[float, float]:
        """The t span of the run's metric rows (schema v8), as bounds a raw read adds to
        `run_id = …`: the metrics table's zone maps on t then skip the row groups written while
        the run wrote nothing. Without a stored span (an older file read read-only), no bound."""
        if self._version(con) >= schema.ROW_TIMES_VERSION:
            row = first(
                con.execute(
                    "SELECT metrics_t_min, metrics_t_max FROM runs WHERE run_id = ?", [run_id]
                )
            )
            if row is not None and row[0] is not None:
                return float(row[0]), float(row[1])
        return -np.inf, np.inf

    def _row_spans(self, con, run_ids: list[str]) -> dict[str, tuple[float, float]]:
        """_row_span of each of these runs, in one query."""
        got = {}
        if self._version(con) >= schema.ROW_TIMES_VERSION:
            rows = con.execute(
                "SELECT run_id, metrics_t_min, metrics_t_max FROM runs "
                "WHERE run_id = ANY(?::VARCHAR[])",
                [run_ids],
            ).fetchall()
            got = {r: (float(lo), float(hi)) for r, lo, hi in rows if lo is not None}
        return {r: got.get(r, (-np.inf, np.inf)) for r in run_ids}

    def export(self, run_id: str) -> pa.Table:
        """Every raw metric row of a run (run_id, step, t, name, value), for CSV/Parquet."""
        with self._connection() as con:
            t_min, t_max = self._row_span(con, run_id)
            return con.sql(
                "SELECT run_id, step, t, name, value FROM metrics WHERE run_id = ? "
                "AND t >= ? AND t <= ? ORDER BY step, name",
                params=[run_id, t_min, t_max],
            ).to_arrow_table()


def list_runs(db, **kw) -> list[Run]:
    return Reader(db, **kw).list_runs()


def get_run(db, run_id: str, **kw) -> Run:
    return Reader(db, **kw).get_run(run_id)


def metric_names(db, run_id: str, **kw) -> list[str]:
    return Reader(db, **kw).metric_names(run_id)


def series(
    db,
    run_id: str,
    name: str,
    buckets: int = 2000,
    width: int | None = None,
    since_step: int | None = None,
    **kw,
) -> Series:
    return Reader(db, **kw).series(run_id, name, buckets, width, since_step)


def latest(db, run_id: str, names: list[str] | None = None, **kw) -> dict[str, tuple[int, float]]:
    return Reader(db, **kw).latest(run_id, names)


def metric_stats(
    db, names: list[str] | None = None, run_ids: list[str] | None = None, **kw
) -> dict[str, dict[str, MetricStats]]:
    return Reader(db, **kw).metric_stats(names, run_ids)


def events_of_runs(
    db, kinds: list[str] | None = None, run_ids: list[str] | None = None, **kw
) -> dict[str, list[Event]]:
    return Reader(db, **kw).events_of_runs(kinds, run_ids)


def events(
    db, run_id: str, since_step: int | None = None, kinds: list[str] | None = None, **kw
) -> list[Event]:
    return Reader(db, **kw).events(run_id, since_step, kinds)


def memory_plan(db, run_id: str, **kw) -> list[PlanRow]:
    return Reader(db, **kw).memory_plan(run_id)


def trials(db, run_id: str, **kw) -> list[Trial]:
    return Reader(db, **kw).trials(run_id)


def trial_points(db, run_id: str, trial_id: int, **kw) -> list[TrialPoint]:
    return Reader(db, **kw).trial_points(run_id, trial_id)


def export(db, run_id: str, **kw) -> pa.Table:
    return Reader(db, **kw).export(run_id)
