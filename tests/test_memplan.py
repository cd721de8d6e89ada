"""trainer/gpt_plan.py: the fake-tensor memory plan, its breakdown, its child process, and the
plan's slope against a real CPU measurement (VmHWM of fresh processes, bench/memplan_bench.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from rampwatch.trainer.config import PRESETS, count_params
from rampwatch.trainer.gpt_plan import (
    COMPONENTS,
    calibrate,
    plan_in_process,
    plan_points,
    start_plan,
)

TINY = PRESETS["test-tiny"].to_dict()
# A head-heavy shape: vocab 4096 makes the (b·T, V) fp32 logits the biggest tensors, and a chunk
# of 64 tokens is an eighth of one sequence.
WIDE = dict(
    vocab_size=4096,
    tokenizer="bpe",
    n_layer=1,
    n_head=2,
    d_model=64,
    seq_len=128,
    ce_chunk_tokens=64,
)


def _rows(cfg, batches, variants=("plain",), **kw):
    rows = plan_in_process(cfg, batches, "adamw", "cpu", variants, **kw)
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    return rows


def test_plan_grows_with_batch_and_breakdown_sums_to_peak():
    rows = _rows(TINY, [1, 2, 4])
    peaks = [r["predicted_bytes"] for r in rows]
    assert peaks[0] < peaks[1] < peaks[2]
    # Activations are linear in the batch: the step from 2 to 4 is twice the step from 1 to 2.
    assert (peaks[2] - peaks[1]) == pytest.approx(2 * (peaks[1] - peaks[0]), rel=0.02)
    n = count_params(PRESETS["test-tiny"])["total"]
    for r in rows:
        bd = r["breakdown"]
        assert set(bd) == set(COMPONENTS)
        assert sum(bd.values()) == r["predicted_bytes"]  # taken at one moment: exact
        assert all(v >= 0 for v in bd.values())
        # fp32 weights plus the rotary tables (a buffer of 2·T·head_dim/2 floats)
        assert bd["parameters"] == 4 * n + 2 * 4 * 128 * 16
        # AdamW: exp_avg and exp_avg_sq per weight, plus a scalar step per tensor
        assert 8 * n <= bd["optimizer"] < 8 * n + 1024
        assert bd["gradients"] <= 4 * n
        # Between steps live the weights, their optimizer state and the batch itself.
        batch_bytes = 2 * 8 * r["per_device_batch"] * 128
        assert r["steady_bytes"] == bd["parameters"] + bd["optimizer"] + batch_bytes
        assert r["peak_phase"] in ("forward", "backward", "optimizer")


def test_accumulation_plans_a_backward_into_existing_gradients():
    one, acc = _rows(TINY, [2]), _rows(TINY, [2], accum_steps=4)
    n = count_params(PRESETS["test-tiny"])["total"]
    assert acc[0]["breakdown"]["gradients"] == 4 * n  # all of them exist during the backward
    assert acc[0]["predicted_bytes"] > one[0]["predicted_bytes"]


def test_chunked_cross_entropy_shrinks_the_logits():
    b, T, V = 4, WIDE["seq_len"], WIDE["vocab_size"]
    plain, chunked = _rows(WIDE, [b], variants=("plain", "chunked"))
    fp32_logits = b * T * V * 4
    # Plain: the fp32 logits and their gradient (at least) are alive at the peak.
    assert plain["breakdown"]["logits"] >= 2 * fp32_logits
    # Chunked: a chunk of 64 tokens at a time, plus dW (V, d) and dh (b·T, d) kept for backward.
    assert chunked["breakdown"]["logits"] < plain["breakdown"]["logits"] / 3
    assert chunked["predicted_bytes"] < plain["predicted_bytes"]
    # Nothing else changes: same parameters, optimizer state, trunk.
    for k in ("parameters", "optimizer"):
        assert chunked["breakdown"][k] == plain["breakdown"][k]


def test_bad_requests_become_error_rows_not_exceptions():
    bad = dict(TINY, n_head=3)  # 128 is not divisible into 3 heads: ModelConfig refuses
    rows = plan_in_process(bad, [1, 2], "adamw", "cpu", ("plain",))
    assert [r["per_device_batch"] for r in rows] == [1, 2]
    assert all(r["predicted_bytes"] is None and "head" in r["error"] for r in rows)
    rows = plan_in_process(TINY, [1], "adamw", "cpu", ("plain", "fused"))
    assert rows[0]["error"] is None and "fused" in rows[1]["error"]
    rows = plan_in_process(TINY, [1], "lion", "cpu", ("plain",))
    assert "lion" in rows[0]["error"]


def test_plan_in_a_child_process_returns_while_the_parent_keeps_stepping():
    handle = start_plan(TINY, [1, 2], "adamw", "cpu", variants=("plain",))
    assert not handle.done()  # start_plan returned before the plan (seconds of work) finished
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, deadline = 0, time.monotonic() + 240
    while not handle.done() and time.monotonic() < deadline:
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    rows = handle.result(timeout=10)
    assert steps > 0 and rows is not None
    assert [r["error"] for r in rows] == [None, None]
    # The child plans exactly what the parent would: fake tensors are deterministic.
    here = _rows(TINY, [1, 2])
    assert [r["predicted_bytes"] for r in rows] == [r["predicted_bytes"] for r in here]
    assert [r["breakdown"] for r in rows] == [r["breakdown"] for r in here]


def test_a_failed_or_cancelled_child_reports_errors():
    h = start_plan(dict(TINY, n_head=3), [1], "adamw", "cpu", variants=("plain",))
    rows = h.result(timeout=120)
    assert rows and rows[0]["predicted_bytes"] is None and rows[0]["error"]
    h = start_plan(TINY, [1, 2], "adamw", "cpu", variants=("plain", "chunked"))
    h.cancel()
    rows = h.result(timeout=30)
    assert len(rows) == 4 and all(r["error"] and r["predicted_bytes"] is None for r in rows)


def test_calibrate_anchors_the_plan_slope_on_one_measurement():
    rows = _rows(WIDE, [1, 2, 4], variants=("plain", "chunked"))
    plain = plan_points(rows, "plain")
    measured = {2: plain[2] + 300 * 2**20}  # e.g. a CUDA context and allocator slack
    cal = calibrate(rows, measured)
    by = {(r["per_device_batch"], r["variant"]): r["calibrated_bytes"] for r in cal}
    assert by[(2, "plain")] == measured[2]
    for b in (1, 4):  # the plan's slope, shifted by the measured constant
        assert by[(b, "plain")] == pytest.approx(plain[b] + 300 * 2**20, rel=0.01)
    chunked = plan_points(rows, "chunked")
    for b in (1, 2, 4):  # what chunking saves stays the plan's figure
        assert by[(b, "chunked")] == pytest.approx(by[(b, "plain")] - plain[b] + chunked[b], abs=1)


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux clear_refs"
)
def test_plan_slope_matches_real_cpu_peak():
    from bench.memplan_bench import compare

    res = compare(TINY, [2, 4, 8], "adamw", ("plain",))["variants"]["plain"]
    # Measured to 0.1% on cpu-tiny (bench/memplan_bench.py); 10% leaves room for allocators.
    assert res["slope_planned"] == pytest.approx(res["slope_measured"], rel=0.10)
    for b, planned in res["planned"].items():
        assert planned == pytest.approx(res["measured"][b]["step_bytes"], rel=0.15)
