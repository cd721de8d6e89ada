"""`rampwatch info DIR` and `rampwatch dashboard DIR` on a team's directory of databases, as the
real command: every file listed with its runs, or with its problem in one line in its place; a
bad path is one line on stderr and exit 2, never a traceback; nothing is written beside the
files `info` reads."""

from __future__ import annotations

import os

import pytest

from rampwatch.store.db_files import database_files
from tests import seed
from tests.test_cli import _rw
from tests.test_cli_bad_input import _digests, _file_modes_apply


@pytest.fixture
def team(tmp_path):
    """Two good files (one nested), a garbage one, a foreign one, and a spool folder's kin."""
    root = tmp_path / "team"
    (root / "node-b").mkdir(parents=True)
    seed.finished_run(root / "node-a.duckdb", 16, name="first", run_id="first", steps=20)
    seed.finished_run(root / "node-b" / "runs.duckdb", 32, name="second", run_id="second", steps=5)
    seed.finished_run(root / "node-b" / "runs.duckdb", 64, name="twin", run_id="first", steps=5)
    (root / "broken.duckdb").write_bytes(b"\x00garbage" * 1000)
    seed.foreign_duckdb(root / "sales.duckdb")
    (root / "notes.txt").write_text("not a database, not listed\n")
    return root


def _one_error_line(r, command: str) -> str:
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith(f"rampwatch {command}: error: "), r.stderr
    return r.stderr


def test_info_dir_lists_every_file_and_each_problem_in_its_place(team):
    before = _digests(team), sorted(p.name for p in team.rglob("*"))
    r = _rw("info", team, cwd=team.parent)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)  # some file needs a look
    assert "could not be read (listed above)" in _one_error_line(r, "info")
    out = r.stdout
    assert out.startswith(f"directory {team}: 4 database file(s)\n"), out
    blocks = {b.split(":", 1)[0]: b for b in out.split("\n\n")[1:]}
    assert set(blocks) == {
        f"database {team / n}"
        for n in ("broken.duckdb", "node-a.duckdb", "node-b/runs.duckdb", "sales.duckdb")
    }, blocks.keys()
    a, b = (
        blocks[f"database {team / 'node-a.duckdb'}"],
        blocks[f"database {team / 'node-b/runs.duckdb'}"],
    )
    assert "1 run(s)" in a and "\nfirst " in a and "finished" in a
    assert "2 run(s)" in b and "\nsecond " in b and "\nfirst " in b  # the same id, its own file
    broken = blocks[f"database {team / 'broken.duckdb'}"]
    assert "cannot be read:" in broken and "is not a DuckDB database" in broken
    assert broken.count("\n") == 0  # one line in its place
    assert "not a Rampwatch one" in blocks[f"database {team / 'sales.duckdb'}"]
    assert "notes.txt" not in out
    after = _digests(team), sorted(p.name for p in team.rglob("*"))
    assert after == before  # info only reads: nothing written in or beside any file


def test_info_dir_of_good_files_exits_0(team):
    for bad in ("broken.duckdb", "sales.duckdb"):
        (team / bad).unlink()
    r = _rw("info", team, cwd=team)
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    assert "2 database file(s)" in r.stdout and "\nsecond " in r.stdout


def test_info_dir_without_databases_or_unreadable(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _rw("info", empty, cwd=tmp_path)
    assert r.returncode == 2
    assert f"no Rampwatch databases (*.duckdb files) under {empty}" in _one_error_line(r, "info")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        r = _rw("info", locked, cwd=tmp_path, preexec_fn=_file_modes_apply)
    finally:
        locked.chmod(0o755)
    assert r.returncode == 2
    assert f"cannot list the directory {locked}: Permission denied" in _one_error_line(r, "info")


@pytest.mark.parametrize(
    "name,make,says",
    [
        ("missing", None, "{p}: no such directory (name a directory of Rampwatch databases"),
        ("locked", "locked", "cannot list the directory {p}: Permission denied"),
    ],
)
def test_dashboard_refuses_a_bad_directory_in_one_line(tmp_path, name, make, says):
    pytest.importorskip("streamlit")
    p = tmp_path / name
    if make == "locked":
        p.mkdir(mode=0o000)
    try:
        r = _rw("dashboard", p, cwd=tmp_path, preexec_fn=_file_modes_apply)
    finally:
        if p.exists():
            p.chmod(0o755)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert says.format(p=p) in _one_error_line(r, "dashboard")
    assert "Operator token" not in r.stdout  # no token made up for a start that is refused
    assert sorted(os.listdir(tmp_path)) == ([name] if make else [])  # nothing made


def test_dashboard_usage_names_the_directory_argument():
    r = _rw("dashboard", "--help", cwd=os.getcwd())
    assert r.returncode == 0
    assert "DIR" in r.stdout and "a directory of Rampwatch databases" in r.stdout
    assert "repeat it for several" in r.stdout


def test_the_store_lists_only_database_files(team):
    """What both commands list: *.duckdb below the folder, never a spool folder's content, a
    hidden file (rsync's temporary copy) or a link back up."""
    (team / "node-b" / "runs.duckdb.spool" / "s1").mkdir(parents=True, exist_ok=True)
    (team / "node-b" / "runs.duckdb.spool" / "s1" / "x.duckdb").write_bytes(b"")
    (team / ".node-a.duckdb.Xy12").write_bytes(b"partial")
    (team / ".hidden").mkdir()
    (team / ".hidden" / "old.duckdb").write_bytes(b"")
    (team / "node-b" / "loop").symlink_to(team, target_is_directory=True)
    found = [p.relative_to(team).as_posix() for p in database_files(team)]
    assert found == ["broken.duckdb", "node-a.duckdb", "node-b/runs.duckdb", "sales.duckdb"]
