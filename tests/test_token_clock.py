"""monitor/token_clock.py: a scheduler driven by tokens reads, after a ramp ×k with its LR scaled by
m, the unramped schedule at the same token × m, for every scheduler of tests/test_scale_lr.py
(closed-form, recursive, sequential, chained); a step of tokens that is not a whole number of
planned steps stands at the last whole one; the clock's state survives a checkpoint and a
trial's snapshot, and a bare scheduler's state from before the clock loads; the steps a budget
has left; Monitor.start records the budget as the run config's "total_tokens" (real DuckDB file).
The same in real processes with real frameworks: test_own_loop_ramps, test_integration_*."""

from __future__ import annotations

import pytest
import torch

from rampwatch import TokenClock, store
from rampwatch.monitor import Monitor
from rampwatch.monitor.ramp_protocol import scale_lr
from rampwatch.monitor.token_clock import steps_to_budget
from rampwatch.monitor.trial_snapshot import Snapshot
from tests.test_scale_lr import SCHEDULES

T0 = 8  # tokens of one planned step


class _PerStep:
    """A scheduler stepped once per optimizer step, whatever its tokens (what the clock fixes)."""

    def __init__(self, sched):
        self.sched, self._schedulers = sched, [sched]

    def step(self, tokens):
        self.sched.step()


def _optimizer(base: float = 1e-3):
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(2))]},
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": base / 10},
    ]
    return torch.optim.AdamW(groups, lr=base)


def _by_tokens(make, step_tokens, ramp_at=None, mult=1.0, clock=True):
    """{tokens seen before a step: the LR of each group for that step}, stepping through a clock
    (clock=False: the scheduler once per step); after step ramp_at the LR is scaled by mult (a
    ramp's scale_lr)."""
    opt = _optimizer()
    sched = make(opt)
    clock = TokenClock(sched, tokens_per_step=T0) if clock else _PerStep(sched)
    seen, out = 0, {}
    for i, tokens in enumerate(step_tokens, start=1):
        out[seen] = [g["lr"] for g in opt.param_groups]
        opt.step()
        clock.step(tokens)
        seen += tokens
        if i == ramp_at:
            scale_lr(opt, mult, clock)
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_after_a_ramp_the_lr_at_every_token_is_the_unramped_one_times_the_multiplier(name):
    make, s, m = SCHEDULES[name], 5, 2**0.5
    unramped = _by_tokens(make, [T0] * 24)
    ramped = _by_tokens(make, [T0] * s + [2 * T0] * 9, ramp_at=s, mult=m)
    assert list(ramped)[s:] == [T0 * (s + 2 * j) for j in range(9)]  # the ramp's tokens
    for tokens, lrs in ramped.items():
        want = [lr * (m if tokens >= s * T0 else 1.0) for lr in unramped[tokens]]
        assert lrs == pytest.approx(want, rel=1e-9), (name, tokens)


def test_without_the_clock_the_decay_stretches_over_the_ramps_extra_tokens():
    """The check above can fail: a scheduler stepped once per optimizer step is behind."""
    make, s, m = SCHEDULES["cosine"], 5, 2**0.5
    unramped = _by_tokens(make, [T0] * 24)
    per_step = _by_tokens(make, [T0] * s + [2 * T0] * 9, ramp_at=s, mult=m, clock=False)
    late = [t for t in per_step if t > s * T0]
    assert all(per_step[t][0] > 1.01 * m * unramped[t][0] for t in late)


def test_tokens_that_are_not_whole_planned_steps_stand_at_the_last_whole_one():
    make = SCHEDULES["lambda (HF warmup)"]  # lr = base × min(1, (n + 1) / 5) after n steps
    ramped = _by_tokens(make, [12] * 4)  # ×1.5: 12, 24, 36 tokens → 1, 3, 4 planned steps
    assert [v[0] for v in ramped.values()] == pytest.approx(
        [1e-3 * min(1.0, (n + 1) / 5) for n in (0, 1, 3, 4)], rel=1e-12
    )


def test_its_state_survives_a_checkpoint_and_a_trials_snapshot():
    opt = _optimizer()
    make = SCHEDULES["sequential"]
    clock = TokenClock(make(opt), tokens_per_step=T0)
    for tokens in (T0, T0, 2 * T0, 12):
        opt.step()
        clock.step(tokens)
    assert (clock.tokens, clock.steps) == (44, 5)
    snap = Snapshot.take(torch.nn.Linear(1, 1), opt, clock)
    before = [g["lr"] for g in opt.param_groups]
    for _ in range(3):  # an arm goes on
        opt.step()
        clock.step(3 * T0)
    snap.restore(torch.nn.Linear(1, 1), opt, clock)
    assert (clock.tokens, clock.steps, [g["lr"] for g in opt.param_groups]) == (44, 5, before)
    # a checkpoint into a fresh clock over a fresh scheduler (a resume's order: build, then load
    # the optimizer, then the scheduler): it goes on where this one does
    fresh_opt = _optimizer()
    fresh = TokenClock(make(fresh_opt), tokens_per_step=T0)
    fresh_opt.load_state_dict(opt.state_dict())
    fresh.load_state_dict(clock.state_dict())
    for o, c in ((opt, clock), (fresh_opt, fresh)):
        o.step()
        c.step(2 * T0)
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]


def test_a_bare_schedulers_state_from_before_the_clock_loads_as_planned_steps():
    opt = _optimizer()
    plain = SCHEDULES["cosine"](opt)
    for _ in range(4):
        opt.step()
        plain.step()
    clock = TokenClock(SCHEDULES["cosine"](_optimizer()), tokens_per_step=T0)
    clock.load_state_dict(plain.state_dict())
    assert (clock.steps, clock.tokens) == (4, 4 * T0)
    assert clock.get_last_lr() == plain.get_last_lr()


def test_frameworks_step_it_by_the_tokens_seen_and_bad_sizes_are_refused():
    opt, seen = _optimizer(), [0]
    clock = TokenClock(SCHEDULES["step"](opt), tokens_per_step=None, seen=lambda: seen[0])
    with pytest.raises(RuntimeError, match="before its tokens_per_step was set"):
        clock.step()
    clock.tokens_per_step = T0  # a framework that learns its batch after building the clock
    seen[0] = 4 * T0
    opt.step()
    clock.step()
    assert (clock.steps, clock.optimizer) == (4, opt)
    with pytest.raises(ValueError, match="tokens_per_step must be a positive whole number"):
        TokenClock(SCHEDULES["step"](opt), tokens_per_step=0)


def test_the_steps_a_budget_has_left_reach_it_within_one_step():
    assert steps_to_budget(15 * 64, 5 * 64, 128) == 5  # exactly
    assert steps_to_budget(10 * 64, 5 * 64, 128) == 3  # 2.5 → 3: passes it by half a step
    assert steps_to_budget(100, 120, 8) == 0


def test_monitor_start_records_the_budget_as_total_tokens(tmp_path):
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(2, 1)

    def start(**kw):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = Monitor.start(
            db, name="budget", model=model, optimizer=opt, per_device_batch=2, accum=2, seq_len=4,
            **kw,
        )  # fmt: skip
        mon.finish()
        return mon, store.get_run(db, mon.run_id).config

    mon, config = start(config={"lr": 1e-3}, total_tokens=4096)
    assert config["total_tokens"] == 4096 and mon.ramps.trials.budget_tokens == 4096
    _, config = start(config={"total_tokens": 2048.0})  # the trainer's key, from its config
    assert config["total_tokens"] == 2048
    _, config = start(config={})
    assert "total_tokens" not in config
    with pytest.raises(ValueError, match="total_tokens must be a positive whole number.*-5"):
        start(config={}, total_tokens=-5)


def test_monitor_start_refuses_a_bad_seq_len_or_policy_before_it_writes(tmp_path):
    """seq_len "4" used to start a run that logged no step (each step's telemetry failed on
    it), and policy={...} failed deep inside; both are refused by name, with no run left."""
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    base = dict(name="bad", config={}, model=model, optimizer=opt, per_device_batch=2, accum=2)
    for bad in ("4", 0, 2.5):
        with pytest.raises(ValueError, match=f"seq_len must be a positive integer, got {bad!r}"):
            Monitor.start(db, seq_len=bad, **base)
    with pytest.raises(TypeError, match="policy must be a RampPolicy.*got dict"):
        Monitor.start(db, seq_len=4, policy={"original_batch": 4}, **base)
    # capacity "80GB" failed inside the store's insert (a DuckDB conversion error), a misspelt
    # keyword was blamed on Monitor.__init__, and ramp="bogus" was refused after the run began:
    # each left a failed run behind
    for bad in ("80GB", 0, -1, 2.5):
        with pytest.raises(ValueError, match=f"capacity_bytes must be .*got {bad!r}"):
            Monitor.start(db, seq_len=4, capacity_bytes=bad, **base)
    with pytest.raises(TypeError, match=r"Monitor.start\(\) got an unexpected keyword.*'ramp_at'"):
        Monitor.start(db, seq_len=4, ramp_at=2.0, **base)
    with pytest.raises(ValueError, match="ramp='bogus': one of manual, auto, off"):
        Monitor.start(db, seq_len=4, ramp="bogus", **base)
    assert not db.exists() or store.list_runs(db) == []


def test_the_lightning_callback_refuses_a_bad_seq_len_when_made():
    pytest.importorskip("lightning")
    from rampwatch.integrations.lightning import RampwatchCallback

    for bad in ("4", 0):
        with pytest.raises(ValueError, match="seq_len must be a positive integer"):
            RampwatchCallback("runs.duckdb", seq_len=bad)
    # a misspelt monitor keyword: said when the callback is made, not at fit's first step
    with pytest.raises(
        TypeError,
        match=r"RampwatchCallback\(\) got .* 'flop_per_token': did "
        "you mean 'flops_per_token'",
    ):
        RampwatchCallback("runs.duckdb", flop_per_token=6e6)


def test_the_hf_trainer_refuses_a_misspelt_monitor_keyword_when_made(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from rampwatch.integrations.transformers import RampwatchTrainer

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    args = TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match=r"monitor_kwargs=...\) got .* 'gns_window'"):
        RampwatchTrainer(
            model=model, args=args, db=tmp_path / "r.duckdb", monitor_kwargs={"gns_window": 50}
        )
    assert not (tmp_path / "r.duckdb").exists()
