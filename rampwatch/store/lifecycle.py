"""Process-wide hooks of the writers: atexit, SIGTERM and fork.

Owns what happens to a process's open RunWriters when the process ends or forks: at exit each
is closed (finished, or failed after an uncaught exception); on SIGTERM each flushes and,
when SIGTERM would kill the process, is closed as killed before the default action runs (a
handler the program installed first is chained and decides); in a forked child the writers
refuse to log. The SIGTERM handler is installed once, from the main thread only.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rampwatch.store.writer import RunWriter


def status_for(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, KeyboardInterrupt):
        return "killed", "interrupted (KeyboardInterrupt)"
    return "failed", f"{type(exc).__name__}: {exc}"


_writers: list[RunWriter] = []
_hooks_lock = threading.RLock()  # RLock: the SIGTERM handler may interrupt register()
_atexit_done = False
_sigterm_prev = None
_sigterm_installed = False


def register(w: RunWriter, handle_sigterm: bool) -> None:
    global _atexit_done, _sigterm_prev, _sigterm_installed
    with _hooks_lock:
        _writers.append(w)
        if not _atexit_done:
            atexit.register(_at_exit)
            _atexit_done = True
        # Python runs signal handlers in the main thread only, and only it may install one.
        if (
            handle_sigterm
            and not _sigterm_installed
            and threading.current_thread() is threading.main_thread()
        ):
            _sigterm_prev = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)
            _sigterm_installed = True


def unregister(w: RunWriter) -> None:
    with _hooks_lock:
        if w in _writers:
            _writers.remove(w)


def _at_exit() -> None:
    # An uncaught exception was printed (sys.last_value set) before atexit handlers run.
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    for w in list(_writers):
        if w.started_here:
            if exc is None:
                w.close("finished", "process exited without closing the writer")
            else:
                w.close(*status_for(exc))


def _on_sigterm(signum, frame) -> None:
    prev = _sigterm_prev
    dies = prev in (None, signal.SIG_DFL)
    for w in list(_writers):
        if not w.started_here:
            continue
        if dies:
            w.close("killed", "terminated by SIGTERM", timeout=min(5.0, w.lock_timeout))
        else:  # the program handles SIGTERM itself (e.g. checkpoints, then exits): just flush
            w.flush(timeout=min(5.0, w.lock_timeout))
    if callable(prev):
        prev(signum, frame)
    elif dies:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _after_fork_in_child() -> None:
    # The child inherits copies of the writers but not their flusher threads or spool locks;
    # they refuse to log there, and the child must not close them (or flush) at exit.
    global _hooks_lock
    for w in _writers:
        w.disown_in_forked_child()
    _writers.clear()
    _hooks_lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
