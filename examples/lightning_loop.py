"""Rampwatch in a Lightning 2.x Trainer: one callback (rampwatch/integrations/lightning.py), the
README's Lightning snippet, runnable (tests/test_integration_lightning.py runs it as written).

    python examples/lightning_loop.py runs.duckdb [auto]
"""

import sys

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from rampwatch.integrations.lightning import RampwatchCallback


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)  # Lightning divides it by accum

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))  # on the loss chart

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(L.LightningDataModule):
    def __init__(self, batch_size=16):
        super().__init__()
        self.batch_size = batch_size  # a per-device batch ramp sets it at an epoch end
        self.x = torch.randn(4096, 32)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.5 * torch.randn(4096, 1)

    def train_dataloader(self):  # asked again each epoch: reload_dataloaders_every_n_epochs=1
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:256], self.y[:256]), batch_size=64)


torch.manual_seed(0)
# --- the integration ----------------------------------------------------------------------
rampwatch = RampwatchCallback(
    sys.argv[1], name="lightning", seq_len=1, ramp=sys.argv[2] if len(sys.argv) > 2 else "manual"
)
trainer = L.Trainer(
    max_steps=60,
    accumulate_grad_batches=4,
    gradient_clip_val=1.0,
    val_check_interval=80,  # batches: every 20 optimizer steps
    reload_dataloaders_every_n_epochs=1,
    callbacks=[rampwatch],
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Regression(), datamodule=Data())
