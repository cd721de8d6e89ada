"""The GPT that Rampwatch trains, its loss head (plain or chunked lm_head + cross-entropy) and the
optimizer factory.

- Pre-norm decoder (GPT-2 layout; Radford et al. 2019) with parameter-free RMSNorm and no biases
  (as nanochat), rotary (Su et al. 2021) or learned positions, causal attention through
  F.scaled_dot_product_attention, MLP 4·d with relu² (So et al. 2021, "Primer"; nanochat).
- The loss lives in the submodule `loss_head`, which owns `lm_head`: a per-module memory tracker
  (MemTracker) then attributes the logits and their gradient to `loss_head`, which is how the
  dashboard shows what a chunked head would save.
- Nothing depends on the batch size: a compiled model with a dynamic batch dimension need not
  recompile when the batch changes.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from rampwatch.trainer.config import ModelConfig


def norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without a gain (Zhang & Sennrich 2019; nanochat)."""
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0, device=None):
    """cos, sin of shape (1, seq_len, 1, head_dim/2) for RoPE (Su et al. 2021, eq. 34)."""
    inv_freq = 1.0 / base ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x (B, T, H, D) by position-dependent angles."""
    T, half = x.size(1), x.size(-1) // 2
    cos, sin = cos[:, :T].to(x.dtype), sin[:, :T].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.rotary = cfg.positions == "rotary"
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        if self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn, self.mlp, self.dropout = CausalSelfAttention(cfg), MLP(cfg), cfg.dropout

    def forward(self, x, cos, sin):
        x = x + F.dropout(self.attn(norm(x), cos, sin), self.dropout, self.training)
        return x + F.dropout(self.mlp(norm(x)), self.dropout, self.training)


class _ChunkedLinearCE(torch.autograd.Function):
    """mean_i CE(h_i · Wᵀ, t_i) without ever holding more than one chunk's logits.

    The idea of Liger-Kernel's FusedLinearCrossEntropy (Hsu et al. 2024) and of "Cut Your
    Losses in Large-Vocabulary Language Models" (Wijmans et al. 2024). Of their two ways we take
    Liger's: the gradients are computed in the forward pass, chunk by chunk, since
    dCE/dlogits = softmax − onehot is at hand there; backward only scales them by grad_output.
    It costs 3 matmuls per chunk (logits, dh, dW) instead of 4 for recomputing the logits in
    backward (Cut Your Losses), and holds dh (N, d) and an fp32 dW (V, d) until backward:
    for the 0.7B preset at batch 16 that is ~0.4 GB instead of the 4.3 GB of fp32 logits
    (plus their gradient). Backward also needs no autocast state. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, grad_h: bool, grad_w: bool):
        N, dev = h.size(0), h.device.type
        # Under autocast the matmuls run in the autocast dtype, as nn.Linear would; the softmax,
        # the loss sum and dW accumulate in fp32.
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        w = weight.to(dt)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if grad_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grad_w else None
        for s in range(0, N, chunk):
            hc, tc = h[s : s + chunk].to(dt), targets[s : s + chunk]
            logits = (hc @ w.t()).float()  # (c, V), the only big tensor
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            if grad_h or grad_w:
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                g.scatter_add_(1, tc[:, None], torch.full_like(lse[:, None], -1.0))
                g = g.div_(N).to(dt)  # d(mean CE)/dlogits
                if grad_h:
                    dh[s : s + chunk] = g @ w
                if grad_w:
                    dw += g.t() @ hc
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return loss / N

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw = ctx.saved_tensors
        return (
            None if dh is None else dh * grad_out,
            None if dw is None else (dw * grad_out).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )


@torch.compiler.disable
def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Mean CE of logits h @ weightᵀ against targets, h (N, d), weight (V, d), targets (N,).

    Kept out of torch.compile on purpose: a Python loop over N/chunk chunks would make dynamo
    specialize on N (= batch · seq) and recompile on every batch change. The graph break sits
    at the very end of the model and the work here is three large matmuls per chunk.
    """
    need = torch.is_grad_enabled()
    return _ChunkedLinearCE.apply(
        h, weight, targets, chunk, need and h.requires_grad, need and weight.requires_grad
    )


class LossHead(nn.Module):
    """lm_head and the loss: logits (B, T, V) without targets, else the mean CE (fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.chunked, self.chunk = cfg.chunked_ce, cfg.ce_chunk_tokens

    def forward(self, h, targets=None):
        if targets is None:
            return self.lm_head(h)
        if self.chunked:
            return chunked_cross_entropy(
                h.flatten(0, 1), self.lm_head.weight, targets.flatten(), self.chunk
            )
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.loss_head = LossHead(cfg)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialize parameters and rotary tables; call after `to_empty()` from meta.

        GPT-2 init (Radford et al. 2019; nanoGPT): N(0, 0.02), with the residual output
        projections scaled by 1/√(2·n_layer) so the residual stream's variance stays O(1).
        """
        for name, p in self.named_parameters():
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        if self.cfg.positions == "rotary":
            cos, sin = rotary_tables(
                self.cfg.seq_len, self.cfg.head_dim, device=self.wte.weight.device
            )
            self.rope_cos, self.rope_sin = cos, sin

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids, T ≤ seq_len → mean cross-entropy (fp32 scalar) against targets
        (B, T), or logits (B, T, V) when targets is None."""
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.loss_head(norm(x), targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def configure_optimizer(
    model: nn.Module,
    name: str = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum betas[0]) over two groups: 'decay' (matmul weights) and
    'no_decay' (embeddings and any vector). Each group keeps 'base_lr': schedules and batch
    ramps scale the base (lr = base_lr · schedule(t) · ramp factor), never the current lr."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["lr"] = lr
    if name == "adamw":
        fused = all(p.is_cuda for g in groups for p in g["params"])  # one kernel per step on GPU
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=betas[0])
    raise ValueError(f"unknown optimizer {name!r} (adamw | sgd)")
