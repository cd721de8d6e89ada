"""Trial-gated auto (issue 26): with ramp="auto" and the policy's trial gate, an own loop's monitor
starts ramp trials itself and ramps only through one that passes. In one process against a real
database, a real Monitor on a small torch model (the setup of tests/test_trial_protocol.py):

- a noise-dominated regression: the noise scale passes the batch (about half the critical batch),
  an auto trial starts on that evidence (negative id, source "auto: <the decision>"), its
  branches pass, and the kept branch is the run's ramp (source "trial -1");
- a signal-dominated one far from its optimum: the evidence never calls a trial, the interval
  does; the larger batches fall behind, so the trial fails and the run keeps its tier, and the
  next trial starts at the first boundary a whole interval after the last one's start.
"""

from __future__ import annotations

import math

import pytest
import torch

from rampwatch import Monitor
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.trial import failed_factor
from rampwatch.store import names as M
from rampwatch.store import reader

N_EVAL = (
    8192  # held-out examples: enough that the paired bound separates ×2 and ×4 from the control
)


def _data(n: int, seed: int, scale: float, noise: float):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ (scale * torch.arange(1.0, 9.0)).unsqueeze(1) + noise * torch.randn(n, 1, generator=g)
    return x, y


class GatedLoop:
    """The README's own loop with trials, ramp="auto" and the trial gate."""

    def __init__(self, db, data, lr: float, interval: int | None, steps: int, delta: int):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        policy = RampPolicy(
            original_batch=8,
            original_lr=lr,
            lr_rule="sqrt",
            gate="trial",
            trial_interval_tokens=interval,
            hysteresis_steps=5,
            min_estimates=5,
        )
        self.mon = Monitor.start(
            db,
            name="gated",
            config={"total_tokens": 100_000},
            model=self.model,
            optimizer=self.opt,
            per_device_batch=4,
            accum=2,
            seq_len=1,
            ramp="auto",
            policy=policy,
            trials=True,
            trial_delta_tokens=delta,
        )
        (self.x, self.y), (self.xe, self.ye) = data
        self.pos, self.step, self.steps = 0, 0, steps
        self.trials = []  # (request, outcome, tokens seen at its start)

    def _loss(self, start, count):
        xs, ys = self.x[start : start + count], self.y[start : start + count]
        return torch.nn.functional.mse_loss(self.model(xs), ys)

    def train_step(self, model, opt, start, count):
        loss = self._loss(start, count)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def evaluate(self, model):
        return ((model(self.xe) - self.ye) ** 2).squeeze(1)

    def run(self):
        mon = self.mon
        while self.step < self.steps:
            self.step += 1
            tier = mon.tier
            for _ in range(tier.accum):
                loss = self._loss(self.pos, tier.per_device_batch)
                (loss / tier.accum).backward()
                mon.after_backward()
                self.pos += tier.per_device_batch
            mon.step(self.step, loss=loss.detach())
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            ramp = mon.ramp_due()
            assert ramp is None  # the trial gate never ramps but through a trial
            trial = mon.trial_due()
            if trial is None:
                continue
            tokens = mon.tokens_seen
            out = mon.run_trial(trial, self.train_step, self.evaluate, start=self.pos)
            assert out is not None
            self.pos += trial.delta_examples
            self.step = mon.trial_ended(out)
            self.trials.append((trial, out, tokens))
        mon.finish()
        return self


def test_auto_trial_on_the_evidence_passes_and_its_kept_branch_is_the_ramp(tmp_path):
    db = tmp_path / "runs.duckdb"
    # far enough from its optimum that the control still progresses over Δ once the noise scale
    # passes the batch (at scale 0.05 it is at its noise floor by then: Δ too long)
    data = (_data(60_000, 1, 0.1, 1.0), _data(N_EVAL, 2, 0.1, 1.0))
    # interval None: 100 × Δ, past the run's end, so only the evidence can call the trial
    loop = GatedLoop(db, data, lr=0.02, interval=None, steps=130, delta=256).run()
    assert loop.trials, "the evidence never called a trial"
    req, out, _ = loop.trials[0]
    assert req.trial_id == -1 and req.command_id is None
    assert req.source.startswith("auto: The noise scale"), req.source  # the evidence, not time
    assert req.factors == (2, 4)
    assert out.verdict.k_star is not None, out.verdict.summary
    assert out.kept.factor == out.verdict.k_star and out.tier.batch == 8 * out.kept.factor
    events = reader.events(db, loop.mon.run_id)
    [start] = [e for e in events if e.kind == M.EVENT_TRIAL_START][:1]
    assert start.data["trial_id"] == -1 and start.data["source"] == req.source
    ramps = [e for e in events if e.kind == M.EVENT_RAMP]
    assert ramps[0].data["source"] == "trial -1" and ramps[0].step == out.continue_step
    assert ramps[0].data["after"]["batch"] == out.tier.batch
    # the run now reads the noise scale through the trial's calibration, and says so
    advice = loop.mon.ramps.advise()
    assert advice.trial.trial_id == -1 and advice.trial.coefficient == out.verdict.calibration
    assert advice.evidence.startswith(f"noise scale × {out.verdict.calibration:.3g} from auto ")
    stored = reader.trials(db, loop.mon.run_id)
    assert stored[0].trial_id == -1 and stored[0].status == "finished"
    assert stored[0].source == req.source


def test_a_failing_interval_trial_keeps_the_tier_and_the_next_waits_the_interval(tmp_path):
    db = tmp_path / "runs.duckdb"
    interval = 256  # tokens: 32 steps of 8
    data = (_data(20_000, 1, 10.0, 0.0), _data(N_EVAL, 2, 10.0, 0.0))
    loop = GatedLoop(db, data, lr=0.01, interval=interval, steps=110, delta=64).run()
    assert len(loop.trials) >= 2
    for req, out, _ in loop.trials:
        assert req.source.startswith("auto: ") and "tokens since" in req.source, req.source
        assert out.verdict.k_star is None, out.verdict.summary  # the bigger batches fell behind
        assert out.kept.factor == 1 and out.tier.batch == 8
    assert [r.trial_id for r, _, _ in loop.trials] == [-1 - i for i in range(len(loop.trials))]
    # each starts at the first boundary a whole interval after the last one's start
    (first, _, t0), (second, _, t1) = loop.trials[:2]
    assert t0 == interval
    assert t1 - t0 >= interval and t1 - t0 - 8 < interval
    events = reader.events(db, loop.mon.run_id)
    assert [e for e in events if e.kind == M.EVENT_RAMP] == []
    assert all(t.status == "finished" for t in reader.trials(db, loop.mon.run_id))


def test_the_trial_gate_needs_a_loop_that_runs_trials(tmp_path):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    policy = RampPolicy(original_batch=8, original_lr=0.01, gate="trial")
    with pytest.raises(ValueError, match="trial gate ramps only through trials"):
        Monitor.start(
            tmp_path / "runs.duckdb",
            name="no-trials",
            config={},
            model=model,
            optimizer=opt,
            per_device_batch=4,
            accum=2,
            seq_len=1,
            ramp="auto",
            policy=policy,
        )
    assert not (tmp_path / "runs.duckdb").exists()  # refused before the run exists


def test_a_trial_that_judged_nothing_is_tried_once_more_at_a_shorter_delta(tmp_path):
    """Noise-free regression, loss flattening within Δ: the interval's trial finds Δ too long,
    the retry starts at the next boundary at the Δ where the control's own ratio says r = 0.8,
    and when the retry judges nothing either, the next trial waits the interval again."""
    db = tmp_path / "runs.duckdb"
    data = (_data(60_000, 1, 1.0, 0.0), _data(N_EVAL, 2, 1.0, 0.0))
    loop = GatedLoop(db, data, lr=0.05, interval=256, steps=420, delta=2048).run()
    assert len(loop.trials) >= 3, [r.source for r, _, _ in loop.trials]
    (first, out0, t0), (retry, out1, t1), (third, _, t2) = loop.trials[:3]
    assert out0.verdict.delta_check == "too long", out0.verdict.summary
    r = out0.verdict.half_progress_ratio
    want = first.delta_tokens * math.log(0.8) / math.log(r)  # exp(−Δ/2τ) = r, then 0.8
    unit = 4 * 8  # whole steps of ×1, ×2 and ×4 at batch 8
    assert 4 * unit < want < first.delta_tokens  # above the floor: 4 steps of ×4
    assert retry.delta_tokens == -(-int(want) // unit) * unit
    assert retry.source.startswith("auto: auto trial 1 judged nothing (Δ too long, "), retry.source
    assert retry.delta_choice["basis"] == "retry"
    assert 0 < t1 - (t0 + first.delta_tokens) <= 8  # the first boundary after the trial
    assert out1.verdict.delta_check != "fine", out1.verdict.summary
    assert "tokens since the last trial" in third.source, third.source
    assert t2 - t1 >= 256
    [start] = [e for e in reader.events(db, loop.mon.run_id) if e.kind == M.EVENT_TRIAL_START][1:2]
    assert start.data["trial_id"] == -2 and start.data["delta_tokens"] == retry.delta_tokens
    # the first trial's failures stand at the shorter Δ: the retry keeps no arm from them up
    assert first.cap is None and retry.cap == failed_factor(out0.verdict)
    assert start.data["cap"] == retry.cap and out1.verdict.cap == retry.cap
    assert retry.cap is None or out1.kept.factor < retry.cap
