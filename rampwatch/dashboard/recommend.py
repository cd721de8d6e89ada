"""The recommendation card's content: store rows in, the advisor's verdict out (no Streamlit).

Owns: reading the run's current tier, sequence length, capacity, LR rule and policy from its
config and latest metrics, the last ramp (and what the monitor's LR check said of it) and the
OOMs from its events, and what the latest ramp command says. The verdict itself is
advisor/advice.py's `advise` over `memory_evidence` of the run's memory_plan rows and
`TrialEvidence` of its latest finished trial (the store's trials table): the same functions and
evidence the monitor's auto mode and command check use, so the card offers what the trainer
would do, and says what it rests on (`Card.evidence`). The tier table (`Card.table`,
advisor/tier_table.py) adds each tier's throughput, steps and hours from the run's per-step tier
and tokens/s (advisor/throughput.py), fitted here, per refresh, never in the monitor's per-step
advise(). `card_of` builds the card from a live_data.Snapshot: the live page and `rampwatch plan
--db` both do. dashboard/card.py draws it; tests build it from seeded databases. `how_it_stopped`
words a run that is not running, for the card and the schedule section.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rampwatch.advisor.advice import (
    NOISE_ONLY,
    Advice,
    RunningTier,
    TierAdvice,
    TrialEvidence,
    advise,
    memory_evidence,
)
from rampwatch.advisor.lr import rule_for
from rampwatch.advisor.lr_check import CAUSE as LR_CHECK
from rampwatch.advisor.memory import MemoryModel, format_gb
from rampwatch.advisor.policy import CONFIG_KEY as POLICY_KEY
from rampwatch.advisor.policy import RampPolicy
from rampwatch.advisor.ramp_point import Effect, Recommendation
from rampwatch.advisor.throughput import ThroughputModel, measure_tiers, recent_throughput
from rampwatch.advisor.tier_table import TierRow, steps_to_limit, tier_rows
from rampwatch.advisor.tiers import Tier, TierOption
from rampwatch.advisor.trial import TrialVerdict, discarded_at_most
from rampwatch.dashboard.buckets import Buckets
from rampwatch.store import names as M


@dataclass(frozen=True)
class TierView:
    option: TierOption
    label: str
    new_base_lr: float | None
    lr_warning: str | None
    effect: Effect | None
    plan: str | None = None  # a hand-plan step this tier carries out (dashboard/run_schedule.py)

    @property
    def fits(self) -> bool:
        return self.option.fits

    @property
    def predicted_bytes(self) -> float | None:
        return self.option.predicted_peak_bytes

    def payload(self) -> dict:
        """The ramp command's payload (store.commands.validate)."""
        return {**self.option.tier.to_payload(), "lr_multiplier": float(self.option.lr_multiplier)}

    def chart_line(self) -> dict:
        return {"label": self.label, "predicted_bytes": self.predicted_bytes, "fits": self.fits}


@dataclass(frozen=True)
class CommandView:
    command_id: int
    status: str
    text: str
    payload: dict
    applied_step: int | None = None
    reason: str | None = None

    @property
    def open(self) -> bool:
        return self.status in ("pending", "claimed")


@dataclass(frozen=True)
class Card:
    run_id: str
    current: RunningTier | None
    decision: Recommendation | None
    tiers: list[TierView] = field(default_factory=list)
    memory_model: MemoryModel | None = None
    memory_note: str = ""
    usable_bytes: float | None = None
    last_ramp_step: int | None = None
    command: CommandView | None = None
    problems: list[str] = field(default_factory=list)  # why parts of the card are missing
    notes: list[str] = field(default_factory=list)
    policy: RampPolicy | None = None
    latest_estimate_step: int | None = None  # the newest step with a noise-scale estimate
    last_step: int | None = None  # the run's newest step
    tokens_per_s: float | None = None  # the run's throughput now (running_throughput)
    evidence: str = NOISE_ONLY  # what the decision rests on (advisor.advice.Advice.evidence)
    table: list[TierRow] = field(default_factory=list)  # advisor.tier_table's rows
    table_notes: list[str] = field(default_factory=list)  # what the table's figures assume
    lr_check: str | None = None  # the last ramp's LR change, where the run did not carry it out
    advice: Advice | None = None  # what the card was built from (the schedule reads it too)
    speeds: ThroughputModel | None = None  # the throughput model fitted for the table
    end_tokens: int | None = None  # the tokens seen when the run ends (run_tokens)

    @property
    def steps_per_second(self) -> float | None:
        """The run's step rate now: its recent tokens/s over the tokens of a step now."""
        cur = self.current
        if self.tokens_per_s is None or cur is None or not cur.seq_len:
            return None
        return self.tokens_per_s / (cur.batch * cur.seq_len)

    @property
    def awaiting_reread(self) -> bool:
        """A ramp was applied at step S but the run has not logged step S+1 (the first on the
        new tier) yet: what the card knows of the current tier is the old one, so it must offer
        nothing until the next refresh reads the run again."""
        c = self.command
        if c is None or c.status != "applied" or c.applied_step is None:
            return False
        return self.last_step is None or self.last_step <= c.applied_step

    @property
    def suggested(self) -> TierView | None:
        """The tier of the policy's ramp (×factor, advisor.advice.Advice.suggested): what the
        monitor's auto mode would apply."""
        factor = self.policy.factor if self.policy is not None else 2
        return next(
            (t for t in self.tiers if t.option.factor == factor),
            self.tiers[0] if self.tiers else None,
        )

    @property
    def key(self) -> str:
        """Identity of this recommendation: a ramp or a different suggested tier is a new one."""
        s = self.suggested
        tier = f"{s.option.tier.per_device_batch}x{s.option.tier.accum}" if s else "-"
        return f"{self.run_id}:{self.last_ramp_step}:{tier}"


def _get(mapping: Mapping | None, *path, default=None):
    cur = mapping
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur:
            return default
        cur = cur[p]
    return cur


def _pos_int(v) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(f) or f <= 0 or f != int(f):
        return None
    return int(f)


def current_tier(
    config: Mapping | None, latest: Mapping[str, float], world_size=None, capacity_bytes=None
) -> RunningTier | None:
    """The running tier from the latest metrics, falling back on the run config."""
    device_batch = _pos_int(latest.get(M.PER_DEVICE_BATCH)) or _pos_int(
        _get(config, "per_device_batch")
    )
    acc = _pos_int(latest.get(M.ACCUM)) or _pos_int(_get(config, "accum"))
    world = _pos_int(world_size) or _pos_int(_get(config, "world_size")) or 1
    if device_batch is None or acc is None:
        return None
    seq = _pos_int(_get(config, "seq_len")) or _pos_int(_get(config, "model", "seq_len"))
    if seq is None and latest.get(M.BATCH_TOKENS) and latest.get(M.BATCH_SEQS):
        seq = _pos_int(latest[M.BATCH_TOKENS] / latest[M.BATCH_SEQS])
    cap = capacity_bytes if capacity_bytes and capacity_bytes > 0 else latest.get(M.MEM_CAPACITY)
    cap = float(cap) if cap is not None and math.isfinite(float(cap)) and cap > 0 else None
    return RunningTier(Tier(device_batch, acc, world), seq, cap)


def running_variant(config: Mapping | None) -> str:
    return M.loss_variant(_get(config, "model", "chunked_ce") or _get(config, "chunked_ce"))


def oom_batches(events: Sequence[Mapping]) -> set[int]:
    """Per-device batches that OOM events say ran out of memory (a rank without a writer has
    no infeasible row of its own: its event comes through the resumed rank 0)."""
    bad = set()
    for e in events:
        if e.get("kind") == M.EVENT_OOM:
            b = _pos_int(_get(e.get("data"), "per_device_batch")) or _pos_int(
                _get(e.get("data"), "before", "per_device_batch")
            )
            if b:
                bad.add(b)
    return bad


def command_view(cmd) -> CommandView:
    """The card's line for a ramp command (store.commands.Command or a mapping)."""
    get = cmd.get if isinstance(cmd, Mapping) else (lambda k, d=None: getattr(cmd, k, d))
    cid, status, payload = int(get("command_id")), str(get("status")), dict(get("payload") or {})
    what = f"{payload.get('per_device_batch')} per device × {payload.get('accum')} accumulation"
    step, reason = get("applied_step"), get("reason")
    text = {
        "pending": f"Ramp #{cid} to {what} is pending: waiting for the trainer to pick it up.",
        "claimed": f"Ramp #{cid} to {what} was claimed by the trainer: applying at the next step.",
        "applied": f"Ramp #{cid} to {what} was applied at step {step}.",
        "refused": f"Ramp #{cid} to {what} was refused: {reason}",
        "cancelled": f"Ramp #{cid} to {what} was cancelled.",
        "undone": f"Ramp #{cid} to {what} is not in effect: {reason}.",
    }.get(status, f"Ramp #{cid}: {status}")
    return CommandView(cid, status, text, payload, step, reason)


def build_card(
    run: Mapping,
    latest: Mapping[str, float],
    gns_steps: Sequence[int],
    gns_values: Sequence[float | None],
    events: Sequence[Mapping],
    plan_rows: Sequence[Mapping],
    commands: Sequence = (),
    gns_lower: Sequence[float | None] | None = None,
    throughput: Buckets | None = None,
    trials: Sequence = (),
    series: Mapping[str, Buckets] | None = None,
) -> Card:
    """Everything the recommendation card shows, from one run's store rows.

    run: mapping with run_id, config (dict), world_size, capacity_bytes; latest: the latest value
    of each metric; gns_*: the noise scale's steps with a fresh estimate (recent window), its
    point (None where the window's |G|² was not positive) and one-sided 95% lower bound; events,
    plan_rows: the run's rows as mappings; commands: the run's ramp commands, oldest first. The
    ramp policy, like the trainer's, comes from the run config (advisor.policy.RampPolicy).
    throughput: the run's tokens/s series, for the step rate the forecast is timed at.
    trials: the run's trials (store.reader.Trial), oldest first: the latest finished one
    calibrates the noise scale (advisor.advice.TrialEvidence).
    series: the run's per-step series by name (per_device_batch, accum, tokens_per_s, mfu): the
    tier table's measured throughput (its tokens/s is also `throughput` when that is not given).
    """
    series = series or {}
    throughput = throughput if throughput is not None else series.get(M.TOKENS_PER_S)
    run_id = str(run.get("run_id"))
    config = run.get("config") or {}
    problems: list[str] = []
    notes: list[str] = []
    ramp_steps = [
        int(e["step"])
        for e in events
        if e.get("kind") == M.EVENT_RAMP and e.get("step") is not None
    ]
    last_ramp = max(ramp_steps) if ramp_steps else None
    lr_check = ramp_lr_problem(events, last_ramp)
    cmds = [
        c
        for c in commands
        if (c.get("kind") if isinstance(c, Mapping) else getattr(c, "kind", "ramp")) == "ramp"
    ]
    cmd = command_view(cmds[-1]) if cmds else None
    cur = current_tier(config, latest, run.get("world_size"), run.get("capacity_bytes"))
    last_step = _pos_int(run.get("last_step"))
    end_tokens = run_tokens(config, latest.get(M.TOKENS_SEEN), last_step, cur)
    if cur is None:
        problems.append(
            "the run has not logged per_device_batch and accum yet (and its config "
            "does not name them): no tier can be computed"
        )
        return Card(
            run_id,
            None,
            None,
            last_ramp_step=last_ramp,
            command=cmd,
            problems=problems,
            lr_check=lr_check,
            end_tokens=end_tokens,
        )
    knows_lr = True  # the config names the original batch and LR the new base LR scales from
    try:
        policy = RampPolicy.from_config(config)
    except ValueError as e:  # a run of someone's own loop that recorded neither: its first tier
        policy, knows_lr = RampPolicy(original_batch=cur.batch, original_lr=1.0), False
        notes.append(f"{e}: the ramp policy's defaults apply and no new base LR can be given")
    optimizer = _get(config, "optimizer")
    if optimizer is not None and not isinstance(config.get(POLICY_KEY), Mapping):
        # a recorded policy names its rule (Monitor.start's lr_rule, or the optimizer's base class)
        try:
            rule_for(optimizer)
        except ValueError:
            notes.append(
                f"no learning-rate rule known for optimizer {optimizer!r}: the "
                f"{policy.lr_rule} rule is assumed"
            )
    memory = memory_evidence(plan_rows, running_variant(config), oom_batches(events))
    advice = advise(
        policy,
        cur,
        gns_steps,
        gns_values,
        gns_lower,
        memory,
        since_step=last_ramp,
        knows_lr=knows_lr,
        trial=latest_trial_evidence(trials),
    )
    problems += advice.notes
    views = [tier_view(t) for t in advice.tiers]
    newest = int(gns_steps[-1]) if len(gns_steps) else None
    table, table_notes, speeds = _table(advice, series, latest, config, knows_lr, last_step)
    return Card(
        run_id,
        cur,
        advice.decision,
        views,
        advice.memory_model,
        advice.memory_note,
        advice.usable_bytes,
        last_ramp,
        cmd,
        problems,
        notes,
        policy,
        newest,
        last_step,
        running_throughput(speeds, cur.tier, throughput),
        advice.evidence,
        table,
        table_notes,
        lr_check,
        advice,
        speeds,
        end_tokens,
    )


def running_throughput(
    speeds: ThroughputModel | None, tier: Tier, throughput: Buckets | None
) -> float | None:
    """The run's tokens/s now: the running tier's own recent median where the tier table
    measured it (one number for its row, the forecast and a trial's minutes), else the median
    of the run's recent steps whatever their tier (a tier just started has none timed)."""
    measured = None if speeds is None else speeds.measured.get(tier)
    if measured is not None:
        return measured.tokens_per_s
    return None if throughput is None else recent_throughput(throughput.last)


def card_of(snap) -> Card:
    """The card of a live_data.Snapshot: what the live page draws and `rampwatch plan --db`
    prints."""
    r = snap.run
    return build_card(
        {
            "run_id": r.run_id,
            "config": r.config,
            "world_size": r.world_size,
            "capacity_bytes": r.capacity_bytes,
            "last_step": r.last_step,
        },
        snap.latest,
        snap.gns_steps,
        snap.gns_values,
        snap.events,
        snap.plan_rows,
        snap.commands,
        snap.gns_lower,
        trials=snap.trials,
        series=snap.series,
    )


def _table(advice, series: Mapping[str, Buckets], latest, config, knows_lr, last_step):
    """The tier table's rows, what they assume, and the throughput model fitted on the run's
    per-step tier and tokens/s (None: nothing timed); the budget and step limit from the run
    config."""
    cur, notes = advice.current, []
    speeds = None
    per_step = aligned_steps(series, (M.PER_DEVICE_BATCH, M.ACCUM, M.TOKENS_PER_S), M.MFU)
    if per_step is not None and cur.seq_len:
        measured = measure_tiers(*per_step, cur.tier.world_size)
        speeds = ThroughputModel.fit(measured, cur.seq_len, cur.tier.world_size)
        notes += speeds.notes
    budget, limit = budget_of(config), step_limit_of(config)
    if budget is None and limit is None:
        notes.append(
            "steps and ETA unknown: the run records no token budget (run config "
            "total_tokens: the trainer's --total-tokens, Monitor.start(total_tokens=...))"
        )
    if limit is not None:
        notes.append(
            f"the run stops at step {limit:,} (its step limit, the trainer's --steps) unless its "
            "token budget ends it sooner: steps left and ETA count to whichever comes first"
        )
    rows = tier_rows(advice, speeds, latest.get(M.TOKENS_SEEN), budget, knows_lr, limit, last_step)
    return rows, notes, speeds


def aligned_steps(series: Mapping[str, Buckets], names: Sequence[str], optional: str):
    """The `last` values of `names` at the steps every one of them has (buckets pair by their
    last step), then `optional`'s at those steps (NaN where it has none); None when a series
    of `names` is missing or empty."""
    got = [series.get(n) for n in names]
    if any(b is None or not len(b) for b in got):
        return None
    steps = got[0].last_step
    for b in got[1:]:
        steps = np.intersect1d(steps, b.last_step)
    values = [b.last[np.searchsorted(b.last_step, steps)] for b in got]
    extra = series.get(optional)
    filled = np.full(steps.shape, np.nan)
    if extra is not None and len(extra):
        at = np.clip(np.searchsorted(extra.last_step, steps), 0, len(extra) - 1)
        hit = extra.last_step[at] == steps
        filled[hit] = extra.last[at[hit]]
    return (*values, filled)


def ramp_lr_problem(events: Sequence[Mapping], ramp_step: int | None) -> str | None:
    """What the monitor's LR check (advisor/lr_check.py) said of the ramp at ramp_step, when
    its LR change did not reach the optimizer or could not be confirmed; None when it did."""
    if ramp_step is None:
        return None
    for e in reversed(events):
        data = e.get("data") or {}
        if (
            e.get("kind") == M.EVENT_ALERT
            and data.get("cause") == LR_CHECK
            and data.get("ramp_step") == ramp_step
        ):
            return f"The ramp at step {ramp_step:,}: {e.get('message')}."
    return None


def latest_trial_evidence(trials: Sequence) -> TrialEvidence | None:
    """The newest finished trial with a readable verdict, as the monitor keeps its own."""
    for t in reversed(trials):
        if t.status == "finished" and t.start_step is not None:
            verdict = trial_view(t).verdict
            if verdict is not None:
                return TrialEvidence.of(t.trial_id, t.start_step, verdict)
    return None


def tier_view(t: TierAdvice, plan: str | None = None) -> TierView:
    """The card's view of one advised tier; `plan`: the hand-plan step it carries out."""
    label = _label(t.option)
    if plan is not None:
        label = f"hand plan {label}"
    return TierView(t.option, label, t.new_base_lr, t.lr_warning, t.effect, plan)


def budget_of(config: Mapping | None) -> int | None:
    """The run's token budget (run config `total_tokens`), None when it records none."""
    return _pos_int(_get(config, "total_tokens"))


def step_limit_of(config: Mapping | None) -> int | None:
    """The last step the run logs whatever its tokens (run config `step_limit`: the trainer's
    --steps, whose steps count from 1), None when it records none."""
    return _pos_int(_get(config, "step_limit"))


def _label(o: TierOption) -> str:
    return f"×{o.factor}: {o.tier.per_device_batch} × {o.tier.accum}" + (
        f" ({format_gb(o.predicted_peak_bytes)})" if o.predicted_peak_bytes else ""
    )


# ---- ramp trials (issue 26): the "Test first" offer, its cost, the latest trial's state -----
# A trial runs the control and each branch ×k for Δ tokens from one snapshot and keeps the
# largest branch that passes (advisor/trial.py); the card offers one before a ramp.
TRIAL_FACTORS = (2, 4)


@dataclass(frozen=True)
class TrialOffer:
    """What "Test ×2 / ×4 first" would cost, said before the click; `refusal` when the run's
    loop runs no trials (then the card shows it instead of a button)."""

    factors: tuple[int, ...]
    delta_tokens: int | None  # the loop's default Δ per arm (run config `trial_delta_tokens`)
    end_tokens: int | None  # the tokens seen when the run ends (Card.end_tokens)
    tokens_per_s: float | None  # the run's recent throughput (a median)
    refusal: str | None = None

    @property
    def label(self) -> str:
        return " / ".join(f"×{k}" for k in self.factors)

    @property
    def cost_tokens(self) -> int | None:
        """Discarded at most (advisor.trial.discarded_at_most); None without the loop's Δ."""
        return (
            None
            if self.delta_tokens is None
            else discarded_at_most(self.factors, self.delta_tokens)
        )

    @property
    def cost_fraction(self) -> float | None:
        cost = self.cost_tokens
        return cost / self.end_tokens if cost is not None and self.end_tokens else None

    @property
    def cost_seconds(self) -> float | None:
        cost = self.cost_tokens
        return cost / self.tokens_per_s if cost is not None and self.tokens_per_s else None

    def payload(self) -> dict:
        """The trial command's payload (store.commands.validate): Δ is the loop's default."""
        return {"factors": list(self.factors), "delta_tokens": None}

    @property
    def cost_text(self) -> str:
        if self.cost_tokens is None:
            return "Cost unknown: the run's config does not give its trial Δ."
        share = self.cost_fraction
        parts = (
            [f"{'<0.01%' if share < 1e-4 else f'{share:.2%}'} of the run's tokens"] if share else []
        )
        if self.cost_seconds is not None:
            parts.append(f"~{duration(self.cost_seconds)} at {self.tokens_per_s:,.0f} tokens/s")
        more = f" ({', '.join(parts)})" if parts else ""
        return (
            f"Cost: {len(self.factors)} × {self.delta_tokens:,} = {self.cost_tokens:,} tokens "
            f"of discarded arms at most{more}."
        )


def how_it_stopped(run) -> str:
    """A sentence's start for a run that is not running: "The run stopped reporting at step 729"
    (stale: no heartbeat, or no live writer) or "The run is killed, stopped at step 729"."""
    where = "" if run.last_step is None else f" at step {run.last_step:,}"
    if run.status == "stale":
        return f"The run stopped reporting{where}"
    return f"The run is {run.status}, stopped{where}"


def duration(seconds: float) -> str:
    """12 s, 3.5 min, 2.1 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def trial_offer(
    config: Mapping | None,
    tokens_per_s: float | None,
    refusal: str | None,
    end_tokens: int | None,
):
    """The offer from the run config (the loop writes `trial_delta_tokens`) and the run's
    recent throughput (Card.tokens_per_s, a median); `refusal`: store.commands.trial_refusal of
    the same config; `end_tokens`: the run's tokens at its end (Card.end_tokens; None: not
    known)."""
    return TrialOffer(
        TRIAL_FACTORS,
        _pos_int(_get(config, "trial_delta_tokens")),
        end_tokens,
        tokens_per_s,
        refusal,
    )


def run_tokens(config: Mapping | None, seen, last_step, current) -> int | None:
    """The tokens the run will have seen when it ends: its token budget, or fewer where its step
    limit comes first at the running tier (`current`, a RunningTier; None: not known); None
    when it records neither."""
    budget, limit = budget_of(config), step_limit_of(config)
    if limit is None or current is None or not current.seq_len:
        return budget
    at_limit = int((seen or 0) + steps_to_limit(limit, last_step) * current.batch * current.seq_len)
    return at_limit if budget is None else min(budget, at_limit)


@dataclass(frozen=True)
class ArmProgress:
    factor: int  # 1 = the control
    tokens: int  # done of the trial's Δ
    done: bool
    examples: int | None = None  # a second stage: evaluated again on this many held-out examples
    first: int | None = None  # the held-out examples that could not tell

    @property
    def name(self) -> str:
        return "control ×1" if self.factor == 1 else f"branch ×{self.factor}"


@dataclass(frozen=True)
class TrialView:
    """One trial as the card shows it: store.reader.Trial, its arm points, the verdict."""

    FIGURES = ("loss difference", "95% upper bound", "tolerance")  # branch_rows' numbers

    trial: object  # store.reader.Trial
    points: list = field(default_factory=list)  # store.reader.TrialPoint, in written order
    verdict: object | None = None  # advisor.trial.TrialVerdict (finished trials)
    note: str | None = None  # why a stored verdict could not be read

    @property
    def arms(self) -> list[ArmProgress]:
        """Each arm's furthest point, control first, then branches in the order they ran."""
        last: dict[int, ArmProgress] = {}
        for p in self.points:
            last[p.factor] = ArmProgress(p.factor, p.tokens, p.done, p.examples, p.first)
        return [last[k] for k in sorted(last)]

    def branch_rows(self) -> list[dict]:
        """Per branch: the paired loss difference against the control, its bound, tolerance; a
        branch not run (advisor/trial.py `arms_left`) says so (not_run_lines: why) and has
        None for each figure."""
        if self.verdict is None:
            return []
        judged = self.verdict.judged  # Δ too long, or cannot tell with no lower bound above 0
        why = {"cannot tell": "not judged: cannot tell whether Δ is too long"}
        unjudged = why.get(self.verdict.delta_check, "not judged: Δ too long")
        cap = self.verdict.cap

        def result(b) -> str:
            if not judged:
                return unjudged
            if not b.passed:
                return "fail"
            capped = cap is not None and b.k >= cap  # the summary says why
            return f"pass; not kept: ×{cap} failed in the trial before" if capped else "pass"

        return [
            {
                "branch": f"×{b.k}",
                "batch": b.batch,
                "LR ×": round(b.lr_factor, 4),
                **dict(zip(self.FIGURES, (b.mean_diff, b.bound, b.tolerance), strict=True)),
                "result": result(b),
            }
            for b in self.verdict.branches
        ] + [
            {
                "branch": f"×{k}",
                "batch": k * self.verdict.plan.batch,
                "LR ×": round(self.verdict.plan.lr_factor(k), 4),
                **dict.fromkeys(self.FIGURES),
                "result": "not run",
            }
            for k in self.verdict.not_run
        ]

    def not_run_lines(self) -> list[str]:
        """Why each branch not run was skipped, a sentence each (under the table: a cell cuts
        them at its width)."""
        if self.verdict is None:
            return []
        return [f"×{k} not run: {self.verdict.not_run_reason(k)}." for k in self.verdict.not_run]

    @property
    def bracket_text(self) -> str | None:
        v = self.verdict
        if v is None:
            return None
        if v.bracket is None:  # Δ too long or cannot tell: the summary says what would tell
            return None
        lo, hi = v.bracket
        b = (
            f"below {hi:,}"
            if lo is None
            else f"at least {lo:,}"
            if hi is None
            else f"between {lo:,} and {hi:,}"
        )
        text = f"Critical batch {b} sequences (measured at batch {v.plan.batch:,})."
        if v.calibration is not None and v.b_simple is not None:
            text += (
                f" Calibration: the bracket's lower end is {v.calibration:.3g}× the noise "
                f"scale ({v.b_simple:.3g})."
            )
        return text


def trial_view(trial, points=()) -> TrialView:
    """The view of a stored trial; a verdict that does not parse is named, not raised."""
    verdict, note = None, None
    if trial.verdict:
        try:
            verdict = TrialVerdict.from_dict(trial.verdict)
        except (KeyError, TypeError, ValueError) as e:
            note = f"its verdict could not be read ({type(e).__name__}: {e})"
    return TrialView(trial, list(points), verdict, note)


def trial_command_view(cmd) -> CommandView:
    """The card's line for a trial command (store.commands.Command)."""
    cid, status, payload = int(cmd.command_id), str(cmd.status), dict(cmd.payload or {})
    what = ", ".join(f"×{k}" for k in payload.get("factors") or ())
    step, reason = cmd.applied_step, cmd.reason
    at = "?" if step is None else f"{int(step):,}"  # every entry is built: pending has no step
    text = {
        "pending": f"Trial #{cid} ({what}) is pending: waiting for the trainer to pick it up.",
        "claimed": f"Trial #{cid} ({what}) was claimed by the trainer: it runs at the next step.",
        "applied": f"Trial #{cid} ({what}) ended; the run continued from step {at}.",
        "refused": f"Trial #{cid} ({what}) was refused: {reason}",
        "cancelled": f"Trial #{cid} ({what}) was cancelled.",
        "undone": f"Trial #{cid} ({what}) is not in effect: {reason}.",
    }.get(status, f"Trial #{cid}: {status}")
    return CommandView(cid, status, text, payload, step, reason)


@dataclass(frozen=True)
class TrialCard:
    """The card's trial section: the offer, the latest trial command, the latest trial (with
    its points) and the earlier ones."""

    offer: TrialOffer
    command: CommandView | None = None
    latest: TrialView | None = None
    past: list = field(default_factory=list)  # TrialView, oldest first, without their points

    @property
    def running(self) -> bool:
        return self.latest is not None and self.latest.trial.status == "running"


def build_trial_card(
    config: Mapping | None,
    tokens_per_s: float | None,
    refusal: str | None,
    end_tokens: int | None,
    commands: Sequence = (),
    trials: Sequence = (),
    points: Sequence = (),
) -> TrialCard:
    """The trial section from the run's rows: its config, recent throughput and tokens at its
    end (the offer), its commands (the newest trial command's line), its trials, oldest first, and
    the newest trial's arm points."""
    cmds = [c for c in commands if getattr(c, "kind", None) == "trial"]
    views = [trial_view(t) for t in trials]
    newest = trial_view(trials[-1], points) if trials else None
    return TrialCard(
        trial_offer(config, tokens_per_s, refusal, end_tokens),
        trial_command_view(cmds[-1]) if cmds else None,
        newest,
        views[:-1],
    )
