"""The monitor's trial protocol, in one process against a real database: a loop that opted in
gets a checked trial request at a boundary, runs it through Monitor.run_trial and continues from
the kept arm; the events of the contract (docs: /work/notes/trial_contract.md) and the command's
'applied at continue_step' are recorded. A loop that did not opt in refuses a trial command at
the next boundary with the reason, and a factor that cannot run refuses the whole command. A
trial begun right after one that judged nothing keeps that one's failures (its cap), through a
resume too; a trial after one that could not tell asks for the held-out batch that would.
The step after a trial logs its own peak memory, not an arm's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rampwatch import Monitor
from rampwatch.advisor.gns_window import significant
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.trial import TrialVerdict
from rampwatch.store import commands, reader
from rampwatch.store import names as M
from rampwatch.store.errors import CommandError
from tests.procs import wait_for_ramp
from tests.trainer_runs import metric

N_EVAL = 64


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.3 * torch.randn(n, 1, generator=g)


def _loop(db, trials: bool, budget: int = 100_000, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = Monitor.start(
        db,
        name="trial-loop",
        config={"total_tokens": budget},
        model=model,
        optimizer=opt,
        per_device_batch=4,
        accum=2,
        seq_len=1,
        policy=RampPolicy(original_batch=8, original_lr=0.05, lr_rule="sqrt"),
        trials=trials,
        **kw,
    )
    return model, opt, mon


def _train(model, opt, mon, x, y, pos, step, batch=4, accum=2) -> int:
    for _ in range(accum):
        loss = torch.nn.functional.mse_loss(model(x[pos : pos + batch]), y[pos : pos + batch])
        (loss / accum).backward()
        mon.after_backward()
        pos += batch
    mon.step(step, loss=loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return pos


def _train_step(x, y):
    """The trial's train_step(model, opt, start, count): one optimizer step on those examples."""

    def train_step(model, opt, start, count):
        loss = torch.nn.functional.mse_loss(
            model(x[start : start + count]), y[start : start + count]
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


def _boundary(mon):
    """ramp_due then trial_due, polled until the flusher has claimed the command."""
    return wait_for_ramp(lambda: (mon.ramp_due(), mon.trial_due())[1], wait=True, timeout=30)


def _held_out_script():
    """script(*levels): held-out losses at the snapshot, Δ/2, the control's end, ×2, ×4, each
    level over the same examples' own losses, with per-example noise."""
    rng = np.random.default_rng(0)
    base = rng.gamma(2.0, 1.0, N_EVAL)

    def script(*levels, noise=1e-3):
        return [torch.as_tensor(base + v + rng.normal(0, noise, N_EVAL)) for v in levels]

    return script


def _scripted_trials(db, model, opt, mon, calls: list) -> list:
    """A ×2, ×4 trial command after every two steps, each judged on the scripted held-out losses
    (`calls`, taken in order); real training. Returns the outcomes, once each command ended."""
    x, y = _data(4000, 1)
    pos, last, outs = 0, 0, []
    while calls:
        for step in (last + 1, last + 2):
            pos = _train(model, opt, mon, x, y, pos, step)
        cid = commands.submit(db, mon.run_id, "trial", {"factors": [2, 4]}, actor="test")
        trial = _boundary(mon)
        out = mon.run_trial(trial, _train_step(x, y), lambda model: calls.pop(0), start=pos)
        pos += trial.delta_examples
        last = mon.trial_ended(out)
        outs.append(out)
        applied = lambda cid=cid: commands.get(db, cid).status == "applied" or None  # noqa: E731
        assert wait_for_ramp(applied, wait=True, timeout=30)
    mon.finish()
    return outs


def test_a_loop_that_runs_no_trials_has_a_trial_command_refused_with_its_reason(tmp_path):
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=False, trials_note="its data loader cannot seek")
    x, y = _data(200, 1)
    pos = _train(model, opt, mon, x, y, 0, 1)
    with pytest.raises(CommandError, match="runs no ramp trials: its data loader cannot seek"):
        commands.submit(db, mon.run_id, "trial", {"factors": [2]}, actor="test")
    assert mon.trial_due() is None
    _train(model, opt, mon, x, y, pos, 2)
    mon.finish()
    assert commands.list_commands(db, mon.run_id) == []
    config = reader.get_run(db, mon.run_id).config
    assert config["trials"] is False and config["trials_note"] == "its data loader cannot seek"


def test_a_factor_that_cannot_run_refuses_the_trial_with_the_reason(tmp_path):
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True)
    x, y = _data(200, 1)
    pos = _train(model, opt, mon, x, y, 0, 1)
    mon.report_oom(4)  # every tier at per-device batch 4 is out
    _train(model, opt, mon, x, y, pos, 2)
    cid = commands.submit(db, mon.run_id, "trial", {"factors": [2, 4]}, actor="test")
    wait_for_ramp(
        lambda: mon.ramp_due() or commands.get(db, cid).status == "refused" or None,
        wait=True,
        timeout=30,
    )
    assert mon.trial_due() is None
    mon.finish()
    cmd = commands.get(db, cid)
    assert cmd.status == "refused" and cmd.reason.startswith("×2 cannot run: "), cmd.reason
    assert "per-device batch 4" in cmd.reason


def test_a_trial_command_runs_in_an_own_loop_and_continues_from_the_kept_arm(tmp_path):
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    x, y = _data(4000, 1)
    x_eval, y_eval = _data(N_EVAL, 2)
    pos, step = 0, 0
    for step in range(1, 6):
        pos = _train(model, opt, mon, x, y, pos, step)
    cid = commands.submit(db, mon.run_id, "trial", {"factors": [2, 4]}, actor="test")
    trial = _boundary(mon)
    assert trial is not None and trial.trial_id == cid and trial.step == 5
    assert trial.factors == (2, 4) and trial.delta_tokens == 64  # 64: whole steps of ×4 (32)
    assert [a.tier.batch for a in trial.arms] == [16, 32]

    def evaluate(model):  # with _train_step, the README's own-loop snippet's two functions
        return ((model(x_eval) - y_eval) ** 2).squeeze(1)

    out = mon.run_trial(trial, _train_step(x, y), evaluate, start=pos)
    assert out is not None
    pos += trial.delta_examples
    continue_step = mon.trial_ended(out)
    assert continue_step == 5 + trial.steps(out.kept.factor)
    assert mon.tier == out.tier
    for step in range(continue_step + 1, continue_step + 3):
        b = out.tier.per_device_batch
        pos = _train(model, opt, mon, x, y, pos, step, batch=b, accum=out.tier.accum)
    mon.finish()

    cmd = commands.get(db, cid)
    assert (cmd.status, cmd.applied_step) == ("applied", continue_step)
    events = reader.events(db, mon.run_id)
    [start] = [e for e in events if e.kind == M.EVENT_TRIAL_START]
    assert start.step == 5 and start.data["trial_id"] == cid
    assert start.data["cost_tokens"] == 2 * 64 and start.data["cost_fraction"] == 128 / 100_000
    assert start.data["tier"] == {"per_device_batch": 4, "accum": 2}
    arms = [e for e in events if e.kind == M.EVENT_TRIAL_ARM]
    assert {e.step for e in arms} == {5}
    ends = {e.data["factor"]: e.data for e in arms if e.data["done"]}
    # the arms run: the control and the branches judged (a branch after a failed one is not)
    ran = [b.k for b in out.verdict.branches]
    assert sorted(ends) == [1, *ran] and out.verdict.not_run == (2, 4)[len(ran) :]
    assert all(d["tokens"] == 64 for d in ends.values())
    assert all(d["eval_loss"] is not None for d in ends.values())
    [end] = [e for e in events if e.kind == M.EVENT_TRIAL_END]
    assert end.step == continue_step and end.data["kept_factor"] == out.kept.factor
    assert end.data["cost_tokens"] == len(ran) * 64  # the arms run, but the kept one
    assert end.data["verdict"]["kept_k"] == out.kept.factor
    ramps = [e for e in events if e.kind == M.EVENT_RAMP]
    if out.kept.factor > 1:  # the kept branch is a ramp in every chart and in the ramp history
        assert [(e.step, e.data["source"]) for e in ramps] == [(continue_step, f"trial {cid}")]
    else:
        assert ramps == []
    # the kept arm's steps are logged after the verdict, with their tier; no step twice
    loss_steps = sorted(metric(db, mon.run_id, M.LOSS))
    assert loss_steps == list(range(1, continue_step + 3))
    batch = metric(db, mon.run_id, M.BATCH_SEQS)
    assert {batch[s] for s in range(6, continue_step + 1)} == {out.tier.batch}


def test_with_delta_from_loss_the_trial_takes_delta_from_the_runs_loss_curve(tmp_path):
    """A loop whose loss decays as 1 + exp(−t/τ) in tokens (τ = 100 steps): Δ comes from that
    curve (its control's half-progress ratio on the true curve near the 0.8 aimed at), within
    the loop's Δ as the cap, and the trial_start says so; its cost is a share of the 10¹²-token
    budget in significant digits (never "0.0%") and of the tokens seen so far."""
    db, cap = tmp_path / "runs.duckdb", 4096
    model, opt, mon = _loop(
        db, True, budget=10**12, trial_delta_tokens=cap, trial_delta_from_loss=True
    )
    assert reader.get_run(db, mon.run_id).config["trial_delta_from_loss"] is True
    tau = 100 * 8

    def curve(tokens):
        return 1.0 + math.exp(-tokens / tau)

    x = torch.randn(8, 8)
    for step in range(1, 301):
        (model(x) ** 2).mean().backward()
        mon.after_backward()
        mon.step(step, loss=curve(8 * step))  # the loop's loss: a known curve
        opt.zero_grad(set_to_none=True)
    cid = commands.submit(db, mon.run_id, "trial", {"factors": [2, 4]}, actor="test")
    trial = _boundary(mon)
    assert trial is not None and trial.trial_id == cid
    choice = trial.delta_choice
    assert choice["basis"] == "loss curve" and choice["tokens"] == trial.delta_tokens
    assert 4 * 4 * 8 <= trial.delta_tokens < cap and trial.delta_tokens % 32 == 0
    t0 = 8 * 300
    a, b, c = (curve(t0 + f * trial.delta_tokens) for f in (0, 0.5, 1))
    assert 0.75 <= (b - c) / (a - b) <= 0.9
    mon.trial_abandoned(trial, "the test stops here")
    mon.finish()

    [start] = reader.events(db, mon.run_id, kinds=[M.EVENT_TRIAL_START])
    cost = 2 * trial.delta_tokens
    assert start.data["delta_choice"] == choice
    assert start.data["cost_fraction"] == cost / 10**12
    assert start.data["cost_fraction_seen"] == cost / 2400
    assert (
        "0.0%" not in start.message and "% of the 1,000,000,000,000-token budget" in start.message
    )
    assert f"{significant(100 * cost / 2400)}% of the 2,400 tokens seen so far" in start.message
    assert "Δ from the loss curve: τ ≈" in start.message


def test_the_trial_start_times_its_cost_at_the_median_of_the_recent_steps(tmp_path):
    """cost_seconds is the discarded tokens over the median tokens/s of the running tier's
    recent steps (advisor.throughput.RECENT), never one step's: here the last step, with no wait,
    runs far faster than the ones before it."""
    import time

    from rampwatch.advisor.throughput import RECENT

    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, True, trial_delta_tokens=64)
    x, y = _data(4000, 1)
    pos = 0
    for step in range(1, 41):
        time.sleep(0.05 if step < 40 else 0)  # a wide margin over a loaded step
        pos = _train(model, opt, mon, x, y, pos, step)
    cid = commands.submit(db, mon.run_id, "trial", {"factors": [2, 4]}, actor="test")
    trial = _boundary(mon)
    assert trial is not None and trial.trial_id == cid
    mon.trial_abandoned(trial, "the test stops here")
    mon.finish()
    [start] = reader.events(db, mon.run_id, kinds=[M.EVENT_TRIAL_START])
    tps = metric(db, mon.run_id, M.TOKENS_PER_S)
    recent = [tps[s] for s in sorted(tps)[-RECENT:]]
    cost = start.data["cost_tokens"]
    assert start.data["cost_seconds"] == pytest.approx(cost / float(np.median(recent)))
    assert tps[40] > 2 * np.median(recent)  # the premise: the last step is no typical one


def test_a_retry_s_cap_survives_a_resume_and_goes_to_a_trial_that_begins_soon_only():
    from rampwatch.advisor.trial_delta import DeltaChoice
    from rampwatch.monitor.trial_protocol import TrialProtocol

    def protocol(state=None):
        p = TrialProtocol(enabled=True)
        if state is None:  # a trial of batch 8 that judged nothing ended at 1,000 tokens
            p.retry = DeltaChoice(256, "retry", "auto trial 1 judged nothing")
            p.retry_cap = (8, 4, 1000)
        else:
            p.load_state_dict(state)
        return p

    after = protocol(protocol().state_dict())
    assert after.retry_cap == (8, 4, 1000) and after.retry == protocol().retry
    after.begin(None, 1000 + 256)  # within the retry's Δ: it takes the cap, the next does not
    assert after._cap == (8, 4) and after.retry is None and after.retry_cap is None
    after.begin(None, 2000)
    assert after._cap is None
    late = protocol()  # an operator's trial long after (no auto retry ran): no cap
    late.begin(7, 1000 + 257)
    assert late._cap is None and late.retry_cap is None


def test_a_trial_right_after_one_that_judged_nothing_keeps_its_failure(tmp_path):
    """Trial 1 finds Δ too long, with ×4 behind even so; a trial begun right after it passes ×2
    and ×4 on its own, and keeps ×2: ×4's "no" from the longer Δ stands (advisor/trial.py
    failed_factor). The loop's evaluate is scripted (held-out losses per call), its training
    real."""
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    script = _held_out_script()
    calls = script(1.0, 0.2, 0.1, 0.1, 0.6) + script(1.0, 0.6, 0.2, 0.19)
    outs = _scripted_trials(db, model, opt, mon, calls)
    assert not calls  # the second trial runs no ×4: it would be at the cap
    first, second = (o.verdict for o in outs)
    assert first.delta_check == "too long" and [b.passed for b in first.branches] == [True, False]
    assert outs[1].request.cap == 4
    assert second.delta_ok and [b.passed for b in second.branches] == [True]
    assert second.not_run == (4,) and second.cost_tokens == 64
    assert (second.cap, second.k_star, second.bracket, outs[1].kept.factor) == (4, 2, (16, 32), 2)
    starts = [e for e in reader.events(db, mon.run_id) if e.kind == M.EVENT_TRIAL_START]
    assert [e.data["cap"] for e in starts] == [None, 4]
    assert starts[1].message.endswith("Nothing from ×4 up is kept: the trial before failed it.")
    [_, end] = [e for e in reader.events(db, mon.run_id) if e.kind == M.EVENT_TRIAL_END]
    assert "×4 failed in the trial before at this batch" in end.message


def test_the_trial_after_one_that_could_not_tell_asks_for_the_held_out_batch_that_would(tmp_path):
    """Stein's two stages: trial 1's held-out batch is too small for the spread it measured
    (its control's half-progress ratio near the threshold, noisy per example), so it names the
    batch that would tell; the next trial asks for that many (an own loop's evaluate() reads
    `eval_examples`), and the one after it, following a trial that told, asks for nothing."""
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    script = _held_out_script()
    # trial 1: progress 0.4 then 0.28 (ratio 0.7, the threshold 0.67) under a spread of 0.3
    calls = script(1.0, 0.6, 0.32, 0.3, 0.3, noise=0.3)
    calls += script(1.0, 0.6, 0.2, 0.19, 0.19) + script(1.0, 0.6, 0.2, 0.19, 0.19)
    outs = _scripted_trials(db, model, opt, mon, calls)
    asked = [o.request.eval_examples for o in outs]
    first = outs[0].verdict
    assert first.delta_check == "cannot tell" and first.examples_to_tell > N_EVAL
    assert "the next trial asks for that many" in first.summary
    assert outs[1].verdict.delta_ok
    assert asked == [None, first.examples_to_tell, None]
    starts = [e for e in reader.events(db, mon.run_id) if e.kind == M.EVENT_TRIAL_START]
    assert [e.data["eval_examples"] for e in starts] == asked
    assert starts[1].message.endswith(
        f"It asks for ~{first.examples_to_tell:,} held-out examples: the trial before could "
        "not tell with fewer."
    )


def test_a_control_that_cannot_tell_is_measured_again_on_the_batch_that_would(tmp_path):
    """The second stage, in the same trial: on 64 held-out examples the control's half-progress
    ratio is too noisy to tell whether Δ is too long; the loop's grow_eval takes the batch that
    would tell, the snapshot, the control at Δ/2 and its end are evaluated again on it, and the
    branches on it too. The verdict says both sizes; the next trial asks for nothing more."""
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    x, y = _data(4000, 1)
    pos = 0
    for step in range(1, 3):
        pos = _train(model, opt, mon, x, y, pos, step)
    commands.submit(db, mon.run_id, "trial", {"factors": [2, 4]}, actor="test")
    trial = _boundary(mon)
    rng = np.random.default_rng(0)
    bases, size, scored = {}, [N_EVAL], []
    # snapshot, Δ/2, the control's end: progress 0.4 then 0.28 (ratio 0.7, the threshold 0.67)
    # under a spread of 0.3 on the first 64; on the larger batch 0.4 then 0.4, ×2 and ×4 as good
    levels = [(1.0, 0.3), (0.6, 0.3), (0.32, 0.3)] + [(1.0, 0.01), (0.6, 0.01), (0.2, 0.01)]
    levels += [(0.19, 0.01), (0.19, 0.01)]

    def evaluate(model):  # the same examples at one size: one base loss per example
        n = size[0]
        base = bases.setdefault(n, rng.gamma(2.0, 1.0, n))
        level, noise = levels.pop(0)
        scored.append(n)
        return torch.as_tensor(base + level + rng.normal(0, noise, n))

    def grow_eval(asked):
        size[0] = asked
        return asked

    out = mon.run_trial(trial, _train_step(x, y), evaluate, start=pos, grow_eval=grow_eval)
    mon.trial_ended(out)
    mon.finish()
    v = out.verdict
    assert not levels and size[0] > N_EVAL
    assert scored == [N_EVAL] * 3 + [size[0]] * 5
    assert (v.first_examples, v.examples, v.delta_check, v.k_star) == (N_EVAL, size[0], "fine", 4)
    assert out.kept.factor == 4
    assert v.summary.startswith(
        f"On {N_EVAL} held-out examples the control could not tell whether Δ was too long; "
        f"it was measured again on {size[0]:,}. Critical batch at least 32"
    )
    events = reader.events(db, mon.run_id)
    [stage] = [e for e in events if e.kind == M.EVENT_TRIAL_ARM and "first_examples" in e.data]
    assert stage.data["eval_examples"] == size[0]
    points = reader.trial_points(db, mon.run_id, trial.trial_id)
    assert [(p.factor, p.examples, p.first, p.done) for p in points if p.factor == 1][-2:] == [
        (1, size[0], N_EVAL, False),  # the card's progress: evaluating again
        (1, None, None, True),
    ]
    assert TrialVerdict.from_dict(v.to_dict()) == v
    assert mon.trial_due() is None and mon.ramps.trials.tell is None


def test_a_trial_judged_at_the_ratio_s_lower_bound_that_kept_the_control_says_so(tmp_path):
    """The control cannot tell (ratio 0.7 under a spread of 0.3), but its ratio clears the
    threshold, so the branches are judged at the ratio's lower bound; both fall far behind, the
    control is kept, and the retry due at once says the trial kept no branch rather than that it
    judged nothing."""
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    script = _held_out_script()
    calls = script(1.0, 0.6, 0.32, noise=0.3) + script(1.5)
    [out] = _scripted_trials(db, model, opt, mon, calls)
    v = out.verdict
    assert v.delta_check == "cannot tell" and v.judged, v.summary
    # ×2 fails the linear tolerance too: its "no" stands, and ×4 is not run
    assert [b.passed for b in v.branches] == [False] and v.not_run == (4,)
    assert out.kept.factor == 1
    retry = mon.ramps.trials.retry
    assert retry is not None and retry.note.startswith("trial 1 kept no branch (Δ cannot tell, ")


def test_the_state_after_a_trial_that_judged_nothing_loads_as_plain_data(tmp_path):
    """What a checkpoint keeps after a trial that could not tell (its evidence, the retry due
    with its τ, the cap, the ask) reads back with torch's weights_only loader, as the reference
    trainer's resume reads it, and as JSON, as the Hugging Face restart writes it."""
    import json

    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    _scripted_trials(db, model, opt, mon, _held_out_script()(1.0, 0.6, 0.32, 0.3, 0.3, noise=0.3))
    state = mon.state_dict()["trials"]
    assert state["tell"] and state["retry"] and state["latest"]
    torch.save({"trials": state}, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True)["trials"] == state
    assert json.loads(json.dumps(state)) == state


def test_trial_start_says_each_of_its_sentences_once():
    """The Δ's note, the cap and the ask each end in one full stop (seen on the demo: "(0.67
    needed).. It asks for ~295 held-out examples")."""
    from rampwatch.advisor.tiers import Tier
    from rampwatch.monitor.trial_protocol import TrialArm, TrialProtocol, TrialRequest

    note = "Δ from the loss curve (its cap): τ ≈ 430,271 tokens (0.67 needed)."
    req = TrialRequest(
        trial_id=3,
        step=559,
        control=Tier(4, 2),
        base_lr=1e-3,
        delta_tokens=131_072,
        seq_len=256,
        rule="sqrt",
        arms=(TrialArm(2, Tier(4, 4), 1.4e-3), TrialArm(4, Tier(4, 8), 2e-3)),
        source="command 3",
        delta_choice={"note": note},
        cap=4,
        eval_examples=295,
    )
    said = []
    TrialProtocol(enabled=True, delta_from_loss=True).started(
        lambda step, kind, message, data: said.append(message), req, None
    )
    assert said[0].endswith(
        "(0.67 needed). Nothing from ×4 up is kept: the trial before failed it. It asks for ~295 "
        "held-out examples: the trial before could not tell with fewer."
    ), said[0]


def test_the_held_out_batch_a_trial_asks_for_survives_a_resume():
    from rampwatch.monitor.trial_protocol import TrialProtocol

    before = TrialProtocol(enabled=True, tell=900)
    after = TrialProtocol(enabled=True)
    after.load_state_dict(before.state_dict())
    assert after.tell == 900
    after.begin(7, 5000)  # the next trial takes it, whoever starts it; the one after does not
    assert (after._tell, after.tell) == (900, None)
    after.begin(None, 9000)
    assert after._tell is None


def test_the_step_after_a_trial_logs_its_own_peak_memory_not_the_arms(tmp_path):
    """An arm's memory (a larger batch, here 400 MB held for one arm step) is no peak of the
    running tier: the step after the trial measures from the trial's end, so the memory plan's
    measured row at the running per-device batch is the run's own."""
    db = tmp_path / "runs.duckdb"
    model, opt, mon = _loop(db, trials=True, trial_delta_tokens=64)
    x, y = _data(4000, 1)
    x_eval, y_eval = _data(N_EVAL, 2)
    pos = 0
    for step in range(1, 6):
        pos = _train(model, opt, mon, x, y, pos, step)
    commands.submit(db, mon.run_id, "trial", {"factors": [2]}, actor="test")
    trial = _boundary(mon)
    plain = _train_step(x, y)

    def big_arm(model, opt, start, count):
        if count > 8:  # the ×2 arm: a batch that needs 400 MB more than the run's
            torch.ones(100_000_000).add_(1)
        return plain(model, opt, start, count)

    out = mon.run_trial(trial, big_arm, lambda m: ((m(x_eval) - y_eval) ** 2).squeeze(1), start=pos)
    pos += trial.delta_examples
    cont = mon.trial_ended(out)
    for step in (cont + 1, cont + 2):
        pos = _train(model, opt, mon, x, y, pos, step, out.tier.per_device_batch, out.tier.accum)
    mon.finish()
    peaks = metric(db, mon.run_id, M.MEM_PEAK)
    before, after = max(peaks[s] for s in range(2, 6)), max(peaks[s] for s in (cont + 1, cont + 2))
    assert after < before + 100e6, (before, after)
