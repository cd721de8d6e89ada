"""`rampwatch plan` as a user runs it: a real subprocess, table, JSON, and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.procs import rampwatch_command

BASE = ["--capacity-gb", "141", "--seq-len", "2048", "--per-device-batch", "16", "--accum", "16"]
MEASURED = ["--measured", "16:70", "--measured", "32:130"]


def run(*args: str) -> subprocess.CompletedProcess:
    return rampwatch_command("plan", *args, timeout=60)


def test_table_for_people():
    p = run(*MEASURED, *BASE, "--noise-scale", "600")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert (
        "current: per-device 16 × accum 16 × world 1 = 256 sequences (524,288 tokens/step)" in out
    )
    assert "measured line (2 points)" in out and "usable 133.9 GB of 141.0 GB" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith("×")]
    assert len(rows) == 3
    assert rows[0].split()[:8] == ["×2", "32", "16", "1,048,576", "130.0", "GB", "yes", "1.414"]
    assert "steps saved" in out and "warning: batch 1024 exceeds the gradient noise scale" in out


def test_json_for_scripts():
    p = run(*MEASURED, *BASE, "--json", "--noise-scale", "256", "--optimizer", "SGD")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["memory_model"]["bytes_per_sequence"] == pytest.approx(3.75e9)
    assert doc["lr_rule"] == "linear"
    tiers = doc["tiers"]
    assert [(t["factor"], t["per_device_batch"], t["accum"], t["fits"]) for t in tiers] == [
        (2, 32, 16, True),
        (4, 32, 32, True),
        (8, 32, 64, True),
    ]
    assert [t["lr_multiplier"] for t in tiers] == [2.0, 4.0, 8.0]
    assert tiers[0]["tokens_per_step"] == 1 << 20
    # at B = B_noise = 256 a doubling saves 25% of the steps for 50% more examples
    assert tiers[0]["effect"]["step_savings"] == pytest.approx(0.25)
    assert tiers[0]["effect"]["example_cost"] == pytest.approx(0.5)


def test_json_reports_a_tier_that_cannot_fit():
    # 10 GB + 3.75 GB/sequence; 12 GB card (11.4 GB usable) and the running 16 ran out of memory
    p = run(
        *MEASURED,
        "--capacity-gb",
        "12",
        "--seq-len",
        "2048",
        "--per-device-batch",
        "16",
        "--infeasible",
        "16",
        "--factors",
        "2",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    (t,) = json.loads(p.stdout)["tiers"]
    assert (t["fits"], t["per_device_batch"], t["accum"]) == (False, 1, 32)
    assert (
        t["reason"]
        == "even per-device batch 1 needs 13.8 GB > 11.4 GB usable (known to run out of memory: 16)"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--measured", "16x", *BASE], "expected BATCH:GB such as 16:70.5, got '16x'"),
        (["--measured", "16:-3", *BASE], "expected a positive number, got '-3'"),
        (
            ["--measured", "0:70", "--measured", "32:130", *BASE],
            "expected a positive integer, got '0'",
        ),
        ([*BASE], "no memory data: pass --measured BATCH:GB"),
        (["--measured", "16:70", *BASE], "one measured peak"),
        ([*MEASURED, *BASE, "--margin", "1.5"], "fraction in [0, 1)"),
        ([*MEASURED, *BASE[:-2], "--accum", "0"], "argument --accum: expected a positive integer"),
        ([*MEASURED, *BASE, "--optimizer", "lion"], "pass --lr-rule sqrt, linear or none"),
        (["--measured", "16:70", "--measured", "16:71", *BASE], "per-device batch 16 twice"),
        ([*MEASURED, "--capacity-gb", "80"], "required without --db: --seq-len, --per-device"),
        ([*MEASURED, *BASE, "--run", "r"], "--run names a run of --db: pass --db DB too"),
        (["--db", "runs.duckdb", *MEASURED], "--db reads the tier, memory and policy from the"),
        (["--db", "/nonexistent/runs.duckdb"], "no Rampwatch database at /nonexistent/runs.duckdb"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    p = run(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("rampwatch plan: error:") and message in last, last
    assert p.stdout == ""
