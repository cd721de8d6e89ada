"""The reference trainer's ramp and out-of-memory decisions as values, in this process: the halved
tier, the --inject-oom parser and when it fires, what an out-of-memory becomes (trainer/oom.py
decide_oom, and OomGuard applying it to a real Monitor and checkpoint), what a due ramp becomes
for the trainer's state (trainer/ramp_controller.py), and a resume's world-size note (trainer/dist.py).
tests/test_ramp.py and tests/test_dist.py run the same paths end to end in real trainers."""

from __future__ import annotations

import pytest
import torch

from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.tiers import Tier
from rampwatch.monitor import Monitor
from rampwatch.monitor.ramp_protocol import Ramp
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.dist import DistInfo, on_resume
from rampwatch.trainer.loop import monitor_state
from rampwatch.trainer.oom import (
    RETIER,
    SAVE,
    OomGuard,
    OomInjector,
    StopTraining,
    decide_oom,
    halve_tier,
)
from rampwatch.trainer.ramp_controller import (
    GptPlan,
    RampController,
    plan_ladder,
    tier_switch,
)

CPU = torch.device("cpu")


# -- halve_tier ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "before, after",
    [
        ((4, 2), (2, 4)),  # even: exact
        ((8, 1), (4, 2)),
        ((6, 3), (3, 6)),
        ((5, 2), (2, 5)),  # odd per-device batch, but b·accum divides: still exact
        ((3, 1), (1, 3)),
        ((2, 1), (1, 2)),
    ],
)
def test_halve_tier_keeps_the_effective_batch_where_it_divides(before, after):
    old = Tier(*before)
    new = halve_tier(old)
    assert new == Tier(*after) and new.per_rank == old.per_rank


@pytest.mark.parametrize(
    "before, after",
    [((5, 3), (2, 8)), ((7, 1), (3, 3)), ((9, 1), (4, 3)), ((9, 3), (4, 7))],
)
def test_halve_tier_rounds_accumulation_up_when_it_cannot_keep_it(before, after):
    old = Tier(*before)
    new = halve_tier(old)
    assert new == Tier(*after)
    assert old.per_rank < new.per_rank < old.per_rank + new.per_device_batch  # least above


def test_halve_tier_never_shrinks_the_batch_and_takes_the_least_accumulation():
    for b in range(2, 41):
        for accum in range(1, 9):
            old = Tier(b, accum)
            new = halve_tier(old)
            assert new.per_device_batch == b // 2
            assert new.per_rank >= old.per_rank > (new.accum - 1) * new.per_device_batch


@pytest.mark.parametrize("accum", [1, 2, 7])
def test_halve_tier_at_per_device_batch_one_has_nothing_smaller(accum):
    assert halve_tier(Tier(1, accum)) is None


# -- the --inject-oom parser and when it fires -----------------------------------------------
def test_inject_oom_parses_step_micro_and_phase():
    injector = OomInjector.parse("12:1:backward")
    assert (injector.step, injector.micro, injector.phase) == (12, 1, "backward")
    assert OomInjector.parse(None).step is None and OomInjector.parse("").step is None


@pytest.mark.parametrize("spec", ["12:1", "12", "a:1:forward", "1:x:forward", "1:2:3:forward"])
def test_inject_oom_rejects_a_malformed_spec(spec):
    with pytest.raises(SystemExit, match="expected STEP:MICRO:PHASE"):
        OomInjector.parse(spec)


def test_inject_oom_rejects_an_unknown_phase_even_where_it_would_not_fire():
    for scope in ({}, {"rank": 0, "only_rank": 1}, {"restart": 1}):
        with pytest.raises(SystemExit, match="one of forward, backward, optimizer"):
            OomInjector.parse("3:0:sideways", **scope)


def test_inject_oom_fires_on_the_named_rank_only_and_never_after_a_restart():
    assert OomInjector.parse("3:0:forward", rank=1, only_rank=1).step == 3
    assert OomInjector.parse("3:0:forward", rank=0, only_rank=1).step is None
    assert OomInjector.parse("3:0:forward", rank=0).step == 3  # no rank named: every rank
    assert OomInjector.parse("3:0:forward", rank=1, only_rank=1, restart=1).step is None


@pytest.mark.parametrize("phase", OomInjector.PHASES)
def test_maybe_raise_fires_once_at_its_step_micro_batch_and_phase(phase):
    injector = OomInjector.parse(f"6:1:{phase}")
    near = [(5, 1, phase), (7, 1, phase), (6, 0, phase), (6, 2, phase)]
    near += [(6, 1, other) for other in OomInjector.PHASES if other != phase]
    for where in near:
        injector.maybe_raise(*where)  # anywhere else: nothing
    with pytest.raises(torch.OutOfMemoryError, match=f"injected out of memory \\({phase}, step 6"):
        injector.maybe_raise(6, 1, phase)
    injector.maybe_raise(6, 1, phase)  # once: the redone step runs


def test_attach_backward_raises_from_inside_autograd_once():
    injector = OomInjector.parse("4:0:backward")
    weight = torch.ones(2, requires_grad=True)
    spared = (weight * 2).sum()
    injector.attach_backward(spared, 4, 1)  # another micro-batch: no hook
    spared.backward()
    loss = (weight * 2).sum()
    injector.attach_backward(loss, 4, 0)
    with pytest.raises(torch.OutOfMemoryError, match="backward, step 4"):
        loss.backward()
    again = (weight * 2).sum()
    injector.attach_backward(again, 4, 0)
    again.backward()


# -- what an out-of-memory becomes --------------------------------------------------------------
def test_one_process_redoes_the_step_at_the_halved_tier():
    d = decide_oom(Tier(4, 2), 5, error="CUDA out of memory", run_id="r")
    assert d.redo and d.after == Tier(2, 4) and d.checkpoint is None and d.note is None
    assert d.event_step == 6  # the step that failed, and is redone
    assert d.message == "out of memory at per-device batch 4: step redone at 2 x 4"
    assert d.data == {
        "before": {"per_device_batch": 4, "accum": 2},
        "after": {"per_device_batch": 2, "accum": 4},
        "exact": True,
        "error": "CUDA out of memory",
    }


def test_an_inexact_halving_says_so():
    d = decide_oom(Tier(5, 3), 0, error="oom", run_id="r")
    assert d.after == Tier(2, 8) and d.data["exact"] is False
    assert d.message.endswith("(effective batch not kept exactly: odd per-device batch)")


@pytest.mark.parametrize("rank", [0, 1])
def test_under_ddp_the_rank_checkpoints_the_halved_tier_and_stops(rank):
    d = decide_oom(Tier(8, 2, world_size=2), 2, error="oom", run_id="o", rank=rank)
    assert not d.redo and d.checkpoint == SAVE and d.after == Tier(4, 4, world_size=2)
    assert d.event_step == 2  # the checkpoint's step: a resume purges events after it
    assert d.message == (
        f"out of memory on rank {rank} at per-device batch 8 in step 3: all ranks stop; the "
        "checkpoint at step 2 holds tier 4 x 4; torchrun --max-restarts resumes it (or --resume o)"
    )
    assert d.data["rank"] == rank and d.data["world_size"] == 2
    # rank 0 records the event itself; another rank has no writer, so the resumed rank 0 does
    expected = None if rank == 0 else {"kind": M.EVENT_OOM, "message": d.message, "data": d.data}
    assert d.note == expected


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_optimizer_oom_retiers_the_last_checkpoint_and_stops(world_size):
    d = decide_oom(
        Tier(4, 2, world_size),
        5,
        error="oom",
        run_id="opt",
        in_optimizer=True,
        checkpoint_exists=True,
    )
    assert not d.redo and d.checkpoint == RETIER and d.after == Tier(2, 4, world_size)
    assert d.event_step == 6 and d.data["phase"] == "optimizer"
    assert d.message == (
        "out of memory inside the optimizer step at step 6 (per-device batch 4); the checkpoint "
        "now holds tier 2 x 4: resume with --resume opt"
    )


def test_an_optimizer_oom_before_any_checkpoint_says_start_again():
    d = decide_oom(Tier(4, 2), 1, error="oom", run_id="opt", in_optimizer=True)
    assert not d.redo and d.checkpoint is None
    assert d.message.endswith("no checkpoint yet: start again at 2 x 4")


@pytest.mark.parametrize(
    "world, scope",
    [(1, {}), (2, {"rank": 1}), (1, {"in_optimizer": True, "checkpoint_exists": True})],
)
def test_at_per_device_batch_one_every_case_stops_and_records_nothing(world, scope):
    d = decide_oom(Tier(1, 4, world), 3, error="oom", run_id="r", **scope)
    assert d.after is None and not d.redo and d.checkpoint is None and d.event_step is None
    assert d.message.startswith("out of memory at per-device batch 1: nothing smaller")


# -- OomGuard applies the decision to a real monitor and checkpoint ----------------------------
def _monitor(per_device_batch=4, accum=2):
    """A rank's Monitor as the trainer makes it (its policy and base LR given), without a writer;
    no step is taken here, so it needs no optimizer (whose first use costs seconds of imports)."""
    model = torch.nn.Linear(3, 2)
    monitor = Monitor(
        None,
        model=model,
        optimizer=None,
        per_device_batch=per_device_batch,
        accum=accum,
        seq_len=8,
        world_size=1,
        device=CPU,
        policy=RampPolicy(original_batch=per_device_batch * accum, original_lr=0.1),
        base_lr=0.1,
    )
    return monitor, model


def _guard(tmp_path, per_device_batch=4, accum=2, rank=0, world_size=1):
    """A guard on a real monitor; the trainer's checkpoint writer is a list of what it was
    asked to write (tier, note)."""
    monitor, model = _monitor(per_device_batch, accum)
    state = ckpt.TrainState("r", step=5, per_device_batch=per_device_batch, accum=accum)
    written = []
    guard = OomGuard(
        state,
        monitor,
        model,
        DistInfo(rank, world_size, rank, CPU),
        checkpoint_path=tmp_path / "r.pt",
        write_checkpoint=lambda tier, note: written.append((tier, note)),
    )
    return guard, state, monitor, written


def test_guard_redo_moves_the_state_and_monitor_to_the_halved_tier(tmp_path):
    guard, state, monitor, written = _guard(tmp_path)
    assert guard.recover(Tier(4, 2), "oom") == Tier(2, 4)
    assert state.tier(1) == Tier(2, 4)
    assert (monitor.per_device_batch, monitor.accum) == (2, 4)
    assert monitor.ramps.infeasible == {4} and written == []
    # the ramp check now refuses the per-device batch that ran out of memory
    assert "ran out of memory" in monitor.ramps.check({"per_device_batch": 4, "accum": 1})


def test_guard_under_ddp_writes_the_halved_tier_with_the_note_and_stops(tmp_path):
    guard, state, monitor, written = _guard(tmp_path, 8, 2, rank=1, world_size=2)
    with pytest.raises(StopTraining, match="out of memory on rank 1") as stop:
        guard.recover(Tier(8, 2, world_size=2), "oom")
    assert stop.value.status == "failed" and stop.value.code == 3
    [(tier, note)] = written
    assert tier == Tier(4, 4, world_size=2) and note["kind"] == M.EVENT_OOM
    assert state.tier(2) == Tier(8, 2, 2)  # this process stops; the checkpoint moves
    assert monitor.ramps.infeasible == {8}


def test_guard_after_an_optimizer_oom_retiers_the_checkpoint_on_disk(tmp_path):
    guard, state, monitor, written = _guard(tmp_path)
    optimizer = torch.optim.SGD(guard.model.parameters(), lr=0.1)
    ckpt.save(tmp_path / "r.pt", state=state, model=guard.model, optimizer=optimizer, config={})
    with pytest.raises(StopTraining, match="--resume r"):
        guard.recover(Tier(4, 2), "oom", in_optimizer=True)
    saved = ckpt.load(tmp_path / "r.pt")["state"]
    assert saved.tier(1) == Tier(2, 4) and saved.infeasible_batches == [4]
    assert written == [] and monitor.ramps.infeasible == {4}


def test_guard_at_per_device_batch_one_stops_without_marking_anything(tmp_path):
    guard, state, monitor, _ = _guard(tmp_path, 1, 2)
    with pytest.raises(StopTraining, match="out of memory at per-device batch 1"):
        guard.recover(Tier(1, 2), "oom")
    assert monitor.ramps.infeasible == set() and state.tier(1) == Tier(1, 2)


# -- what a due ramp becomes for the trainer's state ------------------------------------------
def _ramp(per_device_batch, accum, before=(4, 2)):
    return Ramp(
        Tier(per_device_batch, accum), 1.5, 0.003, step=10, source="command 1", before=Tier(*before)
    )


def test_a_ramp_sets_the_tier_and_base_lr_and_replans_when_the_per_device_batch_moves():
    switch = tier_switch(Tier(4, 2), _ramp(8, 2))
    assert switch.tier == Tier(8, 2) and switch.base_lr == 0.003 and switch.replan
    by_accumulation = tier_switch(Tier(4, 2), _ramp(4, 4))
    assert by_accumulation.tier == Tier(4, 4) and not by_accumulation.replan
    assert tier_switch(Tier(4, 2), _ramp(2, 8)).replan  # smaller: plan around it too


@pytest.mark.parametrize(
    "b, ladder",
    [(1, [1, 2, 4, 8]), (2, [1, 2, 4, 8, 16]), (3, [1, 3, 6, 12, 24]), (4, [2, 4, 8, 16, 32])],
)
def test_the_plan_covers_half_to_eight_times_the_running_per_device_batch(b, ladder):
    assert plan_ladder(b) == ladder


def test_the_controller_hands_the_plan_variant_to_the_monitor_and_waits_without_a_ramp():
    monitor, _ = _monitor()
    state = ckpt.TrainState("r", step=7, per_device_batch=4, accum=2, infeasible_batches=[16])
    saves = []
    plan = GptPlan({"chunked_ce": True}, "adamw", "cpu", enabled=False)
    controller = RampController(
        state, monitor, plan, is_main=True, save_checkpoint=lambda: saves.append(1)
    )
    assert monitor.ramps.variant == M.CHUNKED_CE
    controller.at_boundary()  # no writer, no command: nothing due, no checkpoint
    assert saves == [] and state.tier(1) == Tier(4, 2)


def test_the_trainer_hands_the_checkpoints_state_to_the_monitor():
    """What the trainer's _start_monitor loads (trainer/loop.py monitor_state)."""
    monitor, _ = _monitor()
    state = ckpt.TrainState("r", step=7, per_device_batch=4, accum=2, infeasible_batches=[16])
    monitor.load_state_dict(monitor_state(state))
    assert monitor.ramps.infeasible == {16}
    assert monitor.ramps.last_ramp_step == 7


# -- a resume on another world size -----------------------------------------------------------
def test_a_resume_on_fewer_ranks_keeps_the_batch_and_records_why():
    stop_note = {"kind": M.EVENT_OOM, "message": "out of memory on rank 1", "data": {}}
    blob = {
        "state": ckpt.TrainState("o", step=2, per_device_batch=8, accum=2),
        "config": {"world_size": 2},
        "note": stop_note,
    }
    state, notes = on_resume(blob, 1)
    assert state.tier(1) == Tier(8, 4)
    assert notes[0] == stop_note and notes[1]["kind"] == M.EVENT_RESUME
    assert notes[1]["message"] == (
        "world size 2 -> 1: tier 8 x 2 -> 8 x 4 per device; batch 32 -> 32 sequences"
    )
    assert on_resume({**blob, "note": None}, 2)[1] == []  # same world, no note: nothing to say
