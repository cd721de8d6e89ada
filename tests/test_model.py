"""trainer/model.py and trainer/config.py: chunked cross-entropy equals the plain one (loss and
every gradient), presets' parameter counts, both position schemes learn, optimizer groups,
torch.compile without recompiles on batch changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rampwatch.trainer.config import (
    PRESET_RUN_DEFAULTS,
    PRESETS,
    ModelConfig,
    count_params,
    matmul_params,
)
from rampwatch.trainer.model import GPT, configure_optimizer

torch.set_num_threads(1)
TINY = PRESETS["test-tiny"]


def _grads(model, idx, targets, scale=1.0):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    (loss * scale).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("positions", ["rotary", "learned"])
@pytest.mark.parametrize("chunk", [16, 7, 4096])  # ragged last chunk (74 = 4·16 + 10), one chunk
def test_chunked_ce_matches_plain(positions, chunk):
    cfg = dataclasses.replace(TINY, positions=positions, ce_chunk_tokens=chunk)
    torch.manual_seed(0)
    plain = GPT(cfg)
    chunked = GPT(dataclasses.replace(cfg, chunked_ce=True))
    chunked.load_state_dict(plain.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 37))
    targets = torch.randint(0, cfg.vocab_size, (2, 37))
    # a non-unit upstream gradient, as accumulation's loss / accum gives
    loss_p, grads_p = _grads(plain, idx, targets, scale=0.37)
    loss_c, grads_c = _grads(chunked, idx, targets, scale=0.37)
    assert loss_c.dtype == torch.float32
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_c[name], grads_p[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: loss only, no gradient work
        torch.testing.assert_close(chunked(idx, targets), loss_p, rtol=1e-5, atol=1e-6)


def test_chunked_ce_under_bf16_autocast_close_to_plain():
    torch.manual_seed(0)
    plain = GPT(TINY)
    chunked = GPT(dataclasses.replace(TINY, chunked_ce=True, ce_chunk_tokens=50))
    chunked.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_p, grads_p = _grads(plain, idx, targets)
        loss_c, grads_c = _grads(chunked, idx, targets)
    assert loss_c.dtype == torch.float32
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-3, atol=1e-3)
    for name in grads_p:
        assert grads_c[name].dtype == torch.float32
        torch.testing.assert_close(grads_c[name], grads_p[name], rtol=0.05, atol=2e-4, msg=name)


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_counts_closed_form_match_model(name):
    for positions in ("rotary", "learned"):
        cfg = dataclasses.replace(PRESETS[name], positions=positions)
        with torch.device("meta"):  # the 0.7B preset without 2.7 GB of real memory
            model = GPT(cfg)
        counts = count_params(cfg)
        assert model.num_params() == counts["total"]
        tables = model.wte.weight.numel() + (
            model.wpe.weight.numel() if model.wpe is not None else 0
        )
        assert model.num_params() - tables == counts["matmul"] == matmul_params(cfg)
    assert name in PRESET_RUN_DEFAULTS


def test_preset_sizes():
    assert count_params(PRESETS["test-tiny"])["total"] <= 1_000_000
    assert 100e6 < count_params(PRESETS["gpu-small"])["total"] < 150e6
    assert 0.6e9 < count_params(PRESETS["gpu-0.7b"])["total"] < 0.75e9
    # by hand: 12·L·d² per layer (q, k, v, out; two 4d MLP matrices) + V·d for the lm_head
    wide = dataclasses.replace(PRESETS["gpu-0.7b"], n_layer=24)
    assert count_params(wide)["matmul"] == 24 * 12 * 1536**2 + 32768 * 1536 == 729_808_896
    big, rd = PRESETS["gpu-0.7b"], PRESET_RUN_DEFAULTS["gpu-0.7b"]
    assert rd.per_device_batch * rd.accum * big.seq_len == 2**19  # 0.5M tokens per step
    assert ModelConfig(**big.to_dict()) == big


def test_tiny_forward_backward_and_logits():
    torch.manual_seed(0)
    model = GPT(TINY)
    rd = PRESET_RUN_DEFAULTS["test-tiny"]
    idx = torch.randint(0, 256, (rd.per_device_batch, TINY.seq_len))
    loss = model(idx, idx)
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        assert model(idx[:, :10]).shape == (rd.per_device_batch, 10, 256)  # T < seq_len


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_learns_repeated_batch(positions):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(TINY, positions=positions))
    opt = configure_optimizer(model, "adamw", lr=3e-3)
    idx = torch.randint(0, 256, (4, 65))
    losses = []
    for _ in range(15):
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_rotary_positions_matter():
    """In one causal layer without positions, attention at the last token of x·x (x repeated)
    equals attention at the last token of x: duplicated keys leave softmax averages unchanged.
    Rotary positions must break that."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (1, 16))
    no_pos = GPT(dataclasses.replace(TINY, n_layer=1, positions="learned")).eval()
    rotary = GPT(dataclasses.replace(TINY, n_layer=1)).eval()
    with torch.no_grad():
        no_pos.wpe.weight.zero_()
        a = no_pos(torch.cat([x, x], 1))
        b = rotary(torch.cat([x, x], 1))
    torch.testing.assert_close(a[0, 15], a[0, 31], rtol=0, atol=1e-5)  # the premise
    assert (b[0, 15] - b[0, 31]).abs().max() > 1e-3


def test_optimizer_groups():
    model = GPT(dataclasses.replace(TINY, positions="learned"))
    opt = configure_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, torch.optim.AdamW)
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"decay", "no_decay"}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    all_params = ids(model.parameters())
    assert ids(groups["decay"]["params"]) | ids(groups["no_decay"]["params"]) == all_params
    assert not ids(groups["decay"]["params"]) & ids(groups["no_decay"]["params"])
    assert ids(groups["no_decay"]["params"]) == {id(model.wte.weight), id(model.wpe.weight)}
    assert id(model.loss_head.lm_head.weight) in ids(groups["decay"]["params"])
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)
    sgd = configure_optimizer(model, "sgd", lr=0.5, betas=(0.8, 0.95))
    assert isinstance(sgd, torch.optim.SGD)
    assert all(g["momentum"] == 0.8 and g["lr"] == 0.5 for g in sgd.param_groups)
    with pytest.raises(ValueError):
        configure_optimizer(model, "lion")


@pytest.mark.parametrize("chunked", [False, True])
def test_compile_dynamic_batch_no_recompile(chunked):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(TINY, n_layer=1, chunked_ce=chunked, ce_chunk_tokens=64))
    counter = CompileCounterWithBackend("aot_eager")  # inductor needs a C compiler; not here
    compiled = torch.compile(model, backend=counter)
    frames = []
    for batch in (4, 6, 3, 8):
        x, y = torch.randint(0, 256, (batch, 32)), torch.randint(0, 256, (batch, 32))
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
        loss = compiled(x, y)
        loss.backward()
        torch.testing.assert_close(loss, model(x, y), rtol=1e-5, atol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], frames  # compiled once, for every batch
