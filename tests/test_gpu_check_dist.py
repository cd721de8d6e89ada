"""The NCCL part of the GPU check (bench/gpu_check_dist.py) in its CPU smoke run: two gloo ranks
under torchrun train test-tiny under DDP and under FSDP2 into one real database. Shown: the
tables come out, the exit is 0, every printed noise-scale row agrees within float32 rounding,
and so do the two runs' rows in the database itself; the memory table has both wrappings and
the plan's figure for DDP only; the check fails on a difference it should catch, and says so
outside torchrun; scripts/gpu_check.sh without 2 GPUs says the NCCL part was skipped and why.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bench import gpu_check_dist as check
from rampwatch import store
from rampwatch.store import names as M
from tests.procs import REPO, child_env, kill_group, spawn, torchrun

pytestmark = pytest.mark.slow

CELLS = re.compile(r"(?<!\\)\|")  # a markdown cell border, not an escaped \| inside a cell


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(exit status, output, database) of one torchrun of the CPU smoke run."""
    db = tmp_path_factory.mktemp("gpucheck") / "runs.duckdb"
    proc = spawn(
        torchrun("-m", "bench.gpu_check_dist", "--cpu-smoke", "--db", str(db)),
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError("the smoke run did not finish within 150 s") from None
    return proc.returncode, out.decode(), db


def _rows(out: str, header_start: str) -> list[list[str]]:
    """The body rows (cells, stripped) of the markdown table whose header starts so."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in CELLS.split(line)[1:-1]])
    return rows


def test_the_tables_come_out_and_the_exit_is_0(smoke):
    code, out, _ = smoke
    assert code == 0, out[-4000:]
    assert "### GPU check, NCCL part: `test-tiny` on 2 × CPU, gloo" in out
    assert "DDP and FSDP2 agree" in out
    assert _rows(out, "| wrapping | wall s")


def test_every_printed_noise_row_agrees_within_float32(smoke):
    """|G|² and tr(Σ) at every step, the per-step B_simple where |G|² > 0, the windowed one at
    step 3; each within 1e-4 on its points' scale."""
    _, out, _ = smoke
    rows = _rows(out, "| metric | step |")
    seen = {(r[0], int(r[1])) for r in rows}
    for step in (1, 2, 3):
        assert (r"\|G\|²", step) in seen and ("tr(Σ)", step) in seen
    assert ("B_simple window", 3) in seen
    assert any(r[0] == "B_simple" for r in rows)
    for metric, step, ddp, fsdp, _rel, scaled in rows:
        assert abs(float(scaled)) <= 1e-4, (metric, step, ddp, fsdp, scaled)
        if metric == "tr(Σ)":
            assert float(fsdp) == pytest.approx(float(ddp), rel=1e-4)


def test_the_database_holds_two_runs_that_log_the_same_noise_scale(smoke):
    """Read back from the database, not from the script's own table."""
    _, _, db = smoke
    runs = {r.name: r.run_id for r in store.list_runs(db)}
    assert sorted(runs) == ["gpu-check-dist ddp", "gpu-check-dist fsdp2"]
    ddp, fsdp = (check._per_step(db, runs[f"gpu-check-dist {w}"]) for w in ("ddp", "fsdp2"))
    assert sorted(ddp[M.LOSS]) == [1, 2, 3]
    for name in (M.GNS_G2, M.GNS_TRACE, M.GNS_RAW, M.GNS, M.LOSS):
        assert sorted(fsdp[name]) == sorted(ddp[name]), name
        for step, value in ddp[name].items():
            _, scaled = check._differences(name, value, fsdp[name][step], ddp[M.GNS_TRACE][step], 2)
            assert abs(scaled) <= 1e-4, (name, step)
    assert ddp[M.LOSS] == pytest.approx(fsdp[M.LOSS], rel=1e-5)


def test_the_memory_table_has_both_wrappings_and_the_plan_for_ddp_only(smoke):
    _, out, _ = smoke
    rows = {r[0]: r for r in _rows(out, "| wrapping | measured")}
    assert sorted(rows) == ["ddp", "fsdp2"]
    for r in rows.values():
        assert float(r[1]) > 0  # the logged peak RSS, MB
    assert float(rows["ddp"][3]) > 0  # the plan's replica prediction, MB
    assert rows["fsdp2"][3].startswith("measured only")


def test_a_difference_over_the_tolerance_fails_the_check(capsys):
    """The check is not vacuous: FSDP2's |G|² off by 1e-3 of its points' scale is caught."""
    ddp = {M.GNS_G2: {1: 0.01}, M.GNS_TRACE: {1: 6.0}, M.GNS_RAW: {1: 600.0}, M.GNS: {1: 600.0}}
    off = dict(ddp, **{M.GNS_G2: {1: 0.01 + 1e-3 * (0.01 + 6.0 / 2)}})
    assert check.noise_table({"ddp": ddp, "fsdp2": ddp}, 2, 1e-4) == []
    [bad] = check.noise_table({"ddp": ddp, "fsdp2": off}, 2, 1e-4)
    assert bad.startswith(r"\|G\|² step 1: +1.00e-03"), bad
    assert "missing" in check.noise_table({"ddp": ddp, "fsdp2": dict(ddp, **{M.GNS: {}})}, 2, 1)[0]
    capsys.readouterr()


def test_outside_torchrun_it_says_how_to_run_it(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert check.main(["--cpu-smoke"]) == 2
    assert "run it under torchrun" in capsys.readouterr().err


def test_the_device_check_script_says_the_nccl_part_was_skipped_without_2_gpus():
    """scripts/gpu_check.sh on a machine whose torch sees no GPU: part 1 says there is no CUDA
    device (exit 2), part 2 says why it was skipped."""
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=REPO,
        env=child_env(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_check: no CUDA device" in done.stderr
    assert "NCCL part skipped: torch sees 0 GPU(s); DDP vs FSDP2 needs 2 or more." in done.stdout
