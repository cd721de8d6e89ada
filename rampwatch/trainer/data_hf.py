"""Hugging Face `datasets` directories for `--data`: what Dataset.save_to_disk writes (state.json,
dataset_info.json and .arrow files), one directory per split of a DatasetDict
(data_formats.hf_splits picks the splits). Loaded with load_from_disk, which memory-maps the
.arrow files and reads nothing from the network (HF_DATASETS_OFFLINE is set before the import
all the same). One column is read: --text-column (default `text`) if the dataset has it, else
`input_ids`; a string column is text (its rows are documents, tokenized like the other text
formats), a column of integer lists is token ids, used as they are. Needs the optional
`datasets` package: pip install 'rampwatch[datasets]'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from rampwatch.trainer.data_formats import HF_DATASET, DataError, no_datasets

ID_COLUMN = "input_ids"
BATCH_ROWS = 4096


def saved_files(path: Path) -> list[Path]:
    """The dataset's .arrow files in order, from its state.json (none when it has no rows)."""
    state = path / HF_DATASET[0]
    try:
        return [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a readable save_to_disk state ({e!r})") from None


def load(path: Path):
    """The saved Dataset at `path` (one split's directory), with at least one row."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise no_datasets(path) from None
    if not saved_files(path):  # load_from_disk fails on these itself
        raise DataError(f"{path}: an empty dataset (0 rows)")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # any failure of the reader: one line, naming the directory
        first = str(e).strip().splitlines()[:1]
        raise DataError(
            f"{path}: not a readable save_to_disk directory ({type(e).__name__}"
            f"{': ' + first[0] if first else ''})"
        ) from None
    if ds.num_rows == 0:
        raise DataError(f"{path}: an empty dataset (0 rows)")
    return ds


def pick_column(ds, path: Path, column: str) -> tuple[str, str]:
    """(column, 'text' or 'ids'): --text-column if the dataset has it, else input_ids."""
    import pyarrow as pa

    names = ds.column_names
    name = column if column in names else ID_COLUMN if ID_COLUMN in names else None
    if name is None:
        raise DataError(
            f"{path}: no column {column!r} or {ID_COLUMN!r} (has: {', '.join(names)}); "
            f"name the text or token-id column with --text-column"
        )
    t = ds.data.schema.field(name).type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return name, "text"
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(is_list(t) for is_list in lists) and pa.types.is_integer(t.value_type):
        return name, "ids"
    raise DataError(f"{path}: column {name!r} is {t}, neither text nor lists of token ids")


def _chunks(ds, name: str):
    for batch in ds.with_format("arrow", columns=[name]).iter(batch_size=BATCH_ROWS):
        yield from batch.column(0).chunks


def iter_docs(ds, name: str) -> Iterator[bytes]:
    """The text column's rows as UTF-8 bytes, in order (missing values skipped)."""
    for chunk in _chunks(ds, name):
        for value in chunk.to_pylist():
            if value is not None:
                yield value.encode("utf-8", errors="replace")


def iter_ids(ds, path: Path, name: str) -> Iterator[np.ndarray]:
    """The token-id column's lists end to end, a batch of rows at a time (missing rows
    skipped; a missing or negative id inside a list is an error)."""
    import pyarrow.compute as pc

    for chunk in _chunks(ds, name):
        values = pc.list_flatten(chunk)
        if values.null_count:
            raise DataError(f"{path}: column {name!r} has a missing (null) token id in a list")
        ids = values.to_numpy(zero_copy_only=False)
        if len(ids) and ids.min() < 0:
            raise DataError(
                f"{path}: column {name!r} holds token id {ids.min()}; token ids are never "
                f"negative (a labels column?)"
            )
        yield ids
