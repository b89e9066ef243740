"""Flatten a Python object tree into a manifest tree plus the list of tensor entries to write.

Tensors are grouped by the storage they live in, so that what torch.save preserves survives here
too: the same tensor object referenced twice is written once and loads as one object, and several
views of one storage load as views of one storage. A tensor that shares its storage with nothing
else is written compactly (only its own elements, contiguous), so a small slice of a huge tensor
does not drag the whole storage into the file the way torch.save does.
"""

from __future__ import annotations

import collections
import math
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, UnsupportedObjectError, also
from ..format import codecs
from ..format.dtypes import dtype_name, element_size
from ..format.manifest import ATTRS_MINOR, FORMAT_MINOR
from ..format.tree import Encoder, format_path, npscalar_node, plain_numpy

# Compressed tensors are cut into dim-0 slabs of about this many raw bytes, so chunks can be
# encoded and decoded in parallel and no single zstd frame needs a huge buffer.
COMPRESSED_CHUNK_BYTES = 16 << 20
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def cpu_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU, with its lazy conjugate and negative bits applied, so that its
    memory holds the values it reads as (``t``'s own storage whenever that already does)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def contiguous_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in C order as a contiguous 1-D uint8 CPU tensor (a copy only when unavoidable)."""
    t = cpu_values(t)
    if not t.is_contiguous():
        # Copy through a same-size integer view: torch has no copy kernel for sub-byte dtypes
        # (int4, uint1..7) and warns when it touches complex32.
        same_size = _SAME_SIZE_INT.get(t.element_size())
        t = t.view(same_size).contiguous() if same_size is not None and t.dim() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


@dataclass
class WriteItem:
    """One manifest tensor entry to write: ``source`` holds exactly the bytes of the entry."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: torch.Tensor
    codec: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)

    def raw_bytes(self) -> torch.Tensor:
        """The entry's bytes as a contiguous 1-D uint8 CPU tensor (a copy only when unavoidable)."""
        return contiguous_bytes(self.source)

    def slabs(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
        """Chunk boxes as (offsets, sizes, byte start, byte length) within :meth:`raw_bytes`."""
        nbytes = self.nbytes
        if self.codec == "raw" or not self.shape or self.shape[0] <= 1 or nbytes <= COMPRESSED_CHUNK_BYTES:
            return [((0,) * len(self.shape), self.shape, 0, nbytes)]
        row_bytes = nbytes // self.shape[0]
        rows = max(1, COMPRESSED_CHUNK_BYTES // max(1, row_bytes))
        out = []
        for start in range(0, self.shape[0], rows):
            n = min(rows, self.shape[0] - start)
            out.append(((start,) + (0,) * (len(self.shape) - 1), (n,) + self.shape[1:], start * row_bytes, n * row_bytes))
        return out


@dataclass
class Plan:
    tree: Any
    items: list[WriteItem]
    pickled: list[str]
    minor: int = FORMAT_MINOR  # the format minor version the tree needs (section 8 of docs/format.md)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def escape_key(path: list[Any]) -> str:
    """A manifest key for a key path: parts joined by '/', with '~' and '/' escaped JSON-pointer style."""
    return "/".join(_escape(p) for p in path) or "<root>"


class LeafEncoder:
    """The leaf hook (see :class:`~ckptstore.format.tree.Encoder`) of every writer of a tree.

    Which values are leaves, and how they are told apart, is decided here for all of them: a
    tensor (the same object reached twice gets its first node again, so it loads as one object), a
    plain numeric ndarray (its bytes become an entry the node names) and a numpy scalar (inline).
    Entry keys come from the key path and never collide. What a new tensor becomes is the
    subclass's :meth:`tensor_leaf`, and where entry bytes go its :meth:`add_bytes`.
    """

    ndarray_suffix = ""  # appended to an ndarray's key path to name its entry

    def __init__(self) -> None:
        self.keys: set[str] = set()
        # id(tensor) -> (tensor, leaf node, path). Holding the tensor keeps its id from being
        # reused by another object while the tree is encoded.
        self.tensors: dict[int, tuple[torch.Tensor, dict[str, Any], list[Any]]] = {}
        self.next_obj = 0

    def key_for(self, path: list[Any], suffix: str = "") -> str:
        base = escape_key(path) + suffix
        key, n = base, 1
        while key in self.keys:
            n += 1
            key = f"{base}#{n}"
        self.keys.add(key)
        return key

    def leaf(self, obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen = self.tensors.get(id(obj))
            if seen is not None:
                return self.tensor_again(seen[1], path)
            node = self.tensor_leaf(obj, path)
            if node is not None:
                self.tensors[id(obj)] = (obj, node, path)
            return node
        if type(obj) is np.ndarray:
            if not plain_numpy(obj.dtype):
                return None
            data = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8).copy())
            key = self.key_for(path, self.ndarray_suffix)
            self.add_bytes(key, data)
            return {"$ndarray": key, "dtype": obj.dtype.str, "shape": list(obj.shape)}
        return self.other_leaf(obj, path)

    def other_leaf(self, obj: Any, path: list[Any]) -> Any:
        """The node of a leaf that is neither a tensor nor an ndarray: a numpy scalar's, else None."""
        return npscalar_node(obj)

    def tensor_node(self, t: torch.Tensor, key: str | None, *, device: bool) -> dict[str, Any]:
        """A new tensor object's node: ``obj`` numbers objects, so that one loads as one object."""
        node: dict[str, Any] = {"$tensor": key, "obj": self.next_obj}
        self.next_obj += 1
        if type(t) is torch.nn.Parameter:
            node["param"] = True
        if t.requires_grad:
            node["requires_grad"] = True
        if device and t.device.type != "cpu":
            node["device"] = str(t.device)
        return node

    def tensor_leaf(self, t: torch.Tensor, path: list[Any]) -> dict[str, Any] | None:
        """The node of a tensor object not seen before, or None to leave it to the pickle hook."""
        raise NotImplementedError

    def tensor_again(self, node: dict[str, Any], path: list[Any]) -> dict[str, Any]:
        """The node of a tensor object met again at ``path``; ``node`` is the one it got first."""
        return node

    def add_bytes(self, key: str, data: torch.Tensor) -> None:
        """Store ``data`` (1-D uint8, stored as is) as the entry ``key``."""
        raise NotImplementedError


class _Planner(LeafEncoder):
    def __init__(self, compression: str | None, allow_pickle: bool) -> None:
        super().__init__()
        self.compression = compression
        self.allow_pickle = allow_pickle
        self.items: list[WriteItem] = []
        self.pickled: list[str] = []

    def tensor_leaf(self, t: torch.Tensor, path: list[Any]) -> dict[str, Any] | None:
        check_storage(t, format_path(path))
        problem = tensor_problem(t)
        if problem is not None:
            if self.allow_pickle:
                return None  # falls through to the pickle hook
            raise UnsupportedObjectError(
                f"{format_path(path)}: {problem}. Convert it to a plain dense tensor (for example t.to_dense() "
                "or t.dequantize()), or pass allow_pickle=True to save it pickled (loading then needs "
                "weights_only=False)."
            )
        # The entry key waits for finish(): whether the tensor gets its own entry or is a view of
        # a shared one depends on the tensors not reached yet.
        return self.tensor_node(t, None, device=True)

    def add_bytes(self, key: str, data: torch.Tensor) -> None:
        self.items.append(WriteItem(key, torch.uint8, (data.numel(),), data, "raw"))

    def other_leaf(self, obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            # Refused even with allow_pickle: torch's own unpickling of a pickled storage fails
            # (its _load_from_bytes meets a class without `dtype`), so the file would never load.
            raise UnsupportedObjectError(
                f"{format_path(path)} is a bare {type(obj).__module__}.{type(obj).__qualname__}; a storage that Python's "
                "pickle wrote cannot be unpickled by torch, so ckptstore does not store one even with allow_pickle=True. "
                "Save a tensor over it instead: torch.empty(0, dtype=torch.uint8).set_(storage) (ckptstore.load "
                "gives it back; .untyped_storage() is the storage)."
            )
        return super().other_leaf(obj, path)

    def pickle_leaf(self, obj: Any, path: list[Any]) -> Any:
        try:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            # Also of pickle's own class (AttributeError, PicklingError, ...), which torch.save lets through.
            raise also(UnsupportedObjectError, type(exc))(
                f"{format_path(path)} cannot be pickled either: {exc}") from exc
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        key = self.key_for(path, "#pickle")
        self.add_bytes(key, data)
        self.pickled.append(key)
        return {"$pickle": key}

    def finish(self) -> None:
        """Decide, storage by storage, between compact entries and shared-storage view entries."""
        groups: dict[tuple[str, int], list[tuple[torch.Tensor, dict[str, Any], list[Any]]]] = {}
        for t, node, path in self.tensors.values():
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or t.is_conj() or t.is_neg():
                gkey = ("id", id(t))
            else:
                try:
                    gkey = (str(t.device), storage.data_ptr())
                except RuntimeError:
                    if not t._is_zerotensor():
                        raise
                    # Checked here, where its missing storage shows, rather than on every tensor.
                    # pickle fails on it too, with the same bare "data pointer" error.
                    raise also(UnsupportedObjectError, RuntimeError)(
                        f"{format_path(path)} is a ZeroTensor (torch._efficientzerotensor), which has no storage; "
                        "neither ckptstore nor torch.save can store it. Save torch.zeros_like(t) instead."
                    ) from None
            groups.setdefault(gkey, []).append((t, node, path))
        for members in groups.values():
            if len(members) == 1:
                t, node, path = members[0]
                if _overlaps_itself(t):
                    self.view_entry(members)
                else:
                    node["$tensor"] = key = self.key_for(path)
                    self.add_item(key, t.dtype, tuple(t.shape), t)
            else:
                self.view_entry(members)

    def add_item(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], source: torch.Tensor) -> None:
        codec = codecs.resolve_compression(self.compression, dtype)
        self.items.append(WriteItem(key, dtype, shape, source, codec))

    def view_entry(self, members: list[tuple[torch.Tensor, dict[str, Any], list[Any]]]) -> None:
        """Store the byte span of one storage that all ``members`` view, and each member as a view of it."""
        lo: int | None = None
        hi = 0
        for t, _, _ in members:
            es = t.element_size()
            if t.numel() == 0:
                continue
            start = int(t.storage_offset()) * es
            end = (int(t.storage_offset()) + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * es
            lo = start if lo is None else min(lo, start)
            hi = max(hi, end)
        lo = 0 if lo is None else lo
        dtypes = {t.dtype for t, _, _ in members}
        entry_dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        es = element_size(entry_dtype)
        # Align the span start so every view's offset is a whole number of its own elements
        # (element sizes are powers of two up to 16).
        lo -= lo % 16
        hi = max(hi, lo)
        hi += (-(hi - lo)) % es
        first_path = members[0][2]
        key = self.key_for(first_path, "#storage")
        t0 = members[0][0].detach()
        span = torch.empty(0, dtype=torch.uint8, device=t0.device).set_(t0.untyped_storage(), lo, (hi - lo,), (1,))
        span = span.view(entry_dtype) if es > 1 else span
        self.add_item(key, entry_dtype, (span.numel(),), span)
        for t, node, _ in members:
            tes = t.element_size()
            node.pop("$tensor", None)
            flags = {k: node.pop(k) for k in list(node) if k != "obj"}
            obj = node.pop("obj")
            node.update(
                {
                    "$view": key,
                    "obj": obj,
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "stride": list(t.stride()),
                    "offset": (t.storage_offset() * tes - lo) // tes if t.numel() else 0,
                }
            )
            node.update(flags)


def tensor_problem(t: torch.Tensor) -> str | None:
    """Why ``t`` is not a plain dense tensor of a dtype the format names (None when it is), as a
    phrase that follows the tensor's path; a writer for a narrower format checks its dtypes after."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"is a tensor subclass {type(t).__module__}.{type(t).__qualname__}"
    if t.layout != torch.strided:
        return f"is a {t.layout} tensor"
    if t.is_quantized:
        return "is a quantized tensor"
    if t.is_nested:
        return "is a nested tensor"
    if t.device.type == "meta":
        return "is a meta tensor, which has no data to save"
    if dtype_name(t.dtype) is None:
        return f"has dtype {t.dtype}, which the format cannot store"
    return None


def check_storage(t: torch.Tensor, where: str) -> None:
    """Raise :class:`InvalidArgumentError` when ``t``'s storage cannot hold what its shape names."""
    problem = storage_problem(t)
    if problem is not None:
        raise InvalidArgumentError(f"{where}: {problem}")


def storage_problem(t: torch.Tensor) -> str | None:
    """Why ``t``'s storage cannot hold the elements its shape and strides name (None when it can):
    a storage freed by ``resize_(0)`` (FSDP frees parameters so outside forward) keeps the shape and
    points at address 0, and reading it crashes the process or, through some paths, reads zeros."""
    if (not t.numel() or t.device.type == "meta" or t.layout != torch.strided or t.is_quantized or t.is_nested
            or type(t) not in (torch.Tensor, torch.nn.Parameter)):
        return None  # no storage of its own to check (tensor_problem names what is wrong with it)
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    need = (t.storage_offset() + span) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have >= need:
        return None
    return (f"has a storage of {have:,} bytes where its shape {list(t.shape)} needs {need:,}: its storage was freed "
            "or shrunk (FSDP frees parameters outside forward); save a state whose tensors hold their data, "
            "such as a state_dict() taken while they are materialized")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True for views whose elements alias each other (expand, as_strided with zero strides)."""
    if t.numel() <= 1:
        return False
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return span < t.numel()


_SCALARS = (type(None), bool, str, int)
_MAX_DEPTH = 64
_WALKED = frozenset({*_SCALARS, float, dict, collections.OrderedDict, list, tuple, torch.Tensor, torch.nn.Parameter})


# What a fingerprint's caller makes of a leaf it does not know: the tensor to stage for it and what
# identifies its structure, or None when the state cannot be fingerprinted (see :func:`fingerprint`).
OtherLeaf = Callable[[Any], "tuple[torch.Tensor, Any] | None"]


def fingerprint(obj: Any, other: OtherLeaf | None = None,
                dtensor: type | None = None) -> tuple[list[torch.Tensor], list[Any]] | None:
    """The tensors of a state tree in walk order, and a key that is equal for two trees exactly
    when they flatten the same way: the same containers (their types, keys and lengths), the same
    non-tensor leaves (their values: they are in the manifest's tree), and tensors of the same type,
    dtype, shape, strides and device at the same places, the same tensor object at the same places
    (an alias is written once). A save whose key equals the last one's can reuse everything planned
    from the tree and stage the new tensors into the same places.

    ``dtensor``: DTensor's class, when the process imported it: a DTensor's tensor is its local
    tensor, and its key part is its spec (see :func:`dtensor_leaf`) with its local tensor's dtype,
    shape, strides and device. ``other`` describes the leaves this module cannot (a per-rank value):
    it returns the tensor to stage and a key part that decides its structure, or None.

    It is walked at every save, so the walk does Python work per container, not per tensor: a
    container whose values are all tensors (a model's state dict, an optimizer's per-parameter
    state) hands them over at once, and what the key holds of every tensor is read afterwards in
    columns (``map`` over all of them: a dtype column, a shape column, ...), a few tenths of a
    microsecond per tensor where a tuple per tensor built in the walk cost 2-3 us per DTensor.
    None when the tree holds anything neither it nor ``other`` describes completely (a tensor
    subclass, a container other than dict, OrderedDict, list and tuple, a cycle): such a state is
    planned afresh at every save.
    """
    found: list[Any] = []  # tensors and DTensors as found, and other's tensors
    key: list[Any] = []
    others: list[int] = []  # where other's tensors are in found
    leafy = frozenset({torch.Tensor, torch.nn.Parameter} | ({dtensor} if dtensor is not None else set()))
    if not _walk(obj, found, key, 0, other, leafy, others):
        return None
    types = list(map(type, found))
    leaves: list[torch.Tensor] = found
    specs: list[Any] | None = None
    if dtensor is not None and dtensor in set(types):
        at = [i for i, t in enumerate(types) if t is dtensor]
        dts = found if len(at) == len(found) else [found[i] for i in at]
        try:
            locals_, specs = list(map(_dtensor_local, dts)), list(map(_dtensor_spec, dts))
        except AttributeError:  # torch without DTensor's private attributes: its public properties
            pairs = list(map(dtensor_leaf, dts))
            if any(p is None for p in pairs):
                return None
            locals_, specs = [p[0] for p in pairs], [p[1] for p in pairs]  # type: ignore[index]
        if not set(map(type, locals_)) <= _TENSOR_TYPES:
            return None  # an async collective's local tensor
        if dts is found:
            leaves = locals_
        else:
            leaves = list(found)
            for i, local in zip(at, locals_):
                leaves[i] = local
    shapes: list[Any] = list(map(_shape, leaves))
    for i in others:
        shapes[i] = None  # a per-rank value's length moves only the slot's tail (Pipeline._reuse)
    key.append((types, specs, list(map(_dtype, leaves)), shapes, list(map(torch.Tensor.stride, leaves)),
                list(map(_device, leaves))))
    if len(set(map(id, leaves))) != len(leaves):
        # Aliases are part of the structure: two places holding one tensor are one entry, two
        # tensors of the same shape are two.
        first: dict[int, int] = {}
        aliases = []
        for i, t in enumerate(leaves):
            j = first.setdefault(id(t), i)
            if j != i:
                aliases.append((i, j))
        key.append(("aliases", tuple(aliases)))
    return leaves, key


class _Mark:
    """A place in a fingerprint's key, equal only to itself."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


# A tensor-like leaf at this place of the walk, and a container whose values all are: what the key
# holds of them is in its columns, in the walk's order.
_TENSOR = _Mark("tensor")
_TENSORS = _Mark("tensors")
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_KEY_TYPES = frozenset({str, int})
_shape, _dtype, _device = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("device")


def _walk(obj: Any, found: list[Any], key: list[Any], depth: int, other: OtherLeaf | None,
          leafy: frozenset[type], others: list[int]) -> bool:
    t = type(obj)
    if t in leafy:
        found.append(obj)
        key.append(_TENSOR)
        return True
    if t in _SCALARS:
        key.append((t, obj))
        return True
    if t is float:
        key.append((t, repr(obj)))  # 0.0 == -0.0, but they encode differently
        return True
    if depth > _MAX_DEPTH:
        return False  # a cycle, or a tree deep enough to plan the slow way, which reports cycles
    if t is dict or t is collections.OrderedDict:
        # model.state_dict() carries per-module versions in `_metadata`, which the tree keeps.
        meta = getattr(obj, "_metadata", None) if t is collections.OrderedDict else None
        names = tuple(obj)
        if not set(map(type, names)) <= _KEY_TYPES:
            return False
        key.append((t, len(obj), None if meta is None else repr(meta)))
        key.append(names)
        values: Any = obj.values()
    elif t is list or t is tuple:
        key.append((t, len(obj)))
        values = obj
    elif other is not None:
        leaf = other(obj)
        if leaf is None:
            return False
        others.append(len(found))
        found.append(leaf[0])
        key.append(leaf[1])
        return True
    else:
        return False
    if set(map(type, values)) <= leafy:
        found.extend(values)
        key.append(_TENSORS)
        return True
    return all(_walk(v, found, key, depth + 1, other, leafy, others) for v in values)


def dtensor_leaf(obj: Any) -> tuple[torch.Tensor, Any] | None:
    """A DTensor's fingerprint (see :func:`fingerprint`): its local tensor, what a save stages (read
    with grad off, where ``to_local()`` is the tensor itself), and a key part that decides its
    structure: the global shape, dtype, placements, shard order and mesh (the boxes follow from
    them) and the local tensor's own shape, strides and device (how the boxes are cut out of it).
    None when the local tensor is not a plain tensor (an async collective's).

    The spec comes from :func:`dtensor_internals` where it can: DTensor's public properties cost
    about a microsecond each, and a fingerprint reads them for every tensor at every save. A
    DTensor keeping its spec object keeps its layout (an in-place op that changes the layout gives
    the DTensor a new spec); two spec objects are equal exactly when their mesh, placements, shard
    order, global shape, strides and dtype are."""
    found = dtensor_internals(obj)
    if found is None:
        local = obj.to_local()
        spec: Any = (obj.device_mesh, tuple(obj.placements), obj.shape, obj.dtype)
    else:
        local, spec = found
    t = type(local)
    if t is not torch.Tensor and t is not torch.nn.Parameter:
        return None
    return local, (type(obj), spec, local.shape, local.stride(), local.device)


# The one reader of DTensor's private attributes: its local tensor (``_local_tensor``) and its
# spec (``_spec``, a ``DTensorSpec``), at C speed; AttributeError when torch no longer has them.
_dtensor_parts = operator.attrgetter("_local_tensor", "_spec")
_dtensor_local, _dtensor_spec = operator.attrgetter("_local_tensor"), operator.attrgetter("_spec")


def dtensor_internals(obj: Any) -> tuple[torch.Tensor, Any] | None:
    """A DTensor's local tensor and spec (see ``_dtensor_parts``). None when torch no longer has
    them: the caller then reads the public properties (tests/test_save_blocking.py fails when torch
    changes them)."""
    try:
        return _dtensor_parts(obj)
    except AttributeError:
        return None


def plan(obj: Any, *, compression: str | None = None, allow_pickle: bool = False) -> Plan:
    codecs.resolve_compression(compression, torch.float32)  # refuse an unknown name even with no tensors
    planner = _Planner(compression, allow_pickle)
    encoder = Encoder(planner.leaf, planner.pickle_leaf if allow_pickle else None, tensor_attrs=True)
    tree = encoder.encode(obj)
    planner.finish()
    minor = ATTRS_MINOR if encoder.wrote_attrs else FORMAT_MINOR
    return Plan(tree=tree, items=planner.items, pickled=planner.pickled, minor=minor)
