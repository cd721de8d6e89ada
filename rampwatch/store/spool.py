"""Spool files: what log() appends to and what ingest reads back, and whose spool is alive.

Owns the files and the liveness lock (the bytes inside them: store/spool_format.py). One writer
session has one directory `<db>.spool/<session>/` holding:
  metrics.v2.bin  fixed 40-byte checked records (step, t, value, name id), parsed with
                  numpy.frombuffer, never a Python loop per record
  names.v2.txt    one checked line `[name_id, "name"]` per name, appended before the first
                  record that uses it, so ingest never sees an unknown id for long
  records.v2.txt  rare records (start or segment first, then event, plan, run update, status,
                  command result), one checked JSON line each
(`metrics.bin`, `names.jsonl`, `records.jsonl`: format 1, still read.)
Every append is one unbuffered os.write on an O_APPEND descriptor: a killed process leaves what
it wrote in the OS. A write that fails part-way (disk full, file-size limit) is cut back to the
last whole record or line, so the spool stays readable and later appends land whole; if even
that fails, the next line starts on a fresh line and the damage is stepped over by the reader.
Readers take only whole records/lines; a torn tail waits (or, if its writer is dead, was never
acknowledged). The live writer holds an exclusive fcntl lock on the spool's
`lock` file; a spool whose lock can be taken belongs to a dead writer. The lock is on a file
of its own because closing *any* descriptor of a file drops the process's fcntl locks on it,
and the writer's own flusher opens and closes the records file to read it. A directory is built
as `<session>.tmp` and renamed only once locked, so recovery never mistakes a spool being
created for a dead one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from rampwatch.store import names
from rampwatch.store import spool_format as fmt

BIN, NAMES, RECORDS, LOCK = "metrics.v2.bin", "names.v2.txt", "records.v2.txt", "lock"
LEGACY_FILES = ("metrics.bin", "names.jsonl", "records.jsonl")  # format 1
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


class _File:
    """One append-only file of the spool, with the size of what was appended whole."""

    def __init__(self, fd: int, line_based: bool):
        self.fd, self.size, self.line_based = fd, 0, line_based
        self.torn = False  # a failed write could not be cut back: its bytes stay in the file

    def append(self, data) -> None:
        view = memoryview(data).cast("B")
        if self.torn and self.line_based:
            view = memoryview(b"\n" + bytes(view))  # the damaged bytes end on their own line
        written = 0
        try:
            while written < len(view):
                written += os.write(self.fd, view[written:])
        except OSError:
            if written:
                try:  # cut the partial record or line off: readers never see it
                    os.ftruncate(self.fd, self.size)
                except OSError:
                    self.torn = True  # the reader steps over it (spool_format resyncs)
                    try:
                        self.size = os.fstat(self.fd).st_size
                    except OSError:
                        pass  # size stays at the last whole append; nothing is cut later
            raise
        self.size += written
        self.torn = False


class SpoolFiles:
    """The writer's side of one spool: open descriptors, the lock, the name dictionary."""

    def __init__(self, path: Path, lock_fd: int, bin_fd: int, names_fd: int, rec_fd: int):
        self.path = path
        self.lock_fd, self.bin_fd, self.names_fd, self.rec_fd = lock_fd, bin_fd, names_fd, rec_fd
        self._bin, self._names, self._rec = (
            _File(bin_fd, False),
            _File(names_fd, True),
            _File(rec_fd, True),
        )
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
        self._bin.append(buf)

    def name_id(self, name: str) -> int:
        nid = self.name_ids.get(name)
        if nid is None:
            problem = names.name_problem(name)
            if problem is not None:
                raise ValueError(f"metric {name!r}: {problem}")
            nid = len(self.name_ids)
            self._names.append(fmt.encode_line([nid, name]))
            self.name_ids[name] = nid
        return nid

    def append_json(self, obj: dict) -> None:
        self._rec.append(fmt.encode_line(obj))

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
                pass  # already closed: nothing of ours is lost by that
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
    return [
        p
        for p in entries
        if p.name.endswith(_TMP) and p.is_dir() and now - p.stat().st_mtime > older_than
    ]


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


def is_legacy(path: Path) -> bool:
    """A format-1 spool (left by a Rampwatch before schema 5)."""
    return (path / LEGACY_FILES[2]).exists() and not (path / RECORDS).exists()


def file_sizes(path: Path) -> tuple[int, int]:
    """(records file, rare-records file) sizes in bytes; 0 for a missing file."""
    legacy = is_legacy(path)
    out = []
    for name in (LEGACY_FILES[0], LEGACY_FILES[2]) if legacy else (BIN, RECORDS):
        try:
            out.append((path / name).stat().st_size)
        except FileNotFoundError:
            out.append(0)
    return out[0], out[1]


def read_records(
    path: Path, offset: int, max_records: int, final: bool = False
) -> tuple[np.ndarray, np.ndarray, int, fmt.Damage, bool]:
    """Valid metric records from byte `offset` on (at most max_records), their offsets, the
    offset reached, the damage stepped over (spool_format.decode_records), and whether more
    may follow."""
    legacy = is_legacy(path)
    size = fmt.LEGACY_RECORD.itemsize if legacy else fmt.SIZE
    limit = max_records * size
    data = _read_from(path / (LEGACY_FILES[0] if legacy else BIN), offset, limit)
    more = len(data) == limit
    if legacy:
        return (*fmt.decode_legacy_records(data, offset), more)
    # `final` only if this chunk reaches the end of the file: a chunk boundary is not a tail
    return (*fmt.decode_records(data, offset, final and not more), more)


def read_names(path: Path) -> tuple[dict[int, str], fmt.Damage, bool]:
    """{name_id: name}, the damaged lines, and whether a torn last line is still waiting."""
    legacy = is_legacy(path)
    data = _read_from(path / (LEGACY_FILES[1] if legacy else NAMES), 0, 1 << 30)
    return fmt.decode_names(data, legacy)


def read_json_records(
    path: Path, offset: int, max_bytes: int = 16 << 20, final: bool = False
) -> tuple[list, int, fmt.Damage]:
    """Valid rare records from byte `offset` on, the offset after the last line read, damage."""
    legacy = is_legacy(path)
    data = _read_from(path / (LEGACY_FILES[2] if legacy else RECORDS), offset, max_bytes)
    return fmt.decode_lines(data, offset, final and len(data) < max_bytes, legacy)
