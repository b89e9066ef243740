"""Sharded checkpoints: every rank writes its own data in parallel, one coordinator commits.

Layout under the checkpoint's URL (docs/format.md, "The sharded directory layout")::

    manifest.json            written last, by rank 0, after every rank's data is durable: the commit
    parts/rank-<r:05d>.json  what rank r wrote (chunks, checksums, timings)
    data/rank-<r:05d>.bin    rank r's chunk bytes, 4 KiB aligned, no header

Loading reads only the byte ranges the caller's layout needs (rounded out to the 4 MiB blocks
that carry their own checksums), with at most ``buffer_bytes`` of staging memory in flight.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import os
import queue
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._buffers import byte_view
from .._version import __version__
from ..collective import Group
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    StorageError,
    UnsupportedObjectError,
)
from ..format import codecs
from ..format.checksum import checksum
from ..format.dtypes import dtype_from_name, dtype_name, element_size
from ..format.manifest import (
    PARTED_VERSION,
    Chunk,
    Manifest,
    Parted,
    TensorEntry,
    check_byte_ranges,
    check_manifest_size,
    chunk_digest,
    combine_digests,
    encode_parted,
    load_json,
    parse_entry,
    parse_sharded,
)
from ..format.tree import Decoder, Encoder, format_path
from ..names import INDEX, MANIFEST, data_file, part_file, writer_variant
from ..planning.flatten import check_storage, contiguous_bytes, escape_key
from ..planning.sharding import Box, ItemMeta, intersect, read_plan, row_span, shard_boxes, spread
from ..storage.small import write_small_exclusive
from ..storage.targets import (
    Source,
    Target,
    makedirs_private,
    open_sink,
    open_source,
    resolve,
    write_bytes,
)
from . import coop, transfer
from .coop import ReadTarget
from .memory import alloc_bytes
from .single_file import BATCH_BYTES, SMALL_BYTES, run_all, write_raw

BLOCK_SIZE = 4 << 20
# A read job of a chunk with block checksums is at most about this many bytes (see _rows_per_job).
JOB_BYTES = 16 << 20
# A rank's second, third... box of one tensor travels through the tiers under its own name
# (`<key>#box<n>`: a tier keys a rank's entries by name); build_manifest folds them back into <key>.
BOX_ALIAS = "#box"


def box_alias(key: str, n: int) -> str:
    """The name of this rank's ``n``-th box of ``key`` (0: the key itself)."""
    return key if n == 0 else f"{key}{BOX_ALIAS}{n}"


def _unalias(key: str) -> str:
    base, sep, n = key.rpartition(BOX_ALIAS)
    return base if sep and n.isdigit() else key
DEFAULT_READ_BUFFER = 256 << 20


class PerRank:
    """Marks a value that belongs to one rank (its RNG state, its data-loader position).

    ``save_sharded`` stores each rank's value separately and ``load_sharded`` puts rank r's saved
    value back into ``.value`` on rank r. Plain tensors and values elsewhere in a state dict are
    treated as replicated: written once, and the same on every rank after a load.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


@dataclass
class GlobalBox:
    """A box of a global tensor as a state-dict leaf, for callers whose framework already decided
    who holds which piece (``ckptstore.dcp`` hands torch.distributed.checkpoint's write items over
    this way). Saving: this rank writes ``tensor`` (None: it writes nothing of this tensor) at
    ``offsets`` of a tensor of global ``shape`` and ``dtype``, and each ``(tensor, offsets)`` of
    ``more`` too (a rank holding several pieces, as a ShardedTensor with several local shards
    does); the pieces of all ranks must tile it. Loading: every piece is filled with the box at its
    offsets (its shape is the box's sizes), from whatever chunks the checkpoint holds."""

    tensor: torch.Tensor | None
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    more: list[tuple[torch.Tensor, tuple[int, ...]]] = field(default_factory=list)

    def pieces(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        first = [] if self.tensor is None else [(self.tensor, tuple(self.offsets))]
        return first + [(t, tuple(o)) for t, o in self.more]


class Directory:
    """A checkpoint directory: a local path or an fsspec URL (no file objects)."""

    def __init__(self, url: Any, storage_options: dict[str, Any] | None) -> None:
        self.base = resolve(url, storage_options)
        if self.base.fileobj is not None:
            raise InvalidArgumentError("sharded checkpoints need a directory path or URL, not a file object")
        self.display = self.base.display.rstrip("/")

    def target(self, rel: str) -> Target:
        if self.base.path is not None:
            return Target(display=f"{self.display}/{rel}", path=os.path.join(self.base.path, rel))
        assert self.base.fspath is not None
        return Target(display=f"{self.display}/{rel}", fs=self.base.fs, fspath=f"{self.base.fspath.rstrip('/')}/{rel}")

    def child(self, rel: str) -> Directory:
        """The directory ``rel`` under this one, on this one's filesystem object. Resolving its URL
        again builds a new filesystem, with a new S3 client and connection pool, wherever the
        options bypass fsspec's instance cache (``skip_instance_cache``): about 0.9 s of CPU per
        step, measured on a durable tier."""
        d = Directory.__new__(Directory)
        d.base = self.target(rel)
        d.display = d.base.display.rstrip("/")
        return d

    def makedirs(self) -> None:
        try:
            if self.base.path is not None:
                for sub in ("data", "parts"):
                    makedirs_private(os.path.join(self.base.path, sub))
            else:
                self.base.fs.makedirs(self.base.fspath, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create checkpoint directory {self.display}: {exc}", errno=exc.errno) from None

    def exists(self, rel: str) -> bool:
        t = self.target(rel)
        if t.path is not None:
            return os.path.exists(t.path)
        return bool(t.fs.exists(t.fspath))

    def remove(self, rel: str) -> None:
        t = self.target(rel)
        if t.path is not None:
            if os.path.exists(t.path):
                os.unlink(t.path)
        elif t.fs.exists(t.fspath):
            t.fs.rm(t.fspath)

    def open(self, rel: str | None) -> Source:
        if rel is None:
            raise CorruptCheckpointError(f"{self.display}: a chunk of a sharded checkpoint names no file", location=self.display)
        target = self.target(rel)
        self._confine(target)
        return open_source(target)

    def _confine(self, target: Target) -> None:
        """A local file must resolve inside the checkpoint directory: manifest paths cannot climb
        out (the path grammar), and neither may a symbolic link planted in the directory."""
        if target.path is None or self.base.path is None:
            return
        root = os.path.realpath(self.base.path)
        real = os.path.realpath(target.path)
        if not real.startswith(root.rstrip(os.sep) + os.sep):
            raise CorruptCheckpointError(
                f"{target.display} resolves to {real}, outside the checkpoint directory {root} (a symbolic "
                "link); refusing to read it. Replace the link by a copy of the file if you trust it",
                location=target.display,
            )

    def read_small(self, rel: str) -> bytes:
        source = self.open(rel)
        try:
            check_manifest_size(source.size, where=source.display)  # before reading it into memory
            return source.read(0, source.size)
        finally:
            source.close()

    def write_small(self, rel: str, data: bytes) -> None:
        write_bytes(self.target(rel), data)

    def create_small(self, rel: str, data: bytes) -> None:
        """Create ``rel`` only if nothing is there (CheckpointExistsError otherwise): a commit point."""
        write_small_exclusive(self.target(rel), data)


# ------------------------------------------------------------------------------------------ save


@dataclass
class Collected:
    """What one rank holds: its boxes of each tensor, and the tree of the state dict."""

    tree: Any = None
    items: dict[tuple[str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # key -> (dtype, shape)
    # Who else holds each box: ("own",) per-rank values and GlobalBox pieces, ("all",) plain tensors
    # (every rank of the same structure holds them), or ("replicas", count, my index, group, mesh) for
    # DTensor boxes (group: the global ranks holding this box; mesh: the global ranks of the mesh).
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple] = field(default_factory=dict)
    # How a DTensor was laid out when saved (for `ckptstore inspect`): key -> {"mesh", "names", "placements"}
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)


def strided_split_factor(p: Any) -> int | None:
    """The split factor of a ``_StridedShard`` placement (FSDP2 over TP), None for any other placement.

    ``_StridedShard`` is private to torch and the one place ckptstore reads a private torch attribute:
    torch has no public way to ask how a strided shard was cut. Kept here alone, and tested
    (tests/test_layouts_dist.py), so a torch upgrade that moves it fails in one obvious place.
    """
    if type(p).__name__ != "_StridedShard":
        return None
    sf = getattr(p, "split_factor", None)
    if not isinstance(sf, int) or sf < 1:
        raise UnsupportedObjectError(
            f"a _StridedShard placement without a usable split factor ({p!r}); this torch version is not supported by "
            "ckptstore's sharded save, report it with the torch version"
        )
    return sf


def _placements(dt: Any, where: str) -> list[tuple]:
    out: list[tuple] = []
    for p in dt.placements:
        sf = strided_split_factor(p)
        if sf is not None:
            out.append(("strided", p.dim, sf))
        elif p.is_shard():
            out.append(("shard", p.dim))
        elif p.is_replicate():
            out.append(("replicate",))
        elif p.is_partial():
            raise UnsupportedObjectError(
                f"{where} is a DTensor with a Partial placement; reduce it first "
                "(dt.redistribute(placements=[Replicate()])) since a checkpoint holds final values"
            )
        else:
            raise UnsupportedObjectError(f"{where} is a DTensor with placement {p!r}, which ckptstore cannot store yet")
    return out


def _spec(p: tuple) -> str:
    return {"shard": lambda: f"S({p[1]})", "replicate": lambda: "R", "strided": lambda: f"_S({p[1]},{p[2]})"}[p[0]]()


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor: that import takes
    1-5 s (it pulls in sympy), paid by a process's first save and first restore, and a process that
    never imported it holds no DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(t, cls)


def local_boxes(t: torch.Tensor, where: str) -> list[tuple[torch.Tensor, Box]]:
    """The pieces of leaf ``t`` this rank holds: a view of its local data per global box it covers
    (one box, except for strided layouts that leave a rank separate runs of some dimension)."""
    if _is_dtensor(t):
        local = t.to_local()  # type: ignore[attr-defined]
        check_storage(local, where)
        return _cut(local, _dtensor_boxes(t, tuple(local.shape), where))
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedObjectError(f"{where} is a tensor subclass {type(t).__qualname__}, which save_sharded cannot store")
    check_storage(t, where)
    return [(t, ((0,) * t.dim(), tuple(t.shape)))]


def _dtensor_boxes(t: Any, local_shape: tuple[int, ...], where: str) -> list[tuple[Box, Box]]:
    """(box of the local tensor, box of the global tensor) of every piece DTensor ``t`` gives this
    rank; raises where its local shard is not what its placements give (a padded shard)."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise InvalidArgumentError(f"{where}: this rank is not part of the DTensor's device mesh")
    boxes = shard_boxes(tuple(t.shape), tuple(mesh.shape), _placements(t, where), coordinate)
    held = tuple(max(lb[0][d] + lb[1][d] for lb, _ in boxes) for d in range(t.dim()))
    if local_shape != held:
        raise UnsupportedObjectError(
            f"{where}: the local shard has shape {local_shape} but its placements {list(t.placements)} give "
            f"{held} (a padded local shard); ckptstore stores unpadded shards: pass to_local()'s unpadded view"
        )
    return boxes


def _cut(local: torch.Tensor, boxes: list[tuple[Box, Box]]) -> list[tuple[torch.Tensor, Box]]:
    """A view of ``local`` per (local box, global box) pair, with its global box."""
    out = []
    for lbox, gbox in boxes:
        view = local
        for d, (o, n) in enumerate(zip(*lbox)):
            if n != local.shape[d]:
                view = view.narrow(d, o, n)
        out.append((view, gbox))
    return out


def _held_boxes(t: torch.Tensor, path: list[Any], ctx: _LoadCtx) -> list[tuple[torch.Tensor, Box]]:
    """:func:`local_boxes` of a load's target, with the boxes of each DTensor layout worked out once
    per walk (``ctx.layouts``), not from the DTensor's properties at every tensor."""
    if not _is_dtensor(t):
        return local_boxes(t, format_path(path))
    local = t.to_local()  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    try:
        key = (id(mesh), tuple(t.placements), tuple(t.shape), tuple(local.shape))  # type: ignore[attr-defined]
        layout = ctx.layouts.get(key)
    except TypeError:  # a placement that does not hash
        return local_boxes(t, format_path(path))
    if layout is None:
        # The mesh is held with its boxes, so that its id is not another mesh's while the walk lasts;
        # a layout of one box that is the whole local tensor (most) needs no view made.
        boxes = _dtensor_boxes(t, tuple(local.shape), format_path(path))
        whole = boxes[0][1] if len(boxes) == 1 and boxes[0][0][1] == tuple(local.shape) else None
        layout = ctx.layouts[key] = (mesh, boxes, whole)
    if layout[2] is not None:
        return [(local, layout[2])]
    return _cut(local, layout[1])


def local_box(t: torch.Tensor, where: str) -> tuple[torch.Tensor, Box]:
    """The one box this rank holds of ``t`` (see :func:`local_boxes` for layouts with several)."""
    boxes = local_boxes(t, where)
    if len(boxes) != 1:
        raise UnsupportedObjectError(f"{where}: this rank holds {len(boxes)} separate boxes of it; use local_boxes")
    return boxes[0]


def _replicas(t: torch.Tensor, cache: dict[Any, tuple]) -> tuple:
    """Who holds the same box of a DTensor as this rank: ("replicas", count, my index, their global ranks)."""
    if not _is_dtensor(t):
        return ("all",)
    from torch.distributed.tensor import DTensor  # imported already: t is one

    assert isinstance(t, DTensor)
    mesh = t.device_mesh
    replicated = tuple(d for d, p in enumerate(t.placements) if p.is_replicate())
    k = (id(mesh), replicated)
    if k not in cache:
        coordinate: list[int] = list(mesh.get_coordinate() or [])
        index = tuple(slice(None) if d in replicated else c for d, c in enumerate(coordinate))
        group = tuple(int(r) for r in mesh.mesh[index].flatten().tolist())
        me = int(mesh.mesh[tuple(coordinate)])
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        cache[k] = ("replicas", len(group), group.index(me), group, ranks, mesh)  # the mesh keeps id() unique
    return cache[k][:5]


def my_writes(
    local: Collected,
    world: int,
    rank: int,
    *,
    same: Sequence[int] | None = None,
    skip: frozenset[str] = frozenset(),
) -> list[ItemMeta]:
    """The boxes this rank writes, decided without communication: each distinct box exactly once
    across the job (empty boxes not at all), in the state dict's order.

    ``same``: the ranks whose state dicts have this rank's structure (all ranks by default), over
    which plain tensors are spread; ``skip``: keys that ranks of another structure write
    (:func:`agree_structure`). Boxes replicated over DTensor mesh dimensions are spread the same way
    over their replicas: every replica holds the same list, so each computes the same assignment.
    """
    peers = list(range(world)) if same is None else list(same)
    metas, everywhere = [], []
    groups: dict[tuple, list[ItemMeta]] = collections.defaultdict(list)
    for (key, offsets, sizes), tensor in local.items.items():
        meta = ItemMeta(key, offsets, sizes, int(tensor.numel() * tensor.element_size()))
        if (meta.nbytes == 0 and sizes) or key in skip:
            continue
        metas.append(meta)
        holders = local.holders[(key, offsets, sizes)]
        if holders[0] == "all":
            everywhere.append(meta)
        elif holders[0] == "replicas":
            groups[holders[3]].append(meta)
    mine_at = peers.index(rank) if rank in peers else -1
    chosen = {m for m, w in zip(everywhere, spread(everywhere, len(peers))) if w == mine_at}
    for group, members in groups.items():
        index = local.holders[(members[0].key, members[0].offsets, members[0].sizes)][2]
        chosen.update(m for m, w in zip(members, spread(members, len(group))) if w == index)

    def writes(m: ItemMeta) -> bool:
        return local.holders[(m.key, m.offsets, m.sizes)][0] == "own" or m in chosen

    return [m for m in metas if writes(m)]


def structure_digest(local: Collected) -> str:
    """What identifies a rank's structure: the keys, dtypes, global shapes and kinds of holding of
    its shared tensors, a DTensor's mesh included. Ranks of one digest hold the same keys on the same
    meshes (a pipeline stage, an expert group, one TP column of an FSDP x TP job's submesh tensors)."""
    kinds = {k[0]: _kind(h) for k, h in local.holders.items()}
    shared = sorted((k, v[0], list(v[1]), kinds.get(k, "own")) for k, v in local.tensors.items() if "#rank" not in k)
    return hashlib.sha256(json.dumps(shared).encode()).hexdigest()


@dataclass(frozen=True)
class Structure:
    """What the ranks agreed on about the union of their state dicts (see :func:`agree_structure`)."""

    same: tuple[int, ...]  # the ranks whose structure is this rank's (a pipeline stage, an expert group)
    skip: frozenset[str]  # keys ranks of an earlier structure write for this one
    representative: bool  # this rank carries its structure's tree and tensor table to the manifest
    # Plain tensors of this rank that ranks of other structures hold as plain tensors too: key -> every
    # rank holding it (the replica check compares them all; a key absent is held by ``same`` alone).
    plain: dict[str, tuple[int, ...]] = field(default_factory=dict)


def agree_structure(group: Group, local: Collected, digests: list[str], cache: dict[str, Structure] | None = None) -> Structure:
    """Agree on the union of the ranks' structures, from every rank's digest (already gathered).

    Ranks of one digest hold the same keys; with pipeline stages or experts there are several. Each
    digest's lowest rank (its representative) sends its tensor table to rank 0, point to point; rank 0
    checks that every key has one dtype and global shape, picks which structure writes a key that
    several hold (a tied weight on the first and last stage: the structure of the lowest rank), and
    broadcasts its verdict: the keys each structure leaves to another. Nobody gathers every rank's
    table, and with ``cache`` nothing is exchanged while the digests stay as they were (digests
    change only when the structure does). Raises the same CheckpointError on every rank on a conflict.
    """
    mine = digests[group.rank]
    same = tuple(r for r, d in enumerate(digests) if d == mine)
    distinct = list(dict.fromkeys(digests))
    if len(distinct) == 1:
        return Structure(same, frozenset(), same[0] == group.rank)
    vector = hashlib.sha256("|".join(digests).encode()).hexdigest()
    if cache is not None and vector in cache:
        return cache[vector]
    reps = [digests.index(d) for d in distinct]
    kinds = {k[0]: _kind(h) for k, h in local.holders.items()}
    table = {k: (v[0], list(v[1]), kinds.get(k, "own")) for k, v in local.tensors.items() if "#rank" not in k}
    tables = group.from_senders(table if group.rank in reps else None, reps)
    verdict: dict[str, Any] | None = None
    if group.rank == 0:
        verdict = union_verdict([(r, digests[r], tables[r]) for r in reps])
    verdict = group.broadcast(verdict)
    assert verdict is not None
    if verdict["error"]:
        raise CheckpointError(verdict["error"])
    index = {d: i for i, d in enumerate(distinct)}
    plain: dict[str, tuple[int, ...]] = {}
    for holding, keys in verdict.get("plain", []):
        if index[mine] in holding:
            ranks = tuple(r for r, d in enumerate(digests) if index[d] in holding)
            plain.update((k, ranks) for k in keys)
    result = Structure(same, frozenset(verdict["skip"].get(mine, ())), same[0] == group.rank, plain)
    if cache is not None:
        cache.clear()  # one structure at a time: a changed one replaces the old
        cache[vector] = result
    return result


def _kind(holders: tuple) -> str:
    """How a key is held, as the union's table compares it: "own", "all", or a DTensor's mesh."""
    if holders[0] != "replicas":
        return holders[0]
    return "dtensor:" + hashlib.sha256(json.dumps(holders[4]).encode()).hexdigest()[:16]


def union_verdict(tables: list[tuple[int, str, dict[str, tuple]]]) -> dict[str, Any]:
    """Rank 0's decision over the representatives' tables ((rank, digest, table) in rank order):
    conflicting dtypes or shapes, and which keys each digest skips because another writes them.

    A key several structures hold is written by one *copy* of it: each structure holding it as a
    plain tensor is a full copy, and so is each DTensor mesh holding it (the structures sharing one
    mesh hold parts of one copy, planned over that mesh). Copies go largest first to the least
    loaded, so replicated keys (a DDP x TP job) are spread over the structures, not all on the first.
    """
    first: dict[str, tuple[int, tuple]] = {}
    copies: dict[str, dict[str, list[str]]] = {}
    load: dict[str, int] = collections.defaultdict(int)
    nbytes: dict[str, int] = {}
    conflicts = []
    for rank, digest, table in tables:
        for key, (dtype, shape, kind) in table.items():
            seen = first.get(key)
            if seen is None:
                first[key] = (rank, (dtype, shape))
                nbytes[key] = math.prod(shape) * element_size(dtype_from_name(dtype, where=key))
            elif seen[1] != (dtype, shape):
                conflicts.append(f"{key!r} is {seen[1][0]} {seen[1][1]} on rank {seen[0]} but {dtype} {shape} on rank {rank}")
                continue
            if kind == "own":
                copies.setdefault(key, {})["own"] = []
                continue
            copy = digest if kind == "all" else kind
            copies.setdefault(key, {}).setdefault(copy, []).append(digest)
    if conflicts:
        shown = "; ".join(conflicts[:5]) + (f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else "")
        return {"error": f"ranks hold one key as different tensors: {shown}. A key names one tensor in the whole "
                         "job: rename one of them, or make them agree", "skip": {}}
    skip: dict[str, list[str]] = collections.defaultdict(list)
    shared = []
    for key, by_copy in copies.items():
        if len(by_copy) == 1 or "own" in by_copy:
            for digests in by_copy.values():
                for d in digests:
                    load[d] += nbytes[key]
        else:
            shared.append(key)
    for key in sorted(shared, key=lambda k: (-nbytes[k], k)):
        by_copy = copies[key]
        owner = min(by_copy, key=lambda c: (load[by_copy[c][0]], c))
        load[by_copy[owner][0]] += nbytes[key]
        for c, digests in by_copy.items():
            if c != owner:
                for d in digests:
                    skip[d].append(key)
    # Plain tensors several structures hold (each a full copy): who holds each, by the structures'
    # indexes in the tables' order (the order of the ranks' distinct digests), keys grouped by holders.
    order = {digest: i for i, (_rank, digest, _table) in enumerate(tables)}
    holding: dict[tuple[int, ...], list[str]] = collections.defaultdict(list)
    for key, by_copy in copies.items():
        held = sorted(order[c] for c in by_copy if c in order)  # a plain copy is named by its digest
        if len(held) > 1:
            holding[tuple(held)].append(key)
    return {"error": None, "skip": dict(skip), "plain": [[list(h), sorted(k)] for h, k in sorted(holding.items())]}


def merge_structures(shared: list[tuple[int, dict[str, Any]]], where: str) -> dict[str, Any]:
    """The union of the representatives' trees, tensor tables and layouts ((rank, shared) in rank order)."""
    tree: Any = None
    tensors: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    origin = 0
    for i, (rank, part) in enumerate(shared):
        if i == 0:
            tree, origin = part["tree"], rank
        else:
            tree = _merge_tree(tree, part["tree"], [], origin, rank, where)
        for k, v in part["tensors"].items():
            tensors.setdefault(k, v)
        for k, v in part.get("layouts", {}).items():
            layouts.setdefault(k, v)
    return {"tree": tree, "tensors": tensors, "layouts": layouts}


def _is_plain_dict(node: Any) -> bool:
    return isinstance(node, dict) and not any(isinstance(k, str) and k.startswith("$") for k in node)


def _merge_tree(a: Any, b: Any, path: list[Any], ra: int, rb: int, where: str) -> Any:
    """Dicts merge key by key (each stage adds its keys); anything else must be equal on both sides."""
    if _is_plain_dict(a) and _is_plain_dict(b):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge_tree(a[k], v, path + [k], ra, rb, where) if k in a else v
        return out
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and next(iter(a), None) in ("$dict", "$odict"):
        tag = next(iter(a))
        pairs = {json.dumps(k, sort_keys=True): [k, v] for k, v in a[tag]}
        for k, v in b[tag]:
            j = json.dumps(k, sort_keys=True)
            pairs[j] = [k, _merge_tree(pairs[j][1], v, path + [k], ra, rb, where)] if j in pairs else [k, v]
        out = {tag: list(pairs.values())}
        if "meta" in a:
            out["meta"] = _merge_tree(a["meta"], b["meta"], path + ["_metadata"], ra, rb, where)
        return out
    if a != b:
        shown = lambda v: (s := json.dumps(v))[:80] + ("..." if len(s) > 80 else "")  # noqa: E731
        raise CheckpointError(
            f"{where}: ranks {ra} and {rb} hold different values at {format_path(path)} ({shown(a)} against {shown(b)}). "
            "A value that is not a tensor is saved once for the whole job, so the ranks holding it must agree: mark "
            "values that differ per rank with PerRank, or key them apart (for optimizer state of pipeline stages, "
            "TrainState(model=[...parts]) keys it by parameter name)"
        )
    return a


def collect(state: Any, rank: int, encode_per_rank: Callable[[Any], bytes]) -> Collected:
    local = Collected()
    seen: dict[int, dict[str, Any]] = {}
    meshes: dict[Any, tuple] = {}
    taken: set[str] = set()

    def unique(path: list[Any]) -> str:
        # Paths can collide once escaped (the int 1 and the str "1"); every rank walks the same
        # structure in the same order, so the suffixes agree across ranks.
        base = escape_key(path)
        key, n = base, 1
        while key in taken or "#rank" in key or BOX_ALIAS in key:
            n += 1
            key = f"{base.replace('#rank', '#_rank').replace(BOX_ALIAS, '#_box')}#{n}"
        taken.add(key)
        return key

    def leaf(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, GlobalBox):
            return _collect_box(local, obj, unique(path), format_path(path))
        if isinstance(obj, PerRank):
            key = unique(path)
            blob = torch.frombuffer(bytearray(encode_per_rank(obj.value)), dtype=torch.uint8)
            entry_key = f"{key}#rank{rank:05d}"
            local.items[(entry_key, (0,), (blob.numel(),))] = blob
            local.holders[(entry_key, (0,), (blob.numel(),))] = ("own",)
            local.tensors[entry_key] = ("uint8", (blob.numel(),))
            return {"$per_rank": key}
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:
                return seen[id(obj)]
            where = format_path(path)
            key = unique(path)
            name = dtype_name(obj.dtype)
            if name is None or obj.is_quantized or obj.layout != torch.strided:
                raise UnsupportedObjectError(f"{where}: {obj.dtype}/{obj.layout} tensors cannot be stored")
            holders = _replicas(obj, meshes)
            for data, box in local_boxes(obj, where):
                local.items[(key, box[0], box[1])] = data
                local.holders[(key, box[0], box[1])] = holders
            local.tensors[key] = (name, tuple(obj.shape))
            if holders[0] == "replicas":
                mesh = obj.device_mesh  # type: ignore[attr-defined]
                local.layouts[key] = {
                    "mesh": list(mesh.shape),
                    "names": list(mesh.mesh_dim_names or []),
                    "placements": [_spec(p) for p in _placements(obj, where)],
                }
            node = {"$tensor": key}
            seen[id(obj)] = node
            return node
        return None

    local.tree = Encoder(leaf, None).encode(state)
    return local


def _collect_box(local: Collected, box: GlobalBox, key: str, where: str) -> dict[str, str]:
    name = dtype_name(box.dtype)
    if name is None:
        raise UnsupportedObjectError(f"{where}: {box.dtype} tensors cannot be stored")
    local.tensors[key] = (name, tuple(box.shape))
    for tensor, offsets in box.pieces():
        if tensor.dtype != box.dtype or len(offsets) != len(box.shape) or tensor.dim() != len(box.shape):
            raise InvalidArgumentError(
                f"{where}: a {tensor.dtype} box of {tensor.dim()} dims at offsets {list(offsets)} does not fit "
                f"a {box.dtype} tensor of shape {list(box.shape)}"
            )
        sizes = tuple(tensor.shape)
        if (key, offsets, sizes) in local.items:
            raise InvalidArgumentError(f"{where}: the box at offsets {list(offsets)} of sizes {list(sizes)} is given twice")
        local.items[(key, offsets, sizes)] = tensor
        local.holders[(key, offsets, sizes)] = ("own",)
    return {"$tensor": key}


def save(
    state: Any,
    url: Any,
    *,
    process_group: Any,
    storage_options: dict[str, Any] | None,
    overwrite: bool,
    encode_per_rank: Callable[[Any], bytes],
) -> None:
    """Commits a format 2.0 manifest: rank 0 receives each rank's part summary (its part file's
    name, size and checksum, and the chunks at a tensor's origin), never a chunk table, so the
    commit and the manifest grow with the ranks plus the tensors, not ranks x tensors (a 1.x
    manifest at 4,096 ranks x 10,000 tensors was gigabytes, built in about half an hour). The
    manifest is its own index: a rank plans its load from it and the part files it needs
    (checkpoint/index.py)."""
    t0 = time.perf_counter()
    group = Group(process_group)
    directory = Directory(url, storage_options)
    rank = group.rank

    # Rank 0 decides whether the destination may be written, so no rank starts on a committed step.
    verdict: Any = None
    created: list[str] = []  # directories rank 0 made, removed again if the save fails
    if rank == 0:
        if directory.base.path is not None:
            root = directory.base.path
            created = [p for p in (os.path.join(root, "data"), os.path.join(root, "parts"), root) if not os.path.isdir(p)]
        try:
            if directory.exists(MANIFEST):
                if not overwrite:
                    raise CheckpointError(
                        f"{directory.display} already holds a committed checkpoint; pass overwrite=True to replace "
                        "it, or save to a new directory"
                    )
                directory.remove(MANIFEST)  # uncommit first: a crash mid-save must not leave old + new mixed
            if directory.exists(INDEX):
                # It describes an old 1.x manifest, perhaps one an overwrite uncommitted before it
                # crashed; readers look for it first, and beside this save's manifest (its own
                # index) it would send them to the old data files, still there under their names.
                directory.remove(INDEX)
            directory.makedirs()
        except CheckpointError as exc:
            verdict = str(exc)
        except OSError as exc:
            verdict = f"cannot prepare {directory.display}: {exc}"
    verdict = group.broadcast(verdict)
    if verdict is not None:
        raise CheckpointError(verdict)
    if rank != 0 and directory.base.path is not None:
        directory.makedirs()

    # Planning is local: which boxes this rank writes follows from its own boxes and placements
    # (see my_writes); the ranks check that they hold one structure with one all-reduce of its
    # digest (_digests), and only when the digests differ (pipeline stages, experts) exchange them
    # and the representatives' tables (agree_structure), so the cost does not grow with the ranks.
    status: dict[str, Any]
    try:
        local = collect(state, rank, encode_per_rank)
        status = {"ok": True, "digest": structure_digest(local)}
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather, or the others hang
        status = {"ok": False, "error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    written: list[str] = []  # the files this rank wrote: a failed or losing save removes these, no others
    try:
        digests = _digests(group, status)  # raises where some rank could not collect its state
        structure = agree_structure(group, local, digests)
        mine = my_writes(local, group.world, rank, same=structure.same, skip=structure.skip)
        t_plan = time.perf_counter()

        try:
            part = _write_rank(directory, rank, group.world, local, mine, t0, t_plan, overwrite, written)
            shapes = {k: v[1] for k, v in local.tensors.items()}
            result: dict[str, Any] = {"ok": True, "part": part_summary(part, shapes)}
            if structure.representative:
                result["shared"] = {"tree": local.tree, "tensors": local.tensors, "layouts": local.layouts}
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather, or the others hang
            result = {"ok": False, "error": f"rank {rank} ({socket.gethostname()}): {exc}"}
        results = _to_coordinator(group, result)  # parts go to rank 0 only

        commit: Any = None
        if rank == 0:
            try:
                _raise_if_failed(results)
                union = merge_structures([(r, x["shared"]) for r, x in enumerate(results) if "shared" in x], directory.display)
                tensors = {k: (v[0], tuple(v[1])) for k, v in union["tensors"].items()}
                body = parted_manifest(union["tree"], tensors, [r["part"] for r in results], group.world,
                                       layouts=union["layouts"] or None)
                parse_sharded(body, where=f"{directory.display}/{MANIFEST}")  # never commit what we would refuse to read
                if overwrite:
                    directory.write_small(MANIFEST, body)
                else:
                    # The commit point: of writers racing for one directory, the one whose manifest
                    # is created first wins; each writer's data files are its own (_write_rank), so
                    # the winning manifest never names a loser's bytes.
                    directory.create_small(MANIFEST, body)
            except CheckpointExistsError:
                commit = {"exists": True}
            except Exception as exc:  # noqa: BLE001 - the other ranks wait for this verdict
                commit = str(exc) if str(exc).startswith("save_sharded failed") else f"rank 0 could not commit {directory.display}: {exc}"
        commit = group.broadcast(commit)
        if isinstance(commit, dict):
            raise CheckpointExistsError(
                f"{directory.display} was committed by another writer while this save wrote it; this save's files "
                "were removed and the other writer's checkpoint is untouched. Save to a new directory, or pass "
                "overwrite=True to replace it", location=directory.display)
        if commit is not None:
            raise CheckpointError(commit)
    except CheckpointError:
        # Every rank raises at the same point (each raise above follows a collective), so all of them
        # clean up together: the directory is left as it was, and the error's "nothing was committed" holds.
        _undo(directory, group, rank, created, written)
        raise


def _undo(directory: Directory, group: Group, rank: int, created: list[str], written: list[str]) -> None:
    for rel in written:  # only this writer's own files: a racing writer may have committed the usual names
        try:
            directory.remove(rel)
        except OSError:
            pass  # the error being raised says more than this one
    group.max_int64([0])  # a barrier: every rank's files are gone before rank 0 removes the directories
    if rank == 0 and directory.base.path is not None:
        for path in created:  # deepest first
            try:
                os.rmdir(path)
            except OSError:
                pass  # not empty: something else lives there, leave it


def _to_coordinator(group: Group, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``result`` on rank 0 (an empty list elsewhere), point to point: a gather pads
    every rank's message to the largest (the representative's, with the tree and tensor table) and
    makes every rank learn every rank's size. Torch's threaded process group (benchmarks run
    thousands of ranks as threads on it) has no point-to-point messages: a gather there."""
    if group.world == 1:
        return [result]
    import torch.distributed as dist

    try:
        threaded = str(dist.get_backend(group.pg)) == "threaded"
    except (RuntimeError, ValueError):
        threaded = False
    if threaded:
        return group.gather_to_root(result)
    got = group.from_senders(result, list(range(group.world)))
    return [got[r] for r in range(group.world)] if group.rank == 0 else []


def _digests(group: Group, status: dict[str, Any]) -> list[str]:
    """Every rank's structure digest, or the CheckpointError of the ranks that failed to collect
    their state. One all-reduce of a flag and of 63 bits of the digest (negated too, for the
    minimum) settles the usual case, every rank of one structure, whatever the number of ranks;
    only a failure, or ranks of several structures (pipeline stages, experts), gathers what every
    rank holds."""
    if group.world == 1:
        _raise_if_failed([status])
        return [status["digest"]]
    mark = int(hashlib.sha256(status["digest"].encode()).hexdigest()[:16], 16) >> 1 if status["ok"] else 0
    failed, high, low = group.max_int64([0 if status["ok"] else 1, mark, -mark])
    if failed:
        _raise_if_failed(group.all_gather(status))
    if high == -low:
        return [status["digest"]] * group.world
    return [g["digest"] for g in group.all_gather(status)]


def _raise_if_failed(statuses: list[dict[str, Any]]) -> None:
    errors = [s["error"] for s in statuses if not s["ok"]]
    if errors:
        raise CheckpointError("save_sharded failed, nothing was committed: " + "; ".join(errors))


def _write_rank(
    directory: Directory, rank: int, world: int, local: Collected, mine: list[ItemMeta], t0: float, t_plan: float,
    overwrite: bool = False, written: list[str] | None = None,
) -> dict[str, Any]:
    """Write this rank's data file and part file; ``written`` collects their names as they appear."""
    written = [] if written is None else written
    chunks: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    written_bytes = 0
    token = secrets.token_hex(4)
    rel, part_rel = data_file(rank), part_file(rank)
    if not overwrite and directory.base.path is None:
        # On an object store every writer names its files for itself: a server may complete several
        # conditional multipart uploads of one new key (SeaweedFS does, Ceph RGW ignores the
        # condition), so only the manifest's conditional PUT can decide between racing writers.
        rel, part_rel = writer_variant(rel, token), writer_variant(part_rel, token)
    if mine:
        tensors = [local.items[(m.key, m.offsets, m.sizes)] for m in mine]
        while True:
            # Locally the data file is created exclusively (a link): when a racing writer, or a save
            # that crashed here, holds the usual name, this writer takes names of its own.
            sink = open_sink(directory.target(rel), exclusive=not overwrite)
            try:
                done = write_raw(sink, [functools.partial(contiguous_bytes, t) for t in tensors],
                                 block_size=BLOCK_SIZE)
                sink.commit(b"")
                written.append(rel)
                break
            except CheckpointExistsError:
                sink.abort()
                if rel != data_file(rank):
                    raise
                rel, part_rel = writer_variant(rel, token), writer_variant(part_rel, token)
            except BaseException:
                sink.abort()
                raise
        for m, w in zip(mine, done):
            blocks = w.block_checksums
            chunk = Chunk(
                m.offsets,
                m.sizes,
                rel,
                w.offset,
                w.length,
                "raw",
                w.checksum,
                BLOCK_SIZE if blocks is not None else None,
                blocks,
            )
            chunks[m.key].append(chunk.to_json())
            written_bytes += w.length
    t_write = time.perf_counter()
    part = {
        "rank": rank,
        "world_size": world,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "bytes": written_bytes,
        "chunks": dict(chunks),
        "timings": {"plan_s": round(t_plan - t0, 6), "write_s": round(t_write - t_plan, 6)},
    }
    body = json.dumps(part, separators=(",", ":")).encode()
    directory.write_small(part_rel, body)
    written.append(part_rel)
    # Not in the file (they are about its bytes): what the committer's manifest names it by.
    return {**part, "part_file": part_rel, "part_size": len(body), "part_checksum": checksum(body)}


def build_manifest(
    tree: Any,
    tensors_meta: dict[str, tuple[str, tuple[int, ...]]],
    parts: list[dict[str, Any]],
    world: int,
    *,
    layouts: dict[str, Any] | None = None,
) -> Manifest:
    tensors: dict[str, TensorEntry] = {}
    for key, (dtype, shape) in tensors_meta.items():
        tensors[key] = TensorEntry(dtype=dtype, shape=tuple(shape))
    for part in parts:
        for alias, chunk_list in part["chunks"].items():
            key = _unalias(alias)
            if key not in tensors:  # another rank's per-rank value: one uint8 chunk
                tensors[key] = TensorEntry(dtype="uint8", shape=tuple(chunk_list[0]["sizes"]))
            for c in chunk_list:
                blocks = c.get("block_checksums")
                tensors[key].chunks.append(
                    Chunk(
                        tuple(c["offsets"]),
                        tuple(c["sizes"]),
                        c["file"],
                        c["offset"],
                        c["length"],
                        c["codec"],
                        c["checksum"],
                        c.get("block_size"),
                        tuple(blocks) if blocks is not None else None,
                    )
                )
    for entry in tensors.values():
        entry.chunks.sort(key=lambda c: c.offsets)
    return Manifest(
        kind="sharded",
        tensors=tensors,
        tree=tree,
        meta={
            "world_size": world,
            "created_unix": round(time.time(), 3),
            "torch_version": torch.__version__,
            "ckptstore_version": __version__,
            "total_bytes": sum(e.nbytes for e in tensors.values()),
            "ranks": [
                {k: p[k] for k in ("rank", "host", "pid", "bytes", "timings")} for p in sorted(parts, key=lambda p: p["rank"])
            ],
            **({"layouts": {k: layouts[k] for k in sorted(layouts) if k in tensors}} if layouts else {}),
        },
    )


# ------------------------------------------------------------------------------------------ load


class _SavedRef:
    __slots__ = ("tag", "key")

    def __init__(self, tag: str, key: str) -> None:
        self.tag, self.key = tag, key


@dataclass
class _LoadCtx:
    manifest: Manifest
    targets: list[ReadTarget] = field(default_factory=list)
    per_rank: list[tuple[PerRank, str, list[Any]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    fresh: dict[str, torch.Tensor] = field(default_factory=dict)  # entry key -> tensor allocated for it
    # Opens chunk files to check their sizes before a buffer is allocated for what they claim to hold.
    open_file: Callable[[str | None], Source] | None = None
    display: str = ""
    sizes: dict[str, int] = field(default_factory=dict)
    # A planning walk (which chunks will a load read?) allocates nothing: an empty slot stays empty
    # and the load that follows allocates it, after checking what its files hold.
    plan_only: bool = False
    state: Any = None  # the caller's state walked: a load reuses the walk only for the same object
    # The boxes a DTensor layout gives this rank, by (mesh, placements, global and local shape):
    # the tensors of one state share a few layouts, and working each out again from the DTensor's
    # properties was most of a walk's time.
    layouts: dict[Any, Any] = field(default_factory=dict)

    def check_extents(self, key: str, entry: TensorEntry) -> None:
        if self.open_file is None:
            return
        for c in entry.chunks:
            if c.file is None or not c.length:
                continue
            if c.file not in self.sizes:
                try:
                    source = self.open_file(c.file)
                except CheckpointNotFoundError:
                    raise CorruptCheckpointError(
                        f"{self.display}/{c.file} is missing, but the manifest keeps tensor {key!r} in it; the "
                        "checkpoint is damaged: load another copy or an earlier step",
                        location=f"{self.display}/{c.file}",
                        key=key,
                    ) from None
                try:
                    self.sizes[c.file] = source.size
                finally:
                    source.close()
            check_extent(self.display, key, c, self.sizes[c.file])


def check_extent(where: str, key: str, c: Chunk, size: int) -> None:
    if c.offset + c.length > size:
        location = f"{where}/{c.file}"
        raise CorruptCheckpointError(
            f"{location} is truncated (it has {size} bytes, but the manifest keeps bytes [{c.offset}, "
            f"{c.offset + c.length}) of tensor {key!r} in it, or the manifest is damaged); load another copy or "
            "an earlier step",
            location=location,
            key=key,
        )


def read_manifest(directory: Directory) -> Manifest:
    """The committed manifest of ``directory``, whole: a format 2 manifest's chunk table is
    assembled from the part files it names (each checked against its size and checksum)."""
    where = f"{directory.display}/{MANIFEST}"
    try:
        body = directory.read_small(MANIFEST)
    except CheckpointNotFoundError:
        if directory.exists("parts") or directory.exists("data"):
            raise CheckpointNotFoundError(
                f"{directory.display} has data but no {MANIFEST}: its save never committed, so it is not a "
                "checkpoint; load an earlier one"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {directory.display}: {MANIFEST} does not exist") from None
    parsed = parse_sharded(body, where=where)
    manifest = assemble(parsed, directory.read_small, directory.display) if isinstance(parsed, Parted) else parsed
    if manifest.kind != "sharded":
        raise CorruptCheckpointError(f"{where}: kind {manifest.kind!r} is not a sharded checkpoint", location=where)
    world = manifest.meta.get("world_size")
    if type(world) is not int or world < 1:
        raise CorruptCheckpointError(f"{where}: meta.world_size must be a positive int, got {world!r}", location=where)
    if manifest.pickled:
        raise CorruptCheckpointError(f"{where}: a sharded checkpoint holds no pickled entries", location=where)
    for key, entry in manifest.tensors.items():
        if any(c.file is None for c in entry.chunks):
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has a chunk with no file", location=where, key=key)
    return manifest


# ------------------------------------------------------------------------------ format 2.0 manifests


def part_summary(part: dict[str, Any], shapes: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the committer of a format 2.0 manifest needs of a rank's part (``part`` as its tier
    returned it, naming its ``part_file``, ``part_size`` and ``part_checksum``): no chunk table.
    ``origin`` lists the rank's chunks at the origin of their tensor (at most one per tensor in
    the whole job, as boxes are written once and do not overlap): those that are the whole tensor
    tell the committer this rank is its one writer. ``layout``: the digest of the rank's chunks
    (None when it wrote none), from which the committer composes the step's layout digest.
    ``shapes`` (key -> global shape, the rank's own tensors): ``whole`` then carries the chunks
    of the tensors this rank wrote whole, which the manifest lists too, so that a rank loading a
    replicated tensor another rank wrote reads no part but its own. Each tensor is written whole
    by at most one rank in the job: what the committer receives grows with the tensors, not with
    ranks x tensors."""
    origin: list[tuple[str, Any]] = []
    whole: list[tuple[str, Any]] = []
    items: list[tuple[str, Any]] = []
    for alias, chunks in part["chunks"].items():
        key = _unalias(alias)
        for c in chunks:
            items.append((key, c))
            if not any(c["offsets"]):
                origin.append((key, c["sizes"]))
                if shapes is not None and key == alias and len(chunks) == 1 and list(shapes.get(key, ())) == list(c["sizes"]):
                    whole.append((key, c))
    return {
        **{k: part[k] for k in ("rank", "host", "pid", "bytes", "timings", "part_file", "part_size", "part_checksum")},
        "origin": origin,
        "layout": chunk_digest(items) if items else None,
        **({"whole": whole} if shapes is not None else {}),
    }


def parted_manifest(tree: Any, tensors_meta: dict[str, tuple[str, tuple[int, ...]]], summaries: list[dict[str, Any]],
                    world: int, *, layouts: dict[str, Any] | None = None, meta: dict[str, Any] | None = None) -> bytes:
    """The bytes of a format 2.0 manifest for ``world`` ranks' parts, from their
    :func:`part_summary` (in any order): the tree, the tensor table, each tensor's one writer where
    a single rank wrote it whole, and each rank's part file with its size and checksum. Its cost
    grows with the ranks plus the tensors, never with ranks x tensors (no chunk is seen)."""
    tensors: dict[str, TensorEntry] = {k: TensorEntry(dtype=d, shape=tuple(s)) for k, (d, s) in tensors_meta.items()}
    writers: dict[str, int] = {}
    inline: dict[str, list[Any]] = {}
    parts: list[Any] = [None] * world
    digests: dict[int, str] = {}
    for summary in summaries:
        rank = summary["rank"]
        parts[rank] = (summary["part_file"], summary["part_size"], summary["part_checksum"])
        if summary["layout"] is not None:
            digests[rank] = summary["layout"]
        for key, chunk in summary.get("whole", ()):
            inline[key] = [chunk]
        for key, sizes in summary["origin"]:
            entry = tensors.get(key)
            if entry is None:  # another rank's per-rank value: one uint8 chunk, its own
                entry = tensors[key] = TensorEntry(dtype="uint8", shape=tuple(sizes))
            if tuple(sizes) == entry.shape:
                writers[key] = rank
    missing = [r for r, p in enumerate(parts) if p is None]
    if missing:
        raise CheckpointError(f"no part of ranks {missing[:5]} reached the committer")
    header = Manifest(kind="sharded", tensors=tensors, tree=tree, format_version=PARTED_VERSION, meta={
        "world_size": world,
        "created_unix": round(time.time(), 3),
        "torch_version": torch.__version__,
        "ckptstore_version": __version__,
        "total_bytes": sum(e.nbytes for e in tensors.values()),
        "ranks": [{k: s[k] for k in ("rank", "host", "pid", "bytes", "timings")}
                  for s in sorted(summaries, key=lambda s: s["rank"])],
        **({"layouts": {k: layouts[k] for k in sorted(layouts) if k in tensors}} if layouts else {}),
        **(meta or {}),
    })
    inline = {k: v for k, v in inline.items() if writers.get(k) is not None}
    return encode_parted(header, writers, parts, combine_digests(digests), inline)


def read_part(read: Callable[[str], bytes], parted_or_file: tuple[str, int | None, str], rank: int,
              display: str) -> dict[str, Any]:
    """Rank ``rank``'s part file, checked against the (file, size, checksum) a manifest or index
    names it by: a missing, short or damaged part is a CorruptCheckpointError naming the file."""
    rel, size, expected = parted_or_file
    where = f"{display}/{rel}"
    try:
        data = read(rel)
    except (CheckpointNotFoundError, FileNotFoundError):
        raise CorruptCheckpointError(f"{where}: the part file of rank {rank} that the manifest names is missing: "
                                     "the checkpoint is damaged; load another copy or an earlier step",
                                     location=where) from None
    if (size is not None and len(data) != size) or checksum(data) != expected:
        raise CorruptCheckpointError(
            f"{where}: the part file of rank {rank} does not match the manifest's size and checksum of it "
            f"({len(data)} bytes): this copy is damaged; load another copy or an earlier step", location=where)
    doc = load_json(data, where=where, what="part file")
    if not isinstance(doc, dict) or doc.get("rank") != rank or not isinstance(doc.get("chunks"), dict):
        raise CorruptCheckpointError(f"{where}: not the part of rank {rank}", location=where)
    return doc


def assemble(parted: Parted, read: Callable[[str], bytes], display: str) -> Manifest:
    """The whole manifest of a format 2.0 ``parted`` one: its chunk table read from every part
    file (each checked against the manifest), validated as a 1.x manifest is (coverage, byte
    ranges, one writer per whole tensor)."""
    where = f"{display}/{MANIFEST}"
    header = parted.header
    raw: dict[str, list[Any]] = {key: [] for key in header.tensors}
    for rank, named in enumerate(parted.parts):
        doc = read_part(read, named, rank, display)
        for alias, chunks in doc["chunks"].items():
            key = _unalias(alias)
            got = raw.get(key)
            if got is None or not isinstance(chunks, list):
                raise CorruptCheckpointError(f"{display}/{named[0]}: tensor {key!r} is not in the manifest",
                                             location=where, key=key)
            writer = parted.writers.get(key)
            if writer is not None and writer != rank:
                raise CorruptCheckpointError(
                    f"{display}/{named[0]}: rank {rank} names chunks of tensor {key!r}, which the manifest says "
                    f"rank {writer} wrote whole", location=where, key=key)
            got.extend(chunks)
    tensors: dict[str, TensorEntry] = {}
    for key, entry in header.tensors.items():
        parsed = parse_entry(key, {"dtype": entry.dtype, "shape": list(entry.shape), "chunks": raw[key]}, where)
        parsed.chunks.sort(key=lambda c: c.offsets)
        if entry.chunks and entry.chunks != parsed.chunks:
            raise CorruptCheckpointError(
                f"{where}: the chunks the manifest lists for tensor {key!r} are not those of its writer's part "
                f"file: the checkpoint is damaged; load another copy or an earlier step", location=where, key=key)
        tensors[key] = parsed
    check_byte_ranges(tensors, where)
    return Manifest(kind="sharded", tensors=tensors, tree=header.tree, pickled=[], meta=header.meta,
                    format_version=header.format_version, writer=header.writer)


def load(
    state: Any,
    url: Any,
    *,
    process_group: Any,
    storage_options: dict[str, Any] | None,
    strict: bool,
    per_rank: str,
    buffer_bytes: int,
    decode_per_rank: Callable[[bytes, str], Any],
    plan: Callable[[Any, Directory, Group], Manifest] | None = None,
) -> None:
    """``plan``: the manifest a rank loads with (collective; by default the whole manifest)."""
    if per_rank not in ("error", "skip"):
        raise InvalidArgumentError(f"per_rank={per_rank!r}: use 'error' or 'skip'")
    if buffer_bytes < 1:
        raise InvalidArgumentError("buffer_bytes must be positive")
    group = Group(process_group)
    try:
        directory = Directory(url, storage_options)
        manifest = read_manifest(directory) if plan is None else plan(state, directory, group)
    except BaseException:
        coop.abstain(group)  # the other ranks' reads must not wait for this one
        raise
    load_manifest(
        state,
        manifest,
        directory.display,
        directory.open,
        group=group,
        strict=strict,
        per_rank=per_rank,
        buffer_bytes=buffer_bytes,
        decode_per_rank=decode_per_rank,
    )


def _walk(state: Any, manifest: Manifest, display: str) -> _LoadCtx:
    """The planning walk of a load: ``state`` and ``manifest``'s tree together, allocating nothing
    (an empty slot gets a placeholder the load replaces). Kept on ``manifest`` (its ``walk``) for
    the load that follows: the tree and tensor table it reads are the ones the load reads, and a
    planner only adds chunks to the table."""
    saved = Decoder(lambda tag, node: _SavedRef(tag, node[tag]), display).decode(manifest.tree)
    ctx = _LoadCtx(manifest, plan_only=True, state=state)
    with torch.no_grad():
        _fill(state, saved, [], ctx, top=True)
    manifest.walk = ctx
    return ctx


def _walked(state: Any, manifest: Manifest) -> _LoadCtx | None:
    """The planning walk kept on ``manifest`` when it is one of ``state`` whose targets a load can
    fill as they are (no placeholder of an empty slot in it)."""
    ctx = manifest.walk
    if not isinstance(ctx, _LoadCtx) or ctx.state is not state or ctx.manifest is not manifest or ctx.fresh:
        return None
    return ctx


def chunks_needed(state: Any, manifest: Manifest, display: str, rank: int, world: int) -> list[tuple[str, int, int]]:
    """The (file, offset, length) of every chunk a load of ``state`` by ``rank`` of ``world`` will
    read (whole chunks): the load's own planning walk, allocating nothing (or the one a planner
    made already, :func:`load_boxes`). Non-tensor leaves of ``state`` are replaced by the saved
    values, as the load that follows does anyway."""
    ctx = _walked(state, manifest) or _walk(state, manifest, display)
    out: set[tuple[str, int, int]] = set()
    for target in ctx.targets:
        entry = manifest.tensors[target.key]
        for c in entry.chunks:
            if c.file is None:
                continue
            if not c.sizes or (c.offsets == target.box[0] and c.sizes == target.box[1]) or intersect(
                    target.box, (c.offsets, c.sizes)) is not None:
                out.add((c.file, c.offset, c.length))
    if int(manifest.meta.get("world_size", 1)) == world:
        for _wrapper, key, _path in ctx.per_rank:
            per = manifest.tensors.get(f"{key}#rank{rank:05d}")
            for c in per.chunks if per is not None else []:
                if c.file is not None:
                    out.add((c.file, c.offset, c.length))
    return sorted(out)


def load_boxes(state: Any, manifest: Manifest, display: str, rank: int, world: int,
               missing: list[str] | None = None) -> list[tuple[str, Box]]:
    """The (entry key, box) of every piece a load of ``state`` by ``rank`` of ``world`` fills: the
    walk of :func:`chunks_needed`, which needs of ``manifest`` its tree and tensor table only (no
    chunk), so a rank can learn what to read before it reads any chunk table (checkpoint/index.py).
    ``missing`` receives the paths the state asks for that the tree lacks. The walk stays on
    ``manifest`` for :func:`chunks_needed` and :func:`load_manifest` of the same state."""
    ctx = _walk(state, manifest, display)
    if missing is not None:
        missing.extend(ctx.missing)
    out = [(target.key, target.box) for target in ctx.targets]
    if int(manifest.meta.get("world_size", 1)) == world:
        for _wrapper, key, _path in ctx.per_rank:
            per = manifest.tensors.get(f"{key}#rank{rank:05d}")
            if per is not None:
                out.append((f"{key}#rank{rank:05d}", ((0,) * len(per.shape), per.shape)))
    return out


def load_manifest(
    state: Any,
    manifest: Manifest,
    display: str,
    open_file: Callable[[str | None], Source],
    *,
    group: Group,
    strict: bool,
    per_rank: str,
    buffer_bytes: int,
    decode_per_rank: Callable[[bytes, str], Any],
    share_whole: bool = True,
    cooperate: bool = True,
) -> None:
    """Fill ``state`` in place from a sharded manifest whose chunk files ``open_file`` opens
    (a checkpoint directory, or the RAM tier's slots); ``share_whole`` as in :func:`coop.read`.
    ``cooperate=False`` (alike on every rank) reads each rank's boxes on its own, with no
    collective: for manifests that hold only what their own rank reads, where no chunk is needed
    by two ranks in part (a store's restore planned from its own part, engine/exchange.py)."""
    saved_world = int(manifest.meta.get("world_size", 1))
    walked, manifest.walk = _walked(state, manifest), None  # a walk is filled once
    ctx = walked or _LoadCtx(manifest)
    ctx.open_file, ctx.display = open_file, display
    try:
        if walked is None:
            saved = Decoder(lambda tag, node: _SavedRef(tag, node[tag]), display).decode(manifest.tree)
            with torch.no_grad():
                _fill(state, saved, [], ctx, top=True)
        if ctx.missing and strict:
            shown = ", ".join(ctx.missing[:10]) + (f" and {len(ctx.missing) - 10} more" if len(ctx.missing) > 10 else "")
            raise CheckpointError(
                f"{display} lacks {len(ctx.missing)} key(s) the state dict asks for: {shown}; "
                "pass strict=False to load the rest and leave these untouched"
            )
        if ctx.per_rank and saved_world != group.world and per_rank == "error":
            raise CheckpointError(
                f"{display} was saved by {saved_world} ranks and is loaded by {group.world}: per-rank values "
                f"({', '.join(k for _, k, _ in ctx.per_rank[:5])}) have no owner at this world size. Pass "
                "per_rank='skip' to keep the current values (and re-seed or re-position them yourself)"
            )
    except BaseException:
        if cooperate:
            coop.abstain(group)  # the other ranks' reads must not wait for this one
        raise
    with torch.no_grad():
        if cooperate and coop.usable(group):
            # Ranks split the reading of chunks several of them need and exchange the slices.
            coop.read(group, manifest, ctx.targets, buffer_bytes,
                      lambda targets, staging=None: read_targets(display, open_file, manifest, targets, buffer_bytes,
                                                                 staging=staging), display,
                      share_whole=share_whole)
        else:
            read_targets(display, open_file, manifest, ctx.targets, buffer_bytes)
        if saved_world == group.world:
            for wrapper, key, _path in ctx.per_rank:
                entry_key = f"{key}#rank{group.rank:05d}"
                entry = manifest.tensors.get(entry_key)
                if entry is None:
                    raise CorruptCheckpointError(f"{display}: per-rank entry {entry_key!r} is missing", key=entry_key)
                ctx.check_extents(entry_key, entry)
                buf = alloc_bytes(entry.nbytes)
                one = [ReadTarget(entry_key, [], buf, ((0,), (entry.numel,)))]
                read_targets(display, open_file, manifest, one, buffer_bytes)
                wrapper.value = decode_per_rank(bytes(byte_view(buf)), f"{display} [{entry_key}]")


def _fill(caller: Any, saved: Any, path: list[Any], ctx: _LoadCtx, *, top: bool = False) -> Any:
    """Walk the caller's state and the saved tree together; returns the value for the caller's slot."""
    if isinstance(saved, _SavedRef) and saved.tag == "$tensor" and isinstance(caller, torch.Tensor):
        # The one leaf of a state of tens of thousands: its path is formatted only for an error.
        entry = ctx.manifest.tensors.get(saved.key)
        if entry is not None and tuple(caller.shape) == entry.shape and dtype_name(caller.dtype) == entry.dtype:
            for local, box in _held_boxes(caller, path, ctx):
                ctx.targets.append(ReadTarget(saved.key, path, local, box))
            return caller
    where = format_path(path)
    if isinstance(caller, PerRank):
        if not isinstance(saved, _SavedRef) or saved.tag != "$per_rank":
            raise CheckpointError(f"{where} is PerRank in the state dict but not a per-rank value in the checkpoint")
        ctx.per_rank.append((caller, saved.key, path))
        return caller
    if isinstance(saved, _SavedRef) and saved.tag == "$tensor":
        entry = ctx.manifest.tensors.get(saved.key)
        if entry is None:
            raise CorruptCheckpointError(f"tree refers to tensor {saved.key!r}, which the manifest lacks", key=saved.key)
        if isinstance(caller, GlobalBox):
            if dtype_name(caller.dtype) != entry.dtype or tuple(caller.shape) != entry.shape:
                raise CheckpointError(
                    f"{where}: the checkpoint holds {entry.dtype} {list(entry.shape)} but the state dict asks for "
                    f"{dtype_name(caller.dtype)} {list(caller.shape)}"
                )
            for tensor, offsets in caller.pieces():
                ctx.targets.append(ReadTarget(saved.key, path, tensor, (offsets, tuple(tensor.shape))))
            return caller
        if not isinstance(caller, torch.Tensor):
            # Nothing to load into: allocate the whole tensor (single-process loads into an empty slot),
            # once per entry, so slots that name the same entry (the same tensor saved twice) share it.
            if ctx.plan_only:
                if saved.key not in ctx.fresh:
                    ctx.fresh[saved.key] = torch.empty(0)
                    ctx.targets.append(ReadTarget(saved.key, path, ctx.fresh[saved.key], ((0,) * len(entry.shape), entry.shape)))
                return caller
            if saved.key in ctx.fresh:
                return ctx.fresh[saved.key]
            ctx.check_extents(saved.key, entry)
            dtype = dtype_from_name(entry.dtype, where=where)
            fresh = alloc_bytes(entry.nbytes).view(dtype).view(entry.shape) if entry.nbytes else torch.empty(
                entry.shape, dtype=dtype
            )
            ctx.targets.append(ReadTarget(saved.key, path, fresh, ((0,) * len(entry.shape), entry.shape)))
            ctx.fresh[saved.key] = fresh
            return fresh
        if dtype_name(caller.dtype) != entry.dtype or tuple(caller.shape) != entry.shape:
            raise CheckpointError(
                f"{where}: the checkpoint holds {entry.dtype} {list(entry.shape)} but the state dict has "
                f"{dtype_name(caller.dtype)} {list(caller.shape)}; convert one side first"
            )
        for local, box in local_boxes(caller, where):
            ctx.targets.append(ReadTarget(saved.key, path, local, box))
        return caller
    if isinstance(caller, torch.Tensor):
        raise CheckpointError(f"{where} is a tensor in the state dict but {type(saved).__name__} in the checkpoint")
    if isinstance(caller, dict):
        if not isinstance(saved, dict):
            raise CheckpointError(f"{where} is a dict in the state dict but {type(saved).__name__} in the checkpoint")
        for k in list(caller):
            if k in saved:
                caller[k] = _fill(caller[k], saved[k], path + [k], ctx)
            else:
                ctx.missing.append(format_path(path + [k]))
        return caller
    if isinstance(caller, list) and isinstance(saved, list):
        for i in range(len(caller)):
            if i < len(saved):
                caller[i] = _fill(caller[i], saved[i], path + [i], ctx)
            else:
                ctx.missing.append(format_path(path + [i]))
        return caller
    if isinstance(caller, tuple) and isinstance(saved, tuple) and len(caller) == len(saved):
        items = [_fill(c, s, path + [i], ctx) for i, (c, s) in enumerate(zip(caller, saved))]
        return type(caller)(*items) if hasattr(type(caller), "_fields") else type(caller)(items)
    if isinstance(saved, _SavedRef):
        raise CheckpointError(f"{where}: unexpected {saved.tag} in the checkpoint")
    return _materialize(saved, path, ctx)


def _materialize(saved: Any, path: list[Any], ctx: _LoadCtx) -> Any:
    """A saved subtree where the caller has nothing to fill (None, or a value of another kind):
    it replaces the caller's value, with its tensors allocated fresh."""
    if isinstance(saved, _SavedRef):
        return _fill(None, saved, path, ctx)
    if isinstance(saved, dict):
        for k in list(saved):
            saved[k] = _materialize(saved[k], path + [k], ctx)
    elif isinstance(saved, list):
        for i, v in enumerate(saved):
            saved[i] = _materialize(v, path + [i], ctx)
    elif isinstance(saved, tuple):
        items = [_materialize(v, path + [i], ctx) for i, v in enumerate(saved)]
        return type(saved)(*items) if hasattr(type(saved), "_fields") else type(saved)(items)
    return saved


@dataclass
class _ReadJob:
    target: ReadTarget
    chunk: Chunk
    file_start: int  # absolute offset in the chunk's file
    length: int  # bytes to read
    rows_start: int  # first chunk row held at byte skip within what is read
    skip: int  # bytes to skip in the read buffer before rows_start
    nrows: int
    overlap: Box
    blocks: list[tuple[int, str]]  # (offset in read buffer, checksum) per block, or [] for whole-chunk
    # Set once by read_targets, before any job runs: the caller's memory that is exactly the bytes
    # read (see _direct_destination), and whether the job needs a staging buffer.
    direct: torch.Tensor | None = None
    staged: bool = False


def _jobs_for(target: ReadTarget, entry: TensorEntry, buffer_bytes: int, where: str) -> list[_ReadJob]:
    whole = _whole_chunk(target, entry, buffer_bytes)
    if whole is not None:
        return [whole]
    boxes = [(c.offsets, c.sizes) for c in entry.chunks]
    reads, uncovered = read_plan(target.box, boxes)
    if uncovered:
        raise CorruptCheckpointError(
            f"{where}: tensor {target.key!r}: saved chunks leave {uncovered} elements of {list(target.box[1])} uncovered",
            key=target.key,
        )
    es = element_size(dtype_from_name(entry.dtype, where=where))
    jobs = []
    for r in reads:
        c = entry.chunks[r.chunk]
        row_bytes = (element_size(dtype_from_name(entry.dtype, where=where)) * math.prod(c.sizes[1:])) if c.sizes else es
        if c.codec != "raw" or not c.sizes:
            first, count = row_span(r.chunk_box, r.overlap)
            jobs.append(_ReadJob(target, c, c.offset, c.length, first, first * row_bytes, count, r.overlap, []))
            continue
        first, count = row_span(r.chunk_box, r.overlap)
        step = _rows_per_job(row_bytes, (c.block_size or 0) if c.block_checksums is not None else 0, buffer_bytes)
        for sub in range(first, first + count, step):
            n = min(step, first + count - sub)
            overlap = ((r.overlap[0][0] + (sub - first),) + r.overlap[0][1:], (n,) + r.overlap[1][1:])
            lo, hi = sub * row_bytes, (sub + n) * row_bytes
            if c.block_checksums is not None and c.block_size:
                bs = c.block_size
                b0, b1 = lo // bs, -(-hi // bs)
                start, end = b0 * bs, min(b1 * bs, c.length)
                blocks = [(b * bs - start, c.block_checksums[b]) for b in range(b0, b1)]
            else:
                start, end, blocks = 0, c.length, []
            jobs.append(_ReadJob(target, c, c.offset + start, end - start, sub, lo - start, n, overlap, blocks))
    return jobs


def _whole_chunk(target: ReadTarget, entry: TensorEntry, buffer_bytes: int) -> _ReadJob | None:
    """The one job of a target that is exactly one raw chunk's box, read whole in one go (a load at
    the layout it saved: every target of a restore from its own part); None for any other target,
    which :func:`_jobs_for` plans from the overlaps. The same job as that plan makes, without it."""
    box = target.box
    for c in entry.chunks if len(entry.chunks) <= 4 else ():
        if c.offsets != box[0] or c.sizes != box[1]:
            continue
        if (c.codec != "raw" or c.block_checksums is not None or not c.sizes or not c.length or not all(c.sizes)
                or c.length > buffer_bytes):
            return None
        return _ReadJob(target, c, c.offset, c.length, 0, 0, c.sizes[0], box, [])
    return None


def _rows_per_job(row_bytes: int, block_size: int, buffer_bytes: int) -> int:
    """Rows of a raw chunk per read job. With block checksums a job verifies only its own blocks,
    so a large tensor is cut into jobs of about ``JOB_BYTES`` (whole blocks where the rows allow),
    and every reader thread copies and verifies a share of it instead of one thread all of it.
    Without them every job verifies the whole chunk: one job per ``buffer_bytes``, as many as the
    staging budget requires."""
    row_bytes = max(1, row_bytes)
    if not block_size:
        return max(1, buffer_bytes // row_bytes)
    limit = min(buffer_bytes, JOB_BYTES)
    unit = math.lcm(row_bytes, block_size)  # rows that end on a block boundary: no block read twice
    if unit <= limit:
        return (limit // unit) * (unit // row_bytes)
    return max(1, limit // row_bytes)


def read_targets(
    where: str,
    open_file: Callable[[str | None], Source],
    manifest: Manifest,
    targets: list[ReadTarget],
    buffer_bytes: int,
    *,
    staging: Callable[[int], torch.Tensor] | None = None,
) -> None:
    """Fill every target box from the chunks that overlap it, at most ``buffer_bytes`` staged at once.

    ``open_file(rel)`` opens a chunk's file (``None``: the single-file container itself, which the
    caller owns and closes). ``staging(nbytes)``: where the staging memory comes from (a fresh
    buffer by default; a cooperative load's rounds pass their own).
    """
    jobs: list[_ReadJob] = []
    for t in targets:
        jobs.extend(_jobs_for(t, manifest.tensors[t.key], buffer_bytes, where))
    sources: dict[str | None, Source] = {}
    lock = threading.Lock()

    def source_for(rel: str | None, key: str) -> Source:
        with lock:
            if rel not in sources:
                try:
                    sources[rel] = open_file(rel)
                except CheckpointNotFoundError:
                    raise CorruptCheckpointError(
                        f"{where}/{rel} is missing, but the manifest keeps tensor {key!r} in it; the checkpoint is "
                        "damaged: load another copy or an earlier step",
                        location=f"{where}/{rel}",
                        key=key,
                    ) from None
            return sources[rel]

    try:
        # Every file a job reads is opened now (they all would be anyway), so that a byte range past
        # the end of its file is refused before the staging arena is sized from it.
        for job in jobs:
            if job.length:
                source = source_for(job.chunk.file, job.target.key)
                if job.chunk.file is not None:
                    check_extent(where, job.target.key, job.chunk, source.size)
        engine = transfer.engine_for(t.local.device for t in targets)
        device = [job for job in jobs if engine is not None and engine.claims(job.target.local)]
        host = [job for job in jobs if engine is None or not engine.claims(job.target.local)]
        # Staging memory for host jobs is one arena of at most buffer_bytes, cut into equal slots
        # that jobs take turns on: freed and re-allocated buffers would stay resident in the
        # allocator's per-thread arenas (measured: 234-586 MiB of extra RSS for budgets of 16-64
        # MiB), an arena does not. Only jobs that neither read straight into the caller's tensor nor
        # find their bytes in memory take a slot. Slots are multiples of 64 bytes apart from a base
        # aligned to 16 at least (``staging``'s, or a fresh tensor's): a slot is viewed as the
        # chunk's dtype (0-dim tensors), which needs an offset divisible by the element size even
        # when another job has an odd length.
        # Each source's bytes in this process's memory, and each job's direct destination, are
        # looked up once here: a lookup is an fstat or a narrow of the caller's tensor, and asking
        # again in every worker for every job cost more than the first copy's wait.
        memory = {rel: s.memory() for rel, s in sources.items()}
        sizes: dict[str, int] = {}  # element size by dtype name
        for job in host:
            if job.length:
                name = manifest.tensors[job.target.key].dtype
                es = sizes.get(name) or sizes.setdefault(name, element_size(dtype_from_name(name, where=where)))
                job.direct = _direct_destination(job, es)
                job.staged = job.direct is None and memory[job.chunk.file] is None
        staged = [job for job in host if job.staged]
        slot = -(-max((job.length for job in staged), default=0) // 64) * 64
        nslots = max(1, min(len(staged), buffer_bytes // max(1, slot))) if staged else 0
        arena = (staging or alloc_bytes)(nslots * slot)
        free: queue.Queue[torch.Tensor] = queue.Queue()
        for i in range(nslots):
            free.put(arena[i * slot : (i + 1) * slot])

        def run(batch: list[_ReadJob]) -> None:
            for job in batch:
                rel = job.chunk.file
                if not job.staged:
                    _execute(job, sources[rel] if job.length else None, memory.get(rel), manifest, where, None)
                    continue
                buf = free.get()
                try:
                    _execute(job, sources[rel], None, manifest, where, buf[: job.length])
                finally:
                    free.put(buf)

        # From an object store every read is a request of its own, so small reads are not batched
        # into one task: there they ran one after another (the 40 small tensors of a 0.47 GiB state
        # took about 1 s of a 3 s restore from S3 on a loaded machine) where the pool runs them
        # IO_THREADS at a time.
        remote = any(s.parallel and s.local_path is None for s in sources.values())
        batches = [[job] for job in host] if remote else _batched(host)
        if engine is not None and device:
            engine.begin([job.target.local for job in device])
            pieces = [p for job in device for p in _pieces(job, source_for(job.chunk.file, job.target.key), manifest,
                                                           where)]
            transfer.run_device(pieces, engine, host_work=[functools.partial(run, b) for b in batches])
        else:
            run_all(run, batches)
    finally:
        for rel, s in sources.items():
            if rel is not None:
                s.close()


def _batched(jobs: list[_ReadJob]) -> list[list[_ReadJob]]:
    """Small jobs run in batches, one thread task each, of up to BATCH_BYTES: handing each of
    100,000 small reads to the pool on its own cost more than reading them (about 40 us each)."""
    out: list[list[_ReadJob]] = []
    small: list[_ReadJob] = []
    size = 0
    for job in jobs:
        if job.length >= SMALL_BYTES:
            out.append([job])
            continue
        if small and size + job.length > BATCH_BYTES:
            out.append(small)
            small, size = [], 0
        small.append(job)
        size += job.length
    if small:
        out.append(small)
    return out


def _flat_destination(job: _ReadJob, es: int) -> torch.Tensor | None:
    """The caller's memory for this job's rows as one contiguous span, when the bytes read hold
    exactly those rows from byte ``job.skip`` on: whole rows of a raw chunk into a contiguous target
    with the same trailing dims (any device)."""
    c, t = job.chunk, job.target
    if c.codec != "raw" or not c.sizes or not job.nrows:
        return None
    if job.overlap is t.box and not job.skip and c.sizes == t.box[1] and job.length == c.length:
        # a whole chunk into its whole box (_whole_chunk)
        return t.local if t.local.is_contiguous() else None
    if job.overlap[1][1:] != c.sizes[1:] or t.box[1][1:] != c.sizes[1:] or not t.local.is_contiguous():
        return None
    if job.skip + job.nrows * math.prod(c.sizes[1:]) * es > job.length:
        return None
    return t.local.narrow(0, job.overlap[0][0] - t.box[0][0], job.nrows)


def _direct_destination(job: _ReadJob, es: int) -> torch.Tensor | None:
    """The caller's memory for this job when it is exactly the bytes being read: whole rows of a raw
    chunk, read without block rounding, into a contiguous CPU target with the same trailing dims."""
    if job.skip or job.target.local.device.type != "cpu":
        return None
    flat = _flat_destination(job, es)
    if flat is None or job.length != flat.numel() * es:
        return None
    return flat


def _checks(job: _ReadJob) -> list[transfer.Check]:
    return transfer.checks_of(job.length, job.chunk.checksum, job.blocks, job.chunk.block_size or 0)


def _execute(job: _ReadJob, source: Source | None, memory: torch.Tensor | None, manifest: Manifest, where: str,
             buf: torch.Tensor | None) -> None:
    """One host job: its bytes read from ``source`` (or taken from ``memory``, the source's bytes
    in this process) and verified, then placed into the caller's box; ``buf`` is staging memory of
    the job's length, None where ``job.staged`` says none is needed."""
    c, entry_key = job.chunk, job.target.key
    location = f"{where}/{c.file}" if c.file else where
    direct = job.direct
    if direct is not None and job.length:
        assert source is not None
        # Same layout on both sides: straight into the caller's tensor, hashed piece by piece.
        transfer.fill_verified(source, job.file_start, direct.reshape(-1).view(torch.uint8), _checks(job),
                               location=location, key=entry_key, memory=memory)
        return
    entry = manifest.tensors[entry_key]
    dtype = dtype_from_name(entry.dtype, where=where)
    es = element_size(dtype)
    if not job.length:
        buf = alloc_bytes(0)
    else:
        assert source is not None
        if memory is not None:
            buf = memory[job.file_start : job.file_start + job.length]
            transfer.verify_in_place(buf, _checks(job), location=location, key=entry_key)
        else:
            assert buf is not None
            transfer.fill_verified(source, job.file_start, buf, _checks(job), location=location, key=entry_key)
    for dst, src in _box_copies(job, buf, dtype, es, where, location):
        dst.copy_(src)


def _box_copies(job: _ReadJob, buf: torch.Tensor, dtype: torch.dtype, es: int, where: str,
                location: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs that put a job's verified bytes ``buf`` (host) into the caller's
    box: decoded first where the chunk is compressed."""
    c = job.chunk
    if c.codec != "raw":
        raw = alloc_bytes(c.numel * es)
        codecs.decode_into(c.codec, bytes(byte_view(buf)), raw, es, where=f"{location}: tensor {job.target.key!r}")
        buf = raw
    if not c.sizes:
        return [(job.target.local, buf[:es].view(dtype).view(()))]
    row_elems = math.prod(c.sizes[1:])
    src = buf[job.skip : job.skip + job.nrows * row_elems * es].view(dtype).view((job.nrows,) + c.sizes[1:])
    dst = job.target.local
    for d in range(len(c.sizes)):
        o, s = job.overlap[0][d], job.overlap[1][d]
        base = job.rows_start + c.offsets[0] if d == 0 else c.offsets[d]
        src = src.narrow(d, o - base, s)
        dst = dst.narrow(d, o - job.target.box[0][d], s)
    return [(dst, src)]


def _pieces(job: _ReadJob, source: Source, manifest: Manifest, where: str) -> list[transfer.Piece]:
    """A device job as pieces of the pipeline: spans of whole rows in pieces cut at its checksum
    blocks; anything else (a box narrower than the chunk's rows, a compressed chunk) as one piece."""
    c, key = job.chunk, job.target.key
    dtype = dtype_from_name(manifest.tensors[key].dtype, where=where)
    es = element_size(dtype)
    location = f"{where}/{c.file}" if c.file else where
    if not job.length:
        return []
    flat = _flat_destination(job, es)
    if flat is not None:
        return transfer.flat_pieces(source, job.file_start, job.length, _checks(job),
                                    flat.reshape(-1).view(torch.uint8), job.skip, location=location, key=key)

    def place(host: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return _box_copies(job, host, dtype, es, where, location)

    return [transfer.Piece(source, job.file_start, job.length, _checks(job), place, location, key)]
