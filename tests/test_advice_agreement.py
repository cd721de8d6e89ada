"""The card and the monitor decide the same ramp on recorded runs.

Each run is seeded through the real store (tests/seed.py replay_run: plans, measured peaks,
OOMs, ramps, a rising noise scale) and read back with the store's reader. Then it is replayed
step by step through both deciders: the dashboard's card (dashboard/recommend.py build_card, from
the rows up to the step) and a real Monitor's auto mode (monitor/ramp_protocol.py, fed the same
estimates and memory rows at the steps they were written). At every step both must say the
same: ready or not, why, and which tiers — and the monitor's auto proposal is the card's
suggestion whenever the card says ready. (Before the advisor's `advise` and `memory_evidence`,
the card merged every plan's newest row per per-device batch where the monitor kept the newest
plan whole, and suggested ×2 where the policy ramps ×factor: "replanned" and "factor 4".) With
a finished trial ("calibrated by a trial"), both read the noise scale through its calibration:
the card from the store's trials table, the monitor from its own record of the trial's end.)"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from rampwatch.advisor.memory import GB
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.tiers import Tier
from rampwatch.advisor.trial import TrialPlan, TrialVerdict, judge
from rampwatch.dashboard import recommend
from rampwatch.dashboard.live_data import event_dict, plan_dict
from rampwatch.monitor import Monitor
from rampwatch.monitor.ramp_protocol import Ramp
from rampwatch.monitor.trial_protocol import TrialArm, TrialOutcome, TrialRequest
from rampwatch.store import names as M
from rampwatch.store.reader import Reader
from tests import seed

# a second plan of another shape (e.g. planned at another accumulation): 2 GB + 3 GB/sequence
REPLAN = {8: 26 * GB, 16: 50 * GB, 32: 98 * GB, 64: 194 * GB, 128: 386 * GB}
FIRST_PLAN = {4: 24 * GB, 8: 28 * GB, 16: 36 * GB, 32: 52 * GB, 64: 84 * GB}

TRIAL_STEP = 60  # a ×2, ×4 trial at 8 × 2 that passes both: the run continues at 8 × 8
GNS_AT_TRIAL = 4.0 * 20 ** (TRIAL_STEP / 300)  # seed.replay_run's noise scale there
TRIAL_VERDICT = judge(
    TrialPlan(batch=16, ks=(2, 4), delta_tokens=64, rule="sqrt"),
    3.0,
    [2.0, 2.2, 1.9, 2.1],
    {2: [2.0, 2.2, 1.9, 2.1], 4: [2.01, 2.21, 1.91, 2.11]},
    b_simple=GNS_AT_TRIAL,
).to_dict()

RUNS = {
    # the newest plan alone puts per-device batch 16 at 49.6 GB; mixed with the first plan's
    # point at 4, 49.3 GB: usable memory between the two decides the x2 tier
    "replanned": dict(
        plans=((0, FIRST_PLAN), (120, REPLAN)),
        ooms=((60, 64),),
        capacity=49.46 * GB / 0.95,
    ),
    # the auto ramp is x4: the card's suggestion must be the same tier
    "factor 4": dict(policy={"factor": 4}),
    # an accumulation ramp at 150 (hysteresis restarts), then an OOM at 16
    "ramped, then oom": dict(ramps=((150, 8, 4),), ooms=((200, 16),)),
    # the trial's calibration (64 / B_simple ≈ 8.8) moves the ramp point: both read it
    "calibrated by a trial": dict(
        trials=((TRIAL_STEP, TRIAL_VERDICT),), ramps=((TRIAL_STEP, 8, 8),)
    ),
}


def _series(reader: Reader, run_id: str, name: str) -> dict[int, float]:
    s = reader.series(run_id, name, width=1)
    return dict(zip(s.last_step.tolist(), s.last.tolist(), strict=True))


class Recorded:
    """One recorded run as the store's reader gives it."""

    def __init__(self, rec: seed.Recorded):
        reader = Reader(rec.db)
        self.run = reader.get_run(rec.run_id)
        self.events = [event_dict(e) for e in reader.events(rec.run_id)]
        self.plan = [plan_dict(p) for p in reader.memory_plan(rec.run_id)]
        names = (M.GNS, M.GNS_LOW, M.PER_DEVICE_BATCH, M.ACCUM, M.BATCH_SEQS, M.MEM_CAPACITY)
        self.metrics = {n: _series(reader, rec.run_id, n) for n in names}
        self.steps = rec.steps
        self.trials = reader.trials(rec.run_id)

    def card(self, k: int) -> recommend.Card:
        """The card as the live page builds it once the run has logged step k (a ramp recorded
        at the boundary after k is not in yet)."""
        gns = [s for s in sorted(self.metrics[M.GNS_LOW]) if s <= k]
        latest = {n: v[max(s for s in v if s <= k)] for n, v in self.metrics.items() if v}
        run = {
            "run_id": self.run.run_id,
            "config": self.run.config,
            "world_size": self.run.world_size,
            "capacity_bytes": self.run.capacity_bytes,
            "last_step": k,
        }
        events = [
            e
            for e in self.events
            if e["step"] < k or (e["step"] == k and e["kind"] != M.EVENT_RAMP)
        ]
        return recommend.build_card(
            run,
            latest,
            gns,
            [self.metrics[M.GNS].get(s) for s in gns],
            events,
            [p for p in self.plan if p["step"] <= k],
            (),
            [self.metrics[M.GNS_LOW][s] for s in gns],
            trials=[t for t in self.trials if t.continue_step is not None and t.continue_step <= k],
        )


def _monitor(recorded: Recorded) -> Monitor:
    """A rank's Monitor as the trainer makes it, in auto mode, on the recorded run's device."""
    config = recorded.run.config
    mon = Monitor(
        None,
        model=torch.nn.Linear(3, 2),
        optimizer=None,
        per_device_batch=config["per_device_batch"],
        accum=config["accum"],
        seq_len=config["seq_len"],
        world_size=1,
        device=torch.device("cpu"),
        ramp="auto",
        policy=RampPolicy.from_config(config),
        base_lr=config["lr"],
        capacity_bytes=recorded.run.capacity_bytes,  # the recorded device's, not this machine's
    )
    return mon


def _replay(recorded: Recorded):
    """(step, the monitor's advice, its auto proposal, the card) at every step of the run."""
    mon = _monitor(recorded)
    rows = defaultdict(list)
    for p in recorded.plan:
        rows[p["step"]].append(p)
    ramps = {e["step"]: e for e in recorded.events if e["kind"] == M.EVENT_RAMP}
    for k in range(recorded.steps):
        if k in recorded.metrics[M.GNS_LOW]:
            mon.ramps.observe(
                k, {M.GNS: recorded.metrics[M.GNS][k], M.GNS_LOW: recorded.metrics[M.GNS_LOW][k]}
            )
        by_source = defaultdict(list)
        for p in rows.get(k, ()):
            by_source[p["source"]].append(p)
        for source, group in by_source.items():
            mon.ramps.write_plan_rows(group, source, k)
        for t in recorded.trials:  # the loop ends the recorded trial at this boundary
            if t.continue_step == k:
                mon.ramps.trials.ended(mon.event, _outcome(mon, t))
        yield k, mon.ramps.advise(), mon.ramps._auto(k), recorded.card(k)
        if k in ramps:  # the loop applies the recorded ramp at this boundary
            tier = Tier.from_payload(ramps[k]["data"]["after"], mon.world_size)
            lr = mon.ramps.policy.new_base_lr(tier.batch)
            mon.ramp_applied(Ramp(tier, lr / mon.ramps.base_lr, lr, k, "recorded", None, mon.tier))


def _outcome(mon: Monitor, trial) -> TrialOutcome:
    """The recorded trial as the monitor's run_trial returns it (its own verdict, not the row)."""
    verdict = TrialVerdict.from_dict(trial.verdict)
    lr = mon.ramps.policy.new_base_lr
    arms = tuple(TrialArm(k, Tier(8, 2 * k), lr(16 * k)) for k in verdict.plan.ks)
    req = TrialRequest(
        trial.trial_id, trial.start_step, mon.tier, mon.ramps.base_lr, 64, 1, "sqrt", arms, "auto"
    )
    return TrialOutcome(req, verdict, req.arm(verdict.kept_k), 1.0)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_card_and_the_monitor_agree_at_every_step(tmp_path, name):
    recorded = Recorded(seed.replay_run(tmp_path / "r.duckdb", **RUNS[name]))
    disagree, ready = [], 0
    for k, advice, proposal, card in _replay(recorded):
        # the same decision (reason, evidence, forecast) and the same tiers, every step
        assert card.decision == advice.decision, k
        assert (card.evidence, card.policy) == (advice.evidence, advice.policy), k
        assert [v.option for v in card.tiers] == [t.option for t in advice.tiers], k
        assert (card.memory_model, card.usable_bytes) == (advice.memory_model, advice.usable_bytes)
        s = card.suggested
        expected = (
            (s.option.tier.per_device_batch, s.option.tier.accum)
            if card.decision.ready and s is not None and s.fits
            else None
        )
        got = None if proposal is None else (proposal.tier.per_device_batch, proposal.tier.accum)
        ready += expected is not None
        if got != expected:
            disagree.append((k, got, expected))
    assert ready > 10  # the run does reach its ramp point
    if recorded.trials:  # after the trial, both say what the decision rests on
        c = TRIAL_VERDICT["calibration"]
        assert c == pytest.approx(64 / GNS_AT_TRIAL)
        assert card.evidence == (
            f"noise scale × {c:.3g} from auto trial 1 at step {TRIAL_STEP}, "
            f"{recorded.steps - 1 - TRIAL_STEP} steps ago"
        )
    assert not disagree, f"(step, monitor, card): {disagree[:3]} … ({len(disagree)} steps)"
