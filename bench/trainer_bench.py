"""What telemetry costs the training loop, and what chunked cross-entropy saves; prints markdown.

    python bench/trainer_bench.py            # cpu-tiny, 6 rounds of A/B
    python bench/trainer_bench.py --quick    # test-tiny, 5 rounds, fewer steps

1. tokens/s with telemetry on (trainer.Monitor: a norm after every backward, one host transfer
   per step, store.RunWriter spooling 20 metrics, its flusher thread ingesting into DuckDB) vs
   off (the same loop without Monitor), interleaved A B A B ... so drift hits both alike.
2. the real peak one training step adds (VmHWM of a fresh process, bench/memplan_bench.py's
   method) with plain vs chunked lm_head + cross-entropy at the same batch, on a logits-heavy
   shape, beside the plan's per-component breakdown (trainer/gpt_plan.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.memplan_bench import measure
from rampwatch.monitor import Monitor
from rampwatch.store import names as M
from rampwatch.trainer.config import PRESET_RUN_DEFAULTS, PRESETS
from rampwatch.trainer.data import prepare
from rampwatch.trainer.gpt_plan import plan_in_process
from rampwatch.trainer.model import GPT, configure_optimizer

LOGITS_HEAVY = {
    "vocab_size": 8192,
    "tokenizer": "bpe",
    "n_layer": 2,
    "n_head": 4,
    "d_model": 128,
    "seq_len": 256,
    "ce_chunk_tokens": 256,
}


def _block(model, opt, data, mon, first_id: int, steps: int, batch: int, accum: int) -> float:
    """`steps` optimizer steps; returns tokens/s."""
    t0 = time.perf_counter()
    for s in range(steps):
        total = torch.zeros(())
        for j in range(accum):
            x, y, _ = data.batch(first_id + (s * accum + j) * batch, batch)
            loss = model(x, y)
            (loss / accum).backward()
            if mon is not None:
                mon.after_backward()
            total += loss.detach() / accum
        if mon is not None:
            mon.step(mon.tokens_seen // (batch * accum * data.seq_len) + 1, loss=total)
        else:
            float(total)  # the same one host sync per step the monitor does
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * accum * batch * data.seq_len / (time.perf_counter() - t0)


def telemetry_overhead(preset: str, rounds: int, steps: int) -> list[str]:
    cfg, d = PRESETS[preset], PRESET_RUN_DEFAULTS[preset]
    data = prepare(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = configure_optimizer(model, "adamw", d.lr)
    with tempfile.TemporaryDirectory() as tmp:
        mon = Monitor.start(
            Path(tmp) / "bench.duckdb",
            name="bench",
            config={},
            model=model,
            optimizer=opt,
            per_device_batch=d.per_device_batch,
            accum=d.accum,
            seq_len=cfg.seq_len,
        )
        on, off = [], []
        first = 0
        _block(model, opt, data, None, first, 2, d.per_device_batch, d.accum)  # warm-up
        for _ in range(rounds):
            for sink, m in ((off, None), (on, mon)):
                first += steps * d.accum * d.per_device_batch
                sink.append(_block(model, opt, data, m, first, steps, d.per_device_batch, d.accum))
        mon.finish()
    med_on, med_off = statistics.median(on), statistics.median(off)
    spread = lambda xs: f"{min(xs):,.0f}–{max(xs):,.0f}"  # noqa: E731
    return [
        f"### Telemetry cost, `{preset}` ({d.per_device_batch} × {d.accum}, {rounds} rounds "
        f"of {steps} steps each, interleaved)",
        "",
        "| loop | tokens/s median | spread |",
        "|---|---:|---:|",
        f"| telemetry off | {med_off:,.0f} | {spread(off)} |",
        f"| telemetry on (Monitor + RunWriter) | {med_on:,.0f} | {spread(on)} |",
        f"| difference | {100 * (med_on - med_off) / med_off:+.1f}% | |",
        "",
    ]


def chunked_memory(batch: int) -> list[str]:
    lines = [
        f"### Peak memory one step adds: plain vs chunked cross-entropy (batch {batch}, "
        f"vocab {LOGITS_HEAVY['vocab_size']}, seq {LOGITS_HEAVY['seq_len']}, "
        f"chunk {LOGITS_HEAVY['ce_chunk_tokens']} tokens)",
        "",
        "| variant | measured (VmHWM) | planned | plan: logits | plan: activations |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant in M.LOSS_VARIANTS:
        cfg = {
            **PRESETS["test-tiny"].to_dict(),
            **LOGITS_HEAVY,
            "chunked_ce": variant == M.CHUNKED_CE,
        }
        real = measure(cfg, batch)
        [row] = plan_in_process(cfg, [batch], variants=(variant,))
        added = row["predicted_bytes"] - row["steady_bytes"]
        mb = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
        lines.append(
            f"| {variant} | {mb(real['step_bytes'])} | {mb(added)} | "
            f"{mb(row['breakdown']['logits'])} | {mb(row['breakdown']['activations'])} |"
        )
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    preset, rounds, steps = ("test-tiny", 5, 5) if args.quick else ("cpu-tiny", 6, 6)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s)\n"
    )
    print("\n".join(telemetry_overhead(preset, rounds, steps)))
    print("\n".join(chunked_memory(4 if args.quick else 8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
