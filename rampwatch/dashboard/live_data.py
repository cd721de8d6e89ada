"""The live page's refresh: what a session keeps between ticks of one run, and the one read
connection each tick fetches through.

Owns: `LiveState` (a SeriesCache per chart, "More charts" included, the run's metric names,
the raw noise-scale window the recommendation reads,
the run's ramp commands, read only when due) and `live_snapshot` (the Streamlit-side entry: state
in st.session_state, the previous snapshot kept while the database is busy) and
`read_snapshot` (one refresh outside Streamlit: `rampwatch plan --db`; Streamlit is imported
only by live_snapshot), with the plain forms of the store's rows the card reads (buckets_from,
event_dict, plan_dict) and the dashboard's lock TIMEOUT. The run's trials
come with each tick, and the newest one's arm points (its trial_arm events, which are kept out
of the events list: they are the trial chart's points, not markers). Each tick fetches
only from the last partial bucket on, all inside one Reader session. Reads and writes that are
not live-page specific live in dashboard/store_access.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rampwatch.dashboard.buckets import Buckets, SeriesCache
from rampwatch.store import commands as store_commands
from rampwatch.store import names as M
from rampwatch.store.errors import StoreBusyError
from rampwatch.store.reader import Reader

TIMEOUT = 5.0  # seconds a dashboard read or write waits for the database's lock
COMMANDS_DIRTY = "_rw_commands_dirty"  # session flag: this session wrote a command (store_access)
TARGET_BUCKETS = 1000  # points per live chart (about a chart's width in pixels)
GNS_WINDOW = 2048  # raw steps of the noise scale the recommendation reads (dashboard/recommend.py)


def buckets_from(series) -> Buckets:
    """store.reader.Series -> Buckets."""
    w = int(series.width)
    return Buckets.from_columns(
        w,
        bucket=np.asarray(series.step, np.int64) // w,
        last_step=series.last_step,
        lo=series.min,
        hi=series.max,
        last=series.last,
        n=series.count,
        nonfinite=series.nonfinite,
    )


def refresh_series(
    reader: Reader, run_id: str, caches: dict, last_step: int | None, epoch: int
) -> dict[str, Buckets]:
    """{name: Buckets}: each of the run's SeriesCaches brought up to date through `reader` (one
    fetch each, from its last partial bucket on: dashboard/buckets.py). Call it inside
    reader.session(), for as many runs as the page shows."""

    def fetch_of(name):
        return lambda since, width: buckets_from(
            reader.series(run_id, name, width=width, since_step=since)
        )

    return {n: c.refresh(fetch_of(n), last_step, epoch) for n, c in caches.items()}


def refresh_series_many(reader: Reader, runs) -> None:
    """refresh_series of several runs, each (run_id, {name: SeriesCache}, last_step, epoch),
    their fetches made by one Reader.series_many (one query for all their raw rows). Call it
    inside reader.session()."""
    begun = [
        (c, (run_id, name, *reversed(c.begin(last_step, epoch))))  # (run, name, width, since)
        for run_id, caches, last_step, epoch in runs
        for name, c in caches.items()
    ]
    for (c, _), s in zip(begun, reader.series_many([w for _, w in begun]), strict=True):
        c.finish(buckets_from(s))


def event_dict(e) -> dict:
    return {"step": e.step, "t": e.t, "kind": e.kind, "message": e.message, "data": e.data}


def plan_dict(p) -> dict:
    return {
        "step": p.step,
        "per_device_batch": p.per_device_batch,
        "variant": p.variant,
        "predicted_bytes": p.predicted_bytes,
        "measured_bytes": p.measured_bytes,
        "source": p.source,
        "feasible": p.feasible,
        "breakdown": p.breakdown,
    }


@dataclass
class Snapshot:
    run: object  # store.reader.Run
    series: dict[str, Buckets]
    latest: dict[str, float]
    gns_steps: np.ndarray
    gns_values: np.ndarray
    events: list[dict]
    plan_rows: list[dict]
    commands: list = field(default_factory=list)
    busy: str | None = None  # set when this is the previous snapshot: the database was busy
    gns_lower: np.ndarray | None = None  # one-sided 95% lower bound at each of gns_steps
    trials: list = field(default_factory=list)  # store.reader.Trial, oldest first
    trial_points: list = field(default_factory=list)  # the newest trial's store.reader.TrialPoint
    names: list = field(default_factory=list)  # every metric the run has logged, sorted


LIVE_METRICS = (
    M.LOSS,
    M.VAL_LOSS,
    M.GRAD_NORM,
    M.GNS,
    M.GNS_LOW,
    M.GNS_HIGH,
    M.BATCH_SEQS,
    M.MEM_PEAK,
    M.MEM_CAPACITY,
    M.TOKENS_PER_S,
    M.MFU,
    M.PER_DEVICE_BATCH,
    M.ACCUM,
    M.TOKENS_SEEN,
)
COMMANDS_EVERY = 6  # ticks between command reads while none is open (an open one: every tick)
NAMES_EVERY = 6  # ticks between reads of the run's metric names: a new one is charted within


class LiveState:
    """What a session keeps between refreshes of one run: a SeriesCache per metric, the recent
    raw noise-scale window, and the run's ramp commands. Plain object (no Streamlit), so the
    bench mirrors it.

    Commands cost a connection of their own (store.commands has no read inside a Reader
    session), so they are read every tick only while one is open (pending → claimed → applied /
    refused is what the card waits for), after this session wrote one (`commands_dirty`), when
    the events changed, and otherwise every COMMANDS_EVERY ticks (another session's approval).
    """

    def __init__(self, target_buckets: int = TARGET_BUCKETS, gns_window: int = GNS_WINDOW):
        self.target_buckets = target_buckets
        self.caches = {n: SeriesCache(target_buckets) for n in LIVE_METRICS}
        self.gns_window = gns_window
        self._gns: dict[str, Buckets] = {}  # raw noise scale and its bound, last `gns_window` steps
        self._gns_key: tuple[int, int] | None = None  # (run last step, resume epoch) it is for
        self.fetches = 0
        self.commands: list | None = None
        self.commands_dirty = False
        self._since_commands = 0
        self._events_seen = -1
        self.names: list[str] | None = None  # the run's metric names, read every NAMES_EVERY ticks
        self._since_names = 0
        self.last: Snapshot | None = None

    def commands_due(self, n_events: int) -> bool:
        due = (
            self.commands is None
            or self.commands_dirty
            or n_events != self._events_seen
            or any(c.status in ("pending", "claimed") for c in self.commands)
            or self._since_commands + 1 >= COMMANDS_EVERY
        )
        self._events_seen = n_events
        return due

    def update_commands(self, db, run_id: str, n_events: int) -> list:
        """The run's ramp and trial commands, read only when due (see the class doc)."""
        if self.commands_due(n_events):
            self.commands = [
                c
                for c in store_commands.list_commands(db, run_id, timeout=TIMEOUT)
                if c.kind in ("ramp", "trial")
            ]
            self.commands_dirty = False
            self._since_commands = 0
        else:
            self._since_commands += 1
        return list(self.commands)

    def choose_more(self, more) -> None:
        """Keep a SeriesCache for each of `more` (the charts below the fixed ones) besides
        LIVE_METRICS; drop those no longer chosen."""
        for name in [n for n in self.caches if n not in LIVE_METRICS and n not in more]:
            del self.caches[name]
        for name in more:
            self.caches.setdefault(name, SeriesCache(self.target_buckets))

    def refresh(self, reader: Reader, run_id: str, more=()) -> Snapshot:
        self.choose_more(more)
        with reader.session():
            run = reader.get_run(run_id)
            if self.names is None or self._since_names + 1 >= NAMES_EVERY:
                self.names, self._since_names = reader.metric_names(run_id), 0
            else:
                self._since_names += 1
            evs = [event_dict(e) for e in reader.events(run_id) if e.kind != M.EVENT_TRIAL_ARM]
            epoch = sum(1 for e in evs if e["kind"] == M.EVENT_RESUME)
            out = refresh_series(reader, run_id, self.caches, run.last_step, epoch)
            self.fetches += len(out)  # one fetch per cache
            gsteps, gvals, glower = self._gns_window(reader, run_id, run.last_step, epoch)
            plan = [plan_dict(p) for p in reader.memory_plan(run_id)]
            trials = reader.trials(run_id)
            points = reader.trial_points(run_id, trials[-1].trial_id) if trials else []
        latest = {}
        for name, b in out.items():
            fin = np.flatnonzero(np.isfinite(b.last))
            if fin.size:
                latest[name] = float(b.last[fin[-1]])
        snap = Snapshot(run, out, latest, gsteps, gvals, evs, plan, gns_lower=glower)
        snap.trials, snap.trial_points, snap.names = trials, points, list(self.names)
        return snap

    def _gns_window(self, reader, run_id, last_step, epoch):
        """Raw (width 1) noise-scale points and lower bounds over the last `gns_window` steps,
        fetched incrementally. Steps are those with a fresh estimate (each logs a lower bound);
        runs written before bounds were logged have points only."""
        if last_step is None:
            return np.zeros(0, np.int64), np.zeros(0), None
        lo = max(0, int(last_step) - self.gns_window + 1)
        stale = self._gns_key is None or self._gns_key[1] != epoch or self._gns_key[0] > last_step
        for name in (M.GNS, M.GNS_LOW):
            old = None if stale else self._gns.get(name)
            since = lo if old is None or not len(old) else max(lo, int(old.last_step[-1]))
            self.fetches += 1
            fresh = buckets_from(reader.series(run_id, name, width=1, since_step=since))
            kept = (
                Buckets(1)
                if old is None
                else old.take((old.last_step >= lo) & (old.last_step < since))
            )
            self._gns[name] = kept.concat(fresh)
        self._gns_key = (int(last_step), epoch)
        points, bounds = self._gns[M.GNS], self._gns[M.GNS_LOW]
        if not len(bounds):
            return points.last_step, points.last, None
        by_step = dict(zip(points.last_step.tolist(), points.last.tolist(), strict=True))
        values = np.array([by_step.get(s, np.nan) for s in bounds.last_step.tolist()])
        return bounds.last_step, values, bounds.last


def read_snapshot(db, run_id: str) -> Snapshot:
    """One refresh of a run outside a Streamlit session, read only (no commands: a card built
    from it offers nothing): what `rampwatch plan --db` builds the card from (recommend.card_of)."""
    return LiveState().refresh(Reader(db, timeout=TIMEOUT, read_only=True), run_id)


def live_snapshot(db: Path, run_id: str, more=()) -> Snapshot:
    """Refresh the selected run: only new buckets are read; state lives in st.session_state.
    more: metrics charted besides LIVE_METRICS (the page's "More charts")."""
    import streamlit as st  # here: the rest of this module runs outside Streamlit too

    states = st.session_state.setdefault("_rw_live", {})
    key = (str(db), run_id)
    if key not in states:
        states.clear()  # one run at a time: drop the previous run's buckets
        states[key] = LiveState()
    state: LiveState = states[key]
    if st.session_state.pop(COMMANDS_DIRTY, False):  # this session just wrote one
        state.commands_dirty = True
    try:
        snap = state.refresh(Reader(db, timeout=TIMEOUT), run_id, more)
        snap.commands = state.update_commands(db, run_id, len(snap.events))
    except StoreBusyError as e:  # keep showing what we have; the next tick retries
        last = getattr(state, "last", None)
        if last is None:
            raise
        last.busy = str(e)
        return last
    state.last = snap
    return snap
