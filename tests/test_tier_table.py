"""The tier table (advisor/tier_table.py) on the card and in `rampwatch plan --db`: issue 27's
seed case — one H200, 16 × 16 and 32 × 16 measured, 64 and 128 out of memory — written through
the real RunWriter, must read as the seed concluded: the same tokens/s, half the steps, an ETA
within a few percent, and 64 and 128 per device as rows of their own, out of memory. Then a run
with one measured per-device batch and no budget: its unknowns are written as such; and a
per-device batch the memory model predicts to fit gets its row with its predicted peak."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess

import pytest

from rampwatch.advisor.advice import RunningTier, advise, memory_evidence
from rampwatch.advisor.memory import GB
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.throughput import RECENT, MeasuredSpeed, ThroughputModel
from rampwatch.advisor.tier_table import cells, tier_rows
from rampwatch.advisor.tiers import Tier
from tests import seed
from tests.procs import rampwatch_command

SEED_STEPS = 40  # per tier: 40 at 16 × 16, then 40 at 32 × 16


@pytest.fixture
def h200(db_path):
    run = seed.h200_run(db_path, steps_per_tier=SEED_STEPS)
    yield run
    run.close()


def _card_table(at) -> dict[str, dict]:
    [table] = [d.value for d in at.dataframe if "tokens/s (K)" in d.value.columns]
    return {row["tier"]: dict(row) for _, row in table.iterrows()}


def _plan(*args: str) -> subprocess.CompletedProcess:
    return rampwatch_command("plan", *args)


def _assert_reads_as_the_seed(rows: dict[str, dict]) -> None:
    """The two measured tiers as the seed table has them, from the card's or the CLI's cells."""
    now, before = rows["▶ now: 32 × 16"], rows["ran: 16 × 16"]
    tps32, tps16 = float(now["tokens/s (K)"]), float(before["tokens/s (K)"])
    assert tps32 == pytest.approx(135, rel=0.02) and tps16 == pytest.approx(129, rel=0.02)
    assert tps32 / tps16 == pytest.approx(1.0, abs=0.06)  # the same throughput, within 6%
    assert float(now["MFU (%)"]) == pytest.approx(65, abs=1.5)
    assert float(before["MFU (%)"]) == pytest.approx(62, abs=1.5)
    assert float(now["step time (s)"]) == pytest.approx(7.8, rel=0.03)
    assert float(before["step time (s)"]) == pytest.approx(4.1, rel=0.03)
    assert (now["tokens/step"], before["tokens/step"]) == ("1,048,576", "524,288")
    assert (now["steps (run)"], before["steps (run)"]) == ("14,500", "29,000")  # from step 0
    # what is left after 40 + 40 steps = 120 steps of 524,288 tokens
    assert (now["steps left"], before["steps left"]) == ("14,440", "28,880")
    eta32, eta16 = float(now["ETA (h)"]), float(before["ETA (h)"])
    assert eta32 == pytest.approx(31, abs=0.7) and eta16 == pytest.approx(33, abs=0.7)
    assert 0.90 < eta32 / eta16 < 1.0  # half the steps, the wall time barely moves
    assert (before["peak measured (GB)"], now["peak measured (GB)"]) == ("54.0 (38%)", "93.0 (66%)")
    # each tier's last RECENT timed steps of the 40 it ran
    assert now["throughput from"] == f"measured: median of its last {RECENT} steps"
    assert before["throughput from"] == f"measured: median of its last {RECENT} steps"
    assert (now["LR ×"], before["LR ×"]) == ("1.000", "0.707")
    double = rows["×2: 32 × 32"]  # 64 per device ran out of memory: ×2 is accumulation only
    assert "per-device 64 ran out of memory before" in double["why"]
    assert double["steps (run)"] == "7,250"
    assert float(double["tokens/s (K)"]) == pytest.approx(tps32, abs=0.11)  # the same b, a model
    assert double["throughput from"] == "model: per-device batch 32 as measured"
    for b, steps, lr in (("64", "7,250", "1.414"), ("128", "3,625", "2.000")):
        oom = rows[f"per-device {b}: {b} × 16"]  # at the running accumulation
        assert (oom["status"], oom["peak measured (GB)"]) == ("does not fit", "OOM")
        assert (oom["why"], oom["steps (run)"], oom["LR ×"]) == ("ran out of memory", steps, lr)
        assert (oom["tokens/s (K)"], oom["ETA (h)"]) == ("unknown", "unknown")  # it cannot run


def test_the_seed_case_on_the_card(h200, monkeypatch):
    at = seed.app(monkeypatch, h200.db)
    assert not at.exception
    rows = _card_table(at)
    assert list(rows) == [
        "▶ now: 32 × 16",
        "×2: 32 × 32",
        "×4: 32 × 64",
        "×8: 32 × 128",
        "ran: 16 × 16",
        "per-device 64: 64 × 16",
        "per-device 128: 128 × 16",
    ]
    _assert_reads_as_the_seed(rows)
    assert "per-step overhead taken as 0" in seed.texts(at)  # what the model assumes, said


def test_the_seed_case_in_rampwatch_plan(h200):
    p = _plan("--db", str(h200.db))
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"run {h200.run_id}: now 32 per device × 16 accumulation")
    [head] = [i for i, line in enumerate(lines) if line.startswith("tier ")]
    columns = re.split(r"\s{2,}", lines[head].strip())
    rows = {}
    for line in lines[head + 1 :]:
        if not line.strip():
            break
        values = re.split(r"\s{2,}", line.strip())
        rows[values[0]] = dict(zip(columns, values, strict=True))
    assert len(rows) == 7
    _assert_reads_as_the_seed(rows)
    doc = json.loads(_plan("--db", str(h200.db), "--run", h200.run_id, "--json").stdout)
    by_tier = {(t["kind"], t["per_device_batch"], t["accum"]): t for t in doc["tiers"]}
    assert by_tier[("now", 32, 16)]["total_steps"] == 14_500
    assert by_tier[("ran", 16, 16)]["total_steps"] == 29_000
    assert by_tier[("ran", 16, 16)]["eta_s"] / 3600 == pytest.approx(33, abs=0.7)
    missing = _plan("--db", str(h200.db), "--run", "nope")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("rampwatch plan: error: no run 'nope' in ")
    assert len(missing.stderr.splitlines()) == 1


def test_the_card_and_the_cli_show_the_same_cells(h200, monkeypatch):
    card = _card_table(seed.app(monkeypatch, h200.db))
    doc = json.loads(_plan("--db", str(h200.db), "--json").stdout)
    kinds = [t["kind"] for t in doc["tiers"]]
    assert kinds == ["now", "×2", "×4", "×8", "ran", "per-device 64", "per-device 128"]
    assert doc["tiers"][0]["tokens_per_s"] / 1e3 == pytest.approx(
        float(card["▶ now: 32 × 16"]["tokens/s (K)"]), abs=0.051
    )


def test_unknowns_are_written_as_such(db_path, monkeypatch):
    """The seeded live run: 8 × 2 measured only, a memory plan, no token budget."""
    run = seed.live_run(db_path)
    try:
        at = seed.app(monkeypatch, db_path)
        rows = _card_table(at)
        now, four = rows["▶ now: 8 × 2"], rows["×4: 32 × 2"]
        assert now["throughput from"] == f"measured: median of its last {RECENT} steps"
        assert float(now["tokens/s (K)"]) == pytest.approx(50.5, abs=0.5)
        assert (four["tokens/s (K)"], four["MFU (%)"], four["ETA (h)"]) == ("unknown",) * 3
        assert four["throughput from"].startswith("unknown: only per-device batch 8 was measured")
        assert now["steps left"] == "unknown" and now["peak measured (GB)"] == "25.6 (32%)"
        assert rows["×2: 8 × 4"]["throughput from"] == "model: per-device batch 8 as measured"
        assert "run records no token budget" in seed.texts(at)
        assert not any("nan" in str(v).lower() for r in rows.values() for v in r.values())
    finally:
        run.close()


def test_steps_left_stop_at_zero_and_round_up():
    """The row arithmetic: ceil(budget / tokens per step) from step 0, ceil of what is left."""
    cur = RunningTier(Tier(4, 2), seq_len=100, capacity_bytes=80 * GB)
    policy = RampPolicy(original_batch=8, original_lr=1e-3)
    memory = memory_evidence([{"per_device_batch": 4, "measured_bytes": 10 * GB}], "plain")
    advice = advise(policy, cur, [], [], None, memory, since_step=None)
    speeds = ThroughputModel.fit({cur.tier: MeasuredSpeed(cur.tier, 800.0, None, 9)}, 100, 1)
    [now, *_] = tier_rows(advice, speeds, tokens_seen=500, total_tokens=1_001)
    assert (now.total_steps, now.steps_left) == (2, 1)  # 1,001 / 800; 501 / 800
    assert now.eta_s == pytest.approx(1.0)  # one step of 800 tokens at 800 tokens/s
    [done, *_] = tier_rows(advice, speeds, tokens_seen=5_000, total_tokens=1_001)
    assert done.steps_left == 0 and cells(done)["ETA (h)"] == "0.00"
    assert cells(done)["base LR"] == "0.001"  # the run's first batch: its own LR
    one_size = dataclasses.replace(now, tier=Tier(8, 1))  # accumulation 1 on one device
    assert cells(one_size)["why"].endswith("measures no noise scale (one batch size per step)")
    assert "noise scale" not in cells(now)["why"]


def test_per_device_batches_predicted_to_fit_get_rows():
    """4 × 8 running, 2 and 4 measured (a line: 2 GB + 2 GB per sequence): at accumulation 8,
    per-device 8 and 16 are predicted to fit, 32 × 8 is the ×8 tier already, 64 needs 130 GB."""
    cur = RunningTier(Tier(4, 8), seq_len=100, capacity_bytes=80 * GB)
    policy = RampPolicy(original_batch=32, original_lr=1e-3)
    peaks = [{"per_device_batch": b, "measured_bytes": (2 + 2 * b) * GB} for b in (2, 4)]
    advice = advise(policy, cur, [], [], None, memory_evidence(peaks, "plain"), since_step=None)
    speeds = ThroughputModel.fit({cur.tier: MeasuredSpeed(cur.tier, 3_200.0, None, 9)}, 100, 1)
    rows = tier_rows(advice, speeds, tokens_seen=0, total_tokens=128_000)
    assert [r.label for r in rows] == [
        "now: 4 × 8",
        "×2: 32 × 2",
        "×4: 32 × 4",
        "×8: 32 × 8",
        "per-device 2: 2 × 8",
        "per-device 8: 8 × 8",
        "per-device 16: 16 × 8",
    ]
    small, eight, sixteen = (cells(r) for r in rows[-3:])
    assert (small["why"], small["peak measured (GB)"]) == ("measured in this run", "6.0 (8%)")
    assert (eight["status"], eight["peak predicted (GB)"]) == ("fits", "18.0 (22%)")
    assert eight["why"] == f"predicted 18.0 GB <= {advice.usable_bytes / GB:.1f} GB usable"
    assert (eight["peak measured (GB)"], eight["steps (run)"]) == ("unknown", "20")  # 6,400/step
    assert sixteen["peak predicted (GB)"] == "34.0 (42%)" and sixteen["LR ×"] == "2.000"
    assert rows[-1].new_base_lr == pytest.approx(policy.new_base_lr(128))
