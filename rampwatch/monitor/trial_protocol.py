"""The trial protocol: at a step boundary a loop that runs trials learns of one (`TrialRequest`),
runs it from a snapshot, and says how it ended — the one implementation of check / request /
the trial's events / keep the branch, for the reference trainer and for own loops.

    mon = Monitor.start(..., trials=True)        # the run config says this loop runs trials
    ramp = mon.ramp_due()                        # takes the claimed commands (ramps and trials)
    if trial := mon.trial_due():                 # a trial command, checked; trial_start written
        out = mon.run_trial(trial, train_step, evaluate, start=pos, scheduler=sched)
        if out is not None:                      # None: abandoned, the snapshot restored
            pos += trial.delta_examples          # every arm read the same examples
            batch, accum = out.tier.per_device_batch, out.tier.accum
            mon.trial_ended(out)                 # trial_end; the kept branch is a ramp

Owns `TrialArm`, `TrialRequest`, `TrialOutcome` and `TrialProtocol` (the monitor's part: whether
this loop runs trials and why not, a trial command's check, Δ, the cost, the events of the
contract). Like RampProtocol, it works with what it is handed (the ramp protocol for the running
tier, the policy, advise(), the writer and the event function), never with the Monitor. Running
the arms is monitor/trial_runner.py's; the judgement advisor/trial.py's.

A command's factors each get the tier that the one `advise()` offers at that factor (or, for a
factor it does not offer, the running per-device batch with k× the accumulation, which fits by
construction) and must pass `Advice.refusal`; one that cannot run refuses the whole command with
the reason (a trial never silently drops an arm). Δ is rounded up to a whole number of steps of
every arm (advisor/trial.py's TrialPlan needs it: every arm reads the same examples). A loop
started with `trial_delta_from_loss` (the reference trainer, unless told a Δ) has its default Δ
chosen at each trial from its own loss curve (advisor/trial_delta.py, from the training losses
this protocol keeps: `observe`), at most the loop's Δ and at least MIN_BRANCH_STEPS steps of
the largest branch; the trial_start event says what Δ rests on.

A finished trial is the run's newest trial evidence (`latest`, advisor/advice.py TrialEvidence):
advise() reads the noise scale through its calibration until the next one. Under the policy's
trial gate (advisor/policy.py) with ramp="auto", `auto` is where the loop starts a trial itself
(a negative trial id, source "auto: ..."): when the decision on that evidence is ready, or once
the policy's interval has passed since the last trial's start; after a trial that did not ramp
(failed or abandoned) the evidence waits that interval too, so a ramp the trials keep refusing
is not tried again at every boundary. A trial that judged nothing (its Δ check "too long" or
"cannot tell": no answer, not a "no") is tried once more at once, at a Δ from its own control's
half-progress ratio (advisor/trial_delta.py `retry_choice`), keeping the smallest factor that
trial failed (advisor/trial.py `failed_factor`: such a "no" stands at a shorter Δ) as the cap of
a trial at that batch that begins within the retry's Δ of it (the retry, or an operator's trial
then); a retry that judges nothing waits the interval like any other.

A trial that could not tell (its held-out batch too small for the spread it measured) names the
batch that would tell (advisor/trial.py `examples_to_tell`): a two-stage design, the first stage
measuring the spread and the second sized by it (Stein 1945, "A two-sample test for a linear
hypothesis whose power is independent of the variance", Ann. Math. Stat. 16). A loop that can
grow its evaluation (`run_trial(..., grow_eval=)`) runs the second stage inside the same trial
(monitor/trial_runner.py; `second_stage` is its event). Otherwise, or when that batch still
could not tell, the next trial, whichever starts it, asks for that many
(`TrialRequest.eval_examples`). The loop's evaluate() scores what it can (the reference trainer
up to a cap, trainer/trial_controller.py); the trial's verdict records how many it scored. Only
the next trial asks: a later one measures at the loop's own size again, as the spread moves
with the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rampwatch.advisor.advice import TrialEvidence
from rampwatch.advisor.gns_window import significant
from rampwatch.advisor.tiers import RAMP_MAX_FACTOR, Tier
from rampwatch.advisor.trial import TrialPlan, TrialVerdict, failed_factor
from rampwatch.advisor.trial_delta import (
    DeltaChoice,
    LossHistory,
    choose_delta,
    retry_choice,
    whole_units,
)
from rampwatch.monitor.ramp_channel import Proposal
from rampwatch.store import CommandError
from rampwatch.store import names as M
from rampwatch.store.commands import validate as validate_command

if TYPE_CHECKING:  # trial_snapshot imports torch; this module does not
    from rampwatch.monitor.trial_snapshot import SnapshotPlace

__all__ = [
    "DEFAULT_BRANCH_STEPS",
    "TrialArm",
    "TrialOutcome",
    "TrialProtocol",
    "TrialRequest",
    "abandoned_note",
]

# Δ of a loop that names none: this many optimizer steps of the largest branch
DEFAULT_BRANCH_STEPS = 8
# the shortest Δ from the loss curve: this many steps of the largest branch
MIN_BRANCH_STEPS = 4
NOT_OPTED_IN = "its monitor started without trials=True"


@dataclass(frozen=True)
class TrialArm:
    """One branch: its factor, the tier it runs at and the base LR it runs with (the policy's
    rule at that batch: what a ramp to the same tier would set)."""

    factor: int
    tier: Tier
    base_lr: float


@dataclass(frozen=True)
class TrialRequest:
    """A trial due at the boundary after `step` (S): the control at `control` and each arm, all
    from one snapshot, each for `delta_tokens` on the same examples."""

    trial_id: int  # the command id (a negative local id for a trial the loop starts itself)
    step: int
    control: Tier
    base_lr: float
    delta_tokens: int
    seq_len: int
    rule: str
    arms: tuple[TrialArm, ...]
    source: str  # "command 7"
    command_id: int | None = None
    delta_choice: dict | None = None  # DeltaChoice.to_dict(): what Δ rests on (rank 0's)
    cap: int | None = None  # no arm at or past this factor is kept (the trial before failed it)
    # held-out examples to score: the trial before could not tell with fewer (None: the loop's)
    eval_examples: int | None = None

    @property
    def factors(self) -> tuple[int, ...]:
        return tuple(a.factor for a in self.arms)

    @property
    def delta_examples(self) -> int:
        """Examples (sequences) each arm reads: the data position moves by this after a trial."""
        return self.delta_tokens // self.seq_len

    def plan(self) -> TrialPlan:
        return TrialPlan(
            batch=self.control.batch,
            ks=self.factors,
            delta_tokens=self.delta_tokens,
            rule=self.rule,
            tokens_per_example=self.seq_len,
        )

    def arm(self, factor: int) -> TrialArm:
        """The arm at this factor; 1 is the control (the running tier and base LR)."""
        if factor == 1:
            return TrialArm(1, self.control, self.base_lr)
        return next(a for a in self.arms if a.factor == factor)

    def steps(self, factor: int) -> int:
        return self.plan().steps(factor)


@dataclass(frozen=True)
class TrialOutcome:
    """What a trial left the run with: the verdict, the arm kept (its end state is in place)."""

    request: TrialRequest
    verdict: TrialVerdict
    kept: TrialArm
    seconds: float  # the trial's wall time, all arms
    place: SnapshotPlace | None = None  # where its copies of the state were
    kept_losses: tuple[float | None, ...] = ()  # the kept arm's train loss at each of its steps

    @property
    def tier(self) -> Tier:
        return self.kept.tier

    @property
    def continue_step(self) -> int:
        """The run's step after the trial: S + the kept arm's optimizer steps."""
        return self.request.step + self.request.steps(self.kept.factor)

    @property
    def on_disk(self) -> bool:
        return self.place is not None and self.place.folder is not None

    @property
    def cost_seconds(self) -> float:
        """Measured: the discarded arms' share of the trial's wall time (by tokens, which every
        arm that ran has the same of)."""
        arms = len(self.verdict.branches) + 1
        return self.seconds * (arms - 1) / arms


@dataclass
class TrialProtocol:
    """Whether this loop runs trials (the run config says so), and a trial's checks and events.
    `Monitor` owns one beside its RampProtocol."""

    enabled: bool = False
    note: str | None = None  # why this loop does not run trials (the card shows it)
    delta_tokens: int | None = None  # the loop's default Δ (None: DEFAULT_BRANCH_STEPS)
    budget_tokens: int | None = None  # the run's token budget, for the cost's share
    delta_from_loss: bool = False  # the default Δ is a cap: the loss curve picks Δ below it
    history: LossHistory = field(default_factory=LossHistory, repr=False)
    pending: TrialRequest | None = field(default=None, repr=False)
    latest: TrialEvidence | None = None  # the newest finished trial: advise() reads it
    last_start_tokens: int | None = None  # tokens seen at the last trial's start (None: none yet)
    last_ramped: bool = False  # the last trial kept a branch
    auto_trials: int = 0  # trials this loop started itself: their ids are -1, -2, ...
    unjudged: int = 0  # trials in a row that judged nothing (Δ "too long" or "cannot tell")
    retry: DeltaChoice | None = None  # the Δ of the retry due at once, if any (note: why)
    # (control batch, factor, tokens seen at its end): the smallest factor the trial that judged
    # nothing failed; a trial at that batch that begins within the retry's Δ of it keeps no arm
    # from it up (advisor/trial.py failed_factor); a later one owes it nothing
    retry_cap: tuple[int, int, int] | None = None
    _cap: tuple[int, int] | None = field(default=None, repr=False)  # the trial begun's
    tell: int | None = None  # held-out examples the last trial said would tell, for the next
    _tell: int | None = field(default=None, repr=False)  # the trial begun's

    def state_dict(self) -> dict:
        return {
            "latest": None if self.latest is None else self.latest.to_dict(),
            "last_start_tokens": self.last_start_tokens,
            "last_ramped": self.last_ramped,
            "auto_trials": self.auto_trials,
            "unjudged": self.unjudged,
            "retry": None if self.retry is None else self.retry.to_dict(),
            "retry_cap": None if self.retry_cap is None else list(self.retry_cap),
            "tell": self.tell,
            "loss_history": self.history.to_dict() if self.delta_from_loss else None,
        }

    def load_state_dict(self, state: dict) -> None:
        latest = state.get("latest")
        self.latest = TrialEvidence(**latest) if latest else self.latest
        self.last_start_tokens = state.get("last_start_tokens", self.last_start_tokens)
        self.last_ramped = bool(state.get("last_ramped", self.last_ramped))
        self.auto_trials = int(state.get("auto_trials", self.auto_trials))
        self.unjudged = int(state.get("unjudged", self.unjudged))
        retry = state.get("retry")
        self.retry = None if retry is None else DeltaChoice(**retry)
        cap = state.get("retry_cap")
        self.retry_cap = None if cap is None else (int(cap[0]), int(cap[1]), int(cap[2]))
        self.tell = state.get("tell")
        if state.get("loss_history"):
            self.history = LossHistory.from_dict(state["loss_history"])

    def observe(self, metrics: dict) -> None:
        """Monitor.step's metrics: the training loss against tokens seen, for the Δ choice."""
        if self.delta_from_loss and M.LOSS in metrics and M.TOKENS_SEEN in metrics:
            self.history.add(int(metrics[M.TOKENS_SEEN]), float(metrics[M.LOSS]))

    def config(self) -> dict:
        """What the run config records: the card says up front whether trials run, and why not."""
        out = {"trials": self.enabled, "trial_delta_tokens": self.delta_tokens}
        if self.delta_from_loss:  # trial_delta_tokens is then Δ's cap: the card's "at most"
            out["trial_delta_from_loss"] = True
        if not self.enabled:
            out["trials_note"] = self.note or NOT_OPTED_IN
        return out

    def refusal(self) -> str | None:
        if self.enabled:
            return None
        return f"this loop does not run trials: {self.note or NOT_OPTED_IN}"

    # -- a trial command at a boundary (rank 0) -------------------------------------------
    def propose(self, ramps, payload, advice=None) -> Proposal | str:
        """The trial a command asks for, checked (ramps: the RampProtocol, for the running tier,
        the policy and advise(); advice: its advice, when the caller has it), or why it cannot run."""
        reason = self.refusal()
        if reason is not None:
            return reason
        try:  # the store's own payload rules: the loop does not trust what it was sent
            payload = validate_command("trial", payload)
        except CommandError as e:
            return str(e)
        running = ramps.running
        advice = advice or ramps.advise()
        offered = {t.option.factor: t for t in advice.tiers}
        arms = []
        for k in payload["factors"]:
            t = offered.get(k)
            if t is not None and not t.fits:
                return f"×{k} cannot run: {t.option.reason}"
            tier = (
                t.option.tier
                if t is not None
                else Tier(
                    running.tier.per_device_batch, running.tier.accum * k, running.tier.world_size
                )
            )
            why = advice.refusal(tier)
            if why is not None:
                return f"×{k} cannot run: {why}"
            arms.append((k, tier))
        delta = self.choose_delta(payload["delta_tokens"], payload["factors"], running)
        return Proposal(
            running.tier,
            ramps.base_lr,
            "",
            None,
            "trial",
            delta.tokens,
            tuple(arms),
            delta.to_dict(),
        )

    def whole_delta(self, requested: int | None, factors, running) -> int:
        """Δ without the loss curve: the command's, else the loop's default, else
        DEFAULT_BRANCH_STEPS steps of the largest branch, rounded up to whole steps of every
        arm (the trial gate's interval counts in it)."""
        unit, largest = _arm_units(factors, running.tier.batch * (running.seq_len or 1))
        return whole_units(requested or self.delta_tokens or DEFAULT_BRANCH_STEPS * largest, unit)

    def choose_delta(self, requested: int | None, factors, running) -> DeltaChoice:
        """A trial's Δ: the command's; else, with delta_from_loss, from the loss curve between
        MIN_BRANCH_STEPS steps of the largest branch and the default (whole_delta's); else the
        default."""
        delta = self.whole_delta(requested, factors, running)
        if requested:
            return DeltaChoice(delta, "command", "Δ as the command asked.")
        if not self.delta_from_loss:
            return DeltaChoice(delta, "default", "The loop's default Δ.")
        unit, largest = _arm_units(factors, running.tier.batch * (running.seq_len or 1))
        floor = min(delta, MIN_BRANCH_STEPS * largest)
        return choose_delta(self.history.tokens, self.history.losses, floor, delta, unit)

    # -- a trial the loop starts itself (ramp="auto" under the trial gate; rank 0) -----------
    def auto(self, ramps, advice, tokens: int) -> Proposal | None:
        """The trial due now by the evidence or the interval (module docstring), or None: ×f and
        ×2f (the policy's factor f), or ×f alone when ×2f cannot run."""
        if not self.enabled:
            return None
        policy, running = ramps.policy, ramps.running
        f = policy.factor
        choices = [(f, 2 * f), (f,)] if 2 * f <= RAMP_MAX_FACTOR else [(f,)]
        interval = policy.trial_interval(self.whole_delta(None, choices[0], running))
        since = tokens - (self.last_start_tokens or 0)
        first = self.last_start_tokens is None
        delta = None
        if self.retry is not None:
            delta, why = self.retry.tokens, self.retry.note
        elif since >= interval:
            why = f"{since:,} tokens since {'the start' if first else 'the last trial'}"
            why += f" (a trial every {interval:,})"
        elif advice.decision.ready and (first or self.last_ramped):
            why = advice.decision.reason
        else:
            return None
        for factors in choices:
            payload = {"factors": list(factors), "delta_tokens": delta}
            proposal = self.propose(ramps, payload, advice)
            if not isinstance(proposal, str):
                proposal.source = f"auto: {why}"
                if delta is not None:
                    proposal.delta_choice = self.retry.to_dict()
                return proposal
        return None

    def begin(self, command_id: int | None, tokens: int) -> int:
        """Every rank, as a trial is decided: its id (a new negative one for an auto trial) and
        the interval's start (a retry due is taken by any trial)."""
        cap, retry = self.retry_cap, self.retry
        soon = cap is not None and retry is not None and int(tokens) - cap[2] <= retry.tokens
        self._cap = cap[:2] if soon else None
        self._tell, self.tell = self.tell, None
        self.last_start_tokens, self.last_ramped, self.retry = int(tokens), False, None
        self.retry_cap = None
        if command_id is not None:
            return command_id
        self.auto_trials += 1
        return -self.auto_trials

    def request(self, ramps, proposal: Proposal, step: int, trial_id: int) -> TrialRequest:
        """Every rank: the request from the proposal rank 0 decided (arms' base LRs by the
        policy, which every rank reads from the same run config)."""
        return TrialRequest(
            trial_id=trial_id,
            step=step,
            control=ramps.running.tier,
            base_lr=ramps.base_lr,
            delta_tokens=proposal.delta_tokens,
            seq_len=ramps.running.seq_len or 1,
            rule=ramps.policy.lr_rule,
            arms=tuple(
                TrialArm(k, tier, ramps.policy.new_base_lr(tier.batch)) for k, tier in proposal.arms
            ),
            source=proposal.source,
            command_id=proposal.command_id,
            delta_choice=proposal.delta_choice,
            cap=self._cap[1] if self._cap and self._cap[0] == ramps.running.tier.batch else None,
            eval_examples=self._tell,
        )

    # -- the events of the contract (rank 0 writes; Monitor.event is a no-op elsewhere) ------
    def cost(self, req: TrialRequest, tokens_per_s: float | None) -> dict:
        """The discarded arms' tokens, their share of the run's budget (None: none given) and
        of the tokens seen before the trial (None: none yet), seconds at the throughput."""
        tokens = req.plan().cost_tokens
        fraction = tokens / self.budget_tokens if self.budget_tokens else None
        seen = self.last_start_tokens
        seconds = tokens / tokens_per_s if tokens_per_s and tokens_per_s > 0 else None
        return {
            "cost_tokens": tokens,
            "cost_fraction": fraction,
            "cost_fraction_seen": tokens / seen if seen else None,
            "cost_seconds": seconds,
        }

    def started(self, event, req: TrialRequest, tokens_per_s: float | None) -> None:
        cost = self.cost(req, tokens_per_s)
        arms = ", ".join(f"×{k}" for k in req.factors)
        extra = []
        if cost["cost_fraction"] is not None:  # a budget of 10¹² is a share, never "0.0%"
            extra.append(
                f"{_percent(cost['cost_fraction'])} of the {self.budget_tokens:,}-token budget"
            )
        if cost["cost_fraction_seen"] is not None:
            extra.append(
                f"{_percent(cost['cost_fraction_seen'])} of the {self.last_start_tokens:,} "
                "tokens seen so far"
            )
        if cost["cost_seconds"] is not None:
            extra.append(f"~{_duration(cost['cost_seconds'])}")
        choice = (req.delta_choice or {}) if self.delta_from_loss else {}
        said = [
            f"trial {arms} from step {req.step}: {len(req.arms)} × {req.delta_tokens:,} tokens "
            "discarded at most" + (f" ({', '.join(extra)})" if extra else "")
        ]
        if "note" in choice:
            said.append(choice["note"])
        if req.cap is not None:
            said.append(f"Nothing from ×{req.cap} up is kept: the trial before failed it")
        if req.eval_examples is not None:
            said.append(
                f"It asks for ~{req.eval_examples:,} held-out examples: the trial before "
                "could not tell with fewer"
            )
        message = " ".join(s.rstrip(".") + "." for s in said)
        event(
            req.step,
            M.EVENT_TRIAL_START,
            message,
            {
                "trial_id": req.trial_id,
                "command_id": req.command_id,
                "tier": req.control.to_payload(),
                "factors": list(req.factors),
                "delta_tokens": req.delta_tokens,
                "seq_len": req.seq_len,
                "lr_rule": req.rule,
                **cost,
                "delta_choice": req.delta_choice,
                "cap": req.cap,
                "eval_examples": req.eval_examples,
                "source": req.source,
                "arms": [{"factor": a.factor, **a.tier.to_payload()} for a in req.arms],
            },
        )

    def _plan_retry(self, out: TrialOutcome) -> None:
        """After a trial that judged nothing, the retry due at once (module docstring), at least
        MIN_BRANCH_STEPS steps of the largest branch."""
        verdict, req = out.verdict, out.request
        if verdict.delta_ok or out.kept.factor > 1:
            self.unjudged = 0
            return
        self.unjudged += 1
        if self.unjudged > 1:  # a retry judged nothing either: the interval decides
            return
        unit, largest = _arm_units(req.factors, req.control.batch * req.seq_len)
        r = verdict.half_progress_ratio
        failed = failed_factor(verdict)
        end = (self.last_start_tokens or 0) + req.delta_tokens
        self.retry_cap = None if failed is None else (req.control.batch, failed, end)
        self.retry = retry_choice(
            req.delta_tokens,
            r,
            floor=MIN_BRANCH_STEPS * largest,
            unit=unit,
            why=f"{self.latest.name} "
            + ("kept no branch" if verdict.judged else "judged nothing")
            + f" (Δ {verdict.delta_check}"
            + ("" if r is None else f", half-progress ratio {r:.2f}")
            + "): ",
        )

    def arm_point(
        self, event, req: TrialRequest, factor: int, steps_done: int, loss, eval_loss=None
    ):
        """A progress point of one arm: tokens done in it, the train loss of that step, and at
        its end (eval_loss given) the held-out mean."""
        tokens = steps_done * factor * req.control.batch * req.seq_len
        self._point(
            event,
            req,
            factor,
            tokens,
            loss,
            eval_loss,
            f"trial {req.trial_id} ×{factor}: {tokens:,} of {req.delta_tokens:,} tokens"
            + ("" if eval_loss is None else f", held-out loss {eval_loss:.4f}"),
        )

    def second_stage(self, event, req: TrialRequest, first: int, examples: int) -> None:
        """The control's evaluations on `first` held-out examples could not tell whether Δ is
        too long: they run again on `examples` before the branches (a point of the control at Δ
        with no loss to draw: the card's progress says it)."""
        self._point(
            event,
            req,
            1,
            req.delta_tokens,
            None,
            None,
            f"trial {req.trial_id}: on {first:,} held-out examples the control could not tell "
            f"whether Δ is too long; evaluating again on {examples:,}",
            first_examples=first,
            eval_examples=examples,
        )

    @staticmethod
    def _point(event, req, factor, tokens, loss, eval_loss, text, **extra) -> None:
        """One trial_arm event: an arm's point (its end when eval_loss is given)."""
        event(
            req.step,
            M.EVENT_TRIAL_ARM,
            text,
            {
                "trial_id": req.trial_id,
                "factor": factor,
                "tokens": tokens,
                "loss": None if loss is None else float(loss),
                "eval_loss": None if eval_loss is None else float(eval_loss),
                "done": eval_loss is not None,
                **extra,
            },
        )

    def ended(self, event, out: TrialOutcome) -> None:
        req, forced = out.request, out.kept.factor != out.verdict.kept_k
        self.latest = TrialEvidence.of(req.trial_id, req.step, out.verdict)
        self.last_ramped = out.kept.factor > 1
        self.tell = out.verdict.examples_wanted
        self._plan_retry(out)
        event(
            out.continue_step,
            M.EVENT_TRIAL_END,
            out.verdict.summary
            + (f" Kept ×{out.kept.factor} instead, as the loop was told (keep)." if forced else "")
            + (f" Its copies of the state: {out.place.describe()}." if out.on_disk else ""),
            {
                "trial_id": req.trial_id,
                "verdict": out.verdict.to_dict(),
                "kept_factor": out.kept.factor,
                "continue_step": out.continue_step,
                "cost_tokens": out.verdict.cost_tokens,
                "cost_seconds": out.cost_seconds,
                "snapshots": None if out.place is None else out.place.describe(),
            },
        )

    def abandoned(self, event, req: TrialRequest, reason: str) -> None:
        event(
            req.step,
            M.EVENT_TRIAL_ABANDONED,
            f"trial {req.trial_id} abandoned: {reason}",
            {"trial_id": req.trial_id, "reason": reason},
        )


def _arm_units(factors, step_tokens: int) -> tuple[int, int]:
    """(Δ's unit, whole steps of every arm; one step of the largest arm), in tokens, from the
    control's tokens per step."""
    return math.lcm(*factors) * step_tokens, max(factors) * step_tokens


def abandoned_note(req: TrialRequest) -> dict:
    """The checkpoint note at S (Monitor.event's arguments) a resume records: a checkpoint with
    it was written at a trial's snapshot, so a run resumed from it lost the trial."""
    reason = (
        f"the run stopped during the trial from step {req.step}; resumed from the checkpoint at "
        "its snapshot"
    )
    return {
        "kind": M.EVENT_TRIAL_ABANDONED,
        "message": f"trial {req.trial_id} abandoned: {reason}",
        "data": {"trial_id": req.trial_id, "reason": reason},
    }


def _percent(fraction: float) -> str:
    """A share as a percentage of three significant digits: 1.60%, 0.000026% (never 0.0%)."""
    return f"{significant(100 * fraction)}%"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
