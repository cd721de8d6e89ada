"""Shared fixtures: child processes are always killed as a group when a test ends."""

from __future__ import annotations

import os
import sys

import pytest

from tests.procs import children

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def procs():
    """Start children with procs.spawn([...]); any still alive at teardown is killed as a group."""
    with children() as spawner:
        yield spawner


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "runs.duckdb"


@pytest.fixture(autouse=True)
def _writable_store_process():
    """The dashboard's read-only mode makes every store read of its process read-only
    (store.db.set_read_only); a page test in read-only mode must not leave that on for the
    tests after it, which share this process."""
    yield
    from rampwatch.store import db as store_db

    store_db.set_read_only(False)


@pytest.fixture(autouse=True)
def _app_argv(monkeypatch):
    """Streamlit hands an app the arguments after `--` as sys.argv[1:]; under AppTest the app
    would see pytest's own arguments (and rightly call them unknown dashboard arguments)."""
    monkeypatch.setattr(sys, "argv", ["app.py"])


@pytest.fixture(autouse=True)
def _fresh_write_throttle():
    """The dashboard counts refused writes per client in its process (dashboard/guard.py); page
    tests share this process and AppTest's client has no address, so each test starts afresh."""
    from rampwatch.dashboard import guard

    guard.THROTTLE.reset()
    yield
    guard.THROTTLE.reset()
