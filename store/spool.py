"""Spool files: what log() appends to and what ingest reads back, and whose spool is alive.

Owns the on-disk format and the liveness lock. One writer session has one directory
`<db>.spool/<session>/` holding:
  metrics.bin    fixed 32-byte records: int64 step, float64 t, float64 value, int32 name_id,
                 int32 magic; parsed with numpy.frombuffer, never a Python loop per record
  names.jsonl    one JSON string per line, line i naming name_id i; a name is appended before
                 the first record that uses it, so ingest never sees an unknown id for long
  records.jsonl  rare records (start or segment first, then event, plan, run update, status,
                 command result), one JSON object per line
Every append is one unbuffered os.write on an O_APPEND descriptor: a killed process leaves what
it wrote in the OS. Readers take only whole records/lines; a torn tail waits (or, if its writer
is dead, was never acknowledged). The live writer holds an exclusive fcntl lock on the spool's
`lock` file; a spool whose lock can be taken belongs to a dead writer. The lock is on a file
of its own because closing *any* descriptor of a file drops the process's fcntl locks on it,
and the writer's own flusher opens and closes metrics.bin to read it. A directory is built as
`<session>.tmp` and renamed only once locked, so recovery never mistakes a spool being created
for a dead one.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from store.errors import SpoolCorruptError

MAGIC = 0x52570001  # 'RW' + format 1: a record that lacks it means misaligned or foreign bytes
RECORD = np.dtype([("step", "<i8"), ("t", "<f8"), ("value", "<f8"),
                   ("name_id", "<i4"), ("magic", "<i4")])
assert RECORD.itemsize == 32
BIN, NAMES, RECORDS, LOCK = "metrics.bin", "names.jsonl", "records.jsonl", "lock"
_TMP, CORRUPT = ".tmp", ".corrupt"

# Spool directories owned by live writers of *this* process. fcntl locks do not conflict
# within a process, and closing any fd of a locked file would drop the writer's lock, so a
# spool of ours must never be probed: it is alive by definition.
_live: set[str] = set()
_live_lock = threading.Lock()


def _key(path: Path) -> str:
    return os.path.realpath(path)


def is_ours(path: Path) -> bool:
    with _live_lock:
        return _key(path) in _live


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class SpoolFiles:
    """The writer's side of one spool: open descriptors, the lock, the name dictionary."""

    def __init__(self, path: Path, lock_fd: int, bin_fd: int, names_fd: int, rec_fd: int):
        self.path = path
        self.lock_fd, self.bin_fd, self.names_fd, self.rec_fd = lock_fd, bin_fd, names_fd, rec_fd
        self.name_ids: dict[str, int] = {}

    @classmethod
    def create(cls, root: Path, session: str) -> "SpoolFiles":
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / (session + _TMP)
        tmp.mkdir()
        lock_fd = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody holds it
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        fds = [lock_fd] + [os.open(tmp / name, flags, 0o644) for name in (BIN, NAMES, RECORDS)]
        final = root / session
        with _live_lock:
            os.rename(tmp, final)
            _live.add(_key(final))
        return cls(final, *fds)

    def append_records(self, buf) -> None:
        _write_all(self.bin_fd, buf)

    def name_id(self, name: str) -> int:
        nid = self.name_ids.get(name)
        if nid is None:
            if not isinstance(name, str):
                raise TypeError(f"metric names must be str, got {type(name).__name__} {name!r}")
            nid = len(self.name_ids)
            _write_all(self.names_fd, (json.dumps(name, ensure_ascii=False) + "\n").encode())
            self.name_ids[name] = nid
        return nid

    def append_json(self, obj: dict) -> None:
        _write_all(self.rec_fd, (json.dumps(obj, ensure_ascii=False) + "\n").encode())

    def size(self) -> int:
        return os.fstat(self.bin_fd).st_size

    def close(self, remove: bool) -> None:
        """Close the files; with remove, delete them first, while the lock is still held."""
        if remove:
            remove_dir(self.path)
        for fd in (self.bin_fd, self.names_fd, self.rec_fd, self.lock_fd):  # the lock last
            try:
                os.close(fd)
            except OSError:
                pass
        with _live_lock:
            _live.discard(_key(self.path))


def lock_if_dead(path: Path) -> int | None:
    """An fd holding the exclusive lock of a dead writer's spool, or None if it is alive.

    The caller closes the fd when done (and should delete or ingest the spool meanwhile).
    """
    if is_ours(path):
        return None
    try:
        fd = os.open(path / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return None
        raise


def is_live(path: Path) -> bool:
    """True while a writer holds the spool; a shared probe, so it works on read-only files."""
    if is_ours(path):
        return True
    try:
        fd = os.open(path / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)


def list_spools(root: Path) -> list[Path]:
    """Spool directories that are complete (not being created, not set aside as corrupt)."""
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return []
    return [p for p in entries if p.is_dir() and not p.name.endswith((_TMP, CORRUPT))]


def stale_tmp_dirs(root: Path, older_than: float = 600.0) -> list[Path]:
    """`.tmp` directories left by a process killed while creating its spool."""
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    now = time.time()
    return [p for p in entries if p.name.endswith(_TMP) and p.is_dir()
            and now - p.stat().st_mtime > older_than]


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def set_aside(path: Path) -> Path:
    """Rename a spool that cannot be parsed so it is kept for inspection but not retried."""
    dest = path.with_name(path.name + CORRUPT)
    os.rename(path, dest)
    return dest


def _read_from(path: Path, offset: int, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        size = os.fstat(fd).st_size
        n = min(max(0, size - offset), limit)
        return os.pread(fd, n, offset) if n else b""
    finally:
        os.close(fd)


def read_records(path: Path, offset: int, max_records: int) -> tuple[np.ndarray, int]:
    """Whole metric records from byte `offset` on (at most max_records) and the new offset."""
    data = _read_from(path / BIN, offset, max_records * RECORD.itemsize)
    whole = len(data) - len(data) % RECORD.itemsize
    recs = np.frombuffer(data, RECORD, count=whole // RECORD.itemsize)
    bad = np.flatnonzero(recs["magic"] != MAGIC)
    if len(bad):
        if bad[0] == 0:
            raise SpoolCorruptError(
                f"spool {path / BIN} has a record without Rampwatch's magic at byte {offset}: "
                "the file is damaged (a failed partial write?) and cannot be read further.")
        recs = recs[:bad[0]]  # ingest what precedes the damage; the next read reports it
    return recs, offset + len(recs) * RECORD.itemsize


def read_names(path: Path) -> list[str]:
    data = _read_from(path / NAMES, 0, 1 << 30)
    end = data.rfind(b"\n") + 1
    try:
        return [json.loads(line) for line in data[:end].splitlines()]
    except ValueError as e:
        raise SpoolCorruptError(f"spool {path / NAMES} has a line that is not JSON: {e}") from None


def read_json_records(path: Path, offset: int, max_bytes: int = 16 << 20
                      ) -> tuple[list[dict], int]:
    """Whole JSON lines from byte `offset` on, and the offset after the last whole line."""
    data = _read_from(path / RECORDS, offset, max_bytes)
    end = data.rfind(b"\n") + 1
    try:
        recs = [json.loads(line) for line in data[:end].splitlines()]
    except ValueError as e:
        raise SpoolCorruptError(
            f"spool {path / RECORDS} has a line that is not JSON after byte {offset}: {e}"
        ) from None
    return recs, offset + end


def first_json_record(path: Path) -> dict | None:
    recs, _ = read_json_records(path, 0, 1 << 20)
    return recs[0] if recs else None
