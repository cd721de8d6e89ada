"""The trainer's ramp flags are named by the policy's fields; old spellings still parse (hidden),
and the policy's defaults are the only defaults of its knobs."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

from rampwatch.advisor import cli as plan_cli
from rampwatch.advisor import memory, tiers
from rampwatch.advisor.policy import (
    LEGACY_HYSTERESIS,
    LEGACY_MIN_ESTIMATES,
    RampPolicy,
    default,
)
from rampwatch.store import RunWriter, reader
from rampwatch.trainer import cli as train_cli
from rampwatch.trainer.config import POLICY_FLAGS
from tests.trainer_runs import run_trainer


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rampwatch train")
    train_cli.add_arguments(p)
    return p


def _train_args(*flags: str) -> argparse.Namespace:
    return train_cli.resolve_defaults(_train_parser().parse_args(list(flags)))


def test_each_ramp_flag_is_a_policy_field():
    assert set(POLICY_FLAGS) <= {f.name for f in fields(RampPolicy)}
    args = _train_args(
        *("--ramp-at", "2", "--hysteresis-steps", "7", "--min-estimates", "3"),
        *("--ramp-gate", "trial", "--trial-interval-tokens", "4096"),
    )
    got = {k: getattr(args, k) for k in POLICY_FLAGS}
    assert got == {
        "ramp_at": 2.0,
        "hysteresis_steps": 7,
        "min_estimates": 3,
        "gate": "trial",
        "trial_interval_tokens": 4096,
    }
    unset = _train_args()
    assert all(getattr(unset, k) is None for k in POLICY_FLAGS)  # the policy's own


def test_old_flag_spellings_still_parse_but_are_not_offered():
    old = _train_args("--ramp-hysteresis", "7", "--ramp-min-samples", "3")
    assert (old.hysteresis_steps, old.min_estimates) == (7, 3)
    shown = _train_parser().format_help()
    assert "--hysteresis-steps" in shown and "--min-estimates" in shown
    assert "--ramp-hysteresis" not in shown and "--ramp-min-samples" not in shown


def test_the_policys_defaults_are_the_only_ones():
    assert default("margin") == 0.05 and default("offered_factors") == (2, 4, 8)
    assert inspect.signature(memory.usable_bytes).parameters["margin"].default == default("margin")
    signature = inspect.signature(tiers.candidate_tiers).parameters
    assert signature["margin"].default == default("margin")
    assert signature["factors"].default == default("offered_factors")
    plan = argparse.ArgumentParser()
    plan_cli.add_arguments(plan)
    assert plan.get_default("margin") == default("margin")
    assert plan.get_default("factors") == default("offered_factors")


def test_the_trainer_records_the_flags_in_its_policy(tmp_path):
    db, flags = tmp_path / "runs.duckdb", ("--hysteresis-steps", "7", "--min-estimates", "3")
    flags += ("--ramp", "auto", "--ramp-gate", "trial")
    r = run_trainer(db, tmp_path / "ck", "--run-id", "new", "--steps", "2", *flags)
    assert r.returncode == 0, r.stdout[-2000:]
    policy = RampPolicy.from_config(reader.get_run(db, "new").config)
    assert (policy.hysteresis_steps, policy.min_estimates, policy.ramp_at) == (7, 3, 1.0)
    assert (policy.gate, policy.trial_interval_tokens) == ("trial", None)


def test_a_run_recorded_with_the_old_config_keys_loads_its_policy(tmp_path):
    db = tmp_path / "runs.duckdb"
    old = {"optimizer": "adamw", "lr": 3e-3, "per_device_batch": 8, "accum": 2}
    old.update({LEGACY_HYSTERESIS: 50, LEGACY_MIN_ESTIMATES: 0})  # as runs before the policy
    with RunWriter.start(db, "old", run_id="old", config=old, handle_sigterm=False):
        pass
    policy = RampPolicy.from_config(reader.get_run(db, "old").config)
    assert (policy.hysteresis_steps, policy.min_estimates) == (50, 0)
    assert (policy.original_batch, policy.original_lr, policy.lr_rule) == (16, 3e-3, "sqrt")
