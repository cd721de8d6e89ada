"""Rampwatch in your own training loop: the README's snippet, runnable (tests/test_install.py runs it
from a wheel installed into a fresh environment; tests/test_trainer.py checks the README matches).

    python examples/own_loop.py runs.duckdb
"""
import sys

import torch

from rampwatch import Monitor

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
batch, accum, steps = 16, 4, 30
data = torch.randn(batch * accum * steps, 32)
target = data.sum(dim=1, keepdim=True)

# --- the integration: five calls ---------------------------------------------------------
mon = Monitor.start(sys.argv[1], name="own-loop", config={"lr": 1e-2}, model=model,
                    optimizer=opt, per_device_batch=batch, accum=accum, seq_len=1)
for step in range(1, steps + 1):
    total = torch.zeros(())
    for j in range(accum):
        i = ((step - 1) * accum + j) * batch
        loss = torch.nn.functional.mse_loss(model(data[i:i + batch]), target[i:i + batch])
        (loss / accum).backward()
        mon.after_backward()                  # noise-scale partial sums, no device sync
        total += loss.detach() / accum        # stays on the device
    mon.step(step, loss=total)                # before clipping: grad norm, noise scale, memory
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
mon.finish()
