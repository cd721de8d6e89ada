"""Compare page (AppTest on seeded databases): overlays by run on each axis, the config diff,
steps/tokens/time to a target loss, and the critical-batch fit (or what it still lacks)."""

from __future__ import annotations

import json

import pytest

from rampwatch import store
from tests import seed


@pytest.fixture
def four(db_path):
    ids = seed.compare_runs(db_path)  # batches 16, 32, 64, 128; S = 100 (1 + 64/B)
    return db_path, ids


def _compare(monkeypatch, db):
    at = seed.app(monkeypatch, db, page="views/compare.py")
    assert not at.exception, [e.message for e in at.exception]
    return at


TABLES = {"config_diff": "key", "target_table": "reached"}  # table -> a column only it has


def _table(at, name):
    return next(d.value for d in at.dataframe if TABLES[name] in d.value.columns)


def test_overlay_per_run_and_axes(four, monkeypatch):
    db, ids = four
    at = _compare(monkeypatch, db)
    assert set(at.multiselect(key="compare_runs").value) == set(ids)
    fig = seed.figures(at)["loss by step"]
    assert sorted(seed.trace_names(fig)) == ["b128", "b16", "b32", "b64"]
    b16 = next(t for t in fig["data"] if t["name"] == "b16")
    assert b16["x"][:3] == [0, 1, 2] and len(b16["x"]) == 600
    at.radio(key="compare_x").set_value("tokens").run()
    fig = seed.figures(at)["loss by tokens"]
    b16 = next(t for t in fig["data"] if t["name"] == "b16")
    assert b16["x"][:2] == [16 * 128, 32 * 128]  # tokens_seen after steps 0 and 1
    at.radio(key="compare_x").set_value("time").run()
    fig = seed.figures(at)["loss by seconds"]
    b64 = next(t for t in fig["data"] if t["name"] == "b64")
    assert b64["x"][-1] == pytest.approx(600 * 0.04)  # step_time 0.04 s × 600 steps
    assert "Time axis: training time (cumulative step_time)." in seed.texts(at)
    at.selectbox(key="compare_metric").set_value("mem_peak").run()
    assert "mem_peak by seconds" in seed.figures(at)


def test_config_diff_shows_only_what_differs(four, monkeypatch):
    db, _ = four
    rows = _table(_compare(monkeypatch, db), "config_diff")
    keys = list(rows["key"])
    assert keys == ["per_device_batch"]  # lr, optimizer, model.* are all the same
    assert sorted(rows.iloc[0][["b16", "b32", "b64", "b128"]]) == sorted(["16", "32", "64", "128"])


def test_config_diff_flattens_nested(db_path, monkeypatch):
    seed.finished_run(db_path, 16, name="a", lr=1e-3)
    seed.finished_run(db_path, 16, name="b", lr=3e-3)
    rows = _table(_compare(monkeypatch, db_path), "config_diff")
    assert list(rows["key"]) == ["lr"]


def test_steps_to_target_and_critical_batch(four, monkeypatch):
    db, _ = four
    at = _compare(monkeypatch, db)
    at.slider(key="compare_smoothing").set_value(0.0).run()
    at.number_input(key="target_loss").set_value(seed.TARGET_LOSS).run()
    rows = _table(at, "target_table").set_index("run")
    for b in (16, 32, 64, 128):
        want = seed.S_MIN * (1 + seed.B_CRIT / b)  # first integer step at or past it
        assert rows.loc[f"b{b}", "steps"] == pytest.approx(want, abs=1)
        assert rows.loc[f"b{b}", "reached"] == "yes"
        assert rows.loc[f"b{b}", "tokens"] == (rows.loc[f"b{b}", "steps"] + 1) * b * 128
    [table] = [d for d in at.dataframe if "reached" in d.value.columns]
    tokens = json.loads(table.proto.columns)["tokens"]["type_config"]
    assert tokens["format"] == "localized"  # 733,184 as on the Runs page, not 733184
    metrics = {m.label: m.value for m in at.metric}
    b_crit = float(metrics["Critical batch B_crit"].split()[0].replace(",", ""))
    assert b_crit == pytest.approx(seed.B_CRIT, rel=0.05)
    assert "fit over 4 runs at batches 16, 32, 64, 128" in seed.texts(at)


def test_fewer_than_three_batches_says_what_is_missing(db_path, monkeypatch):
    seed.finished_run(db_path, 16)
    seed.finished_run(db_path, 32)
    at = _compare(monkeypatch, db_path)
    at.number_input(key="target_loss").set_value(seed.TARGET_LOSS).run()
    infos = [str(i.value) for i in at.info]
    assert any(
        "needs runs at >= 3 different constant batch sizes that reached loss 2.5; have 2 "
        "(16, 32)" in i
        for i in infos
    ), infos
    assert "Critical batch B_crit" not in {m.label for m in at.metric}


def test_unreached_target_and_ramped_runs_are_named(db_path, monkeypatch):
    for b in (16, 32, 64):
        seed.finished_run(db_path, b)
    live = seed.live_run(db_path, name="ramped")
    try:
        live.writer.log(400, {"batch_seqs": 32, "loss": 2.1})
        assert live.writer.flush()
        at = _compare(monkeypatch, db_path)
        at.slider(key="compare_smoothing").set_value(0.0).run()
        at.number_input(key="target_loss").set_value(2.3).run()
        rows = _table(at, "target_table").set_index("run")
        assert rows.loc["ramped", "batch (sequences)"] == "ramped 16→32"
        assert rows.loc["b16", "reached"] == "no"  # b16 reaches only ~2.32 in 600 steps
        text = "\n".join(str(i.value) for i in at.info)
        assert "not reached by: b16" in text and "batch changed during: ramped" in text
    finally:
        live.close()


def _curve(at, name):
    fig = seed.figures(at)["loss by step"]
    return next(t for t in fig["data"] if t["name"] == name)


def test_curves_in_one_session_and_a_refresh_reads_only_what_changed(db_path, monkeypatch):
    """Compare's curves of every chosen run come from one read session; after new steps of one
    run, the next load reads only that run, from its last bucket on; a resumed run, or one
    deleted and made again under its id, is read again whole."""
    done = seed.team(db_path, 3, steps=200)
    live = seed.live_run(db_path, name="live")
    try:
        calls = seed.count_connects(monkeypatch)
        at = seed.app(monkeypatch, db_path, first="views/compare.py")
        assert not at.exception, [e.message for e in at.exception]
        assert set(at.multiselect(key="compare_runs").value) == {*done, live.run_id}
        # the runs, their metric names, every curve (+ a first look at the file)
        assert len(calls) <= 4, calls
        caches = at.session_state["_rw_series"]["caches"]  # by (file, run id, metric)
        assert {(db, rid) for db, rid, _ in caches} == {
            (str(db_path), r) for r in {*done, live.run_id}
        }
        assert all(len(c.fetches) == 1 for c in caches.values())  # one fetch each, from step 0

        for s in range(400, 410):
            live.writer.log(s, {"loss": 1.5, "tokens_seen": (s + 1) * 16 * seed.SEQ_LEN})
        assert live.writer.flush()
        del calls[:]
        at.run()
        assert not at.exception, [e.message for e in at.exception]
        assert len(calls) <= 3, calls  # runs, names, curves: one session for what changed
        for (_, rid, name), c in caches.items():
            if rid == live.run_id:
                assert len(c.fetches) == 2 and c.fetches[-1][0] > 0, (name, c.fetches)
            else:
                assert len(c.fetches) == 1, (rid, name, c.fetches)
        curve = _curve(at, "live")
        assert curve["x"][-1] == 409 and len(curve["x"]) == 410

        opened = len(calls)
        at.slider(key="compare_smoothing").set_value(0.0).run()  # nothing changed: no read
        assert len(calls) == opened
    finally:
        live.close()

    w = store.RunWriter.start(db_path, run_id=done[0], resume_step=99, handle_sigterm=False)
    for s in range(100, 150):
        w.log(s, {"loss": 9.0})
    assert w.close()
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    curve = _curve(at, "r00")
    assert curve["x"][-1] == 149 and curve["y"][-1] == 9.0  # the resumed history, not the old
    assert caches[(str(db_path), done[0], "loss")].fetches[-1][0] == 0  # read again whole

    store.delete_run(db_path, done[1])  # and made again under its id, longer than before
    w = store.RunWriter.start(db_path, "r01", run_id=done[1], handle_sigterm=False)
    for s in range(250):
        w.log(s, {"loss": 7.0})
    assert w.close()
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    curve = _curve(at, "r01")
    assert curve["x"][-1] == 249 and set(curve["y"]) == {7.0}  # none of the deleted run's
