"""Fuzzing the spool reader: any byte-level damage (flips, insertions, deletions, truncation) to
a spool of N good records loses at most the damaged records, reports what it stepped over, and
never raises; read in pieces as a live reader would, it finds the same records, once each."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rampwatch import store
from rampwatch.store import spool_format as fmt

pytestmark = pytest.mark.timeout(300)

SIZE = fmt.SIZE


def _good(n: int) -> bytes:
    return b"".join(fmt.encode_one(s, 1000.0 + s, s * 0.5 - 3.0, s % 3) for s in range(n))


@st.composite
def damaged(draw, max_records=40):
    """(damaged bytes, origin of each byte: record index or -1 for foreign, set of damaged
    record indexes)."""
    n = draw(st.integers(1, max_records))
    data = bytearray(_good(n))
    origin = [i // SIZE for i in range(len(data))]
    hurt = set()
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= draw(st.integers(1, 255))
            if origin[at] >= 0:
                hurt.add(origin[at])
        elif op == "insert":
            junk = draw(st.binary(min_size=1, max_size=50))
            data[at:at] = junk
            origin[at:at] = [-1] * len(junk)
            # inside a record (its bytes on both sides): that record is broken
            if at > 0 and origin[at - 1] >= 0 and origin[at - 1] == origin[at + len(junk)]:
                hurt.add(origin[at - 1])
        elif op == "delete":
            k = draw(st.integers(1, 60))
            hurt.update(o for o in origin[at : at + k] if o >= 0)
            del data[at : at + k]
            del origin[at : at + k]
        else:
            hurt.update(o for o in origin[at:] if o >= 0)
            del data[at:]
            del origin[at:]
    return bytes(data), origin, hurt, n


def _keys(recs) -> list[tuple]:
    return [(int(r["step"]), float(r["value"]), int(r["name_id"])) for r in recs]


def _original(n: int) -> dict[tuple, int]:
    return {(s, s * 0.5 - 3.0, s % 3): s for s in range(n)}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged(), st.lists(st.integers(0, 2000), max_size=5))
def test_damage_loses_at_most_the_damaged_records(case, cuts):
    data, origin, hurt, n = case
    recs, offs, end, damage = fmt.decode_records(data, 0, final=True)
    got = _keys(recs)
    original = _original(n)
    assert set(got) <= set(original), "decoding invented a record"
    assert len(got) == len(set(got)), "a record was decoded twice"
    found = {original[k] for k in got}
    intact = set(range(n)) - hurt
    assert intact <= found, f"lost undamaged records {sorted(intact - found)}"
    assert end == len(data)
    # every byte is accounted for: read into a record, or reported (whole records removed
    # cleanly leave no trace that any check could see, and need none: no byte is damaged)
    assert len(got) * SIZE + damage.nbytes + damage.torn == len(data)
    for rec, off in zip(recs, offs, strict=True):  # each offset points at its record's bytes
        assert data[off : off + SIZE] == rec.tobytes()
    # the same bytes read in pieces, as a live reader does while the file grows
    pieces, pos = [], 0
    for cut in sorted(set(min(c, len(data)) for c in cuts)) + [len(data)]:
        if cut < pos:
            continue
        part, _, pos, _ = fmt.decode_records(data[pos:cut], pos, final=cut == len(data))
        pieces += _keys(part)
    assert sorted(pieces) == sorted(got)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(max_size=20), min_size=1, max_size=15), st.data())
def test_damaged_lines_lose_only_their_own_line(texts, data):
    lines = [fmt.encode_line({"k": "event", "i": i, "m": t}) for i, t in enumerate(texts)]
    raw = bytearray(b"".join(lines))
    starts = np.cumsum([0] + [len(x) for x in lines])
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    hit = int(np.searchsorted(starts, at, side="right") - 1)  # the line holding byte `at`
    got, end, damage = fmt.decode_lines(bytes(raw), 0, final=True)
    ids = [g["i"] for g in got]
    # a flipped newline merges two lines: both go; otherwise only the line hit
    lost = {hit, hit + 1} if at == starts[hit + 1] - 1 else {hit}
    assert set(range(len(texts))) - lost <= set(ids)
    assert set(ids) <= set(range(len(texts))) and end == len(raw)
    assert damage.nbytes > 0 or damage.torn > 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged(max_records=30))
def test_damage_through_a_real_ingest_keeps_every_intact_record(case):
    """End to end: a real writer's spool, damaged in place, ingested at close into DuckDB."""
    data, origin, hurt, n = case
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "f.duckdb"
        w = store.RunWriter.start(db, "fuzz", flush_interval=1000, handle_sigterm=False)
        for name in ("n0", "n1", "n2"):  # ids 0, 1, 2 as _good() uses them
            w._flusher.files.name_id(name)
        path = w._flusher.files.path / "metrics.v2.bin"
        with open(path, "ab") as f:
            f.write(data)
        w.close()  # never raises, whatever it found
        rows = store.export(db, w.run_id).to_pylist()
        got = {(r["step"], r["value"], int(r["name"][1:])) for r in rows}
        original = _original(n)
        assert got <= set(original)
        assert set(range(n)) - hurt <= {original[k] for k in got}
        alerts = store.events(db, w.run_id, kinds=["alert"])
        if fmt.decode_records(data, 0, final=True)[3].nbytes:  # beyond a cut-off tail
            assert alerts and alerts[0].data["damaged_metric_bytes"] > 0
