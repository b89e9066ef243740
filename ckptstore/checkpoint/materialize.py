"""Turning a single-file container back into objects: the tree, tensors on the devices
``map_location`` chooses, views of shared storages, numpy values and (opted-in) pickles.

Also the small value codec the sharded layout and the engine use for per-rank values: a value as
the bytes of a complete single-file container, and back.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch

from .._buffers import byte_view
from ..errors import CheckpointError, CorruptCheckpointError, InvalidArgumentError, PickleNotAllowedError, also
from ..format import codecs
from ..format.dtypes import dtype_from_name, element_size
from ..format.manifest import Chunk, Manifest, TensorEntry
from ..format.tree import Decoder, grad_flags, npscalar_value, numpy_dtype, parse_device
from ..planning.flatten import plan as make_plan
from ..storage.targets import FileObjectSink, FileObjectSource, Source
from . import transfer
from .memory import alloc_bytes
from .single_file import OpenContainer, open_container, read_entries, slab_range, write_container

MapLocation = Union[  # noqa: UP007 - a runtime alias; X | Y with None first is not valid at runtime
    None, str, torch.device, dict[str, str | torch.device], Callable[[torch.UntypedStorage, str], Any]
]


def check_map_location(map_location: Any) -> None:
    """Refuse a map_location of a kind torch.load does not take, before anything is read; also a
    TypeError, which torch.load raises for it."""
    if map_location is None or isinstance(map_location, (str, torch.device, dict)) or callable(map_location):
        return
    raise also(InvalidArgumentError, TypeError)(
        f"map_location must be None, a str, a torch.device, a dict or a callable, not {type(map_location).__name__}"
    )


def load_container(
    source: Source, map_location: MapLocation, weights_only: bool, mmap: bool, verify: bool | None,
    *, shared_mmap: bool = False,
) -> Any:
    opened = open_container(source)
    manifest = opened.manifest
    if manifest.pickled and weights_only:
        raise PickleNotAllowedError(
            f"{source.display} holds pickled objects ({', '.join(manifest.pickled[:5])}"
            f"{', ...' if len(manifest.pickled) > 5 else ''}); unpickling can run arbitrary code, so "
            "load it with weights_only=False only if you trust where the file came from"
        )
    verify_checksums = (not mmap) if verify is None else verify
    placed = {} if mmap or not verify_checksums else _load_to_devices(opened, map_location)
    buffers = read_entries(opened, [k for k in manifest.tensors if k not in placed], verify_checksums=verify_checksums,
                           use_mmap=mmap, shared=shared_mmap)
    buffers.update(placed)
    result = _Materializer(manifest, buffers, map_location, source.display, weights_only=weights_only).build()
    source.finish(opened.end)
    return result


def _saved_devices(tree: Any, tensors: dict[str, Any], out: dict[str, str]) -> dict[str, str]:
    """Each entry's saved device, from the tree's tensor and view nodes."""
    if isinstance(tree, dict):
        for tag in ("$tensor", "$view"):
            key, device = tree.get(tag), tree.get("device", "cpu")
            if isinstance(key, str) and key in tensors and isinstance(device, str):
                out.setdefault(key, device)
        for value in tree.values():
            _saved_devices(value, tensors, out)
    elif isinstance(tree, list):
        for value in tree:
            _saved_devices(value, tensors, out)
    return out


def _load_to_devices(opened: OpenContainer, map_location: MapLocation) -> dict[str, torch.Tensor]:
    """The entries ``map_location`` sends to a device, read straight into device buffers through
    the load pipeline (pieces verified on the host, then copied on a side stream) instead of into
    host buffers that are copied again; {} when every entry stays on the host or ``map_location`` is
    a function (it is given host storages)."""
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        return {}
    manifest, source = opened.manifest, opened.source
    targets: dict[str, torch.device] = {}
    for key, location in _saved_devices(manifest.tree, manifest.tensors, {}).items():
        target = location if map_location is None else (
            map_location.get(location, location) if isinstance(map_location, dict) else map_location)
        try:
            targets[key] = torch.device(target)
        except (RuntimeError, TypeError):
            continue  # materializing reports it
    engine = transfer.engine_for(targets.values())
    if engine is None:
        return {}
    where = source.display
    out: dict[str, torch.Tensor] = {}
    pieces: list[transfer.Piece] = []
    for key, device in targets.items():
        if not engine.claims_device(device):
            continue
        entry = manifest.tensors[key]
        dtype = dtype_from_name(entry.dtype, where=where)
        es = element_size(dtype)
        buf = out[key] = torch.empty(entry.numel * es, dtype=torch.uint8, device=device)
        for c in entry.chunks:
            pieces.extend(_chunk_pieces(source, entry, c, buf, dtype, es, where, key))
    if out:
        engine.begin(list(out.values()))
        transfer.run_device(pieces, engine, parallel=source.parallel and source.local_path is not None)
    return out


def _chunk_pieces(source: Source, entry: TensorEntry, c: Chunk, buf: torch.Tensor, dtype: torch.dtype, es: int,
                  where: str, key: str) -> list[transfer.Piece]:
    if not c.length:
        return []
    rng = slab_range(entry, c, es)
    bs = c.block_size or 0
    blocks = [(i * bs, sum_) for i, sum_ in enumerate(c.block_checksums)] if c.block_checksums and bs else []
    checks = transfer.checks_of(c.length, c.checksum, blocks, bs)
    if c.codec == "raw" and rng is not None:
        return transfer.flat_pieces(source, c.offset, c.length, checks, buf[rng[0] : rng[0] + rng[1]], 0,
                                    location=where, key=key)

    def place(host: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raw = host
        if c.codec != "raw":
            raw = alloc_bytes(c.numel * es)
            codecs.decode_into(c.codec, bytes(byte_view(host)), raw, es, where=f"{where}: tensor {key!r}")
        if rng is not None:
            return [(buf[rng[0] : rng[0] + rng[1]], raw)]
        region = buf.view(dtype).view(entry.shape)
        for d, (o, n) in enumerate(zip(c.offsets, c.sizes)):
            region = region.narrow(d, o, n)
        return [(region, raw.view(dtype).view(c.sizes))]

    return [transfer.Piece(source, c.offset, c.length, checks, place, where, key)]


class _Materializer:
    """Turns the manifest tree plus raw entry buffers back into the user's objects."""

    def __init__(
        self,
        manifest: Manifest,
        buffers: dict[str, torch.Tensor],
        map_location: MapLocation,
        where: str,
        *,
        weights_only: bool,
    ) -> None:
        self.manifest, self.buffers, self.where = manifest, buffers, where
        self.weights_only = weights_only
        self.map_location = map_location
        self.objects: dict[int, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}
        self._decoder = Decoder(self.resolve, where)

    def build(self) -> Any:
        return self._decoder.decode(self.manifest.tree)

    def bad(self, msg: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {msg}", location=self.where, key=key)

    def entry_buffer(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.buffers:
            raise self.bad(f"tree refers to tensor {key!r}, which the manifest does not have")
        return self.buffers[key]

    def resolve(self, tag: str, node: dict[str, Any]) -> Any:
        if tag == "$npscalar":
            return npscalar_value(node, self.bad)
        if tag == "$pickle":
            key = node["$pickle"]
            # Checked here too, not only against the manifest's `pickled` list in load(): a crafted
            # tree could point a $pickle node at an entry that list does not name.
            if self.weights_only or key not in self.manifest.pickled:
                raise PickleNotAllowedError(
                    f"{self.where}: {key!r} is a pickled object"
                    + (" not declared in the manifest's 'pickled' list; refusing it" if key not in self.manifest.pickled
                       else "; load with weights_only=False only if you trust where the file came from")
                )
            data = byte_view(self.entry_buffer(key))
            try:
                return pickle.loads(data)  # noqa: S301
            except Exception as exc:
                # The bytes passed their checksum: the failure is the object's own unpickling (a
                # class that moved or changed, or torch's own code), not damage. Also of its class,
                # as torch.load(weights_only=False) would raise it.
                raise also(CheckpointError, type(exc))(
                    f"{self.where}: the pickled object {key!r} is intact (its checksum matches), but unpickling it "
                    f"failed with {type(exc).__name__}: {exc}. The code that unpickles it (its class, or torch) "
                    "cannot rebuild it in this environment; load it where that class is as it was at save time"
                ) from exc
        if tag == "$ndarray":
            dt = numpy_dtype(node["dtype"], self.bad)
            shape = tuple(node["shape"])
            raw = self.entry_buffer(node["$ndarray"]).numpy()
            if len(raw) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                raise self.bad(f"ndarray {node['$ndarray']!r} has {len(raw)} bytes, shape {shape} needs more")
            return raw.view(dt).reshape(shape)
        if tag == "$per_rank":
            raise self.bad(f"{node['$per_rank']!r} is a per-rank value, which only sharded checkpoints hold")
        obj_id = node.get("obj")
        if obj_id in self.objects:
            return self.objects[obj_id]
        tensor = self.tensor(node) if tag == "$tensor" else self.view(node)
        tensor = grad_flags(tensor, node, lambda message: self.bad(message, node[tag]))
        if obj_id is not None:
            self.objects[obj_id] = tensor
        return tensor

    def placed(self, key: str, location: str) -> torch.Tensor:
        """The entry's flat byte buffer on the device ``map_location`` chooses (once per entry)."""
        parse_device(location, self._decoder)  # a saved device name that torch cannot parse is damage
        if key not in self.bases:
            self.bases[key] = _relocate(self.entry_buffer(key), location, self.map_location)
        return self.bases[key]

    def tensor(self, node: dict[str, Any]) -> torch.Tensor:
        key = node["$tensor"]
        entry = self.manifest.tensors.get(key)
        if entry is None:
            raise self.bad(f"tree refers to tensor {key!r}, which the manifest does not have")
        base = self.placed(key, node.get("device", "cpu"))
        dtype = dtype_from_name(entry.dtype, where=self.where)
        flat = base.view(dtype) if base.numel() else _empty(dtype, base.device)
        return flat.view(entry.shape)

    def view(self, node: dict[str, Any]) -> torch.Tensor:
        key = node["$view"]
        base = self.placed(key, node.get("device", "cpu"))
        dtype = dtype_from_name(node["dtype"], where=self.where)
        shape, stride, offset = tuple(node["shape"]), tuple(node["stride"]), node["offset"]
        es = dtype.itemsize
        if any(type(x) is not int or x < 0 for x in (*shape, *stride, offset)) or len(shape) != len(stride):
            raise self.bad(f"view of {key!r} has a malformed shape/stride/offset", key)
        needed = (offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1) * es if all(shape) else 0
        if needed > base.numel() * base.element_size():
            raise self.bad(f"view of {key!r} reaches past the end of its storage", key)
        start = base.storage_offset() * base.element_size()
        if start % es:
            raise self.bad(f"view of {key!r} is misaligned for {dtype}", key)
        return _empty(dtype, base.device).set_(base.untyped_storage(), start // es + offset, shape, stride)


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Through uint8: allocating some dtypes directly warns (complex32 is "experimental").
    return torch.empty(0, dtype=torch.uint8, device=device).view(dtype)


def _relocate(buf: torch.Tensor, location: str, map_location: MapLocation) -> torch.Tensor:
    """Apply torch.load's map_location rules to one storage saved at ``location``."""
    if map_location is None:
        target: Any = location
    elif isinstance(map_location, (str, torch.device)):
        target = map_location
    elif isinstance(map_location, dict):
        target = map_location.get(location, location)
    elif callable(map_location):
        result = map_location(buf.untyped_storage(), location)
        if result is None:
            target = location
        else:
            storage = getattr(result, "_untyped_storage", result)
            if not isinstance(storage, torch.UntypedStorage):
                raise InvalidArgumentError(
                    f"map_location returned {type(result).__name__}; it must return a storage or None"
                )
            return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    else:
        raise InvalidArgumentError(
            f"map_location must be None, a str, a torch.device, a dict or a callable, not {type(map_location).__name__}"
        )
    device = torch.device(target)
    if device.type == buf.device.type and (device.index is None or device == buf.device):
        return buf
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            f"a tensor was saved on {location}, but CUDA is not available here; pass map_location='cpu' "
            "(or another device) to load it"
        )
    return buf.to(device)




def encode_value(value: Any) -> bytes:
    """``value`` as the bytes of a complete single-file container (no pickle)."""
    buf = io.BytesIO()
    write_container(make_plan(value), FileObjectSink(buf, "<value>"))
    return buf.getvalue()


def decode_value(data: bytes, where: str) -> Any:
    """The value :func:`encode_value` encoded, checksums verified, pickles refused."""
    return load_container(FileObjectSource(io.BytesIO(data), where), None, True, False, None)
