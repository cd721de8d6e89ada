"""Live page (AppTest on seeded databases): charts by trace name, event markers, the
recommendation card in every command state, Approve / Cancel writing the real command table,
read-only mode, and a tier that cannot be approved."""

from __future__ import annotations

import pytest

from rampwatch.dashboard import live_data
from rampwatch.store import commands
from rampwatch.store import names as M
from tests import seed

CHARTS = (
    "Loss",
    "Gradient norm (before clipping)",
    "Gradient noise scale vs batch",
    "Memory (GB)",
    "Throughput",
)


@pytest.fixture
def live(db_path):
    run = seed.live_run(db_path)
    yield run
    run.close()


def _cmd(db, state):
    run = seed.with_command(db, state)
    return run


def test_charts_traces_events_and_nonfinite(live, monkeypatch):
    at = seed.app(monkeypatch, live.db)
    assert not at.exception
    figs = seed.figures(at)
    assert set(CHARTS) <= set(figs), figs.keys()
    loss = seed.trace_names(figs["Loss"])
    assert {"loss (raw)", "loss (smoothed)", "val_loss", "loss (raw) non-finite"} <= set(loss)
    nonfinite = next(t for t in figs["Loss"]["data"] if t["name"] == "loss (raw) non-finite")
    assert sorted(nonfinite["x"]) == [150, 151, 320]  # markers where the NaN losses are
    assert {"noise scale (B_simple)", "batch (sequences)"} <= set(
        seed.trace_names(figs["Gradient noise scale vs batch"])
    )
    mem = seed.trace_names(figs["Memory (GB)"])
    assert {"peak memory", "capacity", "usable"} <= set(mem)
    assert [n for n in mem if n.startswith("×")] == [
        # one device: every tier keeps accumulation >= 2 (the noise scale); 16 ran out of memory
        "×2: 8 × 4 (25.6 GB)",
        "×4: 32 × 2 (73.6 GB)",
        "×8: 32 × 4 (73.6 GB)",
    ]
    assert {"tokens/s", "MFU (%)"} <= set(seed.trace_names(figs["Throughput"]))
    assert "grad_norm" in seed.trace_names(figs["Gradient norm (before clipping)"])
    for title in CHARTS:  # every event is a vertical marker on every chart
        shapes = seed.event_shapes(figs[title])
        assert len(shapes) == live.events == 4, title
        assert sorted(s["x0"] for s in shapes) == [100, 150, 250, 300]
    text = seed.texts(at)
    assert "Ramp now." in text and "ramp the batch" in text
    assert "status **running**" in text


def test_card_evidence_and_chosen_tier(live, monkeypatch):
    at = seed.app(monkeypatch, live.db)
    text = seed.texts(at)
    assert "noise-scale estimates (need 30)" in text  # the ramp policy's default
    assert "vs ramp point **16.0** sequences" in text  # the batch of 16 (the policy's 1×)
    assert "(95% lower bound 47.6)" in text  # the newest estimate's bound
    assert "keep the batch within [1, 2] × the noise scale" in text
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Batch"] == "32 seq"
    assert metrics["Predicted peak"] == "25.6 GB"
    assert metrics["LR multiplier"] == "×1.414"
    assert metrics["Steps to target"].startswith("-")  # a doubling saves steps
    # choosing the ×4 tier updates the card
    at.radio(key="tier_choice").set_value("×4: 32 × 2 (73.6 GB)").run()
    assert {m.label: m.value for m in at.metric}["Batch"] == "64 seq"
    assert at.button(key="approve").label.startswith("Approve ramp to 32 × 2")


def test_approve_writes_pending_then_cancel(live, monkeypatch):
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    approve = at.button(key="approve")
    assert approve.label.startswith("Approve") and "On hold" not in seed.texts(at)
    approve.click().run()
    assert not at.exception
    cmds = commands.list_commands(live.db, live.run_id)
    assert len(cmds) == 1
    c = cmds[0]
    assert (c.status, c.kind, c.actor) == ("pending", "ramp", "alice (dashboard, token)")
    assert c.payload == {"per_device_batch": 8, "accum": 4, "lr_multiplier": pytest.approx(2**0.5)}
    text = seed.texts(at)
    assert f"Ramp #{c.command_id} to 8 per device × 4 accumulation is pending" in text
    assert f"On hold: already waiting on ramp #{c.command_id}" in text  # one open ramp at a time
    at.button(key="cancel_command").click().run()
    assert commands.get(live.db, c.command_id).status == "cancelled"
    assert "was cancelled" in seed.texts(at)
    assert "On hold" not in seed.texts(at)


def test_approve_again_on_ones_own_pending_ramp_says_it_is_submitted(live, monkeypatch):
    """A second Approve (or Streamlit's second delivery of the first click) in the session that
    sent the pending command is not a refusal: that command is this approval. Another session
    gets the card's reason."""
    at = seed.sign_in(seed.app(monkeypatch, live.db))
    at.button(key="approve").click().run()
    [c] = commands.list_commands(live.db, live.run_id)
    at.button(key="approve").click().run()
    assert not at.exception and len(commands.list_commands(live.db, live.run_id)) == 1
    said = [str(e.value) for e in at.info]
    assert any(f"Ramp #{c.command_id} is already submitted by you" in m for m in said), said
    assert not [e for e in at.error if "Not submitted" in str(e.value)]
    other = seed.sign_in(seed.app(monkeypatch, live.db))
    other.button(key="approve").click().run()
    refused = [str(e.value) for e in other.error]
    assert f"Not submitted: already waiting on ramp #{c.command_id}" in refused, refused


@pytest.mark.parametrize(
    "state,expected,kind",
    [
        ("pending", "is pending: waiting for the trainer", "info"),
        ("claimed", "was claimed by the trainer", "info"),
        ("applied", "was applied at step 399", "success"),
        (
            "refused",
            "was refused: per-device batch 32 needs about 90.0 GB > 76.0 GB usable",
            "error",
        ),
    ],
)
def test_card_command_states(db_path, monkeypatch, state, expected, kind):
    run = seed.with_command(db_path, state)
    try:
        at = seed.app(monkeypatch, db_path)
        assert not at.exception
        msgs = [str(e.value) for e in getattr(at, kind)]
        assert any(
            f"Ramp #{run.command_id} to 8 per device × 4 accumulation {expected}" in m for m in msgs
        ), msgs
        keys = {b.key for b in at.button}
        assert ("cancel_command" in keys) == (state == "pending")
        if state == "applied":  # at step 399, the run's last: nothing offered until step 400
            assert "approve" not in keys
            assert "from step 400; the card reads the run again" in seed.texts(at)
        else:
            held = "On hold: already waiting on ramp" in seed.texts(at)
            assert held == (state in ("pending", "claimed"))
    finally:
        run.close()


def test_after_an_applied_ramp_the_card_offers_again_once_the_run_moved_on(db_path, monkeypatch):
    run = seed.with_command(db_path, "applied")
    try:
        run.writer.log(400, {M.PER_DEVICE_BATCH: 8, M.ACCUM: 4, M.BATCH_SEQS: 32})
        run.writer.flush()
        at = seed.app(monkeypatch, db_path)
        assert "Now: 8 per device × 4 accumulation" in seed.texts(at)
        assert "approve" in {b.key for b in at.button}
    finally:
        run.close()


def test_reject_hides_until_new_recommendation(live, monkeypatch):
    at = seed.app(monkeypatch, live.db)
    at.button(key="reject").click().run()
    text = seed.texts(at)
    assert "You rejected this recommendation" in text and "Ramp now." not in text
    assert "approve" not in {b.key for b in at.button}
    assert commands.list_commands(live.db, live.run_id) == []  # rejecting writes nothing
    # a ramp makes a new recommendation
    live.writer.event(M.EVENT_RAMP, "ramp (command 1): 8 x 2 -> 8 x 4", step=399)
    assert live.writer.flush()
    at.run()
    assert "You rejected this recommendation" not in seed.texts(at)
    assert "approve" in {b.key for b in at.button}


def test_read_only_has_no_controls(live, monkeypatch):
    at = seed.app(monkeypatch, live.db, read_only=True)
    assert not at.exception
    assert [b.key for b in at.button] == []
    assert "Ramp now." in seed.texts(at)  # same card, no buttons
    assert set(CHARTS) <= set(seed.figures(at))
    assert commands.list_commands(live.db, live.run_id) == []


def test_tier_that_does_not_fit_cannot_be_approved(db_path, monkeypatch):
    # its per-device batch 8 just ran out of memory, and on a 12 GB device nothing smaller fits
    run = seed.live_run(db_path, oom_at_running=True, capacity=12 * seed.GB)
    try:
        at = seed.app(monkeypatch, db_path)
        assert not at.exception
        assert "On hold: even per-device batch 1 needs" in seed.texts(at)
        errors = [str(e.value) for e in at.error]
        assert (
            "This tier cannot be approved: even per-device batch 1 needs 12.0 GB > 11.4 GB "
            "usable (known to run out of memory: 8, 16)" in errors
        )
    finally:
        run.close()


def test_more_rows_arrive_and_the_page_refreshes(live, monkeypatch):
    at = seed.app(monkeypatch, live.db)
    before = seed.figures(at)["Loss"]
    raw = next(t for t in before["data"] if t["name"] == "loss (raw)")
    assert max(raw["x"]) == 399
    for s in range(400, 450):
        live.writer.log(s, {M.LOSS: 2.0, M.GNS: 90.0, M.BATCH_SEQS: 16})
    assert live.writer.flush()
    at.run()
    raw = next(t for t in seed.figures(at)["Loss"]["data"] if t["name"] == "loss (raw)")
    assert max(raw["x"]) == 449 and len(raw["x"]) == 450
    assert "step **449**" in seed.texts(at)


def test_the_runs_own_metrics_are_charted_as_they_appear(live, monkeypatch):
    """A loop's own metrics (extra=, a framework's validation) were only in Compare: now each
    gets a chart under "More charts" the first time it appears; the monitor's others (lr, step
    time) are offered; a chart taken out stays out when more rows come."""
    for s in range(0, 400, 50):
        live.writer.log(s, {"tok_acc": s / 400})
    assert live.writer.flush()
    at = seed.app(monkeypatch, live.db)
    assert not at.exception
    more = at.multiselect(key="more_charts")
    assert more.value == ["tok_acc"]
    assert {M.LR, M.STEP_TIME, "tok_acc"} <= set(more.options)
    assert not set(live_data.LIVE_METRICS) & set(more.options)  # drawn above already
    fig = seed.figures(at)["tok_acc"]
    line = next(t for t in fig["data"] if t["name"] == "tok_acc")
    assert line["x"] == list(range(0, 400, 50)) and line["mode"] == "lines+markers"
    more.set_value(["tok_acc", M.LR]).run()
    assert seed.figures(at)[M.LR]["data"]  # fetched at once, not at the next refresh
    at.multiselect(key="more_charts").set_value([M.LR]).run()
    live.writer.log(400, {"tok_acc": 1.0, "valid/mae": 0.25})  # a new name, and an old one
    assert live.writer.flush()
    for _ in range(live_data.NAMES_EVERY):  # the names are read every so many refreshes
        at.run()
    assert at.multiselect(key="more_charts").value == [M.LR, "valid/mae"]
    figs = seed.figures(at)
    assert "tok_acc" not in figs and figs["valid/mae"]["data"][0]["y"] == [0.25]


def test_finished_run_has_card_but_no_buttons(db_path, monkeypatch):
    rid = seed.finished_run(db_path, 32)
    at = seed.app(monkeypatch, db_path)
    assert not at.exception
    assert "approve" not in {b.key for b in at.button}
    assert "The run is finished: ramp commands go only to running runs." in seed.texts(at)
    assert rid in seed.texts(at)
    # what it ended at, and its tiers' measured figures; no tier to choose for a ramp to come
    assert "tier_choice" not in {r.key for r in at.radio}
    assert any(c.value.startswith("At its last step: ") for c in at.caption)
    assert not any(c.value.startswith("Now: ") for c in at.caption)
    assert "Tiers: memory, throughput, steps and hours to the run's end" in seed.texts(at)


def test_busy_database_keeps_the_last_refresh(live, monkeypatch):
    import threading

    from rampwatch.dashboard import store_access
    from rampwatch.store import write_connection

    at = seed.app(monkeypatch, live.db)
    monkeypatch.setattr(store_access, "TIMEOUT", 0.3)
    held, release = threading.Event(), threading.Event()

    def hold():
        with write_connection(live.db):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(10)
        at.run()
    finally:
        release.set()
        t.join()
    assert not at.exception
    assert any("Showing the previous refresh:" in c.value and "busy" in c.value for c in at.caption)
    assert set(CHARTS) <= set(seed.figures(at))  # the charts stay


def test_read_only_never_submits(live, monkeypatch):
    from rampwatch.dashboard import store_access

    monkeypatch.setenv("RAMPWATCH_READ_ONLY", "1")
    with pytest.raises(store_access.CommandError, match="read-only"):
        store_access.submit_ramp(
            live.db, live.run_id, seed.RAMP_PAYLOAD, operator=seed.OPERATOR, token=seed.TOKEN
        )
    assert commands.list_commands(live.db, live.run_id) == []


def test_card_says_when_the_noise_scale_stopped_being_measured(db_path, monkeypatch):
    # estimates stop at step 300 of 400 (e.g. a tier with accumulation 1 on one device): the
    # card names the newest estimate's step and that it is old, never shows it as current
    run = seed.live_run(db_path, estimates_until=300)
    try:
        at = seed.app(monkeypatch, db_path)
        assert not at.exception
        text = seed.texts(at)
        assert "at step 300 — **99 steps old: the run measures no noise scale now**" in text
        noise = seed.figures(at)["Gradient noise scale vs batch"]
        points = next(t for t in noise["data"] if t["name"] == "noise scale (B_simple)")
        assert max(x for x, y in zip(points["x"], points["y"], strict=True) if y is not None) <= 300
    finally:
        run.close()


def test_lost_records_are_a_visible_warning_on_live_and_runs(live, monkeypatch):
    """Records that never reached the database (the writer's 'dropped' alerts, a damaged
    spool's 'lost_metric_records') are said at the top of the live page and on the Runs page."""
    live.writer.event(
        M.EVENT_ALERT,
        "36 records dropped by the writer: 36 × disk full",
        step=390,
        data={"dropped": 36, "reasons": {"disk full": 36}},
    )
    live.writer.event(M.EVENT_ALERT, "spool damaged", step=395, data={"lost_metric_records": 4})
    live.writer.flush()
    at = seed.app(monkeypatch, live.db)
    warnings = [str(w.value) for w in at.warning]
    assert any(
        w.startswith("40 records of this run never reached the database") for w in warnings
    ), warnings
    at.switch_page("views/runs.py").run()
    [table] = at.dataframe
    assert list(table.value["lost records"]) == [40]
    assert any("1 run(s) lost records" in str(w.value) for w in at.warning)


def test_approve_before_the_advisor_is_ready_is_a_marked_override(db_path, monkeypatch):
    """'Not yet' never sits beside a primary Approve: the button is secondary, says "early",
    and is on hold until the operator ticks the override that repeats the advisor's reason."""
    run = seed.live_run(db_path, ramp_due=False)
    try:
        at = seed.sign_in(seed.app(monkeypatch, db_path))
        at.run()
        assert any("Not yet." in str(i.value) for i in at.info)
        early = at.button(key="approve")
        assert early.label.startswith("Approve early: ramp to")
        assert "On hold: tick the override first" in seed.texts(at)
        assert early.proto.type == "secondary"
        assert "Ramp before the advisor is ready (" in at.checkbox(key="override").label
        at.checkbox(key="override").check().run()
        assert "On hold" not in seed.texts(at)
        at.button(key="approve").click().run()
        [c] = commands.list_commands(db_path, run.run_id)
        assert c.status == "pending" and c.actor == "alice (dashboard, token)"
    finally:
        run.close()


def test_alerts_that_hold_are_banners(db_path, monkeypatch):
    """The seeded run's non-finite-gradient alert (step 150) is long past, so no banner; a
    fresh one, an OOM recovery, and 'noise scale not measured' while no estimate is fresh are."""
    run = seed.live_run(db_path, estimates_until=300)
    try:
        at = seed.app(monkeypatch, db_path)
        texts = [str(w.value) for w in at.warning]
        assert not any("non-finite gradient" in t for t in texts), texts
        run.writer.event(
            M.EVENT_ALERT,
            "noise scale not measured: accumulation 1 on one device "
            "gives one batch size per step; use accumulation ≥ 2",
            step=1,
        )
        run.writer.event(
            M.EVENT_ALERT, "non-finite gradient: step left out of the noise scale", step=395
        )
        run.writer.event(
            M.EVENT_OOM, "out of memory at per-device batch 8; redone at 4 x 4", step=396
        )
        run.writer.flush()
        at = seed.app(monkeypatch, db_path)
        texts = [str(w.value) for w in at.warning]
        assert any(t.startswith("**Alert at step 1:** noise scale not measured") for t in texts)
        assert any(t.startswith("**Alert at step 395:** non-finite gradient") for t in texts)
        assert any(t.startswith("**Out of memory at step 396:**") for t in texts)
        at.switch_page("views/runs.py").run()
        [table] = at.dataframe
        assert list(table.value["alerts"]) == [3]  # the seeded one at 150 and the two above
    finally:
        run.close()


def test_a_run_that_takes_no_ramps_says_so_and_offers_no_approve(db_path, monkeypatch):
    """A loop that cannot change its batch mid-run (ramp='off'): the card says to ramp by hand,
    draws no Approve, and the store refuses a command sent around the page."""
    run = seed.live_run(db_path, ramp="off", ramp_note="this trainer fixes its batch at start")
    try:
        at = seed.app(monkeypatch, db_path)
        assert not at.exception
        text = seed.texts(at)
        assert (
            "This run takes no ramps from the dashboard: this trainer fixes its batch at "
            "start; change its batch by hand."
        ) in text
        assert not [b for b in at.button if b.key == "approve"]
        with pytest.raises(commands.CommandError, match="takes no ramps from the dashboard"):
            commands.submit(
                db_path, run.run_id, "ramp", {"per_device_batch": 8, "accum": 4}, actor="test"
            )
    finally:
        run.close()
