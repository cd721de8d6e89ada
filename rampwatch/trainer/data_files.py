"""Your own data for the reference trainer (`--data`): the data spec a run records, the cheap
fingerprint, the one-time scan of token ids (cached), text → tokens (cached by content hash),
the validation split, the vocabulary check
against the model, and prepare_for_run, which the Trainer calls for either corpus.

Windows span file boundaries. The train files are one stream in the order given (a directory or
a glob sorted), as the standard-library corpus concatenates its files and nanoGPT's train.bin its
documents; TokenDataset's sample ids then work unchanged (sample i is one fixed window of
seq_len + 1 tokens of that stream, epochs start at a seeded offset and visit the windows in a
seeded order) and no token at a shard's end is lost. Validation: the --val-data files; else the
files named as validation (val.bin, *_val_*.bin, a DatasetDict's validation split); else, or
with --val-fraction F, the last F of the tokens (default 5%), cut at a token (the one document
across the cut is in both splits). A Hugging Face save_to_disk split (data_hf) is one source
like a file: its token-id or text column becomes one cached token array.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from rampwatch.trainer import data_hf
from rampwatch.trainer.config import ModelConfig
from rampwatch.trainer.data import (
    ByteTokenizer,
    TokenDataset,
    _atomic_write,
    cache_dir,
    get_tokenizer,
    load_corpus,
    prepare,
)
from rampwatch.trainer.data_formats import (
    DataError,
    expand,
    is_val_name,
    iter_docs,
    open_token_file,
)
from rampwatch.trainer.token_stream import TokenStream

DEFAULT_VAL_FRACTION = 0.05
SAMPLE_BYTES = 4096  # per probe of the fingerprint: 5 probes, ≤ 20 KiB read per file
SCAN_CHUNK = 1 << 24  # tokens per step of the one-time max-id scan (bounded memory)
DOC_BATCH_BYTES = 8 << 20  # text handed to the tokenizer at a time


@dataclass
class DataSpec:
    """What --data and its flags said; recorded in the run config, so a resume needs no flags."""

    data: list[str]
    val_data: list[str] = field(default_factory=list)
    val_fraction: float | None = None
    dtype: str | None = None
    vocab: int | None = None
    text_column: str = "text"
    vocab_from_data: bool = False
    # the preset's [kind, vocab] at the first start: text is tokenized the same way on a resume
    text_tokenizer: list = field(default_factory=lambda: ["bytes", 256])

    @classmethod
    def from_args(cls, args, cfg: ModelConfig, recorded: dict | None = None) -> DataSpec:
        absolute = [os.path.abspath(os.path.expanduser(p)) for p in args.data]
        tok = (recorded or {}).get("text_tokenizer") or [cfg.tokenizer, cfg.vocab_size]
        return cls(
            absolute,
            [os.path.abspath(os.path.expanduser(p)) for p in args.val_data or []],
            args.val_fraction,
            args.data_dtype,
            args.data_vocab,
            args.text_column,
            bool(args.vocab_from_data),
            list(tok),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- fingerprint and caches


def sampled_hash(path: Path, size: int) -> str:
    """sha256 of 4 KiB at the start, the end and three points between: cheap at every start for
    files of any size, and it sees a different, truncated or rewritten file."""
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        for at in sorted({0, *(size * k // 4 for k in (1, 2, 3)), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _cached_json(kind: str, key: str) -> dict | None:
    path = cache_dir() / "data" / f"{kind}-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _store_json(kind: str, key: str, value: dict) -> None:
    _atomic_write(
        cache_dir() / "data" / f"{kind}-{key}.json", lambda p: p.write_text(json.dumps(value))
    )


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:32]


def token_max(tokens: np.ndarray, stat_key: str, path: Path) -> int:
    """The largest token id in a file: one pass over it at its first use (chunked, a few GB/s),
    then cached by path, size, mtime and sampled hash, so a later start reads nothing."""
    hit = _cached_json("max", stat_key)
    if hit is not None:
        return int(hit["max_id"])
    top = 0
    for i in range(0, len(tokens), SCAN_CHUNK):
        top = max(top, int(tokens[i : i + SCAN_CHUNK].max()))
    _store_json("max", stat_key, {"max_id": top, "path": str(path)})
    return top


def content_sha(paths: list[Path]) -> str:
    """sha256 of the files' bytes end to end, remembered per path, size and mtime, so unchanged
    files are read once."""
    stats = [(p.absolute(), p.stat()) for p in paths]
    memo = _key(*[x for a, st in stats for x in (a, st.st_size, st.st_mtime_ns)])
    content = (_cached_json("sha", memo) or {}).get("sha256")
    if content is None:
        h = hashlib.sha256()
        for p in paths:
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        content = h.hexdigest()
        _store_json("sha", memo, {"sha256": content, "path": str(paths[0])})
    return content


def _cached_npy(out: Path, make: Callable[[], np.ndarray]) -> np.ndarray:
    """The array saved at `out` (made once by `make`), memory-mapped."""
    if not out.exists():
        ids = make()

        def write(p):
            with open(p, "wb") as f:
                np.save(f, ids)

        _atomic_write(out, write)
    return np.load(out, mmap_mode="r")


def _encode(docs: Iterator[bytes], tok, path: Path) -> np.ndarray:
    """Documents tokenized end to end (no separator token: as the stdlib corpus)."""
    parts, batch, size = [], [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= DOC_BATCH_BYTES:
            parts.append(tok.encode_docs(batch))
            batch, size = [], 0
    if batch:
        parts.append(tok.encode_docs(batch))
    ids = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    if len(ids) == 0:
        raise DataError(f"{path}: no text in it (0 tokens)")
    return ids


def text_tokens(path: Path, kind: str, column: str, tok) -> np.ndarray:
    """The file's documents tokenized end to end, cached as .npy by the file's content sha256
    and the tokenizer, and memory-mapped. A save_to_disk dataset ('hf') must hold text."""
    if kind == "hf":
        hf_kind, tokens, _, _ = hf_tokens(path, column, lambda: tok)
        if hf_kind != "hf-text":
            raise DataError(f"{path}: its column holds token ids, not text")
        return tokens
    col = column if kind in ("jsonl", "parquet") else ""
    content = content_sha([path])
    out = cache_dir() / "data" / f"text-{content[:24]}-{kind}-{_key(col)[:8]}-{tok.name}.npy"
    return _cached_npy(out, lambda: _encode(iter_docs(path, kind, column), tok, path))


def _id_array(parts: Iterator[np.ndarray], path: Path, column: str) -> np.ndarray:
    """Token ids end to end as uint16, or uint32 when one exceeds 65535."""
    kept, top = [np.zeros(0, np.uint32)], 0
    for a in parts:
        top = max(top, int(a.max())) if len(a) else top
        if top > np.iinfo(np.uint32).max:
            raise DataError(f"{path}: column {column!r} holds token id {top}, past uint32")
        kept.append(a.astype(np.uint32))
    ids = np.concatenate(kept)
    if len(ids) == 0:
        raise DataError(f"{path}: column {column!r} holds no token ids")
    return ids.astype(np.uint16) if top <= np.iinfo(np.uint16).max else ids


def hf_tokens(path: Path, column: str, get_tok) -> tuple[str, np.ndarray, int, object]:
    """A save_to_disk dataset's column as one token array, cached as .npy by the content of its
    .arrow files and memory-mapped: (kind, tokens, largest id, tokenizer or None). Kind 'hf-ids':
    lists of token ids as they are (uint16, or uint32 past 65535); 'hf-text': the rows tokenized
    with the run's tokenizer, as a text file's documents are."""
    ds = data_hf.load(path)
    name, shape = data_hf.pick_column(ds, path, column)
    base = f"hf-{content_sha(data_hf.saved_files(path))[:24]}-{shape}-{_key(name)[:8]}"
    if shape == "text":
        tok = get_tok()
        out = cache_dir() / "data" / f"{base}-{tok.name}.npy"
        tokens = _cached_npy(out, lambda: _encode(data_hf.iter_docs(ds, name), tok, path))
        return "hf-text", tokens, tok.vocab_size - 1, tok
    out = cache_dir() / "data" / f"{base}.npy"
    tokens = _cached_npy(out, lambda: _id_array(data_hf.iter_ids(ds, path, name), path, name))
    return "hf-ids", tokens, token_max(tokens, _key(out.name), path), None


def text_tokenizer(kind: str, vocab: int):
    """The run's tokenizer for text files: raw bytes, or the preset's BPE (trained once on the
    standard-library corpus and cached, exactly as for the built-in corpus)."""
    if kind == "bytes":
        return ByteTokenizer()
    return get_tokenizer(kind, vocab, load_corpus())


# ---------------------------------------------------------------- preparing a run's data


@dataclass
class _Source:
    path: Path
    kind: str
    tokens: np.ndarray
    max_id: int  # largest id it holds (text: the tokenizer's vocab - 1)
    declared: int | None  # the vocabulary a token file declares
    tokenizer: str | None
    size: int
    mtime_ns: int
    sample: str


def split_files(spec: DataSpec) -> tuple[list, list, str]:
    """(train [(path, kind)], val [(path, kind)], how the split was made)."""
    files = expand(spec.data)
    if spec.val_data:
        val = expand(spec.val_data)
        held = {p for p, _ in val}
        return [f for f in files if f[0] not in held], val, "the --val-data files"
    if spec.val_fraction is None and any(is_val_name(p) for p, _ in files):
        val = [f for f in files if is_val_name(f[0])]
        return [f for f in files if not is_val_name(f[0])], val, "the files named as validation"
    frac = DEFAULT_VAL_FRACTION if spec.val_fraction is None else spec.val_fraction
    return files, [], f"the last {frac:g} of the tokens"


def _open_hf(path: Path, spec: DataSpec, get_tok) -> _Source:
    """A save_to_disk split: its size, newest mtime and sampled hash are its .arrow files'."""
    kind, tokens, top, tok = hf_tokens(path, spec.text_column, get_tok)
    files = [(f, f.stat()) for f in data_hf.saved_files(path)]
    h = hashlib.sha256()
    for f, st in files:
        h.update(sampled_hash(f, st.st_size).encode())
    return _Source(
        path,
        kind,
        tokens,
        top,
        None if tok else spec.vocab,
        tok.name if tok else None,
        sum(st.st_size for _, st in files),
        max(st.st_mtime_ns for _, st in files),
        h.hexdigest(),
    )


def _open_source(path: Path, kind: str, spec: DataSpec, seq_len: int, get_tok) -> _Source:
    if kind == "hf":
        return _open_hf(path, spec, get_tok)
    st = path.stat()
    sample = sampled_hash(path, st.st_size) if st.st_size else ""
    if kind == "tokens":
        tf = open_token_file(path, spec.dtype, spec.vocab)
        if tf.count < seq_len + 1:
            raise DataError(
                f"{path}: {tf.count} tokens, shorter than one sequence (seq_len {seq_len} + 1)"
            )
        tokens = tf.open()
        top = token_max(
            tokens,
            _key(
                path.absolute(),
                st.st_size,
                st.st_mtime_ns,
                sample,
                tf.layout,
                tf.dtype.str,
                tf.offset,
            ),
            path,
        )
        return _Source(
            path, tf.layout, tokens, top, tf.vocab, tf.tokenizer, st.st_size, st.st_mtime_ns, sample
        )
    tok = get_tok()
    tokens = text_tokens(path, kind, spec.text_column, tok)
    return _Source(
        path, kind, tokens, tok.vocab_size - 1, None, tok.name, st.st_size, st.st_mtime_ns, sample
    )


def _model_vocab(cfg: ModelConfig, spec: DataSpec, sources: list[_Source]) -> ModelConfig:
    """The model's config with the vocabulary checked against the data, or (--vocab-from-data)
    following it: a declared vocab_size, else the largest id + 1."""
    for s in sources:
        if s.declared is not None and s.max_id >= s.declared:
            raise DataError(
                f"{s.path}: holds token id {s.max_id}, but its declared vocabulary "
                f"(sidecar or --data-vocab) is {s.declared}"
            )
    worst = max(sources, key=lambda s: s.max_id)
    if spec.vocab_from_data:
        vocab = max(max(s.max_id + 1, s.declared or 0) for s in sources)
        kind = "bytes" if vocab == 256 and cfg.tokenizer == "bytes" else "bpe"  # bpe = not bytes
        return dataclasses.replace(cfg, vocab_size=vocab, tokenizer=kind)
    if worst.max_id >= cfg.vocab_size:
        more = sum(s.max_id >= cfg.vocab_size for s in sources) - 1
        raise DataError(
            f"{worst.path}: token id {worst.max_id} >= the model's vocabulary "
            f"{cfg.vocab_size}{f' (and {more} more files)' if more else ''}: pass "
            f"--vocab-from-data, or a preset whose vocab_size covers the data"
        )
    return cfg


def _tokens_check(what: str, stream: TokenStream, need: int, seq_len: int, files: list) -> None:
    if len(stream) < need:
        names = ", ".join(str(p) for p, _ in files[:3]) + (" …" if len(files) > 3 else "")
        raise DataError(
            f"{names}: the {what} split holds {len(stream)} tokens, fewer than "
            f"{need} (seq_len {seq_len})"
        )


def prepare_files(
    cfg: ModelConfig, spec: DataSpec, seed: int = 0
) -> tuple[TokenDataset, ModelConfig]:
    """--data files → (TokenDataset, the model config with its vocabulary settled). Every check
    happens here, before a model exists; each problem is a DataError naming the file."""
    T = cfg.seq_len
    train_files, val_files, how = split_files(spec)
    if not train_files:
        raise DataError(f"{spec.data[0]}: no training files (all of them are validation data)")
    tok_cache: list = []

    def get_tok():
        if not tok_cache:
            tok_cache.append(text_tokenizer(*spec.text_tokenizer))
        return tok_cache[0]

    train = [_open_source(p, k, spec, T, get_tok) for p, k in train_files]
    val = [_open_source(p, k, spec, T, get_tok) for p, k in val_files]
    cfg = _model_vocab(cfg, spec, train + val)
    names = [str(s.path) for s in train]
    stream = TokenStream([s.tokens for s in train], names)
    if val:
        train_stream, val_stream = (
            stream,
            TokenStream([s.tokens for s in val], [str(s.path) for s in val]),
        )
    else:
        frac = DEFAULT_VAL_FRACTION if spec.val_fraction is None else spec.val_fraction
        cut = len(stream) - int(round(frac * len(stream)))
        train_stream, val_stream = stream.view(0, cut), stream.view(cut, len(stream))
    _tokens_check("training", train_stream, 2 * T + 2, T, train_files)
    _tokens_check("validation", val_stream, T + 1, T, val_files or train_files)
    meta = _meta(
        spec,
        train,
        val,
        how,
        cfg,
        train_stream,
        val_stream,
        seed,
        tok_cache[0] if tok_cache else None,
    )
    return TokenDataset(
        train_stream, val_stream, T, seed, meta, tok_cache[0] if tok_cache else None
    ), cfg


def _meta(spec, train, val, how, cfg, train_stream, val_stream, seed, tok) -> dict:
    """What the run config records under `data` (and Compare's config diff shows)."""
    every = train + val
    root = os.path.commonpath([str(s.path.parent) for s in every])
    h = hashlib.sha256()
    for role, group in (("train", train), ("val", val)):
        for s in group:
            h.update(json.dumps([role, os.path.relpath(s.path, root), s.size, s.sample]).encode())
    kinds: dict[str, int] = {}
    for s in every:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    newest = max(s.mtime_ns for s in every) / 1e9
    tokenizers = sorted({s.tokenizer for s in every if s.tokenizer})
    return {
        "source": "files",
        "spec": spec.to_dict(),
        "root": root,
        "files": {"train": len(train), "val": len(val)},
        "formats": kinds,
        "bytes": sum(s.size for s in every),
        "fingerprint": h.hexdigest()[:32],
        "newest_mtime": datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "tokenizer": "+".join(tokenizers) or "unknown (token files)",
        "tokenizer_vocab": tok.vocab_size if tok else None,
        "max_token_id": max(s.max_id for s in every),
        "vocab_size": cfg.vocab_size,
        "train_tokens": len(train_stream),
        "val_tokens": len(val_stream),
        "val_split": how,
        "windows": "span file boundaries",
        "data_seed": seed,
    }


def prepare_for_run(
    cfg: ModelConfig, args, recorded: dict | None = None
) -> tuple[TokenDataset, ModelConfig]:
    """The Trainer's data: --data files, or on a resume without --data the files the run
    recorded, else the standard-library corpus. A resumed run's data must be the data it
    started with (same fingerprint and token counts), or its sample ids would name other
    windows: that is a DataError."""
    spec = None
    if getattr(args, "data", None):
        spec = DataSpec.from_args(args, cfg, (recorded or {}).get("spec"))
    elif recorded and recorded.get("spec"):
        spec = DataSpec(**recorded["spec"])
    if spec is None:
        return prepare(cfg, seed=args.seed), cfg
    ds, cfg = prepare_files(cfg, spec, args.seed)
    if recorded is not None:
        keys = ("fingerprint", "train_tokens", "val_tokens")
        then, now = [recorded.get(k) for k in keys], [ds.meta[k] for k in keys]
        if then != now:
            raise DataError(
                f"{spec.data[0]}: not the data this run started with (fingerprint, "
                f"train, val tokens {then} then, {now} now): its sample ids would "
                f"name other windows; resume with the original files"
            )
    return ds, cfg
