"""Offline resharding: rewrite a checkpoint for N even Shard(0) ranks, or consolidate it into one file.

Streaming: each output chunk is read from the source (only the byte ranges it overlaps) just before
it is written, and no chunk is larger than ``max_chunk_bytes``, so memory stays bounded by a few
chunks whatever the checkpoint's size.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointError, InvalidArgumentError
from ..format.dtypes import dtype_from_name
from ..format.manifest import Chunk, Manifest, TensorEntry, parse_manifest
from ..format.tree import Decoder, Encoder
from ..planning.flatten import Plan, WriteItem, _Planner
from ..planning.sharding import Box, shard_box
from ..storage.targets import open_sink, resolve
from .inspect import Opened, check_files, open_any
from .memory import alloc_bytes
from .sharded import (
    BLOCK_SIZE,
    DEFAULT_READ_BUFFER,
    MANIFEST,
    Directory,
    ReadTarget,
    data_file,
    part_file,
    read_targets,
)
from .single_file import write_container, write_raw

MAX_CHUNK_BYTES = 64 << 20


def _split_rows(box: Box, row_bytes: int, max_bytes: int) -> list[Box]:
    offsets, sizes = box
    if not sizes or sizes[0] * row_bytes <= max_bytes:
        return [box]
    rows = max(1, max_bytes // max(1, row_bytes))
    out = []
    for start in range(0, sizes[0], rows):
        n = min(rows, sizes[0] - start)
        out.append(((offsets[0] + start,) + offsets[1:], (n,) + sizes[1:]))
    return out


def _reader(opened: Opened, buffer_bytes: int) -> Callable[[str, Box], torch.Tensor]:
    def read_box(key: str, box: Box) -> torch.Tensor:
        entry = opened.manifest.tensors[key]
        dtype = dtype_from_name(entry.dtype, where=opened.display)
        nbytes = dtype.itemsize * math.prod(box[1])
        buf = alloc_bytes(nbytes)
        local = buf.view(dtype).view(box[1]) if nbytes else torch.empty(box[1], dtype=dtype)
        if nbytes:
            read_targets(opened.display, opened.source, opened.manifest, [ReadTarget(key, [], local, box)], buffer_bytes)
        return buf

    return read_box


def _per_rank_values(opened: Opened) -> dict[str, list[str]]:
    """Per-rank value keys -> their entries (one per saved rank), for sharded sources."""
    out: dict[str, list[str]] = {}
    for key in opened.manifest.tensors:
        base, sep, rank = key.rpartition("#rank")
        if sep and rank.isdigit() and len(rank) >= 5:
            out.setdefault(base, []).append(key)
    return out


def reshard(
    src: str,
    dst: str,
    ranks: int,
    *,
    storage_options: dict[str, Any] | None = None,
    buffer_bytes: int = DEFAULT_READ_BUFFER,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
    decode_per_rank: Callable[[bytes, str], Any] | None = None,
) -> dict[str, Any]:
    """Rewrite ``src`` (sharded directory) at ``dst`` for ``ranks`` even Shard(0) ranks, or as one
    single-file checkpoint when ``ranks == 1``. ``decode_per_rank`` turns a saved per-rank value
    back into an object (only needed to consolidate a checkpoint saved by one rank)."""
    if ranks < 1:
        raise InvalidArgumentError(f"--ranks must be at least 1, got {ranks}")
    opened = open_any(src, storage_options)
    try:
        if opened.manifest.kind != "sharded":
            raise CheckpointError(
                f"{opened.display} is a single-file checkpoint; reshard reads sharded checkpoints. Load it and "
                "save it with ckptstore.save_sharded to lay it out for several ranks"
            )
        check_files(opened)  # a damaged source is refused before anything is written
        Decoder(lambda tag, node: None, opened.display).decode(opened.manifest.tree)
        if ranks == 1:
            return _consolidate(opened, dst, storage_options, buffer_bytes, progress, decode_per_rank)
        return _to_sharded(opened, dst, ranks, storage_options, buffer_bytes, max_chunk_bytes, progress)
    finally:
        opened.close()


def _tensor_keys(manifest: Manifest) -> list[str]:
    keys: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("$tensor") is not None:
                keys.append(node["$tensor"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(manifest.tree)
    return list(dict.fromkeys(keys))


def _to_sharded(
    opened: Opened,
    dst: str,
    ranks: int,
    storage_options: dict[str, Any] | None,
    buffer_bytes: int,
    max_chunk_bytes: int,
    progress: Callable[[int], None] | None,
) -> dict[str, Any]:
    m = opened.manifest
    if m.kind != "sharded" and m.pickled:
        raise CheckpointError(f"{opened.display} holds pickled objects, which the sharded layout does not store")
    out = Directory(dst, storage_options)
    if out.exists(MANIFEST):
        raise CheckpointError(f"{out.display} already holds a checkpoint; choose a new destination")
    out.makedirs()
    read_box = _reader(opened, buffer_bytes)
    keys = [k for k in _tensor_keys(m) if k in m.tensors]
    tensors = {k: TensorEntry(m.tensors[k].dtype, m.tensors[k].shape) for k in keys}
    per_rank = _per_rank_values(opened) if m.kind == "sharded" else {}
    saved_world = int(m.meta.get("world_size", 1))
    keep_per_rank = bool(per_rank) and saved_world == ranks
    ranks_meta = []
    for r in range(ranks):
        t0 = time.perf_counter()
        boxes: list[tuple[str, Box]] = []
        for k in keys:
            e = m.tensors[k]
            if not e.shape:
                if r == 0:
                    boxes.append((k, ((), ())))
                continue
            box = shard_box(e.shape, (ranks,), [("shard", 0)], (r,))
            if not math.prod(box[1]) and any(e.shape):
                continue
            row_bytes = dtype_from_name(e.dtype, where=opened.display).itemsize * math.prod(e.shape[1:])
            boxes.extend((k, b) for b in _split_rows(box, row_bytes, max_chunk_bytes))
        if keep_per_rank:
            for base in per_rank:
                key = f"{base}#rank{r:05d}"
                if key in m.tensors:
                    boxes.append((key, ((0,), m.tensors[key].shape)))
                    tensors[key] = TensorEntry("uint8", m.tensors[key].shape)
        written = 0
        if boxes:
            sink = open_sink(out.target(data_file(r)))
            try:
                done = write_raw(sink, [functools.partial(read_box, k, b) for k, b in boxes], block_size=BLOCK_SIZE)
                sink.commit(b"")
            except BaseException:
                sink.abort()
                raise
            for (k, b), w in zip(boxes, done):
                tensors[k].chunks.append(
                    Chunk(
                        b[0], b[1], data_file(r), w.offset, w.length, "raw", w.checksum,
                        BLOCK_SIZE if w.block_checksums is not None else None, w.block_checksums,
                    )
                )
                written += w.length
                if progress:
                    progress(w.length)
        timings = {"plan_s": 0.0, "write_s": round(time.perf_counter() - t0, 6)}
        part = {"rank": r, "world_size": ranks, "host": socket.gethostname(), "pid": os.getpid(), "bytes": written,
                "chunks": {k: [c.to_json() for c in e.chunks if c.file == data_file(r)] for k, e in tensors.items()},
                "timings": timings}
        out.write_small(part_file(r), json.dumps(part, separators=(",", ":")).encode())
        ranks_meta.append({k: part[k] for k in ("rank", "host", "pid", "bytes", "timings")})
    tree = m.tree
    dropped = []
    if per_rank and not keep_per_rank:
        dropped = sorted(per_rank)
        tree = _drop_per_rank(tree)
    manifest = Manifest(
        kind="sharded",
        tensors=tensors,
        tree=tree,
        meta={
            "world_size": ranks,
            "created_unix": round(time.time(), 3),
            "resharded_from": {"location": opened.display, "world_size": saved_world, "kind": m.kind},
            "total_bytes": sum(e.nbytes for e in tensors.values()),
            "ranks": ranks_meta,
        },
    )
    body = manifest.to_json_bytes()
    parse_manifest(body, where=f"{out.display}/{MANIFEST}")
    out.write_small(MANIFEST, body)
    return {"ranks": ranks, "tensors": len(keys), "bytes": manifest.meta["total_bytes"], "dropped_per_rank": dropped}


def _drop_per_rank(node: Any) -> Any:
    if isinstance(node, dict):
        if "$per_rank" in node:
            return None
        return {k: _drop_per_rank(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_drop_per_rank(v) for v in node]
    return node


class _LazyItem(WriteItem):
    """A write item whose bytes are read from the source checkpoint only when the writer asks."""

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], read: Callable[[], torch.Tensor]) -> None:
        super().__init__(key, dtype, shape, torch.empty(0), "raw")
        self._read = read

    def raw_bytes(self) -> torch.Tensor:
        return self._read()


def _consolidate(
    opened: Opened,
    dst: str,
    storage_options: dict[str, Any] | None,
    buffer_bytes: int,
    progress: Callable[[int], None] | None,
    decode_per_rank: Callable[[bytes, str], Any] | None,
) -> dict[str, Any]:
    """One single-file checkpoint; per-rank values survive only when one rank saved them."""
    m = opened.manifest
    read_box = _reader(opened, buffer_bytes)
    items: list[WriteItem] = []
    obj_ids: dict[str, int] = {}
    saved_world = int(m.meta.get("world_size", 1))
    planner = _Planner(None, False)
    planner.keys.update(m.tensors)  # per-rank values' own tensors must not take a manifest key
    planner.next_obj = len(m.tensors)  # nor an object id of the tensors read from the source
    dropped: list[str] = []

    def per_rank_value(key: str) -> Any:
        entry_key = f"{key}#rank00000"
        blob = bytes(read_box(entry_key, ((0,), m.tensors[entry_key].shape)).numpy())
        assert decode_per_rank is not None
        return decode_per_rank(blob, f"{opened.display} [{entry_key}]")

    def convert(node: Any, path: list[Any]) -> Any:
        if isinstance(node, dict):
            if "$tensor" in node and node["$tensor"] in m.tensors:
                key = node["$tensor"]
                if key not in obj_ids:
                    e = m.tensors[key]
                    dtype = dtype_from_name(e.dtype, where=opened.display)
                    full = ((0,) * len(e.shape), e.shape)

                    def read(key: str = key, full: Box = full) -> torch.Tensor:
                        buf = read_box(key, full)
                        if progress:
                            progress(buf.numel())
                        return buf

                    obj_ids[key] = len(obj_ids)
                    items.append(_LazyItem(key, dtype, e.shape, read))
                return {"$tensor": key, "obj": obj_ids[key], **{k: v for k, v in node.items() if k not in ("$tensor", "obj")}}
            if "$per_rank" in node:
                if saved_world != 1 or decode_per_rank is None:
                    dropped.append(node["$per_rank"])
                    return None
                value = per_rank_value(node["$per_rank"])
                return Encoder(planner.leaf, None).encode(value) if value is not None else None
            return {k: convert(v, path + [k]) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v, path + [i]) for i, v in enumerate(node)]
        return node

    tree = convert(m.tree, [])
    planner.finish()
    plan = Plan(tree=tree, items=items + planner.items, pickled=[])
    Decoder(lambda tag, node: None, opened.display).decode(tree)  # the tree must stay well-formed
    target = resolve(dst, storage_options)
    if target.path is not None and os.path.exists(target.path):
        raise CheckpointError(f"{dst} already exists; choose a new destination")
    sink = open_sink(target)
    try:
        write_container(plan, sink)
    except BaseException:
        sink.abort()
        raise
    return {"ranks": 1, "tensors": len(items), "bytes": sum(i.nbytes for i in items), "dropped_per_rank": dropped}

