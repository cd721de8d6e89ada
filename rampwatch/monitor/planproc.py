"""The child processes of the memory plan and the memory probe: how a user's setup crosses the
process boundary, the child's environment and its side of the protocol, and `PlanHandle`.

Owns: `setup_ref` / `resolve_setup` (a setup function <-> "package.module:function", or
"/path/script.py:function" for the running script, as multiprocessing's spawn does),
`check_setup` (what setup must return), `PlanHandle` (a child that never raises into the caller),
`child_main` (the child's side) and `error_row`. Used by monitor/memplan.py, monitor/memprobe.py
and trainer/gpt_plan.py (docs/ARCHITECTURE.md, "Memory model").

Protocol: the parent runs `python -m MODULE --request JSON --watch-parent PID` (one thread,
niced, its own session; it exits when its parent dies). The child writes one JSON row per line
on its standard output, as each row is ready; whatever the user's code prints goes to the
child's stderr instead. Rows that never came (a crash, a kill, a timeout, a cancel) become error
rows naming the reason, so the rows done before a failure are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

# The folder holding the rampwatch package (a checkout or site-packages): the child imports the
# very code the parent runs, whichever directory the parent was started from.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_SCRIPT_MODULE = "__rampwatch_main__"  # the running script, loaded in the child under this name


# -- setup references -----------------------------------------------------------------------


def setup_ref(setup: str | Callable) -> str:
    """The reference of `setup` that the child resolves: a "module:function" string is taken
    as it is; a function must be reachable by name from its module (pickle's rule: no lambda,
    closure or bound method). Raises ValueError saying what to do instead."""
    if isinstance(setup, str):
        if setup.count(":") != 1 or not all(setup.split(":")):
            raise ValueError(f"setup {setup!r}: expected 'package.module:function'")
        return setup
    mod, qual = getattr(setup, "__module__", None), getattr(setup, "__qualname__", None)
    bound = inspect.ismethod(setup) and not isinstance(setup.__self__, type)
    if not callable(setup) or not mod or not qual or "<" in qual or bound:
        raise ValueError(
            f"setup {setup!r} cannot cross a process boundary: pass a module-level "
            "function (not a lambda, a closure, a partial or an instance's method) "
            "or a 'package.module:function' string"
        )
    if mod == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise ValueError(
                f"setup {qual} is defined in an interactive session, which a child "
                "process cannot import: put it in a module (a .py file)"
            )
        owner, ref = sys.modules["__main__"], f"{os.path.abspath(path)}:{qual}"
    else:
        owner, ref = sys.modules.get(mod), f"{mod}:{qual}"
    if owner is not None and _lookup(owner, qual) is not setup:
        raise ValueError(
            f"setup {ref} names another object in its module (rebound or "
            "decorated): pass the module-level name itself"
        )
    return ref


def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def resolve_setup(ref: str | Callable) -> Callable:
    """The function a reference names (a callable is returned as it is). A module part ending
    in .py is a script: it is loaded under another name than __main__, so what its
    `if __name__ == "__main__":` block does (the training itself) does not run here."""
    if callable(ref):
        return ref
    mod, _, qual = setup_ref(ref).partition(":")
    if mod.endswith(".py"):
        module = sys.modules.get(_SCRIPT_MODULE)
        if module is None or getattr(module, "__file__", None) != mod:
            spec = importlib.util.spec_from_file_location(_SCRIPT_MODULE, mod)
            if spec is None or spec.loader is None:
                raise ImportError(f"no Python script at {mod}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[_SCRIPT_MODULE] = module
            sys.path.insert(0, os.path.dirname(mod))
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod)
    fn = _lookup(module, qual)
    if not callable(fn):
        raise ImportError(
            f"{mod} has no function {qual}"
            + (
                ' (what a script defines under `if __name__ == "__main__":` is not there for a '
                "child)"
                if mod.endswith(".py")
                else ""
            )
        )
    return fn


def check_setup(built: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Callable]:
    """setup(per_device_batch)'s result, checked: (model, optimizer, batch, train_step)."""
    ok = (
        isinstance(built, (tuple, list))
        and len(built) == 4
        and isinstance(built[0], torch.nn.Module)
        and isinstance(built[1], torch.optim.Optimizer)
        and callable(built[3])
    )
    if not ok:
        raise TypeError(
            "setup(per_device_batch) must return (model, optimizer, batch, "
            "train_step), with an nn.Module, a torch.optim.Optimizer and "
            f"train_step(model, optimizer, batch); got {type(built).__name__}"
        )
    return built[0], built[1], built[2], built[3]


def plan_row(
    b: int,
    variant: str,
    figures: dict,
    device_type: str,
    amp,
    accum_steps: int,
    started: float,
    **extra,
) -> dict:
    """A planned row: trace_step's figures and how they were planned (the row format of
    monitor/memplan.py); `started` is the time.perf_counter() the planning began at."""
    return {
        "per_device_batch": b,
        "variant": variant,
        **figures,
        **extra,
        "device_type": device_type,
        "amp": amp,
        "accum_steps": int(accum_steps),
        "seconds": round(time.perf_counter() - started, 3),
        "source": "plan",
        "error": None,
    }


def error_row(b, variant: str, device_type: str, msg: str, **extra) -> dict:
    """A row with no figures and the reason (the row format of monitor/memplan.py)."""
    return {
        "per_device_batch": b,
        "variant": variant,
        "predicted_bytes": None,
        "breakdown": None,
        "steady_bytes": None,
        "peak_phase": None,
        "device_type": device_type,
        "seconds": None,
        "error": msg,
        **extra,
    }


# -- parent side ----------------------------------------------------------------------------


def child_env(device_type: str) -> dict[str, str]:
    env = dict(os.environ)
    # The child must not compete with the loop for cores (it is single-threaded work anyway).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(_PACKAGE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if device_type.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        # A fake CUDA tensor makes a real 1-element tensor (a CUDA context) on the current
        # device: put it on the loop's GPU, not on GPU 0 of every rank.
        cur = torch.cuda.current_device()
        visible = env.get("CUDA_VISIBLE_DEVICES")
        parts = [p for p in visible.split(",") if p.strip()] if visible else []
        env["CUDA_VISIBLE_DEVICES"] = parts[cur] if cur < len(parts) else str(cur)
    return env


def _missing_as_errors(request: dict, rows: list[dict], error: str) -> list[dict]:
    """Default completion: every (batch, variant) asked for and not answered is an error row."""
    have = {(r.get("per_device_batch"), r.get("variant")) for r in rows}
    return rows + [
        error_row(b, v, request["device_type"], error)
        for b in request["batches"]
        for v in request.get("variants", ["plain"])
        if (b, v) not in have
    ]


class PlanHandle:
    """A plan (or probe) running in a child process. done() never blocks; result() returns rows
    (error rows for what the child did not answer: failed, timed out or cancelled) and never
    raises. `error` starts no child at all: result() reports it for every row."""

    def __init__(
        self,
        request: dict,
        timeout_s: float,
        module: str = "rampwatch.monitor.memplan",
        *,
        env: dict[str, str] | None = None,
        error: str | None = None,
        complete: Callable[[dict, list[dict], str], list[dict]] = _missing_as_errors,
    ):
        self.request, self.timeout_s, self._complete = request, timeout_s, complete
        self.what = "probe" if module.endswith("memprobe") else "planner"  # for the messages
        self.started = time.monotonic()
        self._rows: list[dict] = []
        self._error: str | None = error
        self._done = threading.Event()
        self.proc = None
        if error is not None:
            self._done.set()
            return
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module,
                    "--request",
                    json.dumps(request),
                    "--watch-parent",
                    str(os.getpid()),
                ],
                env=env or child_env(request["device_type"]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except Exception as e:  # noqa: BLE001
            self._error = f"could not start the {self.what}: {type(e).__name__}: {e}"
            self._done.set()
            return
        # communicate() in a thread drains both pipes (a chatty child cannot block on a full
        # pipe) while the caller's loop keeps stepping.
        threading.Thread(target=self._wait, name="memplan-wait", daemon=True).start()

    def _wait(self):
        out = err = b""
        try:
            out, err = self.proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._error = f"{self.what} timed out after {self.timeout_s:.0f} s"
            self.cancel()
            out, err = self.proc.communicate()
        except Exception as e:  # noqa: BLE001
            self._error = f"{self.what} wait failed: {type(e).__name__}: {e}"
        for line in out.decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    self._rows.append(row)
        if self._error is None and self.proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-5:]
            code = self.proc.returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            self._error = f"the {self.what} process {how}: " + (" | ".join(tail) or "no output")
        self._done.set()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[dict] | None:
        """Rows, or None if still running after `timeout` seconds (None: wait until done)."""
        if not self._done.wait(timeout):
            return None
        return self._complete(
            self.request,
            list(self._rows),
            self._error or f"the {self.what} finished without this row",
        )

    def cancel(self) -> None:
        """Kill the child (and anything it started); result() then reports an error."""
        if self.proc is not None and self.proc.poll() is None:
            self._error = self._error or f"{self.what} cancelled"  # before the kill wakes _wait
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)


def request_base(setup: str | Callable, batches: Sequence[int], device_type: str) -> dict:
    """The part of a plan or probe request naming the user's setup (setup_ref may raise)."""
    return {
        "setup": setup_ref(setup),
        "batches": [int(b) for b in batches],
        "device_type": device_type,
        "sys_path": [p for p in sys.path if isinstance(p, str)],
    }


# -- child side -----------------------------------------------------------------------------


def _watch_parent(pid: int) -> None:
    # An orphaned child would hold memory (and on CUDA, a context) for nothing.
    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != pid:
                os._exit(3)

    threading.Thread(target=loop, name="memplan-parent", daemon=True).start()


def child_main(
    argv: Sequence[str] | None,
    prog: str,
    run: Callable[[dict], Iterable[dict]],
    parser: argparse.ArgumentParser | None = None,
    from_args: Callable[[argparse.Namespace], dict] | None = None,
) -> int:
    """The child's side: read the request (`--request`, or `from_args` for a person at a
    terminal), write each row of run(request) as one JSON line on the real stdout."""
    ap = parser or argparse.ArgumentParser(prog=prog)
    ap.add_argument("--request", help="JSON request (what the parent sends)")
    ap.add_argument("--watch-parent", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.watch_parent:
        _watch_parent(a.watch_parent)
        with contextlib.suppress(OSError):
            os.nice(10)
    if a.request:
        req = json.loads(a.request)
    elif from_args is not None:
        req = from_args(a)
    else:
        ap.error("--request is required")
    for p in reversed(req.get("sys_path") or []):  # the parent's import path (spawn does too)
        if p not in sys.path:
            sys.path.insert(0, p)
    if not a.request:  # a person: one JSON list at the end
        json.dump(list(run(req)), sys.stdout)
        sys.stdout.write("\n")
        return 0
    # Rows go to the real stdout as each is ready; what the user's code prints goes to stderr.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for row in run(req):
        out.write(json.dumps(row) + "\n")
    out.close()
    return 0
