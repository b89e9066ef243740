"""``ckptstore.save`` / ``ckptstore.load``: drop-in replacements for ``torch.save`` / ``torch.load``."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch

from .._buffers import byte_view
from ..engine.single_file import open_container, read_entries, write_container
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
)
from ..format import container
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.tree import Decoder
from ..planning.flatten import plan as make_plan
from ..storage.targets import FileLike, FileObjectSource, Source, open_sink, open_source, resolve

MapLocation = Union[  # noqa: UP007 - a runtime alias; X | Y with None first is not valid at runtime
    None, str, torch.device, dict[str, str | torch.device], Callable[[torch.UntypedStorage, str], Any]
]

_ZIP_MAGIC = b"PK\x03\x04"
# torch's legacy (pre-1.6) format starts with the pickled magic number 0x1950a86a20f9469cfc6c.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def save(
    obj: Any,
    f: FileLike,
    *,
    compression: str | None = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save ``obj`` to ``f`` (a path, PathLike, binary file object or fsspec URL) as one file.

    ``compression``: None (raw, mmap-able), ``"zstd"``, or ``"shuffle+zstd"`` (byte-shuffle floats first).
    ``allow_pickle``: store objects outside the supported set pickled (loading them needs
    ``weights_only=False``); without it they raise :class:`UnsupportedObjectError` naming their path,
    and nothing is written.
    """
    target = resolve(f, storage_options)
    the_plan = make_plan(obj, compression=compression, allow_pickle=allow_pickle)
    sink = open_sink(target)
    try:
        write_container(the_plan, sink)
    except BaseException:
        sink.abort()
        raise


def load(
    f: FileLike,
    map_location: MapLocation = None,
    *,
    weights_only: bool = True,
    mmap: bool = False,
    storage_options: dict[str, Any] | None = None,
    verify: bool | None = None,
) -> Any:
    """Load what :func:`save` (or ``torch.save``) wrote to ``f``.

    ``map_location`` behaves as torch.load's. ``weights_only=True`` never unpickles anything.
    ``mmap=True`` maps a local file's tensor bytes instead of reading them. ``verify`` checks every
    chunk's checksum (default: True, except with ``mmap=True``, where reading everything to check it
    would defeat the mapping; run ``ckptstore verify`` for that).
    """
    target = resolve(f, storage_options)
    source = open_source(target)
    try:
        if mmap and source.local_path is None:
            raise InvalidArgumentError(
                f"mmap=True needs a local file path, but {source.display} is not a local file; "
                "load without mmap, or copy the file to local disk first"
            )
        head = source.read(0, min(len(_LEGACY_TORCH_MAGIC), source.size))
        if head.startswith(container.MAGIC):
            result = _load_container(source, map_location, weights_only, mmap, verify)
        elif head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_TORCH_MAGIC):
            result = _torch_load(source, target.fileobj, map_location, weights_only, mmap)
        elif not head:
            raise NotACheckpointError(f"{source.display} is empty (0 bytes): it is not a checkpoint")
        else:
            raise NotACheckpointError(
                f"{source.display} is not a checkpoint: it starts with {head[:8]!r}; ckptstore.load reads files "
                "written by ckptstore.save or torch.save"
            )
    finally:
        source.close()
    return result


def _torch_load(source: Source, fileobj: Any, map_location: MapLocation, weights_only: bool, mmap: bool) -> Any:
    """Files written by torch.save are handed to torch.load unchanged, so migration can be gradual."""
    if source.local_path is not None:
        return torch.load(source.local_path, map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only, mmap=mmap)
    if isinstance(source, FileObjectSource):
        source.rewind()
        return torch.load(fileobj, map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only)
    import io

    return torch.load(io.BytesIO(source.read(0, source.size)), map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only)


def _load_container(
    source: Source, map_location: MapLocation, weights_only: bool, mmap: bool, verify: bool | None
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
    buffers = read_entries(opened, list(manifest.tensors), verify_checksums=verify_checksums, use_mmap=mmap)
    result = _Materializer(manifest, buffers, map_location, source.display, weights_only=weights_only).build()
    source.finish(opened.end)
    return result


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

    def build(self) -> Any:
        return Decoder(self.resolve, self.where).decode(self.manifest.tree)

    def bad(self, msg: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {msg}", location=self.where, key=key)

    def entry_buffer(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.buffers:
            raise self.bad(f"tree refers to tensor {key!r}, which the manifest does not have")
        return self.buffers[key]

    def resolve(self, tag: str, node: dict[str, Any]) -> Any:
        if tag == "$npscalar":
            dt = _numpy_dtype(node["$npscalar"], self)
            return np.frombuffer(base64.b64decode(node["b64"]), dtype=dt)[0].copy()
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
            return pickle.loads(byte_view(self.entry_buffer(key)))  # noqa: S301
        if tag == "$ndarray":
            dt = _numpy_dtype(node["dtype"], self)
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
        if node.get("param"):
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(node.get("requires_grad")))
        elif node.get("requires_grad"):
            tensor.requires_grad_(True)
        if obj_id is not None:
            self.objects[obj_id] = tensor
        return tensor

    def placed(self, key: str, location: str) -> torch.Tensor:
        """The entry's flat byte buffer on the device ``map_location`` chooses (once per entry)."""
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


def _numpy_dtype(spec: Any, m: _Materializer) -> np.dtype:
    try:
        dt = np.dtype(spec) if isinstance(spec, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "biufc" or dt.fields is not None:
        raise m.bad(f"numpy dtype {spec!r} is not a plain numeric dtype")
    return dt


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


__all__ = ["save", "load", "MapLocation"]
