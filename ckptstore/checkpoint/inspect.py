"""Read-only views of a checkpoint for the CLI: a summary and a full checksum scan, for the
single-file container and the sharded directory alike."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.checksum import ALGORITHM
from ..format.manifest import Manifest
from ..storage.targets import ShortRead, Source, open_source, resolve
from .sharded import Directory, check_extent, read_manifest
from .single_file import open_container

SCAN_PIECE = 64 << 20


@dataclass
class Opened:
    """A checkpoint opened for reading, whichever layout: its manifest and a way to its files."""

    display: str
    manifest: Manifest
    file_bytes: int | None
    _source: Source | None = None
    _directory: Directory | None = None

    def source(self, rel: str | None) -> Source:
        if rel is None:
            assert self._source is not None
            return self._source
        assert self._directory is not None
        return self._directory.open(rel)

    def close(self) -> None:
        if self._source is not None:
            self._source.close()


def is_sharded(url: str, storage_options: dict[str, Any] | None) -> bool:
    target = resolve(url, storage_options)
    if target.path is not None:
        return os.path.isdir(target.path)
    if target.fs is not None:
        return bool(target.fs.isdir(target.fspath))
    return False


def open_any(url: str, storage_options: dict[str, Any] | None) -> Opened:
    if is_sharded(url, storage_options):
        directory = Directory(url, storage_options)
        return Opened(directory.display, read_manifest(directory), None, _directory=directory)
    source = open_source(resolve(url, storage_options))
    try:
        c = open_container(source)
    except BaseException:
        source.close()
        raise
    return Opened(source.display, c.manifest, c.end, _source=source)


def check_files(opened: Opened) -> None:
    """Every chunk's bytes lie inside its file (symbolic links out of the directory refused): what
    a command that writes checks first, so that a damaged source is refused before any write."""
    if opened._directory is None:
        return  # a single file's chunk ranges were checked against its data region when it was opened
    sizes: dict[str, int] = {}
    for key, entry in opened.manifest.tensors.items():
        for c in entry.chunks:
            if c.file is None or not c.length:
                continue
            if c.file not in sizes:
                try:
                    source = opened.source(c.file)
                except CheckpointNotFoundError:
                    raise CorruptCheckpointError(
                        f"{opened.display}/{c.file} is missing, but the manifest keeps tensor {key!r} in it",
                        location=f"{opened.display}/{c.file}",
                        key=key,
                    ) from None
                sizes[c.file] = source.size
                source.close()
            check_extent(opened.display, key, c, sizes[c.file])


def _split_dims(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    return [d for d in range(len(shape)) if len({b[0][d] for b in boxes}) > 1]


def saved_layout(layout: Any) -> str | None:
    """A DTensor's saved mesh and placements as one line: ``(dp=2, tp=2) _S(0,2) S(0)``."""
    if not isinstance(layout, dict) or not isinstance(layout.get("mesh"), list):
        return None
    names = layout.get("names") or [f"d{i}" for i in range(len(layout["mesh"]))]
    mesh = ", ".join(f"{n}={s}" for n, s in zip(names, layout["mesh"]))
    return f"({mesh}) " + " ".join(map(str, layout.get("placements", [])))


def summary(opened: Opened) -> dict[str, Any]:
    m = opened.manifest
    layouts: dict[str, Any] = m.meta["layouts"] if isinstance(m.meta.get("layouts"), dict) else {}
    tensors = []
    for key, e in m.tensors.items():
        codecs = sorted({c.codec for c in e.chunks})
        files = sorted({c.file for c in e.chunks if c.file is not None})
        tensors.append(
            {
                "key": key,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "bytes": e.nbytes,
                "stored_bytes": sum(c.length for c in e.chunks),
                "chunks": len(e.chunks),
                "split_dims": _split_dims(e.shape, [(c.offsets, c.sizes) for c in e.chunks]),
                "files": files,
                "codec": codecs[0] if len(codecs) == 1 else (",".join(codecs) or "-"),
                "pickled": key in m.pickled,
                "saved_layout": saved_layout(layouts.get(key)),  # None: a plain tensor, or not recorded
            }
        )
    tree = m.tree
    top = list(tree.keys()) if isinstance(tree, dict) and not next(iter(tree), "").startswith("$") else None
    info: dict[str, Any] = {
        "location": opened.display,
        "layout": m.kind,
        "format_version": m.format_version,
        "writer": m.writer,
        "meta": m.meta,
        "file_bytes": opened.file_bytes,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "stored_bytes": sum(t["stored_bytes"] for t in tensors),
        "num_tensors": len(tensors),
        "num_chunks": sum(t["chunks"] for t in tensors),
        "pickled": list(m.pickled),
        "top_level_keys": top,
        "tensors": tensors,
    }
    if m.kind == "sharded":
        ranks = m.meta.get("ranks", [])
        info["world_size"] = m.meta.get("world_size")
        info["ranks"] = ranks
        info["stragglers"] = stragglers(ranks)
    return info


def stragglers(ranks: list[dict[str, Any]], factor: float = 2.0) -> list[int]:
    """Ranks whose write time is over ``factor`` times the median (and over 10 ms, to ignore noise)."""
    times = [r.get("timings", {}).get("write_s", 0.0) for r in ranks]
    if len(times) < 3:
        return []
    med = statistics.median(times)
    return [r["rank"] for r, t in zip(ranks, times) if t > 0.01 and t > factor * med]


@dataclass
class BadChunk:
    key: str
    index: int
    file: str | None
    offset: int
    length: int
    problem: str


def scan(opened: Opened, progress: Callable[[int], None] | None = None) -> tuple[int, list[BadChunk]]:
    """Re-read every chunk in bounded pieces and check its checksum; returns (chunks checked, bad ones)."""
    bad: list[BadChunk] = []
    checked = 0
    sources: dict[str | None, Source] = {}
    try:
        for key, entry in opened.manifest.tensors.items():
            for i, c in enumerate(entry.chunks):
                checked += 1
                h = xxhash.xxh3_64()
                try:
                    if c.file not in sources:
                        sources[c.file] = opened.source(c.file)
                    source = sources[c.file]
                    for p in range(0, c.length, SCAN_PIECE):
                        n = min(SCAN_PIECE, c.length - p)
                        h.update(source.read(c.offset + p, n))
                        if progress:
                            progress(n)
                except ShortRead as exc:
                    bad.append(BadChunk(key, i, c.file, c.offset, c.length, f"truncated: {exc}"))
                    continue
                except CheckpointNotFoundError:
                    bad.append(BadChunk(key, i, c.file, c.offset, c.length, "file is missing"))
                    continue
                except CheckpointError as exc:
                    bad.append(BadChunk(key, i, c.file, c.offset, c.length, str(exc)))
                    continue
                actual = f"{ALGORITHM}:{h.hexdigest()}"
                if actual != c.checksum:
                    bad.append(
                        BadChunk(key, i, c.file, c.offset, c.length, f"checksum mismatch: stored {c.checksum}, read {actual}")
                    )
    finally:
        for rel, s in sources.items():
            if rel is not None:
                s.close()
    return checked, bad

