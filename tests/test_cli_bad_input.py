"""Bad input to the real `rampwatch` command: one line on stderr that names the flag or the file
and what to do, exit 2, no traceback, and nothing written or damaged. One table of `rampwatch
train` cases (most are refused while the arguments are checked, before torch is imported; a
few need the set-up: the store, the checkpoint, the device), then the dashboard's port and a
closed stdout under the database commands."""

from __future__ import annotations

import ctypes
import hashlib
import os
import socket
import sqlite3
import subprocess
import sys

import pytest
import torch

from rampwatch import store
from tests.procs import child_env
from tests.store_helpers import Lines
from tests.test_cli import _rw
from tests.trainer_runs import QUICK

pytestmark = pytest.mark.timeout(240)

TINY = [*QUICK, "--steps", "1", "--no-plan"]
_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 24, 1, 2


def _file_modes_apply() -> None:
    """preexec_fn: as root, drop the capabilities that let root ignore file modes (the tests
    run as root), so a folder without read or write permission refuses this child too."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _digests(root) -> dict[str, str]:
    """sha256 of every file under root (what a refused command must leave as it was)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".lock"
    }


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Things a flag can wrongly name: a folder, a text file, a SQLite file, a damaged Rampwatch
    database, an unreadable and an unwritable folder."""
    root = tmp_path_factory.mktemp("bad")
    (root / "folder.duckdb").mkdir()
    (root / "notes.duckdb").write_text("not a database\n")
    with sqlite3.connect(root / "sqlite.db") as con:
        con.execute("CREATE TABLE t (x)")
    damaged = root / "damaged.duckdb"
    with store.RunWriter.start(damaged, "old", run_id="old", handle_sigterm=False) as w:
        for s in range(5000):
            w.log(s, {f"m{j}": s * j for j in range(5)})
    os.truncate(damaged, damaged.stat().st_size // 2)
    (root / "unreadable").mkdir()
    (root / "unreadable" / "a.txt").write_text("some text to train on\n")
    (root / "unreadable").chmod(0o000)
    (root / "unwritable").mkdir(mode=0o555)
    yield root
    (root / "unreadable").chmod(0o755)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A real one-step run, 'done', with its checkpoint: a good invocation still works."""
    root = tmp_path_factory.mktemp("finished")
    r = _rw("train", *TINY, "--db", "runs.duckdb", "--run-id", "done", cwd=root)
    assert r.returncode == 0, r.stderr
    [run] = store.list_runs(root / "runs.duckdb")
    assert (run.run_id, run.status, run.last_step) == ("done", "finished", 1)
    return root


@pytest.fixture
def live_writer(finished, procs):
    """Run 'done' resumed by a writer that stays alive (a trainer still at work on it)."""
    p = procs.spawn(
        [
            "tests/store_child.py",
            "log",
            str(finished / "runs.duckdb"),
            "--run-id",
            "done",
            "--resume",
            "1",
            "--first",
            "2",
            "--last",
            "1",  # logs nothing
            "--exit-mode",
            "wait",
        ],
        stdout=subprocess.PIPE,
    )
    Lines(p).wait_for("WAITING")  # the procs fixture kills it after the test


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

# (flags after the tiny settings, what the one line must say, what the case needs: the
# finished run, a live writer on it, or a machine without CUDA)
CASES = [
    (["--lr", "0"], "--lr must be a positive number", None),
    (["--lr", "-1"], "--lr must be a positive number", None),
    (["--lr", "nan"], "--lr must be a positive number", None),
    (["--lr", "inf"], "--lr must be a positive number", None),
    (["--betas", "2", "2"], "--betas", None),
    (["--ramp-at", "nan"], "--ramp-at must be a positive number", None),
    (["--ramp-at", "-1"], "--ramp-at must be a positive number", None),
    (["--hysteresis-steps", "0"], "--hysteresis-steps must be at least 1", None),
    (["--ramp-hysteresis", "-1"], "--hysteresis-steps must be at least 1", None),  # old spelling
    (["--min-estimates", "-1"], "--min-estimates must be 0 or more", None),
    (["--gns-window", "0"], "--gns-window", None),
    (["--val-batch", "-3"], "--val-batch must be positive", None),
    (["--val-batch", "0"], "--val-batch must be positive", None),
    (["--steps", "-5"], "--steps must be positive", None),
    (["--checkpoint-every", "-1"], "--checkpoint-every", None),
    (["--capacity-bytes", "-1"], "--capacity-bytes must be positive", None),
    (["--weight-decay", "-1"], "--weight-decay", None),
    (["--grad-clip", "nan"], "--grad-clip", None),
    (["--checkpoint-dir", "{bad}/notes.duckdb"], "--checkpoint-dir", None),
    (["--data", "{bad}/unreadable"], "--data", None),
    (["--db", "{bad}/folder.duckdb"], "folder.duckdb is a directory", None),
    (["--db", "{bad}/notes.duckdb"], "notes.duckdb is not a DuckDB database", None),
    (["--db", "{bad}/sqlite.db"], "sqlite.db is not a DuckDB database", None),
    (["--db", "{bad}/damaged.duckdb"], "damaged.duckdb is damaged", None),
    # found while setting up: torch is imported by then
    (["--db", "{here}/missing/runs.duckdb"], "directory {here}/missing does not exist", None),
    (["--db", "{bad}/unwritable/runs.duckdb"], "cannot write {bad}/unwritable/runs.duckdb", None),
    (["--resume", "nosuch"], "no checkpoint at {here}/ck/nosuch.pt", None),
    (["--run-id", "done"], "run 'done' already exists", "finished"),
    (["--resume", "done"], "run 'done' is still being written by a live process", "live"),
    (["--device", "cuda"], "--device cuda", "no-cuda"),
]


def _run_rows(db) -> list[tuple]:
    return [(r.run_id, r.status, r.last_step) for r in store.list_runs(db)]


def _params(cases):
    for flags, says, needs in cases:
        marks = [NO_CUDA] if needs == "no-cuda" else []
        yield pytest.param(flags, says, needs, marks=marks, id=" ".join(flags))


@pytest.mark.parametrize("flags,says,needs", _params(CASES))
def test_train_refuses_bad_input_in_one_line(request, bad, tmp_path, flags, says, needs):
    here, db, ckpts = tmp_path, "{here}/new.duckdb", "{here}/ck"
    if needs in ("finished", "live"):  # the finished run's own database and checkpoints
        here, db, ckpts = request.getfixturevalue("finished"), "runs.duckdb", "checkpoints"
        if needs == "live":
            request.getfixturevalue("live_writer")
        rows, checkpoint = _run_rows(here / db), _digests(here / ckpts)
    bad_files = _digests(bad)
    args = ["train", *TINY, "--db", db, "--checkpoint-dir", ckpts, *flags]
    r = _rw(*(a.format(bad=bad, here=here) for a in args), cwd=here, preexec_fn=_file_modes_apply)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith("rampwatch train: error: "), r.stderr
    assert says.format(bad=bad, here=here) in r.stderr, r.stderr
    # nothing written: no new database, no checkpoint, what it named left as it was
    assert not (tmp_path / "new.duckdb").exists() and not list(tmp_path.glob("ck/*"))
    assert _digests(bad) == bad_files
    if needs in ("finished", "live"):
        assert _run_rows(here / db) == rows and _digests(here / ckpts) == checkpoint


def test_dashboard_refuses_a_port_in_use(tmp_path):
    pytest.importorskip("streamlit")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _rw("dashboard", "--read-only", "--port", port, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert f"--port {port}" in r.stderr and "in use" in r.stderr, r.stderr


@pytest.fixture
def one_run(tmp_path):
    db = tmp_path / "runs.duckdb"
    with store.RunWriter.start(db, "only", run_id="only", handle_sigterm=False) as w:
        for step in range(20):
            w.log(step, {"loss": 1.0 / (step + 1)})
    return db


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("command", ["info", "export", "recover"])
def test_a_closed_stdout_ends_quietly_and_blames_nobody(one_run, command, buffered):
    """`rampwatch info DB | head -2`: the reader went away; the file is fine, nothing to say.
    Buffered (as from a shell), the write that fails is the last flush; unbuffered, the first."""
    env = child_env()
    if buffered:
        del env["PYTHONUNBUFFERED"]
    read, write = os.pipe()
    os.close(read)  # no reader at all: the first write fails with EPIPE, every time
    try:
        r = subprocess.run(
            [sys.executable, "-m", "rampwatch", command, str(one_run)],
            cwd=one_run.parent,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert r.returncode == 141, (r.returncode, r.stderr)  # 128 + SIGPIPE, as a shell reports
    assert r.stderr == "", r.stderr
    assert store.get_run(one_run, "only").last_step == 19  # and the file is fine
