"""Run ids are names, never paths; run names are bounded and hide nothing (issue 23, 3a and 6).

On real database files: a hostile id or name is refused at start with one line naming it and the
rule, and nothing is written; the trainer's checkpoint path refuses an id that is not a name;
the real `rampwatch train --run-id ../../outside` writes nothing outside --checkpoint-dir; and
`rampwatch info` shows names stored by older versions escaped and bounded.
"""

from __future__ import annotations

import subprocess
import sys
import unicodedata

import pytest

from rampwatch import store
from tests.procs import child_env
from tests.trainer_runs import run_trainer

HOSTILE_IDS = ["../../outside", "a/b", "..", "", "x" * 1000, "a\x00b", ".hidden", "a b", "/abs"]
HIDDEN = "\u202e\u202a\u2066\u2069\u200e\u200f\u2028\u2029\x1b\n\t\ufeff\u00ad"


def _short(text: str) -> str:
    """A test id for a long or hostile string: its first characters, escaped, and its length."""
    return f"{ascii(text[:16])}-{len(text)}"


def _hidden(text: str) -> list[str]:
    """The characters of text a reader cannot see (control, format, line separators)."""
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]


def _one_line_naming(e: BaseException, *parts: str) -> None:
    msg = str(e)
    assert "\n" not in msg and not _hidden(msg), msg
    for p in parts:
        assert p in msg, msg


def _run_ids(db) -> list[str]:
    return [r.run_id for r in store.list_runs(db)] if db.exists() else []


@pytest.mark.parametrize("run_id", HOSTILE_IDS, ids=_short)
def test_a_hostile_run_id_is_refused_at_start(db_path, run_id):
    with pytest.raises(store.StoreError) as e:
        store.RunWriter.start(db_path, "n", run_id=run_id, handle_sigterm=False)
    assert isinstance(e.value, ValueError)  # the CLIs turn a ValueError into one line, exit 2
    _one_line_naming(e.value, "run id", "letters, digits")
    assert len(str(e.value)) < 300  # a 1000-character id is not repeated whole
    assert _run_ids(db_path) == []
    assert not list(db_path.parent.glob("**/*outside*"))


def test_a_hostile_run_id_is_refused_on_resume(db_path):
    with pytest.raises(ValueError) as e:
        store.RunWriter.start(db_path, "n", run_id="../r", resume_step=0, handle_sigterm=False)
    _one_line_naming(e.value, "'../r'")


def test_a_run_id_that_is_a_name_is_accepted(db_path):
    with store.RunWriter.start(db_path, "n", run_id="Run-1.v2_a", handle_sigterm=False) as w:
        w.log(0, {"loss": 1.0})
    assert _run_ids(db_path) == ["Run-1.v2_a"]
    with store.RunWriter.start(db_path, "random id", handle_sigterm=False) as w:
        assert store.naming.check_run_id(w.run_id) == w.run_id


@pytest.mark.parametrize(
    "name",
    ["x" * 201, "x" * 1_000_000, "\u202eacf3290d69db", "a\nb", "a\x00b", "a\u2066b"],
    ids=_short,
)
def test_a_long_or_hiding_run_name_is_refused_at_start(db_path, name):
    with pytest.raises(store.StoreError) as e:
        store.RunWriter.start(db_path, name, handle_sigterm=False)
    assert isinstance(e.value, ValueError)
    _one_line_naming(e.value, "run name")
    assert len(str(e.value)) < 400
    assert _run_ids(db_path) == []


def test_a_renamed_run_obeys_the_same_rule(db_path):
    with store.RunWriter.start(db_path, "fine", handle_sigterm=False) as w:
        with pytest.raises(ValueError):
            w.update_run(name="\u202efine")
        w.update_run(name="still fine · ünïcode ✓")
    assert store.list_runs(db_path)[0].name == "still fine · ünïcode ✓"


def test_display_name_makes_hidden_characters_visible_and_bounds_the_length():
    from rampwatch.store.naming import MAX_NAME_CHARS, display_name

    shown = display_name("ab" + HIDDEN + "cd")
    assert not _hidden(shown)
    assert shown.startswith("ab\\u202e\\u202a") and shown.endswith("\\u00adcd")
    assert display_name("\U000e0041") == "\\U000e0041"  # a tag character, outside the BMP
    assert display_name("plain run · ✓") == "plain run · ✓"
    assert display_name(None) == ""
    long = display_name("x" * 1_000_000)
    assert len(long) == MAX_NAME_CHARS and long.endswith("…")
    assert len(display_name("\u202e" * 1000)) <= MAX_NAME_CHARS  # escapes count too
    assert display_name("x" * 50, limit=10) == "x" * 9 + "…"


@pytest.mark.parametrize("run_id", ["../../outside", "a/b", "..", "", "a\x00b"], ids=_short)
def test_checkpoint_path_refuses_an_id_that_is_not_a_name(tmp_path, run_id):
    from rampwatch.trainer import checkpoint as ckpt

    with pytest.raises(ValueError) as e:
        ckpt.checkpoint_path(tmp_path / "ckpt", run_id)
    _one_line_naming(e.value, "run id")
    assert ckpt.checkpoint_path(tmp_path / "ckpt", "r-1") == tmp_path / "ckpt" / "r-1.pt"


def test_train_with_a_path_as_run_id_writes_nothing_outside_the_checkpoint_dir(tmp_path):
    work = tmp_path / "work"
    ckpt_dir, db = work / "a" / "ckpt", work / "runs.duckdb"
    r = run_trainer(db, ckpt_dir, "--run-id", "../../outside", "--total-tokens", "4096")
    assert r.returncode == 2, r.stdout
    assert "Traceback" not in r.stdout and len(r.stdout.strip().splitlines()) == 1, r.stdout
    assert "'../../outside'" in r.stdout and "run id" in r.stdout, r.stdout
    outside = [
        p for p in tmp_path.rglob("*") if p.is_file() and ckpt_dir not in p.parents and p != db
    ]
    assert outside == [] and not (tmp_path / "outside.pt").exists()
    assert _run_ids(db) == []


def test_info_shows_stored_names_escaped_and_bounded(db_path, tmp_path):
    for name in ("liar", "huge"):
        with store.RunWriter.start(db_path, name, run_id=name, handle_sigterm=False):
            pass
    _stored_by_an_older_version(db_path, "liar", "\u202eacf3290d69db")
    _stored_by_an_older_version(db_path, "huge", "N" * 1_000_000)
    r = subprocess.run(
        [sys.executable, "-m", "rampwatch", "info", str(db_path)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) < 2_000 and not _hidden(r.stdout.replace("\n", "")), r.stdout[:500]
    assert "\\u202eacf3290d69db" in r.stdout
    assert "N" * 150 in r.stdout and "…" in r.stdout


def _stored_by_an_older_version(db, run_id: str, name: str) -> None:
    """Older versions stored any name: write one as they did, under the store's lock."""
    with store.write_connection(db) as con:
        con.execute("UPDATE runs SET name = ? WHERE run_id = ?", [name, run_id])
