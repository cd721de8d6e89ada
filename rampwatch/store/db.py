"""Access to the DuckDB file: the cross-process lock and short-lived connections.

Owns: where the lock file and spool directory live beside a database, the one lock every
access goes through (a POSIX fcntl record lock on `<db>.lock`, shared for readers and exclusive
for writers, with a turnstile so writers are not starved, plus a per-process threading lock),
jittered retry with a timeout, connecting with
extension downloads off, the schema check on first contact (errors: store/errors.py), the
check that the file is whole before it is trusted (store/integrity.py), and read-only reading.

Read-only reading (read_connection(read_only=True), or set_read_only() for a whole process such
as the dashboard's read-only mode, and always where the file or its folder cannot be written)
never changes anything: no schema upgrade (an older schema from MIN_READABLE_VERSION on is read
as it is; an older one raises SchemaUpgradeNeededError naming `rampwatch upgrade`), no
lock file created (an existing one is opened read-only and locked shared).

Why this shape: DuckDB lets one read-write process *or* many read-only processes hold a file,
and a second process fails at once instead of waiting. So nobody keeps a connection open:
open, work, close, under our lock. fcntl locks are per process and are not inherited by forked
children, so a dead writer's lock is really free; but closing *any* descriptor of a locked file
drops the process's lock, which is why each lock file is opened once per process and kept. The
same holds for DuckDB's own lock on the database file: reading the file's header (or anything
else that opens and closes it) happens only under the per-process thread lock, never while
another thread of the process has a connection open, or a program that relies on DuckDB's lock
(the read-only first-contact check below, a duckdb shell) could open the file mid-write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import re
import threading
import time
from pathlib import Path

import duckdb

from rampwatch.store import integrity, schema
from rampwatch.store.errors import (
    DatabaseMissingError,
    DuckDBVersionError,
    NotRampwatchError,
    SchemaUpgradeNeededError,
    StoreBusyError,
    StoreError,
)

# DuckDB 2.0.1 would try to download extensions it knows; there is no network at run time.
BASE_CONFIG = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}
DEFAULT_TIMEOUT = 10.0
_DUCKDB_MAGIC = b"DUCK"  # bytes 8..12 of every DuckDB file header
_read_only_process = False  # set_read_only(): every read of this process writes nothing


def set_read_only(on: bool = True) -> None:
    """Make every read of this process read-only (the dashboard's read-only mode): no schema
    upgrade, no lock file created, nothing written beside the database."""
    global _read_only_process
    _read_only_process = bool(on)


def _never_write(db: Path, read_only: bool | None) -> bool:
    if _read_only_process if read_only is None else read_only:
        return True
    # read-only media or permissions: reading must still work, without trying to write
    return not (os.access(db.parent, os.W_OK) and (not db.exists() or os.access(db, os.W_OK)))


def resolve(db: str | os.PathLike) -> Path:
    """The database's real path: two spellings of one file (a symlink) must share one lock."""
    return Path(os.path.realpath(db))


def lock_path(db: str | os.PathLike) -> Path:
    return Path(str(resolve(db)) + ".lock")


def spool_root(db: str | os.PathLike) -> Path:
    return Path(str(resolve(db)) + ".spool")


class _PathLock:
    """One per database file per process: a threading lock and the kept-open lock-file fd."""

    def __init__(self) -> None:
        self.thread_lock = threading.Lock()
        self.owner: int | None = None
        self.fd: int | None = None
        self.fd_writable = False  # opened O_RDWR: a read-only reader's fd cannot take LOCK_EX
        # (st_dev, st_ino) of the file last checked read-only before taking any lock
        self.prechecked: tuple[int, int] | None = None
        self.size_seen = 0  # of that file at the last first look: shrinking means a re-check


_registry: dict[str, _PathLock] = {}
_registry_lock = threading.Lock()


def _reset_after_fork() -> None:
    # A thread of the parent may have held a lock at fork time; the child starts clean. The
    # inherited fds carry no fcntl locks in the child, so dropping them is safe.
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _path_lock(db: Path) -> _PathLock:
    key = str(db)  # already resolved
    with _registry_lock:
        pl = _registry.get(key)
        if pl is None:
            pl = _registry[key] = _PathLock()
        return pl


def _sleep_jittered(attempt: int, deadline: float) -> None:
    delay = min(0.02, 0.001 * (2 ** min(attempt, 5))) * random.uniform(0.5, 1.5)
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))


_DATA, _TURNSTILE = 0, 1  # bytes of the lock file: the lock itself, and the writers' queue


def _lock_byte(fd: int, mode: int, byte: int, deadline: float, busy) -> None:
    attempt = 0
    while True:
        try:
            fcntl.lockf(fd, mode | fcntl.LOCK_NB, 1, byte)
            return
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            raise busy()
        _sleep_jittered(attempt, deadline)
        attempt += 1


def _busy(db: Path, what: str, timeout: float) -> StoreBusyError:
    return StoreBusyError(
        f"database {db} is busy: could not get {what} within {timeout:.1f} s. Another process "
        f"is holding it; retry later or pass a longer timeout."
    )


@contextlib.contextmanager
def _locked(
    db: Path, exclusive: bool, timeout: float, create_lock_file: bool = True, first_look=None
):
    """Hold this process's thread lock and the cross-process fcntl lock on `<db>.lock`.

    first_look(pl), if given, runs under the thread lock before the lock file is opened (or
    created): the place for anything that opens the database file itself. Closing that
    descriptor drops every fcntl lock this process holds on the file, DuckDB's own included, so
    it must never overlap a connection another thread of this process has open.
    """
    pl = _path_lock(db)
    if pl.owner == threading.get_ident():
        raise RuntimeError(
            f"store access to {db} re-entered from the thread that holds it; "
            "finish the first access (close its connection) before the next"
        )
    deadline = time.monotonic() + timeout
    if not pl.thread_lock.acquire(timeout=max(0.0, timeout)):
        raise _busy(db, "this process's lock (another thread is using the database)", timeout)
    try:
        pl.owner = threading.get_ident()
        if first_look is not None:
            first_look(pl)
        path = lock_path(db)
        writing = create_lock_file or exclusive
        if pl.fd is not None and writing and not pl.fd_writable:
            # read-only reads came first: reopen for writing. This process holds no fcntl lock
            # on the file now (the thread lock is ours), so closing the fd drops none.
            os.close(pl.fd)
            pl.fd = None
        if pl.fd is None and (writing or path.exists()):
            try:
                if not writing:
                    raise PermissionError  # read-only reading: never open it for writing
                pl.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
                pl.fd_writable = True
            except OSError as e:  # EACCES, EPERM, EROFS (read-only media)
                if exclusive:
                    raise StoreError(
                        f"cannot write {db}: its lock file {path} cannot be "
                        f"opened for writing ({e.strerror or e})"
                    ) from None
                try:
                    pl.fd = os.open(path, os.O_RDONLY)  # a shared lock needs only reading
                except FileNotFoundError:
                    pl.fd = None
        # No fd: reading beside a directory we cannot write, with no lock file in it. No
        # Rampwatch writer can exist there, so there is nothing to lock against.
        fd = -1 if pl.fd is None else pl.fd
        if fd >= 0:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            what = f"the {'write' if exclusive else 'read'} lock {path}"
            # Byte 1 is a turnstile: a writer holds it while it waits for byte 0, so a stream
            # of overlapping readers cannot starve it; readers only pass through it.
            _lock_byte(fd, mode, _TURNSTILE, deadline, lambda: _busy(db, what, timeout))
            try:
                _lock_byte(fd, mode, _DATA, deadline, lambda: _busy(db, what, timeout))
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, _TURNSTILE)
        try:
            yield deadline
        finally:
            if fd >= 0:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, _DATA)
    finally:
        pl.owner = None
        pl.thread_lock.release()


def _connect(db: Path, read_only: bool, deadline: float, timeout: float, threads: int | None):
    """duckdb.connect, retried while a program outside our lock (a duckdb shell) holds the file."""
    config = dict(BASE_CONFIG)
    if threads:
        config["threads"] = threads
    attempt = 0
    while True:
        try:
            return duckdb.connect(str(db), read_only=read_only, config=config)
        except duckdb.IOException as e:
            msg = str(e)
            _raise_named(db, e)
            if "lock" not in msg.lower() or time.monotonic() >= deadline:
                if "lock" in msg.lower():
                    raise StoreBusyError(
                        f"database {db} is locked by a program that does not use Rampwatch's "
                        f"lock file (a duckdb shell?) for over {timeout:.1f} s: {msg}"
                    ) from None
                raise
        _sleep_jittered(attempt, deadline)
        attempt += 1


def _raise_named(db: Path, e: duckdb.IOException) -> None:
    """Raise the store's error for an open that failed on the file itself (not DuckDB, written
    by a newer DuckDB, damaged); return for anything else (a lock, for one)."""
    msg = str(e)
    if "not a valid DuckDB database" in msg:
        raise NotRampwatchError(_not_duckdb_message(db)) from None
    if "newer version of DuckDB" in msg or "can only read versions" in msg:
        raise DuckDBVersionError(_duckdb_version_message(db)) from None
    if integrity.is_corruption(e):
        raise integrity.corrupt(db, msg.splitlines()[0]) from None


def _duckdb_version_message(db: Path) -> str:
    try:
        with open(db, "rb") as f:
            found = re.search(rb"v(\d+\.\d+\.\d+)", f.read(4096))
    except OSError:
        found = None
    writer = found.group(1).decode() if found else None
    wrote = f"DuckDB {writer}" if writer else "a newer DuckDB"
    pin = f"duckdb=={writer}" if writer else "a newer duckdb"
    return (
        f"{db} was written by {wrote}, which this environment's duckdb "
        f"{duckdb.__version__} cannot read (the training and the dashboard environments "
        f"differ). Install the same DuckDB here (`pip install '{pin}'`), or open the file "
        "where it was written."
    )


def _not_duckdb_message(db: Path) -> str:
    return (
        f"{db} is not a DuckDB database (its header lacks DuckDB's magic bytes); Rampwatch "
        "will not touch it. Point Rampwatch at a database it created, or at a path that "
        "does not exist yet."
    )


def _check_header(db: Path) -> bool:
    """True if `db` exists and looks like DuckDB, False if it is missing; raises otherwise.

    Only under this process's thread lock (see _locked): it opens and closes the database file,
    which drops DuckDB's fcntl lock on it if a connection of this process is open.
    """
    try:
        with open(db, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        raise NotRampwatchError(
            f"{db} is a directory, not a database file: pass the path of "
            "the .duckdb file a training run writes (its --db)"
        ) from None
    if len(head) < 12 or head[8:12] != _DUCKDB_MAGIC:
        raise NotRampwatchError(_not_duckdb_message(db))
    return True


def _identity(db: Path) -> tuple[int, int]:
    st = os.stat(db)
    return st.st_dev, st.st_ino


def _precheck(db: Path, pl: _PathLock) -> None:
    """First contact with an existing file in this process: check its schema read-only.

    Done before the lock file is created, so pointing Rampwatch at someone else's DuckDB file
    (or one from a newer Rampwatch) writes nothing at all beside it. If a writer holds the
    file right now, DuckDB refuses the read-only open and the check happens under the lock.
    Called under this process's thread lock (from _locked's first_look), so no other thread of
    this process has the file open meanwhile.
    """
    identity = _identity(db)
    size = os.stat(db).st_size
    shrunk, pl.size_seen = size < pl.size_seen, size
    if pl.prechecked == identity and not shrunk:  # truncated since? then look again
        return
    pl.prechecked = None  # until this check passes: a failed one is repeated next time
    try:
        con = duckdb.connect(str(db), read_only=True, config=dict(BASE_CONFIG))
    except duckdb.IOException as e:
        _raise_named(db, e)
        con = None  # held by a writer: checked under the lock instead
    except duckdb.ConnectionException:
        con = None  # this process has it open in another mode: it was checked then
    if con is not None:
        try:
            with _corruption_named(db):
                version = schema.read_version(con, db, allow_empty=True)
                if version:  # ours: every block it uses must be inside the file
                    integrity.check_blocks(con, db, os.stat(db).st_size)
        finally:
            con.close()
        schema.check_not_newer(version, db)
    pl.prechecked = identity


@contextlib.contextmanager
def _corruption_named(db: Path):
    """DuckDB's errors about damaged contents, raised anywhere in the block, as one
    DatabaseCorruptError naming the file and what to do."""
    try:
        yield
    except duckdb.Error as e:
        if integrity.is_corruption(e):
            raise integrity.corrupt(db, str(e).splitlines()[0]) from None
        raise


@contextlib.contextmanager
def write_connection(
    db: str | os.PathLike,
    timeout: float = DEFAULT_TIMEOUT,
    threads: int | None = 1,
    *,
    create: bool = True,
):
    """A read-write connection under the exclusive lock; creates or upgrades the schema.
    create=False: a missing file is DatabaseMissingError, and nothing is made there (a command
    that only changes a database must not turn a mistyped path into one).

    The connection is closed on exit. Keep the work inside short: every other process waits.
    """
    if not create and not resolve(db).exists():
        raise DatabaseMissingError(
            f"no Rampwatch database at {db}: the file does not exist; check the path"
        )
    with write_lock(db, timeout) as held:
        with held.connection(threads) as con:
            yield con


class Held:
    """The exclusive lock on a database, held: connections opened under it, one at a time, and
    the lock still held after they close (store/compact.py replaces the file then)."""

    def __init__(self, db: Path, deadline: float, timeout: float):
        self.db, self.deadline, self.timeout = db, deadline, timeout

    @contextlib.contextmanager
    def connection(self, threads: int | None = 1):
        """A read-write connection (schema created or upgraded), closed on exit."""
        db = self.db
        _check_header(db)  # again: it may have been replaced while we waited
        con = _connect(db, False, self.deadline, self.timeout, threads)
        try:
            with _corruption_named(db):
                # Every time, not once per process: another process may have upgraded the file.
                version = schema.read_version(con, db, allow_empty=True)
                schema.check_not_newer(version, db)
                schema.upgrade(con, version)
                yield con
        finally:
            try:
                con.close()  # the checkpoint at close reads blocks too
            except duckdb.Error as e:
                if integrity.is_corruption(e):
                    raise integrity.corrupt(db, str(e).splitlines()[0]) from None
                raise


@contextlib.contextmanager
def write_lock(db: str | os.PathLike, timeout: float = DEFAULT_TIMEOUT):
    """The exclusive lock with no connection open yet (a Held); write_connection is one
    connection under it."""
    db = resolve(db)
    if not db.parent.is_dir():
        raise StoreError(f"cannot create the database {db}: directory {db.parent} does not exist")

    def first_look(pl: _PathLock) -> None:
        if _check_header(db):
            _precheck(db, pl)

    with _locked(db, exclusive=True, timeout=timeout, first_look=first_look) as deadline:
        yield Held(db, deadline, timeout)


def _upgrade_needed(db: Path, version: int) -> SchemaUpgradeNeededError:
    return SchemaUpgradeNeededError(
        f"{db} has Rampwatch schema version {version}; reading without writing (read-only "
        f"mode, or a file or folder that cannot be written) reads versions "
        f"{schema.MIN_READABLE_VERSION}..{schema.CURRENT_VERSION} as they are, and this one "
        f"needs an upgrade first. Run `rampwatch upgrade {db}` where the file can be "
        "written (a copy, if the media is read-only), then view that."
    )


@contextlib.contextmanager
def read_connection(
    db: str | os.PathLike,
    timeout: float = DEFAULT_TIMEOUT,
    threads: int | None = None,
    read_only: bool | None = None,
):
    """A read-only connection under the shared lock.

    An older schema is upgraded first, unless read_only (default: the process setting, see
    set_read_only) or the file cannot be written: then nothing is written at all, and an older
    schema is read as it is (from MIN_READABLE_VERSION on).
    """
    db = resolve(db)
    never_write = _never_write(db, read_only)

    def first_look(pl: _PathLock) -> None:
        if not _check_header(db):
            raise DatabaseMissingError(
                f"no Rampwatch database at {db}: the file does not exist. Check the path, or "
                "start a training run with `--db` set to it (rampwatch train, or Monitor.start "
                "in your own loop): that creates it."
            )
        _precheck(db, pl)

    create = not never_write
    for _ in range(2):
        with _locked(
            db, exclusive=False, timeout=timeout, create_lock_file=create, first_look=first_look
        ) as deadline:
            con = _connect(db, True, deadline, timeout, threads)
            try:
                with _corruption_named(db):
                    version = schema.read_version(con, db)
                    schema.check_not_newer(version, db)
                    readable = version == schema.CURRENT_VERSION or (
                        never_write and version >= schema.MIN_READABLE_VERSION
                    )
                    if readable:
                        yield con
                        return
                    if never_write:
                        raise _upgrade_needed(db, version)
            finally:
                con.close()
        with write_connection(db, timeout):  # an older file: upgrade it, then read
            pass
    raise AssertionError("unreachable: the upgrade above brings the file to CURRENT_VERSION")


def schema_version(db, timeout: float = 10.0, read_only: bool | None = None) -> int:
    """The schema version of an existing database (after any upgrade opening it performs;
    read_only: none, the version as the file has it)."""
    with read_connection(db, timeout, read_only=read_only) as con:
        return schema.read_version(con, db)
