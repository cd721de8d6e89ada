"""trainer/data_hf.py and its hooks in data_formats.py and data_files.py: Hugging Face `datasets`
directories written by save_to_disk as --data. Real Dataset / DatasetDict objects made here: a
column of token-id lists gives its ids, a text column is tokenized with the run's tokenizer (and
cached by content), a DatasetDict gives its train split and holds out its validation split,
windows keep their sample ids across a split's and a shard's boundary, and every bad case (no
`datasets` package, a missing column, an empty dataset, an id past the vocabulary) is one line
naming the directory. The training run through the CLI is test_data_runs.py's, with every
other format."""

from __future__ import annotations

import json
import re
import shutil
import sys
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from rampwatch.trainer import data_hf
from rampwatch.trainer.data_files import prepare_files
from rampwatch.trainer.data_formats import DataError, expand
from tests.test_data_files import (
    SHORT,
    TINY,
    _train,
    as_bytes,
    everything,
    llmc,
    refused,
    spec,
)

needs_datasets = pytest.mark.skipif(find_spec("datasets") is None, reason="datasets not installed")
rng = np.random.default_rng(2)


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAMPWATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # load() sets it; restored after the test


def saved(path, **columns):
    """A Dataset of these columns, saved with save_to_disk at `path`."""
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


def saved_dict(path, **splits):
    """A DatasetDict of {split: {column: values}}, saved with save_to_disk at `path`."""
    import datasets

    dd = datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()})
    dd.save_to_disk(str(path))
    return path


def id_rows(n_rows, high=256):
    return [rng.integers(0, high, rng.integers(5, 40)).tolist() for _ in range(n_rows)]


@needs_datasets
def test_token_ids_and_text_give_their_tokens_and_sample_ids(tmp_path):
    rows = id_rows(30)
    docs = [f"document {i}: ünïcode and words " * (i % 3 + 1) for i in range(20)]
    ids_ds = saved(tmp_path / "ids", input_ids=rows, n=list(range(30)))
    text_ds = saved(tmp_path / "text", text=docs[:10] + [None] + docs[10:], n=list(range(21)))
    shard = llmc(tmp_path / "c.bin", rng.integers(0, 256, 200))
    ds, cfg = prepare_files(TINY, spec(ids_ds, shard, text_ds, val_fraction=0.1))
    want = np.concatenate([np.concatenate(rows), np.fromfile(shard, np.uint16)[512:]])
    want = np.concatenate([want, as_bytes("".join(docs))])
    assert np.array_equal(np.concatenate([everything(ds.train), everything(ds.val)]), want)
    m = ds.meta
    assert cfg == TINY and m["formats"] == {"hf-ids": 1, "llmc": 1, "hf-text": 1}
    assert m["files"] == {"train": 3, "val": 0} and m["max_token_id"] == 255
    assert m["tokenizer"] == "bytes" and m["val_split"] == "the last 0.1 of the tokens"
    # a sample is its window, across the dataset's and the shard's boundaries
    T, crossing = TINY.seq_len, 0
    x, y, sample_ids = ds.batch(0, ds.epoch_samples)
    for row, start in enumerate(ds.starts(sample_ids.numpy())):
        w = torch.from_numpy(want[start : start + T + 1].astype(np.int64))
        assert torch.equal(x[row], w[:-1]) and torch.equal(y[row], w[1:])
        crossing += bool(
            ((ds.train.bounds[1:-1] > start) & (ds.train.bounds[1:-1] < start + T + 1)).any()
        )
    assert crossing >= 2, "fewer than two windows crossed a boundary"


@needs_datasets
def test_wide_ids_and_the_column_choice(tmp_path):
    big = [[1, 70000, 3] * 30, [65536] * 40]
    wide = saved(tmp_path / "big", input_ids=big)
    ds, cfg = prepare_files(SHORT, spec(wide, vocab_from_data=True, val_fraction=0.5))
    assert cfg.vocab_size == 70001 and ds.meta["max_token_id"] == 70000
    assert np.array_equal(everything(ds.train), np.concatenate(big)[:65])
    assert [a.dtype for a in ds.train.pieces] == [np.uint32]  # uint16 unless an id needs more
    # text and ids side by side: --text-column (default text) first, input_ids when it is absent
    both = saved(tmp_path / "both", text=["some text " * 20], input_ids=[[7] * 200])
    as_text, _ = prepare_files(SHORT, spec(both, val_fraction=0.3))
    assert as_text.meta["formats"] == {"hf-text": 1}
    as_ids, _ = prepare_files(SHORT, spec(both, val_fraction=0.3, text_column="input_ids"))
    assert as_ids.meta["formats"] == {"hf-ids": 1} and set(everything(as_ids.train)) == {7}
    tokens = saved(tmp_path / "tokens", tokens=[[5] * 300])
    named, _ = prepare_files(SHORT, spec(tokens, val_fraction=0.3, text_column="tokens"))
    assert named.meta["formats"] == {"hf-ids": 1}
    assert [a.dtype for a in named.train.pieces] == [np.uint16]


@needs_datasets
def test_dataset_dict_trains_on_train_and_holds_out_validation(tmp_path):
    train, val, test = id_rows(20), id_rows(8), id_rows(8)
    dd = saved_dict(
        tmp_path / "dd",
        train={"input_ids": train},
        validation={"input_ids": val},
        test={"input_ids": test},
    )
    assert [(p.name, k) for p, k in expand([str(dd)])] == [("train", "hf"), ("validation", "hf")]
    ds, _ = prepare_files(SHORT, spec(dd))
    assert np.array_equal(everything(ds.train), np.concatenate(train))
    assert np.array_equal(everything(ds.val), np.concatenate(val))
    assert ds.meta["val_split"] == "the files named as validation"
    assert ds.meta["files"] == {"train": 1, "val": 1}
    # one split chosen by its directory; --val-data another
    chosen, _ = prepare_files(SHORT, spec(dd / "test", val_data=[str(dd / "validation")]))
    assert np.array_equal(everything(chosen.train), np.concatenate(test))
    assert chosen.meta["val_split"] == "the --val-data files"
    # --val-fraction: names are ignored, as for val.bin (the validation split is in the stream)
    frac, _ = prepare_files(SHORT, spec(dd, val_fraction=0.2))
    whole = np.concatenate(train + val)
    assert np.array_equal(np.concatenate([everything(frac.train), everything(frac.val)]), whole)


@needs_datasets
def test_cached_by_content(tmp_path, monkeypatch):
    rows = id_rows(20)
    docs = ["cached text " * 30, "more of it " * 20]
    first, _ = prepare_files(
        SHORT,
        spec(
            saved(tmp_path / "a", input_ids=rows),
            saved(tmp_path / "b", text=docs),
            val_fraction=0.2,
        ),
    )

    def boom(*a, **k):
        raise AssertionError("read again")

    with monkeypatch.context() as m:
        m.setattr(data_hf, "iter_ids", boom)
        m.setattr(data_hf, "iter_docs", boom)
        again, _ = prepare_files(SHORT, spec(tmp_path / "a", tmp_path / "b", val_fraction=0.2))
        assert again.meta == first.meta
        saved(tmp_path / "copy", text=docs)  # another directory, the same content: same tokens
        prepare_files(SHORT, spec(tmp_path / "copy", val_fraction=0.2))
    # the same directory saved again with other rows: another fingerprint, other tokens
    shutil.rmtree(tmp_path / "a")
    saved(tmp_path / "a", input_ids=rows[::-1])
    changed, _ = prepare_files(SHORT, spec(tmp_path / "a", tmp_path / "b", val_fraction=0.2))
    assert changed.meta["fingerprint"] != first.meta["fingerprint"]
    assert changed.meta["train_tokens"] == first.meta["train_tokens"]


# name: (the dataset's columns, extra spec fields, the message after its path)
BAD = {
    "nocol": (
        {"content": ["x" * 500], "n": [1]},
        {},
        r"no column 'text' or 'input_ids' \(has: content, n\)",
    ),
    "empty": ({"text": []}, {}, r"an empty dataset \(0 rows\)"),
    "filtered": ({"text": ["a"]}, {}, r"an empty dataset \(0 rows\)"),  # 0 rows after a filter
    "blank": ({"input_ids": [[], None]}, {}, r"column 'input_ids' holds no token ids"),
    "big": ({"input_ids": [[300] * 400]}, {}, r"token id 300 >= the model's vocabulary 256"),
    "declared": (
        {"input_ids": [[299] * 400]},
        {"vocab": 200},
        r"holds token id 299, but its declared vocabulary .* is 200",
    ),
    "negative": (
        {"input_ids": [[1, 2, -100] * 200]},
        {},
        r"column 'input_ids' holds token id -100",
    ),
    "nested": (
        {"input_ids": [[[1, 2]] * 300]},
        {},
        r"column 'input_ids' is list<item: list<item: int\d+>>, neither text",
    ),
    "floats": ({"text": [1.5] * 300}, {}, r"column 'text' is double, neither text"),
    "notrain": (
        {"text": ["a" * 300]},
        {},
        r"a DatasetDict without a 'train' split \(has: test\)",
    ),
}


def _bad(tmp_path, name: str):
    """(directory, extra spec fields, message) for each bad case."""
    import datasets
    import pyarrow as pa

    p = tmp_path / name
    columns, extra, message = BAD[name]
    if name == "notrain":
        saved_dict(p, test=columns)
    elif name == "filtered":
        datasets.Dataset.from_dict(columns).filter(lambda r: False).save_to_disk(str(p))
    elif name == "blank":  # from_dict cannot infer the type of lists without ids: given here
        schema = datasets.Features.from_arrow_schema(
            pa.schema([("input_ids", pa.list_(pa.int32()))])
        )
        datasets.Dataset.from_dict(columns, features=schema).save_to_disk(str(p))
    else:
        saved(p, **columns)
    return p, extra, f"{name}: {message}"


@needs_datasets
@pytest.mark.parametrize("name", BAD)
def test_bad_datasets_name_the_directory_and_the_problem(tmp_path, name):
    refused(*_bad(tmp_path, name))


def test_without_the_datasets_package_the_directory_says_how_to_get_it(
    tmp_path, monkeypatch, capsys
):
    """Made by hand (save_to_disk's index files), so this runs where datasets is not installed."""
    d = tmp_path / "saved"
    d.mkdir()
    (d / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (d / "dataset_info.json").write_text(json.dumps({"features": {}}))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets → ImportError
    want = r"saved: a Hugging Face datasets directory .*: pip install 'rampwatch\[datasets\]'"
    with pytest.raises(DataError, match=want):
        prepare_files(TINY, spec(d))
    with pytest.raises(DataError, match=want):
        data_hf.load(d)
    with pytest.raises(SystemExit) as caught:  # the command line: one line, exit 2, no run
        _train(tmp_path, "--data", str(d))
    err = capsys.readouterr().err
    assert caught.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(want, err)
    assert not (tmp_path / "r.duckdb").exists()


@needs_datasets
def test_make_shards_reads_a_text_dataset(tmp_path, capsys):
    docs = [f"document {i}: " + "words and more words " * (i % 7 + 1) for i in range(60)]
    dd = saved_dict(tmp_path / "dd", train={"text": docs[:50]}, validation={"text": docs[50:]})
    out = tmp_path / "shards"
    assert (
        _train(tmp_path, "--make-shards", str(out), "--shard-tokens", "1000", "--data", str(dd))
        == 0
    )
    from_text, _ = prepare_files(TINY, spec(dd))
    from_shards, _ = prepare_files(TINY, spec(out))
    assert np.array_equal(everything(from_shards.train), everything(from_text.train))
    assert np.array_equal(everything(from_shards.val), as_bytes("".join(docs[50:])))
    ids = saved(tmp_path / "ids", input_ids=id_rows(20))
    with pytest.raises(SystemExit):
        _train(tmp_path, "--make-shards", str(tmp_path / "s2"), "--data", str(ids))
    assert "holds token ids, not text" in capsys.readouterr().err
