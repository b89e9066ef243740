"""The one exception tree of ckptstore.

Every error the package raises on purpose derives from :class:`CheckpointError`, so
``except ckptstore.CheckpointError`` catches them all. Where a builtin exception type
is the natural one for callers (``FileNotFoundError``, ``ValueError``, ``TypeError``,
``OSError``) the ckptstore error subclasses it as well, so existing handlers keep
working when ckptstore replaces ``torch.save``/``torch.load``::

    CheckpointError
    ├── CheckpointNotFoundError      (also FileNotFoundError)  nothing at that path
    ├── NotACheckpointError          (also ValueError)         a file that is no checkpoint at all
    ├── CorruptCheckpointError                                 checksum mismatch, truncation, bad footer/manifest
    ├── UnsupportedFormatVersionError                          written by a newer major format version
    ├── UnsupportedObjectError       (also TypeError)          save refused an object under allow_pickle=False
    ├── PickleNotAllowedError        (also pickle.UnpicklingError) load refused pickled content under weights_only=True
    ├── UnknownProtocolError         (also ValueError)         fsspec protocol unknown or not installed
    ├── StorageError                 (also OSError)            the destination failed: full, read-only, denied
    ├── CheckpointExistsError        (also FileExistsError)    another writer committed that step first
    └── InvalidArgumentError         (also ValueError)         an argument that cannot work (mmap on a stream, ...)

Each message says what was wrong, where, and what to do about it.
"""

from __future__ import annotations

import errno as _errno
import pickle as _pickle

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "NotACheckpointError",
    "CorruptCheckpointError",
    "UnsupportedFormatVersionError",
    "UnsupportedObjectError",
    "PickleNotAllowedError",
    "UnknownProtocolError",
    "StorageError",
    "CheckpointExistsError",
    "InvalidArgumentError",
]


class CheckpointError(Exception):
    """Root of every error ckptstore raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the given location."""

    def __init__(self, message: str) -> None:
        # FileNotFoundError's OSError constructor would reformat a single argument;
        # keep the message exactly as written.
        super().__init__(message)
        self.errno = _errno.ENOENT

    def __str__(self) -> str:
        return str(self.args[0])


class NotACheckpointError(CheckpointError, ValueError):
    """The location holds something that is not a checkpoint in any format ckptstore reads."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint is damaged: a checksum mismatch, a truncated file, a bad footer or manifest.

    ``location`` names the file (or object) and ``key`` the tensor, when known.
    """

    def __init__(self, message: str, *, location: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.location = location
        self.key = key


class UnsupportedFormatVersionError(CheckpointError):
    """The checkpoint was written by a newer, incompatible major format version."""


class UnsupportedObjectError(CheckpointError, TypeError):
    """``save`` met an object it cannot store without pickle, and pickle was not allowed."""


class PickleNotAllowedError(CheckpointError, _pickle.UnpicklingError):
    """The checkpoint holds pickled objects and the caller did not opt in to unpickling.

    Also an ``UnpicklingError``: what ``torch.load(weights_only=True)`` raises for the same refusal."""


class UnknownProtocolError(CheckpointError, ValueError):
    """The URL's protocol is unknown to fsspec, or its implementation is not installed."""


class StorageError(CheckpointError, OSError):
    """Reading or writing the storage failed (disk full, read-only, permission denied, ...).

    ``errno`` carries the underlying OS error number when there was one.
    """

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno  # type: ignore[assignment]

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Something is already committed where this writer meant to create it: of two writers committing
    the same step, the one that came second gets this, and the first one's files are untouched.

    ``location`` names the file or object that exists.
    """

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)  # one argument: OSError's constructor keeps it as the message
        self.errno = _errno.EEXIST
        self.location = location

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument that cannot work, for example ``mmap=True`` on an in-memory stream."""
