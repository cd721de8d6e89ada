"""`rampwatch train --data …` as real processes: every format (llm.c shards, raw tokens with a
sidecar, .npy, plain text, JSONL, Parquet) trains the test-tiny preset end to end and the run
config records the data; a run stopped mid-shard and resumed without --data continues with the
same sample ids and the same losses as a run that never stopped."""

from __future__ import annotations

import json
from importlib.util import find_spec

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rampwatch.store import names as M
from rampwatch.store import reader
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data_files import DataSpec, prepare_files
from tests.test_data_files import llmc
from tests.test_data_hf_datasets import id_rows, saved, saved_dict
from tests.test_trainer import assert_continuous_samples
from tests.trainer_runs import metric, run_trainer

pytestmark = pytest.mark.slow
rng = np.random.default_rng(1)


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    """The children's token caches (they inherit the environment) stay in the test's tmp_path."""
    monkeypatch.setenv("RAMPWATCH_CACHE", str(tmp_path / "cache"))


def shards(root, n=4, tokens=700):
    """n llm.c train shards and one val shard of byte-range ids (test-tiny's vocabulary)."""
    root.mkdir()
    for i in range(n):
        llmc(root / f"fineweb_train_{i:06d}.bin", rng.integers(0, 256, tokens))
    llmc(root / "fineweb_val_000000.bin", rng.integers(0, 256, 400))
    return root


def test_every_format_trains_through_the_cli(tmp_path):
    data = shards(tmp_path / "shards", n=2)
    rng.integers(0, 256, 500).astype(np.uint16).tofile(tmp_path / "raw.bin")
    (tmp_path / "raw.bin.json").write_text(json.dumps({"dtype": "uint16"}))
    np.save(tmp_path / "arr.npy", rng.integers(0, 256, 300).astype(np.uint32))
    (tmp_path / "a.txt").write_text("A plain text document about nothing much. " * 20)
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": f"line {i} of JSON text"}) for i in range(50))
    )
    pq.write_table(
        pa.table({"text": [f"row {i} of a Parquet table" for i in range(50)]}),
        tmp_path / "c.parquet",
    )
    db = tmp_path / "runs.duckdb"
    files = [
        data,
        tmp_path / "raw.bin",
        tmp_path / "arr.npy",
        tmp_path / "a.txt",
        tmp_path / "b.jsonl",
        tmp_path / "c.parquet",
    ]
    formats = {"llmc": 3, "raw": 1, "npy": 1, "text": 1, "jsonl": 1, "parquet": 1}
    if find_spec("datasets") is not None:  # the optional extra (requirements-dev installs it)
        docs = [f"row {i} of a saved dataset, long enough to matter. " * 3 for i in range(60)]
        train, validation = {"text": docs[:50]}, {"text": docs[50:]}
        files.append(saved_dict(tmp_path / "dd", train=train, validation=validation))
        files.append(saved(tmp_path / "ids", input_ids=id_rows(40)))
        formats.update({"hf-text": 2, "hf-ids": 1})
    done = run_trainer(
        db,
        tmp_path / "ckpt",
        "--run-id",
        "f",
        "--steps",
        "4",
        "--no-plan",
        *[a for f in files for a in ("--data", str(f))],
    )
    assert done.returncode == 0, done.stdout
    run = reader.get_run(db, "f")
    assert run.status == "finished" and run.last_step == 4
    d = run.config["data"]
    assert d["formats"] == formats
    n_val = 1 + (formats.get("hf-text", 0) > 0)  # the shards' val file, the dataset's split
    assert d["val_split"] == "the files named as validation" and d["files"]["val"] == n_val
    assert d["vocab_size"] == run.config["model"]["vocab_size"] == 256
    assert len(d["fingerprint"]) == 32 and d["spec"]["data"][0] == str(data)
    assert_continuous_samples(db, "f")
    assert all(np.isfinite(list(metric(db, "f", M.LOSS).values())))


def test_resume_mid_shard_continues_the_same_samples(tmp_path):
    data = shards(tmp_path / "shards")
    db, ck = tmp_path / "runs.duckdb", tmp_path / "ckpt"
    common = ("--no-plan", "--checkpoint-every", "0")
    whole = run_trainer(db, ck, "--run-id", "whole", "--steps", "6", "--data", str(data), *common)
    assert whole.returncode == 0, whole.stdout
    first = run_trainer(db, ck, "--run-id", "r", "--steps", "3", "--data", str(data), *common)
    assert first.returncode == 0, first.stdout
    stopped = ckpt.load(ckpt.checkpoint_path(ck, "r"))["state"]
    assert stopped.step == 3 and stopped.next_sample == 3 * 16
    # that position is inside a shard: its window starts past the shard's first token
    ds, _ = prepare_files(PRESETS["test-tiny"], DataSpec([str(data)]))
    start = int(ds.starts(np.array([stopped.next_sample]))[0])
    assert start > ds.train.bounds[ds.train.piece_at(start)]
    # no --data: the run's recorded files, checked against their fingerprint
    resumed = run_trainer(db, ck, "--resume", "r", "--steps", "6", *common)
    assert resumed.returncode == 0, resumed.stdout
    assert_continuous_samples(db, "r")
    assert metric(db, "r", M.FIRST_SAMPLE) == metric(db, "whole", M.FIRST_SAMPLE)
    a, b = metric(db, "r", M.LOSS), metric(db, "whole", M.LOSS)
    assert sorted(a) == list(range(1, 7))
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    assert reader.get_run(db, "r").config["data"] == reader.get_run(db, "whole").config["data"]
