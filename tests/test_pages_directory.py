"""A team's directory of databases (AppTest, `rampwatch dashboard DIR`): three real files under
one folder — one whose run's writer lives in another process, one of finished runs, one of
garbage bytes — and a foreign and a newer-schema file beside them. The Runs page lists the runs
of both good files and each bad file with its problem; Compare overlays runs of two files; two
files holding the same run id are told apart by file, in the picker and in the address; an
Approve on the live run's page lands in that run's file and its writer process takes it; a file
copied in later shows up on the next page load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from rampwatch import store
from rampwatch.dashboard.sources import run_key
from rampwatch.store import commands
from tests import seed
from tests.procs import children, wait_until

pytestmark = pytest.mark.timeout(240)

LIVE_FILE, DONE_FILE = "node-a/runs.duckdb", "node-b/runs.duckdb"
TWIN = "live-a"  # the live run's id, held by a finished run of the other file too


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    root = tmp_path_factory.mktemp("team")
    (root / "node-a").mkdir()
    (root / "node-b").mkdir()
    done = root / DONE_FILE
    seed.finished_run(done, 16, name="b16", run_id="b16")
    seed.finished_run(done, 32, name="twin", run_id=TWIN)
    (root / "broken.duckdb").write_bytes(bytes(range(256)) * 64)  # garbage with the name
    seed.foreign_duckdb(root / "sales.duckdb")
    seed.newer_schema(root / "future.duckdb")
    with children() as kids:
        child = kids.spawn(
            [
                "tests/store_child.py",
                "seeded",
                str(root / LIVE_FILE),
                "--run-id",
                TWIN,
                "--name",
                "live-run",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        first = child.stdout.readline()
        assert first.strip() == f"READY {TWIN}", first
        yield root, child


def _runs_table(at):
    return next(d.value for d in at.dataframe if "status" in d.value.columns)


def _ok(at):
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_runs_page_lists_both_files_and_the_bad_ones(team, monkeypatch):
    root, _ = team
    at = _ok(seed.app(monkeypatch, root, page="views/runs.py"))
    t = _runs_table(at)
    assert list(t.columns[:2]) == ["name", "file"]  # in view without scrolling the table
    got = sorted(zip(t["file"], t["run id"], t["status"], strict=True))
    assert got == [
        (LIVE_FILE, TWIN, "running"),  # its writer lives in the child process
        (DONE_FILE, "b16", "finished"),
        (DONE_FILE, TWIN, "finished"),
    ]
    warnings = [str(w.value) for w in at.warning]
    problems = {
        "broken.duckdb": "is not a DuckDB database",
        "sales.duckdb": "is a DuckDB database but not a Rampwatch one",
        "future.duckdb": "schema version 999, newer than this Rampwatch understands",
    }
    for name, says in problems.items():
        # the file's name once, in front
        said = [w for w in warnings if w.startswith(name) and says in w]
        assert len(said) == 1 and said[0].count(name) == 1, (name, warnings)
    assert "3 with a problem (see Runs)" in seed.texts(at)  # the sidebar counts them


def test_compare_overlays_runs_of_two_files(team, monkeypatch):
    root, _ = team
    at = _ok(seed.app(monkeypatch, root, page="views/compare.py"))
    live, b16 = run_key(LIVE_FILE, TWIN), run_key(DONE_FILE, "b16")
    at.multiselect(key="compare_runs").set_value([live, b16]).run()
    _ok(at)
    fig = seed.figures(at)["loss by step"]
    traces = {t["name"]: t for t in fig["data"] if t["name"] in ("live-run", "b16")}
    assert set(traces) == {"live-run", "b16"}
    assert len(traces["live-run"]["x"]) == 400 and len(traces["b16"]["x"]) == 600
    # the same id in two files: the picker's labels name the file
    labels = {str(o) for o in at.multiselect(key="compare_runs").options}
    assert f"live-run (running) · {LIVE_FILE}" in labels and "b16 (finished)" in labels


def test_the_address_names_a_run_by_file_and_id(team, monkeypatch):
    root, _ = team
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("RAMPWATCH_DB", str(root))
    monkeypatch.setenv("RAMPWATCH_TOKEN", seed.TOKEN)
    at = AppTest.from_file(str(seed.APP), default_timeout=60)
    at.query_params["db"] = DONE_FILE
    at.query_params["run"] = TWIN
    _ok(at.run())
    assert at.session_state["rw_run"] == run_key(DONE_FILE, TWIN)
    assert str(at.session_state["rw_db"]) == str(root / DONE_FILE)
    text = seed.texts(at)
    assert "status **finished**" in text and f"file `{DONE_FILE}`" in text
    shown = {str(o) for o in at.sidebar.selectbox(key="run_picker").options}  # the labels
    assert f"twin · finished · {TWIN} · {DONE_FILE}" in shown, shown
    assert f"live-run · running · {TWIN} · {LIVE_FILE}" in shown, shown


def test_approve_reaches_the_live_writer_in_its_own_file(team, monkeypatch):
    root, child = team
    at = seed.sign_in(_ok(seed.app(monkeypatch, root)))  # the running run is picked
    assert at.session_state["rw_run"] == run_key(LIVE_FILE, TWIN)
    approve = at.button(key="approve")
    assert approve.label.startswith("Approve ramp to 8 × 4"), approve.label
    _ok(approve.click().run())
    [c] = commands.list_commands(root / LIVE_FILE, TWIN)
    assert c.actor == "alice (dashboard, token)" and c.payload["accum"] == 4
    assert commands.list_commands(root / DONE_FILE, TWIN) == []  # not the twin's file
    line = child.stdout.readline()  # the writer process took it at its next visit
    assert line.startswith(f"CLAIMED {c.command_id} "), line
    assert json.loads(line.split(" ", 2)[2]) == c.payload
    wait_until(lambda: commands.get(root / LIVE_FILE, c.command_id).status == "claimed")


def test_a_file_copied_in_appears_on_the_next_load(team, monkeypatch, tmp_path):
    root, _ = team
    at = _ok(seed.app(monkeypatch, root, page="views/runs.py"))
    assert "late" not in set(_runs_table(at)["run id"])
    made = tmp_path / "late.duckdb"  # written elsewhere, then copied in (as after a job)
    seed.finished_run(made, 64, name="late", run_id="late", steps=20)
    (root / "node-c").mkdir()
    shutil.copy(made, root / "node-c" / "late.duckdb")
    _ok(at.run())
    t = _runs_table(at)
    assert ("node-c/late.duckdb", "late") in set(zip(t["file"], t["run id"], strict=True))
    assert store.list_runs(root / "node-c" / "late.duckdb")[0].status == "finished"


def test_files_named_by_repeated_db_flags(team, monkeypatch):
    """`rampwatch dashboard --db A --db B` hands the app both files (after `--`): their runs
    on one Runs page, each labelled below the files' common folder."""
    root, _ = team
    monkeypatch.setattr(
        sys, "argv", ["app.py", "--db", str(root / LIVE_FILE), "--db", str(root / DONE_FILE)]
    )
    at = _ok(seed.app(monkeypatch, root / "elsewhere.duckdb", page="views/runs.py"))  # flags win
    t = _runs_table(at)
    assert sorted(zip(t["file"], t["run id"], strict=True)) == [
        (LIVE_FILE, TWIN),
        (DONE_FILE, "b16"),
        (DONE_FILE, TWIN),
    ]
    assert not at.warning  # only the two good files were named


def test_a_page_load_reads_only_the_files_that_changed(team, monkeypatch):
    """The directory is listed again on each load, but an unchanged file (finished, damaged,
    foreign, newer) is not opened again: its runs or its problem are cached on its version."""
    root, _ = team
    at = _ok(seed.app(monkeypatch, root, page="views/runs.py"))
    calls = seed.count_connects(monkeypatch)
    _ok(at.run())
    opened = {os.path.relpath(c, root) for c in calls}
    assert opened <= {LIVE_FILE}, opened  # the live file changes every flush of its writer
