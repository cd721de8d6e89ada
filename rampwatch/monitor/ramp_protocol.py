"""The ramp protocol: at a step boundary any loop asks its monitor whether a ramp is due, applies
it, and says so — the one implementation of claim / check / apply / refuse / auto.

    ramp = mon.ramp_due()                    # None, or a Ramp already checked against memory
    if ramp is not None:                     # and the policy; the new tier runs from ramp.step + 1
        batch, accum = ramp.per_device_batch, ramp.accum   # your loader, your accumulation
        ramp.scale_lr(optimizer, scheduler)  # the LR rule, on the scheduler's base LRs too
        mon.ramp_applied(ramp)               # or mon.ramp_refused(ramp, "why not")

Owns: `Ramp` (the value a loop acts on), `scale_lr` (an LR move that survives any scheduler) and
`RampProtocol` (the monitor's part: commands the writer's flusher claimed, the memory check, the
`ramp="auto"` policy, the measured memory plan, their state for a resume). It works with what
the Monitor hands it (the writer, the `RunningTier`, the policy, an event and an alert function),
never with the Monitor itself. A tier is advisor/tiers.py's `Tier` and the run as it is now
advisor/advice.py's `RunningTier`, which the protocol holds and Monitor.set_tier replaces. Under
torch.distributed its decisions travel through monitor/ramp_channel.py `RampChannel` (rank 0
decides, every rank learns the same ramp at the same boundary); RampChannel and RunningTier are
re-exported here.

Trial commands come through the same claim: `_decide` hands one to monitor/trial_protocol.py's
TrialProtocol (the check, the arms' tiers by advise()), the channel carries it like a ramp, and
`due` leaves the request for Monitor.trial_due() instead of returning a Ramp; `trial_done`
reports its command applied at the step the run continued from, or refused. Under the policy's
trial gate, `ramp="auto"` ramps only through trials: `_auto` asks TrialProtocol.auto for one
(monitor/trial_protocol.py) instead of proposing a ramp, and the kept branch is the ramp.
Every advise() here carries the latest finished trial's evidence (TrialProtocol.latest), as the
card's does from the store's trials table.

Why the checks live here and not in the dashboard: the memory picture may have changed (an OOM,
a new measurement) since the operator clicked, so a command is checked again at the boundary.
Every command ends exactly once: applied at step N, or refused with a reason.

After an applied ramp the protocol checks that its LR change reached the optimizer: the LR the
loop logs at the next two steps against its own schedule extended past the ramp
(advisor/lr_check.py). A change the run did not carry out is an alert that says so (the ramp's
event stays as it was written, the alert follows it) and is taken back out of the base LR and
`lr_scale`, so nothing the monitor records or hands on claims it. A check still open at a
process restart (the Hugging Face restart) is not carried over.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rampwatch.advisor.advice import Advice, MemoryEvidence, RunningTier, advise, memory_evidence
from rampwatch.advisor.lr_check import CAUSE as LR_CHECK
from rampwatch.advisor.lr_check import NOT_REACHED, UNDONE, LrCheck
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.tiers import Tier
from rampwatch.monitor.ramp_channel import Proposal, RampChannel
from rampwatch.monitor.trial_protocol import TrialProtocol
from rampwatch.store import CommandError, RunWriter
from rampwatch.store import names as M
from rampwatch.store.commands import validate as validate_command

# RampChannel and RunningTier (advisor/advice.py's): re-exported
__all__ = [
    "MODES",
    "Ramp",
    "RampChannel",
    "RampProtocol",
    "RunningTier",
    "check_mode",
    "check_mode_name",
    "scale_lr",
]

MODES = ("manual", "auto", "off")
AUTO_PAUSED = (
    "auto ramps are paused until a ramp's LR change is carried out: fix the loop's LR, then "
    "approve the next ramp on the dashboard"
)
AUTO_RESUMED = "auto ramps resume: this ramp's LR change was carried out"
HISTORY = 2000  # noise-scale points kept for the auto policy (covers its window and min samples)
# scheduler and param-group keys that hold a learning rate (torch.optim.lr_scheduler's own)
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LR_ATTRS = ("base_lrs", "max_lrs", "min_lrs")


@dataclass(frozen=True)
class Ramp:
    """A ramp due at the boundary after `step`: the loop runs `tier` from step + 1 and moves
    its LR by lr_multiplier (base_lr is the new base the policy's rule gives)."""

    tier: Tier
    lr_multiplier: float
    base_lr: float
    step: int
    source: str  # "command 7" or "auto: <the policy's reason>"
    command_id: int | None = None
    before: Tier = Tier(1, 1)  # the tier it replaces

    # what a loop reads to switch its loader and accumulation (the README's snippet)
    @property
    def per_device_batch(self) -> int:
        return self.tier.per_device_batch

    @property
    def accum(self) -> int:
        return self.tier.accum

    def scale_lr(self, optimizer, scheduler=None) -> None:
        scale_lr(optimizer, self.lr_multiplier, scheduler)


def scale_lr(optimizer, multiplier: float, scheduler=None) -> None:
    """Multiply every LR the optimizer and its scheduler keep by `multiplier`.

    A scheduler rewrites group["lr"] every step from its base LRs (LambdaLR, the Hugging Face
    warmup schedules, CosineAnnealingLR's closed form) or from the group's own keys (OneCycleLR's
    max_lr / initial_lr / min_lr), so scaling only the current LR is undone at the next step.
    Chained and sequential schedulers are scaled through their children."""
    if not (math.isfinite(multiplier) and multiplier > 0):
        raise ValueError(f"LR multiplier must be a positive number, got {multiplier!r}")
    for group in optimizer.param_groups:
        for key in _GROUP_LR_KEYS:
            if isinstance(group.get(key), (int, float)):
                group[key] = group[key] * multiplier
    seen: set[int] = set()
    todo = [scheduler] if scheduler is not None else []
    while todo:
        s = todo.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        for attr in _SCHEDULER_LR_ATTRS:
            values = getattr(s, attr, None)
            if isinstance(values, (list, tuple)):
                setattr(s, attr, type(values)(v * multiplier for v in values))
        if isinstance(getattr(s, "_last_lr", None), list):
            s._last_lr = [v * multiplier for v in s._last_lr]
        todo.extend(getattr(s, "_schedulers", None) or ())


def check_mode_name(mode: str) -> None:
    """ValueError unless `mode` is one of MODES (the integrations call it when made)."""
    if mode not in MODES:
        raise ValueError(f"ramp={mode!r}: one of {', '.join(MODES)}")


def check_mode(mode: str, policy: RampPolicy, trials: TrialProtocol) -> None:
    """ValueError unless `mode` is one of MODES and can run with this policy and these trials
    (Monitor.start calls it before the run exists)."""
    check_mode_name(mode)
    if mode == "auto" and policy.gate == "trial" and not trials.enabled:
        raise ValueError(
            "ramp='auto' with the policy's trial gate ramps only through trials, and this "
            f"loop runs none ({trials.note or 'trials=False'}): start the monitor with "
            "trials=True and run what trial_due() returns, or use gate 'noise'"
        )


@dataclass
class RampProtocol:
    """The monitor's ramp state. `Monitor` owns one and hands it what it works with; loops use it
    through Monitor.ramp_due, ramp_applied, ramp_refused and report_oom."""

    writer: RunWriter | None  # rank 0's; other ranks decide nothing and write nothing
    running: RunningTier  # the run now: Monitor.set_tier replaces it (one home for the tier)
    policy: RampPolicy
    event: Callable[[int, str, str, dict], None]  # one event of the run (Monitor.event)
    failed: Callable[[str, Exception, int], None]  # an error of its own: one alert, never raised
    mode: str = "manual"
    base_lr: float = 0.0  # the schedule's base LR now (the policy's rule moves it)
    start_base_lr: float = 0.0  # the base LR before any ramp (default: the policy's original)
    # an alert only the loop's author can fix (Monitor._alert_author: stderr too); else event
    author_alert: Callable[[int, str, dict], None] | None = None
    variant: str = "plain"  # which memory-plan rows describe this run (the trainer: chunked CE)
    channel: RampChannel | None = None
    infeasible: set[int] = field(default_factory=set)
    measured: dict[int, int] = field(default_factory=dict)
    # devices the parameters are sharded over (FSDP, ZeRO: the world size; a replica: 1): the
    # per-device peaks, and the batches that ran out of memory, hold at this count only
    shards: int = 1
    plan_rows: list[dict] = field(default_factory=list)
    plan_pending: bool = False  # a plan is on its way: auto waits for it before a larger batch
    last_ramp_step: int = 0
    stop_requested: bool = False  # this process was asked to stop (e.g. SIGTERM)
    # auto took a ramp whose LR change the loop did not carry out: no more auto ramps until an
    # approved one's is (each would grow the batch at the old LR again)
    auto_paused: bool = False
    trials: TrialProtocol = field(default_factory=TrialProtocol)  # trial commands: its checks

    def __post_init__(self):
        check_mode(self.mode, self.policy, self.trials)
        self.tokens = 0  # tokens seen at the last step (the trial gate's interval counts them)
        self.base_lr = self.base_lr or self.policy.original_lr
        self.start_base_lr = self.start_base_lr or self.policy.original_lr
        self.lr_check: LrCheck | None = None  # the last ramp's, until it has an outcome
        self._logged_lr: dict[int, float] = {}  # step -> LR logged, the last two steps
        self._checked_bases = (0.0, 0.0)  # the checked ramp's base LR before and after
        self._gns_steps: list[int] = []  # steps with a fresh noise-scale estimate
        self._gns_values: list[float | None] = []
        self._gns_lower: list[float] = []
        self._handled: set[int] = set()
        self._in_flight: set[int] = set()  # commands decided, not yet reported applied/refused
        self._unanswered: Ramp | None = None  # returned by due(), not yet applied or refused
        self._plan = None  # a memory plan running in a child process (monitor/memplan.py)

    @property
    def stopping(self) -> bool:
        """Stop at this boundary: asked here (one process), or rank 0 was asked one boundary
        earlier (torch.distributed: every rank stops at the same boundary)."""
        return self.channel.stopping if self.channel is not None else self.stop_requested

    @property
    def lr_scale(self) -> float:
        """The base LR now over the base before any ramp: the product of the applied ramps'
        lr_multiplier (less any the LR check found not carried out)."""
        return self.base_lr / self.start_base_lr if self.start_base_lr > 0 else 1.0

    # -- what a resume continues (Monitor.state_dict) -----------------------------------------
    def state_dict(self) -> dict:
        return {
            "base_lr": self.base_lr,
            "start_base_lr": self.start_base_lr,
            "last_ramp_step": self.last_ramp_step,
            "infeasible": sorted(self.infeasible),
            "measured": {str(b): v for b, v in sorted(self.measured.items())},  # JSON keys
            "shards": self.shards,
            "auto_paused": self.auto_paused,
            "trials": self.trials.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("base_lr"):  # 0 or none (older checkpoints): the start's base stays
            self.base_lr = float(state["base_lr"])
        if state.get("start_base_lr"):  # none (the trainer's own fields): the policy's original
            self.start_base_lr = float(state["start_base_lr"])
        self.last_ramp_step = int(state.get("last_ramp_step", self.last_ramp_step))
        self.auto_paused = bool(state.get("auto_paused", self.auto_paused))
        shards = int(state.get("shards", 1))  # saved before shard counts were: a replica
        if shards == self.shards:
            self.infeasible = {int(b) for b in state.get("infeasible", self.infeasible)}
            self.measured = {int(b): int(v) for b, v in state.get("measured", {}).items()}
        elif state.get("measured") or state.get("infeasible"):
            self.event(
                int(state.get("step", 0)),
                M.EVENT_RESUME,
                f"memory peaks measured with the model on {shards} shard(s) dropped: this "
                f"launch shards it over {self.shards}, so its per-device peaks are measured anew",
                {"shards_before": shards, "shards": self.shards},
            )
        self.trials.load_state_dict(state.get("trials") or {})
        self.tokens = int(state.get("tokens_seen", self.tokens))  # Monitor.state_dict's

    # -- fed by Monitor.step ------------------------------------------------------------------
    def observe(self, step: int, metrics: dict) -> None:
        self.tokens = int(metrics.get(M.TOKENS_SEEN, self.tokens))
        self._observe_lr(step, metrics.get(M.LR))
        if M.GNS_LOW in metrics:  # a fresh estimate this step (a point, a bound or both)
            self._gns_steps.append(step)
            self._gns_values.append(metrics.get(M.GNS))
            self._gns_lower.append(metrics[M.GNS_LOW])
            if len(self._gns_steps) > HISTORY:  # ramp_decision's cost grows with the history
                del self._gns_steps[:-HISTORY], self._gns_values[:-HISTORY]
                del self._gns_lower[:-HISTORY]
        peak = metrics.get(M.MEM_PEAK)
        b = self.running.tier.per_device_batch
        if peak is None or not math.isfinite(peak) or b in self.infeasible:
            return
        if peak > self.measured.get(b, 0) * 1.01:  # new information only
            self.write_plan_rows(
                [{"per_device_batch": b, "measured_bytes": int(peak)}], "measured", step
            )

    def _observe_lr(self, step: int, lr: float | None) -> None:
        if lr is None:
            return
        self._logged_lr = {s: v for s, v in self._logged_lr.items() if s == step - 1}
        self._logged_lr[step] = lr
        if self.lr_check is not None:
            outcome = self.lr_check.observe(step, lr)
            if outcome is not None:
                self._lr_checked(step, outcome)

    def _start_lr_check(self, ramp: Ramp, old_base_lr: float) -> None:
        """After an applied ramp: check its LR change at the next steps (advisor/lr_check.py),
        when the LR was logged at its step (not after a trial, whose arms log none)."""
        if self.lr_check is not None:  # a ramp right after another: judge that one on what it has
            outcome = self.lr_check.outcome()
            if outcome is not None:
                self._lr_checked(max(self.lr_check.ratios, default=ramp.step), outcome)
        at = self._logged_lr.get(ramp.step)
        self._checked_bases = (old_base_lr, ramp.base_lr)
        self.lr_check = (
            None
            if at is None
            else LrCheck.start(
                ramp.step, ramp.lr_multiplier, at, self._logged_lr.get(ramp.step - 1)
            )
        )

    def _lr_checked(self, step: int, outcome: str) -> None:
        check, self.lr_check = self.lr_check, None
        message = check.message(outcome)
        if message is None:  # reached
            if self.auto_paused:
                self.auto_paused = False
                self.event(step, M.EVENT_ALERT, AUTO_RESUMED, {"cause": LR_CHECK})
            return
        if outcome in (NOT_REACHED, UNDONE):  # the run's base LR is what it was
            before, after = self._checked_bases
            # exactly the old base, unless a later ramp moved it since (then by the multiplier)
            self.base_lr = before if self.base_lr == after else self.base_lr / check.multiplier
            if self.mode == "auto":
                self.auto_paused = True
                message += f"; {AUTO_PAUSED}"
        data = {
            "cause": LR_CHECK,
            "outcome": outcome,
            "ramp_step": check.step,
            "lr_multiplier": check.multiplier,
            "lr_ratios": {str(s): q for s, q in sorted(check.ratios.items())},
            "base_lr": self.base_lr,
            "auto_paused": self.auto_paused,
        }
        (self.author_alert or self._alert)(step, message, data)

    def _alert(self, step: int, message: str, data: dict) -> None:
        self.event(step, M.EVENT_ALERT, message, data)

    def write_plan_rows(self, rows, source: str, step: int | None = None) -> None:
        """Memory rows of any source: what they say is what the checks know (a measured peak,
        a per-device batch that ran out of memory, a plan), and the store gets them for the card."""
        for r in rows:
            b = int(r["per_device_batch"])
            if r.get("feasible") is False:
                self.infeasible.add(b)
            elif r.get("measured_bytes"):
                self.measured[b] = max(self.measured.get(b, 0), int(r["measured_bytes"]))
        if source == "plan":
            good = [r for r in rows if r.get("error") is None]
            if good:
                self.plan_rows = good
        if self.writer is None:
            return
        for r in rows:
            self.writer.memory_plan(
                r["per_device_batch"],
                variant=r.get("variant", self.variant),
                predicted_bytes=r.get("predicted_bytes"),
                measured_bytes=r.get("measured_bytes"),
                source=source,
                feasible=r.get("feasible"),
                step=step,
                breakdown=r.get("breakdown") or ({"error": r["error"]} if r.get("error") else None),
            )

    def start_plan(self, handle) -> None:
        """A plan running in a child process (memplan.PlanHandle): polled at each boundary, its
        rows written when in; a plan still running is replaced."""
        if self._plan is not None:
            self._plan.cancel()
        self._plan, self.plan_pending = handle, True

    def _poll_plan(self, step: int) -> None:
        if self._plan is None or not self._plan.done():
            return
        rows, self._plan = self._plan.result() or [], None
        self.write_plan_rows(rows, "plan", step)
        self.plan_pending = False
        failed = [r for r in rows if r.get("error")]
        if failed:  # said, never guessed: the card keeps to what was measured
            self.event(
                step,
                M.EVENT_ALERT,
                f"memory plan failed at per-device batch "
                f"{', '.join(str(r['per_device_batch']) for r in failed)}: "
                f"{failed[0]['error']}",
                {"errors": {str(r["per_device_batch"]): r["error"] for r in failed}},
            )

    def mark_infeasible(self, per_device_batch: int, step: int) -> None:
        self.write_plan_rows(
            [{"per_device_batch": per_device_batch, "feasible": False}], "oom", step
        )

    def memory_evidence(self) -> MemoryEvidence:
        """What this process knows of memory, through the advisor's one builder (the card
        builds its own from the store's rows with the same function)."""
        measured = [
            {"per_device_batch": b, "measured_bytes": v, "variant": self.variant}
            for b, v in self.measured.items()
        ]
        return memory_evidence([*self.plan_rows, *measured], self.variant, self.infeasible)

    def advise(self) -> Advice:
        """The advisor's advice for the running tier, from this process's evidence."""
        return advise(
            self.policy,
            self.running,
            self._gns_steps,
            self._gns_values,
            self._gns_lower,
            self.memory_evidence(),
            since_step=self.last_ramp_step,
            trial=self.trials.latest,
        )

    # -- at a step boundary -------------------------------------------------------------------
    def due(self, step: int) -> Ramp | None:
        self._poll_plan(step)
        self._drop_unanswered(step)
        proposal = None
        if self.writer is not None and self.mode != "off":
            try:  # never into the loop, and never past the exchange every rank waits in
                proposal = self._decide(step)
            except Exception as e:
                self.failed("ramp_due", e, step)
        sent = proposal
        if self.channel is not None:  # every rank: what rank 0 decided one boundary earlier
            proposal, sent = self.channel.exchange(proposal, stop=self.stop_requested)
        if proposal is None:
            return None
        if proposal.kind == "trial":  # the loop takes it with Monitor.trial_due()
            decided = sent or proposal  # rank 0's own names its source
            trial_id = self.trials.begin(decided.command_id, self.tokens)
            self.trials.pending = self.trials.request(self, decided, step, trial_id)
            return None
        self._unanswered = Ramp(
            proposal.tier,
            lr_multiplier=proposal.base_lr / self.base_lr,
            base_lr=proposal.base_lr,
            step=step,
            source=(sent or proposal).source,
            command_id=(sent or proposal).command_id,
            before=self.running.tier,
        )
        return self._unanswered

    def _drop_unanswered(self, step: int) -> None:
        """A ramp returned at an earlier boundary that the loop neither applied nor refused, or
        a trial it never asked for with trial_due() (a loop that drops what it is given):
        refused now, or its command would stay claimed for the rest of the run; the loop's
        author is told once of each."""
        ramp, self._unanswered = self._unanswered, None
        if ramp is not None:
            self.refused(
                ramp,
                f"the loop neither applied nor refused it: mon.ramp_due() returned it at step "
                f"{ramp.step}, and was called again at step {step}",
            )
            self._tell_author(
                step,
                f"mon.ramp_due() returned a ramp at step {ramp.step} that the loop neither "
                "applied nor refused: it is refused. Apply ramp.tier, then call "
                "mon.ramp_applied(ramp); or call mon.ramp_refused(ramp, why)",
                "ramp not answered",
            )
        trial, self.trials.pending = self.trials.pending, None
        if trial is not None:
            self.trial_done(
                trial.command_id,
                None,
                f"the loop did not take it: mon.trial_due() was not called after "
                f"mon.ramp_due() at step {trial.step}",
            )
            self._tell_author(
                step,
                f"a trial was due at step {trial.step}, and mon.trial_due() was not called "
                "after mon.ramp_due() at that boundary: it is refused. A loop started with "
                "trials=True calls mon.trial_due() after each mon.ramp_due(), and runs what it "
                "returns with mon.run_trial(...)",
                "trial not taken",
            )

    def _tell_author(self, step: int, message: str, cause: str) -> None:
        (self.author_alert or self._alert)(step, message, {"cause": cause})

    def _decide(self, step: int) -> Proposal | None:
        if self.channel is not None and self.channel.sending:
            return None  # one change at a time: the last one reaches every rank first
        # the writer's flusher claims approved commands in the background: nothing here waits
        # on the database, however long another process holds it
        chosen = None
        for cmd in self.writer.take_claimed_commands():
            if cmd.command_id in self._handled:
                continue
            self._handled.add(cmd.command_id)
            if chosen is not None:
                self._refuse(
                    cmd.command_id,
                    step,
                    "another ramp or trial was taken at this boundary",
                    cmd.payload,
                    cmd.kind,
                )
                continue
            chosen = self._command(cmd, step)
        if chosen is None and self.mode == "auto" and not self.auto_paused:
            chosen = self._auto(step)
        if chosen is not None and chosen.command_id is not None:
            self._in_flight.add(chosen.command_id)
        return chosen

    def _command(self, cmd, step: int) -> Proposal | None:
        if cmd.kind == "trial":
            return self._trial_command(cmd, step)
        if cmd.kind != "ramp":
            self.writer.command_refused(
                cmd.command_id, f"the loop does not know command kind {cmd.kind!r}"
            )
            return None
        payload = cmd.payload or {}
        reason = self.check(payload)
        if reason is not None:
            self._refuse(cmd.command_id, step, reason, payload)
            return None
        tier = Tier.from_payload(payload, self.running.tier.world_size)
        by_rule = self.policy.new_base_lr(tier.batch)
        mult = payload.get("lr_multiplier")
        # the operator's multiplier wins only where it disagrees with the rule; otherwise the
        # rule's value from the original LR, so a ramp and its reverse restore it bit for bit
        base = (
            by_rule
            if mult is None or math.isclose(self.base_lr * mult, by_rule, rel_tol=1e-9)
            else self.base_lr * mult
        )
        return Proposal(tier, base, f"command {cmd.command_id}", cmd.command_id)

    def _trial_command(self, cmd, step: int) -> Proposal | None:
        proposal = self.trials.propose(self, cmd.payload or {})
        if isinstance(proposal, str):
            self._refuse(cmd.command_id, step, proposal, cmd.payload, "trial")
            return None
        proposal.source, proposal.command_id = f"command {cmd.command_id}", cmd.command_id
        return proposal

    def trial_done(self, command_id: int | None, step: int | None, reason: str | None = None):
        """A trial's command: applied at the step the run continued from, or refused (reason)."""
        if command_id is None or self.writer is None:
            return
        self._in_flight.discard(command_id)
        if reason is None:
            self.writer.command_applied(command_id, step)
        else:
            self.writer.command_refused(command_id, reason)

    def check(self, payload: dict, advice: Advice | None = None) -> str | None:
        """Why this tier cannot run here, now; None when it can."""
        try:  # the store's own payload rules: the loop does not trust what it was sent
            payload = validate_command("ramp", payload)
        except CommandError as e:
            return str(e)
        advice = advice or self.advise()
        return advice.refusal(Tier.from_payload(payload, self.running.tier.world_size))

    def _auto(self, step: int) -> Proposal | None:
        advice = self.advise()
        if not advice.decision.ready and self.policy.gate != "trial":
            return None
        if advice.memory_model is None and self.plan_pending:
            return None  # the plan is still running: judge the per-device batch when it is in
        if self.policy.gate == "trial":  # ramps only through a trial that passes
            return self.trials.auto(self, advice, self.tokens)
        suggested = advice.suggested
        if suggested is None or not suggested.fits:
            return None
        tier = suggested.option.tier
        if self.check(tier.to_payload(), advice) is not None:
            return None
        return Proposal(tier, suggested.new_base_lr, f"auto: {advice.decision.reason}", None)

    # -- the loop's answer --------------------------------------------------------------------
    def applied(self, ramp: Ramp) -> None:
        """After Monitor.set_tier to the ramp's tier: the new base LR, the event, 'applied'."""
        self._unanswered = None
        seq, old_lr = self.running.seq_len, self.base_lr
        before, after = ramp.before, ramp.tier
        self.base_lr = ramp.base_lr
        self.last_ramp_step = ramp.step

        def side(t: Tier, base_lr: float) -> dict:
            return {**t.to_payload(), "batch": t.batch, "tokens": t.batch * seq, "base_lr": base_lr}

        self.event(
            ramp.step,
            M.EVENT_RAMP,
            f"ramp ({ramp.source}): {before.per_device_batch} x {before.accum} -> "
            f"{after.per_device_batch} x {after.accum} per device; batch {before.batch} -> "
            f"{after.batch} sequences; base lr {old_lr:.3g} -> {ramp.base_lr:.3g}",
            {
                "source": ramp.source,
                "before": side(before, old_lr),
                "after": side(after, ramp.base_lr),
                "rule": self.policy.lr_rule,
            },
        )
        if ramp.command_id is not None and self.writer is not None:
            self._in_flight.discard(ramp.command_id)
            self.writer.command_applied(ramp.command_id, ramp.step)
        self._start_lr_check(ramp, old_lr)

    def refused(self, ramp: Ramp, reason: str) -> None:
        self._unanswered = None
        self.last_ramp_step = ramp.step  # an auto ramp the loop refused waits a whole streak
        payload = ramp.tier.to_payload()
        if ramp.command_id is not None:
            self._refuse(ramp.command_id, ramp.step, reason, payload)
        else:
            self.event(
                ramp.step,
                M.EVENT_REFUSED,
                f"ramp ({ramp.source}) refused: {reason}",
                {"payload": payload},
            )

    def _refuse(self, command_id: int, step: int, reason: str, payload, kind="ramp") -> None:
        self._in_flight.discard(command_id)
        if self.writer is not None:
            self.writer.command_refused(command_id, reason)
        self.event(
            step,
            M.EVENT_REFUSED,
            f"{kind} command {command_id} refused: {reason}",
            {"command_id": command_id, "payload": dict(payload or {})},
        )

    def close(self, status: str) -> None:
        """A command decided but never reported is refused, never left claimed."""
        if self._plan is not None:
            self._plan.cancel()
        if self.channel is not None:
            self.channel.drain(wait=status == "finished")
        for command_id in sorted(self._in_flight):
            if self.writer is not None:
                self.writer.command_refused(
                    command_id, f"the run stopped ({status}) before the tier change took effect"
                )
        self._in_flight.clear()
