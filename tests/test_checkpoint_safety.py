"""Checkpoints that cannot hurt or strand a run: a file planted at the resume path runs no code
(every load is weights_only), what the trainer saves loads that way, a save on a full disk
says so in one line and leaves no partial file, the last good checkpoint still resumes, and a
partial file whose writer died is removed when the run next starts."""

from __future__ import annotations

import resource
import signal
import subprocess

import pytest
import torch

from rampwatch.store import names as M
from rampwatch.store import reader
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.model import GPT, configure_optimizer
from tests.procs import spawn
from tests.trainer_runs import run_trainer

pytestmark = pytest.mark.timeout(600)


class _Plant:
    """Unpickled, it opens (creates) the marker file: code run by loading a checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": _Plant(str(marker)), "model": {}, "optimizer": {}, "config": {}}, path)


def test_the_planted_payload_is_live(tmp_path):
    """The test's own check: an unsafe load of the planted file does run its code."""
    marker = tmp_path / "ran"
    _plant(tmp_path / "p.pt", marker)
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert marker.exists()


def test_load_and_retier_refuse_a_planted_checkpoint(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "ck" / "r.pt"
    _plant(path, marker)
    with pytest.raises(ckpt.CheckpointError, match=str(path)):
        ckpt.load(path)
    with pytest.raises(ckpt.CheckpointError, match=str(path)):
        ckpt.retier(path, 2, 4, 4)
    assert not marker.exists()


def test_resume_from_a_planted_checkpoint_exits_2_and_runs_nothing(tmp_path):
    marker, ck = tmp_path / "ran", tmp_path / "ck"
    _plant(ck / "r.pt", marker)
    done = run_trainer(tmp_path / "db.duckdb", ck, "--resume", "r", "--steps", "2", "--no-plan")
    assert done.returncode == 2, done.stdout
    assert "Traceback" not in done.stdout
    (line,) = done.stdout.strip().splitlines()
    assert str(ck / "r.pt") in line and "refus" in line, line
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"not a checkpoint", b"PK\x03\x04 half a zip"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "r.pt"
    path.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint") as raised:
        ckpt.load(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_what_the_trainer_saves_loads_weights_only(tmp_path, optimizer):
    """The optimizer's state after a step, the noise window, the config and a note: plain data
    and tensors, so weights_only loads all of it back equal."""
    torch.manual_seed(0)
    model = GPT(PRESETS["test-tiny"])
    opt = configure_optimizer(model, optimizer, 1e-3, 0.1, (0.9, 0.95))
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len))
    model(x, x).backward()
    opt.step()
    state = ckpt.TrainState(run_id="r", step=1, noise_window={"g2": [1.0], "trace": [2.5]})
    note = {"kind": M.EVENT_OOM, "message": "m", "data": {"before": {"per_device_batch": 4}}}
    path = tmp_path / "r.pt"
    ckpt.save(path, state=state, model=model, optimizer=opt, config={"betas": [0.9]}, note=note)
    blob = ckpt.load(path)
    assert blob["state"] == state and blob["note"] == note and blob["config"] == {"betas": [0.9]}
    restored = configure_optimizer(model, optimizer, 1e-3, 0.1, (0.9, 0.95))
    restored.load_state_dict(blob["optimizer"])
    assert str(restored.state_dict()) == str(opt.state_dict())


# -- a full disk ------------------------------------------------------------------------------

DISK = 8 << 20  # one test-tiny AdamW checkpoint (about 5.5 MB) fits, a second beside it not
COMMON = ("--no-plan", "--checkpoint-every", "2")


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of DISK bytes (mounting needs root); its remount(size) gives it room."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip() or mount.returncode}")

    def remount(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)

    try:
        yield disk, remount
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _tmp_files(directory):
    return sorted(p.name for p in directory.glob(".*.tmp"))


def _assert_failed_save(done, path, reason: str, run_id: str, db) -> None:
    """The run ended failed with one line naming the checkpoint, the reason and the size."""
    assert done.returncode not in (0, 2) and "Traceback" not in done.stdout, done.stdout
    lines = [x for x in done.stdout.splitlines() if "cannot save checkpoint" in x]
    assert lines and str(path) in lines[-1] and reason in lines[-1], done.stdout
    assert "needs about" in lines[-1] and "MiB" in lines[-1], lines[-1]
    assert reader.get_run(db, run_id).stored_status == "failed"
    assert _tmp_files(path.parent) == []
    assert torch.load(path, weights_only=True)["state"]["step"] == 2  # the last good one


def test_a_full_disk_alerts_then_fails_the_final_save_and_the_last_checkpoint_resumes(
    tmp_path, small_disk
):
    disk, remount = small_disk
    db, path = tmp_path / "db.duckdb", disk / "full.pt"
    done = run_trainer(db, disk, "--run-id", "full", "--steps", "5", *COMMON)
    _assert_failed_save(done, path, "No space left on device", "full", db)
    # the periodic save at step 4 was an alert, and the run went on to step 5
    alerts = [e for e in reader.events(db, "full", kinds=[M.EVENT_ALERT]) if e.step == 4]
    assert len(alerts) == 1 and "No space left on device" in alerts[0].message, alerts
    assert reader.get_run(db, "full").last_step == 5
    remount(64 << 20)  # room again: the run resumes from its step-2 checkpoint
    again = run_trainer(db, disk, "--resume", "full", "--steps", "4", *COMMON)
    assert again.returncode == 0, again.stdout
    assert ckpt.load(path)["state"].step == 4 and _tmp_files(disk) == []


def _file_size_limit(limit: int):
    def preexec() -> None:  # in the child: write() past the limit fails with EFBIG, no signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return preexec


def test_a_file_size_limit_fails_the_save_and_the_last_checkpoint_resumes(tmp_path):
    """The same without root: RLIMIT_FSIZE in the child, so a checkpoint cannot grow past a
    limit the database stays under."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY or not hasattr(signal, "SIGXFSZ"):
        pytest.skip("RLIMIT_FSIZE cannot be set and lifted here")
    db, ck = tmp_path / "db.duckdb", tmp_path / "ck"
    path = ck / "lim.pt"
    first = run_trainer(db, ck, "--run-id", "lim", "--steps", "2", *COMMON)
    assert first.returncode == 0, first.stdout
    limit = path.stat().st_size - (1 << 20)
    if limit < db.stat().st_size + (1 << 20):
        pytest.skip("the checkpoint is not enough larger than the database for a limit between")
    done = run_trainer(
        db, ck, "--resume", "lim", "--steps", "4", *COMMON, preexec_fn=_file_size_limit(limit)
    )
    _assert_failed_save(done, path, "File too large", "lim", db)
    again = run_trainer(db, ck, "--resume", "lim", "--steps", "4", *COMMON)
    assert again.returncode == 0, again.stdout
    assert ckpt.load(path)["state"].step == 4


# -- partial files left by a dead writer ------------------------------------------------------


def test_start_removes_partial_checkpoints_of_dead_writers_only(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    dead = spawn(["-c", "pass"])
    dead.wait(timeout=60)
    live = spawn(["-c", "import time; time.sleep(600)"])
    try:
        stale, saving = ck / f".r.pt.{dead.pid}.tmp", ck / f".r.pt.{live.pid}.tmp"
        other_run = ck / f".other.pt.{dead.pid}.tmp"
        for p in (stale, saving, other_run):
            p.write_bytes(b"partial")
        done = run_trainer(tmp_path / "db.duckdb", ck, "--run-id", "r", "--steps", "1", "--no-plan")
        assert done.returncode == 0, done.stdout
        assert not stale.exists() and saving.exists() and other_run.exists()
        assert str(stale) in done.stdout
    finally:
        live.kill()
        live.wait(timeout=60)
