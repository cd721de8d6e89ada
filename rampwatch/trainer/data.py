"""Training data: the corpus (the Python standard library's own .py sources, which every machine
with Python has), its fingerprint, the tokenizers (raw bytes or a byte-level BPE trained here),
the on-disk token cache, the train/validation split, and sampling by sample id.

Sampling by sample id: sample i ≥ 0 is a fixed window of seq_len + 1 train tokens, and a batch is
a contiguous range of ids [first, first + n). A run's data position is one integer, the next
sample id, so changing the per-device batch or the accumulation mid-run neither skips nor
repeats a sample, resuming needs nothing but that integer, and under data parallel rank r of W
takes the r-th contiguous slice of the global range (rank_slice). Windows: epoch e = i // K of
K windows starts the windows at a seeded offset in [0, seq_len) and visits them in a seeded
permutation, so epochs see different token boundaries and orders.

Your own files (`--data`: token shards, text) are data_files.py's (formats: data_formats.py);
they end in a TokenDataset here too, so sampling by id is the same for both.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rampwatch.trainer.config import ModelConfig

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VAL_PER_MILLE = 50  # ~5% of files, chosen by a hash of their path


def cache_dir() -> Path:
    """$RAMPWATCH_CACHE, else ~/.cache/rampwatch (read at call time)."""
    return Path(os.environ.get("RAMPWATCH_CACHE") or Path.home() / ".cache" / "rampwatch")


def is_val(rel_path: str) -> bool:
    """Deterministic split by file: the same files are validation on every machine and run."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h % 1000 < VAL_PER_MILLE


@dataclass
class Corpus:
    root: str
    files: list[tuple[str, bytes]]  # (path relative to root, content), sorted by path
    sha256: str  # over (relative path, content) of every file

    @property
    def fingerprint(self) -> dict:
        """What goes into the run config: the same corpus gives the same dict on any machine
        (but for 'root')."""
        return {
            "sha256": self.sha256,
            "files": len(self.files),
            "bytes": sum(len(b) for _, b in self.files),
            "root": self.root,
        }

    def split(self) -> tuple[list[bytes], list[bytes]]:
        """(train contents, validation contents), in path order."""
        train, val = [], []
        for rel, content in self.files:
            (val if is_val(rel) else train).append(content)
        return train, val


def load_corpus(root: str | os.PathLike | None = None, suffix: str = ".py") -> Corpus:
    """Every `suffix` file under root (default: the standard library, without site-packages and
    test directories), sorted by relative path."""
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        paths += [Path(d, n) for n in names if n.endswith(suffix)]
    files = sorted((p.relative_to(root).as_posix(), p.read_bytes()) for p in paths)
    assert files, f"no {suffix} files under {root}"
    h = hashlib.sha256()
    for rel, content in files:
        h.update(rel.encode() + b"\0" + len(content).to_bytes(8, "little"))
        h.update(content)
    return Corpus(str(root), files, h.hexdigest())


# ---------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Raw bytes, vocab 256: nothing to train, nothing to cache."""

    vocab_size = 256
    name = "bytes"

    def encode_docs(self, docs: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(docs), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2's scheme; Radford et al. 2019) from the `tokenizers` package."""

    def __init__(self, tok, name: str):
        self.tok, self.name = tok, name
        self.vocab_size = tok.get_vocab_size()

    @staticmethod
    def train(docs: list[bytes], vocab_size: int):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator([d.decode("utf-8", errors="replace") for d in docs], trainer)
        return tok

    def encode_docs(self, docs: list[bytes]) -> np.ndarray:
        enc = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # no offsets if we can
        out = enc([d.decode("utf-8", errors="replace") for d in docs], add_special_tokens=False)
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return np.concatenate([np.asarray(e.ids, dtype=dtype) for e in out] or [np.zeros(0, dtype)])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file and rename: concurrent starts never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def get_tokenizer(kind: str, vocab_size: int, corpus: Corpus, cache: Path | None = None):
    """'bytes' → ByteTokenizer; 'bpe' → BPE trained on the corpus's train split, cached under
    cache_dir() by corpus hash and vocab size."""
    if kind == "bytes":
        return ByteTokenizer()
    assert kind == "bpe", kind
    from tokenizers import Tokenizer

    path = (cache or cache_dir()) / f"bpe-{corpus.sha256[:16]}-{vocab_size}.json"
    if not path.exists():
        tok = BPETokenizer.train(corpus.split()[0], vocab_size)
        _atomic_write(path, lambda p: tok.save(str(p)))
    text = path.read_text()
    name = f"bpe{vocab_size}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return BPETokenizer(Tokenizer.from_str(text), name)


def tokenize(corpus: Corpus, tokenizer, cache: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens): each split's files concatenated in path order.
    BPE results are cached by corpus hash + tokenizer (bytes are instant)."""
    train_docs, val_docs = corpus.split()
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_docs(train_docs), tokenizer.encode_docs(val_docs)
    path = (cache or cache_dir()) / f"tokens-{corpus.sha256[:16]}-{tokenizer.name}.npz"
    if not path.exists():
        train, val = tokenizer.encode_docs(train_docs), tokenizer.encode_docs(val_docs)

        def write(p):
            with open(p, "wb") as f:
                np.savez(f, train=train, val=val)

        _atomic_write(path, write)
        return train, val
    with np.load(path) as z:
        return z["train"], z["val"]


# ---------------------------------------------------------------- sampling by id


class TokenDataset:
    """Sample id → window of seq_len + 1 train tokens; batches are contiguous ranges of ids.
    train and val are arrays, or TokenStreams of files (token_stream.py): the same ids, the same
    windows either way."""

    def __init__(
        self, train, val, seq_len: int, seed: int = 0, meta: dict | None = None, tokenizer=None
    ):
        T = seq_len
        self.train, self.val, self.seq_len, self.seed = train, val, T, seed
        self.meta, self.tokenizer = meta or {}, tokenizer
        # Windows start at offset + k·T, k < K, offset < T: the last ends at most at len - 1.
        self.epoch_samples = (len(train) - 1) // T - 1
        assert self.epoch_samples >= 1, f"{len(train)} train tokens: too few for seq_len {T}"
        assert len(val) > T, f"{len(val)} validation tokens: too few for seq_len {T}"
        self._epochs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._window = np.arange(T + 1)

    def _starts_of_epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            rng = np.random.default_rng((self.seed, epoch))
            offset = int(rng.integers(self.seq_len))
            self._epochs[epoch] = offset + rng.permutation(self.epoch_samples) * self.seq_len
            if len(self._epochs) > 2:  # a batch spans at most two epochs when n ≤ K
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def starts(self, ids: np.ndarray) -> np.ndarray:
        """Token offset in the train array of each sample id's window."""
        epoch, k = np.divmod(ids, self.epoch_samples)
        out = np.empty_like(ids)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._starts_of_epoch(int(e))[k[sel]]
        return out

    def _windows(self, tokens, starts: np.ndarray):
        if isinstance(tokens, np.ndarray):
            w = torch.from_numpy(tokens[starts[:, None] + self._window].astype(np.int64))
        else:  # token_stream.TokenStream: memory-mapped files, windows across their boundaries
            w = torch.from_numpy(tokens.windows(starts, self.seq_len + 1))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def batch(self, first_id: int, n: int):
        """Samples first_id … first_id + n − 1 → x, y LongTensor (n, seq_len) (y is x shifted by
        one token), ids LongTensor (n,)."""
        assert first_id >= 0 and n >= 1
        ids = np.arange(first_id, first_id + n, dtype=np.int64)
        x, y = self._windows(self.train, self.starts(ids))
        return x, y, torch.from_numpy(ids)

    def val_starts(self, n: int) -> np.ndarray:
        """Where val_batch(n)'s windows start: n evenly spaced over the validation tokens, or as
        many as fit without overlapping when n do not (an example repeated would count twice in
        a trial's paired test)."""
        n = min(n, (len(self.val) - 1) // self.seq_len)
        return np.linspace(0, len(self.val) - self.seq_len - 1, n).astype(np.int64)

    def val_batch(self, n: int):
        """A fixed validation batch of the windows at val_starts(n) (the same n and seq_len give
        the same batch in every run, whatever the seed)."""
        return self._windows(self.val, self.val_starts(n))


def rank_slice(first_id: int, n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank` of `world` takes the contiguous slice of the global batch [first_id,
    first_id + n): returns its (first id, count). n must divide by world."""
    assert n % world == 0 and 0 <= rank < world, (n, rank, world)
    per = n // world
    return first_id + rank * per, per


def prepare(
    cfg: ModelConfig,
    seed: int = 0,
    root: str | os.PathLike | None = None,
    cache: Path | None = None,
) -> TokenDataset:
    """Corpus → tokenizer → tokens → TokenDataset for cfg. dataset.meta holds what the run
    config records: corpus fingerprint, tokenizer name, token counts, seed."""
    corpus = load_corpus(root)
    tok = get_tokenizer(cfg.tokenizer, cfg.vocab_size, corpus, cache)
    assert tok.vocab_size <= cfg.vocab_size, (tok.vocab_size, cfg.vocab_size)
    train, val = tokenize(corpus, tok, cache)
    meta = {
        "corpus": corpus.fingerprint,
        "tokenizer": tok.name,
        "tokenizer_vocab": tok.vocab_size,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "data_seed": seed,
    }
    return TokenDataset(train, val, cfg.seq_len, seed, meta, tok)


if (
    __name__ == "__main__"
):  # python -m rampwatch.trainer.data PRESET: build (and cache) a preset's data
    import sys
    import time

    from rampwatch.trainer.config import PRESETS

    t0 = time.perf_counter()
    ds = prepare(PRESETS[sys.argv[1] if len(sys.argv) > 1 else "cpu-tiny"])
    print(
        json.dumps(
            {
                **ds.meta,
                "epoch_samples": ds.epoch_samples,
                "seconds": round(time.perf_counter() - t0, 2),
            },
            indent=1,
        )
    )
