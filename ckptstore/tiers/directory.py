"""The local and durable tiers: step directories under a root path or fsspec URL.

Every step is an ordinary sharded checkpoint (``<root>/step-<012d>/``: data files, part files,
manifest.json last), so ``load_sharded``, ``ckptstore inspect`` and ``verify`` read any step of
any tier without the store.

A rank's bytes go out as the staged slot laid out on disk: one sequential write (O_DIRECT where
the filesystem allows it) whose chunk checksums are the ones computed from the staged copy. When
the caller declared some tensors frozen, their region of the slot becomes a file of its own whose
name is derived from its chunk checksums: a later step whose frozen region hashes the same gets a
hard link (local) or a server-side copy (object stores) instead of a rewrite, so the bytes written
follow what changed, and each step directory stays complete on its own (retention can delete any
step without breaking another).

``codec="zstd"`` compresses each chunk for this tier only (the durable tier, where bandwidth
costs more than CPU); checksums then cover the compressed bytes, as everywhere in the format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from .._faults import crashpoint
from ..checkpoint.sharded import BLOCK_SIZE, MANIFEST, Directory, data_file, part_file, read_manifest
from ..checkpoint.single_file import write_raw
from ..errors import CheckpointExistsError, InvalidArgumentError
from ..format import codecs
from ..format.manifest import Manifest, parse_manifest
from ..storage.targets import (
    Source,
    WriteTuning,
    open_sink,
    storage_error,
    transport_errors,
    write_bytes,
    write_small_exclusive,
)
from .base import Snapshot, Tier

log = logging.getLogger("ckptstore")


def step_name(step: int) -> str:
    return f"step-{step:012d}"


class DirectoryTier(Tier):
    def __init__(
        self,
        name: str,
        root: str,
        *,
        storage_options: dict[str, Any] | None = None,
        codec: str | None = None,
        manifest_writer: bool = True,
        tuning: WriteTuning | None = None,
    ) -> None:
        if codec not in (None, "raw", "zstd"):
            raise InvalidArgumentError(f"codec must be None or 'zstd' for a tier, not {codec!r}")
        self.name, self.root = name, root.rstrip("/") or "/"
        self.storage_options = storage_options if "://" in root else None
        self.codec = None if codec == "raw" else codec
        # Of all ranks sharing this root, exactly one writes manifests, sweeps and applies retention.
        self.manifest_writer = manifest_writer
        self.tuning = tuning  # bulk-write settings measured by `ckptstore bench`, or None for the defaults
        self._base = Directory(self.root, self.storage_options)
        # frozen file name -> (a step that holds it, its chunk table): what a later step may link.
        self._frozen: dict[str, tuple[int, dict[str, list[dict[str, Any]]]]] = {}
        self._mine: dict[int, list[str]] = {}
        self._token = secrets.token_hex(4)  # names this writer's files where the usual name is taken

    def _dir(self, step: int) -> Directory:
        return Directory(f"{self.root}/{step_name(step)}", self.storage_options)

    def display(self, step: int) -> str:
        return self._dir(step).display

    # ------------------------------------------------------------------------------ writing

    def put_sync(self, snap: Snapshot) -> dict[str, Any]:
        t0 = time.perf_counter()
        d = self._dir(snap.step)
        if d.exists(MANIFEST):
            raise CheckpointExistsError(
                f"step {snap.step} in {d.display} was committed by another writer first ({MANIFEST} already exists; "
                "steps are never rewritten): its checkpoint is untouched and this writer's copy is not written. "
                "Give each writer its own directory, or save under a new step.",
                location=f"{d.display}/{MANIFEST}",
            )
        try:
            return self._put(d, snap, t0)
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"step {snap.step} in {d.display} is being written by another writer at the same time "
                f"({exc.location} appeared first): this writer's copy of the step is abandoned and the other "
                "writer's files are untouched. Give each writer its own directory, or save under a new step.",
                location=exc.location,
            ) from None

    def _put(self, d: Directory, snap: Snapshot, t0: float) -> dict[str, Any]:
        d.makedirs()
        # What this writer creates, so that a failed save removes exactly that (discard_sync).
        mine = self._mine.setdefault(snap.step, [])
        self._mine = {s: v for s, v in self._mine.items() if s > snap.step - 8}
        frozen_keys = [k for k, cs in snap.chunks.items() if cs and cs[0]["offset"] < snap.frozen_end]
        rest_keys = [k for k in snap.chunks if k not in set(frozen_keys)]
        chunks: dict[str, list[dict[str, Any]]] = {}
        written = linked = 0
        if frozen_keys:
            digest = hashlib.sha256(
                json.dumps([(k, [c["checksum"] for c in snap.chunks[k]]) for k in frozen_keys]).encode()
            ).hexdigest()[:16]
            rel = f"data/rank-{snap.rank:05d}-frozen-{self.codec or 'raw'}-{digest}.bin"
            table = self._link(d, rel, snap.step)
            mine.append(rel)
            if table is None:
                table = self._write(d, rel, snap, frozen_keys, 0)
                written += _extent(table)
            else:
                linked += _extent(table)
            self._frozen = {rel: (snap.step, table)}  # only the newest frozen file is ever reused
            chunks.update(table)
        data, part_rel = data_file(snap.rank), part_file(snap.rank)
        if d.exists(data) or d.exists(part_rel):
            # Left by a save of this step that crashed (the durable tier is never swept), or being
            # written right now by another writer of the same step, whose manifest may come to name
            # it: never replace it, write ours beside it.
            data, part_rel = data[:-4] + f".w{self._token}.bin", part_rel[:-5] + f".w{self._token}.json"
        if rest_keys:
            # Exclusive, so that of two writers racing for the same name neither replaces the other's
            # bytes (a manifest over someone else's data would be a torn checkpoint).
            table = self._write(d, data, snap, rest_keys, snap.frozen_end, exclusive=True)
            mine.append(data)
            written += _extent(table)
            chunks.update(table)
        crashpoint("tier.data_written", d.display)
        part = {
            "rank": snap.rank,
            "world_size": snap.world,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "bytes": written + linked,
            "written_bytes": written,
            "chunks": chunks,
            "timings": {"write_s": round(time.perf_counter() - t0, 6), **snap.meta.get("timings", {})},
        }
        write_bytes(d.target(part_rel), json.dumps(part, separators=(",", ":")).encode(), exclusive=True)
        mine.append(part_rel)
        crashpoint("tier.part_written", d.display)
        return part

    def _write(
        self, d: Directory, rel: str, snap: Snapshot, keys: list[str], start: int, exclusive: bool = False
    ) -> dict[str, list[dict[str, Any]]]:
        """Write the chunks of ``keys`` (which sit in the slot from ``start`` on) to ``rel``."""
        sink = open_sink(d.target(rel), self.tuning, exclusive=exclusive)
        try:
            if self.codec is None:
                end = max((c["offset"] + c["length"] for k in keys for c in snap.chunks[k]), default=start)
                # The chunk checksums were computed from the staged copy: no second pass here.
                write_raw(sink, [lambda: snap.data.narrow(0, start, end - start)], hash_bytes=False)
                table = {k: [{**c, "file": rel, "offset": c["offset"] - start} for c in snap.chunks[k]] for k in keys}
            else:
                flat = [(k, c) for k in keys for c in snap.chunks[k]]
                done = write_raw(sink, [_encoder(self.codec, snap.data, c) for _k, c in flat])
                table = {k: [] for k in keys}
                for (k, c), w in zip(flat, done):
                    table[k].append({**c, "file": rel, "offset": w.offset, "length": w.length, "codec": self.codec,
                                     "checksum": w.checksum, "block_size": None, "block_checksums": None})
            sink.commit(b"")
        except BaseException:
            sink.abort()
            raise
        return table

    def _link(self, d: Directory, rel: str, step: int) -> dict[str, list[dict[str, Any]]] | None:
        """Reuse ``rel`` from the step that last held it: a hard link or a server-side copy."""
        held = self._frozen.get(rel)
        if held is None or held[0] == step:
            return None
        src, dst = self._dir(held[0]).target(rel), d.target(rel)
        try:
            if src.path is not None and dst.path is not None:
                os.link(src.path, dst.path)
            else:
                src.fs.copy(src.fspath, dst.fspath)
        except (OSError, NotImplementedError) as exc:
            log.info("ckptstore: cannot reuse %s (%s); writing it again", src.display, exc)
            return None
        return held[1]

    def commit_sync(self, step: int, manifest: Manifest) -> None:
        if not self.manifest_writer:
            return
        d = self._dir(step)
        body = manifest.to_json_bytes()
        parse_manifest(body, where=f"{d.display}/{MANIFEST}")  # never commit what we would refuse to read
        crashpoint("tier.before_manifest", d.display)
        # A conditional create (link on local disks, If-None-Match on S3): of two writers
        # committing the same step, exactly one wins and the other gets a clear error.
        try:
            write_small_exclusive(d.target(MANIFEST), body)
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"step {step} in {d.display} was committed by another writer first ({exc.location} already exists): "
                "its checkpoint is untouched and this writer's copy is not committed. Give each writer its own "
                "directory, or save under a new step.",
                location=exc.location,
            ) from None

    # ------------------------------------------------------------------------------ reading

    def _names(self) -> list[str]:
        base = self._base.base
        if base.fs is not None:
            # Listings are cached per filesystem object, and steps are committed and removed
            # through other objects and by other processes: always list afresh.
            base.fs.invalidate_cache()
        try:
            if base.path is not None:
                return os.listdir(base.path) if os.path.isdir(base.path) else []
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in base.fs.ls(base.fspath, detail=False)]
        except FileNotFoundError:
            return []

    def steps_sync(self) -> list[int]:
        steps = []
        try:
            for name in self._names():
                if name.startswith("step-") and name[5:].isdigit() and self._base.exists(f"{name}/{MANIFEST}"):
                    steps.append(int(name[5:]))
        except FileNotFoundError:
            return []
        except transport_errors() as exc:  # botocore's and aiohttp's own errors too, as StorageError
            raise storage_error(exc, "list", self._base.display) from None
        return sorted(steps)

    def manifest_sync(self, step: int) -> Manifest:
        return read_manifest(self._dir(step))

    def opener(self, step: int) -> Callable[[str | None], Source]:
        return self._dir(step).open

    # ------------------------------------------------------------------------------ removing

    def remove_sync(self, step: int) -> None:
        d = self._dir(step)
        d.remove(MANIFEST)  # uncommit first: a half-deleted step must never look complete
        crashpoint("tier.removing", d.display)
        _remove_tree(d)

    def discard_sync(self, step: int) -> None:
        """Remove the files this writer created for a failed save of ``step``, unless the step is
        committed: a failed save leaves no debris behind, and never touches a committed step or
        another writer's files (two writers of one step share its directory until one commits)."""
        d = self._dir(step)
        mine = self._mine.pop(step, [])
        if d.exists(MANIFEST):
            return
        # Files only: another writer of the step may be about to write into its directories (the
        # empty ones left are swept, with the step, when a store next starts).
        for rel in mine:
            d.remove(rel)

    def sweep_sync(self) -> list[int]:
        """Remove what a crashed save left behind: step directories without a manifest (returns
        their steps), temporary files in the newest committed steps, and, on S3, unfinished
        multipart uploads under the root. Only safe while no save of this job is running (the
        store calls it at start-up, before any rank saves)."""
        swept, committed = [], []
        for name in self._names():
            if not (name.startswith("step-") and name[5:].isdigit()):
                continue
            if self._base.exists(f"{name}/{MANIFEST}"):
                committed.append(int(name[5:]))
                continue
            d = self._dir(int(name[5:]))
            log.warning("ckptstore: removing %s, an incomplete step (no %s)", d.display, MANIFEST)
            _remove_tree(d)
            swept.append(int(name[5:]))
        # A crash between linking a manifest into place and removing its temporary name leaves
        # that name in a committed step; only the steps being written at the time can hold one.
        for step in sorted(committed)[-2:]:
            _remove_temporaries(self._dir(step))
        self._abort_uploads()
        return swept

    def _abort_uploads(self) -> None:
        """Abort multipart uploads under this root that a killed writer never completed: S3 keeps
        (and bills) their parts forever otherwise."""
        base = self._base.base
        if base.fs is None:
            return
        from ..storage import s3

        if not s3.is_s3(base.fs):
            return
        bucket, key, _ = base.fs.split_path(base.fspath)
        prefix = key.rstrip("/") + "/" if key else ""
        try:
            for upload in s3.pending_uploads(base.fs, bucket, prefix):
                log.warning("ckptstore: aborting s3://%s/%s, an upload a crashed save left unfinished", bucket,
                            upload["Key"])
                base.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                UploadId=upload["UploadId"])
        except OSError as exc:
            log.warning("ckptstore: cannot list or abort unfinished uploads under %s: %s", self.root, exc)


def _extent(table: dict[str, list[dict[str, Any]]]) -> int:
    return sum(c["length"] for cs in table.values() for c in cs)


def _encoder(codec: str, data: torch.Tensor, c: dict[str, Any]) -> Callable[[], torch.Tensor]:
    def encode() -> torch.Tensor:
        stored = codecs.encode(codec, data.narrow(0, c["offset"], c["length"]), 1)
        return torch.frombuffer(bytearray(stored), dtype=torch.uint8) if len(stored) else torch.empty(0, dtype=torch.uint8)

    return encode


def _remove_temporaries(d: Directory) -> None:
    base = d.base
    try:
        if base.path is not None:
            for top, _dirs, files in os.walk(base.path):
                for f in files:
                    if ".ckptstore-tmp-" in f:
                        log.warning("ckptstore: removing %s, a temporary file a crashed save left", os.path.join(top, f))
                        os.unlink(os.path.join(top, f))
        else:
            for f in base.fs.find(base.fspath):
                if ".ckptstore-tmp-" in f.rsplit("/", 1)[-1]:
                    log.warning("ckptstore: removing %s, a temporary object a crashed save left", f)
                    base.fs.rm(f)
    except FileNotFoundError:
        pass


def _remove_tree(d: Directory) -> None:
    if d.base.path is not None:
        shutil.rmtree(d.base.path, ignore_errors=True)
    else:
        try:
            d.base.fs.rm(d.base.fspath, recursive=True)
        except FileNotFoundError:
            pass


__all__ = ["BLOCK_SIZE", "DirectoryTier", "step_name"]
