"""The `rampwatch` command as a user runs it (real processes, from another directory): export,
and every mistake as one line on stderr with exit 2, naming nothing internal."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from rampwatch import store
from tests.procs import child_env


def _rw(*args, cwd, **popen) -> subprocess.CompletedProcess:
    """`rampwatch ARGS…` run from cwd; popen: more subprocess.run arguments (preexec_fn …)."""
    return subprocess.run(
        [sys.executable, "-m", "rampwatch", *map(str, args)],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        **popen,
    )


@pytest.fixture
def two_runs(tmp_path):
    db = tmp_path / "runs.duckdb"
    for run_id, n in (("first", 3), ("second", 5)):
        with store.RunWriter.start(db, run_id, run_id=run_id) as w:
            for step in range(n):
                w.log(step, {"loss": 1.0 / (step + 1), "lr": 0.1})
    return db


def test_export_csv_to_stdout_and_parquet_to_a_file(two_runs, tmp_path):
    r = _rw("export", two_runs, "second", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].replace('"', "") == "run_id,step,t,name,value" and len(lines) == 1 + 5 * 2
    out = tmp_path / "first.parquet"
    r = _rw("export", two_runs, "first", "--format", "parquet", "-o", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    table = pq.read_table(out)
    assert table.num_rows == 3 * 2 and set(table.column("run_id").to_pylist()) == {"first"}


@pytest.mark.parametrize(
    "args,says",
    [
        ([], "the following arguments are required: COMMAND"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        (
            ["export", "{db}"],
            "holds 2 runs (second, first): name the one to export",
        ),  # newest first
        (["export", "{db}", "third"], "no run 'third' in"),
        (["recover", "{dir}"], "is a directory, not a database file"),  # info DIR lists it
        (["info", "{dir}/missing.duckdb"], "the file does not exist"),
        (["dashboard", "--db", "{db}", "--dbb", "x"], "unrecognized arguments: --dbb"),
        (["train", "--per-device-batch", "0"], "--per-device-batch must be positive"),
        (["plan", "--capacity-gb", "80"], "the following arguments are required"),
    ],
)
def test_every_mistake_is_one_line_and_exit_2(two_runs, tmp_path, args, says):
    args = [a.format(db=two_runs, dir=tmp_path) for a in args]
    r = _rw(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("rampwatch") and says in r.stderr, r.stderr
    assert "RunWriter" not in r.stderr and "rampwatch.store" not in r.stderr
