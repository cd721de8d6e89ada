"""advisor.flops: FLOPs per token (PaLM convention), the peak table, MFU, against hand arithmetic."""

from __future__ import annotations

import pytest

from rampwatch.advisor.flops import PEAK_FLOPS, flops_per_token, mfu, peak_flops


def test_flops_per_token_hand_computed():
    # 6·1e9 + 12·24·2048·2048 = 6e9 + 1,207,959,552
    assert flops_per_token(1e9, 24, 2048, 2048) == 7_207_959_552
    # causal convention halves the attention term: 6e9 + 603,979,776
    assert flops_per_token(1e9, 24, 2048, 2048, attention="causal") == 6_603_979_776
    with pytest.raises(ValueError, match="attention must be"):
        flops_per_token(1e9, 24, 2048, 2048, attention="sparse")
    with pytest.raises(ValueError, match="n_params_matmul must be a positive"):
        flops_per_token(0, 24, 2048, 2048)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("Tesla V100-SXM2-32GB", 125e12),
        ("AMD Instinct MI300X", 1307.4e12),
        ("NVIDIA B200", 2.25e15),
        ("cpu", None),
        ("", None),
        (None, None),
    ],
)
def test_peak_flops_by_device_name(name, peak):
    assert peak_flops(name) == peak


def test_peak_table_entries_cite_a_source():
    for key, value, source in PEAK_FLOPS:
        assert key == key.upper() and value > 1e12
        assert any(w in source for w in ("datasheet", "whitepaper", "same tensor cores")), key


def test_mfu_hand_computed():
    # 100k tokens/s × 7.2e9 FLOPs/token = 7.2e14 FLOP/s on one 989 TFLOP/s device
    assert mfu(100_000, 7.2e9, 989e12) == pytest.approx(7.2e14 / 989e12)
    # the same throughput spread over 8 devices: an eighth of it
    assert mfu(100_000, 7.2e9, 989e12, world_size=8) == pytest.approx(7.2e14 / 989e12 / 8)
    assert mfu(0, 7.2e9, 989e12) == 0.0
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1, 1, 0)
    with pytest.raises(ValueError, match="world_size"):
        mfu(1, 1, 1, world_size=0)
