"""Convert checkpoints between ckptstore, ``torch.save``, safetensors and ``torch.distributed.checkpoint``.

::

    detect_format(src, storage_options=None) -> "ckptstore" | "ckptstore-sharded" | "torch" | "safetensors" | "dcp"
    convert(src, dst, to, *, storage_options=None, allow_pickle=False) -> report dict

``convert`` reads the whole source into memory in this process (on the CPU), then writes it in the
format ``to`` under a temporary name next to ``dst`` and moves it into place. It never replaces
anything: an existing ``dst`` is refused. It is a single-process tool (run it where
``torch.distributed`` is not initialised).

What each destination holds, for a source read back from it:

``ckptstore`` (single file, :func:`ckptstore.save`)
    Everything ``ckptstore.save`` holds: the nested object exactly (dict key types and order,
    OrderedDict and its ``_metadata``, tuples, namedtuples, sets, bytes, numpy arrays, ...), tensors
    bit for bit with dtype and shape, one tensor object referenced twice as one object, tensors that
    share storage (tied weights) still sharing it. Objects outside that set only with
    ``allow_pickle=True`` (stored pickled).
``torch`` (``torch.save``)
    Everything pickle holds. Reading a torch file uses ``weights_only=not allow_pickle``.
``safetensors``
    A flat ``{key: tensor}`` file every safetensors reader understands: keys are the manifest-style
    paths (``model/layer.0.weight``, parts joined by ``/`` with ``~``/``/`` escaped as ``~0``/``~1``),
    every tensor contiguous and stored on its own (tensors sharing storage are copied). The rest of
    the tree is kept as tagged JSON (the manifest's tree format, tensors as ``{"$tensor": key}``) in
    the header metadata ``"ckptstore.tree"``, so converting back rebuilds the original nested object
    exactly, including which tensors were one object and which were identical views of one storage
    (tied weights). Lost: sharing between tensors that only partly overlap (each keeps its values),
    strides (tensors come back contiguous). Non-tensor leaves outside tagged JSON (arbitrary
    objects) raise :class:`UnsupportedObjectError`; so do tensor dtypes safetensors has no name for.
    A safetensors file without ``"ckptstore.tree"`` reads as the flat dict of its tensors.
``dcp`` (``torch.distributed.checkpoint`` directory)
    Needs a dict at the root. DCP flattens the state to dotted keys and rebuilds the nesting from its
    metadata on load, with these losses: non-string dict keys become strings (an optimizer's
    ``state[0]`` comes back as ``state['0']``), OrderedDicts become dicts without ``_metadata``,
    empty dicts vanish, tensors that shared storage (tied weights) come back as separate tensors, and
    keys whose dotted paths collide (``{'a.b': x, 'a': {'b': y}}``) cannot be written. Non-tensor
    values are pickled by DCP; reading them without ``allow_pickle`` goes through torch's
    ``weights_only`` unpickler, and the pickled ``.metadata`` through an allowlist of DCP's own
    metadata classes.

Sources: a sharded ckptstore directory is assembled into full tensors in this process. Its
:class:`ckptstore.PerRank` values have no place in any of the four formats (none has a notion of
ranks): they are left out, and the report lists their paths under ``"dropped"``. Tensors come out of
every source on the CPU (``map_location="cpu"``), so converting needs no GPU.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
    StorageError,
    UnsupportedObjectError,
)
from .format.tree import Decoder, Encoder, format_path, grad_flags, npscalar_value, numpy_dtype
from .planning.flatten import LeafEncoder, cpu_values, tensor_problem
from .storage.targets import fsync_dir

FORMATS = ("ckptstore", "torch", "safetensors", "dcp")
SAFETENSORS_TREE_KEY = "ckptstore.tree"

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_DCP_METADATA = ".metadata"
# safetensors' own dtype table when it has one (0.4+), else the dtypes every release knows.
_SAFETENSORS_FALLBACK_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


# ------------------------------------------------------------------------------------ locations


def _text(url: Any, what: str) -> str:
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidArgumentError(f"{what} must be a non-empty path or fsspec URL, not {url!r}")
    return url


def _resolve(url: str, storage_options: dict[str, Any] | None) -> Any:
    from .storage.targets import resolve

    # storage_options are for URLs; a local path on the other side of the conversion ignores them.
    return resolve(url, storage_options if "://" in url else None)


def _exists(target: Any) -> bool:
    if target.path is not None:
        return os.path.lexists(target.path)
    return bool(target.fs.exists(target.fspath))


def _isdir(target: Any) -> bool:
    if target.path is not None:
        return os.path.isdir(target.path)
    return bool(target.fs.isdir(target.fspath))


def _local_only(target: Any, fmt: str, role: str) -> str:
    if target.path is None:
        raise InvalidArgumentError(
            f"{target.display}: {fmt} checkpoints are {role} on the local filesystem only; copy it to local disk "
            "first (or convert to/from ckptstore, torch or safetensors, which also work on URLs)"
        )
    return str(target.path)


# ------------------------------------------------------------------------------------ detection


def detect_format(src: str, storage_options: dict[str, Any] | None = None) -> str:
    """The kind of checkpoint at ``src``: ``"ckptstore"`` (single file), ``"ckptstore-sharded"``
    (directory with a sharded ``manifest.json``), ``"torch"``, ``"safetensors"`` or ``"dcp"``.

    Raises :class:`CheckpointNotFoundError` when nothing is there and :class:`NotACheckpointError`
    when it is none of these.
    """
    url = _text(src, "src")
    target = _resolve(url, storage_options)
    if not _exists(target):
        raise CheckpointNotFoundError(f"no checkpoint at {target.display}: nothing exists there")
    if _isdir(target):
        return _detect_directory(url, target, storage_options)
    return _detect_file(target)


def _detect_directory(url: str, target: Any, storage_options: dict[str, Any] | None) -> str:
    from .checkpoint.sharded import MANIFEST, Directory, read_manifest

    directory = Directory(url, storage_options if "://" in url else None)
    if directory.exists(MANIFEST):
        read_manifest(directory)  # validates it, and that its kind is "sharded"
        return "ckptstore-sharded"
    if directory.exists(_DCP_METADATA):
        return "dcp"
    if directory.exists("parts") or directory.exists("data"):
        read_manifest(directory)  # raises: a sharded save that never committed
    raise NotACheckpointError(
        f"{target.display} is a directory with neither {MANIFEST} (a ckptstore sharded checkpoint) nor "
        f"{_DCP_METADATA} (a torch.distributed.checkpoint); give the directory of a checkpoint, or a checkpoint file"
    )


def _detect_file(target: Any) -> str:
    from .format.container import MAGIC
    from .storage.targets import open_source

    source = open_source(target)
    try:
        size = source.size
        head = source.read(0, min(16, size))
    finally:
        source.close()
    if head.startswith(MAGIC):
        return "ckptstore"
    if head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_TORCH_MAGIC):
        return "torch"
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"
    if not head:
        raise NotACheckpointError(f"{target.display} is empty (0 bytes): it is not a checkpoint")
    raise NotACheckpointError(
        f"{target.display} is not a checkpoint convert can read: it starts with {head[:8]!r}. It reads ckptstore "
        "files and sharded directories, torch.save files, safetensors files and torch.distributed.checkpoint "
        "directories"
    )


# ------------------------------------------------------------------------------------ convert


def convert(
    src: str,
    dst: str,
    to: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Read the checkpoint at ``src`` (any format :func:`detect_format` knows) and write it to ``dst`` as ``to``.

    ``to`` is one of :data:`FORMATS`. ``dst`` must not exist; nothing that exists is ever replaced.
    ``allow_pickle`` lets the reader unpickle (torch files with ``weights_only=False``, ckptstore files
    holding pickled objects, DCP metadata and values outside the allowlists) and lets the ckptstore
    writer store objects it would otherwise refuse, pickled; only use it for sources you trust.
    ``storage_options`` go to fsspec for ``src`` and ``dst`` when they are URLs. ``progress`` is told
    each phase as it starts and ends (the readers and writers of the other formats report no bytes).

    Returns ``{"src", "dst", "src_format", "dst_format", "tensors", "bytes", "dropped", "notes"}``:
    ``tensors``/``bytes`` count the distinct tensors written and their data bytes, ``dropped`` lists
    the paths of values left out (per-rank values of a sharded source), ``notes`` says what the
    destination format changed (see this module's docstring).
    """
    if to not in FORMATS:
        raise InvalidArgumentError(f"unknown destination format {to!r}; choose one of {', '.join(FORMATS)}")
    src_url, dst_url = _text(src, "src"), _text(dst, "dst")
    dst_target = _resolve(dst_url, storage_options)
    if _exists(dst_target):
        raise CheckpointError(
            f"{dst_target.display} already exists; convert never replaces anything. Choose another destination, or "
            "move or delete it first"
        )
    if to == "dcp":
        _local_only(dst_target, "DCP", "written")
    src_format = detect_format(src_url, storage_options)
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    say(f"reading {src_format} {src_url}")
    state, dropped = _read(src_url, src_format, storage_options, allow_pickle)
    notes: list[str] = []
    if dropped:
        notes.append(
            f"{len(dropped)} per-rank value(s) left out: {to} has no per-rank values (load the sharded checkpoint "
            "with ckptstore.load_sharded to get them)"
        )
    if to == "dcp":
        notes.extend(_dcp_losses(state))
    count, nbytes = _tensor_stats(state)
    say(f"read {count} tensors ({nbytes / 2**20:.1f} MiB) in {time.perf_counter() - started:.2f} s; writing {to} {dst_url}")
    started = time.perf_counter()
    _write(state, dst_url, dst_target, to, storage_options, allow_pickle)
    say(f"wrote {to} in {time.perf_counter() - started:.2f} s")
    return {
        "src": src_url,
        "dst": dst_url,
        "src_format": src_format,
        "dst_format": to,
        "tensors": count,
        "bytes": nbytes,
        "dropped": dropped,
        "notes": notes,
    }


# ------------------------------------------------------------------------------------ readers


def _read(url: str, fmt: str, storage_options: dict[str, Any] | None, allow_pickle: bool) -> tuple[Any, list[str]]:
    so = storage_options if "://" in url else None
    if fmt in ("ckptstore", "torch"):
        return _read_single(url, so, allow_pickle), []
    if fmt == "ckptstore-sharded":
        return _read_sharded(url, so)
    if fmt == "safetensors":
        return _read_safetensors(_resolve(url, so)), []
    if fmt == "dcp":
        return _read_dcp(_local_only(_resolve(url, so), "DCP", "read"), url, allow_pickle), []
    raise AssertionError(fmt)  # pragma: no cover - detect_format returns only the kinds above


def _read_single(url: str, so: dict[str, Any] | None, allow_pickle: bool) -> Any:
    from .api.dropin import load

    try:
        # ckptstore.load reads both its own files and torch.save files (handed to torch.load).
        return load(url, map_location="cpu", weights_only=not allow_pickle, storage_options=so)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PickleNotAllowedError(
            f"{url} holds objects torch.load refuses with weights_only=True ({first}); unpickling can run "
            "arbitrary code, so pass allow_pickle=True (ckptstore convert --allow-pickle) only if you trust where "
            "the file came from"
        ) from None


def _read_sharded(url: str, so: dict[str, Any] | None) -> tuple[Any, list[str]]:
    """Assemble a sharded checkpoint in this process: a state of full tensors, one per manifest entry."""
    from .api.sharded import PerRank, load_sharded
    from .checkpoint.memory import alloc_bytes
    from .checkpoint.sharded import Directory, read_manifest
    from .format.dtypes import dtype_from_name

    directory = Directory(url, so)
    manifest = read_manifest(directory)
    tensors: dict[str, torch.Tensor] = {}

    def slot(tag: str, node: dict[str, Any]) -> Any:
        if tag == "$per_rank":
            return PerRank(None)
        if tag != "$tensor":
            raise CorruptCheckpointError(
                f"{directory.display}: a sharded manifest tree holds only $tensor and $per_rank leaves, not {tag}",
                location=directory.display,
            )
        key = node["$tensor"]
        if key not in tensors:
            entry = manifest.tensors.get(key)
            if entry is None:
                raise CorruptCheckpointError(
                    f"{directory.display}: tree refers to tensor {key!r}, which the manifest lacks",
                    location=directory.display,
                    key=key,
                )
            dtype = dtype_from_name(entry.dtype, where=directory.display)
            tensors[key] = (
                alloc_bytes(entry.nbytes).view(dtype).view(entry.shape)
                if entry.nbytes
                else torch.empty(entry.shape, dtype=dtype)
            )
        # One tensor per entry: a tensor saved twice (one object) comes back as one object, and
        # load_sharded fills these in place, so they are ours whatever container holds them.
        return tensors[key]

    state = Decoder(slot, directory.display).decode(manifest.tree)
    # No destination holds per-rank values, so they are dropped below; per_rank="skip" lets a
    # checkpoint saved by several ranks load in this one process without them.
    load_sharded(state, url, storage_options=so, per_rank="skip")
    dropped: list[str] = []
    state = _strip_per_rank(state, [], dropped, PerRank)
    return (None if state is _DROP else state), dropped


_DROP = object()


def _strip_per_rank(obj: Any, path: list[Any], dropped: list[str], per_rank_type: type) -> Any:
    """Remove PerRank values: dict entries are deleted, list and tuple items become None."""
    if isinstance(obj, per_rank_type):
        dropped.append(format_path(path))
        return _DROP
    if isinstance(obj, dict):
        for k in list(obj):
            v = _strip_per_rank(obj[k], path + [k], dropped, per_rank_type)
            if v is _DROP:
                del obj[k]
            else:
                obj[k] = v
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_strip_per_rank(v, path + [i], dropped, per_rank_type) for i, v in enumerate(obj)]
        items = [None if v is _DROP else v for v in items]
        if isinstance(obj, list):
            obj[:] = items
            return obj
        return type(obj)(*items) if hasattr(type(obj), "_fields") else type(obj)(items)
    return obj


# ------------------------------------------------------------------------------------ safetensors


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise InvalidArgumentError(
            "the safetensors format needs the 'safetensors' package: pip install safetensors"
        ) from None
    return safetensors.torch


def _safetensors_dtypes() -> frozenset[torch.dtype]:
    table = getattr(_safetensors(), "_TYPES", None)
    if isinstance(table, dict):
        return frozenset(v for v in table.values() if isinstance(v, torch.dtype))
    return frozenset(_SAFETENSORS_FALLBACK_DTYPES)


def _read_safetensors(target: Any) -> Any:
    from .storage.targets import ShortRead, open_source

    st = _safetensors()
    source = open_source(target)
    try:
        try:
            n = int.from_bytes(source.read(0, 8), "little")
            header = json.loads(source.read(8, n).decode("utf-8"))
            data = source.read(0, source.size) if target.path is None else None
        except (ShortRead, UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{target.display}: the safetensors header cannot be read ({exc}); the file is damaged",
                location=target.display,
            ) from None
    finally:
        source.close()
    try:
        flat = st.load_file(target.path) if data is None else st.load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError for damaged files
        raise CorruptCheckpointError(
            f"{target.display}: safetensors cannot read it ({exc}); the file is damaged", location=target.display
        ) from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    tree_json = meta.get(SAFETENSORS_TREE_KEY) if isinstance(meta, dict) else None
    if tree_json is None:
        return flat  # a safetensors file from elsewhere: its flat dict of tensors
    try:
        tree = json.loads(tree_json)
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"{target.display}: metadata {SAFETENSORS_TREE_KEY!r} is not valid JSON ({exc})", location=target.display
        ) from None
    return _SafetensorsTree(flat, target.display).build(tree)


class _SafetensorsTree:
    """Rebuilds the nested object from the ``ckptstore.tree`` metadata and the flat tensors."""

    def __init__(self, flat: dict[str, torch.Tensor], where: str) -> None:
        self.flat, self.where = flat, where
        self.objects: dict[Any, torch.Tensor] = {}
        self.used: set[str] = set()

    def build(self, tree: Any) -> Any:
        return Decoder(self.resolve, self.where).decode(tree)

    def bad(self, msg: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {msg}", location=self.where, key=key)

    def tensor(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.flat:
            raise self.bad(f"metadata {SAFETENSORS_TREE_KEY!r} refers to tensor {key!r}, which the file lacks", None)
        return self.flat[key]

    def resolve(self, tag: str, node: dict[str, Any]) -> Any:
        if tag == "$tensor":
            obj = node.get("obj")
            if obj is not None and obj in self.objects:
                return self.objects[obj]
            key = node["$tensor"]
            t = self.tensor(key)
            if key in self.used:
                t = t.view(t.shape)  # another tensor object viewing the same storage (tied weights)
            self.used.add(key)
            t = grad_flags(t, node, lambda message: self.bad(message, key))
            if obj is not None:
                self.objects[obj] = t
            return t
        if tag == "$ndarray":
            dt = numpy_dtype(node.get("dtype"), self.bad)
            shape = tuple(node["shape"])
            raw = self.tensor(node["$ndarray"])
            if raw.dtype != torch.uint8 or raw.numel() != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                raise self.bad(f"array {node['$ndarray']!r} does not hold {shape} of {dt}", node["$ndarray"])
            return raw.numpy().copy().view(dt).reshape(shape)
        if tag == "$npscalar":
            return npscalar_value(node, self.bad)
        raise self.bad(f"metadata {SAFETENSORS_TREE_KEY!r} holds {tag}, which a safetensors export never writes")


class _SafetensorsExport(LeafEncoder):
    """Splits a state into the flat tensor dict and the tagged-JSON tree of everything else."""

    # A flat reader would take an array's raw bytes under the array's own path for a tensor there.
    ndarray_suffix = "#ndarray"

    def __init__(self) -> None:
        super().__init__()
        self.flat: dict[str, torch.Tensor] = {}
        self.views: dict[tuple[Any, ...], str] = {}  # identical views of one storage -> the first key
        self.storages: set[tuple[str, int]] = set()
        self.dtypes = _safetensors_dtypes()

    def run(self, state: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        from ._version import __version__

        tree = Encoder(self.leaf, self.refuse).encode(state)
        meta = {
            SAFETENSORS_TREE_KEY: json.dumps(tree, separators=(",", ":"), ensure_ascii=False, allow_nan=False),
            "ckptstore.version": __version__,
        }
        return self.flat, meta

    def refuse(self, obj: Any, path: list[Any]) -> Any:
        raise UnsupportedObjectError(
            f"{format_path(path)} is a {type(obj).__module__}.{type(obj).__qualname__}, which a safetensors file "
            "cannot hold (it holds tensors, and the rest of the tree as JSON: numbers, strings, bytes, lists, tuples, "
            "dicts, sets, numpy arrays). Convert to ckptstore or torch format instead, or turn the value into one of those"
        )

    def add_bytes(self, key: str, data: torch.Tensor) -> None:
        self.flat[key] = data

    def tensor_again(self, node: dict[str, Any], path: list[Any]) -> dict[str, Any]:
        # One node (it loads as one object), and its own copy under this path too, so readers of
        # the flat file find every path.
        self.flat[self.key_for(path)] = self.flat[node["$tensor"]].clone()
        return node

    def tensor_leaf(self, t: torch.Tensor, path: list[Any]) -> dict[str, Any]:
        problem = tensor_problem(t)
        if problem is None and t.dtype not in self.dtypes:
            problem = f"has dtype {t.dtype}, which safetensors has no name for"
        if problem is not None:
            raise UnsupportedObjectError(
                f"{format_path(path)} {problem}; a safetensors file cannot hold it. Convert to ckptstore or torch format "
                "instead, or make it a plain dense tensor of a safetensors dtype first"
            )
        key = self.key_for(path)
        data = cpu_values(t)
        data_key = key
        storage = data.untyped_storage()
        if storage.nbytes() and data.numel():
            view = (str(data.device), storage.data_ptr(), data.storage_offset(), tuple(data.shape), data.stride(), data.dtype)
            data_key = self.views.setdefault(view, key)
            sid = (str(data.device), storage.data_ptr())
            if not data.is_contiguous():
                data = data.contiguous()
            elif sid in self.storages:
                data = data.clone()  # safetensors refuses tensors that share memory
            self.storages.add(sid)
            self.storages.add((str(data.device), data.untyped_storage().data_ptr()))
        else:
            data = torch.empty(data.shape, dtype=data.dtype)  # no elements: nothing to share
        self.flat[key] = data
        # No device: every tensor of the file is on the CPU, and so is everything convert reads.
        return self.tensor_node(t, data_key, device=False)


# ------------------------------------------------------------------------------------ DCP


_DCP_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` with nothing but DCP's own metadata classes (and torch dtypes)."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise PickleNotAllowedError(
            f"{self.where} refers to {module}.{name}, which convert does not unpickle without allow_pickle=True: "
            "DCP keeps its metadata pickled, and unpickling can run arbitrary code; pass allow_pickle=True "
            "(ckptstore convert --allow-pickle) only if you trust where the checkpoint came from"
        )


def _read_dcp(path: str, display: str, allow_pickle: bool) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    # The loader and the planner torch's own format_utils.dcp_to_torch_save uses: they read without
    # a process group and rebuild the state dict from the checkpoint's metadata.
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    errors: list[CheckpointError] = []
    where = f"{display.rstrip('/')}/{_DCP_METADATA}"

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if allow_pickle:
                return super().read_metadata(*args, **kwargs)
            rank = kwargs.get("rank")
            name = _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}"
            try:
                with open(os.path.join(path, name), "rb") as f:
                    metadata = _DcpMetadataUnpickler(f, where).load()
            except PickleNotAllowedError as exc:
                errors.append(exc)
                raise
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as exc:
                errors.append(CorruptCheckpointError(f"{where} cannot be read: {exc}", location=where))
                raise
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if not allow_pickle:
                fqn = getattr(getattr(read_item, "dest_index", None), "fqn", "?")
                try:
                    # Same bytes through torch's weights_only unpickler first: if it accepts them they
                    # reference only allowlisted globals, and DCP's own (unrestricted) load is safe.
                    torch.load(value, weights_only=True)
                except pickle.UnpicklingError as exc:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    errors.append(
                        PickleNotAllowedError(
                            f"{display}: value {fqn!r} is a pickled object torch's weights_only loader refuses "
                            f"({first}); pass allow_pickle=True (ckptstore convert --allow-pickle) only if you trust "
                            "where the checkpoint came from"
                        )
                    )
                    raise
                value.seek(0)
            super().load_bytes(read_item, value)

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=Reader(path), planner=Planner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps failures (a BaseException); ours first
        if errors:
            raise errors[0] from None
        if isinstance(exc, CheckpointException):
            raise CorruptCheckpointError(
                f"{display}: torch.distributed.checkpoint cannot read it: {_dcp_failure(exc)}", location=display
            ) from None
        raise
    return state


def _dcp_failure(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = getattr(inner, "exc", inner)
        return f"{type(inner).__name__}: {inner}"
    return str(exc)


def _write_dcp(state: Any, path: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    # The saver torch's own format_utils.torch_save_to_dcp uses: no process group, no warning.
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    if not isinstance(state, dict):
        raise UnsupportedObjectError(
            f"a DCP checkpoint holds a dict at its root, but this checkpoint's root is a {type(state).__name__}; "
            "convert to ckptstore or torch format instead"
        )
    try:
        _save_state_dict(state, storage_writer=FileSystemWriter(path), no_dist=True)
    except CheckpointException as exc:
        raise UnsupportedObjectError(f"torch.distributed.checkpoint cannot write this state: {_dcp_failure(exc)}") from None


def _dcp_terminal(value: Any) -> bool:
    """DCP's rule for a value it pickles whole: anything but a dict, or a list holding no tensor or dict."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or (isinstance(v, (dict, list)) and not _dcp_terminal(v)) for v in value)


def _dcp_losses(state: Any) -> list[str]:
    """What writing ``state`` as DCP will change, from a walk of the state (one example path each)."""
    found: dict[str, str] = {}
    storages: dict[tuple[str, int], str] = {}

    def walk(obj: Any, path: list[Any]) -> None:
        if isinstance(obj, torch.Tensor):
            try:
                sid = (str(obj.device), obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                return
            if obj.untyped_storage().nbytes() and sid in storages and storages[sid] != format_path(path):
                found.setdefault("shared", f"{storages[sid]} and {format_path(path)}")
            storages.setdefault(sid, format_path(path))
            return
        if isinstance(obj, dict):
            if type(obj) is not dict:
                found.setdefault("odict", format_path(path))
            if not obj and path:
                found.setdefault("empty", format_path(path))
            for k, v in obj.items():
                if type(k) is not str:
                    found.setdefault("keys", format_path(path + [k]))
                walk(v, path + [k])
        elif isinstance(obj, list) and not _dcp_terminal(obj):
            for i, v in enumerate(obj):
                walk(v, path + [i])

    walk(state, [])
    messages = {
        "keys": "non-string dict keys become strings in DCP (for example {})",
        "odict": "OrderedDicts become plain dicts and lose their _metadata in DCP (for example {})",
        "empty": "empty dicts are not stored by DCP (for example {})",
        "shared": "tensors sharing storage (tied weights) are stored and loaded separately by DCP ({})",
    }
    return [messages[k].format(v) for k, v in found.items()]


# ------------------------------------------------------------------------------------ writers


def _write(
    state: Any, url: str, target: Any, to: str, storage_options: dict[str, Any] | None, allow_pickle: bool
) -> None:
    if to == "dcp":
        _publish_directory(target, lambda tmp: _write_dcp(state, tmp))
        return
    if to == "ckptstore":
        from .api.dropin import save

        if target.path is None:
            save(state, url, allow_pickle=allow_pickle, storage_options=storage_options)  # an atomic upload
            return
        _publish_file(target, lambda f: save(state, f, allow_pickle=allow_pickle))
        return
    if to == "torch":
        if target.path is None:
            buf = io.BytesIO()
            torch.save(state, buf)
            _upload(target, buf.getvalue())
            return
        _publish_file(target, lambda f: torch.save(state, f))
        return
    if to == "safetensors":
        st = _safetensors()
        flat, meta = _SafetensorsExport().run(state)
        if target.path is None:
            _upload(target, st.save(flat, metadata=meta))
            return
        _publish_file(target, lambda f: st.save_file(flat, f, metadata=meta))
        return
    raise AssertionError(to)  # pragma: no cover - convert() checked `to`


def _temp_name(path: str) -> str:
    directory, base = os.path.split(path)
    if not os.path.isdir(directory or "."):
        raise StorageError(
            f"cannot write {path}: its directory {directory} does not exist; create it first", errno=errno.ENOENT
        )
    return os.path.join(directory, f".{base}.convert-tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _publish_file(target: Any, write: Callable[[str], None]) -> None:
    """Write under a temporary name next to the destination, then link it into place (never replacing)."""
    dst = target.path
    tmp = _temp_name(dst)
    try:
        try:
            write(tmp)
        except CheckpointError:
            raise
        except OSError as exc:
            from .storage.targets import storage_error

            raise storage_error(exc, "write", target.display) from None
        try:
            os.link(tmp, dst)  # fails if dst appeared meanwhile: nothing is ever replaced
        except FileExistsError:
            raise CheckpointError(
                f"{target.display} appeared while converting; it was left untouched. Convert to another destination"
            ) from None
        except OSError:
            # Filesystems without hard links: rename, after one more look.
            if os.path.lexists(dst):
                raise CheckpointError(
                    f"{target.display} appeared while converting; it was left untouched. Convert to another destination"
                ) from None
            os.rename(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(dst))


def _publish_directory(target: Any, write: Callable[[str], None]) -> None:
    dst = target.path
    tmp = _temp_name(dst)
    try:
        os.mkdir(tmp)
        write(tmp)
        if os.path.lexists(dst):
            raise CheckpointError(
                f"{target.display} appeared while converting; it was left untouched. Convert to another destination"
            )
        os.rename(tmp, dst)
    except CheckpointError:
        raise
    except OSError as exc:
        from .storage.targets import storage_error

        raise storage_error(exc, "write", target.display) from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(os.path.dirname(dst))


def _upload(target: Any, data: bytes) -> None:
    from .storage.targets import write_bytes

    write_bytes(target, data)


# ------------------------------------------------------------------------------------ report


def _tensor_stats(state: Any) -> tuple[int, int]:
    seen: set[int] = set()
    total = 0

    def walk(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v)

    walk(state)
    return len(seen), total


__all__ = ["FORMATS", "SAFETENSORS_TREE_KEY", "convert", "detect_format"]
