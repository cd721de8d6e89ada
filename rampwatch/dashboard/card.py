"""The recommendation card on the live page: what the advisor says, and Approve / Reject / Cancel,
and beside Approve "Test ×2 / ×4 first" (a ramp trial, issue 26) with its section below the card.

Owns the card's drawing and its controls (content comes from dashboard/recommend.py): the verdict
and its evidence, the chosen tier's predicted peak against capacity, LR change and predicted
effect, the tier table (advisor/tier_table.py: every tier's memory, tokens/s, MFU, step time,
steps and ETA to the run's end, LR; the running tier marked ▶; key "tier_table"), the latest
ramp command's state (pending → applied at step N, or refused with the reason), the last ramp's
LR change where the run did not carry it out (the monitor's LR check), and the buttons. Stable
widget keys for tests and the browser test:
"approve" (label starts with "Approve"; primary only when the advisor says "Ramp now", else
"Approve early" behind the "override" checkbox; "Approve hand-plan step" for a tier that carries
out a due step of the operator's hand plan, dashboard/run_schedule.py, chosen by default and
needing no override: the plan was the operator's call), "reject", "cancel_command", "tier_choice", and the
operator's "rw_operator" (name) and "rw_token" (the operator token, dashboard/guard.py).
Read-only mode and runs that are not running draw the same card with no buttons; a run that
is not running gets "Not running" for its verdict, no forecast and no tier to choose (what it
ended at, and its tier table), a running one the advisor's
sentences with the forecast timed at its measured step rate. An LR note is a caption on its tier. A click is
checked again on the server (store_access.py): the token and the operator's name.
Reject hides that recommendation (Card.key) for this session until a new one appears.
A refusal stays on the card for ERROR_SECONDS (the page refreshes every few seconds, and a refresh
can interrupt the rerun that showed it), or until the operator edits their name or token; a
confirmation shows once, since the command's own line below it carries the lasting state.

Every Approve click makes exactly one command or says why not. The page reruns every few seconds,
so a click can land on a copy of the button that the server's last rerun drew differently.
Streamlit skips the callback of a widget that the last run drew disabled or did not draw, and
drops the value of one drawn disabled now: so Approve is never drawn disabled (a tier that cannot
be sent says "On hold: why" under the button, and a click on it gets that reason on the card), and
its return value catches a click whose callback was skipped. The callback only records the
approval (SENDING); the live page sends it (send_pending) before it reads the run, showing
"Sending…" until the store answers, so a refresh that interrupts the click's rerun sends it on the
next one, once (the command's idempotency key). A click held back by an open command that this
session itself submitted (`SENT`) says that command is its approval, not "Not submitted": under
load one click has left "Not submitted: already waiting on ramp #N" beside the command #N it had
just made (tests/e2e/test_approve_clicks.py, 2 runs in about 27; the callback seems to have run
twice, the second time with the button drawn after the send). The operator's name
and token are kept for the session: their fields are not drawn while the card hides its controls,
and Streamlit forgets a widget's value then. The token stays on the server (never sent back into
the page); its field says it is kept.

"Test first" (key "test_first") goes down the same path as Approve (the callback, SENDING,
send_pending, the idempotency key, the server's checks), with the command kind "trial"; its cost
shows under it before the click. A run whose loop runs no trials gets the reason instead of the
button. The trial section (render_trial) shows the latest trial: its arms' progress while it
runs, then per branch the loss difference, its bound, tolerance and pass/fail, the bracket for
the critical batch, what was kept and the calibration; and the run's earlier trials.
"""

from __future__ import annotations

import time

import streamlit as st

from rampwatch.advisor import tier_table
from rampwatch.advisor.gns_window import significant
from rampwatch.advisor.memory import format_gb
from rampwatch.advisor.throughput import RECENT
from rampwatch.dashboard import charts, store_access
from rampwatch.dashboard.recommend import Card, TierView, TrialCard, how_it_stopped
from rampwatch.dashboard.recommend import duration as recommend_duration

STALE_STEPS = 50  # an estimate this many steps behind the run means the measurement is off
REJECTED = "rw_rejected"
FLASH = "rw_flash"  # (kind, text, time.monotonic() when set): the latest action's outcome
ERROR_SECONDS = 30.0
SENDING = "rw_sending"  # an approval the callback recorded and the card has not sent yet
SEND_GIVE_UP_SECONDS = 60.0  # an approval still unsent after this is dropped, with a reason
CLICK_SEEN = "rw_click_seen"  # the Approve callback ran in this rerun
SENT = "rw_sent"  # the command ids this session submitted
PLAN_OFFERED = "rw_plan_offered"  # the hand-plan tier last chosen for the operator

OPERATOR, TOKEN = "rw_operator", "rw_token"  # the fields' widget keys
KEPT = {OPERATOR: "rw_kept_operator", TOKEN: "rw_kept_token"}  # their values, for the session


def _set_flash(kind: str, text: str) -> None:
    st.session_state[FLASH] = (kind, text, time.monotonic())


def _clear_flash() -> None:
    st.session_state.pop(FLASH, None)


def _who() -> dict:
    """The operator's name and token as typed, or as kept from earlier in the session."""
    state = st.session_state
    return {
        "operator": state.get(OPERATOR) or state.get(KEPT[OPERATOR]),
        "token": state.get(TOKEN) or state.get(KEPT[TOKEN]),
    }


PENDING = "pending until the trainer picks it up at its next step boundary."
# what a command of each kind is called in the card's messages
_WHAT = {"ramp": "the ramp to {}", "trial": "the trial {}"}
_SUBMITTED = {"ramp": "Ramp #{} to {} submitted", "trial": "Trial #{} ({}) submitted"}


def _approve(
    db,
    run_id: str,
    payload: dict,
    label: str,
    key: str,
    blocked: str | None,
    kind: str = "ramp",
    waiting_on: tuple[str, int] | None = None,
) -> None:
    """Approve's and Test first's callback (and its stand-in for a skipped one): a reason, or the
    approval to send. `waiting_on`: the open command (kind, id) that `blocked` names, if any."""
    st.session_state[CLICK_SEEN] = True
    if waiting_on is not None and waiting_on[1] in st.session_state.get(SENT, ()):
        # this session's own command: a second click, or Streamlit's second delivery of the
        # click that sent it (seen under load), is that approval, not a refusal
        what, cid = waiting_on
        _set_flash("info", f"{what.capitalize()} #{cid} is already submitted by you: {PENDING}")
        return
    if blocked:  # on hold when drawn: the card's reason, not the guard's
        _set_flash("error", f"Not submitted: {blocked}")
        return
    st.session_state[SENDING] = (db, run_id, kind, payload, label, key, time.monotonic())


def send_pending(slot) -> None:
    """Send the approval the callback recorded, saying so in `slot` until the store answers. The
    live page calls it before it reads the run, so the card it then draws shows the command."""
    pending = st.session_state.get(SENDING)
    if pending is None:
        return
    db, run_id, kind, payload, label, key, since = pending
    what = _WHAT[kind].format(label)
    if time.monotonic() - since > SEND_GIVE_UP_SECONDS:
        del st.session_state[SENDING]
        _set_flash(
            "error",
            f"Not submitted: {what} could not be sent for "
            f"{SEND_GIVE_UP_SECONDS:.0f} s; approve it again if you still want it.",
        )
        return
    slot.info(f"Sending {what}…", icon=":material/send:")
    try:
        cid = store_access.SUBMIT[kind](db, run_id, payload, key=key, **_who())
        st.session_state.setdefault(SENT, set()).add(cid)
        _set_flash("success", _SUBMITTED[kind].format(cid, label) + ": " + PENDING)
    except store_access.StoreError as e:
        _set_flash("error", f"Not submitted: {e}")
    del st.session_state[SENDING]  # after the flash: an interruption here loses no answer
    slot.empty()  # the answer is the card's to show


def _cancel(db, command_id: int, kind: str = "ramp") -> None:
    try:
        store_access.cancel_command(db, command_id, kind=kind, **_who())
        _set_flash("info", f"{kind.capitalize()} #{command_id} cancelled.")
    except store_access.StoreError as e:
        _set_flash("error", f"Could not cancel #{command_id}: {e}")


def _reject(key: str) -> None:
    st.session_state.setdefault(REJECTED, set()).add(key)


def _flash(slot) -> None:
    msg = st.session_state.get(FLASH)
    if msg is None:
        return
    kind, text, since = msg
    expired = kind == "error" and time.monotonic() - since >= ERROR_SECONDS
    if kind != "error" or expired:  # a confirmation shows once, a refusal until it expires
        del st.session_state[FLASH]
    if not expired:
        getattr(slot, kind)(text)


def _command_line(card: Card, slot) -> None:
    _status_line(card.command, slot)


def _status_line(c, slot) -> None:
    """A command's line (recommend.CommandView), by its status."""
    if c is None:
        return
    if c.status in ("pending", "claimed"):
        slot.info(c.text, icon=":material/hourglass_top:")
    elif c.status == "applied":
        slot.success(c.text, icon=":material/check_circle:")
    elif c.status == "refused":
        slot.error(c.text, icon=":material/block:")
    else:
        slot.caption(c.text)


def signed_percent(x: float) -> str:
    """+42%, -3.1%, +0.25%: two significant digits below 10%, never a bare "-0%"."""
    if x == 0:
        return "0%"
    mag = abs(x) * 100
    text = f"{mag:.0f}" if mag >= 10 else f"{mag:.2g}"
    return ("+" if x > 0 else "-") + text + "%"


def _stopped(run) -> str:
    """Why a run that is not running gets no ramp and no forecast."""
    if run.status == "stale":
        return (
            f"{how_it_stopped(run)} (no heartbeat): no ramp and no forecast until it reports again."
        )
    return f"{how_it_stopped(run)}: no ramp and no forecast."


def _verdict(card: Card, run) -> None:
    """One verdict: Ramp now, Not yet (with its forecast, timed at the run's pace), or Not
    running (no forecast for a run that will not take the ramp)."""
    d = card.decision
    if d is None:
        return
    if not run.running:
        st.info(f"**Not running.** {_stopped(run)}", icon=":material/stop_circle:")
    elif d.ready:
        st.success(f"**Ramp now.** {d.reason}", icon=":material/trending_up:")
    else:
        said = d.said(card.last_step, card.steps_per_second)
        st.info(f"**Not yet.** {said}", icon=":material/schedule:")


def _evidence(card: Card, running: bool) -> None:
    d = card.decision
    if d is None:
        return
    ev = d.evidence
    ns = "none yet"
    if ev.noise_scale is not None:
        ns = significant(ev.noise_scale)
        if ev.lower_bound is not None:
            ns += f" (95% lower bound {significant(ev.lower_bound)})"
    elif ev.lower_bound:
        ns = f"> {significant(ev.lower_bound)} (95%; the windowed |G|² is not positive)"
    trend = (
        "n/a"
        if ev.trend_per_step is None
        else f"{ev.trend_per_step:+.3g} sequences a step ({ev.trend})"
    )
    if not running:
        fc = "none (the run is not running)"
    elif d.forecast_range:  # a range, not a point: README "Forecast coverage" says why
        lo, hi = d.forecast_range
        fc = f"between steps {lo:,} and {hi:,}" if hi is not None else f"after step {lo:,}"
        fc += f" ({d.forecast_note})" if d.forecast_note else ""
    elif d.forecast_step is not None:  # above the ramp point: the hysteresis runs out then
        fc = f"ready at step ~{d.forecast_step:,} if the noise scale stays above the ramp point"
    else:
        fc = f"none ({d.forecast_note})" if d.forecast_note else "none"
    since = (
        "" if card.last_ramp_step is None else f" since the ramp at step {card.last_ramp_step:,}"
    )
    fresh = ""
    if card.latest_estimate_step is not None:
        behind = card.last_step - card.latest_estimate_step if card.last_step is not None else 0
        fresh = f" at step {card.latest_estimate_step:,}" + (
            f" — **{behind:,} steps old: the run measures no noise scale now**"
            if behind > STALE_STEPS
            else ""
        )
    st.markdown(
        f"- rests on: {card.evidence}\n"
        f"- samples: **{ev.n_samples}** noise-scale estimates (need {ev.min_estimates})\n"
        f"- noise scale **{ns}**{fresh} vs ramp point **{significant(ev.threshold_batch)}** "
        f"sequences\n"
        f"- above the ramp point for **{ev.steps_above}** of {ev.hysteresis_steps} estimates{since}\n"
        f"- trend: {trend}\n"
        f"- forecast crossing: {fc}\n"
        + (f"- policy: {card.policy.describe()}" if card.policy else "")
    )


def _tier_table(card: Card) -> None:
    """advisor/tier_table.py's rows, the running one marked ▶, and what their figures assume."""
    if not card.table:
        return
    st.markdown("**Tiers: memory, throughput, steps and hours to the run's end**")
    st.dataframe(
        [tier_table.cells(r) for r in card.table],
        hide_index=True,
        key="tier_table",
        column_config={
            "throughput from": st.column_config.TextColumn(width="medium"),
            "why": st.column_config.TextColumn(width="large"),
        },
    )
    st.caption(
        f"Throughput is measured (the median of the last {RECENT} steps a tier ran), else from "
        "a model fitted on the measured tiers (step time = accumulation × micro-batch time + "
        "per-step overhead, the micro-batch time a line in the per-device batch), else unknown. "
        "ETA = steps left × step time; LR × is against the running batch."
    )
    for n in card.table_notes:
        st.caption(n)


def _chosen(card: Card) -> TierView | None:
    if not card.tiers:
        return None
    labels = [v.label for v in card.tiers]
    planned = [i for i, v in enumerate(card.tiers) if v.plan is not None]
    default = planned[0] if planned else labels.index(card.suggested.label) if card.suggested else 0
    state = st.session_state
    if planned and state.get(PLAN_OFFERED) != labels[default]:  # a plan step just fell due
        state[PLAN_OFFERED] = state["tier_choice"] = labels[default]
    if state.get("tier_choice") not in labels:
        state["tier_choice"] = labels[default]
    label = st.radio("Tier", labels, key="tier_choice", horizontal=True)
    return card.tiers[labels.index(label)]


def _tier_detail(card: Card, v: TierView) -> None:
    t, cur = v.option, card.current
    cols = st.columns(4)
    cols[0].metric(
        "Batch",
        f"{t.tier.batch:,} seq",
        f"from {cur.batch:,}",
        delta_color="off",
        delta_arrow="off",
    )
    cap = cur.capacity_bytes
    if t.predicted_peak_bytes and cap:
        cols[1].metric(
            "Predicted peak",
            format_gb(t.predicted_peak_bytes),
            f"{t.predicted_peak_bytes / cap:.0%} of {format_gb(cap)}",
            delta_color="off",
            delta_arrow="off",
        )
    else:
        cols[1].metric(
            "Predicted peak",
            "—",
            "accumulation only" if t.fits else "unknown",
            delta_color="off",
            delta_arrow="off",
        )
    lr_note = f"base LR → {v.new_base_lr:.3g}" if v.new_base_lr else "of the current LR"
    cols[2].metric(
        "LR multiplier", f"×{t.lr_multiplier:.3f}", lr_note, delta_color="off", delta_arrow="off"
    )
    if v.effect:
        cols[3].metric(
            "Steps to target",
            signed_percent(-v.effect.step_savings),
            f"tokens {signed_percent(v.effect.example_cost)}",
            delta_color="off",
            delta_arrow="off",
        )
    else:
        cols[3].metric(
            "Steps to target",
            "—",
            "needs a noise-scale estimate",
            delta_color="off",
            delta_arrow="off",
        )
    if t.predicted_peak_bytes and cap:
        st.progress(
            min(1.0, t.predicted_peak_bytes / cap),
            text=f"predicted peak {format_gb(t.predicted_peak_bytes)} of "
            f"{format_gb(cap)} capacity (usable {format_gb(card.usable_bytes or cap)})",
        )
    if v.plan is not None:
        st.caption(f"This tier carries out {v.plan}: your plan, approved step by step.")
    if v.lr_warning:  # a note on this tier, not a second verdict beside the card's
        st.caption(f"Note on this tier: {v.lr_warning}.")
    if not t.fits:
        st.error(f"This tier cannot be approved: {t.reason}", icon=":material/memory:")


def render(card: Card, *, db, run, read_only: bool, trial: TrialCard | None = None) -> None:
    """Draw the card for `run` (store.reader.Run); buttons only when writable and running;
    `trial`: the trial section's content, for "Test first" beside Approve."""
    st.subheader("Recommendation")
    with st.container(border=True):
        # fixed slots: a message appearing or going does not shift the elements below it, so a
        # refresh never shows the previous buttons beside the new ones while it runs
        flash, now, command, lr_check = st.empty(), st.empty(), st.empty(), st.empty()
        _flash(flash)
        _command_line(card, command)
        if card.lr_check:  # the ramp's record says what the run carried out
            lr_check.warning(card.lr_check, icon=":material/warning:")
        if card.awaiting_reread:  # "Now" would be the old tier, and Approve a second ramp
            now.caption(
                f"Now: the tier of ramp #{card.command.command_id}, from step "
                f"{card.command.applied_step + 1}; the card reads the run again at its "
                "next step."
            )
            return
        running = run.running
        if card.current is not None:  # a run that stopped: what it ended at, not "now"
            now.caption(("Now: " if running else "At its last step: ") + card.current.describe())
        # one container per part whose element count varies, so the buttons below keep their
        # place in the element tree and a refresh never shows a stale copy beside the new ones
        with st.container():
            for p in card.problems:
                st.warning(p)
        rejected = card.key in st.session_state.get(REJECTED, set())
        if rejected:
            st.caption(
                "You rejected this recommendation for this session; a new one appears "
                "after the next ramp or when the advisor suggests another tier."
            )
            return
        with st.container():
            _verdict(card, run)
        if card.current is None:
            return
        v = None  # a run that stopped takes no ramp: no tier to choose, its tiers' figures stay
        with st.container():
            if running:
                v = _chosen(card)
        with st.container():
            if v is not None:
                _tier_detail(card, v)
        with st.container():
            _tier_table(card)
        with st.expander("Evidence", expanded=False):
            _evidence(card, running)
            st.caption(card.memory_note)
            for n in card.notes:
                st.caption(n)
        if read_only:
            return
        if not running:
            st.caption(f"The run is {run.status}: ramp commands go only to running runs.")
            return
        refusal = store_access.ramp_refusal(run.config)
        if refusal:
            st.info(f"This run {refusal}.", icon=":material/pan_tool:")
            return
        _controls(card, v, db, run.run_id, trial)


def _clause(sentences: str) -> str:
    """Sentences as a clause inside parentheses: lower-case start, no final full stop."""
    return (sentences[:1].lower() + sentences[1:]).rstrip(".")


def _approval_key(card: Card, v: TierView) -> str:
    """The command's idempotency key: the same for every click (or replay) on this card state,
    new once the latest command changed (applied, refused, cancelled) or a ramp happened."""
    last = card.command.command_id if card.command else 0
    tier = v.option.tier
    return f"{card.key}:{tier.per_device_batch}x{tier.accum}:after-{last}"


def _typed(field: str) -> None:
    """A field was edited: keep its value for the session; a refusal was about the old one."""
    st.session_state[KEPT[field]] = st.session_state.get(field) or ""
    _clear_flash()


def _operator() -> None:
    """Who approves: a typed name (recorded in the command log) and the operator token."""
    state = st.session_state
    if OPERATOR not in state and state.get(KEPT[OPERATOR]):
        state[OPERATOR] = state[KEPT[OPERATOR]]  # a name is no secret: back into its field
    left, right = st.columns(2)
    left.text_input(
        "Operator",
        key=OPERATOR,
        max_chars=64,
        placeholder="your name",
        help="recorded with every command you send",
        on_change=_typed,
        args=(OPERATOR,),
    )
    right.text_input(
        "Operator token",
        key=TOKEN,
        type="password",
        placeholder="kept for this session" if state.get(KEPT[TOKEN]) else None,
        help="printed by `rampwatch dashboard` at start (or its RAMPWATCH_TOKEN); Enter "
        "sends it; every Approve and Cancel is checked against it on the server",
        on_change=_typed,
        args=(TOKEN,),
    )


def _controls(card: Card, v: TierView | None, db, run_id: str, trial: TrialCard | None) -> None:
    open_cmd = card.command if card.command and card.command.open else None
    waiting = _waiting_on(open_cmd, trial)
    if store_access.agent_api_enabled():
        st.warning(store_access.AGENT_API_REFUSAL)
        return
    _operator()
    cols = st.columns([3, 2, 1, 2])
    callback_ran = st.session_state.pop(CLICK_SEEN, False)
    if v is not None:
        t = v.option
        label = f"{t.tier.per_device_batch} × {t.tier.accum}"
        blocked = t.reason if not t.fits else _busy(waiting, trial)
        # a hand-plan step is the operator's own call, made when the plan was typed
        ready = v.plan is not None or (card.decision is not None and card.decision.ready)
        if not ready and blocked is None:  # an operator's override: it must look like one
            early = _clause(card.decision.status) if card.decision else "no recommendation yet"
            if not st.checkbox(
                f"Ramp before the advisor is ready ({early})",
                key="override",
                help="the advisor has not recommended this ramp yet; approving it now is your call",
            ):
                blocked = "tick the override first: the advisor says not yet"
        on = waiting if t.fits else None  # the open command is what `blocked` names
        args = (db, run_id, v.payload(), label, _approval_key(card, v), blocked, "ramp", on)
        clicked = cols[0].button(
            f"Approve hand-plan step: ramp to {label} (batch {t.tier.batch:,})"
            if v.plan is not None
            else f"Approve ramp to {label} (batch {t.tier.batch:,})"
            if ready
            else f"Approve early: ramp to {label} (batch {t.tier.batch:,})",
            key="approve",
            type="primary" if ready and blocked is None else "secondary",
            help=blocked
            or "writes a ramp command; the trainer re-checks and applies it at a step boundary",
            on_click=_approve,
            args=args,
        )
        if blocked:  # never disabled: a click must reach the server and get this reason
            cols[0].caption(f"On hold: {blocked}")
        if clicked and not callback_ran:  # Streamlit skipped the callback: see the docstring
            _approve(*args)
            st.session_state.pop(CLICK_SEEN, None)
            send_pending(cols[3])
            _flash(cols[3])
    if trial is not None:
        _test_first(card, trial, db, run_id, waiting, cols[1], cols[3], callback_ran)
    cols[2].button(
        "Reject",
        key="reject",
        on_click=_reject,
        args=(card.key,),
        help="hide this recommendation for this session",
    )
    if open_cmd is not None and open_cmd.status == "pending":
        cols[3].button(
            f"Cancel ramp #{open_cmd.command_id}",
            key="cancel_command",
            on_click=_cancel,
            args=(db, open_cmd.command_id),
        )


# ---- ramp trials (issue 26): "Test first" beside Approve, and the trial section -------------


def _waiting_on(open_cmd, trial: TrialCard | None) -> tuple[str, int] | None:
    """The open command (kind, id) that holds every new one back: a ramp, else a trial."""
    if open_cmd is not None:
        return "ramp", open_cmd.command_id
    c = trial.command if trial is not None else None
    return ("trial", c.command_id) if c is not None and c.open else None


def _busy(waiting: tuple[str, int] | None, trial: TrialCard | None) -> str | None:
    """Why nothing more can be sent: an open command, or a trial running; None if neither."""
    if waiting is not None:
        return f"already waiting on {waiting[0]} #{waiting[1]}"
    if trial is not None and trial.running:
        return f"trial {trial.latest.trial.trial_id} is running"
    return None


def _trial_key(card: Card, trial: TrialCard) -> str:
    """The trial command's idempotency key: the same for every click on this card state, new
    once the latest ramp or trial command changed (as Approve's)."""
    ids = [c.command_id for c in (card.command, trial.command) if c is not None]
    factors = "-".join(map(str, trial.offer.factors))
    return f"{card.key}:trial:{factors}:after-{max(ids, default=0)}"


def _test_first(card, trial: TrialCard, db, run_id, waiting, slot, note, callback_ran) -> None:
    """ "Test ×2 / ×4 first": Approve's path with the command kind "trial", its cost shown."""
    offer = trial.offer
    if offer.refusal:  # a plain refusal, never a button that does nothing
        slot.caption(f"No trials: this run {offer.refusal}.")
        return
    blocked = _busy(waiting, trial)
    key = _trial_key(card, trial)
    args = (db, run_id, offer.payload(), offer.label, key, blocked, "trial", waiting)
    clicked = slot.button(
        f"Test {offer.label} first",
        key="test_first",
        help=blocked
        or "writes a trial command: the trainer trains each branch from a snapshot, keeps the "
        "largest that is as good as the control, and continues from it",
        on_click=_approve,
        args=args,
    )
    slot.caption(offer.cost_text)
    if blocked:  # never disabled: see Approve
        slot.caption(f"On hold: {blocked}")
    if clicked and not callback_ran:  # Streamlit skipped the callback: see the docstring
        _approve(*args)
        st.session_state.pop(CLICK_SEEN, None)
        send_pending(note)
        _flash(note)


def render_trial(trial: TrialCard | None, *, run) -> None:
    """The trial section: the latest trial command, a refusal or the offer, the latest trial
    (progress, or its result and chart), and the run's earlier trials."""
    if trial is None:
        return
    st.subheader("Ramp trials")
    with st.container(border=True):
        _status_line(trial.command, st.empty())
        offer = trial.offer
        if offer.refusal:
            st.info(f"This run {offer.refusal}.", icon=":material/pan_tool:")
        if trial.latest is None:
            if not offer.refusal:
                st.caption(
                    f"No trial yet. Test {offer.label} first trains each branch for the same "
                    f"tokens as the control, from one snapshot, and keeps the largest branch "
                    f"that is as good. {offer.cost_text}"
                )
        else:
            _trial_state(trial.latest, run)
        if trial.past:
            with st.expander(f"Earlier trials ({len(trial.past)})", expanded=False):
                st.dataframe(
                    [_trial_row(v) for v in reversed(trial.past)],
                    hide_index=True,
                    key="trials_table",
                    column_config={"result": st.column_config.TextColumn(width="large")},
                )


def _trial_row(v) -> dict:
    t = v.trial
    return {
        "trial": t.trial_id,
        "step": t.start_step,
        "status": t.status,
        "branches": ", ".join(f"×{k}" for k in t.factors or ()),
        "kept": f"×{t.kept_factor}" if t.kept_factor else None,
        "cost (tokens)": t.cost_tokens,
        "result": v.verdict.summary if v.verdict else t.reason or t.message,
    }


def _trial_state(v, run) -> None:
    t = v.trial
    where = (
        f"Trial {t.trial_id} from step {t.start_step:,}"
        if t.start_step is not None
        else (f"Trial {t.trial_id}")
    )
    if t.status == "running":
        if run.status != "running":
            st.warning(
                f"{where} was cut short: the run is {run.status}. Its resume restores the "
                "snapshot and records the trial as abandoned.",
                icon=":material/warning:",
            )
        else:
            st.info(f"{where} is running. {t.message or ''}", icon=":material/science:")
        _arm_progress(v)
    elif t.status == "finished":
        said = v.verdict.summary if v.verdict else t.message or where
        if v.verdict and v.verdict.bracket is None:  # no answer: neither a pass nor a fail
            st.info(said, icon=":material/help:")
        else:
            st.success(said, icon=":material/science:")
        _trial_result(v)
    else:
        st.warning(f"{where} was abandoned: {t.reason or 'no reason given'}.")
    if v.note:
        st.caption(f"{where}: {v.note}")
    if v.points:
        st.plotly_chart(charts.trial_figure(v.points), key="chart_trial")


def _arm_progress(v) -> None:
    """Each arm's tokens done of Δ: the control first, then the branches."""
    t = v.trial
    done = {a.factor: a for a in v.arms}
    delta = t.delta_tokens
    for k in (1, *(t.factors or ())):
        a = done.get(k)
        tokens = a.tokens if a else 0
        name = "control ×1" if k == 1 else f"branch ×{k}"
        of = f" of {delta:,}" if delta else ""
        state = " (done)" if a and a.done else "" if a else " (waiting)"
        if a and a.examples and not a.done:
            state = (
                f" (evaluating again on {a.examples:,} held-out examples: {a.first:,} could not "
                "tell whether Δ is too long)"
            )
        st.progress(
            min(1.0, tokens / delta) if delta else 0.0, text=f"{name}: {tokens:,}{of} tokens{state}"
        )


def _trial_result(v) -> None:
    t = v.trial
    rows = v.branch_rows()
    if rows:
        # a branch not run has no figures: blank cells, so the figures are text (Streamlit
        # draws a missing number as a grey "None", which reads as a value)
        figures = v.FIGURES
        st.dataframe(
            [r | {c: "" if r[c] is None else f"{r[c]:.4f}" for c in figures} for r in rows],
            hide_index=True,
            key="trial_branches",
            column_config={c: st.column_config.TextColumn(alignment="right") for c in figures},
        )
        for line in v.not_run_lines():
            st.caption(line)
    if v.bracket_text:
        st.markdown(v.bracket_text)
    kept = "the control (×1)" if t.kept_factor in (None, 1) else f"branch ×{t.kept_factor}"
    cost = f"{t.cost_tokens:,} tokens discarded" if t.cost_tokens is not None else "cost unknown"
    if t.cost_seconds is not None:
        cost += f", {recommend_duration(t.cost_seconds)}"
    at = f" from step {t.continue_step:,}" if t.continue_step is not None else ""
    held_out = ""
    if v.verdict:
        first = v.verdict.first_examples
        stage = f" ({first:,} first, which could not tell)" if first else ""
        held_out = f" Measured on {v.verdict.examples:,} held-out examples{stage}."
    st.caption(f"Kept {kept}: the run continued{at}. Cost: {cost}.{held_out}")
