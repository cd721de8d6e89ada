"""Helpers for the store tests: reading a child process's output lines as they come."""

from __future__ import annotations

import subprocess
import threading
import time


class Lines:
    """Collects a child's stdout lines on a thread, so the test can wait for one."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self):
        for raw in self.proc.stdout:
            with self._cv:
                self.lines.append(raw.decode().rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self.lines.append(None)  # EOF
            self._cv.notify_all()

    def wait_for(self, prefix: str, timeout: float = 60.0) -> str:
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if line is None:
                        raise AssertionError(f"child ended before {prefix!r}: {self.lines[-20:]}")
                    if line.startswith(prefix):
                        return line
                left = end - time.monotonic()
                assert left > 0, f"no {prefix!r} within {timeout}s: {self.lines[-20:]}"
                self._cv.wait(left)

    def finish(self, timeout: float = 30.0) -> list[str]:
        self._t.join(timeout)
        return [line for line in self.lines if line is not None]
