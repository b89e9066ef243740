"""A Lightning ``CheckpointIO`` that checkpoints through a :class:`ckptstore.CheckpointStore`.

::

    import lightning as L
    from ckptstore.lightning import TieredCheckpointIO

    io = TieredCheckpointIO(lambda: ckptstore.CheckpointStore("run-42", local="/nvme/ckpt",
                                                               durable="s3://bucket/run-42"))
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_epochs=1)])
    trainer.fit(model, ckpt_path="last")          # resumes from the store when a checkpoint exists

Each ``save_checkpoint`` is one step of the store: it returns once the checkpoint is staged in the
store's RAM tier (the training loop pays only that copy), and the local and durable tiers follow in
the background, so no ``AsyncCheckpointIO`` wrapper is needed. At the path Lightning asked for it
writes a small JSON pointer (job and step), so ``ModelCheckpoint``'s bookkeeping (top-k, ``last``,
removal, ``ckpt_path``) works unchanged; ``load_checkpoint`` follows the pointer and restores
exactly that step from the newest sound copy in RAM, local or durable. Removing a pointer leaves
the step to the store's retention (``keep_local``, ``keep_durable``), and retention does not know
which pointers ``ModelCheckpoint`` still keeps: a pointer whose step every tier has retired raises
``CheckpointNotFoundError`` on load, so keep a tier whose retention covers the checkpoints you
keep (``keep_durable=None``, the default, keeps every promoted step). A path that holds a regular
checkpoint file instead of a pointer loads through :func:`ckptstore.load` (``torch.save`` files
included).

The checkpoint dict is stored like any ``store.save`` state: tensors, nested containers and plain
values; an object ckptstore cannot store without pickle (say, an argparse Namespace among the
hyper-parameters) raises :class:`ckptstore.UnsupportedObjectError`. ``LightningModule.load_from_checkpoint``
reads the file at a path with ``torch.load`` itself, bypassing any CheckpointIO; load a pointer with
``TieredCheckpointIO.load_checkpoint(path)`` and ``module.load_state_dict(ckpt["state_dict"])`` instead.
Pointers are written to local paths. Lightning writes checkpoints
from global rank 0 only, so under DDP give the plugin a factory: it builds the store in the
process that saves, over that process alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ._adapters import MissingDependencyError, next_step, require
from .engine.store import CheckpointStore, SaveHandle
from .errors import CheckpointError, InvalidArgumentError


def _base() -> Any:
    try:
        return require("lightning.fabric.plugins.io.checkpoint_io", "lightning", "ckptstore.lightning").CheckpointIO
    except MissingDependencyError as missing:
        try:  # the standalone pytorch_lightning distribution
            import lightning_fabric.plugins.io.checkpoint_io as standalone
        except ImportError:
            raise missing from None
        return standalone.CheckpointIO


_Base: Any = _base()

__all__ = ["TieredCheckpointIO", "MissingDependencyError"]

POINTER_FORMAT = "ckptstore.lightning/1"


class TieredCheckpointIO(_Base):
    """Lightning ``CheckpointIO`` over a CheckpointStore (see the module docstring).

    ``store``: a CheckpointStore, or a zero-argument callable that builds one on first use (in
    the process that saves or loads; the plugin closes a store it built at ``teardown``).
    """

    def __init__(self, store: CheckpointStore | Callable[[], CheckpointStore]) -> None:
        super().__init__()
        if not isinstance(store, CheckpointStore) and not callable(store):
            raise InvalidArgumentError(
                f"TieredCheckpointIO needs a CheckpointStore or a callable that builds one, not {type(store).__name__}"
            )
        self._store = store if isinstance(store, CheckpointStore) else None
        self._factory = None if isinstance(store, CheckpointStore) else store
        self.handles: list[SaveHandle] = []  # the saves not yet known to have reached every tier

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            assert self._factory is not None
            store = self._factory()
            if not isinstance(store, CheckpointStore):
                raise InvalidArgumentError(f"the store factory returned {type(store).__name__}, not a CheckpointStore")
            self._store = store
        return self._store

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(
                "TieredCheckpointIO takes no storage_options: the store's tiers decide where data goes"
            )
        store = self.store
        step = next_step(store)
        self.handles = [h for h in self.handles if not h.done("durable")]
        self.handles.append(store.save(step, checkpoint))
        pointer = {"format": POINTER_FORMAT, "job": store.job, "step": step, "keys": list(checkpoint)}
        _write_pointer(os.fspath(path), json.dumps(pointer).encode())

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(path)
        pointer = _read_pointer(path)
        if pointer is None:
            import ckptstore

            loaded: dict[str, Any] = ckptstore.load(path, map_location=map_location)
            return loaded
        store = self.store
        if pointer["job"] != store.job:
            raise CheckpointError(
                f"{path} points to step {pointer['step']} of job {pointer['job']!r}, but this plugin's store is job "
                f"{store.job!r}; build the store with job={pointer['job']!r} to resume it"
            )
        state: dict[str, Any] = {k: None for k in pointer["keys"]}
        store.restore(state, step=int(pointer["step"]))
        return state

    def remove_checkpoint(self, path: Any) -> None:
        try:
            os.unlink(os.fspath(path))
        except FileNotFoundError:
            pass

    def teardown(self) -> None:
        """Wait until every save reached each of its tiers (re-raising a background failure);
        close the store when the plugin built it."""
        handles, self.handles = self.handles, []
        for h in handles:
            for tier in ("local", "peer", "durable"):
                h.wait(tier)
        if self._factory is not None and self._store is not None:
            store, self._store = self._store, None
            store.close()


def _write_pointer(path: str, body: bytes) -> None:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_pointer(path: str) -> dict[str, Any] | None:
    """The pointer at ``path``, or None when the file is something else (a regular checkpoint)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: no checkpoint to load there") from None
    if not head.startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    if not isinstance(doc.get("step"), int) or not isinstance(doc.get("keys"), list) or not isinstance(doc.get("job"), str):
        raise CheckpointError(f"{path}: a ckptstore.lightning pointer without a valid job, step and keys")
    return doc
