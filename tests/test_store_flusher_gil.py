"""The flusher and a loop that holds the GIL: visits shorten the switch interval, finish while the
loop spins, and give the interval back (store/flusher.py's module docstring says why)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from rampwatch import store
from rampwatch.store import flusher

pytestmark = pytest.mark.timeout(120)

USER_INTERVAL = 0.004  # not the interpreter's default, so a restore to 5 ms would show


@pytest.fixture
def user_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(USER_INTERVAL)
    yield
    sys.setswitchinterval(before)


def test_the_interval_is_short_while_any_visit_runs_then_restored(user_interval):
    inside, release = threading.Event(), threading.Event()

    def other_writers_visit():
        with flusher.prompt_handoffs():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=other_writers_visit)
    other.start()
    assert inside.wait(10)
    with flusher.prompt_handoffs():
        assert sys.getswitchinterval() == pytest.approx(flusher.VISIT_SWITCH_INTERVAL)
    # the other visit still runs: still short
    assert sys.getswitchinterval() == pytest.approx(flusher.VISIT_SWITCH_INTERVAL)
    release.set()
    other.join()
    assert sys.getswitchinterval() == pytest.approx(USER_INTERVAL)


def test_an_interval_set_during_a_visit_is_kept(user_interval):
    with flusher.prompt_handoffs():
        sys.setswitchinterval(0.002)  # the loop's own choice, made while a visit ran
    assert sys.getswitchinterval() == pytest.approx(0.002)


def _spin(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


def test_visits_finish_while_the_loop_holds_the_gil(db_path):
    """log() every 200 µs, spinning in Python in between: the loop lets go of the GIL only in
    log()'s write. At the interpreter's 5 ms interval a visit took 11.7 s here (no visit in 30 s
    on a quiet machine is the failure); with the short interval, about 0.1 s."""
    w = store.RunWriter.start(db_path, run_id="spin", flush_interval=0.2, lock_timeout=60)
    w.log(0, {"warm": 1.0})
    assert w.flush()  # the first visit's imports happen here, not under the spin
    before, step, deadline = w.flushes, 1, time.monotonic() + 30
    while w.flushes < before + 3 and time.monotonic() < deadline:
        w.log(step, {"a": float(step), "b": 2.0})
        step += 1
        _spin(200)
    visits = w.flushes - before
    assert w.close()
    assert visits >= 3, f"{visits} visits in 30 s of a loop holding the GIL ({step} steps)"
    assert store.reader.export(db_path, "spin").num_rows == 1 + 2 * (step - 1)  # none lost
