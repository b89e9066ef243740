"""ckptstore: a tiered asynchronous checkpoint storage engine for PyTorch.

Public API (everything else is private and may change)::

    ckptstore.save(obj, f, *, compression=None, allow_pickle=False, storage_options=None)
    ckptstore.load(f, map_location=None, *, weights_only=True, mmap=False, storage_options=None, verify=None)

plus the exception tree rooted at :class:`CheckpointError` (see ``ckptstore.errors``).
"""

from ._version import __version__
from .api.dropin import load, save
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
    StorageError,
    UnknownProtocolError,
    UnsupportedFormatVersionError,
    UnsupportedObjectError,
)

__all__ = [
    "__version__",
    "save",
    "load",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "InvalidArgumentError",
    "NotACheckpointError",
    "PickleNotAllowedError",
    "StorageError",
    "UnknownProtocolError",
    "UnsupportedFormatVersionError",
    "UnsupportedObjectError",
]
