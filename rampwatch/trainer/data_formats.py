"""The files `rampwatch train --data` reads, one at a time: which paths a `--data` argument names
(a file, a directory or a glob), what format each file is, token files opened memory-mapped with
every check of their layout, and the documents of text files. Owns DataError: every problem
with a file is one line that names it. Standard library and numpy only (pyarrow when a Parquet
file is read), so the command line can check paths before torch is imported.

Token files: a flat array of uint16/uint32 token ids (nanoGPT's train.bin; its dtype from
--data-dtype or a JSON sidecar), the llm.c / modded-nanogpt shard (a header of 256 int32, then
the tokens), or a 1-D .npy array. Text files: plain text (one file = one document), JSON Lines
(one object per line, its --text-column field = one document) and Parquet (one row = one
document). The llm.c layouts are llm.c's own (dev/data/data_common.py HEADERS_INFO): magic
20240520 version 1 = uint16 (GPT-2), magic 20240801 version 7 = uint32 (LLaMA-3); no other
magic or version is known to exist, so any other is refused rather than guessed. A Hugging Face
`datasets` directory (Dataset.save_to_disk / DatasetDict.save_to_disk) is known by its index
files; data_hf reads it, with the optional `datasets` package.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

LLMC_HEADER_BYTES = 256 * 4
LLMC_LAYOUTS = {
    20240520: (1, np.dtype(np.uint16), "GPT-2"),  # magic: version, dtype, name
    20240801: (7, np.dtype(np.uint32), "LLaMA-3"),
}
LLMC_EVAL_MAGIC = 20240522  # llm.c's HellaSwag/MMLU eval files: not a token stream
DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}

TOKEN_SUFFIXES = {".bin", ".npy"}
TEXT_SUFFIXES = {
    ".txt": "text",
    ".md": "text",
    ".text": "text",
    ".rst": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
SIDECAR = "meta.json"  # beside raw token files: applies to every one in that directory
# A file named like "val.bin", "fineweb_val_000000.bin" or "validation.jsonl" is validation data
# when --val-data and --val-fraction are not given (llm.c's and nanoGPT's naming).
VAL_NAME = re.compile(r"(^|[^a-z0-9])val(id|idation)?([^a-z0-9]|$)", re.IGNORECASE)
# What Dataset.save_to_disk writes beside its .arrow files, and DatasetDict.save_to_disk beside
# one such directory per split ({"splits": ["train", "validation", ...]}).
HF_DATASET = ("state.json", "dataset_info.json")
HF_DICT = "dataset_dict.json"
HF_TRAIN = "train"


class DataError(ValueError):
    """A problem with the data: one line, naming the file (the CLI prints it and exits 2)."""


def kind_of(path: Path, named: bool) -> str | None:
    """'tokens', 'text', 'jsonl' or 'parquet' ('hf' is a directory: hf_splits). A file named
    explicitly is always read (an unknown suffix as plain text, .json as JSON Lines); in a
    directory only known suffixes are, so a directory's sidecars and scripts are not read as
    text."""
    suffix = path.suffix.lower()
    if suffix in TOKEN_SUFFIXES or Path(f"{path}.json").is_file():
        return "tokens"
    if suffix in TEXT_SUFFIXES:
        return TEXT_SUFFIXES[suffix]
    if not named:
        return None
    return "jsonl" if suffix == ".json" else "text"


def _scan_dir(root: Path) -> list[tuple[Path, str]]:
    """A directory's token files if it has any (recursively, sorted by relative path), else its
    text files: nanoGPT's data directories hold input.txt beside train.bin and val.bin."""
    found = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for n in names:
            p = Path(d, n)
            kind = None if n.startswith(".") or n == SIDECAR else kind_of(p, named=False)
            if kind:
                found.append((p, kind))
    found.sort(key=lambda pk: pk[0].relative_to(root).as_posix())
    tokens = [pk for pk in found if pk[1] == "tokens"]
    return tokens or found


def datasets_installed() -> bool:
    if "datasets" in sys.modules:
        return sys.modules["datasets"] is not None
    return importlib.util.find_spec("datasets") is not None


def hf_splits(root: Path) -> list[Path] | None:
    """The Dataset directories of a Hugging Face save_to_disk directory: the directory itself (a
    Dataset, or one split of a DatasetDict), or a DatasetDict's train split and its validation
    split (named as validation, so held out as val.bin is; other splits such as test are not
    read). None for any other directory. Only the index files are read here."""
    index = root / HF_DICT
    if index.is_file():
        try:
            splits = [str(s) for s in json.loads(index.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{index}: not a readable DatasetDict index ({e!r})") from None
        if HF_TRAIN not in splits:
            raise DataError(
                f"{root}: a DatasetDict without a {HF_TRAIN!r} split (has: "
                f"{', '.join(splits) or 'none'}); pass one split's directory instead, e.g. "
                f"{root / (splits or ['NAME'])[0]}"
            )
        chosen = [root / s for s in splits if s == HF_TRAIN or VAL_NAME.search(s)]
    elif all((root / n).is_file() for n in HF_DATASET):
        chosen = [root]
    else:
        return None
    for d in chosen:
        if not all((d / n).is_file() for n in HF_DATASET):
            raise DataError(f"{d}: a split listed in {index} but not a saved Dataset directory")
    if not datasets_installed():
        raise no_datasets(root)
    return chosen


def no_datasets(path: Path) -> DataError:
    return DataError(
        f"{path}: a Hugging Face datasets directory (save_to_disk); reading it needs the "
        f"datasets package: pip install 'rampwatch[datasets]'"
    )


def expand(patterns: list[str]) -> list[tuple[Path, str]]:
    """(path, kind) of every file the --data arguments name, in the order given (a directory or
    glob sorted), each file once. DataError for an argument that names nothing."""
    out: dict[Path, str] = {}
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            hf = hf_splits(p)
            files = [(d, "hf") for d in hf] if hf is not None else _scan_dir(p)
            if not files:
                raise DataError(
                    f"{pattern}: a directory without token files (.bin, .npy), text files "
                    f"({', '.join(sorted(TEXT_SUFFIXES))}) or a Hugging Face save_to_disk "
                    f"dataset"
                )
        elif p.is_file():
            files = [(p, kind_of(p, named=True))]
        elif glob.has_magic(pattern):
            matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(pattern)))
            files = [(m, kind_of(m, named=True)) for m in matches if m.is_file()]
            if not files:
                raise DataError(f"{pattern}: no file matches")
        else:
            raise DataError(f"{pattern}: no such file or directory")
        for path, kind in files:
            out.setdefault(path.absolute(), kind)
    return list(out.items())


def is_val_name(path: Path) -> bool:
    return bool(VAL_NAME.search(path.name))


# ---------------------------------------------------------------- token files


@dataclass(frozen=True)
class TokenFile:
    path: Path
    layout: str  # 'raw' | 'llmc' | 'npy'
    dtype: np.dtype
    offset: int  # bytes before the first token
    count: int  # tokens
    vocab: int | None  # the vocabulary it declares (sidecar or --data-vocab), if any
    tokenizer: str | None  # the sidecar's tokenizer name, if any

    def open(self) -> np.ndarray:
        """The tokens, memory-mapped read-only: nothing is read until a window is taken."""
        return np.memmap(
            self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,)
        )


def sidecar(path: Path) -> dict:
    """FILE.json beside the file, else meta.json in its directory, else {}: e.g.
    {"dtype": "uint16", "vocab_size": 50257, "tokenizer": "gpt2"}."""
    for side in (Path(f"{path}.json"), path.parent / SIDECAR):
        if side.is_file():
            try:
                meta = json.loads(side.read_text())
            except (OSError, ValueError) as e:
                raise DataError(f"{side}: not a readable JSON sidecar ({e})") from None
            if not isinstance(meta, dict):
                raise DataError(f"{side}: a sidecar must be a JSON object")
            return {**meta, "_path": str(side)}
    return {}


def _declared(path: Path, side: dict, dtype_flag: str | None, vocab_flag: int | None):
    """(dtype or None, vocab or None, tokenizer or None) from the flags and the sidecar; a flag
    that contradicts the sidecar is an error, not a silent choice."""
    dtype = side.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise DataError(f"{side['_path']}: dtype {dtype!r}: expected uint16 or uint32")
    if dtype_flag and dtype and dtype_flag != dtype:
        raise DataError(f"{path}: --data-dtype {dtype_flag} but {side['_path']} says {dtype}")
    vocab = side.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or vocab <= 0):
        raise DataError(f"{side['_path']}: vocab_size {vocab!r}: expected a positive integer")
    if vocab_flag and vocab and vocab_flag != vocab:
        raise DataError(f"{path}: --data-vocab {vocab_flag} but {side['_path']} says {vocab}")
    return (dtype_flag or dtype), (vocab_flag or vocab), side.get("tokenizer")


def open_token_file(
    path: Path, dtype_flag: str | None = None, vocab_flag: int | None = None
) -> TokenFile:
    """Reads the header (llm.c), the .npy header or the sidecar and checks the file's length
    against it; the tokens themselves stay on disk."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: empty file")
    side = sidecar(path)
    dtype, vocab, tokenizer = _declared(path, side, dtype_flag, vocab_flag)
    if path.suffix.lower() == ".npy":
        return _open_npy(path, dtype, vocab, tokenizer)
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_BYTES)
    magic, version, count = (
        np.frombuffer(head[:12], "<i4").tolist() if len(head) >= 12 else (None, None, None)
    )
    if magic in LLMC_LAYOUTS:
        want_version, ldtype, name = LLMC_LAYOUTS[magic]
        if version != want_version:
            raise DataError(
                f"{path}: llm.c header magic {magic} with version {version}: only "
                f"version {want_version} ({name}, {ldtype.name} tokens) is known"
            )
        if dtype and DTYPES[dtype] != ldtype:
            raise DataError(
                f"{path}: an llm.c {name} shard holds {ldtype.name} tokens, not "
                f"{dtype} as --data-dtype or its sidecar says"
            )
        body = size - LLMC_HEADER_BYTES
        if count <= 0 or body != count * ldtype.itemsize:
            raise DataError(
                f"{path}: llm.c header says {count} tokens ({count * ldtype.itemsize} "
                f"bytes) but {max(body, 0)} bytes follow it: a truncated or "
                f"damaged shard"
            )
        return TokenFile(path, "llmc", ldtype, LLMC_HEADER_BYTES, count, vocab, tokenizer)
    if magic == LLMC_EVAL_MAGIC:
        raise DataError(
            f"{path}: an llm.c eval file (magic {magic}: HellaSwag/MMLU examples), "
            f"not training tokens"
        )
    if dtype is None:
        raise DataError(
            f"{path}: not an llm.c shard (magic {magic}, expected "
            f"{' or '.join(map(str, LLMC_LAYOUTS))}) and no dtype for raw tokens: "
            f'pass --data-dtype uint16|uint32 or write {{"dtype": "uint16"}} '
            f"into {path.name}.json or {SIDECAR} beside it"
        )
    dt = DTYPES[dtype]
    if size % dt.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype} tokens "
            f"({dt.itemsize} bytes each): wrong dtype, or a truncated file"
        )
    return TokenFile(path, "raw", dt, 0, size // dt.itemsize, vocab, tokenizer)


def _open_npy(path: Path, dtype: str | None, vocab, tokenizer) -> TokenFile:
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})") from None
    if arr.ndim != 1 or arr.dtype not in (*DTYPES.values(), np.dtype(np.uint8)):
        raise DataError(
            f"{path}: a .npy of token ids must be 1-D uint8/uint16/uint32, got "
            f"{arr.ndim}-D {arr.dtype}"
        )
    if dtype and DTYPES[dtype] != arr.dtype:
        raise DataError(f"{path}: the array holds {arr.dtype}, not {dtype}")
    if len(arr) == 0:
        raise DataError(f"{path}: no tokens")
    return TokenFile(path, "npy", arr.dtype, int(arr.offset), len(arr), vocab, tokenizer)


# ---------------------------------------------------------------- text files


def iter_docs(path: Path, kind: str, column: str = "text") -> Iterator[bytes]:
    """The file's documents as UTF-8 bytes, in file order."""
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    if kind == "text":
        yield path.read_bytes()
    elif kind == "jsonl":
        yield from _jsonl_docs(path, column)
    elif kind == "parquet":
        yield from _parquet_docs(path, column)
    else:
        raise DataError(f"{path}: {kind} is not a text format")


def _jsonl_docs(path: Path, column: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(obj, dict) or column not in obj:
                fields = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(
                    f"{path}:{n}: no {column!r} field (has: {fields}); name the "
                    f"text field with --text-column"
                )
            value = obj[column]
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(f"{path}:{n}: {column!r} is {type(value).__name__}, not text")
            yield value.encode("utf-8", errors="replace")


def _parquet_docs(path: Path, column: str) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(
            f"{path}: no column {column!r} (has: {', '.join(names)}); name the "
            f"text column with --text-column"
        )
    field = pf.schema_arrow.field(column)
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise DataError(f"{path}: column {column!r} is {field.type}, not text")
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value.encode("utf-8", errors="replace")
