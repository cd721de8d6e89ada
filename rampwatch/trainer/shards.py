"""`rampwatch train --make-shards OUT_DIR --data TEXT… [--preset P]`: text files → token shards.

Shards are in the llm.c layout (a 256 x int32 header: magic 20240520, version 1, token count;
then uint16 tokens; magic 20240801 version 7 and uint32 when the vocabulary exceeds 65,536),
named train_000000.bin … and val_000000.bin …, with a meta.json sidecar (vocab_size, tokenizer,
dtype). The text goes through the same tokenizer, token cache and validation split as training on
it directly would, so `--data OUT_DIR` trains on exactly the same train and validation tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from rampwatch.trainer.config import PRESETS
from rampwatch.trainer.data_files import (
    DEFAULT_VAL_FRACTION,
    DataSpec,
    split_files,
    text_tokenizer,
    text_tokens,
)
from rampwatch.trainer.data_formats import LLMC_LAYOUTS, DataError
from rampwatch.trainer.token_stream import TokenStream

WRITE_CHUNK = 1 << 24  # tokens per write: bounded memory for shards of any size


def _layout(vocab: int) -> tuple[int, int, np.dtype]:
    for magic, (version, dtype, _name) in LLMC_LAYOUTS.items():
        if vocab <= np.iinfo(dtype).max + 1:
            return magic, version, dtype
    raise DataError(f"a vocabulary of {vocab} does not fit uint32 tokens")


def write_shard(path: Path, stream: TokenStream, start: int, stop: int, vocab: int) -> None:
    """Tokens [start, stop) of the stream as one llm.c shard."""
    magic, version, dtype = _layout(vocab)
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, stop - start
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        for a in range(start, stop, WRITE_CHUNK):
            f.write(stream[a : min(stop, a + WRITE_CHUNK)].astype(dtype).tobytes())
    tmp.replace(path)


def shard_bounds(n: int, per: int, min_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) of each shard of `per` tokens; a last one shorter than `min_tokens` (one
    sequence of the preset) joins the one before, since training refuses shorter shards."""
    cuts = [(a, min(n, a + per)) for a in range(0, n, per)]
    if len(cuts) > 1 and cuts[-1][1] - cuts[-1][0] < min_tokens:
        cuts[-2:] = [(cuts[-2][0], n)]
    return cuts


def make_shards(args) -> dict:
    cfg = PRESETS[args.preset]
    spec = DataSpec.from_args(args, cfg)
    train_files, val_files, how = split_files(spec)
    for path, kind in train_files + val_files:
        if kind == "tokens":
            raise DataError(f"{path}: already token ids; --make-shards reads text files")
    out = Path(args.make_shards)
    if out.is_dir() and any(out.glob("*.bin")):
        raise DataError(f"{out}: already holds .bin shards; make shards into an empty directory")
    tok = text_tokenizer(cfg.tokenizer, cfg.vocab_size)

    def stream(files):
        return TokenStream(
            [text_tokens(p, k, spec.text_column, tok) for p, k in files], [str(p) for p, _ in files]
        )

    train = stream(train_files)
    if val_files:
        val = stream(val_files)
    else:
        frac = DEFAULT_VAL_FRACTION if spec.val_fraction is None else spec.val_fraction
        cut = len(train) - int(round(frac * len(train)))
        train, val = train.view(0, cut), train.view(cut, len(train))
    need = cfg.seq_len + 1
    for name, s in (("training", train), ("validation", val)):
        if len(s) < need:
            raise DataError(
                f"{spec.data[0]}: the {name} split holds {len(s)} tokens, fewer than "
                f"one sequence of preset {args.preset} ({need})"
            )
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, s in (("val", val), ("train", train)):
        bounds = shard_bounds(len(s), args.shard_tokens, need)
        for i, (a, b) in enumerate(bounds):
            write_shard(out / f"{split}_{i:06d}.bin", s, a, b, tok.vocab_size)
        written[split] = len(bounds)
    meta = {
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "dtype": _layout(tok.vocab_size)[2].name,
        "preset": args.preset,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "val_split": how,
        "text_column": spec.text_column,
        "source": spec.data,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return {**meta, "shards": written}


def main(args) -> int:
    meta = make_shards(args)
    print(
        f"{args.make_shards}: {meta['shards']['train']} train shards ({meta['train_tokens']:,} "
        f"tokens), {meta['shards']['val']} val ({meta['val_tokens']:,}); tokenizer "
        f"{meta['tokenizer']}, vocab {meta['vocab_size']}; train with --data "
        f"{args.make_shards} --preset {args.preset}",
        file=sys.stderr,
    )
    return 0
