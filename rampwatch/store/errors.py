"""The store's error classes: each names a problem a caller can act on (see the messages)."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class StoreBusyError(StoreError):
    """The database stayed locked by another process (or thread) for longer than the timeout."""


class DatabaseMissingError(StoreError):
    """A database was opened for reading but the file does not exist."""


class NotRampwatchError(StoreError):
    """The file exists but is not a Rampwatch database (not DuckDB, or DuckDB without ours)."""


class SchemaTooNewError(StoreError):
    """The file was written by a newer Rampwatch whose schema this code does not know."""


class RunNotFoundError(StoreError, KeyError):
    """No run with the given id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CommandError(StoreError):
    """A command was invalid, or a status change it asked for is not allowed."""


class SpoolCorruptError(StoreError):
    """A spool file holds bytes that are not Rampwatch records (disk error, foreign file)."""


class SpoolOffsetsError(StoreError):
    """The stored offsets of a spool are not what the ingest expected (behind what was already
    committed, missing, or changed under it): ingesting now could insert rows a second time."""

    def __init__(self, message: str, spool: str | None = None):
        super().__init__(message)
        self.spool = spool  # the spool directory's name


class DatabaseCorruptError(StoreError):
    """The file is a DuckDB database but damaged (truncated, unreadable blocks): nothing is
    written to it and the message says what to do (store/integrity.py)."""


class SchemaUpgradeNeededError(StoreError):
    """Reading without writing (read-only mode or media) met a schema too old to read as it is;
    the message names the command that upgrades it."""


class DuckDBVersionError(StoreError):
    """The file was written by a DuckDB this environment's duckdb cannot read (the training and
    the dashboard environments differ); the message names both versions and the fix."""


class InvalidNameError(StoreError, ValueError):
    """A run id that is not a name (a path, empty, too long), or a run name a person could not
    read whole (too long, invisible characters): store/naming.py says the rules."""
