"""torch.distributed.checkpoint storage backed by a :class:`ckptstore.CheckpointStore`.

::

    store = ckptstore.CheckpointStore("run-42", local="/nvme/ckpt", durable="s3://bucket/run-42")
    dcp.save(state_dict, storage_writer=ckptstore.dcp.Writer(store), checkpoint_id=100)  # returns once in RAM
    dcp.load(state_dict, storage_reader=ckptstore.dcp.Reader(store))                     # newest sound step

A DCP save is one step of the store: ``checkpoint_id`` is the step (an int, or a string of
digits); without one, the step after the newest the store has saved or restored. ``dcp.save``
returns once this rank's pieces are staged in the store's RAM tier; the local and durable tiers
follow in the background, as for ``store.save`` (``Writer.handle`` is the step's
:class:`~ckptstore.SaveHandle`). ``dcp.async_save`` works too (DCP stages a CPU copy first, then
runs the same save in its thread). A load reads the step named by ``checkpoint_id``, or the newest
step every rank can load a sound copy of, from RAM, the local directory, peers or the durable URL.

Each DCP write item becomes a box of a global tensor in the store's sharded manifest, so every
tier holds an ordinary ckptstore checkpoint (``ckptstore inspect``, ``load_sharded`` and
``ckptstore convert`` read it without DCP), and DCP's load planner reshards it to any world size or
sharding. The metadata DCP needs to plan a load is rebuilt from a JSON description stored with the
step, never unpickled; non-tensor values are the bytes DCP's planner produced (``torch.save``
payloads) and go back to the planner's ``load_bytes``, which is DCP's own choice of format.

The collectives a save and a load need run on the store's own process groups, so the store must
span the same ranks as DCP's process group. Do not use the store from another thread while a DCP
save or load through it is running.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ._adapters import next_step
from .checkpoint.sharded import GlobalBox
from .engine.store import CheckpointStore, SaveHandle
from .errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError, UnsupportedObjectError
from .format.dtypes import dtype_from_name, dtype_name

__all__ = ["Writer", "Reader"]

_FORMAT = "ckptstore.dcp/1"
_DATA, _META = "dcp", "dcp_meta"


def _step_of(checkpoint_id: Any) -> int | None:
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return int(checkpoint_id)
    raise InvalidArgumentError(
        f"checkpoint_id={checkpoint_id!r}: with ckptstore.dcp the checkpoint id is the store's step, a non-negative int"
    )


def _valid_id(checkpoint_id: Any) -> bool:
    try:
        return _step_of(checkpoint_id) is not None
    except InvalidArgumentError:
        return False


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that saves each checkpoint as one step of ``store``.

    ``step``: the step of the next save when ``dcp.save`` gets no ``checkpoint_id``.
    """

    def __init__(self, store: CheckpointStore, *, step: int | None = None) -> None:
        super().__init__()
        if not isinstance(store, CheckpointStore):
            raise InvalidArgumentError(f"ckptstore.dcp.Writer needs a ckptstore.CheckpointStore, not {type(store).__name__}")
        self.store = store
        self._step = _step_of(step)
        self._planner_data: Any = None
        self.handle: SaveHandle | None = None

    @property
    def checkpoint_id(self) -> int | None:
        return self._step

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._step = _step_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._planner_data = plan.planner_data  # DCP's key -> state-dict path mapping, kept with the step
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        store = self.store
        step = self._step
        if step is None:
            step = next_step(store)
        error: str | None = None
        mine: dict[str, Any] = {}
        pieces: dict[str, list[tuple[torch.Tensor, tuple[int, ...]]]] = {}
        results: list[WriteResult] = []
        described: dict[str, Any] = {"tensors": {}, "bytes": {}, "planner_data": None}
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    mine[fqn] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                    described["bytes"][fqn] = len(raw)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=step))
                    continue
                td = item.tensor_data
                assert td is not None
                tensor: torch.Tensor = data.detach()  # type: ignore[union-attr,assignment]
                name = dtype_name(td.properties.dtype)
                if name is None:
                    raise UnsupportedObjectError(f"{fqn!r}: {td.properties.dtype} tensors cannot be stored")
                # A rank may hold several chunks of one tensor (a ShardedTensor with several local
                # shards): each is a box of its own in the store.
                pieces.setdefault(fqn, []).append((tensor, tuple(td.chunk.offsets)))
                entry = described["tensors"].setdefault(fqn, {"dtype": name, "size": list(td.size), "chunks": []})
                entry["chunks"].append([list(td.chunk.offsets), list(td.chunk.sizes)])
                results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                           storage_data=step))
            described["planner_data"] = self._planner_data
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below first
            error = f"rank {store.rank}: {exc}"
            failure: BaseException = exc
        # Every rank needs the whole job's structure (its own pieces are a part of it); the gather
        # is also where a failure on one rank reaches the others, so nobody waits in store.save.
        everyone = store.all_gather({"error": error, "step": step, "described": described})
        errors = [e["error"] for e in everyone if e["error"]]
        if errors:
            if error is not None and store.world == 1:
                raise failure
            raise CheckpointError("ckptstore.dcp: preparing the save failed: " + "; ".join(errors))
        if len({e["step"] for e in everyone}) > 1:
            raise InvalidArgumentError(f"ranks chose different steps for one DCP save: {[e['step'] for e in everyone]}")
        meta = _merge([e["described"] for e in everyone])
        boxes: dict[str, Any] = {}
        for fqn, t in meta["tensors"].items():
            dtype = dtype_from_name(t["dtype"], where=fqn)
            held = pieces.get(fqn, [])
            first, offsets = held[0] if held else (None, (0,) * len(t["size"]))
            boxes[fqn] = GlobalBox(first, offsets, tuple(t["size"]), dtype, more=held[1:])
        for fqn, n in meta["bytes"].items():
            boxes[fqn] = GlobalBox(mine.get(fqn), (0,), (n,), torch.uint8)
        self.handle = store.save(step, {_DATA: boxes, _META: meta})
        self._step = None  # the next save without checkpoint_id takes the step after this one
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # the step is committed by the store's pipeline; the metadata is in the step already

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _valid_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self._step is None else str(self._step))


def _merge(described: list[dict[str, Any]]) -> dict[str, Any]:
    """One description of the whole checkpoint from every rank's part of it (in rank order, so the
    result is the same everywhere)."""
    tensors: dict[str, Any] = {}
    byte_items: dict[str, int] = {}
    planner_data: Any = None
    for d in described:
        for fqn, t in d["tensors"].items():
            have = tensors.setdefault(fqn, {"dtype": t["dtype"], "size": t["size"], "chunks": []})
            if have["dtype"] != t["dtype"] or have["size"] != t["size"]:
                raise InvalidArgumentError(
                    f"{fqn!r}: ranks disagree on its dtype or global size ({have['dtype']} {have['size']} against "
                    f"{t['dtype']} {t['size']})"
                )
            have["chunks"].extend(t["chunks"])
        byte_items.update(d["bytes"])
        if isinstance(d["planner_data"], dict):
            planner_data = {**(planner_data or {}), **d["planner_data"]}
        elif d["planner_data"] is not None and planner_data is None:
            planner_data = d["planner_data"]
    both = set(tensors) & set(byte_items)
    if both:
        raise InvalidArgumentError(f"{sorted(both)[:5]}: saved as a tensor by one rank and as bytes by another")
    if isinstance(planner_data, dict):
        # DCP's default planner maps each flattened key to its path as a tuple; JSON keeps lists.
        planner_data = {k: list(v) if isinstance(v, tuple) else v for k, v in planner_data.items()}
    return {"format": _FORMAT, "tensors": dict(sorted(tensors.items())), "bytes": dict(sorted(byte_items.items())),
            "planner_data": planner_data}


class Reader(StorageReader):
    """A DCP ``StorageReader`` that loads a step of ``store``: ``step`` (or the ``checkpoint_id``
    given to ``dcp.load``), else the newest step every rank can load a sound copy of."""

    def __init__(self, store: CheckpointStore, *, step: int | None = None) -> None:
        super().__init__()
        if not isinstance(store, CheckpointStore):
            raise InvalidArgumentError(f"ckptstore.dcp.Reader needs a ckptstore.CheckpointStore, not {type(store).__name__}")
        self.store = store
        self._want = _step_of(step)
        self.step: int | None = None  # the step read, once read_metadata has run
        self._meta: dict[str, Any] = {}

    @property
    def checkpoint_id(self) -> int | None:
        return self._want

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._want = _step_of(checkpoint_id)

    # No **kwargs: DCP would then retry a failed read asking for per-rank metadata, which a
    # store does not keep, and bury the real error under that one.
    def read_metadata(self) -> Metadata:  # type: ignore[override]
        state: dict[str, Any] = {_META: None}
        if self._want is None:
            step = self.store.restore(state)
            if step is None:
                raise CheckpointNotFoundError(f"job {self.store.job} has no checkpoint in any tier")
        else:
            step = self._want
            self.store.restore(state, step=step)
        meta = state[_META]
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CheckpointError(
                f"step {step} of job {self.store.job} was not saved through ckptstore.dcp.Writer; load it with "
                "store.restore or ckptstore.load_sharded"
            )
        self.step, self._meta = step, meta
        return _metadata(meta, step)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.step is None:
            raise CheckpointError("ckptstore.dcp.Reader: read_metadata must run before read_data")
        # Each read item is a box of a stored global tensor (the stored chunk's offsets plus the
        # offsets within it). The items of one key are read as the one box that bounds them, so
        # the store reads each byte once whatever chunks it was saved in, then handed out.
        by_key: dict[str, list[Any]] = {}
        for item in plan.items:
            by_key.setdefault(item.storage_index.fqn, []).append(item)
        boxes: dict[str, Any] = {}
        spans: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        direct: dict[str, torch.Tensor] = {}
        for fqn, items in by_key.items():
            if items[0].type == LoadItemType.BYTE_IO:
                n = self._meta["bytes"][fqn]
                boxes[fqn] = GlobalBox(torch.empty(n, dtype=torch.uint8), (0,), (n,), torch.uint8)
                continue
            t = self._meta["tensors"][fqn]
            dtype = dtype_from_name(t["dtype"], where=fqn)
            starts = [[o + s for o, s in zip(i.storage_index.offset, i.storage_offsets)] for i in items]
            lo = tuple(min(s[d] for s in starts) for d in range(len(t["size"])))
            hi = tuple(max(s[d] + i.lengths[d] for s, i in zip(starts, items)) for d in range(len(t["size"])))
            sizes = tuple(h - lo_d for h, lo_d in zip(hi, lo))
            target = None
            if len(items) == 1:
                # The common case, no resharding: read straight into the caller's tensor.
                dest = planner.resolve_tensor(items[0]).detach()
                if dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype and tuple(dest.shape) == sizes:
                    target = direct[fqn] = dest
            if target is None:
                target = torch.empty(sizes, dtype=dtype)
            boxes[fqn] = GlobalBox(target, lo, tuple(t["size"]), dtype)
            spans[fqn] = (lo, sizes)
        self.store.restore({_DATA: boxes}, step=self.step)
        for fqn, items in by_key.items():
            box = boxes[fqn]
            assert box.tensor is not None
            if items[0].type == LoadItemType.BYTE_IO:
                for item in items:
                    planner.load_bytes(item, io.BytesIO(box.tensor.numpy().tobytes()))
                continue
            lo = spans[fqn][0]
            for item in items:
                if fqn in direct:
                    planner.commit_tensor(item, direct[fqn])
                    continue
                piece = box.tensor
                for d, (o, s) in enumerate(zip(item.storage_index.offset, item.storage_offsets)):
                    piece = piece.narrow(d, o + s - lo[d], item.lengths[d])
                dest = planner.resolve_tensor(item).detach()
                dest.copy_(piece)
                planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _valid_id(checkpoint_id)


def _metadata(meta: dict[str, Any], step: int) -> Metadata:
    sd: dict[str, Any] = {}
    for fqn, t in meta["tensors"].items():
        dtype = dtype_from_name(t["dtype"], where=fqn)
        chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in t["chunks"]]
        sd[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(t["size"]), chunks=chunks)
    for fqn in meta["bytes"]:
        sd[fqn] = BytesStorageMetadata()
    planner_data = meta.get("planner_data")
    if isinstance(planner_data, dict):
        planner_data = {k: tuple(v) if isinstance(v, list) else v for k, v in planner_data.items()}
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_meta=StorageMeta(checkpoint_id=str(step)))

