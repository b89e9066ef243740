"""Read-only views of a checkpoint for the CLI: a summary and a full checksum scan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CheckpointError
from ..format.checksum import ALGORITHM
from ..storage.targets import ShortRead
from .single_file import OpenContainer

SCAN_PIECE = 64 << 20


def summary(opened: OpenContainer) -> dict[str, Any]:
    m = opened.manifest
    tensors = []
    for key, e in m.tensors.items():
        codecs = sorted({c.codec for c in e.chunks})
        tensors.append(
            {
                "key": key,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "bytes": e.nbytes,
                "stored_bytes": sum(c.length for c in e.chunks),
                "chunks": len(e.chunks),
                "codec": codecs[0] if len(codecs) == 1 else codecs,
                "pickled": key in m.pickled,
            }
        )
    tree = m.tree
    top = list(tree.keys()) if isinstance(tree, dict) and not next(iter(tree), "").startswith("$") else None
    return {
        "location": opened.source.display,
        "layout": m.kind,
        "format_version": m.format_version,
        "writer": m.writer,
        "meta": m.meta,
        "file_bytes": opened.end,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "stored_bytes": sum(t["stored_bytes"] for t in tensors),
        "num_tensors": len(tensors),
        "num_chunks": sum(t["chunks"] for t in tensors),
        "pickled": list(m.pickled),
        "top_level_keys": top,
        "tensors": tensors,
    }


@dataclass
class BadChunk:
    key: str
    index: int
    offset: int
    length: int
    problem: str


def scan(opened: OpenContainer, progress: Callable[[int], None] | None = None) -> tuple[int, list[BadChunk]]:
    """Re-read every chunk in bounded pieces and check its checksum; returns (chunks checked, bad ones)."""
    source = opened.source
    bad: list[BadChunk] = []
    checked = 0
    for key, entry in opened.manifest.tensors.items():
        for i, c in enumerate(entry.chunks):
            checked += 1
            h = xxhash.xxh3_64()
            try:
                for p in range(0, c.length, SCAN_PIECE):
                    n = min(SCAN_PIECE, c.length - p)
                    h.update(source.read(c.offset + p, n))
                    if progress:
                        progress(n)
            except ShortRead as exc:
                bad.append(BadChunk(key, i, c.offset, c.length, f"truncated: {exc}"))
                continue
            except CheckpointError as exc:
                bad.append(BadChunk(key, i, c.offset, c.length, str(exc)))
                continue
            actual = f"{ALGORITHM}:{h.hexdigest()}"
            if actual != c.checksum:
                bad.append(BadChunk(key, i, c.offset, c.length, f"checksum mismatch: stored {c.checksum}, read {actual}"))
    return checked, bad
