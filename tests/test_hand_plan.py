"""advisor/hand_plan.py: the issue's plan read as the seed meant it (2M = 2 × 1,048,576 tokens
a step), points in %, tokens and steps placed on a run, one-line messages for bad plans, the
due step, and the plan's steps and hours counted as the projection's (advisor/schedule.py)."""

from __future__ import annotations

import math

import pytest

from rampwatch.advisor import schedule as S
from rampwatch.advisor.hand_plan import PlanError, format_batch, parse_plan, place
from rampwatch.advisor.throughput import MeasuredSpeed, ThroughputModel
from rampwatch.advisor.tiers import Tier

SEQ = 2048
SEED_BUDGET = 29_000 * 524_288  # the seed's run: 29,000 steps of 524,288 tokens


def test_the_issue_s_plan_reads_as_the_seed_meant_it():
    plan = place(parse_plan("2M → 4M at 70% → 8M at 90%"), SEQ, SEED_BUDGET, None, 0.0)
    assert plan.batches == (1024, 2048, 4096)  # 2M = 2,097,152 tokens = 1,024 × 2,048
    assert plan.starts == (0.0, 0.7 * SEED_BUDGET, 0.9 * SEED_BUDGET)
    assert [b for _, b in plan.points()] == [2 * 1024**2, 4 * 1024**2, 8 * 1024**2]
    assert plan.words().startswith("2M = 2,097,152 tokens (1,024 sequences) from the start; 4M")
    same = place(
        parse_plan("2097152 -> 4,194,304 at 70% -> 4096 seq at 90%"), SEQ, SEED_BUDGET, None, 0
    )
    assert (same.batches, same.starts) == (plan.batches, plan.starts)
    assert place(parse_plan("0.5M -> 1K seqs at 50 %"), SEQ, SEED_BUDGET, None, 0).batches == (
        256,
        1024,
    )


def test_points_in_tokens_and_in_steps_past_and_ahead():
    # a run at 2K tokens a step (16 × 128) that has logged steps 0..399
    run_steps = list(range(400))
    run_tokens = [(s + 1) * 2048 for s in run_steps]
    plan = place(
        parse_plan("2K → 4K at 200 steps → 8K at 1.5M tokens → 16K at 1000 steps"),
        128,
        8_000_000,
        399,
        run_tokens[-1],
        run_steps,
        run_tokens,
    )
    at_1000 = 1.5e6 + (1000 - (399 + (1.5e6 - 819_200) / 4096)) * 8192
    # step 200 is past: where the run's tokens stood; step 1000 is ahead, reached from the
    # 1.5M point at the plan's 8K a step (which began ahead of now, after 4K from now)
    assert plan.starts == pytest.approx((0.0, 201 * 2048, 1.5e6, at_1000), rel=1e-12)
    assert plan.batches == (16, 32, 64, 128)


@pytest.mark.parametrize(
    "text,message",
    [
        ("2M → 4X at 70%", "plan step 2 ('4X at 70%'): '4X' is not a batch; write tokens per step"),
        ("2M -> 4M", "plan step 2 ('4M') has no point: write '4M at 70%'"),
        ("2M at 10% -> 4M at 70%", "plan step 1 ('2M at 10%'): the first step is the batch"),
        ("2M -> 4M at", "plan step 2 ('4M at'): nothing after 'at'; write '4M at 70%'"),
        ("2M -> 4M at 70", "plan step 2 ('4M at 70'): 'at 70' is no point; write 'at 70%'"),
        ("2M -> 4M at 120%", "plan step 2 ('4M at 120%'): 120% is outside the budget"),
        ("2M -> -> 4M at 5%", "plan step 2 is empty: an arrow with no batch beside it"),
        ("2M -> 4M at 70% -> 8M at 60%", "plan step 3 ('8M at 60%') starts at"),
        ("2M -> 4M at 20T tokens", "at or past the budget"),
        ("1.3M", "1,363,149 tokens a step is not a whole number of 2,048-token sequences (665.6)"),
        ("0 seq", "plan step 1 ('0 seq'): a batch of '0 seq' is no batch"),
        ("1.5 seq", "1.5 sequences is not a whole number"),
    ],
)
def test_a_bad_plan_gets_one_line_naming_the_step(text, message):
    with pytest.raises(PlanError) as e:
        place(parse_plan(text), SEQ, SEED_BUDGET, None, 0.0)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_an_empty_plan_is_no_plan():
    assert parse_plan("   ") == []
    with pytest.raises(PlanError, match="the plan has no steps"):
        place([], SEQ, SEED_BUDGET, None, 0)


def test_the_due_step_and_what_is_left():
    budget = 8_192_000
    plan = place(parse_plan("2K → 8K at 25% → 16K at 50%"), 128, budget, 399, 819_200)
    assert plan.starts == (0.0, 2_048_000, 4_096_000)
    assert plan.segments_from(819_200) == [(819_200, 16), (2_048_000, 64), (4_096_000, 128)]
    assert plan.due(819_200, 16) is None  # the plan says 2K now: the run runs it
    lead = 10 * 2048
    assert plan.due(2_048_000 - lead - 1, 16, lead) is None
    due = plan.due(2_048_000 - lead, 16, lead)  # within the lead of step 2's point
    assert (due.number, due.text, due.batch, due.start_tokens) == (2, "8K at 25%", 64, 2_048_000)
    assert plan.due(3_000_000, 64) is None  # taken: the run runs the plan's batch
    assert plan.due(3_000_000, 128) is None  # the run is past it: a plan never shrinks it


def test_a_plan_s_steps_and_hours_are_counted_like_the_projection_s():
    budget, now = 8_192_000, 819_200
    plan = place(parse_plan("2K → 8K at 25% → 16K at 50%"), 128, budget, 399, now)
    tiers = {16: Tier(8, 2), 64: Tier(32, 2), 128: Tier(32, 4)}
    tps = {16: 50_000.0, 64: 60_000.0, 128: 61_000.0}
    speeds = ThroughputModel.fit(
        {tiers[b]: MeasuredSpeed(tiers[b], tps[b], None, 10) for b in tiers}, 128, 1
    )
    segs = [S.Segment(start, b, tiers[b]) for start, b in plan.segments_from(now)]
    s = S.walk("hand plan", segs, now, budget, 128, speeds)
    # 600 steps of 2,048 to 2,048,000, 250 of 8,192 to 4,096,000, 250 of 16,384 to the budget
    assert s.steps == (600, 250, 250) and s.steps_left == 1100
    assert s.seconds_left == pytest.approx(
        600 * 2048 / tps[16] + 250 * 8192 / tps[64] + 250 * 16384 / tps[128], rel=1e-12
    )
    const = S.walk("constant", segs[:1], now, budget, 128, speeds)
    assert const.steps_left == math.ceil((budget - now) / 2048) == 3600
    assert s.saved(const)[0] == 2500


def test_format_batch_writes_what_parse_reads():
    for tokens in (2048, 524_288, 1_048_576, 3 * 1024**2, 1000):
        [step] = parse_plan(format_batch(tokens))
        assert step.tokens_per_step == tokens
    assert (format_batch(524_288), format_batch(2 * 1024**2), format_batch(1000)) == (
        "512K",
        "2M",
        "1,000",
    )
