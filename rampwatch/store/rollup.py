"""The min/max/last rollups of metrics, kept on ingest at each of schema.ROLLUP_LEVELS.

Owns the upkeep of, per level (2**shift steps per bucket), a table of each run's *complete*
buckets that is only appended to (in bucket order, so its zone maps prune well), a table of
each run's still-open buckets rewritten on every ingest (tiny: one row per metric and open
bucket), and `rollup_state.through` per run and level: buckets below the one holding the
largest step seen are complete. All aggregates merge exactly (min of mins, max of maxes, last
at the largest step, sums of counts), so each ingest folds only the new rows in: no rescan of
raw metrics except after a resume (`truncate`, which rebuilds the finest level's open buckets
from raw rows and each coarser level from the level below). A row arriving late for a complete
bucket is merged into that bucket's row (rare: a metric logged out of order).

A row of rollup_state at shift 0 (RAW_SHIFT) is the raw level's mark, written by compaction
(store/compact.py): the run's raw rows below `through` were dropped, the rollups hold them.

The merge is done in numpy, vectorized (no Python loop per row): in SQL it cost a few ms of
query planning per level and visit, which the trainer's flusher thread would pay every second.
No finite value in a bucket is stored as NULL min/max (NaN would sort above every number).
Why rollups, and why these levels: store/reader.py says what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rampwatch.store.schema import RAW_AGGREGATES, ROLLUP_LEVELS

_COLS = "name, bucket, vmin, vmax, last_step, last_value, n, n_nonfinite"


@dataclass(frozen=True)
class Level:
    """One rollup level. Table names come from schema constants, never from input."""

    shift: int
    complete: str
    partial: str


LEVELS = tuple(Level(*lv) for lv in ROLLUP_LEVELS)


@dataclass
class _Rows:
    """Aggregate rows as numpy columns; key indexes a names list, src orders ties (later wins)."""

    key: np.ndarray
    bucket: np.ndarray
    vmin: np.ndarray
    vmax: np.ndarray
    last_step: np.ndarray
    last_value: np.ndarray
    n: np.ndarray
    nnf: np.ndarray
    src: np.ndarray

    def take(self, idx) -> "_Rows":
        return _Rows(*(getattr(self, f)[idx] for f in _Rows.__dataclass_fields__))

    @staticmethod
    def concat(parts: list["_Rows"]) -> "_Rows":
        return _Rows(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in _Rows.__dataclass_fields__)
        )


def _combine(r: _Rows) -> _Rows:
    """Merge rows with the same (key, bucket): fmin/fmax skip NaN (= no finite value)."""
    order = np.lexsort((r.src, r.last_step, r.bucket, r.key))
    r = r.take(order)
    new = np.ones(len(r.key), bool)
    new[1:] = (r.key[1:] != r.key[:-1]) | (r.bucket[1:] != r.bucket[:-1])
    starts = np.flatnonzero(new)
    last = np.r_[starts[1:], len(r.key)] - 1  # the largest step (latest arrival on a tie)
    return _Rows(
        r.key[starts],
        r.bucket[starts],
        np.fmin.reduceat(r.vmin, starts),
        np.fmax.reduceat(r.vmax, starts),
        r.last_step[last],
        r.last_value[last],
        np.add.reduceat(r.n, starts),
        np.add.reduceat(r.nnf, starts),
        r.src[last],
    )


def _raw_rows(step: np.ndarray, value: np.ndarray, key: np.ndarray, shift: int) -> _Rows:
    finite = np.isfinite(value)
    fv = np.where(finite, value, np.nan)
    ones = np.ones(len(step), np.int64)
    return _Rows(
        key.astype(np.int64),
        step >> shift,
        fv,
        fv,
        step,
        value,
        ones,
        (~finite).astype(np.int64),
        np.arange(1, len(step) + 1, dtype=np.int64),
    )


def _stored_rows(con, sql: str, params: list, index: dict[str, int], names: list[str]) -> _Rows:
    cols = con.execute(sql, params).fetchnumpy()
    keys = np.empty(len(cols["name"]), np.int64)
    for i, name in enumerate(cols["name"].tolist()):  # few rows: the open buckets
        if name not in index:
            index[name] = len(names)
            names.append(name)
        keys[i] = index[name]
    f64 = {c: np.ma.filled(np.ma.asarray(cols[c], np.float64), np.nan) for c in ("vmin", "vmax")}
    return _Rows(
        keys,
        np.asarray(cols["bucket"], np.int64),
        f64["vmin"],
        f64["vmax"],
        np.asarray(cols["last_step"], np.int64),
        np.asarray(cols["last_value"], np.float64),
        np.asarray(cols["n"], np.int64),
        np.asarray(cols["n_nonfinite"], np.int64),
        np.zeros(len(keys), np.int64),
    )


def _arrow(r: _Rows, names: list[str]) -> pa.Table:
    return pa.table(
        {
            "name": pa.array(np.asarray(names, dtype=object)[r.key], pa.string()),
            "bucket": r.bucket,
            "vmin": pa.array(r.vmin, mask=np.isnan(r.vmin)),
            "vmax": pa.array(r.vmax, mask=np.isnan(r.vmax)),
            "last_step": r.last_step,
            "last_value": r.last_value,
            "n": r.n,
            "n_nonfinite": r.nnf,
        }
    )


def add_batch(
    con, run_id: str, step: np.ndarray, value: np.ndarray, key: np.ndarray, names: list[str]
) -> None:
    """Fold new raw rows (names[key[i]] = value[i] at step[i]) into the run's rollups."""
    state = dict(
        con.execute("SELECT shift, through FROM rollup_state WHERE run_id = ?", [run_id]).fetchall()
    )
    names = list(names)
    index = {n: i for i, n in enumerate(names)}
    for lv in LEVELS:
        _add(
            con,
            run_id,
            lv,
            state.get(lv.shift),
            _raw_rows(step, value, key, lv.shift),
            names,
            index,
        )


def _add(con, run_id, lv: Level, old: int | None, fresh: _Rows, names, index) -> None:
    new = int(fresh.bucket.max()) if old is None else max(old, int(fresh.bucket.max()))
    parts = [
        fresh,
        _stored_rows(
            con, f"SELECT {_COLS} FROM {lv.partial} WHERE run_id = ?", [run_id], index, names
        ),
    ]
    late = fresh.bucket < old if old is not None else np.zeros(len(fresh.bucket), bool)
    if late.any():  # merge into the complete rows of those buckets, which are then replaced
        lo = int(fresh.bucket[late].min())
        stored = _stored_rows(
            con,
            f"SELECT {_COLS} FROM {lv.complete} WHERE run_id = ? AND bucket >= ? AND bucket < ?",
            [run_id, lo, old],
            index,
            names,
        )
        pairs = set(zip(fresh.key[late].tolist(), fresh.bucket[late].tolist(), strict=True))
        hit = np.array(
            [p in pairs for p in zip(stored.key.tolist(), stored.bucket.tolist(), strict=True)],
            bool,
        )
        parts.append(stored.take(hit))
        con.register("rw_late", _arrow(stored.take(hit), names))
        try:
            con.execute(
                f"""DELETE FROM {lv.complete} USING rw_late m
                            WHERE {lv.complete}.run_id = ? AND {lv.complete}.name = m.name
                              AND {lv.complete}.bucket = m.bucket""",
                [run_id],
            )
        finally:
            con.unregister("rw_late")
    merged = _combine(_Rows.concat(parts))
    done = merged.bucket < new
    con.execute(f"DELETE FROM {lv.partial} WHERE run_id = ?", [run_id])
    for table, sel in ((lv.complete, done), (lv.partial, ~done)):
        if sel.any():
            rows = merged.take(
                np.flatnonzero(sel)[np.lexsort((merged.key[sel], merged.bucket[sel]))]
            )
            con.register("rw_rows", _arrow(rows, names))
            try:
                con.execute(f"INSERT INTO {table} SELECT ?, {_COLS} FROM rw_rows", [run_id])
            finally:
                con.unregister("rw_rows")
    if old is None:
        con.execute("INSERT INTO rollup_state VALUES (?, ?, ?)", [run_id, lv.shift, new])
    elif new != old:
        con.execute(
            "UPDATE rollup_state SET through = ? WHERE run_id = ? AND shift = ?",
            [new, run_id, lv.shift],
        )


RAW_SHIFT = 0  # rollup_state's row at shift 0: raw rows below `through` were compacted away


def raw_from(con, run_id: str) -> int | None:
    """The first step from which the run's raw rows are all kept (None: never compacted)."""
    row = con.execute(
        "SELECT max(through) FROM rollup_state WHERE run_id = ? AND shift = ?", [run_id, RAW_SHIFT]
    ).fetchall()
    return None if not row or row[0][0] is None else int(row[0][0])


def _from_raw(con, run_id: str, lv: Level, lo: int, last_kept_step: int, skip: str = "") -> None:
    """Bucket lo on of level lv from raw rows (skip: a registered table of names to leave out)."""
    leave_out = f"AND name NOT IN (SELECT name FROM {skip})" if skip else ""
    con.execute(
        f"""INSERT INTO {lv.partial}
            SELECT ?, name, step >> {lv.shift} AS bucket, {RAW_AGGREGATES}
            FROM metrics WHERE run_id = ? AND step >= ? AND step <= ? {leave_out}
            GROUP BY name, bucket""",
        [run_id, run_id, lo << lv.shift, last_kept_step],
    )


def _from_finer(con, run_id: str, lv: Level, finer: Level, lo: int) -> None:
    """Bucket lo on of level lv from the finer level's buckets (every aggregate merges exactly)."""
    d = lv.shift - finer.shift
    rows = f"""SELECT {_COLS} FROM {finer.complete} WHERE run_id = $r AND bucket >= $lo
        UNION ALL SELECT {_COLS} FROM {finer.partial} WHERE run_id = $r AND bucket >= $lo"""
    con.execute(
        f"""INSERT INTO {lv.partial}
            SELECT $r, name, bucket >> {d} AS b, min(vmin), max(vmax), max(last_step),
                   arg_max(last_value, last_step), sum(n), sum(n_nonfinite)
            FROM ({rows}) GROUP BY name, b""",
        {"r": run_id, "lo": lo << d},
    )


def truncate(con, run_id: str, last_kept_step: int) -> None:
    """After raw rows with step > last_kept_step were deleted: drop and rebuild what they fed.

    The finest level's open buckets are rebuilt from raw rows, each coarser one from the level
    below it (exact: the aggregates merge). Where compaction (store/compact.py) dropped the raw
    rows of the finest bucket holding last_kept_step, that bucket's stored row is kept when it
    holds no step after last_kept_step, and is lost otherwise (at most 8 steps of each metric).
    """
    state = dict(
        con.execute("SELECT shift, through FROM rollup_state WHERE run_id = ?", [run_id]).fetchall()
    )
    raw = state.get(RAW_SHIFT)
    finer = None
    for lv in LEVELS:
        old = state.get(lv.shift)
        if old is None:
            continue
        lo = min(old, last_kept_step >> lv.shift)  # from bucket lo on: open again, rebuilt
        kept = None
        if finer is None and raw is not None and (lo << lv.shift) < raw:
            kept = con.sql(
                f"""SELECT * FROM {lv.complete} WHERE run_id = $r AND bucket = $b
                    AND last_step <= $s
                    UNION ALL SELECT * FROM {lv.partial} WHERE run_id = $r AND bucket = $b
                    AND last_step <= $s""",
                params={"r": run_id, "b": lo, "s": last_kept_step},
            ).to_arrow_table()
        con.execute(f"DELETE FROM {lv.complete} WHERE run_id = ? AND bucket >= ?", [run_id, lo])
        con.execute(f"DELETE FROM {lv.partial} WHERE run_id = ?", [run_id])
        if finer is not None:
            _from_finer(con, run_id, lv, finer, lo)
        elif kept is not None:  # those stored rows, and raw rows for the other metrics
            con.register("rw_kept", kept)
            try:
                con.execute(f"INSERT INTO {lv.partial} SELECT * FROM rw_kept")
                _from_raw(con, run_id, lv, lo, last_kept_step, skip="rw_kept")
            finally:
                con.unregister("rw_kept")
        else:
            _from_raw(con, run_id, lv, lo, last_kept_step)
        con.execute(
            "UPDATE rollup_state SET through = ? WHERE run_id = ? AND shift = ?",
            [lo, run_id, lv.shift],
        )
        finer = lv
    if raw is not None and last_kept_step + 1 < raw:  # rows logged from now on are all kept
        con.execute(
            "UPDATE rollup_state SET through = ? WHERE run_id = ? AND shift = ?",
            [last_kept_step + 1, run_id, RAW_SHIFT],
        )
