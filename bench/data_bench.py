"""Data-loading figures of `rampwatch train --data` (trainer/data_files.py, data_loader.py):
memory-mapped shard reading and text tokenization in tokens/s beside what the gpu-0.7b preset
consumes on one H200 (~130k tokens/s: the project seed's measured figure, not measured here),
the first and a later start on a directory of shards, and the loader's wait per step of a real
run on the CPU. Prints a markdown table with the machine it ran on.

    OMP_NUM_THREADS=1 python -m bench.data_bench [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data import load_corpus
from rampwatch.trainer.data_files import DataSpec, prepare_files, text_tokenizer, text_tokens
from rampwatch.trainer.data_loader import Prefetcher

NEED = 130_000  # tokens/s of gpu-0.7b on one H200 (the seed's measured figure)
BIG = PRESETS["gpu-0.7b"]  # seq_len 2048, vocab 32768, per-device batch 16 × accumulation 16


def write_shards(root: Path, n: int, tokens: int, high: int) -> list[Path]:
    """n llm.c shards of random ids below `high` (reading speed does not depend on the ids)."""
    root.mkdir(parents=True, exist_ok=True)
    rng, paths = np.random.default_rng(0), []
    for i in range(n):
        header = np.zeros(256, "<i4")
        header[:3] = 20240520, 1, tokens
        p = root / f"bench_train_{i:06d}.bin"
        with open(p, "wb") as f:
            f.write(header.tobytes())
            for a in range(0, tokens, 1 << 24):
                f.write(rng.integers(0, high, min(1 << 24, tokens - a), dtype=np.uint16).tobytes())
            f.flush()
            os.fsync(f.fileno())
        paths.append(p)
    return paths


def drop_page_cache(paths) -> None:
    """Evict the files' pages (clean pages need no root): the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_rate(ds, batches: int, b: int = 16) -> float:
    """tokens/s of ds.batch over consecutive ids, as training takes them (16 × 2048 each)."""
    t0 = time.perf_counter()
    for k in range(batches):
        ds.batch(k * b, b)
    return batches * b * ds.seq_len / (time.perf_counter() - t0)


def loader_rate(ds, steps: int, b: int = 16, accum: int = 16) -> float:
    """tokens/s through the Prefetcher with a consumer that takes no time (its ceiling)."""
    loader = Prefetcher(ds, "cpu")
    t0 = time.perf_counter()
    for s in range(steps + 1):
        first = s * b * accum
        loader.want([(first + j * b, b) for j in range(2 * accum)])
        for j in range(accum):
            loader.get(first + j * b, b)
    loader.close()
    return (steps + 1) * b * accum * ds.seq_len / (time.perf_counter() - t0)


def text_rate(kind: str, vocab: int, docs_mb: float, out: Path) -> tuple[float, float, int]:
    """(tokens/s, bytes/s, tokens) of text_tokens on standard-library sources as plain-text
    files (read, content hash, tokenize, write the cache)."""
    corpus, size, files = load_corpus(), 0, []
    out.mkdir(parents=True, exist_ok=True)
    for i, (_rel, content) in enumerate(corpus.files):
        if size >= docs_mb * 2**20:
            break
        if not content:
            continue  # an empty file is refused as bad data
        p = out / f"doc{i:05d}.txt"
        p.write_bytes(content)
        files.append(p)
        size += len(content)
    tok = text_tokenizer(kind, vocab)  # a BPE is trained once (and cached) before the clock
    t0 = time.perf_counter()
    n = sum(len(text_tokens(p, "text", "text", tok)) for p in files)
    dt = time.perf_counter() - t0
    return n / dt, size / dt, n


def run_rate(shard_dir: Path, preset: str, steps: int, tmp: Path) -> dict:
    """A real `rampwatch train --data` run in this process: the loader's wait per step (the
    time the loop waited for data, copy included) against the step."""
    from rampwatch.trainer import cli as train_cli
    from rampwatch.trainer.loop import Trainer

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--preset",
            preset,
            "--db",
            str(tmp / f"{preset}.duckdb"),
            "--checkpoint-dir",
            str(tmp / "ck"),
            "--data",
            str(shard_dir),
            "--steps",
            str(steps),
            "--no-plan",
            "--progress",
            "off",
            "--val-every",
            "0",
            "--checkpoint-every",
            "0",
        ]
    )
    train_cli.resolve_defaults(args)
    t = Trainer(args)
    times = []
    step = t.train_step

    def timed():
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        return out

    t.train_step = timed
    t.run()
    per_step = float(np.median(times[1:]))  # the first step includes one-time work
    tokens = t.state.per_device_batch * t.state.accum * t.cfg.seq_len
    return {
        "preset": preset,
        "step_s": per_step,
        "wait_s": t.loader.wait_s / len(times),
        "misses": t.loader.misses,
        "tokens_per_s": tokens / per_step,
        "tier": f"{t.state.per_device_batch}x{t.state.accum}",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--dir", help="where to write the shards (default: a temporary directory)")
    a = p.parse_args(argv)
    n_shards, shard_tokens = (2, 4_000_000) if a.quick else (4, 32_000_000)
    load = os.getloadavg()
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="rampwatch-data-bench-"))
    os.environ["RAMPWATCH_CACHE"] = str(tmp / "cache")  # a fresh cache: first starts are first
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {datetime.date.today()}",
        file=sys.stderr,
    )
    rows = []
    paths = write_shards(tmp / "shards", n_shards, shard_tokens, BIG.vocab_size)
    total = n_shards * shard_tokens
    spec = DataSpec([str(tmp / "shards")], val_fraction=0.01)
    t0 = time.perf_counter()
    ds, _ = prepare_files(BIG, spec)
    first = time.perf_counter() - t0
    rows.append(
        (
            f"first start on {n_shards} shards, {total / 1e6:.0f}M tokens (fingerprint + "
            f"one max-id scan, files in page cache)",
            total / first,
            f"{first:.2f} s",
        )
    )
    t0 = time.perf_counter()
    ds, _ = prepare_files(BIG, spec)
    rows.append(
        (
            "a later start (fingerprint only; the scan is cached)",
            None,
            f"{time.perf_counter() - t0:.3f} s",
        )
    )
    batches = 64 if a.quick else 256
    read_rate(ds, batches)  # maps the pages: the timed pass below is the steady state
    rows.append(
        ("memory-mapped windows, 16 × 2048 (page cache warm)", read_rate(ds, batches), "ds.batch")
    )
    del ds
    gc.collect()  # unmap: mapped pages cannot be evicted
    drop_page_cache(paths)
    ds, _ = prepare_files(BIG, spec)
    rows.append(
        (
            "memory-mapped windows, 16 × 2048 (pages evicted first)",
            read_rate(ds, batches),
            "posix_fadvise DONTNEED; a VM's host may still cache",
        )
    )
    rows.append(
        (
            "through the prefetching loader, 16 × 2048 × accum 16 (ceiling)",
            loader_rate(ds, 2 if a.quick else 8),
            "one worker thread, warm",
        )
    )
    mb = 2 if a.quick else 8
    for kind, vocab in (("bytes", 256), ("bpe", BIG.vocab_size)):
        rate, bps, n = text_rate(kind, vocab, mb, tmp / f"text-{kind}")
        rows.append(
            (
                f"text → tokens, {kind} {vocab} ({mb} MB of .py sources, {n / 1e6:.1f}M "
                f"tokens; once, then cached)",
                rate,
                f"{bps / 2**20:.1f} MB/s of text",
            )
        )
    small = write_shards(tmp / "byte-shards", 4, 200_000, 256)
    assert small
    for preset in ("test-tiny",) if a.quick else ("test-tiny", "cpu-tiny"):
        r = run_rate(tmp / "byte-shards", preset, 8 if a.quick else 20, tmp)
        rows.append(
            (
                f"loader wait per step, `rampwatch train --preset {preset} --data` "
                f"({r['tier']}, CPU)",
                None,
                f"{r['wait_s'] * 1e3:.2f} ms of a {r['step_s'] * 1e3:.0f} ms step "
                f"({100 * r['wait_s'] / r['step_s']:.1f}%), {r['misses']} misses",
            )
        )
    if not a.dir:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| measurement | tokens/s | × gpu-0.7b's ~130k tokens/s | note |")
    print("|---|---|---|---|")
    for what, rate, note in rows:
        cells = (f"{rate:,.0f}", f"{rate / NEED:,.1f}×") if rate else ("", "")
        print(f"| {what} | {cells[0]} | {cells[1]} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
