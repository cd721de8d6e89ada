"""Seeded Rampwatch databases for the dashboard tests, written through the real store.

Owns the synthetic runs the page tests look at: a live run whose noise scale has crossed its
batch (a ramp is due), with events, non-finite losses and a memory plan; the same run with a
pending, applied or refused ramp command; a run whose running per-device batch just ran out of
memory (no tier fits); finished runs at constant batch sizes whose steps-to-target follow
S = S_min(1 + B_crit/B); and broken files (empty, foreign DuckDB, text, newer schema, no runs).
Everything goes through store.RunWriter / store.commands; only the newer-schema and
foreign files are made with duckdb directly (the store, rightly, cannot make them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from rampwatch import store
from rampwatch.advisor.memory import GB
from rampwatch.store import RunWriter, commands
from rampwatch.store import names as M

CAPACITY = 80 * GB
SEQ_LEN = 128
# memory plan of the live run: peak(b) = 10 GB + 2 GB per sequence
PLAN = {4: 18 * GB, 8: 26 * GB, 16: 42 * GB, 32: 74 * GB, 64: 138 * GB}
S_MIN, B_CRIT = 100.0, 64.0  # the compare runs: steps to target = S_MIN (1 + B_CRIT / B)
TARGET_LOSS = 2.5


@dataclass
class Seeded:
    db: Path
    run_id: str
    writer: RunWriter | None = None  # open for a running run; close() it at teardown
    events: int = 0
    command_id: int | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close("finished")
            self.writer = None


def _config(device_batch: int, accum: int, **extra) -> dict:
    cfg = {
        "preset": "test",
        "optimizer": "adamw",
        "lr": 1e-3,
        "per_device_batch": device_batch,
        "accum": accum,
        "world_size": 1,
        "seq_len": SEQ_LEN,
        "model": {"d_model": 128, "n_layer": 2, "seq_len": SEQ_LEN, "chunked_ce": False},
        "seed": 0,
    }
    cfg.update(extra)
    return cfg


def _writer(
    db, name: str, config: dict, capacity: int, device: str = "NVIDIA H200", run_id=None
) -> RunWriter:
    """A one-rank run's writer that flushes only when the seed asks (w.flush())."""
    return RunWriter.start(
        db,
        name=name,
        run_id=run_id,
        config=config,
        device=device,
        capacity_bytes=capacity,
        world_size=1,
        handle_sigterm=False,
        flush_interval=3600.0,
    )


def live_run(
    db,
    steps: int = 400,
    name: str = "live-run",
    nonfinite_steps=(150, 151, 320),
    ramp_due: bool = True,
    oom_at_running: bool = False,
    capacity: int = CAPACITY,
    estimates_until: int | None = None,
    noise=None,
    run_id: str | None = None,
    **config,
) -> Seeded:
    """A running run (its writer stays open): device_batch 8 × accum 2 = 16 sequences.

    The windowed noise scale (with 95% bounds at 0.6× and 1.6×) grows from 4 to ~80 sequences,
    so it has been above the ramp point 2 × 16 for far more than the policy's hysteresis at the
    end (ramp_due) — or stays below (ramp_due=False). estimates_until: no noise-scale estimate
    after this step (the measurement went off, e.g. accumulation 1 on one device).
    noise: step -> (point, lower, upper) instead (None: that value is not logged; a lower bound
    of 0 is logged as 0, "no lower bound").
    Events: checkpoint at 100, alert at 150, oom at 250 (recovered), checkpoint at 300.
    oom_at_running: the running per-device batch 8 is marked out of memory at the last step;
    with a small `capacity` no tier can fit then.
    """
    device_batch, accum = 8, 2
    w = _writer(db, name, _config(device_batch, accum, **config), capacity, run_id=run_id)
    rng = np.random.default_rng(0)
    batch = device_batch * accum
    tokens = 0
    for s in range(steps):
        tokens += batch * SEQ_LEN
        loss = 2.0 + 3.0 * math.exp(-s / 120) + 0.05 * rng.standard_normal()
        if s in nonfinite_steps:
            loss = float("nan")
        gns = 4.0 * math.exp(s * math.log(20) / steps) if ramp_due else 4.0 + s * 0.01
        m = {
            M.LOSS: loss,
            M.GRAD_NORM: 1.0 + 0.3 * rng.random(),
            M.LR: 1e-3,
            M.PER_DEVICE_BATCH: device_batch,
            M.ACCUM: accum,
            M.BATCH_SEQS: batch,
            M.BATCH_TOKENS: batch * SEQ_LEN,
            M.TOKENS_SEEN: tokens,
            M.MEM_PEAK: min(25.5 * GB, 0.9 * capacity) + 0.1 * GB * rng.random(),
            M.MEM_CAPACITY: capacity,
            M.TOKENS_PER_S: 50_000 + 1000 * rng.random(),
            M.MFU: 0.41 + 0.01 * rng.random(),
            M.STEP_TIME: 0.04,
        }
        point, low, high = gns, 0.6 * gns, 1.6 * gns
        if noise is not None:
            point, low, high = noise(s)
        if estimates_until is None or s <= estimates_until:
            est = {M.GNS: point, M.GNS_LOW: low, M.GNS_HIGH: high}
            m.update({k: v for k, v in est.items() if v is not None})
            if point is not None:
                m[M.GNS_TOKENS] = point * SEQ_LEN
        w.log(s, m)
        if s % 100 == 99:
            w.log(s, {M.VAL_LOSS: 2.1 + 3.0 * math.exp(-s / 120)})
    events = [
        (100, M.EVENT_CHECKPOINT, "checkpoint at step 100"),
        (150, M.EVENT_ALERT, "non-finite gradient: step left out of the noise scale"),
        (250, M.EVENT_OOM, "out of memory at per-device batch 16; fell back to 8 x 2"),
        (300, M.EVENT_CHECKPOINT, "checkpoint at step 300"),
    ]
    for step, kind, msg in events:
        data = {"per_device_batch": 16} if kind == M.EVENT_OOM else {}
        w.event(kind, msg, step=step, data=data)
    for b, peak in PLAN.items():
        w.memory_plan(
            b,
            predicted_bytes=peak,
            source="plan",
            step=0,
            breakdown={"parameters": 2 * GB, "activations": peak - 2 * GB},
        )
    w.memory_plan(8, measured_bytes=int(min(25.6 * GB, 0.9 * capacity)), source="measured", step=10)
    w.memory_plan(16, feasible=False, source="oom", step=250)
    if oom_at_running:
        w.memory_plan(8, feasible=False, source="oom", step=steps - 1)
    assert w.flush(), w.stats()
    return Seeded(Path(db), w.run_id, w, events=len(events))


RAMP_PAYLOAD = {"per_device_batch": 8, "accum": 4, "lr_multiplier": math.sqrt(2)}


def with_command(
    db,
    state: str,
    reason: str = "per-device batch 32 needs about 90.0 GB > 76.0 GB "
    "usable (80.0 GB capacity, 5% margin)",
) -> Seeded:
    """The live run plus one ramp command in `state`: pending, claimed, applied or refused."""
    run = live_run(db)
    cid = commands.submit(db, run.run_id, "ramp", RAMP_PAYLOAD, actor="dashboard:test")
    if state in ("claimed", "applied", "refused"):
        commands.claim(db, cid, actor="trainer:test")
    if state == "applied":
        commands.apply(db, cid, step=399, actor="trainer:test")
    elif state == "refused":
        commands.refuse(db, cid, reason=reason, actor="trainer:test")
    run.command_id = cid
    return run


def finished_run(
    db,
    batch: int,
    name: str | None = None,
    steps: int = 600,
    lr: float = 1e-3,
    run_id: str | None = None,
) -> str:
    """A finished run at constant batch `batch` (sequences) whose loss reaches TARGET_LOSS at
    step ceil(S_MIN (1 + B_CRIT / batch)) exactly: loss = 2 + 3 exp(-s / tau), no noise."""
    s_target = S_MIN * (1 + B_CRIT / batch)
    tau = s_target / math.log(3.0 / (TARGET_LOSS - 2.0))
    cfg = _config(batch, 1, lr=lr)
    w = _writer(db, name or f"b{batch}", cfg, CAPACITY, device="cpu", run_id=run_id)
    tokens = 0
    for s in range(steps):
        tokens += batch * SEQ_LEN
        w.log(
            s,
            {
                M.LOSS: 2.0 + 3.0 * math.exp(-s / tau),
                M.BATCH_SEQS: batch,
                M.PER_DEVICE_BATCH: batch,
                M.ACCUM: 1,
                M.TOKENS_SEEN: tokens,
                M.STEP_TIME: 0.01 * batch / 16,
                M.MEM_PEAK: (10 + batch / 4) * GB,
            },
        )
    assert w.close("finished")
    return w.run_id


def compare_runs(db, batches=(16, 32, 64, 128)) -> list[str]:
    return [finished_run(db, b) for b in batches]


# issue 27's seed table: nanochat on one H200 (seq 2048, accumulation 16), two measured tiers
H200_CAPACITY = 141 * GB
H200_SEQ = 2048
H200_TIERS = {  # per-device batch -> (tokens/s, MFU, measured peak); 64 and 128 ran out of memory
    16: (129_000.0, 0.62, 54 * GB),
    32: (135_000.0, 0.65, 93 * GB),
}
H200_OOM = {64: 133 * GB, 128: 139 * GB}
H200_BUDGET = 29_000 * 16 * 16 * H200_SEQ  # tokens: 29,000 steps of 524,288


def h200_run(db, steps_per_tier: int = 40, name: str = "h200-seed") -> Seeded:
    """A running run as the monitor would log it: `steps_per_tier` steps at 16 × 16, a ramp,
    then as many at 32 × 16 (tokens/s within ±1% of the seed's, MFU likewise, step time =
    tokens per step / tokens/s as Monitor.step computes it; the first step has none), the
    measured peaks as memory rows and 64 and 128 recorded out of memory."""
    accum = 16
    cfg = _config(16, accum, seq_len=H200_SEQ, total_tokens=H200_BUDGET, lr=3e-4)
    cfg["model"] = {"d_model": 1536, "n_layer": 24, "seq_len": H200_SEQ, "chunked_ce": False}
    w = _writer(db, name, cfg, H200_CAPACITY)
    rng = np.random.default_rng(27)
    tokens, step = 0, 0
    for b, (tps, mfu, peak) in H200_TIERS.items():
        batch = b * accum
        w.memory_plan(b, measured_bytes=peak, source="measured", step=step)
        for _ in range(steps_per_tier):
            tokens += batch * H200_SEQ
            m = {
                M.LOSS: 3.0,
                M.PER_DEVICE_BATCH: b,
                M.ACCUM: accum,
                M.BATCH_SEQS: batch,
                M.BATCH_TOKENS: batch * H200_SEQ,
                M.TOKENS_SEEN: tokens,
                M.MEM_PEAK: peak,
                M.MEM_CAPACITY: H200_CAPACITY,
            }
            if step > 0:  # the run's first step has nothing before it to time it against
                noise = 1 + 0.01 * (2 * rng.random() - 1)
                m[M.TOKENS_PER_S] = tps * noise
                m[M.STEP_TIME] = batch * H200_SEQ / m[M.TOKENS_PER_S]
                m[M.MFU] = mfu * noise
            w.log(step, m)
            step += 1
        if b == 16:
            w.event(
                M.EVENT_RAMP,
                "ramp to 32 per device × 16 accumulation",
                step=step - 1,
                data={"before": {"per_device_batch": 16, "accum": accum}},
            )
    for b, peak in H200_OOM.items():
        w.memory_plan(b, feasible=False, measured_bytes=peak, source="oom", step=step - 1)
    assert w.flush(), w.stats()
    return Seeded(Path(db), w.run_id, w, events=1)


def team(db, n: int, steps: int = 20) -> list[str]:
    """n short finished runs (a team's database), named r00, r01, …; batches 16, 32, 64, 128."""
    return [finished_run(db, 16 << (i % 4), name=f"r{i:02d}", steps=steps) for i in range(n)]


def count_connects(monkeypatch) -> list[str]:
    """The path of every duckdb.connect from now on (the store opens a file only through it):
    a hook that records each call and calls through."""
    calls, real = [], duckdb.connect

    def counted(database=":memory:", *args, **kw):
        calls.append(str(database))
        return real(database, *args, **kw)

    monkeypatch.setattr(duckdb, "connect", counted)
    return calls


# ------------------------------------------------------------------------------ broken files


def empty_file(path) -> Path:
    p = Path(path)
    p.write_bytes(b"")
    return p


def text_file(path) -> Path:
    p = Path(path)
    p.write_text("step,loss\n1,2.0\n")
    return p


def foreign_duckdb(path) -> Path:
    """A DuckDB file that is not Rampwatch's (someone else's table)."""
    p = Path(path)
    con = duckdb.connect(str(p))
    con.execute("CREATE TABLE sales (id INTEGER, amount DOUBLE)")
    con.execute("INSERT INTO sales VALUES (1, 2.5)")
    con.close()
    return p


def damage_data_blocks(db, table: str = "metrics") -> None:
    """Random bytes over each block of `table`'s column data, past the catalog: the file opens
    and lists its runs, and fails only when a read reaches those rows (DuckDB's checksum)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        [(size,)] = con.execute("SELECT block_size FROM pragma_database_size()").fetchall()
        meta = {r[0] for r in con.execute("SELECT block_id FROM pragma_metadata_info()").fetchall()}
        blocks = sorted(
            {
                r[0]
                for r in con.execute(
                    "SELECT block_id FROM pragma_storage_info(?) WHERE block_id >= 0", [table]
                ).fetchall()
            }
            - meta
        )
    finally:
        con.close()
    with open(db, "r+b") as f:
        for block in blocks:
            f.seek(3 * 4096 + block * size + 64)
            f.write(os.urandom(4096))


def no_runs(path) -> Path:
    """A valid Rampwatch database with no runs."""
    p = Path(path)
    with store.write_connection(p):
        pass
    return p


def newer_schema(path) -> Path:
    """A Rampwatch database stamped with a schema version from the future."""
    p = no_runs(path)
    con = duckdb.connect(str(p))
    con.execute("INSERT INTO rampwatch_schema VALUES (999, 0, 'from the future')")
    con.close()
    return p


def delete_run(db, run_id: str) -> None:
    """What an operator's cleanup does behind the dashboard's back."""
    store.delete_run(db, run_id)


# ------------------------------------------------------------------------ the app under test

APP = Path(__file__).resolve().parent.parent / "rampwatch" / "dashboard" / "app.py"


TOKEN = "test-operator-token"  # what `rampwatch dashboard` would hand the app in RAMPWATCH_TOKEN
OPERATOR = "alice"


def app(
    monkeypatch,
    db,
    read_only: bool = False,
    page: str | None = None,
    timeout: float = 60,
    token: str | None = TOKEN,
    first: str | None = None,
):
    """AppTest of the dashboard app on `db` (through RAMPWATCH_DB, as a deployment would), with
    the server's operator token `token`, already run (on the page `first`, default the live
    page; then on `page`, if given)."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("RAMPWATCH_DB", str(db))
    if token is None:
        monkeypatch.delenv("RAMPWATCH_TOKEN", raising=False)
    else:
        monkeypatch.setenv("RAMPWATCH_TOKEN", token)
    if read_only:
        monkeypatch.setenv("RAMPWATCH_READ_ONLY", "1")
    else:
        monkeypatch.delenv("RAMPWATCH_READ_ONLY", raising=False)
    at = AppTest.from_file(str(APP), default_timeout=timeout)
    if first is not None:
        at.switch_page(first)
    at.run()
    if page is not None:
        at.switch_page(page).run()
    return at


def sign_in(at, operator: str | None = OPERATOR, token: str | None = TOKEN):
    """Type the operator's name and token beside the card's buttons (not rerun yet)."""
    if operator is not None:
        at.text_input(key="rw_operator").input(operator)
    if token is not None:
        at.text_input(key="rw_token").input(token)
    return at


def figures(at) -> dict[str, dict]:
    """{chart title: plotly figure JSON} of every st.plotly_chart on the page."""
    import json

    out = {}
    for el in at.get("plotly_chart"):
        fig = _decode(json.loads(el.proto.spec))
        title = fig.get("layout", {}).get("title") or ""
        title = title.get("text", "") if isinstance(title, dict) else str(title)
        out[title] = fig
    return out


def _decode(obj):
    """Plotly 6+ ships numpy arrays as {'dtype', 'bdata' (base64)}: back to lists."""
    import base64

    if isinstance(obj, dict):
        if set(obj) >= {"dtype", "bdata"}:
            arr = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
            return arr.reshape(obj["shape"]).tolist() if "shape" in obj else arr.tolist()
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def trace_names(fig: dict) -> list[str]:
    return [t.get("name") for t in fig.get("data", [])]


def event_shapes(fig: dict) -> list[dict]:
    return [
        s
        for s in fig.get("layout", {}).get("shapes", [])
        if str(s.get("name", "")).startswith("event:")
    ]


def texts(at) -> str:
    """All visible text of the page's messages and markdown, joined (for 'in' assertions)."""
    parts = []
    for kind in (
        "title",
        "markdown",
        "caption",
        "info",
        "success",
        "warning",
        "error",
        "subheader",
    ):
        parts += [str(e.value) for e in getattr(at, kind)]
    return "\n".join(parts)


# ------------------------------------------------------------------------ recorded ramp runs


@dataclass
class Recorded:
    """What replay_run wrote besides the metrics: its plans, measured peaks, OOMs and ramps."""

    db: Path
    run_id: str
    steps: int
    capacity: float
    config: dict


def replay_run(
    db,
    *,
    plans=((0, PLAN),),
    measured=((10, 8, int(25.6 * GB)),),
    ooms=(),
    ramps=(),
    steps: int = 300,
    capacity: float = CAPACITY,
    policy: dict | None = None,
    trials=(),
) -> Recorded:
    """A finished run at 8 × 2 on one device, written as the monitor writes one, for replays.

    plans: (step, {per-device batch: predicted bytes}) — each a whole plan, as the monitor
    writes it at a boundary; measured: (step, per-device batch, peak bytes) rows; ooms: (step,
    per-device batch): an 'oom' event and its infeasible row; ramps: (step, per_device_batch,
    accum): a 'ramp' event at step (the tier runs from step + 1). The noise scale grows like
    live_run's, 4 → 80 sequences, with its lower bound at 0.6×. policy: the run config's
    ramp_policy fields beyond the first tier and LR (none: the legacy keys). trials: (step,
    verdict dict) auto trials (ids -1, -2, …) that start and end at step (tests/trial_events.py
    events; the kept branch's ramp is one of `ramps`)."""
    from tests import trial_events

    device_batch, accum = 8, 2
    extra = {}
    if policy is not None:
        extra["ramp_policy"] = {"original_batch": 16, "original_lr": 1e-3, **policy}
    config = _config(device_batch, accum, **extra)
    w = _writer(db, "recorded", config, capacity)
    tiers = {s: (b, a) for s, b, a in ramps}
    for s in range(steps):
        gns = 4.0 * math.exp(s * math.log(20) / steps)
        w.log(
            s,
            {
                M.LOSS: 2.0 + 3.0 * math.exp(-s / 120),
                M.PER_DEVICE_BATCH: device_batch,
                M.ACCUM: accum,
                M.BATCH_SEQS: device_batch * accum,
                M.MEM_CAPACITY: capacity,
                M.GNS: gns,
                M.GNS_LOW: 0.6 * gns,
                M.GNS_HIGH: 1.6 * gns,
            },
        )
        if s in tiers:  # the boundary after s: the new tier runs from s + 1
            (b0, a0), (device_batch, accum) = (device_batch, accum), tiers[s]
            w.event(
                M.EVENT_RAMP,
                f"ramp: {b0} x {a0} -> {device_batch} x {accum}",
                step=s,
                data={
                    "before": {"per_device_batch": b0, "accum": a0},
                    "after": {"per_device_batch": device_batch, "accum": accum},
                },
            )
    for i, (step, verdict) in enumerate(trials):
        start, end = trial_events.start(-1 - i, None, step), trial_events.end(-1 - i, step)
        end["data"].update(verdict=verdict, kept_factor=verdict["kept_k"])
        for e in (start, end):
            w.event(e["kind"], e["message"], step=e["step"], data=e["data"])
    for step, plan in plans:
        for b, peak in plan.items():
            w.memory_plan(b, predicted_bytes=peak, source="plan", step=step)
    for step, b, peak in measured:
        w.memory_plan(b, measured_bytes=peak, source="measured", step=step)
    for step, b in ooms:
        w.memory_plan(b, feasible=False, source="oom", step=step)
        w.event(
            M.EVENT_OOM,
            f"out of memory at per-device batch {b}",
            step=step,
            data={"per_device_batch": b},
        )
    assert w.close("finished")
    return Recorded(Path(db), w.run_id, steps, capacity, config)
