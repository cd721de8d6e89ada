"""A validation's results reach the run: Monitor.log_validation (own loops and both
integrations), the Lightning callback's values from trainer.callback_metrics in a real fit, and
the Hugging Face Trainer's eval_loss (tests/test_integration_transformers.py runs its example).
val_loss is what the live page's loss chart draws beside the training loss."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from rampwatch import Monitor, store
from rampwatch.integrations.lightning import RampwatchCallback
from rampwatch.store import names as M
from tests.trainer_runs import metric


def test_log_validation_renames_the_loss_and_leaves_out_what_it_cannot_log(tmp_path, capfd):
    db = tmp_path / "runs.duckdb"
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor.start(
        db, name="v", config={}, model=model, optimizer=opt, per_device_batch=2, accum=1, seq_len=1
    )
    model(torch.randn(2, 4)).square().mean().backward()
    mon.after_backward()
    mon.step(1, loss=1.0)
    got = mon.log_validation(
        1, {"eval_loss": torch.tensor(0.5), "acc": 0.9, M.LOSS: 7.0, "name": "x"}, "eval_loss"
    )
    assert got == {M.VAL_LOSS: 0.5, "acc": 0.9}
    mon.finish()
    assert mon.log_validation(2, {"eval_loss": 0.4}, "eval_loss") == {}
    assert metric(db, mon.run_id, M.VAL_LOSS) == {1: 0.5}
    assert metric(db, mon.run_id, M.LOSS) == {1: 1.0}  # not replaced by the validation's
    alerts = store.events(db, mon.run_id, kinds=[M.EVENT_ALERT])
    said = sorted(a.message for a in alerts if a.message.startswith("validation"))
    assert said[0].startswith("validation metrics['loss'] would replace the monitor's own")
    assert said[1].startswith("validation metrics['name'] is not a number ('x')")
    assert "came after mon.finish()" in capfd.readouterr().err


class _Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", loss)  # a training metric: not a validation's
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        mse = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("valid/mse", mse)
        self.log("valid/mae", (self.net(x) - y).abs().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_lightning_fits_validations_are_logged_at_their_steps(tmp_path):
    """val_check_interval=10 batches at accumulation 2: validations after steps 5, 10, 15 (and
    the sanity check before the fit, which is no validation of the run)."""
    torch.manual_seed(0)
    db = tmp_path / "runs.duckdb"
    x = torch.randn(512, 8)
    y = x.sum(dim=1, keepdim=True)
    trainer = L.Trainer(
        max_steps=15,
        accumulate_grad_batches=2,
        val_check_interval=10,
        callbacks=[RampwatchCallback(db, name="val", val_loss="valid/mse")],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        _Regression(),
        DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
        DataLoader(TensorDataset(x[:64], y[:64]), batch_size=32),
    )
    [run] = store.list_runs(db)
    val = metric(db, run.run_id, M.VAL_LOSS)
    assert sorted(val) == [5, 10, 15]
    assert val[15] == pytest.approx(float(trainer.callback_metrics["valid/mse"]))
    assert val[5] > val[15]  # it learns
    assert sorted(metric(db, run.run_id, "valid/mae")) == [5, 10, 15]
    assert not metric(db, run.run_id, "train_mse")
    logged = set(store.export(db, run.run_id).column("name").to_pylist())
    assert logged - M.MONITOR_METRICS == {"valid/mae"}  # the live page's "own" metrics
    assert not store.events(db, run.run_id, kinds=[M.EVENT_ALERT])
