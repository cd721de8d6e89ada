"""trainer/data.py: corpus fingerprint, split, sampling by sample id (continuity under batch
changes, rank slices, epochs), the fixed validation batch, the BPE tokenizer and its cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rampwatch.trainer import data
from rampwatch.trainer.config import PRESETS, ModelConfig
from rampwatch.trainer.data import TokenDataset, is_val, load_corpus, prepare, rank_slice

TINY = PRESETS["test-tiny"]


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAMPWATCH_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus()


@pytest.fixture
def small_root(tmp_path, stdlib):
    """A few standard-library files (some of them validation files) under a tmp root."""
    train = [f for f in stdlib.files if not is_val(f[0])][:30]
    val = [f for f in stdlib.files if is_val(f[0])][:3]
    root = tmp_path / "corpus"
    for rel, content in train + val:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    (root / "notes.txt").write_text("not a .py file")
    return root


def test_stdlib_fingerprint_stable(stdlib):
    again = load_corpus()
    assert again.fingerprint == stdlib.fingerprint
    fp = stdlib.fingerprint
    assert len(fp["sha256"]) == 64 and fp["files"] > 100 and fp["bytes"] > 1_000_000
    rels = [rel for rel, _ in stdlib.files]
    assert rels == sorted(rels)
    assert not any(p in ("site-packages", "test", "tests") for r in rels for p in r.split("/"))


def test_fingerprint_sees_content_and_paths(small_root):
    base = load_corpus(small_root).sha256
    first = sorted(small_root.rglob("*.py"))[0]
    first.write_bytes(first.read_bytes() + b"\n")
    changed = load_corpus(small_root).sha256
    first.rename(first.with_name("renamed_" + first.name))
    renamed = load_corpus(small_root).sha256
    assert len({base, changed, renamed}) == 3


def test_split_disjoint_deterministic(stdlib):
    val = {rel for rel, _ in stdlib.files if is_val(rel)}
    train = {rel for rel, _ in stdlib.files if not is_val(rel)}
    assert not val & train and len(val | train) == len(stdlib.files)
    assert 0.02 < len(val) / len(stdlib.files) < 0.10
    assert val == {rel for rel, _ in load_corpus().files if is_val(rel)}
    train_docs, val_docs = stdlib.split()
    assert len(val_docs) == len(val) and len(train_docs) == len(train)


@pytest.fixture(scope="module")
def ds():
    return prepare(TINY, seed=1)  # bytes: no cache involved


def test_windows_are_shifted_corpus_slices(ds):
    x, y, ids = ds.batch(5, 4)
    assert x.shape == y.shape == (4, TINY.seq_len) and x.dtype == y.dtype == torch.long
    assert ids.tolist() == [5, 6, 7, 8]
    for row, start in enumerate(ds.starts(ids.numpy())):
        window = torch.from_numpy(ds.train[start : start + TINY.seq_len + 1].astype(np.int64))
        assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])
    assert ds.meta["corpus"]["sha256"] == load_corpus().sha256 and ds.meta["tokenizer"] == "bytes"


@pytest.mark.parametrize("first,k,n", [(0, 3, 8), (1000, 1, 2), (17, 16, 64)])
def test_stream_continuity_under_batch_changes(ds, first, k, n):
    whole = ds.batch(first, n)
    parts = [ds.batch(first, k), ds.batch(first + k, n - k)]
    for got, want in zip(zip(*parts, strict=True), whole, strict=True):
        assert torch.equal(torch.cat(got), want)


def test_stream_continuity_across_epoch_boundary(ds):
    first = ds.epoch_samples - 5
    whole = ds.batch(first, 10)
    parts = [ds.batch(first, 5), ds.batch(first + 5, 5)]
    for got, want in zip(zip(*parts, strict=True), whole, strict=True):
        assert torch.equal(torch.cat(got), want)


def test_rank_slices_cover_global_batch(ds):
    first, n, world = 123, 12, 4
    slices = [rank_slice(first, n, r, world) for r in range(world)]
    assert [s[0] for s in slices] == [123, 126, 129, 132] and {s[1] for s in slices} == {3}
    whole = ds.batch(first, n)
    per_rank = [ds.batch(*s) for s in slices]
    for got, want in zip(zip(*per_rank, strict=True), whole, strict=True):
        assert torch.equal(torch.cat(got), want)
    with pytest.raises(AssertionError):
        rank_slice(0, 10, 0, 4)


def test_epochs_visit_every_window_once():
    T, tokens = 10, np.arange(1000, dtype=np.uint16)
    d = TokenDataset(tokens, tokens, T, seed=3)
    K = d.epoch_samples
    assert K == (1000 - 1) // T - 1
    for epoch in range(3):
        starts = d.starts(np.arange(epoch * K, (epoch + 1) * K))
        offset = starts.min()
        assert 0 <= offset < T and starts.max() + T + 1 <= len(tokens)
        assert sorted(starts.tolist()) == [offset + T * k for k in range(K)]  # each once
    assert not np.array_equal(d.starts(np.arange(K)), d.starts(np.arange(K, 2 * K)))
    # the seed picks the order; the same seed the same order, in a fresh object too
    again = TokenDataset(tokens, tokens, T, seed=3).starts(np.arange(2 * K))
    assert np.array_equal(again, d.starts(np.arange(2 * K)))
    other = TokenDataset(tokens, tokens, T, seed=4).starts(np.arange(K))
    assert not np.array_equal(other, d.starts(np.arange(K)))


def test_val_batch_fixed(ds):
    x, y = ds.val_batch(8)
    assert x.shape == (8, TINY.seq_len)
    other_seed = TokenDataset(ds.train, ds.val, TINY.seq_len, seed=99)
    for a, b in zip((x, y), other_seed.val_batch(8), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(x[0], torch.from_numpy(ds.val[: TINY.seq_len].astype(np.int64)))


def test_val_batch_never_repeats_a_token_window(ds):
    """Asked for more windows than the validation tokens hold apart, it returns the windows that
    do not overlap: a repeated example would count twice in a trial's paired test."""
    T = TINY.seq_len
    most = (len(ds.val) - 1) // T
    x, y = ds.val_batch(most + 1000)
    assert x.shape == y.shape == (most, T)
    starts = ds.val_starts(most + 1000)
    assert len(starts) == most and np.diff(starts).min() >= T
    assert starts[-1] + T + 1 <= len(ds.val)
    assert torch.equal(
        x[-1], torch.from_numpy(ds.val[starts[-1] : starts[-1] + T].astype(np.int64))
    )


def test_bpe_trains_caches_and_reloads(small_root, tmp_cache, monkeypatch):
    cfg = ModelConfig(vocab_size=512, n_layer=1, n_head=2, d_model=32, seq_len=64, tokenizer="bpe")
    first = prepare(cfg, root=small_root)
    tok = first.tokenizer
    assert tok.vocab_size == 512 and first.meta["tokenizer"].startswith("bpe512-")
    assert first.train.dtype == np.uint16 and first.train.max() < 512
    assert sorted(p.name.split("-")[0] for p in tmp_cache.iterdir()) == ["bpe", "tokens"]
    text = "def f(x):\n    return x + 1  # ünïcode\n"
    ids = tok.tok.encode(text).ids
    assert tok.decode(ids) == text and len(ids) < len(text.encode())

    # The second start trains and tokenizes nothing and gives the same data.
    def boom(*a, **k):
        raise AssertionError("cache miss")

    monkeypatch.setattr(data.BPETokenizer, "train", staticmethod(boom))
    monkeypatch.setattr(data.BPETokenizer, "encode_docs", boom)
    second = prepare(cfg, root=small_root)
    assert second.meta == first.meta
    assert np.array_equal(second.train, first.train) and np.array_equal(second.val, first.val)
    for a, b in zip(first.batch(7, 3), second.batch(7, 3), strict=True):
        assert torch.equal(a, b)
    # Another corpus is another cache entry.
    (small_root / "extra.py").write_text("x = 1\n" * 100)
    with pytest.raises(AssertionError, match="cache miss"):
        prepare(cfg, root=small_root)


def test_bytes_dataset_from_small_root(small_root):
    d = prepare(dataclasses.replace(TINY, seq_len=32), root=small_root)
    assert d.meta["corpus"]["files"] == 33 and d.meta["val_tokens"] > 0
    train_docs, val_docs = load_corpus(small_root).split()
    assert (
        d.train.tobytes()
        == np.frombuffer(b"".join(train_docs), np.uint8).astype(np.uint16).tobytes()
    )
    assert len(d.val) == sum(map(len, val_docs))
