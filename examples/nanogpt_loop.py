"""Rampwatch in a nanoGPT-style loop, one that computes its own LR: get_lr() writes every param
group's lr at each iteration and there is no torch scheduler, so a ramp moves that schedule by
`mon.lr_scale` (ramp.scale_lr() would be overwritten at the next iteration). float16 runs a
GradScaler, whose scale `mon.step(grad_scale=...)` undoes; evaluation runs inside `mon.untimed()`.
The README's snippet for such loops, runnable (tests/test_nanogpt_loop.py checks the README
matches, approves a ramp into it from another process, and runs it with the multiplier ignored).

    python examples/nanogpt_loop.py runs.duckdb [auto] [float16]

A tiny model stands in for nanoGPT's GPT and a token stream from a fixed random successor table
for its data (nothing is downloaded); the loop around them is nanoGPT's train.py.
"""

import math
import sys
from contextlib import nullcontext

import torch

from rampwatch import Monitor

db, *opts = sys.argv[1:]
mode = "auto" if "auto" in opts else "manual"
dtype = "float16" if "float16" in opts else "float32"  # nanoGPT: bfloat16 or float16 on CUDA
device = "cuda" if torch.cuda.is_available() else "cpu"
batch_size, block_size, gradient_accumulation_steps = 8, 16, 2
max_iters, eval_interval, eval_iters, grad_clip = 60, 20, 4, 1.0
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-2, 1e-3, 10, 60
vocab_size, n_embd = 64, 64

torch.manual_seed(0)
successors = torch.randint(vocab_size, (vocab_size, 4)).tolist()  # each token: 4 likely next
choices, stream = torch.randint(4, (20_000,)).tolist(), [0]
for c in choices[1:]:
    stream.append(successors[stream[-1]][c])
data = torch.tensor(stream)
train_data, val_data = data[:18_000], data[18_000:]


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - block_size - 1, (batch_size,))
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class TinyLM(torch.nn.Module):
    """Stands in for nanoGPT's GPT: model(X, Y) -> (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, n_embd)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(n_embd, 4 * n_embd),
            torch.nn.GELU(),
            torch.nn.Linear(4 * n_embd, n_embd),
        )
        self.lm_head = torch.nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        x = self.wte(idx)
        logits = self.lm_head(x + self.mlp(x))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


model = TinyLM().to(device)
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(  # nanoGPT's two groups: weight decay on matrices only
    [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ],
    lr=learning_rate,
    betas=(0.9, 0.99),
)
ptdtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device, dtype=ptdtype)
scaler = torch.amp.GradScaler(device, enabled=(dtype == "float16"))


def get_lr(it):
    """nanoGPT's: linear warmup, cosine decay to min_lr, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


# the README shows the part below as it is, aligned comments and all: the formatter leaves it
# fmt: off
# --- the integration ----------------------------------------------------------------------
mon = Monitor.start(db, name="nanogpt-loop", config={"learning_rate": learning_rate},
                    model=model, optimizer=optimizer, per_device_batch=batch_size,
                    accum=gradient_accumulation_steps, seq_len=block_size, ramp=mode)
for it in range(max_iters):
    lr = get_lr(it) * mon.lr_scale            # your schedule, times the ramps' LR change
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if it % eval_interval == 0:
        with mon.untimed():                   # evaluation is not step time
            losses = estimate_loss()
        mon.log(it, {"val_loss": losses["val"]})
    total = torch.zeros((), device=device)
    for _ in range(gradient_accumulation_steps):
        X, Y = get_batch("train")             # batch_size: the ramp's from the next step
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
        mon.after_backward()                  # noise-scale partial sums (of scaled grads)
        total += loss.detach()
    mon.step(it + 1, loss=total, grad_scale=scaler.get_scale())  # the loss scale undone
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if (ramp := mon.ramp_due()) is not None:  # approved on the dashboard (or ramp="auto")
        batch_size, gradient_accumulation_steps = ramp.per_device_batch, ramp.accum
        mon.ramp_applied(ramp)                # get_lr(it) * mon.lr_scale from the next step
mon.finish()
