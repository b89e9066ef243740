"""The index beside a sharded manifest: what one rank reads to plan its load.

A manifest names every chunk of every rank with its checksums: at 4,096 ranks of 10,000 tensors
each that is gigabytes of JSON, which no rank can read, let alone every rank at every restore. The
index (``index.json``, written by the committer right after the manifest) holds the manifest's
tree, tensor table and ``meta``; the chunks of every tensor one rank wrote whole (a replicated
tensor, a per-rank value: a few per tensor); and for each tensor several ranks wrote (a sharded
one) only which ranks hold its chunks, as ranges. Those chunks stay in their writers' part files
(``parts/rank-<r>.json``, each named in the index with the checksum of its bytes).

A rank plans its load (:func:`plan_from_index`) from the index and the part files it needs: its
own, when it loads the layout it saved and its own part covers what it loads; the parts of a
tensor's writers otherwise (a resharded load). It reads neither the manifest nor the parts of
ranks whose data it does not load, and the manifest it gets names only the chunks it may read.
A step without an index (written before indexes existed, or whose committer crashed between its
manifest and its index) is read through its manifest, as before.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .._version import __version__
from ..collective import Group
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.checksum import CHECKSUM_FORM, checksum, validate_checksum_string
from ..format.dtypes import dtype_from_name, element_size
from ..format.manifest import (
    FORMAT_NAME,
    MAX_BYTES,
    SAFE_FILE,
    Chunk,
    Manifest,
    Parted,
    TensorEntry,
    _check_coverage,
    check_byte_ranges,
    check_manifest_size,
    check_version,
    chunk_digest,
    layout_digest,
    load_json,
    parse_entry,
    parse_sharded,
    verify_own_checksum,
)
from ..names import INDEX, MANIFEST, data_file_rank
from ..planning.sharding import Box, intersect
from . import coop
from .sharded import Directory, _unalias, load_boxes, read_manifest

log = logging.getLogger("ckptstore")
Reader = Callable[[str], bytes]
_CHECKSUM = CHECKSUM_FORM
_FIELDS = operator.itemgetter("offsets", "sizes", "file", "offset", "length", "codec", "checksum")


@dataclass
class Index:
    """A parsed index: ``header`` is the manifest with the chunks of the sharded tensors left out;
    ``sharded``: those tensors' writer ranks (ranges, both ends included); ``parts``: each such
    writer's part file and the checksum of its bytes; ``layout``: the manifest's layout digest."""

    header: Manifest
    sharded: dict[str, list[tuple[int, int]]]
    parts: dict[int, tuple[str, str]]
    layout: str
    # Each part file's size, where the document names it (a format 2.0 manifest does).
    sizes: dict[int, int] | None = None
    # A format 2.0 manifest's: the one writer of each tensor that names one (the others' chunks may
    # be in any part).
    owners: dict[str, int] | None = None

    def writers(self, key: str) -> list[int]:
        return [r for a, b in self.sharded[key] for r in range(a, b + 1)]


def build_index(manifest: Manifest, parts: Sequence[dict[str, Any]], layout: str) -> bytes | None:
    """The index of ``manifest``, committed from ``parts`` (each as its writer's tier returned it,
    naming its ``part_file`` and ``part_checksum``); None when a part does not name its file (the
    step is then read through its manifest).

    Its cost grows with the ranks plus the tensors of each distinct structure, not with ranks x
    tensors: ranks that wrote the same keys (every rank of one pipeline stage, of one expert
    group) are grouped by their key list, whose hash is computed in C, and each group's keys are
    walked once. Writer ranges are then computed once per distinct set of groups."""
    files: dict[int, tuple[str, str]] = {}
    groups: dict[tuple[int, int], list[Any]] = {}  # (hash, length) of a key list -> [keys, ranks]
    for part in parts:
        rank = part["rank"]
        if not isinstance(part.get("part_file"), str) or not isinstance(part.get("part_checksum"), str):
            return None
        files[rank] = (part["part_file"], part["part_checksum"])
        keys = tuple(part["chunks"])
        # Two different key lists of one hash would list a rank as a writer of keys it did not write
        # (or leave it out of some): a reader then finds those chunks missing from the parts it reads,
        # and reads the manifest instead (plan_from_index checks coverage), so a collision costs time,
        # never a wrong load.
        group = groups.setdefault((hash(keys), len(keys)), [keys, []])
        group[1].append(rank)
    owners: dict[str, list[int]] = {}  # key -> the groups that wrote it
    for gid, (keys, _ranks) in enumerate(groups.values()):
        for alias in keys:
            key = _unalias(alias)
            seen = owners.setdefault(key, [])
            if not seen or seen[-1] != gid:
                seen.append(gid)
    members = [np.asarray(ranks, dtype=np.int64) for _keys, ranks in groups.values()]
    spans: dict[tuple[int, ...], tuple[list[list[int]], int]] = {}  # groups -> (ranges, writer count)
    inline: dict[str, Any] = {}
    sharded: dict[str, Any] = {}
    used: set[tuple[int, ...]] = set()
    for key, entry in manifest.tensors.items():
        gids = tuple(owners.get(key, ()))
        span = spans.get(gids)
        if span is None:
            ranks = np.unique(np.concatenate([members[g] for g in gids])) if gids else np.empty(0, np.int64)
            span = spans[gids] = (_ranges(ranks), len(ranks))
        if span[1] <= 1:
            inline[key] = entry.to_json()
        else:
            sharded[key] = {"dtype": entry.dtype, "shape": entry.shape, "writers": span[0]}
            used.add(gids)
    named: Any = np.unique(np.concatenate([members[g] for gids in used for g in gids])) if used else []
    doc = {
        "format": FORMAT_NAME,
        "format_version": manifest.format_version,
        "writer": f"ckptstore {__version__}",
        "kind": "index",
        "layout": layout,
        "meta": {k: v for k, v in manifest.meta.items() if k != "ranks"},  # per-rank timings: the manifest's
        "pickled": manifest.pickled,
        "tree": manifest.tree,
        "tensors": inline,
        "sharded": sharded,
        "parts": {str(r): list(files[r]) for r in map(int, named)},
    }
    body = json.dumps(doc, allow_nan=False, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}'


def _ranges(ranks: Any) -> list[list[int]]:
    """Sorted distinct ranks as [first, last] runs of consecutive ranks."""
    if len(ranks) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ranks) != 1)
    firsts = np.concatenate(([0], breaks + 1))
    lasts = np.concatenate((breaks, [len(ranks) - 1]))
    return [[int(ranks[a]), int(ranks[b])] for a, b in zip(firsts, lasts)]


def parse_index(data: bytes, *, where: str) -> Index:
    """Parse and validate an index; every failure is a CorruptCheckpointError naming ``where``
    (an UnsupportedFormatVersionError for a newer major version)."""
    check_manifest_size(len(data), where=where)
    doc = load_json(data, where=where, what="index")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME or doc.get("kind") != "index":
        raise CorruptCheckpointError(f"{where}: not a ckptstore index", location=where)
    check_version(doc, where)
    if "checksum" not in doc:
        raise CorruptCheckpointError(f"{where}: the index has no checksum of its own", location=where)
    verify_own_checksum(data, doc, where)
    meta, inline, sharded, parts = doc.get("meta"), doc.get("tensors"), doc.get("sharded"), doc.get("parts")
    layout, pickled = doc.get("layout"), doc.get("pickled", [])
    if (not isinstance(meta, dict) or not isinstance(inline, dict) or not isinstance(sharded, dict)
            or not isinstance(parts, dict) or not isinstance(layout, str) or "tree" not in doc
            or not isinstance(pickled, list)):
        raise CorruptCheckpointError(f"{where}: the index lacks meta/tensors/sharded/parts/layout/tree", location=where)
    world = meta.get("world_size")
    if type(world) is not int or world < 1:
        raise CorruptCheckpointError(f"{where}: meta.world_size must be a positive int, got {world!r}", location=where)
    tensors = {key: parse_entry(key, value, where) for key, value in inline.items()}
    ranges: dict[str, list[tuple[int, int]]] = {}
    # Tensors of one layout share their dtype, shape and writers: each distinct one is checked once.
    headers: dict[str, TensorEntry] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for key, value in sharded.items():
        if key in tensors or not isinstance(value, dict):
            raise CorruptCheckpointError(f"{where}: sharded tensor {key!r} is listed twice or malformed",
                                         location=where, key=key)
        head = f"{value.get('dtype')!r}{value.get('shape')!r}"
        if head not in headers:
            headers[head] = parse_entry(key, {"dtype": value.get("dtype"), "shape": value.get("shape"),
                                              "chunks": []}, where, coverage=False)
        tensors[key] = TensorEntry(headers[head].dtype, headers[head].shape, [])
        got = value.get("writers")
        sig = repr(got)
        if sig not in spans:
            if (not isinstance(got, list) or not got or any(
                    not isinstance(p, list) or len(p) != 2 or any(type(v) is not int for v in p)
                    or not 0 <= p[0] <= p[1] < world for p in got)):
                raise CorruptCheckpointError(f"{where}: tensor {key!r}: writers must be ranges of ranks below {world}",
                                             location=where, key=key)
            spans[sig] = [(a, b) for a, b in got]
        ranges[key] = spans[sig]
    files: dict[int, tuple[str, str]] = {}
    for rank, value in parts.items():
        if (not rank.isdigit() or not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
                or not value[0].startswith("parts/") or ".." in value[0]):
            raise CorruptCheckpointError(f"{where}: part entry {rank!r} is malformed", location=where)
        files[int(rank)] = (value[0], validate_checksum_string(value[1], where=f"{where}: part of rank {rank}"))
    checked: set[tuple[tuple[int, int], ...]] = set()  # tensors of one layout share their writers
    for key, writers in ranges.items():
        if tuple(writers) in checked:
            continue
        missing = [r for a, b in writers for r in range(a, b + 1) if r not in files]
        if missing:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} names writers {missing[:5]} whose parts it lacks",
                                         location=where, key=key)
        checked.add(tuple(writers))
    header = Manifest(kind="sharded", tensors=tensors, tree=doc["tree"], pickled=list(pickled), meta=meta,
                      format_version=doc["format_version"], writer=str(doc.get("writer", "")))
    return Index(header, ranges, files, layout)


def read_index(read: Reader, display: str) -> Index | None:
    """The index of the step ``read`` reads files of: its ``index.json``, or its format 2.0
    manifest, which is one (it names every rank's part file); None when it has neither."""
    try:
        data = read(INDEX)
    except (CheckpointNotFoundError, FileNotFoundError):
        pass
    else:
        return parse_index(data, where=f"{display}/{INDEX}")
    try:
        body = read(MANIFEST)
    except (CheckpointNotFoundError, FileNotFoundError):
        return None
    if _V1_START.match(body):
        return None  # a 1.x manifest without its index: the caller reads it whole (parsing it here would double that)
    parsed = parse_sharded(body, where=f"{display}/{MANIFEST}")
    return index_of(parsed) if isinstance(parsed, Parted) else None


# How the reference writers begin a 1.x manifest; one that begins otherwise is parsed to be sure.
_V1_START = re.compile(rb'\{"format":"ckptstore","format_version":"1\.\d{1,6}"')


def index_of(parted: Parted) -> Index:
    """A format 2.0 manifest as an index: a tensor one rank wrote whole is that rank's; the chunks
    of any other may be in any rank's part (a rank reads its own first, and every part only
    when its own does not cover what it loads: a resharded load)."""
    everyone = [(0, parted.world - 1)]
    # A tensor whose entry lists its chunks (its one writer's, copied into the manifest) is like
    # an index's inline tensor: no part is read for it.
    sharded = {key: ([(w, w)] if (w := parted.writers.get(key)) is not None else everyone)
               for key, entry in parted.header.tensors.items() if not entry.chunks}
    parts = {r: (rel, check) for r, (rel, _size, check) in enumerate(parted.parts)}
    sizes = {r: size for r, (_rel, size, _check) in enumerate(parted.parts)}
    return Index(parted.header, sharded, parts, parted.layout, sizes, dict(parted.writers))


def plan_from_index(read: Reader, state: Any, rank: int, world: int, display: str,
                    index: Index | None = None) -> Manifest | None:
    """The manifest ``rank`` of ``world`` loads ``state`` with, read from the step's index and the
    part files it needs (see the module docstring): every chunk of every box it loads, and only
    those of the sharded tensors. None when the step has no index. Raises CorruptCheckpointError
    when the index or a part it names is damaged, or the parts do not cover what the rank loads
    (the caller reads the manifest instead); CheckpointError when ``state`` does not match."""
    with _collector_paused():
        return _plan(read, state, rank, world, display, index)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused: a plan allocates hundreds of thousands of small objects
    (parsed JSON, chunks, boxes) and no cycles, and the collections they trigger walked them again
    and again (about 40% of a plan's time at 10,000 tensors)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(read: Reader, state: Any, rank: int, world: int, display: str, index: Index | None) -> Manifest | None:
    if index is None:
        index = read_index(read, display)
        if index is None:
            return None
    tensors = index.header.tensors
    targets = [(key, box) for key, box in load_boxes(state, index.header, display, rank, world)
               if key in index.sharded]
    keys = {key for key, _box in targets}
    read_parts: set[int] = set()

    def take(writer: int) -> None:
        if writer in read_parts:
            return
        read_parts.add(writer)
        for key, entry in _read_part(read, index, writer, display, keys).items():
            tensors[key].chunks.extend(entry.chunks)

    if rank in index.parts:
        take(rank)
    own = set(read_parts)
    for key, box in targets:
        if _covered(tensors[key], box):
            continue
        for writer in index.writers(key):
            take(writer)
        if not _covered(tensors[key], box):
            raise CorruptCheckpointError(
                f"{display}/{INDEX}: the parts of tensor {key!r}'s writers do not cover the box {list(box[0])} + "
                f"{list(box[1])} a load reads; the index or a part is damaged (the manifest is read instead)",
                location=f"{display}/{INDEX}", key=key)
    for key in keys:
        if len(tensors[key].chunks) > 1:
            tensors[key].chunks.sort(key=lambda c: c.offsets)
    _check_byte_ranges({k: tensors[k] for k in keys}, f"{display}/{INDEX}")
    index.header.planned = "own" if read_parts == own else "writers"
    return index.header


def _read_part(read: Reader, index: Index, writer: int, display: str, keys: set[str] | None) -> dict[str, TensorEntry]:
    """The chunks of ``keys`` (None: all) in ``writer``'s part, checked against the index's checksum of it."""
    where = f"{display}/{index.parts[writer][0]}"
    return _entries(index, _part_chunks(read, index, writer, display, keys), where)


def _part_chunks(read: Reader, index: Index, writer: int, display: str, keys: set[str] | None) -> dict[str, list[Any]]:
    """The chunks (as stored) of ``keys`` (None: all) in ``writer``'s part by entry key, the part
    checked against the index's checksum of it."""
    rel, expected = index.parts[writer]
    where = f"{display}/{rel}"
    try:
        data = read(rel)
    except (CheckpointNotFoundError, FileNotFoundError):
        raise CorruptCheckpointError(f"{where}: the part file of rank {writer} is missing: the checkpoint is damaged",
                                     location=where) from None
    size = None if index.sizes is None else index.sizes.get(writer)
    if (size is not None and len(data) != size) or checksum(data) != expected:
        named_by = "the index's" if index.sizes is None else "the manifest's size and"
        raise CorruptCheckpointError(f"{where}: the part file does not match {named_by} checksum of it: this copy "
                                     "is damaged", location=where)
    # Checked against the index's checksum, these are the bytes the writer's json.dumps produced:
    # the C parser alone (no per-object duplicate check in Python) reads them.
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: part file is not valid JSON: {exc}", location=where) from None
    if not isinstance(doc, dict) or doc.get("rank") != writer or not isinstance(doc.get("chunks"), dict):
        raise CorruptCheckpointError(f"{where}: not the part of rank {writer}", location=where)
    grouped: dict[str, list[Any]] = {}
    for alias, chunks in doc["chunks"].items():
        key = _unalias(alias)
        if (keys is None or key in keys) and isinstance(chunks, list):
            if key in grouped:
                grouped[key].extend(chunks)
            else:
                grouped[key] = chunks
    return grouped


def _entries(index: Index, grouped: dict[str, list[Any]], where: str) -> dict[str, TensorEntry]:
    out = {}
    files: set[str] = set()  # file names already found safe
    for key, chunks in grouped.items():
        entry = index.header.tensors.get(key)
        if entry is None:
            raise CorruptCheckpointError(f"{where}: chunks of entry {key!r}, which the index does not list",
                                         location=where, key=key)
        fast = _plain_chunks(entry, chunks, files)
        out[key] = TensorEntry(entry.dtype, entry.shape, fast) if fast is not None else parse_entry(
            key, {"dtype": entry.dtype, "shape": list(entry.shape), "chunks": chunks}, where, coverage=False)
    return out


def _check_byte_ranges(tensors: dict[str, TensorEntry], where: str) -> None:
    """check_byte_ranges (no two chunks claim the same stored bytes) sorted by numpy: the chunks of
    one file mostly, already in order, thousands of them."""
    names: dict[str | None, int] = {}
    rows = [(names.setdefault(c.file, len(names)), c.offset, c.offset + c.length)
            for entry in tensors.values() for c in entry.chunks if c.length]
    if len(rows) < 2:
        return
    table = np.asarray(rows, dtype=np.int64)
    order = np.lexsort((table[:, 1], table[:, 0]))
    table = table[order]
    if np.any((table[1:, 0] == table[:-1, 0]) & (table[1:, 1] < table[:-1, 2])):
        check_byte_ranges(tensors, where)  # says which tensors, in the reader's words


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _plain_chunks(entry: TensorEntry, raws: list[Any], files: set[str]) -> list[Chunk] | None:
    """``raws`` as chunks of ``entry`` when each is a plain one (raw codec, no block checksums) that
    passes every check :func:`parse_entry` makes; None otherwise, and parse_entry then says what
    is wrong (or reads the block checksums). The same rules in one tight loop: a rank plans its
    load from thousands of its own chunks, and this is most of that plan's time."""
    shape = entry.shape
    ndim = len(shape)
    elsize = element_size(dtype_from_name(entry.dtype, where="index"))
    out = []
    fields, get, form, rawcodec = _FIELDS, dict.get, _CHECKSUM.fullmatch, "raw"
    for raw in raws:
        try:
            offsets, sizes, file, offset, length, codec, check = fields(raw)
        except (KeyError, TypeError):
            return None
        if (codec != rawcodec or get(raw, "block_size") is not None or get(raw, "block_checksums") is not None
                or type(offsets) is not list or type(sizes) is not list or len(offsets) != ndim or len(sizes) != ndim
                or type(offset) is not int or type(length) is not int or not 0 <= offset <= MAX_BYTES - length
                or length < 0 or type(check) is not str or not form(check)):
            return None
        numel = 1
        for o, n, d in zip(offsets, sizes, shape):
            if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > d:
                return None
            numel *= n
        if length != numel * elsize:
            return None
        if file not in files:
            if type(file) is not str or not SAFE_FILE.match(file):
                return None
            files.add(file)
        out.append(Chunk(tuple(offsets), tuple(sizes), file, offset, length, rawcodec, check))
    return out


def _covered(entry: TensorEntry, box: Box) -> bool:
    """Whether ``entry``'s chunks cover ``box`` (chunks of one manifest never overlap)."""
    need = math.prod(box[1])
    if need == 0:
        return True
    got = 0
    for c in entry.chunks:
        if c.offsets == box[0] and c.sizes == box[1]:
            return True  # the layout it saved: its own chunk is the box
        part = intersect(box, (c.offsets, c.sizes))
        if part is not None:
            got += math.prod(part[1])
    return got == need


def box_id(key: str, offsets: Sequence[int], sizes: Sequence[int]) -> int:
    """A 64-bit name of the box ``offsets`` + ``sizes`` of tensor ``key`` (a signed int64), by which
    a rank that needs a box finds the writer of a chunk of exactly that box without anyone holding
    every rank's chunk table (engine/exchange.py). Two boxes of one name would hand a rank chunks of
    another box, which its coverage check refuses: a collision costs a fallback, never a wrong load."""
    name = f"{key}\0{','.join(map(str, offsets))}\0{','.join(map(str, sizes))}".encode()
    value = xxhash.xxh3_64_intdigest(name)
    return value - (1 << 64) if value >= 1 << 63 else value


def part_boxes(part: dict[str, Any]) -> dict[int, tuple[str, Any]]:
    """Every chunk of a rank's ``part`` by the :func:`box_id` of its box: (key, chunk as stored)."""
    out: dict[int, tuple[str, Any]] = {}
    for alias, chunks in part["chunks"].items():
        key = _unalias(alias)
        for c in chunks:
            out.setdefault(box_id(key, c["offsets"], c["sizes"]), (key, c))
    return out


def part_digest(part: dict[str, Any], rank: int) -> int | None:
    """The layout digest (:func:`chunk_digest`) of ``rank``'s ``part`` as a signed int64, whose
    combination over the ranks (:func:`combine_digests`) is the step's :func:`layout_digest`;
    ``-2**63`` when it has no chunk, and None when some chunk lies in another rank's file (the
    step's digest groups chunks by the rank whose file holds them: only the whole table tells it)."""
    items: list[tuple[str, Any]] = []
    for alias, chunks in part["chunks"].items():
        key = _unalias(alias)
        for c in chunks:
            if data_file_rank(c.get("file")) != rank:
                return None
            items.append((key, c))
    if not items:
        return -(1 << 63)
    value = int(chunk_digest(items).partition(":")[2], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class OwnPlan:
    """What :func:`plan_from_part` planned: the manifest (``planned == "flat"``) with this rank's
    own chunks, and the boxes it loads that they do not cover, as (key, box) with their
    :func:`box_id`."""

    manifest: Manifest
    needs: list[tuple[str, Box, int]]


def plan_from_part(header: dict[str, Any], part: dict[str, Any], meta: dict[str, Any], state: Any, rank: int,
                   world: int, display: str) -> OwnPlan | None:
    """The manifest ``rank`` loads ``state`` with from what its own node copy of a step holds (a
    RAM document, a node part, a replica: engine/exchange.py): its structure's ``header`` (tree,
    tensor table, layouts), its own ``part`` (chunk table) and the step's ``meta``, no other rank's
    chunks. The boxes its own chunks do not cover (a replicated tensor another rank wrote, a key
    another structure writes) are listed for the caller to find among their writers' chunks. None
    when the load cannot be planned so (the tree lacks a key the state asks for: another structure
    holds it, or the state changed); raises CorruptCheckpointError on a part that does not parse,
    CheckpointError when ``state`` does not match."""
    with _collector_paused():
        tensors: dict[str, TensorEntry] = {}
        heads: dict[tuple[str, tuple[int, ...]], TensorEntry] = {}
        for key, (dtype, shape) in header["tensors"].items():
            head = (dtype, tuple(shape))
            if head not in heads:
                heads[head] = parse_entry(key, {"dtype": dtype, "shape": list(shape), "chunks": []}, display,
                                          coverage=False)
            tensors[key] = TensorEntry(heads[head].dtype, heads[head].shape, [])
        grouped: dict[str, list[Any]] = {}
        for alias, chunks in part["chunks"].items():
            grouped.setdefault(_unalias(alias), []).extend(chunks)
        files: set[str] = set()
        for key, chunks in grouped.items():
            entry = tensors.get(key)
            if entry is None:  # this rank's per-rank value: one uint8 chunk
                entry = tensors[key] = parse_entry(key, {"dtype": "uint8", "shape": chunks[0]["sizes"], "chunks": []},
                                                   display, coverage=False)
            fast = _plain_chunks(entry, chunks, files)
            entry.chunks.extend(fast if fast is not None else parse_entry(
                key, {"dtype": entry.dtype, "shape": list(entry.shape), "chunks": chunks}, display,
                coverage=False).chunks)
        layouts = header.get("layouts") or {}
        manifest = Manifest(kind="sharded", tensors=tensors, tree=header["tree"], planned="flat", meta={
            "world_size": world,
            **({"layouts": {k: layouts[k] for k in sorted(layouts) if k in tensors}} if layouts else {}),
            "step": meta.get("step"), "job": meta.get("job"), "cadence": meta.get("cadence", {}),
            **({"sdc": meta["sdc"]} if isinstance(meta.get("sdc"), dict) else {})})
        missing: list[str] = []
        boxes = load_boxes(state, manifest, display, rank, world, missing)
        if missing:
            return None
        needs = []
        for key, box in boxes:
            if not _covered(tensors[key], box):
                needs.append((key, box, box_id(key, box[0], box[1])))
        for entry in tensors.values():
            if len(entry.chunks) > 1:
                entry.chunks.sort(key=lambda c: c.offsets)
        _check_byte_ranges({k: e for k, e in tensors.items() if e.chunks}, display)
        return OwnPlan(manifest, needs)


def add_chunks(plan: OwnPlan, found: list[tuple[str, Any]], display: str) -> bool:
    """Add to ``plan``'s manifest the chunks other writers sent for its needs ((key, chunk as a
    JSON object) pairs); whether every need is now covered."""
    with _collector_paused():
        tensors = plan.manifest.tensors
        grouped: dict[str, list[Any]] = {}
        for key, chunk in found:
            if key in tensors:
                grouped.setdefault(key, []).append(chunk)
        files: set[str] = set()
        for key, chunks in grouped.items():
            entry = tensors[key]
            have = {c.offsets for c in entry.chunks}
            fresh = [c for c in chunks if tuple(c.get("offsets") or ()) not in have]
            fast = _plain_chunks(entry, fresh, files)
            entry.chunks.extend(fast if fast is not None else parse_entry(
                key, {"dtype": entry.dtype, "shape": list(entry.shape), "chunks": fresh}, display,
                coverage=False).chunks)
            entry.chunks.sort(key=lambda c: c.offsets)
        if not all(_covered(tensors[key], box) for key, box, _id in plan.needs):
            return False
        _check_byte_ranges({k: e for k, e in tensors.items() if e.chunks}, display)
        return True


def write_index(directory: Directory, manifest: Manifest, parts: list[dict[str, Any]], overwrite: bool) -> None:
    """``save_sharded``'s index, written after the commit by the rank that committed. Without one
    the checkpoint is read through its manifest, so failing to write it fails nothing."""
    try:
        body = build_index(manifest, parts, layout_digest(manifest))
        if body is not None:
            (directory.write_small if overwrite else directory.create_small)(INDEX, body)
    except (CheckpointError, OSError) as exc:
        log.warning("ckptstore: cannot write the index of %s (%s); it is read through its manifest",
                    directory.display, exc)


def assigned_parts(index: Index, rank: int, world: int) -> list[int]:
    """The writers whose part files ``rank`` of ``world`` reads for everyone in a resharded load:
    writer ``w`` goes to rank ``w % world``, so each part is read once across the job, and at the
    layout it saved each rank reads its own part (which it reads anyway)."""
    return [w for w in sorted(index.parts) if w % world == rank]


def plan_spread(read: Reader, state: Any, rank: int, world: int, display: str) -> coop.Spread | None:
    """``rank``'s table for a load of ``state``, planned from the step's index (None without one):
    the index's header and inline chunks, this rank's own part's chunks of the sharded tensors it
    loads (``planned == "own"`` when they cover its boxes, ``"spread"`` otherwise), and in
    ``routed`` every chunk of the sharded tensors in the part files assigned to it
    (:func:`assigned_parts`), for the cooperative read to hand to the tensors' coordinators. No
    rank reads more than its share of the part files. Raises as :func:`plan_from_index`."""
    with _collector_paused():
        index = read_index(read, display)
        if index is None:
            return None
        h = index.header
        table = coop.Spread(kind=h.kind, tensors=h.tensors, tree=h.tree, pickled=h.pickled, meta=h.meta,
                            format_version=h.format_version, writer=h.writer, sharded=set(index.sharded))
        targets = [(key, box) for key, box in load_boxes(state, table, display, rank, world) if key in index.sharded]
        keys = {key for key, _box in targets}
        mine = assigned_parts(index, rank, world)
        for writer in sorted(set(mine) | ({rank} & set(index.parts))):
            grouped = _part_chunks(read, index, writer, display, None)
            if writer == rank:
                for key, entry in _entries(index, {k: v for k, v in grouped.items() if k in keys},
                                           f"{display}/{index.parts[writer][0]}").items():
                    h.tensors[key].chunks.extend(entry.chunks)
            if writer in mine:
                _check_part(index, writer, grouped, f"{display}/{index.parts[writer][0]}")
                for key, raws in grouped.items():
                    if key in index.sharded:
                        table.routed.setdefault(key, []).extend(raws)
        covered = all(_covered(h.tensors[key], box) for key, box in targets)
        for key in keys:
            if len(h.tensors[key].chunks) > 1:
                h.tensors[key].chunks.sort(key=lambda c: c.offsets)
        _check_byte_ranges({k: h.tensors[k] for k in keys}, f"{display}/{INDEX}")
        table.planned = "own" if covered else "spread"
        where = f"{display}/{INDEX}"
        table.parse = lambda key, raws: _parse_stored(index, key, raws, where)
        table.adopt = lambda found, boxes: _adopt(index, table, found, boxes, where)
        table.complete = lambda: _complete(read, index, table, targets, rank, display)
        return table


def _check_part(index: Index, writer: int, grouped: dict[str, list[Any]], where: str) -> None:
    """What a reader of the whole table checks of each part file (format.md 10.10), on the one rank
    that reads it for everyone: it names only entries the header lists, of a 2.0 manifest no chunk
    of an entry another rank wrote whole, and the chunks the manifest lists of an entry it wrote."""
    tensors = index.header.tensors
    for key, raws in grouped.items():
        entry = tensors.get(key)
        if entry is None:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} is not in the manifest", location=where, key=key)
        if index.owners is None:
            continue
        owner = index.owners.get(key)
        if owner is not None and owner != writer:
            raise CorruptCheckpointError(f"{where}: rank {writer} names chunks of tensor {key!r}, which the manifest "
                                         f"says rank {owner} wrote whole", location=where, key=key)
        if key not in index.sharded and entry.chunks:
            got = sorted(_entries(index, {key: raws}, where)[key].chunks, key=lambda c: c.offsets)
            if got != entry.chunks:
                raise CorruptCheckpointError(
                    f"{where}: the chunks the manifest lists for tensor {key!r} are not those of its writer's part "
                    "file: the checkpoint is damaged; load another copy or an earlier step", location=where, key=key)


def _parse_stored(index: Index, key: str, raws: list[Any], where: str, whole: bool = True) -> list[Chunk]:
    """Chunks of ``key`` as stored in part files, validated as a part's chunks are."""
    if key not in index.sharded or not isinstance(raws, list):
        raise CorruptCheckpointError(f"{where}: chunks of {key!r} that no part holds", location=where, key=key)
    chunks = _entries(index, {key: raws}, where)[key].chunks if raws else []
    if whole:
        # The coordinator holds every chunk of the tensor: they cover it, and do not overlap.
        _check_coverage(key, index.header.tensors[key].shape, chunks, where)
    return chunks


def _adopt(index: Index, table: coop.Spread, found: dict[str, Any], boxes: list[tuple[str, Box]], where: str) -> None:
    """Put in ``table`` the chunks the coordinators sent this rank (key -> [chunks as stored, error])
    in place of its own part's, and check they cover every box it loads."""
    with _collector_paused():
        tensors = table.tensors
        keys = {key for key, _box in boxes if key in table.sharded}
        for key in keys:
            raws, error = found.get(key, (None, f"no coordinator sent the chunks of {key!r}"))
            if raws is None:
                raise CorruptCheckpointError(f"{where}: {error}", location=where, key=key)
            chunks = _parse_stored(index, key, raws, where, whole=False)
            chunks.sort(key=lambda c: c.offsets)
            tensors[key].chunks = chunks
        for key, box in boxes:
            if key in keys and not _covered(tensors[key], box):
                raise CorruptCheckpointError(
                    f"{where}: the part files do not cover the box {list(box[0])} + {list(box[1])} of tensor {key!r} "
                    "a load reads: the checkpoint is damaged", location=where, key=key)
        _check_byte_ranges({k: tensors[k] for k in keys}, where)
        table.planned = "writers"


def _complete(read: Reader, index: Index, table: coop.Spread, targets: list[tuple[str, Box]], rank: int,
              display: str) -> None:
    """Where no exchange runs: this rank reads its tensors' writers' parts itself (as
    :func:`plan_from_index` does), so that its table covers what it loads."""
    with _collector_paused():
        tensors = table.tensors
        keys = {key for key, _box in targets}
        for key in keys:
            tensors[key].chunks = []
        read_parts: set[int] = set()

        def take(writer: int) -> None:
            if writer not in read_parts:
                read_parts.add(writer)
                for key, entry in _read_part(read, index, writer, display, keys).items():
                    tensors[key].chunks.extend(entry.chunks)

        if rank in index.parts:
            take(rank)
        for key, box in targets:
            if not _covered(tensors[key], box):
                for writer in index.writers(key):
                    take(writer)
            if not _covered(tensors[key], box):
                raise CorruptCheckpointError(
                    f"{display}/{INDEX}: the parts of tensor {key!r}'s writers do not cover the box {list(box[0])} + "
                    f"{list(box[1])} a load reads: the checkpoint is damaged", location=f"{display}/{INDEX}", key=key)
        for key in keys:
            tensors[key].chunks.sort(key=lambda c: c.offsets)
        _check_byte_ranges({k: tensors[k] for k in keys}, f"{display}/{INDEX}")
        table.planned = "writers"
        table.routed = {}


# What a rank's planning found, all-reduced with MAX so that every rank takes the same path.
_OWN, _SPREAD, _WHOLE = 0, 1, 2


def load_plan(state: Any, directory: Directory, group: Group) -> Manifest:
    """The manifest this rank loads ``state`` with: planned from the checkpoint's index and this
    rank's own part file when every rank's own part covers what it loads (the layout it saved);
    for a resharded load, the index and this rank's share of the part files (:func:`plan_spread`),
    whose chunks the cooperative read hands to the tensors' coordinators and from them to the
    ranks that load them (or, where no exchange can run, the parts of its tensors' writers): no
    rank reads the whole world's chunk table. ``manifest.json``, whole, where the index is missing
    or damaged on any rank. Ranks agree on the path with one all-reduce of a flag."""
    planned: coop.Spread | None = None
    try:
        if not directory.exists(MANIFEST):
            raise CheckpointNotFoundError(f"{directory.display}: no {MANIFEST}")  # an index never commits
        planned = plan_spread(directory.read_small, state, group.rank, group.world, directory.display)
    except CorruptCheckpointError as exc:
        log.warning("ckptstore: cannot plan the load of %s from its index (%s); reading its manifest",
                    directory.display, exc)
    except Exception:  # noqa: BLE001 - every rank must reach the flag's all-reduce below
        pass  # the state does not match, or the storage failed: the manifest's read says how
    flag = _WHOLE if planned is None else _OWN if planned.planned == "own" else _SPREAD
    if group.world > 1:
        flag = group.max_int64([flag])[0]
    if flag == _WHOLE or planned is None:
        return read_manifest(directory)
    if flag == _OWN:
        planned.routed = {}
        return planned
    planned.planned = "spread"  # every rank, its own part covering its boxes or not, takes part
    if not coop.usable(group) and planned.complete is not None:
        planned.complete()
    return planned


__all__ = ["Index", "OwnPlan", "add_chunks", "box_id", "build_index", "part_boxes", "part_digest", "assigned_parts", "index_of", "load_plan", "plan_spread", "parse_index", "plan_from_index", "plan_from_part", "read_index", "write_index"]
