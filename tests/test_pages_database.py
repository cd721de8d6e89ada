"""Database problems on every page (AppTest): missing, empty, foreign, newer-schema and run-less
files get a clear message naming the problem and what to do, never a traceback; a run deleted
while viewed gets a message; read-only serving never writes beside the file."""

from __future__ import annotations

import os

import pytest

from tests import seed

PAGES = (None, "views/compare.py", "views/runs.py")


def _only_message(at, kind: str) -> str:
    assert not at.exception, [e.message for e in at.exception]
    msgs = [str(e.value) for e in getattr(at, kind)]
    assert len(msgs) == 1, msgs
    assert not at.get("plotly_chart")
    return msgs[0]


def test_missing_file(tmp_path, monkeypatch):
    db = tmp_path / "nope.duckdb"
    at = seed.app(monkeypatch, db)
    msg = _only_message(at, "info")  # not an error: a run about to start creates it
    assert f"No database at {db}: the file does not exist yet" in msg and "--db" in msg
    assert "refreshes when it appears" in msg
    assert not db.exists()  # looking did not create it


def test_no_database_given(monkeypatch):
    monkeypatch.delenv("RAMPWATCH_DB", raising=False)
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(seed.APP), default_timeout=30).run()
    assert "No database given" in _only_message(at, "error")


def test_empty_file(tmp_path, monkeypatch):
    db = seed.empty_file(tmp_path / "empty.duckdb")
    msg = _only_message(seed.app(monkeypatch, db), "error")
    assert "is an empty file (0 bytes), not a Rampwatch database" in msg
    assert db.stat().st_size == 0


@pytest.mark.parametrize("page", PAGES)
def test_foreign_duckdb_on_every_page(tmp_path, monkeypatch, page):
    db = seed.foreign_duckdb(tmp_path / "sales.duckdb")
    before = sorted(os.listdir(tmp_path))
    at = seed.app(monkeypatch, db)
    if page:
        at.switch_page(page).run()
    msg = _only_message(at, "error")
    assert "is a DuckDB database but not a Rampwatch one" in msg and "sales" in msg
    assert sorted(os.listdir(tmp_path)) == before  # nothing written beside someone else's file


def test_text_file(tmp_path, monkeypatch):
    db = seed.text_file(tmp_path / "runs.csv")
    msg = _only_message(seed.app(monkeypatch, db), "error")
    assert "is not a DuckDB database" in msg


def test_newer_schema(tmp_path, monkeypatch):
    db = seed.newer_schema(tmp_path / "future.duckdb")
    msg = _only_message(seed.app(monkeypatch, db), "error")
    assert "schema version 999, newer than this Rampwatch understands" in msg
    assert "Upgrade Rampwatch" in msg


def test_no_runs_yet(tmp_path, monkeypatch):
    db = seed.no_runs(tmp_path / "fresh.duckdb")
    msg = _only_message(seed.app(monkeypatch, db), "info")
    assert "a Rampwatch database with no runs yet" in msg


def test_directory_without_databases_waits_for_them(tmp_path, monkeypatch):
    """A directory is a team's directory of databases (tests/test_pages_directory.py): with no
    *.duckdb file in it yet, the page says so and waits, never an error."""
    msg = _only_message(seed.app(monkeypatch, tmp_path), "info")
    assert f"No runs yet in the Rampwatch databases under {tmp_path}" in msg
    assert "(0 *.duckdb file(s) found)" in msg and "refreshes when one appears" in msg


def test_run_deleted_while_viewed(db_path, monkeypatch):
    keep = seed.finished_run(db_path, 16, name="keeper")
    run = seed.live_run(db_path)
    try:
        at = seed.app(monkeypatch, db_path)
        assert at.session_state["rw_run_id"] == run.run_id  # the running run is picked
        run.close()
        seed.delete_run(db_path, run.run_id)
        at.run()  # the next refresh of the same session
        assert not at.exception
        # the next script run falls back to a run that exists, and says so in the sidebar
        assert any(
            f"Run {run.run_id} is no longer in the database" in str(w.value)
            for w in at.sidebar.warning
        )
        assert at.session_state["rw_run_id"] == keep
        for page in ("views/compare.py", "views/runs.py"):
            at.switch_page(page).run()
            assert not at.exception
        # a new script run of the whole app falls back to a run that exists
        from streamlit.testing.v1 import AppTest

        fresh = AppTest.from_file(str(seed.APP), default_timeout=60)
        fresh.session_state["rw_run_id"] = run.run_id
        fresh.run()
        assert not fresh.exception
        assert any(
            f"Run {run.run_id} is no longer in the database" in str(w.value)
            for w in fresh.sidebar.warning
        )
        assert fresh.session_state["rw_run_id"] == keep
        assert "keeper" in seed.texts(fresh)
    finally:
        run.close()
