"""The bytes of a spool: fixed-size metric records and checked text lines, encoded by the
writer and decoded by ingest, damage found, reported and stepped over.

Metric records (format 2), 40 bytes, little-endian:
  uint32 magic, int32 name_id, int64 step, float64 t, float64 value, uint64 check
check = sum over the first four 8-byte words w_i of ((w_i ^ (w_i >> 32)) * K_i) mod 2**64.
Each term is a bijection of its word (xorshift, then an odd multiplier), so any damage confined
to one word, a single flipped bit included, always changes the check; damage across words goes
unnoticed with odds near 2**-64. It costs a handful of numpy operations per log() call (the
writer precomputes the words that do not change: magic and name id per row, step and t per call)
and is verified vectorized on ingest.

Text lines (names and rare records): `<crc32 of the payload, 8 hex digits> <JSON payload>\\n`.
A names line is `[name_id, "name"]`: the id is in the line, so a lost or merged line costs only
the names it held, not the numbering of every later line.

Damage is stepped over, never trusted and never a reason to stop: decoding keeps every record
whose magic and check hold, and after a bad one scans forward byte by byte for the next offset
where a magic and a matching check are found (resynchronisation: an inserted or deleted byte
shifts every later record). What was skipped is returned as (offset, length) ranges for the
caller to report. Bytes at the end that could still become a whole record or line wait, unless
the caller says the file is final (its writer is gone).
Format 1 (32-byte records without a check, plain JSON lines; Rampwatch before schema 5) is still
read, for spools that an older writer left behind.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

MAGIC = 0x52570002  # 'RW' + format 2
RECORD = np.dtype(
    [
        ("magic", "<u4"),
        ("name_id", "<i4"),
        ("step", "<i8"),
        ("t", "<f8"),
        ("value", "<f8"),
        ("check", "<u8"),
    ]
)
SIZE = RECORD.itemsize
assert SIZE == 40
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_K = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], np.uint64
)
_KI = [int(k) for k in _K]
_MASK = (1 << 64) - 1
_S32 = np.array(32, np.uint64)
_K3 = np.array(_K[3])

LEGACY_MAGIC = 0x52570001
LEGACY_RECORD = np.dtype(
    [("step", "<i8"), ("t", "<f8"), ("value", "<f8"), ("name_id", "<i4"), ("magic", "<i4")]
)
_HEX8 = re.compile(rb"[0-9a-f]{8}")  # int(x, 16) would also take "+", "_" and spaces
MAX_DAMAGE_RANGES = 20  # kept per report: the counts are exact, the list is a sample


def _mix(x: int, i: int) -> int:
    return ((x ^ (x >> 32)) * _KI[i]) & _MASK


def checks(recs: np.ndarray) -> np.ndarray:
    """The check value each record should carry (recs: a RECORD array)."""
    w = np.ascontiguousarray(recs).view("<u8").reshape(-1, 5)[:, :4]
    return ((w ^ (w >> _S32)) * _K).sum(axis=1, dtype=np.uint64)


class Template:
    """The writer's reusable records for one set of metric names; fill() per log() call."""

    def __init__(self, name_ids: list[int]):
        n = len(name_ids)
        self.rec = np.zeros(n, RECORD)
        self.rec["magic"] = MAGIC
        self.rec["name_id"] = name_ids
        words = self.rec.view("<u8").reshape(n, 5)
        w0 = words[:, 0]
        self._base = (w0 ^ (w0 >> _S32)) * _K[0]  # magic and name id never change
        self._step, self._t = words[:, 1], self.rec["t"]
        self._vbits, self._check = words[:, 3], words[:, 4]
        self._value = self.rec["value"]
        self._tmp = np.empty(n, np.uint64)
        self._call = np.zeros((), np.uint64)  # 0-d: the cheapest broadcast

    def fill(self, step: int, t: float, values: list[float]) -> np.ndarray:
        self._step[:] = step
        self._t[:] = t
        self._value[:] = values
        tbits = struct.unpack("<Q", struct.pack("<d", t))[0]
        self._call[()] = (_mix(step & _MASK, 1) + _mix(tbits, 2)) & _MASK
        tmp = self._tmp
        np.right_shift(self._vbits, _S32, out=tmp)
        np.bitwise_xor(tmp, self._vbits, out=tmp)
        np.multiply(tmp, _K3, out=tmp)
        np.add(tmp, self._base, out=tmp)
        np.add(tmp, self._call, out=self._check)
        return self.rec


def encode_one(step: int, t: float, value: float, name_id: int) -> bytes:
    """One record, for the writer's slow path (values that need float() one by one)."""
    rec = np.zeros(1, RECORD)
    rec["magic"], rec["name_id"], rec["step"], rec["t"], rec["value"] = (
        MAGIC,
        name_id,
        step,
        t,
        value,
    )
    rec["check"] = checks(rec)
    return rec.tobytes()


@dataclass
class Damage:
    """What decoding stepped over: exact counts, and the first few (offset, length) ranges."""

    nbytes: int = 0
    ranges: list = field(default_factory=list)
    lines: int = 0  # text lines whose check failed
    torn: int = 0  # final tail bytes cut short by the writer's death (never acknowledged)
    records: int = 0  # records lost, estimated per range: a flipped one is 40 bytes, one with
    #                   bytes inserted or deleted a few more or less

    def add(self, offset: int, length: int) -> None:
        self.nbytes += length
        self.records += max(1, round(length / SIZE))
        if len(self.ranges) < MAX_DAMAGE_RANGES:
            self.ranges.append((offset, length))

    def __bool__(self) -> bool:
        return self.nbytes > 0


def _valid_at(data, pos: int) -> bool:
    rec = np.frombuffer(data, RECORD, count=1, offset=pos)
    return bool(rec["magic"][0] == MAGIC and checks(rec)[0] == rec["check"][0])


def _resync(data, pos: int) -> int | None:
    """The next offset >= pos holding a valid record; len(data) if none can start before the
    end; None if a record starting near the end cannot be judged yet (it is not whole)."""
    while True:
        pos = data.find(_MAGIC_BYTES, pos)
        if pos < 0:
            return None
        if pos + SIZE > len(data):
            return None
        if _valid_at(data, pos):
            return pos
        pos += 1


def decode_records(
    data: bytes, base: int, final: bool
) -> tuple[np.ndarray, np.ndarray, int, Damage]:
    """Valid records of `data` (file bytes from offset `base`), each one's file offset, the
    offset reached, and the damage stepped over.

    Not final: a tail that could still become a valid record waits (the offset stops before it).
    Final: everything is judged; a tail shorter than a record is a write cut short by the
    writer's death, never acknowledged to its caller: passed over and counted as torn.
    """
    parts, offs, damage, pos, n = [], [], Damage(), 0, len(data)
    while n - pos >= SIZE:
        count = (n - pos) // SIZE
        recs = np.frombuffer(data, RECORD, count=count, offset=pos)
        ok = (recs["magic"] == MAGIC) & (checks(recs) == recs["check"])
        good = count if ok.all() else int(np.argmin(ok))
        parts.append(recs[:good])
        offs.append(base + pos + SIZE * np.arange(good, dtype=np.int64))
        if good == count:
            pos += count * SIZE
            break
        start = pos + good * SIZE
        nxt = _resync(data, start + 1)
        if nxt is None:
            # No valid record follows in what is here. A writer still appending may be midway
            # through one, which can only begin in the last SIZE-1 bytes.
            nxt = n if final else max(start + 1, n - (SIZE - 1))
        damage.add(base + start, nxt - start)
        pos = nxt
    if final and pos < n:
        damage.torn += n - pos
        pos = n
    if len(parts) == 1:
        return parts[0], offs[0], base + pos, damage
    if not parts:
        return np.zeros(0, RECORD), np.zeros(0, np.int64), base + pos, damage
    return np.concatenate(parts), np.concatenate(offs), base + pos, damage


def decode_legacy_records(data: bytes, base: int) -> tuple[np.ndarray, np.ndarray, int, Damage]:
    """Format 1 (no check value): whole records up to the first without the magic, which with
    all that follows is reported as damage only when nothing valid could be read before it."""
    whole = len(data) - len(data) % LEGACY_RECORD.itemsize
    recs = np.frombuffer(data, LEGACY_RECORD, count=whole // LEGACY_RECORD.itemsize)
    bad = np.flatnonzero(recs["magic"] != LEGACY_MAGIC)
    damage = Damage()
    if len(bad):
        cut = int(bad[0]) * LEGACY_RECORD.itemsize
        recs = recs[: bad[0]]
        if cut == 0:  # format 1 cannot resynchronise: the rest is lost, and reported
            damage.add(base, len(data))
            return np.zeros(0, RECORD), np.zeros(0, np.int64), base + len(data), damage
    out = np.zeros(len(recs), RECORD)
    for f in ("name_id", "step", "t", "value"):
        out[f] = recs[f]
    offs = base + LEGACY_RECORD.itemsize * np.arange(len(recs), dtype=np.int64)
    return out, offs, base + len(recs) * LEGACY_RECORD.itemsize, damage


def encode_line(payload) -> bytes:
    text = json.dumps(payload, ensure_ascii=False).encode()
    return b"%08x " % zlib.crc32(text) + text + b"\n"


def _check_line(line: bytes):
    """The payload of a checked line, or raises ValueError."""
    if len(line) < 10 or line[8:9] != b" " or not _HEX8.fullmatch(line[:8]):
        raise ValueError("no check value")
    text = line[9:]
    if int(line[:8], 16) != zlib.crc32(text):
        raise ValueError("check value mismatch")
    return json.loads(text)


def decode_lines(
    data: bytes, base: int, final: bool, legacy: bool = False
) -> tuple[list, int, Damage]:
    """Payloads of the whole, valid lines of `data`, the offset reached, and the damage.

    A line that fails its check (or, in format 1, is not JSON) is skipped and reported; the
    line after it is read as usual. A tail without its newline waits unless final.
    """
    out, damage, pos = [], Damage(), 0
    end = data.rfind(b"\n") + 1
    for line in data[:end].split(b"\n")[:-1]:
        try:
            out.append(json.loads(line) if legacy else _check_line(line))
        except (ValueError, UnicodeDecodeError):
            damage.add(base + pos, len(line) + 1)
            damage.lines += 1
        pos += len(line) + 1
    if final and end < len(data):  # a line cut short by the writer's death: never applied
        damage.torn += len(data) - end
        end = len(data)
    return out, base + end, damage


def decode_names(data: bytes, legacy: bool = False) -> tuple[dict[int, str], Damage, bool]:
    """{name_id: name} from a names file, the damaged lines, and whether a torn tail waits."""
    lines, end, damage = decode_lines(data, 0, final=False, legacy=legacy)
    if legacy:
        names = {i: n for i, n in enumerate(lines)}
    else:
        names = {}
        for item in lines:
            if (
                isinstance(item, list)
                and len(item) == 2
                and type(item[0]) is int
                and 0 <= item[0] < 1 << 31
                and isinstance(item[1], str)
            ):
                names[item[0]] = item[1]
            else:
                damage.lines += 1
    return names, damage, end < len(data)
