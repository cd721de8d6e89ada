"""Model configuration: the GPT's shape (ModelConfig), named presets, each preset's run defaults,
and the parameter counts the FLOPs/MFU arithmetic needs. Run-time flags (argparse) belong to the
loop, not here.

Parameter count of the GPT in trainer/model.py (no biases, parameter-free RMSNorm, untied
embeddings), with V vocab, d d_model, L layers, T seq_len:
    embedding  = V·d (+ T·d for learned positions)
    matmul     = 12·L·d² (attention qkv 3d², proj d²; MLP 4d² up, 4d² down) + V·d (lm_head)
N_matmul is the N of the "6N FLOPs per token" estimate (Kaplan et al. 2020, §2.1; PaLM App. B):
every weight that multiplies an activation, i.e. everything but the embedding lookups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ModelConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    positions: str = "rotary"  # 'rotary' (RoPE, Su et al. 2021) | 'learned' (GPT-2)
    tokenizer: str = "bytes"  # 'bytes' (vocab 256) | 'bpe' (byte-level BPE of vocab_size)
    chunked_ce: bool = False  # lm_head + cross-entropy by token chunks, no full logits
    ce_chunk_tokens: int = 4096  # tokens per chunk when chunked_ce
    dropout: float = 0.0  # residual + attention dropout; 0 for pretraining
    # Embeddings are never tied to lm_head (nanochat unties them; the planner then counts
    # two V·d tables, which is what a 0.7B run really holds).

    def __post_init__(self):
        assert self.positions in ("rotary", "learned"), self.positions
        assert self.tokenizer in ("bytes", "bpe"), self.tokenizer
        assert self.tokenizer != "bytes" or self.vocab_size == 256, "bytes tokenizer: vocab 256"
        assert self.d_model % self.n_head == 0, "d_model must divide into heads"
        assert self.positions != "rotary" or self.head_dim % 2 == 0, "rotary needs even head_dim"
        assert self.ce_chunk_tokens > 0 and 0.0 <= self.dropout < 1.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunDefaults:
    """What a run of a preset uses unless told otherwise (the loop's argparse defaults)."""

    per_device_batch: int  # sequences per micro-batch
    accum: int  # micro-batches per optimizer step
    lr: float  # base (peak) learning rate at per_device_batch·accum·world 1
    warmup_tokens: int
    total_tokens: int
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)


# The cap of a trial's default Δ (the Δ itself comes from the run's loss curve at the trial,
# advisor/trial_delta.py, and is this where the curve tells nothing): whole steps of the card's
# largest first test (×4), as many as keep its two discarded arms (×2, ×4) within
# TRIAL_BUDGET_SHARE of the run's tokens, at least one and at most TRIAL_MAX_STEPS of them (a
# longer Δ tells more, but the run waits for it).
TRIAL_BUDGET_SHARE, TRIAL_MAX_STEPS, TRIAL_UNIT_FACTOR = 0.02, 16, 4
# A trial's second stage, or a trial after one that could not tell, takes the held-out batch
# that would tell, at most this many times --trial-eval-batch (2,048 at the default 256: where
# trials on bench-tiny told, README); a pass over the batch runs about seven times a trial.
TRIAL_EVAL_GROWTH = 8


def default_trial_delta_tokens(batch: int, seq_len: int, total_tokens: int) -> int:
    """Δ tokens per arm for a run at `batch` sequences of seq_len: n steps of ×4, with the
    2·Δ of a ×2, ×4 trial ≤ 2% of total_tokens (n at least 1, at most 16)."""
    unit = TRIAL_UNIT_FACTOR * batch * seq_len
    n = int(TRIAL_BUDGET_SHARE * total_tokens / (2 * unit))
    return unit * min(TRIAL_MAX_STEPS, max(1, n))


# Run options that set a RampPolicy knob, each named by its field (--ramp-at sets ramp_at). The
# loop hands those given to the policy; unset, the policy's own default holds.
POLICY_FLAGS = ("ramp_at", "hysteresis_steps", "min_estimates", "gate", "trial_interval_tokens")


PRESETS: dict[str, ModelConfig] = {
    # What tests use: ~0.46M parameters, tens of ms per step on one CPU thread.
    "test-tiny": ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, seq_len=128),
    # The ramp bench's model: ~0.1M parameters, 64-byte sequences, a few ms per sequence on one
    # CPU thread, so constant-batch sweeps to a deep loss fit in minutes.
    "bench-tiny": ModelConfig(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=64),
    # The demo: bytes, ~1.9M parameters, loss falls visibly within minutes on 2 cores.
    "cpu-tiny": ModelConfig(vocab_size=256, n_layer=4, n_head=4, d_model=192, seq_len=256),
    # GPT-3 Small / GPT-2 124M shape with a 32k BPE and untied embeddings: ~136M.
    "gpu-small": ModelConfig(
        vocab_size=32768, n_layer=12, n_head=12, d_model=768, seq_len=1024, tokenizer="bpe"
    ),
    # The design's reference run on one H200: ~0.67B.
    "gpu-0.7b": ModelConfig(
        vocab_size=32768, n_layer=20, n_head=12, d_model=1536, seq_len=2048, tokenizer="bpe"
    ),
}

# GPU learning rates and warmup follow GPT-3 (Brown et al. 2020, Table 2.1: 125M → 6e-4,
# 760M → 2.5e-4 at 0.5M tokens per step; 375M warmup tokens); totals follow Chinchilla's
# ~20 tokens per parameter (Hoffmann et al. 2022). Both GPU presets start at 0.5M tokens per
# step, the first tier of a 0.5M → 1M → 2M → 4M ramp.
PRESET_RUN_DEFAULTS: dict[str, RunDefaults] = {
    "test-tiny": RunDefaults(
        per_device_batch=8, accum=2, lr=3e-3, warmup_tokens=10 * 2048, total_tokens=200 * 2048
    ),
    "bench-tiny": RunDefaults(
        per_device_batch=8, accum=2, lr=3e-3, warmup_tokens=10 * 1024, total_tokens=10**12
    ),
    "cpu-tiny": RunDefaults(
        per_device_batch=8, accum=4, lr=2e-3, warmup_tokens=20 * 8192, total_tokens=2000 * 8192
    ),
    "gpu-small": RunDefaults(
        per_device_batch=32,
        accum=16,
        lr=6e-4,
        warmup_tokens=375_000_000,
        total_tokens=2_700_000_000,
    ),
    "gpu-0.7b": RunDefaults(
        per_device_batch=16,
        accum=16,
        lr=2.5e-4,
        warmup_tokens=375_000_000,
        total_tokens=13_300_000_000,
    ),
}


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """{'total', 'matmul', 'embedding'} for the GPT of trainer/model.py, in closed form."""
    d, V = cfg.d_model, cfg.vocab_size
    embedding = V * d + (cfg.seq_len * d if cfg.positions == "learned" else 0)
    matmul = 12 * cfg.n_layer * d * d + V * d
    return {"total": embedding + matmul, "matmul": matmul, "embedding": embedding}


def matmul_params(cfg: ModelConfig) -> int:
    """N_matmul: parameters that take part in matmuls (all but embedding tables), for 6N FLOPs."""
    return count_params(cfg)["matmul"]
