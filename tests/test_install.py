"""Rampwatch installed as a user installs it: the wheel built from this checkout, pip-installed
into fresh virtual environments outside it, every command run from another directory.

One environment, in two stages, because installing torch is most of the time: first the core
and the [dashboard] extra only (a laptop that views: no torch) serving a database written
elsewhere; then torch added, running examples/own_loop.py, `rampwatch info` on the database it
made, and the dashboard on it. Then a second DuckDB in it, older than the one that wrote the
file, so the message for environments that differ is seen for real.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from rampwatch import store
from tests.procs import REPO, free_port, kill_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(args, cwd, timeout=600, check=True, env=None):
    out = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )
    if check:
        assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def _pip_install(py: Path, *args: str, cwd: Path) -> None:
    """pip install without byte-compiling what it installs: Python compiles a module when it is
    first imported, and compiling all of torch up front took three quarters of its install here
    (42 s against 10 s on the 2-core machine, 2026-12-07)."""
    _run([py, "-m", "pip", "install", "-q", "--no-compile", *args], cwd=cwd, env=_clean_env())


def _clean_env() -> dict:
    """No PYTHONPATH or checkout on the path: only what the environment installed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _serves(venv: Path, db: Path, cwd: Path) -> None:
    """`rampwatch dashboard` starts and its health endpoint answers; then it is stopped."""
    port = free_port()
    proc = subprocess.Popen(
        [venv / "bin" / "rampwatch", "dashboard", "--db", db, "--port", str(port)],
        cwd=cwd,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the dashboard exited:\n{proc.stdout.read()}"
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/_stcore/health", timeout=2
                ) as r:
                    if r.status == 200 and r.read() == b"ok":
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the dashboard's health endpoint did not answer within 90 s")
    finally:
        kill_group(proc)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, REPO], cwd=out)
    [whl] = out.glob("rampwatch-*.whl")
    return whl


def test_wheel_holds_only_the_rampwatch_package(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rampwatch"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "rampwatch/dashboard/app.py" in names and "rampwatch/dashboard/views/live.py" in names


def test_installed_viewer_then_monitor(wheel, tmp_path):
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    py, rw = venv / "bin" / "python", venv / "bin" / "rampwatch"
    env = _clean_env()

    # Stage 1: core + [dashboard], no torch; a database written by another environment (ours).
    _pip_install(py, f"{wheel}[dashboard]", cwd=elsewhere)
    assert _run([py, "-c", "import torch"], cwd=elsewhere, check=False, env=env).returncode != 0, (
        "the viewer's install must not pull in torch"
    )
    site = Path(
        _run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=elsewhere,
            env=env,
        ).stdout.strip()
    )
    assert not {"trainer", "store", "pages", "advisor", "app.py"} & {p.name for p in site.iterdir()}
    made_elsewhere = tmp_path / "made-elsewhere.duckdb"
    with store.RunWriter.start(made_elsewhere, "from-another-env") as w:
        for step in range(1, 6):
            w.log(step, {"loss": 3.0 / step})
    info = _run([rw, "info", made_elsewhere], cwd=elsewhere, env=env)
    assert "from-another-env" in info.stdout
    _serves(venv, made_elsewhere, elsewhere)
    bad = _run([rw, "dashboard", "--dbb", "x"], cwd=elsewhere, env=env, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--dbb" in bad.stderr

    # Stage 2: torch added (as a user's own build would be), then their own loop.
    _pip_install(py, "torch==2.13.0", cwd=elsewhere)
    example = elsewhere / "own_loop.py"
    shutil.copy(REPO / "examples" / "own_loop.py", example)
    _run([py, example, "runs.duckdb"], cwd=elsewhere, env=env, timeout=300)
    info = _run([rw, "info", "runs.duckdb"], cwd=elsewhere, env=env)
    assert "own-loop" in info.stdout and "finished" in info.stdout, info.stdout
    _serves(venv, elsewhere / "runs.duckdb", elsewhere)
    # the framework integrations are extras: without them everything else imports, and theirs
    # say what to install
    frameworks = ("lightning", "pytorch_lightning", "transformers")
    _run(
        [
            py,
            "-c",
            "import sys, rampwatch.monitor, rampwatch.integrations, rampwatch.trainer; "
            f"assert not set({frameworks!r}) & set(sys.modules), sys.modules.keys()",
        ],
        cwd=elsewhere,
        env=env,
    )
    for extra in ("lightning", "transformers"):
        missing = _run(
            [py, "-c", f"import rampwatch.integrations.{extra}"],
            cwd=elsewhere,
            env=env,
            check=False,
        )
        assert missing.returncode == 1 and f"pip install 'rampwatch[{extra}]'" in missing.stderr

    # Stage 3: a DuckDB older than the file's writer, as in a stale dashboard environment.
    _pip_install(py, "--no-deps", "duckdb==1.5.6", cwd=elsewhere)
    old = _run([rw, "info", "runs.duckdb"], cwd=elsewhere, env=env, check=False)
    assert old.returncode == 2 and old.stderr.count("\n") == 1, old.stderr
    assert "was written by DuckDB 2.0.1" in old.stderr and "duckdb 1.5.6" in old.stderr
    assert "pip install 'duckdb==2.0.1'" in old.stderr
