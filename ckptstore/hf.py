"""Hugging Face: safetensors shards with an index, and a Trainer callback over a CheckpointStore.

::

    ckptstore.hf.export_safetensors(model.state_dict(), "out", max_shard_size="2GB")
    # out/model-00001-of-00003.safetensors ... + out/model.safetensors.index.json (from_pretrained's layout)
    state = ckptstore.hf.import_safetensors("out")            # {name: tensor}, every file checked

    ckptstore.hf.export_step(store, "out", key="model")       # the newest step's model, from any tier

    trainer = transformers.Trainer(..., args=TrainingArguments(save_strategy="no", ...),
                                   callbacks=[ckptstore.hf.CheckpointCallback(store, every=100)])
    ckptstore.hf.write_trainer_checkpoint(store, "resume")    # the newest step as a Trainer checkpoint
    trainer.train(resume_from_checkpoint="resume")

The layout is the one ``save_pretrained`` writes and ``from_pretrained`` reads: one
``model.safetensors`` when everything fits in one shard, else ``model-0000k-of-0000n.safetensors``
files of at most ``max_shard_size`` each (a tensor larger than that gets a file of its own) and a
``model.safetensors.index.json`` mapping every tensor name to its file. Tensors that share storage
(tied weights) are written once each, as copies, so every name loads on its own.

``CheckpointCallback`` snapshots the model, optimizer, scheduler, trainer state and RNG states
into the store every ``every`` optimizer steps: the training loop pays the copy into RAM, the tiers
follow in the background. ``write_trainer_checkpoint`` turns a step back into the directory the
Trainer's own ``resume_from_checkpoint`` reads, so resuming keeps the Trainer's logic (data skipping,
RNG) and the weights come from the newest sound copy in RAM, local or durable.

Only ``safetensors`` (``pip install 'ckptstore[safetensors]'``) is needed for the files;
``transformers`` (``pip install 'ckptstore[hf]'``) only for the callback.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

import torch

from ._adapters import require
from ._units import parse_size
from .checkpoint.sharded import PerRank
from .engine.store import CheckpointStore
from .errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError, UnsupportedObjectError

__all__ = ["export_safetensors", "import_safetensors", "export_step", "CheckpointCallback", "write_trainer_checkpoint"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _st() -> Any:
    return require("safetensors.torch", "safetensors", "ckptstore.hf safetensors export/import")


def export_safetensors(state_dict: Mapping[str, torch.Tensor], directory: str | os.PathLike[str], *,
                       max_shard_size: int | str = "5GB", overwrite: bool = False) -> list[str]:
    """Write ``state_dict`` (tensor names to tensors) into ``directory`` as ``from_pretrained`` reads
    it; returns the file names written, the index last. Other files in the directory (config.json)
    stay. An existing ``model.safetensors`` or index is refused unless ``overwrite=True``; then the
    new files replace the old ones and old shards that the new index does not name are removed."""
    st = _st()
    limit = parse_size(max_shard_size, "max_shard_size")
    directory = os.fspath(directory)
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(f"export_safetensors needs a mapping of names to tensors, not {type(state_dict).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state_dict.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise UnsupportedObjectError(
                f"export_safetensors: {name!r} is {type(t).__name__}; pass a flat state dict of tensors "
                "(model.state_dict()); other values have no place in safetensors weights"
            )
        t = t.detach().to("cpu")
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        # safetensors refuses tensors that share memory (tied weights, views of one fused tensor)
        # or are not contiguous: every one after the first on a storage is written as a copy.
        tensors[name] = t.clone(memory_format=torch.contiguous_format) if key in seen or not t.is_contiguous() else t
        seen.add(key)
    os.makedirs(directory, exist_ok=True)
    old = [n for n in os.listdir(directory) if n in (WEIGHTS, INDEX) or _SHARD.match(n)]
    if old and not overwrite:
        raise InvalidArgumentError(
            f"{directory} already holds safetensors weights ({', '.join(sorted(old)[:3])}); pass overwrite=True to "
            "replace them, or export into another directory"
        )
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, keys in zip(names, shards):
        _atomic(os.path.join(directory, fname), lambda p, keys=keys: st.save_file(
            {k: tensors[k] for k in keys}, p, metadata={"format": "pt"}))
    written = list(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys}}
        body = json.dumps(index, indent=2, sort_keys=True).encode()
        _atomic(os.path.join(directory, INDEX), lambda p: _write(p, body))
        written.append(INDEX)
    for stale in old:
        if stale not in written:
            os.unlink(os.path.join(directory, stale))
    return written


def _write(path: str, body: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(body)


def _atomic(path: str, write: Any) -> None:
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def import_safetensors(directory: str | os.PathLike[str], *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read the weights of a ``save_pretrained`` directory (index and shards, or one
    ``model.safetensors``) into ``{name: tensor}``, checking that every file the index names
    exists and holds exactly the tensors the index gives it."""
    st = _st()
    directory = os.fspath(directory)
    index_path = os.path.join(directory, INDEX)
    if not os.path.exists(index_path):
        single = os.path.join(directory, WEIGHTS)
        if not os.path.exists(single):
            raise CheckpointNotFoundError(f"{directory} has neither {INDEX} nor {WEIGHTS}: no safetensors weights there")
        return dict(st.load_file(single, device=device))
    try:
        with open(index_path, "rb") as fh:
            weight_map = json.load(fh)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of names to files")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{index_path} is not a safetensors index ({exc})", location=index_path) from None
    by_file: dict[str, set[str]] = {}
    for name, fname in weight_map.items():
        if os.path.basename(fname) != fname:
            raise CorruptCheckpointError(f"{index_path}: {name!r} is in {fname!r}, outside the directory", location=index_path)
        by_file.setdefault(fname, set()).add(name)
    out: dict[str, torch.Tensor] = {}
    for fname, names in sorted(by_file.items()):
        path = os.path.join(directory, fname)
        if not os.path.exists(path):
            raise CorruptCheckpointError(f"{path} is missing, but {INDEX} keeps {len(names)} tensor(s) in it", location=path)
        loaded = st.load_file(path, device=device)
        if set(loaded) != names:
            extra, missing = sorted(set(loaded) - names), sorted(names - set(loaded))
            raise CorruptCheckpointError(
                f"{path} does not hold what {INDEX} says: missing {missing[:5]}, unlisted {extra[:5]}", location=path
            )
        out.update(loaded)
    return {name: out[name] for name in weight_map}


def export_step(store: CheckpointStore, directory: str | os.PathLike[str], *, key: str = "model",
                step: int | None = None, max_shard_size: int | str = "5GB", overwrite: bool = False) -> int:
    """Export the state dict under ``key`` of a step of ``store`` (the newest sound one, or
    ``step``) as safetensors shards; returns the step. Collective when the store spans ranks."""
    state: dict[str, Any] = {key: None}
    if step is None:
        found = store.restore(state, resume=False)  # an export reads: it removes nothing
        if found is None:
            raise CheckpointNotFoundError(f"job {store.job} has no checkpoint in any tier")
        step = found
    else:
        store.restore(state, step=step, resume=False)
    weights = state[key]
    if not isinstance(weights, Mapping):
        raise InvalidArgumentError(f"step {step} of job {store.job}: {key!r} is {type(weights).__name__}, not a state dict")
    if store.rank == 0:
        export_safetensors(weights, directory, max_shard_size=max_shard_size, overwrite=overwrite)
    return step


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _callback_base() -> Any:
    return require("transformers", "hf", "ckptstore.hf.CheckpointCallback").TrainerCallback


def CheckpointCallback(store: CheckpointStore, *, every: int) -> Any:  # noqa: N802 - builds a TrainerCallback
    """A ``transformers.TrainerCallback`` that snapshots training into ``store`` every ``every``
    optimizer steps and at the end of training (see the module docstring). Each snapshot holds
    ``model``, ``optimizer``, ``scheduler`` (state dicts), ``trainer_state`` (the Trainer's JSON)
    and ``rng``; the store's step is the Trainer's global step."""
    if not isinstance(store, CheckpointStore):
        raise InvalidArgumentError(f"CheckpointCallback needs a CheckpointStore, not {type(store).__name__}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgumentError(f"every must be a positive int, not {every!r}")
    base = _callback_base()

    class _Callback(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            self.store, self.every = store, every
            self.handles: list[Any] = []
            self.last: int | None = None

        def _snapshot(self, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
            step = int(state.global_step)
            if step == self.last:
                return
            import dataclasses

            trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"  # its save_to_json
            snap = {"model": model.state_dict(), "trainer_state": trainer_state,
                    "rng": PerRank(_rng_state())}  # per rank, and PerRank values keep numpy arrays
            if optimizer is not None:
                snap["optimizer"] = optimizer.state_dict()
            if lr_scheduler is not None:
                snap["scheduler"] = lr_scheduler.state_dict()
            self.handles = [h for h in self.handles if not h.done("durable")]
            self.handles.append(self.store.save(step, snap))
            self.last = step

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                        lr_scheduler: Any = None, **kwargs: Any) -> None:
            if state.global_step % self.every == 0:
                self._snapshot(state, model, optimizer, lr_scheduler)

        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                         lr_scheduler: Any = None, **kwargs: Any) -> None:
            self._snapshot(state, model, optimizer, lr_scheduler)
            for h in self.handles:  # surfaces a background failure before the run reports success
                h.wait("local")

    _Callback.__name__ = _Callback.__qualname__ = "CheckpointCallback"
    return _Callback()


def write_trainer_checkpoint(store: CheckpointStore, directory: str | os.PathLike[str], *,
                             step: int | None = None) -> int:
    """Write a step of ``store`` saved by :func:`CheckpointCallback` (the newest sound one, or
    ``step``) as a Trainer checkpoint directory (safetensors weights, ``optimizer.pt``,
    ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``) for
    ``trainer.train(resume_from_checkpoint=directory)``; returns the step. The ``.pt`` files are
    ``torch.save`` files because that is what the Trainer reads."""
    state: dict[str, Any] = {"model": None, "optimizer": None, "scheduler": None, "trainer_state": None,
                             "rng": PerRank(None)}
    if step is None:
        found = store.restore(state, resume=False)  # an export reads: it removes nothing
        if found is None:
            raise CheckpointNotFoundError(f"job {store.job} has no checkpoint in any tier")
        step = found
    else:
        store.restore(state, step=step, resume=False)
    directory = os.fspath(directory)
    export_safetensors(state["model"], directory, overwrite=True)
    state["rng"] = state["rng"].value
    for name, key in (("optimizer.pt", "optimizer"), ("scheduler.pt", "scheduler"), ("rng_state.pth", "rng")):
        if state[key] is not None:
            _atomic(os.path.join(directory, name), lambda p, v=state[key]: torch.save(v, p))
    body = state["trainer_state"].encode()
    _atomic(os.path.join(directory, "trainer_state.json"), lambda p: _write(p, body))
    return step
