"""Steps are non-negative integers: log() drops anything else (counted by reason, never raised),
and every bucket-width choice terminates, whatever steps an older file already holds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampwatch import store
from rampwatch.store import rollup
from rampwatch.store.db import write_connection
from rampwatch.store.reader import _width_shift_for
from tests.procs import REPO, child_env

pytestmark = pytest.mark.timeout(120)


def _rows(db, run_id):
    return sorted((r["step"], r["name"], r["value"]) for r in store.export(db, run_id).to_pylist())


def test_log_refuses_steps_that_are_not_non_negative_integers(db_path):
    torch = pytest.importorskip("torch")
    w = store.RunWriter.start(db_path, "steps", flush_interval=1000)
    bad = [
        -1,
        -(2**40),
        True,
        False,
        "23",
        2.0,
        1.5,
        float("nan"),
        np.float64(3.0),
        np.bool_(True),
        torch.tensor(True),
        torch.tensor(2.0),
        None,
        2**63,
    ]
    for step in bad:
        w.log(step, {"a": 1.0, "b": 2.0})  # never raises
    good = [0, 1, np.int64(2), np.uint8(3), torch.tensor(4)]
    for step in good:
        w.log(step, {"a": 1.0})
    assert w.errors == len(bad), w.last_error
    drops = w.stats()["dropped"]
    assert sum(drops.values()) == 2 * len(bad), drops  # metric values, not calls
    assert any("negative" in reason for reason in drops), drops
    assert any("bool" in reason for reason in drops), drops
    assert any("str" in reason for reason in drops), drops
    assert any("float" in reason for reason in drops), drops
    assert "step" in w.last_error
    assert w.close()
    assert _rows(db_path, w.run_id) == [(s, "a", 1.0) for s in range(5)]
    # and where people look: an alert on the run says how many were dropped and why
    alerts = store.events(db_path, w.run_id, kinds=["alert"])
    assert alerts and sum(a.data["dropped"] for a in alerts) == 2 * len(bad), alerts
    assert any("negative" in a.message for a in alerts), alerts


def test_rare_records_refuse_bad_steps_with_a_reason(db_path):
    w = store.RunWriter.start(db_path, "ev", flush_interval=1000)
    for bad in (-1, True, "3", 2.0):
        with pytest.raises(ValueError, match="step must be a non-negative integer"):
            w.event("checkpoint", step=bad)
    with pytest.raises(ValueError, match="non-negative"):
        store.RunWriter.start(db_path, "r", run_id=w.run_id, resume_step=-5)
    assert w.close()


@given(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1), st.integers(1, 5000))
@settings(max_examples=400, deadline=None)
def test_width_shift_for_is_total(lo, hi, buckets):
    k = _width_shift_for(lo, hi, buckets)
    assert 0 <= k <= 64
    if hi >= lo:
        n = (hi >> k) - (lo >> k) + 1
        assert n <= max(buckets, 2)  # one aligned bucket cannot hold both -1 and 0
        if k > 0 and n <= buckets:  # the smallest such width
            assert (hi >> (k - 1)) - (lo >> (k - 1)) + 1 > buckets


@pytest.mark.parametrize("buckets", [0, -3, 1.5, "10"])
def test_width_shift_for_refuses_bad_bucket_counts(buckets):
    with pytest.raises(ValueError, match="buckets"):
        _width_shift_for(0, 10, buckets)


def _old_run_with_negative_steps(db):
    """As an older Rampwatch could leave it: raw rows and rollups at steps -3 .. 5."""
    store.RunWriter.start(db, "old", run_id="neg").close()
    steps = np.array([-3, -1, 0, 2, 5], np.int64)
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    with write_connection(db) as con:
        for s, v in zip(steps.tolist(), values.tolist(), strict=True):
            con.execute("INSERT INTO metrics VALUES ('neg', ?, 0, 'x', ?)", [s, v])
        rollup.add_batch(con, "neg", steps, values, np.zeros(5, np.int64), ["x"])


def test_series_of_a_run_with_negative_steps_returns(db_path):
    """It used to spin forever inside the read connection, locking every writer out."""
    _old_run_with_negative_steps(db_path)
    code = (
        "import sys\nfrom rampwatch import store\n"
        "for b in (1, 2, 3, 2000):\n"
        "    s = store.series(sys.argv[1], 'neg', 'x', buckets=b)\n"
        "    print(b, s.width, int(s.count.sum()), len(s.step))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(db_path)],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("store.series(buckets=1) did not return within 60 s")
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        b, width, count, n = map(int, line.split())
        assert count == 5 and n <= max(b, 2), line
    # the database is free again: a writer gets in
    with write_connection(db_path, timeout=2) as con:
        con.execute("SELECT 1").fetchall()
