"""trainer/data_files.py, data_formats.py, data_loader.py, shards.py in process: every format gives
its tokens, windows across shard boundaries keep sample-id continuity under a ramp (directly and
through the prefetching loader), the validation split's three rules, the vocabulary check and
--vocab-from-data, the caches (text by content hash, the max-id scan), the fingerprint, every
bad-data message naming its file, and --make-shards giving what training on the text gives."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rampwatch import cli
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data import ByteTokenizer
from rampwatch.trainer.data_files import DataSpec, prepare_files, prepare_for_run
from rampwatch.trainer.data_formats import DataError
from rampwatch.trainer.data_loader import Prefetcher

TINY = PRESETS["test-tiny"]  # seq_len 128, bytes, vocab 256
SHORT = dataclasses.replace(TINY, seq_len=16)
rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAMPWATCH_CACHE", str(cache))
    return cache


def llmc(path, tokens, magic=20240520, version=1, count=None, dtype=np.uint16):
    """An llm.c shard: 256 int32 header (magic, version, token count), then the tokens."""
    header = np.zeros(256, "<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype).tobytes())
    return path


def ids(n, high=256):
    return rng.integers(0, high, n).astype(np.uint16)


def spec(*paths, **kw) -> DataSpec:
    return DataSpec([str(p) for p in paths], **kw)


def everything(stream) -> np.ndarray:
    return stream[0 : len(stream)]


def as_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), np.uint8)


def test_each_format_gives_its_tokens(tmp_path):
    a, b, c, d = ids(300), ids(200), ids(250), ids(260)
    raw = tmp_path / "raw"
    raw.mkdir()
    a.tofile(raw / "a.bin")
    (raw / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    (raw / "prepare.py").write_text("# a directory's other files are not data\n")
    b.astype(np.uint32).tofile(tmp_path / "b32.bin")
    llmc(tmp_path / "c.bin", c)
    llmc(tmp_path / "d.bin", d, magic=20240801, version=7, dtype=np.uint32)
    np.save(tmp_path / "e.npy", a[:150])
    docs = ["first document\n", "ünïcode second\n", "third"] * 10
    (tmp_path / "f.txt").write_text("plain text file " * 20)
    (tmp_path / "g.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "n": i}) for i, t in enumerate(docs)) + "\n\n"
    )
    pq.write_table(pa.table({"text": docs[::-1], "n": list(range(30))}), tmp_path / "h.parquet")
    # raw uint32 needs its dtype; --val-fraction holds out the last tokens
    ds32, _ = prepare_files(SHORT, spec(tmp_path / "b32.bin", dtype="uint32", val_fraction=0.25))
    assert np.array_equal(everything(ds32.train), b[:150])
    assert np.array_equal(everything(ds32.val), b[150:])
    files = [
        raw,
        tmp_path / "c.bin",
        tmp_path / "d.bin",
        tmp_path / "e.npy",
        tmp_path / "f.txt",
        tmp_path / "g.jsonl",
    ]
    ds, cfg = prepare_files(TINY, spec(*files, val_data=[str(tmp_path / "h.parquet")]))
    want = np.concatenate(
        [a, c, d, a[:150], as_bytes("plain text file " * 20), as_bytes("".join(docs))]
    )
    assert np.array_equal(everything(ds.train), want) and cfg == TINY
    assert np.array_equal(everything(ds.val), as_bytes("".join(docs[::-1])))
    m = ds.meta
    assert m["formats"] == {"raw": 1, "llmc": 2, "npy": 1, "text": 1, "jsonl": 1, "parquet": 1}
    assert m["files"] == {"train": 6, "val": 1} and m["val_split"] == "the --val-data files"
    assert m["train_tokens"] == len(want) and m["max_token_id"] == 255
    assert m["tokenizer"] == "bytes" and m["windows"] == "span file boundaries"
    # a sample is its window whatever the files: x and y are shifted slices of the stream
    x, y, sample_ids = ds.batch(3, 5)
    for row, start in enumerate(ds.starts(sample_ids.numpy())):
        w = torch.from_numpy(want[start : start + TINY.seq_len + 1].astype(np.int64))
        assert torch.equal(x[row], w[:-1]) and torch.equal(y[row], w[1:])


@pytest.fixture
def four_shards(tmp_path):
    """Four llm.c shards of 40, 37, 50, 45 tokens and a val shard, for seq_len 16."""
    parts = [ids(n) for n in (40, 37, 50, 45)]
    d = tmp_path / "shards"
    d.mkdir()
    for i, p in enumerate(parts):
        llmc(d / f"fineweb_train_{i:06d}.bin", p)
    llmc(d / "fineweb_val_000000.bin", ids(40))
    return d, np.concatenate(parts)


def test_windows_span_shard_boundaries_and_keep_ids_under_a_ramp(four_shards):
    d, whole = four_shards
    ds, _ = prepare_files(SHORT, spec(d), seed=5)
    T, K = SHORT.seq_len, ds.epoch_samples
    assert ds.meta["val_split"] == "the files named as validation" and len(ds.val) == 40
    assert K == (len(whole) - 1) // T - 1
    bounds = ds.train.bounds[1:-1]
    crossing = 0
    x, y, _ = ds.batch(0, 3 * K)  # three epochs
    for row, start in enumerate(ds.starts(np.arange(3 * K))):
        w = torch.from_numpy(whole[start : start + T + 1].astype(np.int64))
        assert torch.equal(x[row], w[:-1]) and torch.equal(y[row], w[1:])
        crossing += bool(((bounds > start) & (bounds < start + T + 1)).any())
    assert crossing >= 3, "no window crossed a shard boundary"
    # a ramp mid-stream: ids [a, a+4) at one batch, then [a+4, a+15) at another, across an
    # epoch: exactly the windows of one pass
    a = K - 6
    parts = [ds.batch(a, 4), ds.batch(a + 4, 11)]
    for got, want in zip(zip(*parts, strict=True), ds.batch(a, 15), strict=True):
        assert torch.equal(torch.cat(got), want)
    # the same through the prefetching loader, whose queued batches of the old tier are dropped
    loader = Prefetcher(ds, "cpu")
    try:
        loader.want([(a, 2), (a + 2, 2), (a + 4, 2), (a + 6, 2)])  # this step and the next
        got = [loader.get(a, 2), loader.get(a + 2, 2)]
        loader.want([(a + 4, 3), (a + 7, 3), (a + 10, 3)])  # the ramp: batch 3
        got += [loader.get(a + 4, 3), loader.get(a + 7, 3), loader.get(a + 10, 3)]
        x_all, y_all, _ = ds.batch(a, 13)
        assert torch.equal(torch.cat([g[0] for g in got]), x_all)
        assert torch.equal(torch.cat([g[1] for g in got]), y_all)
        assert loader.gets == 5 and loader.misses == 0 and not loader.pending
        assert torch.equal(loader.get(0, 1)[0], ds.batch(0, 1)[0]) and loader.misses == 1
    finally:
        loader.close()


def test_val_split_rules(four_shards, tmp_path):
    d, whole = four_shards
    named, _ = prepare_files(SHORT, spec(d))
    assert named.meta["files"] == {"train": 4, "val": 1}
    # explicit --val-data wins over names; a --val-data file inside a --data directory is held out
    explicit, _ = prepare_files(SHORT, spec(d, val_data=[str(d / "fineweb_train_000003.bin")]))
    assert explicit.meta["files"] == {"train": 4, "val": 1}
    assert len(explicit.train) == 40 + 37 + 50 + 40 and len(explicit.val) == 45
    # --val-fraction: the last fraction of all the tokens, names ignored
    frac, _ = prepare_files(SHORT, spec(d, val_fraction=0.2))
    total = len(whole) + 40
    assert len(frac.val) == round(0.2 * total) and len(frac.train) + len(frac.val) == total
    assert frac.meta["val_split"] == "the last 0.2 of the tokens"
    assert np.array_equal(everything(frac.train), whole[: len(frac.train)])


def test_vocab_checked_against_the_model_or_taken_from_data(tmp_path):
    big = ids(1200, high=300)
    big[7] = 299
    llmc(tmp_path / "gpt2_train.bin", big)
    llmc(tmp_path / "ok_train.bin", ids(400))
    with pytest.raises(
        DataError,
        match=r"gpt2_train\.bin: token id 299 >= the model's "
        r"vocabulary 256: pass --vocab-from-data",
    ):
        prepare_files(TINY, spec(tmp_path / "ok_train.bin", tmp_path / "gpt2_train.bin"))
    with pytest.raises(
        DataError,
        match=r"gpt2_train\.bin: holds token id 299, but its "
        r"declared vocabulary .* is 200",
    ):
        prepare_files(TINY, spec(tmp_path / "gpt2_train.bin", vocab=200, val_fraction=0.5))
    ds, cfg = prepare_files(
        TINY, spec(tmp_path / "gpt2_train.bin", vocab_from_data=True, val_fraction=0.5)
    )
    assert cfg.vocab_size == 300 and cfg.tokenizer == "bpe" and ds.meta["vocab_size"] == 300
    (tmp_path / "gpt2_train.bin.json").write_text(
        json.dumps({"vocab_size": 512, "tokenizer": "mine"})
    )
    ds, cfg = prepare_files(
        TINY, spec(tmp_path / "gpt2_train.bin", vocab_from_data=True, val_fraction=0.5)
    )
    assert cfg.vocab_size == 512 and ds.meta["tokenizer"] == "mine"


def test_caches_text_by_content_and_the_max_id_scan(tmp_path, monkeypatch, tmp_cache):
    text = tmp_path / "a.txt"
    text.write_text("some text to tokenize once " * 40)
    llmc(tmp_path / "b.bin", ids(500))
    first, _ = prepare_files(TINY, spec(text, tmp_path / "b.bin", val_fraction=0.3))

    def boom(*a, **k):
        raise AssertionError("read again")

    with monkeypatch.context() as m:
        m.setattr(ByteTokenizer, "encode_docs", boom)
        m.setattr(np.memmap, "max", boom)  # the id scan of b.bin is cached too
        again, _ = prepare_files(TINY, spec(text, tmp_path / "b.bin", val_fraction=0.3))
        assert again.meta == first.meta
        copy = tmp_path / "copy"
        copy.mkdir()
        shutil.copy(text, copy / "a.txt")  # another path, the same content: the same tokens
        prepare_files(TINY, spec(copy / "a.txt", val_fraction=0.3))
        # the fingerprint: an mtime alone keeps it, a changed middle (below) does not
        os.utime(text, ns=(1, 1))
        moved = prepare_files(TINY, spec(text, tmp_path / "b.bin", val_fraction=0.3))[0].meta
        assert moved["fingerprint"] == first.meta["fingerprint"]
    raw = bytearray((tmp_path / "b.bin").read_bytes())
    raw[len(raw) // 2] ^= 1
    (tmp_path / "b.bin").write_bytes(bytes(raw))
    changed = prepare_files(TINY, spec(text, tmp_path / "b.bin", val_fraction=0.3))[0].meta
    assert changed["fingerprint"] != first.meta["fingerprint"]


def _bad(tmp_path, name: str):
    """(file, extra spec fields, message) for each kind of bad data."""
    p = tmp_path / name
    if name == "empty.bin":
        p.write_bytes(b"")
        return p, {}, r"empty\.bin: empty file"
    if name == "odd.bin":
        p.write_bytes(b"\x01\x02\x03" * 101)
        return p, {"dtype": "uint16"}, r"odd\.bin: 303 bytes is not a whole number of uint16"
    if name == "short.bin":
        llmc(p, ids(100))
        return p, {}, r"short\.bin: 100 tokens, shorter than one sequence \(seq_len 128 \+ 1\)"
    if name == "v2.bin":
        llmc(p, ids(400), version=2)
        return p, {}, r"v2\.bin: llm.c header magic 20240520 with version 2: only version 1"
    if name == "magic.bin":
        llmc(p, ids(400), magic=12345)
        return p, {}, r"magic\.bin: not an llm.c shard \(magic 12345"
    if name == "cut.bin":
        llmc(p, ids(400), count=500)
        return p, {}, r"cut\.bin: llm.c header says 500 tokens \(1000 bytes\) but 800 bytes"
    if name == "nocol.jsonl":
        p.write_text('{"text": "a"}\n{"content": "b"}\n')
        return p, {}, r"nocol\.jsonl:2: no 'text' field \(has: content\)"
    if name == "nocol.parquet":
        pq.write_table(pa.table({"content": ["x" * 500]}), p)
        return p, {}, r"nocol\.parquet: no column 'text' \(has: content\)"
    if name == "big.bin":
        llmc(p, np.full(400, 300, np.uint16))
        return p, {}, r"big\.bin: token id 300 >= the model's vocabulary 256"
    raise AssertionError(name)


BAD = [
    "empty.bin",
    "odd.bin",
    "short.bin",
    "v2.bin",
    "magic.bin",
    "cut.bin",
    "nocol.jsonl",
    "nocol.parquet",
    "big.bin",
]


def refused(path, extra: dict, message: str) -> None:
    """prepare_files refuses the data in one line that names it and matches `message`."""
    with pytest.raises(DataError, match=message) as caught:
        prepare_files(TINY, spec(path, **{"val_fraction": 0.5, **extra}))
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize("name", BAD)
def test_bad_data_names_the_file_and_the_problem(tmp_path, name):
    refused(*_bad(tmp_path, name))


def _train(tmp_path, *argv):
    return cli.main(
        [
            "train",
            "--preset",
            "test-tiny",
            "--db",
            str(tmp_path / "r.duckdb"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--no-plan",
            *argv,
        ]
    )


def test_cli_bad_data_is_one_line_and_exit_2(tmp_path, capsys):
    path, _, message = _bad(tmp_path, "big.bin")
    for argv, want in (
        (("--data", str(path)), message),
        (("--data", str(tmp_path / "no*.bin")), r"no\*\.bin: no file matches"),
        (("--vocab-from-data",), "--vocab-from-data needs --data"),
    ):
        with pytest.raises(SystemExit) as caught:
            _train(tmp_path, *argv)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("rampwatch train: error: ") and re.search(want, err)
    assert not (tmp_path / "r.duckdb").exists()  # refused before any run was created


def test_make_shards_trains_on_what_the_text_gives(tmp_path, capsys):
    docs = [{"text": f"document {i}: " + "words and more words " * (i % 7 + 1)} for i in range(60)]
    (tmp_path / "a.jsonl").write_text("\n".join(map(json.dumps, docs)))
    (tmp_path / "b.txt").write_text("a plain file, longer than one sequence " * 30)
    out = tmp_path / "shards"
    argv = [
        "--data",
        str(tmp_path / "a.jsonl"),
        "--data",
        str(tmp_path / "b.txt"),
        "--val-fraction",
        "0.1",
    ]
    assert _train(tmp_path, "--make-shards", str(out), "--shard-tokens", "1000", *argv) == 0
    assert "train shards" in capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes" and meta["dtype"] == "uint16"
    shards = sorted(p.name for p in out.glob("*.bin"))
    assert "val_000000.bin" in shards and len(shards) >= 4
    header = np.fromfile(out / "train_000000.bin", "<i4", count=3)
    assert header.tolist() == [20240520, 1, 1000]
    from_text, _ = prepare_files(
        TINY, spec(tmp_path / "a.jsonl", tmp_path / "b.txt", val_fraction=0.1)
    )
    from_shards, _ = prepare_files(TINY, spec(out))
    assert from_shards.meta["val_split"] == "the files named as validation"
    assert np.array_equal(everything(from_shards.train), everything(from_text.train))
    assert np.array_equal(everything(from_shards.val), everything(from_text.val))
    for a, b in zip(from_text.batch(11, 6), from_shards.batch(11, 6), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(SystemExit):  # never into a directory that holds shards already
        _train(tmp_path, "--make-shards", str(out), *argv)
    assert "already holds .bin shards" in capsys.readouterr().err


def test_resume_refuses_other_data(four_shards):
    d, _ = four_shards
    args = SimpleNamespace(
        data=[str(d)],
        val_data=None,
        val_fraction=None,
        data_dtype=None,
        data_vocab=None,
        text_column="text",
        vocab_from_data=False,
        seed=0,
    )
    ds, _ = prepare_for_run(SHORT, args)
    again, _ = prepare_for_run(SHORT, SimpleNamespace(data=None, seed=0), ds.meta)  # adopted
    assert again.meta == ds.meta
    llmc(d / "fineweb_train_000009.bin", ids(60))
    with pytest.raises(DataError, match="not the data this run started with"):
        prepare_for_run(SHORT, SimpleNamespace(data=None, seed=0), ds.meta)
