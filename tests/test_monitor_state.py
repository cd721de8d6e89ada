"""What a resume continues: Monitor.state_dict() / load_state_dict() (monitor/monitor.py), as the
trainer's checkpoint keeps it (trainer/loop.py monitor_state, keep_monitor_state: TrainState's
own fields, so checkpoints written before state_dict() existed resume as they are) and as the
Hugging Face restart's rampwatch.json keeps it (the same keys at its top level).

A monitor that ran real steps on a small least-squares model saves its state through JSON and a
weights_only torch checkpoint; a new monitor loaded from it holds the same values, makes the same
ramp checks (where a fresh one decides otherwise) and logs the same next step.
"""

from __future__ import annotations

import json

import pytest
import torch

from rampwatch.advisor.advice import TrialEvidence
from rampwatch.advisor.gns_window import NoiseScaleWindow
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.tiers import Tier
from rampwatch.monitor import Monitor
from rampwatch.monitor.ramp_protocol import Ramp
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.loop import keep_monitor_state, monitor_state

torch.set_num_threads(1)
CPU = torch.device("cpu")
GB = 2**30
# the batches the checks are asked about: the one that ran out of memory, one larger than any
# measured (judged by the measured line), the running tier itself
PAYLOADS = [
    {"per_device_batch": 8, "accum": 1},
    {"per_device_batch": 16, "accum": 1},
    {"per_device_batch": 64, "accum": 1},
    {"per_device_batch": 4, "accum": 2},
]
# what the next step logs that the state decides (not its time or memory)
CONTINUED = (M.TOKENS_SEEN, M.GNS, M.GNS_LOW, M.GNS_HIGH, M.GNS_WINDOW, M.GNS_G2, M.GNS_TRACE)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 6, generator=g)
    y = x @ torch.randn(6, 3, generator=g) + 0.5 * torch.randn(512, 3, generator=g)
    return x, y


def _monitor(model, per_device_batch=2, accum=2, **kw) -> Monitor:
    """A rank's monitor as a loop that resumes makes it: at the tier its own checkpoint names."""
    return Monitor(
        None,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),  # never stepped: frozen weights
        per_device_batch=per_device_batch,
        accum=accum,
        seq_len=4,
        world_size=1,
        device=CPU,
        capacity_bytes=64 * GB,
        noise_window=NoiseScaleWindow(min_steps=3),
        policy=RampPolicy(original_batch=4, original_lr=0.1),
        **kw,
    )


def _step(monitors, model, step: int, data, b: int, k: int) -> list[dict]:
    """One optimizer step's micro-batches, each backward seen by every monitor."""
    x, y = data
    for j in range(k):
        i = (torch.arange(b) + b * (k * step + j)) % len(x)
        loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
        (loss / k).backward()
        for mon in monitors:
            mon.after_backward()
    out = [mon.step(step, 0.0) for mon in monitors]
    model.zero_grad(set_to_none=True)
    return out


def _ran(model, data) -> Monitor:
    """Eight steps at 2 x 2, a ramp to 4 x 2 after step 8 (its LR moved, as a loop does), an OOM
    at 8, measured peaks at 2 and 4, two more steps: every part of the state has moved from a
    fresh monitor's."""
    mon = _monitor(model)
    for step in range(1, 9):
        _step([mon], model, step, data, 2, 2)
    ramp = Ramp(Tier(4, 2), 1.5, 0.15, step=8, source="test", before=Tier(2, 2))
    ramp.scale_lr(mon.optimizer)
    mon.ramp_applied(ramp)
    mon.report_oom(8, 8, "out of memory")
    mon.add_memory_plan(
        [
            {"per_device_batch": 2, "measured_bytes": 20 * GB},
            {"per_device_batch": 4, "measured_bytes": 24 * GB},
        ],
        "probe",
    )
    for step in (9, 10):
        _step([mon], model, step, data, 4, 2)
    return mon


def test_a_saved_state_gives_a_new_monitor_the_same_values_and_decisions(tmp_path):
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _ran(model, data)
    saved = mon.state_dict()
    assert saved["step"] == 10 and saved["last_ramp_step"] == 8 and saved["base_lr"] == 0.15
    assert mon.lr_scale == pytest.approx(1.5, rel=1e-15) and saved["start_base_lr"] == 0.1
    assert saved["tokens_seen"] == (8 * 4 + 2 * 8) * 4 and saved["infeasible"] == [8]
    assert mon.noise_scale is not None

    # plain values: through JSON, and through a torch checkpoint read with weights_only=True
    state = json.loads(json.dumps(saved))
    torch.save({"monitor": state}, tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=True)["monitor"] == state

    resumed, fresh = _monitor(model, 4, 2), _monitor(model, 4, 2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == saved and resumed.lr_scale == mon.lr_scale
    assert resumed.noise_scale == mon.noise_scale
    checks = [mon.ramps.check(p) for p in PAYLOADS]
    assert [resumed.ramps.check(p) for p in PAYLOADS] == checks
    assert [fresh.ramps.check(p) for p in PAYLOADS] != checks  # the state is what decided
    assert "ran out of memory" in checks[0] and "already uses" in checks[3]

    # the next step continues the tokens and the noise-scale window as the first monitor does
    before, after = _step([mon, resumed], model, 11, data, 4, 2)
    assert M.GNS_LOW in before and after[M.TOKENS_SEEN] == saved["tokens_seen"] + 8 * 4
    assert {k: after.get(k) for k in CONTINUED} == {k: before.get(k) for k in CONTINUED}


def test_a_trainer_checkpoint_keeps_the_monitor_state_in_its_own_fields(tmp_path):
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _ran(model, data)
    state = ckpt.TrainState(
        "r", step=10, tokens_seen=mon.tokens_seen, per_device_batch=4, accum=2, base_lr=0.15
    )
    keep_monitor_state(state, mon.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save(tmp_path / "r.pt", state=state, model=model, optimizer=opt, config={})
    # on disk: the fields every checkpoint has had, so older ones read the same way
    on_disk = torch.load(tmp_path / "r.pt", weights_only=True)["state"]
    assert set(on_disk) == {
        "run_id",
        "step",
        "next_sample",
        "tokens_seen",
        "per_device_batch",
        "accum",
        "base_lr",
        "infeasible_batches",
        "noise_window",
        "trials",
    }

    resumed = _monitor(model, 4, 2)
    resumed.load_state_dict(monitor_state(ckpt.load(tmp_path / "r.pt")["state"]))
    assert resumed.noise_scale == mon.noise_scale and resumed.tokens_seen == mon.tokens_seen
    assert resumed.ramps.infeasible == {8} and resumed.ramps.base_lr == 0.15
    assert resumed.lr_scale == mon.lr_scale  # over the run's original LR (the policy's)
    assert resumed.ramps.last_ramp_step == 10  # the resume step: the hysteresis starts there
    assert resumed.ramps.measured == {} and resumed.last_step == 0  # measured again, as ever


def test_the_trial_protocols_state_rides_the_trainer_checkpoint(tmp_path):
    """A monitor with trial_delta_from_loss keeps each step's loss against tokens seen; the
    trainer's checkpoint keeps the trial protocol's state (TrainState.trials), so a resumed run
    chooses Δ from the same curve, reads the noise scale through the latest trial's calibration
    and asks for the held-out batch the last trial named; a monitor without it keeps no curve."""
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _monitor(model, trials=True, trial_delta_from_loss=True)
    for step in range(1, 6):
        _step([mon], model, step, data, 2, 2)
    history = mon.state_dict()["trials"]["loss_history"]
    assert history["tokens"] == [16 * s for s in range(1, 6)] and len(history["losses"]) == 5
    mon.ramps.trials.latest = TrialEvidence(trial_id=3, step=4, coefficient=2.5, passed=True)
    mon.ramps.trials.tell, mon.ramps.trials.last_start_tokens = 900, 48
    state = ckpt.TrainState("r", step=5, tokens_seen=mon.tokens_seen, per_device_batch=2, accum=2)
    keep_monitor_state(state, mon.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save(tmp_path / "r.pt", state=state, model=model, optimizer=opt, config={})
    resumed = _monitor(model, trials=True, trial_delta_from_loss=True)
    resumed.load_state_dict(monitor_state(ckpt.load(tmp_path / "r.pt")["state"]))
    trials = resumed.ramps.trials
    assert trials.history.to_dict() == history
    assert (trials.latest, trials.tell, trials.last_start_tokens) == (
        mon.ramps.trials.latest,
        900,
        48,
    )
    assert _monitor(model).state_dict()["trials"]["loss_history"] is None


def test_a_checkpoint_that_kept_the_loss_curve_alone_resumes_it(tmp_path):
    """Checkpoints before TrainState.trials kept the trial protocol's loss curve in a field of
    its own (loss_history): a resume reads it into the protocol's state."""
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _monitor(model, trials=True, trial_delta_from_loss=True)
    for step in range(1, 4):
        _step([mon], model, step, data, 2, 2)
    history = mon.state_dict()["trials"]["loss_history"]
    state = ckpt.TrainState("r", step=3, tokens_seen=mon.tokens_seen).to_dict()
    del state["trials"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blob = {"state": {**state, "loss_history": history}, "model": model.state_dict()}
    torch.save({**blob, "optimizer": opt.state_dict(), "config": {}}, tmp_path / "old.pt")
    resumed = _monitor(model, trials=True, trial_delta_from_loss=True)
    resumed.load_state_dict(monitor_state(ckpt.load(tmp_path / "old.pt")["state"]))
    assert resumed.ramps.trials.history.to_dict() == history


def test_a_checkpoint_written_before_state_dict_resumes_the_monitor(tmp_path):
    """The blob as the trainer wrote it before (TrainState's fields filled from mon.noise and
    mon.ramps.infeasible), written with torch.save itself; and one from before base_lr was kept
    (0.0): the monitor keeps its start's base LR."""
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _ran(model, data)
    state = {
        "run_id": "old",
        "step": 10,
        "next_sample": 48,
        "tokens_seen": mon.tokens_seen,
        "per_device_batch": 4,
        "accum": 2,
        "base_lr": 0.0,
        "infeasible_batches": [8],
        "noise_window": mon.noise.to_dict(),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blob = {"state": state, "model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save({**blob, "config": {}}, tmp_path / "old.pt")

    resumed = _monitor(model, 4, 2)
    resumed.load_state_dict(monitor_state(ckpt.load(tmp_path / "old.pt")["state"]))
    assert resumed.noise_scale == mon.noise_scale and resumed.tokens_seen == mon.tokens_seen
    assert resumed.ramps.infeasible == {8} and resumed.ramps.last_ramp_step == 10
    assert resumed.ramps.base_lr == 0.1  # the optimizer's LR, as the monitor starts with
    checks = [resumed.ramps.check(p) for p in PAYLOADS[:1]]
    assert "ran out of memory" in checks[0]


def test_a_hugging_face_restart_file_from_before_resumes_the_monitor():
    """rampwatch.json as integrations/transformers.py wrote it before: the monitor's values at its
    top level beside its own keys, and no last ramp (that run resumed with 0, as this one does)."""
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _ran(model, data)
    old = {
        "version": 1,
        "run_id": "hf",
        "step": 10,
        "per_device_batch": 4,
        "accum": 2,
        "samples_seen": 48,
        "stream": True,
        "tokens_seen": mon.tokens_seen,
        "base_lr": 0.15,
        "policy": mon.policy.to_config(),
        "noise_window": mon.noise.to_dict(),
        "infeasible": [8],
        "measured": {"2": 20 * GB, "4": 24 * GB},
        "ramp": None,
    }
    resumed = _monitor(model, 4, 2)
    resumed.load_state_dict(json.loads(json.dumps(old)))
    assert resumed.state_dict() == {**mon.state_dict(), "last_ramp_step": 0}
    assert [resumed.ramps.check(p) for p in PAYLOADS] == [mon.ramps.check(p) for p in PAYLOADS]


def test_a_ramp_whose_lr_never_moved_is_taken_back_out_of_the_state():
    """The loop takes the tier but leaves its LR (the optimizer's 0.1 throughout): after the two
    checked steps the base LR and lr_scale are the run's own again, and so is what it saves."""
    model, data = torch.nn.Linear(6, 3), _data()
    mon = _monitor(model)
    for step in range(1, 9):
        _step([mon], model, step, data, 2, 2)
    mon.ramp_applied(Ramp(Tier(4, 2), 1.5, 0.15, step=8, source="test", before=Tier(2, 2)))
    assert mon.ramps.base_lr == 0.15 and mon.lr_scale > 1.49  # what the ramp asked
    _step([mon], model, 9, data, 4, 2)
    assert mon.lr_scale > 1.49  # one step is not enough to judge
    _step([mon], model, 10, data, 4, 2)
    assert mon.lr_scale == 1.0 and mon.state_dict()["base_lr"] == 0.1
