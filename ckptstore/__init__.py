"""ckptstore: a tiered asynchronous checkpoint storage engine for PyTorch.

Public API (everything else is private and may change)::

    ckptstore.save(obj, f, *, compression=None, allow_pickle=False, storage_options=None)
    ckptstore.load(f, map_location=None, *, weights_only=True, mmap=False, storage_options=None, verify=None)

    ckptstore.save_sharded(state_dict, url, *, process_group=None, storage_options=None, overwrite=False)
    ckptstore.load_sharded(state_dict, url, *, process_group=None, storage_options=None, strict=True,
                           per_rank="error", buffer_bytes=256 MiB)
    ckptstore.PerRank(value)   # marks a per-rank value (RNG state, loader offset) in a sharded state

plus the exception tree rooted at :class:`CheckpointError` (see ``ckptstore.errors``).
"""

from ._version import __version__
from .api.dropin import load, save
from .api.sharded import PerRank, load_sharded, save_sharded
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
    "save_sharded",
    "load_sharded",
    "PerRank",
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
