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

import asyncio
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._faults import crashpoint
from .._gc import gc_paused
from ..checkpoint.index import build_index
from ..checkpoint.sharded import Directory, read_manifest
from ..checkpoint.single_file import write_raw
from ..errors import CheckpointError, CheckpointExistsError, InvalidArgumentError, UnknownProtocolError
from ..format import codecs
from ..format.checksum import checksum
from ..format.container import align_up
from ..format.manifest import (
    Manifest,
    Parted,
    layout_digest,
    max_manifest_bytes,
    parse_manifest,
    parse_sharded,
    verify_checksum_member,
)
from ..names import (
    INDEX,
    MANIFEST,
    data_file,
    data_file_rank,
    frozen_file,
    is_frozen_file,
    is_temporary,
    parse_step_dir,
    part_file,
    step_dir,
    writer_variant,
)
from ..storage import small
from ..storage.targets import (
    Source,
    Target,
    WriteTuning,
    makedirs_private,
    open_sink,
    open_source,
    storage_error,
    transport_errors,
)
from .base import Capabilities, Held, Holdings, NodePart, Snapshot, Tier, manifest_of_parts

log = logging.getLogger("ckptstore")
_LISTING_CONCURRENCY = 8  # manifest checks in flight while listing an object store's steps


class DirectoryTier(Tier):
    """Steps under ``root``. ``node_local``: the root is this node's own disk (the local tier), so
    a restore asks each node what it holds; otherwise every rank reads the same root (durable).
    ``manifest_writer``: of all ranks sharing this root, exactly one writes manifests, sweeps and
    applies retention."""

    def __init__(
        self,
        name: str,
        root: str,
        *,
        storage_options: dict[str, Any] | None = None,
        codec: str | None = None,
        manifest_writer: bool = True,
        tuning: WriteTuning | None = None,
        node_local: bool = False,
    ) -> None:
        if codec not in (None, "raw", "zstd"):
            raise InvalidArgumentError(f"codec must be None or 'zstd' for a tier, not {codec!r}")
        self.name, self.root = name, root.rstrip("/") or "/"
        self.storage_options = storage_options if "://" in root else None
        self.codec = None if codec == "raw" else codec
        self.manifest_writer = manifest_writer
        self.tuning = tuning  # bulk-write settings measured by `ckptstore bench`, or None for the defaults
        # An object store's client (s3fs: a session, its credentials, a connection pool) is built at
        # the first request, not here: a restart restores from the node tiers without it, and the
        # store's start lists and sweeps the durable tier in the background.
        self._built: Directory | None = None
        self._building = threading.Lock()
        if "://" in self.root:
            _check_protocol(self.root)  # a URL no client can serve still fails here, at once
        if node_local and self._base.base.path is None:
            raise InvalidArgumentError(f"the {name} tier must be a local directory, not {root!r}")
        self.capabilities = Capabilities(node_local=node_local, exclusive_commit=True, reuses_unchanged=True,
                                         sweeps=True)
        # frozen file name -> (a step that holds it, its chunk table): what a later step may link.
        self._frozen: dict[str, tuple[int, dict[str, list[dict[str, Any]]]]] = {}
        self._mine: dict[int, list[str]] = {}

    @property
    def _base(self) -> Directory:
        built = self._built
        if built is None:
            with self._building:
                if self._built is None:
                    self._built = Directory(self.root, self.storage_options)
                built = self._built
        return built

    def warm(self) -> None:
        """Build the client now (from a thread of the caller's choosing); an error is left for the
        first request to raise, where it is handled."""
        try:
            self._base  # noqa: B018 - the property builds it
        except Exception as exc:  # noqa: BLE001 - raised again, in context, by the first request
            log.debug("ckptstore: cannot build the %s tier's client yet: %s", self.name, exc)

    @property
    def local_root(self) -> str | None:
        """The root as a local path, or None for an fsspec URL."""
        return self._base.base.path

    def _dir(self, step: int) -> Directory:
        return self._base.child(step_dir(step))

    def display(self, step: int) -> str:
        return self._dir(step).display

    # ------------------------------------------------------------------------------ writing

    async def put(self, snap: Snapshot) -> dict[str, Any]:
        t0 = time.perf_counter()
        d = self._dir(snap.step)
        if await small.exists(d.target(MANIFEST)):
            raise CheckpointExistsError(
                f"step {snap.step} in {d.display} was committed by another writer first ({MANIFEST} already exists; "
                "steps are never rewritten): its checkpoint is untouched and this writer's copy is not written. "
                "Give each writer its own directory, or save under a new step.",
                location=f"{d.display}/{MANIFEST}",
            )
        try:
            return await self._put(d, snap, t0)
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"step {snap.step} in {d.display} is being written by another writer at the same time "
                f"({exc.location} appeared first): this writer's copy of the step is abandoned and the other "
                "writer's files are untouched. Give each writer its own directory, or save under a new step.",
                location=exc.location,
            ) from None

    async def _put(self, d: Directory, snap: Snapshot, t0: float) -> dict[str, Any]:
        # Names this attempt's files where the usual name is taken: new at every put, so that a
        # writer retrying a step (the node agent, after a failure past its data file) never
        # collides with the files of its own earlier attempt.
        token = secrets.token_hex(4)
        try:
            await small.makedirs(d.base, "data", "parts")
        except OSError as exc:
            raise storage_error(exc, "create the checkpoint directory", d.display) from None
        # What this writer creates, so that a failed save removes exactly that (discard).
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
            rel = frozen_file(snap.rank, self.codec, digest)
            table = await self._link(d, rel, snap.step)
            mine.append(rel)
            if table is None:
                table = await asyncio.to_thread(self._write, d, rel, snap, frozen_keys, 0)
                written += _extent(table)
            else:
                linked += _extent(table)
            self._frozen = {rel: (snap.step, table)}  # only the newest frozen file is ever reused
            chunks.update(table)
        data, part_rel = data_file(snap.rank), part_file(snap.rank)
        if await small.exists(d.target(data)) or await small.exists(d.target(part_rel)):
            # Left by a save of this step that crashed (the durable tier is never swept), or being
            # written right now by another writer of the same step, whose manifest may come to name
            # it: never replace it, write ours beside it.
            data, part_rel = writer_variant(data, token), writer_variant(part_rel, token)
        elif d.base.path is None:
            # On an object store the data object is always this writer's own: a server may complete
            # several conditional multipart uploads of one new key (SeaweedFS does; Ceph RGW ignores
            # the condition), so only a single conditional PUT (the part file, then the manifest)
            # can decide a race, and the winner's manifest must name none of a loser's bytes.
            data = writer_variant(data, token)
        if rest_keys:
            # Exclusive, so that of two writers racing for the same name neither replaces the other's
            # bytes (a manifest over someone else's data would be a torn checkpoint).
            try:
                table = await asyncio.to_thread(self._write, d, data, snap, rest_keys, snap.frozen_end, True)
            except CheckpointExistsError:
                if data != data_file(snap.rank):
                    raise
                # The other writer took the usual name after the check above: ours goes beside it.
                data, part_rel = writer_variant(data, token), writer_variant(part_rel, token)
                table = await asyncio.to_thread(self._write, d, data, snap, rest_keys, snap.frozen_end, True)
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
            **snap.meta.get("part", {}),  # members a writer adds to its part (the node agent: its snapshot)
        }
        # Off the loop, the collector paused: a part of 10,000 chunks is some megabytes of JSON,
        # and encoding it on the loop held the other lanes and set off a full collection.
        body = await asyncio.to_thread(gc_paused(_json_bytes), part)
        try:
            await small.write(d.target(part_rel), body, exclusive=True)
        except CheckpointExistsError:
            if part_rel != part_file(snap.rank):
                raise
            # Another writer of the step (the node agent persisting what a killed trainer left,
            # while the restarted job promotes the same step) put its part under the usual name
            # while ours was being written: both stay, and the manifest that wins the step's
            # conditional create names its own writer's part. Failing here made the restarted
            # job's next save raise over a step that was being made durable all along.
            part_rel = writer_variant(part_rel, token)
            await small.write(d.target(part_rel), body, exclusive=True)
        mine.append(part_rel)
        # Not in the file (they are about its bytes): what the committer's index names it by.
        part.update(part_file=part_rel, part_size=len(body), part_checksum=checksum(body))
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
                table = _table_in(snap.chunks, keys, rel, start)
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

    async def _link(self, d: Directory, rel: str, step: int) -> dict[str, list[dict[str, Any]]] | None:
        """Reuse ``rel`` from the step that last held it: a hard link or a server-side copy."""
        held = self._frozen.get(rel)
        if held is None or held[0] == step:
            return None
        src = self._dir(held[0]).target(rel)
        try:
            await small.copy(src, d.target(rel))
        except (OSError, NotImplementedError) as exc:
            log.info("ckptstore: cannot reuse %s (%s); writing it again", src.display, exc)
            return None
        return held[1]

    async def commit(self, step: int, manifest: Manifest, parts: Sequence[dict[str, Any]] | None = None) -> None:
        """Commit ``manifest`` (the conditional create decides between racing writers); then, given
        the ``parts`` it was built from, write its index beside it (checkpoint/index.py), so a rank
        plans its load from the index and its own part instead of the whole manifest."""
        if not self.manifest_writer:
            return
        d = self._dir(step)
        body = manifest.to_json_bytes()
        await _readable(parse_manifest, body, f"{d.display}/{MANIFEST}")
        await self._create_manifest(step, d, body)
        if parts is not None:
            await self._index(d, manifest, parts)

    async def commit_document(self, step: int, body: bytes) -> None:
        """Commit a manifest given as its bytes (a format 2.0 one, which names the part files the
        ranks wrote instead of listing their chunks): the same conditional create as :meth:`commit`.
        Such a manifest is its own index."""
        if not self.manifest_writer:
            return
        d = self._dir(step)
        await _readable(parse_sharded, body, f"{d.display}/{MANIFEST}")
        await self._create_manifest(step, d, body)

    async def _create_manifest(self, step: int, d: Directory, body: bytes) -> None:
        crashpoint("tier.before_manifest", d.display)
        # A conditional create (link on local disks, If-None-Match on S3): of two writers
        # committing the same step, exactly one wins and the other gets a clear error.
        try:
            await small.create(d.target(MANIFEST), body)
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"step {step} in {d.display} was committed by another writer first ({exc.location} already exists): "
                "its checkpoint is untouched and this writer's copy is not committed. Give each writer its own "
                "directory, or save under a new step.",
                location=exc.location,
            ) from None

    async def _index(self, d: Directory, manifest: Manifest, parts: Sequence[dict[str, Any]]) -> None:
        # After the manifest, by the writer that committed it (a racing writer that lost never gets
        # here): the index can only describe the committed manifest. A step without one is read
        # through its manifest, so failing to write it fails nothing.
        try:
            body = await asyncio.to_thread(build_index, manifest, parts, layout_digest(manifest))
            if body is not None:
                await small.create(d.target(INDEX), body)
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: cannot write the index of %s (%s); it is read through its manifest", d.display,
                        exc)

    def small_reader(self, step: int) -> Callable[[str], bytes] | None:
        """Reads the step's index and part files by name (see Tier.small_reader)."""
        return self._dir(step).read_small

    async def discard(self, step: int) -> None:
        """Remove the files this writer created for a failed save of ``step``, unless the step is
        committed: a failed save leaves no debris behind, and never touches a committed step or
        another writer's files (two writers of one step share its directory until one commits)."""
        d = self._dir(step)
        mine = self._mine.pop(step, [])
        if await small.exists(d.target(MANIFEST)):
            return
        # Files only: another writer of the step may be about to write into its directories (the
        # empty ones left are swept, with the step, when a store next starts).
        for rel in mine:
            await small.remove(d.target(rel))

    # ------------------------------------------------------------------------------ reading

    async def _step_names(self) -> list[tuple[int, str]]:
        try:
            names = await small.listdir(self._base.base)
        except transport_errors() as exc:  # botocore's and aiohttp's own errors too, as StorageError
            raise storage_error(exc, "list", self._base.display) from None
        return [(step, name) for name in names if (step := parse_step_dir(name)) is not None]

    async def steps(self, *, since: int | None = None) -> list[int]:
        """The committed steps; ``since``: only those from that step on (the older ones are not
        looked at: on an object store each step's manifest is a request of its own)."""
        try:
            return sorted(step for step, committed in await self._listing(since) if committed)
        except FileNotFoundError:
            return []
        except transport_errors() as exc:
            raise storage_error(exc, "list", self._base.display) from None

    async def _listing(self, since: int | None = None) -> list[tuple[int, bool]]:
        """Every step directory under the root (from step ``since`` on) and whether its manifest is
        there. On an object store each manifest is a request of its own: they go out together (a
        few at a time), not one after another, so listing a tier that holds many steps costs about
        one round trip more than listing one that holds a single step."""
        names = [(step, name) for step, name in await self._step_names() if since is None or step >= since]
        limit = asyncio.Semaphore(_LISTING_CONCURRENCY)

        async def committed(name: str) -> bool:
            async with limit:
                if await small.exists(self._base.target(f"{name}/{MANIFEST}")):
                    return True
            # A node-local directory of a multi-node job: its ranks' parts, each committed on its own.
            return self.local_root is not None and _has_node_parts(os.path.join(self.local_root, name))

        found = await asyncio.gather(*(committed(name) for _step, name in names))
        return [(step, ok) for (step, _name), ok in zip(names, found)]

    async def manifest(self, step: int) -> Manifest:
        if self.local_root is not None and not os.path.exists(os.path.join(self.local_root, step_dir(step), MANIFEST)):
            parts = _node_parts(os.path.join(self.local_root, step_dir(step)), self.name)
            if parts:  # a multi-node job's node: the manifest this node's parts make
                return manifest_of_parts(parts, self.display(step))
        return await asyncio.to_thread(read_manifest, self._dir(step))

    def opener(self, step: int) -> Callable[[str | None], Source]:
        return self._dir(step).open

    def holdings(self, step: int) -> Holdings:
        """The step's data files and manifest in this node's directory (a node-local tier)."""
        return directory_holdings(self.local_root, step, self.name) if self.capabilities.node_local else Holdings()

    def node_steps(self) -> set[int]:
        if not self.capabilities.node_local:
            return set()
        return committed_steps(self.local_root)

    # ------------------------------------------------------------------------------ removing

    async def remove(self, step: int) -> None:
        d = self._dir(step)
        await small.remove(d.target(MANIFEST))  # uncommit first: a half-deleted step must never look complete
        if self.local_root is not None:
            await asyncio.to_thread(shutil.rmtree, os.path.join(self.local_root, step_dir(step), NODE_PARTS), True)
        crashpoint("tier.removing", d.display)
        await small.remove_tree(d.base)

    async def sweep(self, *, agents: bool = False) -> list[int]:
        """Remove what a crashed save left behind: step directories without a manifest (returns
        their steps), temporary files in the newest committed steps, and, on S3, unfinished
        multipart uploads under the root.

        ``agents``: node agents of the job may be writing here right now (they persist what the
        killed trainers left, while the restarted job's store starts), and they only ever write a
        step newer than every one the tier holds: those steps' files and uploads are left alone.
        Removing them mid-write could leave an agent's manifest naming deleted files. A later
        start sweeps what is left of them once a newer step is committed."""
        swept, committed, spared = [], [], []
        listing = await self._listing()
        newest = max((step for step, ok in listing if ok), default=-1)
        for step, ok in listing:
            if ok:
                committed.append(step)
                continue
            d = self._dir(step)
            if agents and step > newest:
                spared.append(step)
                continue
            log.warning("ckptstore: removing %s, an incomplete step (no %s)", d.display, MANIFEST)
            await small.remove_tree(d.base)
            swept.append(step)
        if spared:
            log.info("ckptstore: leaving %s steps %s, newer than every committed one and with no %s yet: a node "
                     "agent may be writing them", self.name, spared, MANIFEST)
        # A crash between linking a manifest into place and removing its temporary name leaves
        # that name in a committed step; only the steps being written at the time can hold one.
        for step in sorted(committed)[-2:]:
            await asyncio.to_thread(_remove_temporaries, self._dir(step))
        await asyncio.to_thread(self._abort_uploads, newest if agents else None)
        return swept

    def _abort_uploads(self, spare_after: int | None = None) -> None:
        """Abort multipart uploads under this root that a killed writer never completed: S3 keeps
        (and bills) their parts forever otherwise. ``spare_after``: not those of steps newer than
        that one (:meth:`sweep`'s ``agents``)."""
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
                step = parse_step_dir(upload["Key"][len(prefix):].split("/", 1)[0])
                if spare_after is not None and step is not None and step > spare_after:
                    continue
                log.warning("ckptstore: aborting s3://%s/%s, an upload a crashed save left unfinished", bucket,
                            upload["Key"])
                base.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                UploadId=upload["UploadId"])
        except OSError as exc:
            log.warning("ckptstore: cannot list or abort unfinished uploads under %s: %s", self.root, exc)

    # ------------------------------------------------------------------------------ promotion source

    def mapped(self, step: int, part: dict[str, Any], snap: Snapshot) -> Any:
        """This rank's committed files of ``step`` (``part`` as :meth:`put` returned it), mapped
        read-only and addressed like the staged slot ``snap`` came from, or None when they cannot
        be (not a local directory, several files per region, a mapping refused): a promotion then
        reads the slot. A mapping keeps the bytes readable even when retention removes the files."""
        root = self.local_root
        if root is None:
            return None
        frozen = {c["file"] for k, cs in part["chunks"].items() for c in cs
                  if snap.chunks[k] and snap.chunks[k][0]["offset"] < snap.frozen_end}
        rest = {c["file"] for k, cs in part["chunks"].items() for c in cs} - frozen
        if len(frozen) > 1 or len(rest) > 1:
            return None
        where = os.path.join(root, step_dir(step))
        try:
            return _SlotFiles(_map(os.path.join(where, frozen.pop())) if frozen else None,
                              _map(os.path.join(where, rest.pop())) if rest else None, snap.frozen_end, snap.nbytes)
        except (OSError, ValueError) as exc:
            log.warning("ckptstore: promoting step %d from its RAM slot (cannot map its local files: %s)", step, exc)
            return None


    async def put_node_part(self, step: int, rank: int, own: dict[str, Any]) -> None:
        """Commit this rank's files of ``step`` on this node with ``own`` (its part, the step's
        meta, its header: :func:`write_node_part`); a failed save's :meth:`discard` removes it."""
        assert self.local_root is not None
        rel = f"{NODE_PARTS}/rank-{rank:05d}.json"
        try:
            # Exclusive: of two writers of one step in one directory (two jobs given the same one)
            # exactly one commits its part, and the other's discard never removes the winner's.
            await write_node_part(self.local_root, step, rank, own, holder=rank, exclusive=True)
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"step {step} in {self.display(step)} is being written by another writer at the same time "
                f"({exc.location} appeared first): this writer's copy of the step is abandoned and the other "
                "writer's files are untouched. Give each writer its own directory, or save under a new step.",
                location=exc.location,
            ) from None
        self._mine.setdefault(step, []).append(rel)

    def node_part(self, step: int, rank: int) -> NodePart | None:
        """Rank ``rank``'s node part of ``step`` in this directory, when there is one."""
        if self.local_root is None:
            return None
        return next((p for p in _node_parts(os.path.join(self.local_root, step_dir(step)), self.name)
                     if p.rank == rank), None)

    def node_parts(self, step: int) -> list[NodePart]:
        """The node parts of ``step`` committed in this directory (this node's ranks')."""
        if self.local_root is None:
            return []
        return _node_parts(os.path.join(self.local_root, step_dir(step)), self.name)

    def snapshot_of(self, step: int, rank: int) -> Snapshot | None:
        """Rank ``rank``'s files of the committed ``step`` as a snapshot another tier can take (a
        restored step promoted to the durable tier): its chunks as this tier's manifest lists them,
        addressed like the staged slot they were written from (the frozen file, then the rest).
        None when this is not a local directory or the files cannot be mapped."""
        if self.local_root is None:
            return None
        chunks: dict[str, list[dict[str, Any]]] = {}
        files: set[str] = set()
        # This rank's node part when there is one: it lists the rank's chunks, where the manifest
        # (a 2.0 one) would send the reader to every rank's part file.
        own = self.node_part(step, rank)
        if own is not None:
            world = int(own.meta.get("world_size", 1))
            for key, table in own.part["chunks"].items():
                for c in table:
                    chunks.setdefault(key, []).append(dict(c))
                    files.add(c["file"])
        else:
            manifest = read_manifest(self._dir(step))
            world = int(manifest.meta.get("world_size", 1))
            for key, entry in manifest.tensors.items():
                for c in entry.chunks:
                    if c.file is not None and data_file_rank(c.file) == rank:
                        chunks.setdefault(key, []).append(c.to_json())
                        files.add(c.file)
        frozen = sorted(f for f in files if is_frozen_file(f))
        rest = sorted(f for f in files if not is_frozen_file(f))
        if len(frozen) > 1 or len(rest) > 1:
            return None
        where = os.path.join(self.local_root, step_dir(step))
        try:
            frozen_map = _map(os.path.join(where, frozen[0])) if frozen else None
            rest_map = _map(os.path.join(where, rest[0])) if rest else None
        except (OSError, ValueError) as exc:
            log.warning("ckptstore: cannot map the local files of step %d: %s", step, exc)
            return None
        frozen_end = align_up(int(frozen_map.numel())) if frozen_map is not None else 0
        for table in chunks.values():
            for doc in table:
                if not is_frozen_file(doc["file"]):
                    doc["offset"] += frozen_end
        size = frozen_end + (int(rest_map.numel()) if rest_map is not None else 0)
        data = _SlotFiles(frozen_map, rest_map, frozen_end, size)
        return Snapshot(step, rank, world, data, chunks, frozen_end)


def _check_protocol(url: str) -> None:
    """Raise UnknownProtocolError for a URL whose protocol fsspec does not know, by its name alone:
    neither building a client nor importing its implementation (s3fs's imports take a second on a
    busy core). One that is known but not installed fails at the first request, saying so."""
    import fsspec

    protocol = url.split("://", 1)[0]
    if protocol not in fsspec.available_protocols():
        raise UnknownProtocolError(f"cannot open {url!r}: fsspec knows no protocol {protocol!r}. Check the URL's "
                                   "spelling, or install the fsspec implementation that provides it")


NODE_PARTS = "node-parts"  # a step's rank parts held on a node instead of its whole manifest


def _has_node_parts(where: str) -> bool:
    d = os.path.join(where, NODE_PARTS)
    return os.path.isdir(d) and any(n.endswith(".json") and not n.startswith(".") for n in os.listdir(d))


def committed_steps(root: str | None) -> set[int]:
    """The committed steps (a manifest, or a rank's node part, present) directly under the local
    directory ``root``."""
    if root is None or not os.path.isdir(root):
        return set()
    return {step for name in os.listdir(root) if (step := parse_step_dir(name)) is not None
            and (os.path.exists(os.path.join(root, name, MANIFEST)) or _has_node_parts(os.path.join(root, name)))}


async def write_node_part(root: str, step: int, rank: int, own: dict[str, Any], *, holder: int,
                          exclusive: bool = False) -> None:
    """Commit rank ``rank``'s data file of ``step`` under ``root`` on this node (written before)
    with its part, the step's meta and its header (``own``, what its RAM document holds): the
    file appears by rename, after the data, so its presence is the commit of that part here."""
    path = os.path.join(root, step_dir(step), NODE_PARTS, f"rank-{rank:05d}.json")
    body = await asyncio.to_thread(gc_paused(_json_bytes), {"format": NODE_PART_FORMAT, "holder": holder, **own})
    await asyncio.to_thread(makedirs_private, os.path.dirname(path))
    await small.write(Target(display=path, path=path), body, exclusive=exclusive)


NODE_PART_FORMAT = "ckptstore-node-part/1"


def _node_parts(where: str, tier: str) -> list[NodePart]:
    out: list[NodePart] = []
    d = os.path.join(where, NODE_PARTS)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        path = os.path.join(d, name)
        if not name.endswith(".json") or name.startswith(".") or os.path.islink(path):
            continue
        try:
            if os.path.getsize(path) > max_manifest_bytes():
                raise ValueError("over the manifest size cap")
            with open(path, "rb") as fh:
                doc = json.loads(fh.read())
            part, meta, header = doc["part"], doc["meta"], doc.get("header")
            if (doc.get("format") != NODE_PART_FORMAT or not isinstance(part, dict) or type(part.get("rank")) is not int
                    or name != f"rank-{part['rank']:05d}.json" or not isinstance(part.get("chunks"), dict)
                    or not isinstance(meta, dict) or type(meta.get("world_size")) is not int
                    or not (header is None or isinstance(header, dict))):
                raise ValueError("not a node part of this format")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ckptstore: ignoring the %s part %s: %s", tier, path, exc)
            continue
        out.append(NodePart(part["rank"], part, meta, header, path))
    return out


def directory_holdings(root: str | None, step: int, tier: str) -> Holdings:
    """The data files and manifest of ``step`` in the local directory ``root``, when committed."""
    held = Holdings()
    if root is None:
        return held
    where = os.path.join(root, step_dir(step))
    manifest = os.path.join(where, MANIFEST)
    body = _listing_manifest(manifest)
    if body is not None and _V2_START.match(body):
        try:
            verify_checksum_member(body, manifest)
        except CheckpointError as exc:
            # The commit point of the step in this directory is damaged: nothing of it is used.
            log.warning("ckptstore: ignoring a damaged copy of a manifest: %s", exc)
            held.damaged.append(manifest)
            return held
    if body is None or not _lists_chunks(body, manifest):
        # No manifest that lists every chunk (none: a multi-node job's node; or a 2.0 one, which
        # names the part files): the rank parts committed on this node, each describing its data
        # file, carrying its rank's header and meta. A restore plans each rank's load from its
        # own, and asks the other ranks only for boxes its own does not hold.
        held.parts = _node_parts(where, tier)
        for p in held.parts:
            # Every file the part names (a frozen region has a file of its own), only under data/.
            names = {c.get("file") for table in p.part["chunks"].values() if isinstance(table, list)
                     for c in table if isinstance(c, dict)} or {data_file(p.rank)}
            for rel in sorted(n for n in names if isinstance(n, str)):
                base = os.path.basename(rel)
                path = os.path.join(where, "data", base)
                if (rel == f"data/{base}" and base.endswith(".bin") and not base.startswith(".")
                        and os.path.isfile(path) and not os.path.islink(path)):
                    held.files.append(Held(rel, path, tier, _opener(path), manifest=p.where))
        return held
    data = os.path.join(where, "data")
    for name in sorted(os.listdir(data)) if os.path.isdir(data) else []:
        path = os.path.join(data, name)
        # Never a symbolic link: the writers make none, and one could point anywhere.
        if name.endswith(".bin") and not name.startswith(".") and not os.path.islink(path):
            held.files.append(Held(f"data/{name}", path, tier, _opener(path), manifest=manifest))
    held.manifests.append((body, manifest))
    return held


# How the reference writers begin a 1.x manifest (checkpoint/index.py): the local tier's copies of
# steps written before 2.0. A manifest that begins otherwise (2.0) is read through the node parts.
_V1_START = re.compile(rb'\{"format":"ckptstore","format_version":"1\.\d{1,6}"')


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


async def _readable(parse: Callable[..., Any], body: bytes, where: str) -> None:
    """Never commit what we would refuse to read: ``body`` parsed as its reader will, in a thread
    with the collector paused. On the loop, the parse of a single node's manifest at 10,000
    tensors a rank held every lane for its length, and its allocations set off full collections
    over the trainer's heap (four passes of about 0.4 s each over six saves of 2 x 10,000 DTensors,
    benchmarks/micro_save_parts.py)."""
    await asyncio.to_thread(gc_paused(parse), body, where=where)


_V2_START = re.compile(rb'\{"format":"ckptstore","format_version":"2\.\d{1,6}"')


def _lists_chunks(body: bytes, where: str) -> bool:
    """Whether the manifest ``body`` lists every chunk (1.x), by how the reference writers begin
    one; a manifest that begins otherwise is parsed to be sure (a damaged one counts as 1.x: its
    reader reports it)."""
    if _V1_START.match(body):
        return True
    if _V2_START.match(body):
        return False
    try:
        return not isinstance(parse_sharded(body, where=where), Parted)
    except CheckpointError:
        return True


def _listing_manifest(path: str) -> bytes | None:
    """The bytes of the manifest at ``path`` when it is there (never through a symbolic link) and
    within the size cap; None otherwise."""
    if not os.path.exists(path) or os.path.islink(path):
        return None
    if os.path.getsize(path) > max_manifest_bytes():
        log.warning("ckptstore: %s is over the manifest size cap; not using it", path)
        return None
    with open(path, "rb") as fh:
        return fh.read()


def _opener(path: str) -> Callable[[], Source]:
    return lambda: open_source(Target(display=path, path=path))


def _table_in(chunks: dict[str, list[dict[str, Any]]], keys: list[str], rel: str, start: int
              ) -> dict[str, list[dict[str, Any]]]:
    """The chunk table of ``keys`` as written whole to ``rel`` from byte ``start`` of the slot. The
    usual case (no frozen region, the file named as the slot's table names it) is the slot's own
    table: its chunk lists are taken as they are (the RAM tier built them from its per-structure
    template for this save, and nothing changes a committed part's chunks), instead of a new dict
    per tensor at every save."""
    if start == 0 and all(c["file"] == rel for k in keys for c in chunks[k]):
        return {k: chunks[k] for k in keys}
    return {k: [{**c, "file": rel, "offset": c["offset"] - start} for c in chunks[k]] for k in keys}


def _extent(table: dict[str, list[dict[str, Any]]]) -> int:
    return sum(c["length"] for cs in table.values() for c in cs)


def _encoder(codec: str, data: Any, c: dict[str, Any]) -> Callable[[], torch.Tensor]:
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
                    if is_temporary(f):
                        log.warning("ckptstore: removing %s, a temporary file a crashed save left", os.path.join(top, f))
                        os.unlink(os.path.join(top, f))
        else:
            for f in base.fs.find(base.fspath):
                if is_temporary(f):
                    log.warning("ckptstore: removing %s, a temporary object a crashed save left", f)
                    base.fs.rm(f)
    except FileNotFoundError:
        pass


def _map(path: str) -> torch.Tensor:
    """A file's bytes, mapped read-only (no copy; the page cache serves the reads)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable; nothing writes it
        return torch.frombuffer(m, dtype=torch.uint8)


class _SlotFiles:
    """The local files of one rank's step, addressed like the staged slot: bytes ``[0, frozen_end)``
    are the frozen file's, bytes from ``frozen_end`` on the other file's (the local tier writes each
    region as it lies in the slot). Tiers only ever ask for a range inside one region."""

    def __init__(self, frozen: torch.Tensor | None, rest: torch.Tensor | None, frozen_end: int, nbytes: int) -> None:
        self.frozen, self.rest, self.frozen_end, self.nbytes = frozen, rest, frozen_end, nbytes

    def numel(self) -> int:
        return self.nbytes

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            raise CheckpointError("the local files of a step are addressed by byte offset (dimension 0)")
        if start >= self.frozen_end:
            assert self.rest is not None
            return self.rest.narrow(0, start - self.frozen_end, length)
        assert self.frozen is not None and start + length <= self.frozen_end
        return self.frozen.narrow(0, start, length)
