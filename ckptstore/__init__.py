"""ckptstore: a tiered asynchronous checkpoint storage engine for PyTorch.

Public API (everything else is private and may change)::

    ckptstore.save(obj, f, *, compression=None, allow_pickle=False, storage_options=None)
    ckptstore.load(f, map_location=None, *, weights_only=True, mmap=False, storage_options=None, verify=None)

    ckptstore.save_sharded(state_dict, url, *, process_group=None, storage_options=None, overwrite=False)
    ckptstore.load_sharded(state_dict, url, *, process_group=None, storage_options=None, strict=True,
                           per_rank="error", buffer_bytes=256 MiB)
    ckptstore.PerRank(value)   # marks a per-rank value (RNG state, loader offset) in a sharded state

    store = ckptstore.CheckpointStore(job, *, local=None, durable=None, durable_every=10, keep_local=3,
                                      keep_durable=None, ram_budget_bytes=None, ram_dir="/dev/shm",
                                      storage_options=None, process_group=None, policy="block",
                                      durable_compression=None, frozen=None, refresh_every=10, timeout_s=600,
                                      peer_replicas=0, peer_every=1, node=None, peer_timeout_s=60,
                                      peer_to_local=False, interval=None, mtbf=None, events=False, sdc="off",
                                      durable_timeout_s=None)
    handle = store.save(step, state)      # a SaveHandle: handle.wait("ram" | "local" | "peer" | "durable")
    store.should_save(step)               # under interval= (seconds, or "auto" with mtbf=): checkpoint now?
    step = store.restore(state)           # newest sound step, in place; None when there is none
    store.restore(state, step=step)       # exactly that step, or CheckpointNotFoundError
    store.latest_step()                   # the newest step any tier holds (collective), without loading it
    store.close()

    ckptstore.TrainState(*, model=None, optimizer=None, scheduler=None, scaler=None, loader=None,
                         extra=None, generators=None)   # save/restore it like a state dict
    ckptstore.ResumableSampler(dataset_len, *, batch_size, seed=0, shuffle=True, rank=None,
                               world_size=None, drop_last=True)
    ckptstore.ResumableLoader(dataset, sampler, **dataloader_kwargs)  # exact position, any world size

plus the exception tree rooted at :class:`CheckpointError` (see ``ckptstore.errors``); an
operation of every rank that failed on some raises a :class:`CollectiveError` carrying each rank's
failure (of their class too, when they share one).

``ckptstore.testing.TierContract`` is the contract suite every tier runs; a third-party tier
subclasses it (needs pytest).

Adapters, imported on first use (``ckptstore.dcp`` works after ``import ckptstore``)::

    ckptstore.dcp.Writer(store) / Reader(store)      # torch.distributed.checkpoint storage on the tiers
    ckptstore.lightning.TieredCheckpointIO(store)    # Lightning CheckpointIO (pip install ckptstore[lightning])
    ckptstore.hf.export_safetensors / import_safetensors / CheckpointCallback   # Hugging Face
"""

from ._version import __version__
from .api.dropin import load, save
from .api.sharded import PerRank, load_sharded, save_sharded
from .data import ResumableLoader, ResumableSampler
from .engine.store import CheckpointStore, SaveHandle
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CollectiveError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
    StorageError,
    UnknownProtocolError,
    UnsupportedFormatVersionError,
    UnsupportedObjectError,
)
from .train_state import TrainState

__all__ = [
    "__version__",
    "save",
    "load",
    "save_sharded",
    "load_sharded",
    "PerRank",
    "CheckpointStore",
    "SaveHandle",
    "TrainState",
    "ResumableSampler",
    "ResumableLoader",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "InvalidArgumentError",
    "NotACheckpointError",
    "PickleNotAllowedError",
    "StorageError",
    "UnknownProtocolError",
    "UnsupportedFormatVersionError",
    "UnsupportedObjectError",
    "CollectiveError",
]


_ADAPTERS = ("dcp", "lightning", "hf")


def __getattr__(name: str) -> object:
    # The adapters import their frameworks, so they load on first use, not with ckptstore.
    if name in _ADAPTERS:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
