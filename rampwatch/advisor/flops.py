"""Training FLOPs per token, device peak FLOPs, and model FLOPs utilization (MFU).

Owns: `flops_per_token` (the parameter count comes from the model's owner), the `PEAK_FLOPS`
table with `peak_flops(device_name)`, `mfu`, and `mfu_at` (another throughput's MFU from a
measured one: what a predicted tier's MFU is).

FLOPs convention (PaLM, Chowdhery et al. 2022, App. B; the same as nanoGPT's estimate_mfu):
    training FLOPs per token = 6·N + 12·n_layer·d_model·seq_len
6·N: a forward multiply-add (2 FLOPs) per matmul parameter per token, the backward twice that
(Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1 and Table 1: C ≈ 6N).
12·L·d·T: attention scores QKᵀ and the weighted sum A·V, 2·T·d FLOPs each per token per layer
forward, ×3 for forward + backward, counting the FULL T×T score matrix (PaLM's convention, which
ignores causal masking). With attention='causal' the term is halved to 6·L·d·T, as in Kaplan et
al.'s Table 1 (2·n_layer·n_ctx·d_attn forward), i.e. counting only the unmasked half that a causal
(flash) kernel computes. N counts matmul weights only: every Linear in the blocks plus the lm_head;
not the token/position embedding lookups, norms or biases (MFU counts model FLOPs, so
rematerialization is not counted either).
"""

from __future__ import annotations

import math

__all__ = ["flops_per_token", "PEAK_FLOPS", "peak_flops", "mfu", "mfu_at"]


def _pos(name: str, value, allow_zero: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}"
        )
    return v


def flops_per_token(
    n_params_matmul: float, n_layer: int, d_model: int, seq_len: int, attention: str = "full"
) -> float:
    """Training (forward + backward) FLOPs per token: 6·N + 12·L·d·T (PaLM App. B).

    attention='full' (default) is PaLM's convention (non-causal count); 'causal' halves the
    attention term (6·L·d·T). Use the same convention when comparing MFU across runs.
    """
    n = _pos("n_params_matmul", n_params_matmul)
    layers = _pos("n_layer", n_layer)
    d = _pos("d_model", d_model)
    t = _pos("seq_len", seq_len)
    if attention == "full":
        attn = 12.0
    elif attention == "causal":
        attn = 6.0
    else:
        raise ValueError(
            f"attention must be 'full' (PaLM convention) or 'causal', got {attention!r}"
        )
    return 6.0 * n + attn * layers * d * t


# Dense (no 2:4 sparsity) BF16 tensor-core peak per device, FLOP/s, from vendor datasheets; the
# datasheets quote "with sparsity" figures that are twice these. Matched as case-insensitive
# substrings of the device name (torch.cuda.get_device_name()), first match wins, so more specific
# names come first. Each entry: (substring, FLOP/s, source).
PEAK_FLOPS: tuple[tuple[str, float, str], ...] = (
    ("GB200", 2.5e15, "NVIDIA GB200 NVL72 datasheet: 5 PFLOPS FP16/BF16 sparse per GPU"),
    ("B200", 2.25e15, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS FP16/BF16 sparse per GPU"),
    ("H100 PCIE", 756e12, "NVIDIA H100 datasheet, PCIe: 1,513 TFLOPS BF16 sparse"),
    ("H100 NVL", 835e12, "NVIDIA H100 NVL datasheet: 1,671 TFLOPS BF16 sparse"),
    ("H100", 989e12, "NVIDIA H100 datasheet, SXM: 1,979 TFLOPS BF16 sparse"),
    ("H200", 989e12, "NVIDIA H200 datasheet, SXM: 1,979 TFLOPS BF16 sparse (GH200 likewise)"),
    ("H800", 989e12, "NVIDIA H800 SXM: same tensor cores as H100 SXM"),
    ("A100", 312e12, "NVIDIA A100 datasheet: 312 TFLOPS BF16 dense (SXM and PCIe)"),
    ("A800", 312e12, "NVIDIA A800: same tensor cores as A100"),
    ("L40S", 362e12, "NVIDIA L40S datasheet: 362.05 TFLOPS BF16 dense (733 sparse)"),
    ("L40", 181e12, "NVIDIA L40 datasheet: 181.05 TFLOPS BF16 dense (362 sparse)"),
    ("L4", 121e12, "NVIDIA L4 datasheet: 242 TFLOPS BF16 sparse"),
    (
        "RTX 4090",
        165e12,
        "NVIDIA Ada whitepaper, RTX 4090: 165.2 TFLOPS FP16/BF16 dense, FP32 accumulate",
    ),
    ("V100", 125e12, "NVIDIA V100 datasheet, SXM2: 125 TFLOPS FP16 tensor (no BF16)"),
    ("MI300X", 1307.4e12, "AMD Instinct MI300X datasheet: 1,307.4 TFLOPS BF16 dense"),
    ("MI250X", 383e12, "AMD Instinct MI250X datasheet: 383 TFLOPS BF16"),
)


def peak_flops(device_name: str | None) -> float | None:
    """Dense BF16 peak FLOP/s for a device name, or None when the device is not in the table."""
    if not device_name:
        return None
    name = str(device_name).upper()
    for key, value, _ in PEAK_FLOPS:
        if key in name:
            return value
    return None


def mfu(
    tokens_per_second: float,
    flops_per_token: float,
    peak_flops_per_device: float,
    world_size: int = 1,
) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the peak of all devices (PaLM App. B).

    tokens_per_second is the whole job's throughput (all ranks together).
    """
    tps = _pos("tokens_per_second", tokens_per_second, allow_zero=True)
    fpt = _pos("flops_per_token", flops_per_token)
    peak = _pos(
        "peak_flops_per_device (look it up with peak_flops(); None means unknown device)",
        peak_flops_per_device,
    )
    world = int(world_size)
    if world <= 0 or world != world_size:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return tps * fpt / (peak * world)


def mfu_at(tokens_per_second: float, like_mfu: float, like_tokens_per_second: float) -> float:
    """The MFU at another throughput of the same model, sequence length, devices and world size.

    MFU = tokens/s × FLOPs per token / (peak × world) is linear in tokens/s, and FLOPs per token
    (6·N + 12·L·d·T) does not depend on the batch, so like_mfu / like_tokens_per_second, measured
    at any tier, is the run's FLOPs per token over its peak: no parameter count or device table
    needed."""
    tps = _pos("tokens_per_second", tokens_per_second, allow_zero=True)
    return tps * _pos("like_mfu", like_mfu) / _pos("like_tokens_per_second", like_tokens_per_second)
