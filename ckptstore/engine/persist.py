"""Persisting a RAM-tier snapshot as a step directory (the local tier's write path, issue 4).

A staged slot is laid out like a sharded data file, so the data file is the slot's bytes written
in one go (O_DIRECT where the filesystem allows it), and the manifest's chunk checksums are the
ones computed from the staged copy: the bytes are hashed once, in RAM, and verified at every later
hop. The directory is an ordinary sharded checkpoint: ``load_sharded`` and the CLI read it.

Single rank for now; the pipeline will gather the parts of all ranks before rank 0 commits.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from typing import Any

from .._version import __version__
from ..errors import CheckpointError
from ..format.manifest import Chunk, Manifest, TensorEntry, parse_manifest
from ..storage.targets import open_sink
from ..tiers.ram import RamTier, Staged
from .sharded import BLOCK_SIZE, MANIFEST, Directory, data_file, part_file
from .single_file import write_raw


def persist_staged(
    tier: RamTier,
    staged: Staged,
    checksums: dict[str, Any],
    tree: Any,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Write the staged snapshot to ``url`` as a committed one-rank checkpoint; returns its manifest.

    ``checksums`` come from :meth:`RamTier.checksums` (with ``block_size=BLOCK_SIZE``) and ``tree``
    is the state's manifest tree whose ``$tensor`` keys name the staged entries.
    """
    t0 = time.perf_counter()
    directory = Directory(url, storage_options)
    if directory.exists(MANIFEST):
        raise CheckpointError(f"{directory.display} already holds a committed checkpoint; steps are never rewritten")
    directory.makedirs()
    slot = tier._slots[staged.slot]
    rel = data_file(tier.rank)
    sink = open_sink(directory.target(rel))
    try:
        write_raw(sink, [functools.partial(slot.buffer.narrow, 0, 0, staged.layout.total)])
        sink.commit(b"")
    except BaseException:
        sink.abort()
        raise
    tensors: dict[str, TensorEntry] = {}
    for e in staged.layout.entries:
        sums = checksums[e.key]
        blocks = sums.get("block_checksums")
        chunk = Chunk(
            (0,) * len(e.shape),
            e.shape,
            rel,
            e.offset,
            e.nbytes,
            "raw",
            sums["checksum"],
            BLOCK_SIZE if blocks else None,
            tuple(blocks) if blocks else None,
        )
        tensors[e.key] = TensorEntry(e.dtype, e.shape, [chunk] if e.nbytes or not e.shape else [])
    written = time.perf_counter() - t0
    part = {
        "rank": tier.rank,
        "world_size": 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "bytes": sum(e.nbytes for e in staged.layout.entries),
        "chunks": {k: [c.to_json() for c in e.chunks] for k, e in tensors.items() if e.chunks},
        "timings": {"stage_s": round(staged.seconds, 6), "write_s": round(written, 6)},
    }
    directory.write_small(part_file(tier.rank), json.dumps(part, separators=(",", ":")).encode())
    manifest = Manifest(
        kind="sharded",
        tensors=tensors,
        tree=tree,
        meta={
            "world_size": 1,
            "step": staged.step,
            "created_unix": round(time.time(), 3),
            "ckptstore_version": __version__,
            "total_bytes": part["bytes"],
            "ranks": [{k: part[k] for k in ("rank", "host", "pid", "bytes", "timings")}],
        },
    )
    body = manifest.to_json_bytes()
    parse_manifest(body, where=f"{directory.display}/{MANIFEST}")
    directory.write_small(MANIFEST, body)
    return manifest
