"""TokenStream: a run's token files end to end as one sequence, without copying them (each
piece memory-mapped); the windows the trainer reads are gathered across a file boundary when
they cross one. data_files.py builds it; data.TokenDataset and shards.py read it."""

from __future__ import annotations

import numpy as np


class TokenStream:
    """Files end to end as one token sequence, without copying them: `pieces` are 1-D arrays
    (memory-mapped), and a window is gathered across a boundary when it crosses one."""

    def __init__(self, pieces: list[np.ndarray], names: list[str]):
        self.pieces, self.names = pieces, names
        self.bounds = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
        self._bounds = self.bounds.tolist()

    def __len__(self) -> int:
        return self._bounds[-1]

    def view(self, start: int, stop: int) -> TokenStream:
        """Tokens [start, stop) as a stream of their own (slices of the same memory maps)."""
        pieces, names = [], []
        for p, name, lo in zip(self.pieces, self.names, self._bounds[:-1], strict=True):
            a, b = max(start - lo, 0), min(stop - lo, len(p))
            if a < b:
                pieces.append(p[a:b])
                names.append(name)
        return TokenStream(pieces, names)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 (len(starts), length): row r is tokens [starts[r], starts[r] + length)."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"window outside the stream of {len(self)} tokens")
        out = np.empty((len(starts), length), dtype=np.int64)
        piece = (np.searchsorted(self.bounds, starts, side="right") - 1).tolist()
        for r, (g, i) in enumerate(zip(starts.tolist(), piece, strict=True)):
            pos, off = 0, g - self._bounds[i]
            while pos < length:  # more than one turn only for a window across a boundary
                p = self.pieces[i]
                take = min(length - pos, len(p) - off)
                out[r, pos : pos + take] = p[off : off + take]
                pos, off, i = pos + take, 0, i + 1
        return out

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, step = s.indices(len(self))
        assert step == 1, "contiguous slices only"
        return self.windows(np.array([start]), max(0, stop - start))[0]

    def piece_at(self, pos: int) -> int:
        return int(np.searchsorted(self.bounds, pos, side="right") - 1)
