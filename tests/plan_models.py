"""Models that are not the GPT, for tests/test_memplan_any_model.py: each `setup_*` is what a user
writes for monitor/memplan.py's plan and probe, setup(per_device_batch) -> (model, optimizer,
batch, train_step), and is imported by reference in the planner's and the probe's children."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IN, HIDDEN, DEPTH, CLASSES = 256, 256, 4, 10


def mlp() -> torch.nn.Module:
    """Narrow and deep enough that activations, not the optimizer, make the peak at a few hundred
    samples: the plan's slope is then a real figure to compare with a measurement."""
    layers = []
    for i in range(DEPTH):
        layers += [torch.nn.Linear(IN if i == 0 else HIDDEN, HIDDEN), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, CLASSES))


def train_step(model, opt, batch):
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)  # the planner defers it to between its iterations


def setup_mlp(per_device_batch: int):
    """The five lines a user writes: model, optimizer, one batch, the step."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(per_device_batch, IN), torch.randint(0, CLASSES, (per_device_batch,)))
    return model, opt, batch, train_step


class Gated(torch.nn.Module):
    """Skips its second layer when the first one's output is small: `if` on a tensor's value,
    which fake tensors (no values) cannot decide."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = self.a(x).relu()
        if h.mean().item() > 1e-6:
            h = h * 2
        return self.b(h)


def _setup(model: torch.nn.Module, per_device_batch: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(per_device_batch, IN), torch.randint(0, CLASSES, (per_device_batch,)))
    return model, opt, batch, train_step


def setup_gated(per_device_batch: int):
    return _setup(Gated(), per_device_batch)


class Routed(torch.nn.Module):
    """Sends only the rows with a positive first feature through its layer (torch.nonzero: a
    shape that depends on the data)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(IN, CLASSES)

    def forward(self, x):
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return self.lin(x.index_select(0, rows)).sum(0, keepdim=True).expand(x.shape[0], -1)


def setup_routed(per_device_batch: int):
    return _setup(Routed(), per_device_batch)


class Blowup(torch.nn.Module):
    """Stands for a model too big for the device from batch 8 on: its forward asks for
    per_device_batch · 2^45 bytes (a petabyte at 8), which no allocator gives."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(IN, CLASSES)

    def forward(self, x):
        if x.shape[0] >= 8:
            x.new_empty(x.shape[0] << 43)  # float32: 4 bytes each
        return self.lin(x)


def setup_blowup(per_device_batch: int):
    return _setup(Blowup(), per_device_batch)
