"""Compare page (AppTest on seeded databases): overlays by run on each axis, the config diff,
steps/tokens/time to a target loss, and the critical-batch fit (or what it still lacks)."""

from __future__ import annotations

import json

import pytest

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
