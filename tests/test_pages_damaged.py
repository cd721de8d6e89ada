"""A database whose catalog is whole but whose rows are damaged (AppTest, a directory): DuckDB
checks a block only when a read reaches it, so the file lists its runs and fails on their rows.
Compare leaves its runs out with the file's problem and overlays the rest; the run's own page
says the file is damaged; from then on the Runs page lists the file with that problem instead
of its runs. Never a traceback."""

from __future__ import annotations

import shutil

import pytest

from rampwatch.dashboard.sources import run_key
from tests import seed

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "team"
    root.mkdir()
    seed.finished_run(root / "good.duckdb", 16, name="good", run_id="good")
    seed.finished_run(tmp_path / "bad.duckdb", 32, name="hurt", run_id="hurt")
    seed.damage_data_blocks(tmp_path / "bad.duckdb")
    shutil.copy(tmp_path / "bad.duckdb", root / "bad.duckdb")
    return root


def _ok(at):
    assert not at.exception, [e.message for e in at.exception]
    return at


def _runs_table(at):
    return next(d.value for d in at.dataframe if "status" in d.value.columns)


def test_compare_leaves_a_damaged_file_out_and_the_runs_page_lists_it(folder, monkeypatch):
    at = _ok(seed.app(monkeypatch, folder, first="views/compare.py"))  # both runs chosen
    assert set(at.multiselect(key="compare_runs").value) == {
        run_key("good.duckdb", "good"),
        run_key("bad.duckdb", "hurt"),
    }
    said = [str(w.value) for w in at.warning]
    assert any("bad.duckdb is damaged" in w and "backup" in w for w in said), said
    names = {t["name"] for t in seed.figures(at)["loss by step"]["data"]}
    assert "good" in names and "hurt" not in names
    # from now on the file is a problem line, its run no longer offered, and the sidebar
    # says why the run it had picked is gone
    _ok(at.run())
    assert "Run hurt is no longer in bad.duckdb (the file has a problem: see Runs)" in (
        seed.texts(at)
    )
    runs = _ok(seed.app(monkeypatch, folder, page="views/runs.py"))
    assert set(_runs_table(runs)["run id"]) == {"good"}
    warnings = [str(w.value) for w in runs.warning]
    assert any(w.startswith("bad.duckdb") and "is damaged" in w for w in warnings), warnings


def test_the_damaged_runs_page_says_so(folder, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("RAMPWATCH_DB", str(folder))
    monkeypatch.setenv("RAMPWATCH_TOKEN", seed.TOKEN)
    at = AppTest.from_file(str(seed.APP), default_timeout=60)
    at.query_params["db"] = "bad.duckdb"
    at.query_params["run"] = "hurt"
    _ok(at.run())
    errors = [str(e.value) for e in at.error]
    assert any("bad.duckdb is damaged" in e for e in errors), (errors, seed.texts(at))


def test_the_runs_page_lists_a_file_whose_summaries_are_damaged(folder, monkeypatch, tmp_path):
    """The Runs page's summaries come from the rollups: damage there is found on its first
    load, and the same load lists the file with its problem."""
    seed.finished_run(tmp_path / "rolled.duckdb", 16, name="rolled", run_id="rolled")
    seed.damage_data_blocks(tmp_path / "rolled.duckdb", table="metrics_rollup")
    shutil.copy(tmp_path / "rolled.duckdb", folder / "rolled.duckdb")
    runs = _ok(seed.app(monkeypatch, folder, first="views/runs.py"))
    assert "rolled" not in set(_runs_table(runs)["run id"])
    warnings = [str(w.value) for w in runs.warning]
    assert any(w.startswith("rolled.duckdb") and "is damaged" in w for w in warnings), warnings
