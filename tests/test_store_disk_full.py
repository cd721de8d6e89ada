"""A full disk (RLIMIT_FSIZE in a real child process: every spool write past the limit fails,
part-way through a record or line): the spool stays readable, what log() accepted lands once
there is room again, events held meanwhile land too, and the drops are an alert on the run."""

from __future__ import annotations

import resource
import signal
import subprocess

import pytest

from rampwatch import store
from tests.procs import kill_group
from tests.store_child import metric, value
from tests.store_helpers import Lines

pytestmark = pytest.mark.timeout(180)

METRICS, PER_PHASE = 4, 600  # 600 steps x 160 bytes: the 64 KiB limit hits mid-record


def _limits_allow() -> str | None:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < 1 << 30:
        return f"RLIMIT_FSIZE hard limit is {hard}: the child could not lift its limit again"
    if not hasattr(signal, "SIGXFSZ"):
        return "no SIGXFSZ on this platform"
    return None


@pytest.mark.parametrize("exit_mode", ["close", "killed"])
def test_a_full_disk_loses_only_what_log_refused(procs, db_path, exit_mode):
    why = _limits_allow()
    if why:
        pytest.skip(why)
    child = procs.spawn(
        [
            "tests/store_child.py",
            "diskfull",
            str(db_path),
            "--run-id",
            "full",
            "--metrics",
            str(METRICS),
            "--last",
            str(PER_PHASE),
            "--exit-mode",
            "close" if exit_mode == "close" else "wait",
        ],
        stdout=subprocess.PIPE,
    )
    out = Lines(child)
    if exit_mode == "close":
        assert child.wait(timeout=120) == 0
        assert "CLOSED True" in out.finish()
    else:
        out.wait_for("WAITING", timeout=120)
        kill_group(child)  # killed after the disk had room again, before any flush
        out.finish()
        store.recover(db_path)
    lines = out.lines
    acked = [int(x[4:]) for x in lines if x and x.startswith("ACK ")]
    dropped = [int(x[5:]) for x in lines if x and x.startswith("DROP ")]
    assert dropped and all(s < PER_PHASE for s in dropped), "the limit never hit"
    assert len(acked) > PER_PHASE  # the whole second phase was accepted
    rows = {(r["step"], r["name"]): r["value"] for r in store.export(db_path, "full").to_pylist()}
    want = {(s, metric(j)): value(1, s, j) for s in acked for j in range(METRICS)}
    assert rows == want, f"{len(rows)} rows, want {len(want)}"
    run = store.get_run(db_path, "full")
    events = {e.message.split(" x")[0] for e in store.events(db_path, "full", kinds=["tick"])}
    sent = {x[6:] for x in lines if x and x.startswith("EVENT ")}
    if exit_mode == "close":
        assert run.stored_status == "finished"
        assert events == sent  # held in memory while the disk was full, then written
        (alert,) = store.events(db_path, "full", kinds=["alert"])
        assert alert.data["dropped"] == METRICS * len(dropped), alert.data
        assert "File too large" in alert.message or "No space" in alert.message, alert.message
    else:  # what reached the spool landed; the run is killed, not lost
        assert run.stored_status == "killed"
        assert {e for e in sent if e.startswith("room")} <= events
