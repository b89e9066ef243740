"""Tagged JSON for the structure and the non-tensor leaves of a checkpoint.

Plain JSON values stand for themselves: ``null``, ``true``/``false``, strings, ints within
±2**53 (exact in every JSON reader), finite floats (``1.0`` stays a float, ``1`` an int),
arrays (Python lists) and objects (dicts whose keys are all strings not starting with ``$``).
Everything else is an object whose *first* key starts with ``$`` (the tag); docs/format.md lists
every tag. The tags ``$tensor``, ``$view``, ``$ndarray``, ``$pickle`` (which refer to
entries of the manifest's ``tensors`` table) and ``$npscalar`` are resolved by the caller; what a
numpy value must be to have a ``$ndarray``/``$npscalar`` node, and how ``$npscalar`` is spelled,
is decided here once for every writer and reader of the tree.

No tag ever names code to run: a namedtuple is rebuilt from its field names, and from the class
only when that class is already imported (no import is triggered by loading).
"""

from __future__ import annotations

import base64
import collections
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedObjectError
from .dtypes import NAME_TO_DTYPE, dtype_name

_SAFE_INT = 2**53
# bool, signed, unsigned, float, complex: the numpy kinds whose bytes alone (with the dtype string)
# are the value. Strings, objects, datetimes and structured dtypes would need more than that.
_NUMPY_KINDS = frozenset("biufc")
RESOLVED_TAGS = frozenset({"$tensor", "$view", "$ndarray", "$pickle", "$npscalar", "$per_rank"})

LeafHook = Callable[[Any, list], "Any | None"]
Resolver = Callable[[str, dict], Any]


class Attr(str):
    """A key path part that names a Python attribute (of a tensor), printed as ``.name``."""


def format_path(path: list[Any]) -> str:
    """A key path as a Python expression users can paste: ``obj['model']['w'][0]``, ``obj['w'].foo``."""
    return "obj" + "".join(f".{p}" if isinstance(p, Attr) else f"[{p!r}]" for p in path)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def plain_numpy(dtype: np.dtype) -> bool:
    """Whether values of a numpy dtype are stored as their dtype string and raw bytes."""
    return dtype.kind in _NUMPY_KINDS and dtype.fields is None


def npscalar_node(obj: Any) -> dict[str, str] | None:
    """The ``$npscalar`` node of a numeric numpy scalar; None for anything else."""
    if isinstance(obj, np.generic) and plain_numpy(obj.dtype):
        return {"$npscalar": obj.dtype.str, "b64": _b64(obj.tobytes())}
    return None


def numpy_dtype(spec: Any, bad: Callable[[str], Exception]) -> np.dtype:
    """The numpy dtype a ``$ndarray``/``$npscalar`` node names; raises ``bad(message)`` unless it is plain numeric."""
    try:
        dt = np.dtype(spec) if isinstance(spec, str) else None
    except TypeError:
        dt = None
    if dt is None or not plain_numpy(dt):
        raise bad(f"numpy dtype {spec!r} is not a plain numeric dtype")
    return dt


def npscalar_value(node: dict[str, Any], bad: Callable[[str], Exception]) -> Any:
    """The numpy scalar an ``$npscalar`` node holds."""
    dt = numpy_dtype(node["$npscalar"], bad)
    return np.frombuffer(base64.b64decode(node["b64"]), dtype=dt)[0].copy()


def grad_flags(tensor: torch.Tensor, node: dict[str, Any], bad: Callable[[str], Exception]) -> torch.Tensor:
    """``tensor`` as a ``$tensor``/``$view`` node's ``param`` and ``requires_grad`` flags say: an
    nn.Parameter, or a tensor requiring gradients. Raises ``bad(message)`` for flags its dtype
    cannot take (only floating-point and complex tensors require gradients)."""
    param, grad = node.get("param"), node.get("requires_grad")
    if (param or grad) and not (tensor.is_floating_point() or tensor.is_complex()):
        raise bad(f"{node.get('$tensor', node.get('$view'))!r} is a {tensor.dtype} tensor marked as requiring gradients")
    if param:
        return torch.nn.Parameter(tensor, requires_grad=bool(grad))
    if grad:
        tensor.requires_grad_(True)
    return tensor


def _float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


class Encoder:
    """Turns an object tree into tagged JSON.

    ``leaf_hook(obj, path)`` is asked first for every value that is not a plain container or
    scalar; it returns a JSON node for tensors (and friends) or None when it does not handle the
    value (``path`` is the list of keys from the root). ``pickle_hook(obj, path)`` stores an unsupported object when pickle is allowed; when it
    is None such objects raise :class:`UnsupportedObjectError` naming their path.
    """

    def __init__(self, leaf_hook: LeafHook, pickle_hook: LeafHook | None, *, tensor_attrs: bool = False) -> None:
        self._leaf_hook = leaf_hook
        self._pickle_hook = pickle_hook
        self._active: set[int] = set()
        # tensor_attrs: a tensor's Python attributes (t.foo = ...) become an $attrs node around
        # its first node, as torch.save keeps them; ids of tensors already given theirs.
        self._tensor_attrs = tensor_attrs
        self._attributed: set[int] = set()
        self.wrote_attrs = False  # whether the tree holds an $attrs node (format 1.2)

    def encode(self, obj: Any) -> Any:
        return self._enc(obj, [])

    def _enc(self, obj: Any, path: list[Any]) -> Any:
        # Exact type checks: a subclass (np.float64 is a float, IntEnum is an int) must not be
        # silently narrowed to its base class.
        t = type(obj)
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            if -_SAFE_INT <= obj <= _SAFE_INT:
                return obj
            # Python refuses decimal conversion past 4300 digits; hex has no such limit.
            return {"$int": str(obj)} if obj.bit_length() < 13_000 else {"$int": hex(obj), "base": 16}
        if t is float:
            return _float(obj)
        if t is complex:
            return {"$complex": [_float(obj.real), _float(obj.imag)]}
        if t is bytes:
            return {"$bytes": _b64(obj)}
        if t is bytearray:
            return {"$bytearray": _b64(bytes(obj))}
        if t is torch.dtype:
            name = dtype_name(obj)
            if name is not None:
                return {"$dtype": name}
        if t is torch.device:
            return {"$device": str(obj)}
        handled = self._leaf_hook(obj, path)
        if handled is not None:
            # Most tensors have no attributes: one attribute read each (~0.1 us), nothing more.
            if self._tensor_attrs and isinstance(obj, torch.Tensor) and obj.__dict__ and id(obj) not in self._attributed:
                self._attributed.add(id(obj))
                return self._with_attrs(handled, obj.__dict__, path)
            return handled
        if t in (dict, collections.OrderedDict, list, tuple, torch.Size, set, frozenset) or _is_namedtuple(obj):
            return self._container(obj, path)
        return self._unsupported(obj, path)

    def _with_attrs(self, node: Any, attrs: dict[Any, Any], path: list[Any]) -> dict[str, Any]:
        bad = [k for k in attrs if type(k) is not str]
        if bad:
            raise UnsupportedObjectError(f"{format_path(path)} has attributes named by non-strings ({bad[:3]!r})")
        self.wrote_attrs = True
        return {"$attrs": node, "attrs": {k: self._enc(v, path + [Attr(k)]) for k, v in attrs.items()}}

    def _container(self, obj: Any, path: list[Any]) -> Any:
        if id(obj) in self._active:
            raise UnsupportedObjectError(
                f"{format_path(path)} contains itself (a reference cycle); checkpoints hold trees, not graphs"
            )
        self._active.add(id(obj))
        try:
            t = type(obj)
            if t is list:
                return [self._enc(v, path + [i]) for i, v in enumerate(obj)]
            if t is tuple:
                return {"$tuple": [self._enc(v, path + [i]) for i, v in enumerate(obj)]}
            if t is torch.Size:
                return {"$size": list(obj)}
            if t is set or t is frozenset:
                items = [self._enc(v, path + [f"<item {i}>"]) for i, v in enumerate(_stable_order(obj))]
                return {"$set" if t is set else "$frozenset": items}
            if _is_namedtuple(obj):
                return {
                    "$namedtuple": f"{t.__module__}:{t.__qualname__}",
                    "fields": list(t._fields),
                    "values": [self._enc(v, path + [f]) for f, v in zip(t._fields, obj)],
                }
            pairs_plain = all(type(k) is str and not k.startswith("$") for k in obj)
            if t is dict and pairs_plain:
                return {k: self._enc(v, path + [k]) for k, v in obj.items()}
            pairs = [[self._enc(k, path + [f"<key {k!r}>"]), self._enc(v, path + [k])] for k, v in obj.items()]
            if t is dict:
                return {"$dict": pairs}
            node: dict[str, Any] = {"$odict": pairs}
            # model.state_dict() carries per-module versions in `_metadata`; load_state_dict uses it.
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                node["meta"] = self._enc(meta, path + ["_metadata"])
            return node
        finally:
            self._active.discard(id(obj))

    def _unsupported(self, obj: Any, path: list[Any]) -> Any:
        where = format_path(path)
        if self._pickle_hook is not None:
            node = self._pickle_hook(obj, path)
            if node is not None:
                return node
        raise UnsupportedObjectError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which ckptstore cannot store "
            "without pickle. Convert it to tensors, numbers, strings, bytes, lists, tuples or dicts "
            "(for example obj.state_dict(), or tensor.tolist()), or pass allow_pickle=True to save it "
            "pickled (loading it then needs weights_only=False)."
        )


def _stable_order(items: Any) -> list[Any]:
    try:
        return sorted(items)
    except TypeError:
        return list(items)


def _is_namedtuple(obj: Any) -> bool:
    t = type(obj)
    return isinstance(obj, tuple) and t is not tuple and isinstance(getattr(t, "_fields", None), tuple)


_namedtuple_cache: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple_type(qualified: str, fields: tuple[str, ...]) -> type:
    module_name, _, qualname = qualified.partition(":")
    module = sys.modules.get(module_name)
    cls: Any = module
    for part in qualname.split("."):
        # __dict__, not getattr: a module-level __getattr__ may import code (lazy submodules).
        cls = vars(cls).get(part) if cls is not None and hasattr(cls, "__dict__") else None
    if isinstance(cls, type) and issubclass(cls, tuple) and getattr(cls, "_fields", None) == fields:
        return cls
    key = (qualified, fields)
    if key not in _namedtuple_cache:
        name = qualname.rsplit(".", 1)[-1]
        safe = name if name.isidentifier() else "Record"
        _namedtuple_cache[key] = collections.namedtuple(safe, fields, rename=True)  # type: ignore[misc]
    return _namedtuple_cache[key]


class Decoder:
    """Rebuilds objects from tagged JSON; tensor-like tags go to ``resolve(tag, node)``."""

    def __init__(self, resolve: Resolver, where: str) -> None:
        self._resolve = resolve
        self._where = where

    def bad(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self._where}: manifest tree: {msg}", location=self._where)

    def decode(self, node: Any) -> Any:
        """The object ``node`` (a manifest's tree) encodes; a malformed tree is a CorruptCheckpointError."""
        try:
            return self._decode(node)
        except RecursionError:
            # json's parser nests deeper than this walk can: a legitimate writer (which recursed
            # as deep to encode) never gets near the limit.
            raise self.bad("the tree is nested too deeply") from None

    def _decode(self, node: Any) -> Any:
        t = type(node)
        if node is None or t is bool or t is str or t is int or t is float:
            return node
        if t is list:
            return [self._decode(v) for v in node]
        if t is not dict:
            raise self.bad(f"unexpected JSON value of type {t.__name__}")
        if not node:
            return {}
        tag = next(iter(node))
        if not tag.startswith("$"):
            if any(k.startswith("$") for k in node):
                raise self.bad(f"object mixes plain keys and tags: {sorted(node)[:5]}")
            return {k: self._decode(v) for k, v in node.items()}
        try:
            return self._tagged(tag, node)
        except CheckpointError:
            raise  # raised on purpose by a resolver (map_location misuse, pickle refusal, ...)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise self.bad(f"malformed {tag} node: {str(exc)[:500]}") from None

    def _float(self, v: Any) -> float:
        if type(v) is dict and set(v) == {"$float"} and v["$float"] in ("nan", "inf", "-inf"):
            return float(v["$float"])
        if type(v) in (int, float):
            return float(v)
        raise self.bad(f"not a float: {v!r}")

    def _pairs(self, v: Any) -> list[tuple[Any, Any]]:
        if type(v) is not list or any(type(p) is not list or len(p) != 2 for p in v):
            raise self.bad("dict entries must be [key, value] pairs")
        return [(_hashable(self._decode(k)), self._decode(val)) for k, val in v]

    def _tagged(self, tag: str, node: dict) -> Any:
        v = node[tag]
        if tag in RESOLVED_TAGS:
            if type(v) is not str:  # every resolved tag names an entry (or a dtype) by a string
                raise self.bad(f"{tag} must name an entry with a string, not a {type(v).__name__}")
            return self._resolve(tag, node)
        if tag == "$attrs":
            tensor = self._decode(v)
            attrs = node.get("attrs")
            if not isinstance(tensor, torch.Tensor) or type(attrs) is not dict:
                raise self.bad("$attrs wraps a tensor node and holds an 'attrs' object")
            # Into the instance dict, as they were read at save time: no descriptor or setter runs.
            vars(tensor).update({k: self._decode(x) for k, x in attrs.items()})
            return tensor
        if tag == "$int":
            base = node.get("base", 10)
            if type(v) is not str or base not in (10, 16):
                raise self.bad("$int must be a decimal string, or a hex string with base 16")
            try:
                return int(v, base)
            except ValueError:
                # Also Python's cap on decimal digits (quadratic conversion): writers use hex past it.
                raise self.bad(f"$int {v[:40]!r}... is not a valid base-{base} integer") from None
        if tag == "$float":
            return self._float(node)
        if tag == "$complex":
            return complex(self._float(v[0]), self._float(v[1]))
        if tag in ("$bytes", "$bytearray"):
            data = base64.b64decode(v.encode("ascii"), validate=True)
            return data if tag == "$bytes" else bytearray(data)
        if tag == "$tuple":
            return tuple(self._decode(x) for x in _list(v, self))
        if tag == "$size":
            if any(type(x) is not int for x in _list(v, self)):
                raise self.bad("$size holds ints only")
            return torch.Size(v)
        if tag in ("$set", "$frozenset"):
            items = [_hashable(self._decode(x)) for x in _list(v, self)]
            return set(items) if tag == "$set" else frozenset(items)
        if tag == "$dict":
            return dict(self._pairs(v))
        if tag == "$odict":
            out = collections.OrderedDict(self._pairs(v))
            if "meta" in node:
                out._metadata = self._decode(node["meta"])  # type: ignore[attr-defined]
            return out
        if tag == "$namedtuple":
            fields = tuple(_list(node["fields"], self))
            if type(v) is not str or any(type(f) is not str for f in fields):
                raise self.bad("$namedtuple needs a class name and string fields")
            cls = _namedtuple_type(v, fields)
            return cls(*(self._decode(x) for x in _list(node["values"], self)))
        if tag == "$dtype":
            if v not in NAME_TO_DTYPE:
                raise self.bad(f"unknown dtype {v!r}")
            return NAME_TO_DTYPE[v]
        if tag == "$device":
            return parse_device(v, self)
        raise self.bad(f"unknown tag {tag!r}; the checkpoint may come from a newer ckptstore")


def parse_device(v: Any, dec: Decoder) -> torch.device:
    """A device named in a tree; torch refuses a bad name with RuntimeError, which is not ours to leak."""
    try:
        if type(v) is not str:
            raise TypeError(f"not a string: {type(v).__name__}")
        return torch.device(v)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise dec.bad(f"{str(v)[:100]!r} is not a device: {str(exc)[:200]}") from None


def _list(v: Any, dec: Decoder) -> list:
    if type(v) is not list:
        raise dec.bad(f"expected a JSON array, got {type(v).__name__}")
    return v


def _hashable(v: Any) -> Any:
    # JSON has no tuples: keys that were tuples come back tagged; a list key would be a bug/attack.
    if isinstance(v, (list, dict, set, bytearray)):
        raise CorruptCheckpointError(f"manifest tree: unhashable dict key or set item {v!r}")
    return v
