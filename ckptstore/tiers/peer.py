"""The peer tier: replicas of each rank's snapshot in the RAM (and optionally on the disk) of ranks
on other nodes, so that a restart after a node loss restores without the durable tier.

``put`` is collective over the store's peer group: every rank sends its staged bytes to the ranks
that hold its replicas (``send_to``) and receives the snapshots of the ranks it holds replicas of
(``hold_for``), each into a shared-memory segment of its own. Sizes go first, so a holder needs no
other knowledge of what arrives. ``commit`` then makes each received replica visible with the
step's manifest (the same manifest as the RAM tier's: a replica is the source's slot, byte for
byte), and with ``local_root`` keeps it under ``<local>/peer/step-<012d>/`` too, so it survives a
reboot of the holder.

The bytes are not hashed again on receipt: the manifest carries the checksums computed from the
staged copy, and every restore verifies every byte it reads against them and moves on to the next
copy on a mismatch. A second pass here would cost the training node's CPU on every step for a
check that reading does anyway (on the 2-core VM it took replication from 1.04x to 0.77x a raw
gloo exchange).

Transfers use the process group object's own ``send``/``recv`` with group ranks, so any gloo
group works, including one created in-process for tests. A peer that does not answer within the
group's timeout fails ``put`` with the transport's error.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from .._aio import run_sync
from ..checkpoint.single_file import write_raw
from ..collective import Group
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import Manifest, parse_manifest
from ..names import MANIFEST, PEER_DIR, data_file, data_file_rank, replica_segment, step_dir
from ..storage import small
from ..storage.targets import Source, Target, makedirs_private, open_sink, open_source
from .base import Capabilities, Holdings, Snapshot, Tier, manifest_of_parts
from .directory import committed_steps, directory_holdings, write_node_part
from .ram import (
    RAM_FORMAT,
    RAM_MINOR,
    Slot,
    extra_checksum,
    lower_record,
    owner_record,
    read_doc,
    remove_file,
    scan,
    segment_holdings,
    write_doc,
)

_SIZE_TAG, _DATA_TAG, _DOC_TAG = 1, 2, 3


class PeerTier(Tier):
    """Replicas of other ranks' snapshots held by rank ``rank`` (see the module docstring).

    ``group``: the gloo group replicas travel on (None, or a group of one: nothing to send).
    ``local_root``: this node's local directory, whose ``peer/`` holds replicas on disk: kept there
    too with ``to_local``, and listed by restores in any case (an earlier run may have kept some).
    ``keep``: how many steps of replicas ``<local>/peer`` keeps."""

    capabilities = Capabilities(node_local=True, collective=True)

    def __init__(self, job: str, rank: int = 0, *, ram_dir: str = "/dev/shm", group: Group | None = None,
                 send_to: list[int] | None = None, hold_for: list[int] | None = None, local_root: str | None = None,
                 to_local: bool = False, keep: int | None = None, durable: str | None = None) -> None:
        self.name = "peer"
        # Recorded in each replica's document, as the RAM tier does (``ckptstore ram``): a replica's
        # step also exists on this node's disk with ``to_local``, or in the durable tier.
        self.lower = lower_record(local_root if to_local else None, durable)
        self.job, self.rank, self.ram_dir = job, rank, ram_dir
        self.group, self.local_root, self.to_local, self.keep = group, local_root, to_local and local_root is not None, keep
        self.send_to, self.hold_for = list(send_to or []), list(hold_for or [])
        self._segments: dict[tuple[int, int], Slot] = {}  # (source rank, slot) -> segment
        # step -> (src, slot, size, bytes, what the source's RAM document holds of the step or None)
        self._received: dict[int, list[tuple[int, int, int, torch.Tensor, dict[str, Any] | None]]] = {}
        # What this rank's RAM document of the step being replicated holds (its part, the step's
        # meta, its header), sent with its bytes; None when the step's whole manifest describes
        # the replicas (the save gathered every part).
        self.outgoing: dict[str, Any] | None = None

    def _name(self, src: int, slot: int, ext: str, holder: int | None = None) -> str:
        return os.path.join(self.ram_dir, replica_segment(self.job, self.rank if holder is None else holder, src, slot, ext))

    # ------------------------------------------------------------------------------ writing

    async def put(self, snap: Snapshot) -> dict[str, Any]:
        return await asyncio.to_thread(self._exchange, snap)

    def _exchange(self, snap: Snapshot) -> dict[str, Any]:
        t0 = time.perf_counter()
        pg = self.group.pg if self.group is not None else None
        received: list[tuple[int, int, int, torch.Tensor, dict[str, Any] | None]] = []
        if pg is not None and (self.send_to or self.hold_for):
            own = b"" if self.outgoing is None else json.dumps(self.outgoing, separators=(",", ":")).encode()
            mine = torch.tensor([snap.nbytes, len(own)], dtype=torch.int64)
            sizes = {src: torch.zeros(2, dtype=torch.int64) for src in self.hold_for}
            _wait([pg.recv([sizes[src]], src, _SIZE_TAG) for src in self.hold_for]
                  + [pg.send([mine], dst, _SIZE_TAG) for dst in self.send_to])
            works = []
            docs: list[torch.Tensor | None] = []
            for src in self.hold_for:
                size, doc_size = (int(v) for v in sizes[src].tolist())
                slot, buf = self.replica_buffer(src, size)
                works.append(pg.recv([buf], src, _DATA_TAG))
                doc = torch.empty(doc_size, dtype=torch.uint8) if doc_size else None
                if doc is not None:
                    works.append(pg.recv([doc], src, _DOC_TAG))
                docs.append(doc)
                received.append((src, slot, size, buf, None))
            works += [pg.send([snap.data], dst, _DATA_TAG) for dst in self.send_to]
            if own:
                sent = torch.frombuffer(bytearray(own), dtype=torch.uint8)
                works += [pg.send([sent], dst, _DOC_TAG) for dst in self.send_to]
            _wait(works)
            received = [(src, slot, size, buf, None if doc is None else json.loads(doc.numpy().tobytes()))
                        for (src, slot, size, buf, _), doc in zip(received, docs)]
        self._received = {s: r for s, r in self._received.items() if s > snap.step - 4}
        self._received[snap.step] = received
        return {"rank": snap.rank, "world_size": snap.world, "host": socket.gethostname(), "pid": os.getpid(),
                "bytes": snap.nbytes, "written_bytes": 0, "chunks": snap.chunks,
                "timings": {**snap.meta.get("timings", {}), "replicate_s": round(time.perf_counter() - t0, 6)}}

    def replica_buffer(self, src: int, size: int) -> tuple[int, torch.Tensor]:
        """A segment to receive rank ``src``'s next snapshot into: of two, the one not holding the
        newest committed replica, so a transfer cut short (or never committed) never costs the last
        good copy. Decided from the committed documents at every call, not by taking turns."""
        held = []
        for k in (0, 1):
            try:
                step = read_doc(self._name(src, k, "json")).get("step", -1)
            except (OSError, CorruptCheckpointError):
                step = -1
            held.append((step if type(step) is int else -1, k))
        slot = min(held)[1]
        remove_file(self._name(src, slot, "json"))
        seg = self._segments.get((src, slot))
        if seg is None or seg.size != size:
            if seg is not None:
                seg.release()
            seg = self._segments[(src, slot)] = Slot(self._name(src, slot, "bin"), size)
        return slot, seg.buffer.narrow(0, 0, size)

    async def commit(self, step: int, manifest: Manifest | None) -> None:
        """Make the replicas of ``step`` received visible: described by the step's whole
        ``manifest``, or (None) each by what its source's RAM document holds, received with it."""
        body = manifest.to_json_bytes() if manifest is not None else None
        for src, slot, size, buf, own in self._received.pop(step, []):
            if body is None and own is None:
                raise CorruptCheckpointError(f"{self.display(step)}: rank {src} sent its snapshot without its part")
            await self._publish(src, slot, step, size, body, own)
            if self.to_local:
                await asyncio.to_thread(self._to_disk, step, src, buf)
                if body is not None:
                    await small.write(self._disk_target(step, MANIFEST), body)
                else:
                    await write_node_part(os.path.join(self.local_root or "", PEER_DIR), step, src, own or {},
                                          holder=self.rank)
        if self.to_local and self.keep is not None:
            await asyncio.to_thread(self._retain_disk)

    def commit_replica(self, src: int, slot: int, step: int, size: int, manifest: bytes) -> None:
        """Make a replica received into ``slot`` outside a store visible to restores."""
        run_sync(self._publish(src, slot, step, size, manifest))

    async def _publish(self, src: int, slot: int, step: int, size: int, manifest: bytes | None,
                       own: dict[str, Any] | None = None) -> None:
        """Make a received replica visible to restores (by rename, after the bytes)."""
        doc = {"format": RAM_FORMAT, "job": self.job, "rank": self.rank, "src": src, "step": step, "slot": slot,
               "size": size, "committed_unix": round(time.time(), 3), "owner": owner_record(), "lower": self.lower,
               "extra": {"manifest": manifest.decode()} if manifest is not None else own}
        if manifest is None:
            doc["minor"] = RAM_MINOR
            doc["extra_checksum"] = extra_checksum(own or {})
        await write_doc(self._name(src, slot, "json"), doc)

    def _disk_target(self, step: int, rel: str) -> Target:
        assert self.local_root is not None
        path = os.path.join(self.local_root, PEER_DIR, step_dir(step), rel)
        return Target(display=path, path=path)

    def _to_disk(self, step: int, src: int, buf: torch.Tensor) -> None:
        target = self._disk_target(step, data_file(src))
        assert target.path is not None
        makedirs_private(os.path.dirname(target.path))
        sink = open_sink(target)
        try:
            write_raw(sink, [lambda: buf], hash_bytes=False)
            sink.commit(b"")
        except BaseException:
            sink.abort()
            raise

    def _retain_disk(self) -> None:
        assert self.local_root is not None and self.keep is not None
        root = os.path.join(self.local_root, PEER_DIR)
        for old in sorted(committed_steps(root))[: -self.keep]:
            self.remove_from_disk(old)

    # ------------------------------------------------------------------------------ reading

    def replicas(self) -> list[tuple[int, dict[str, Any]]]:
        """The replicas this rank holds, committed: (source rank, its document: ``step``, ``size``, ...)."""
        return [(seg.owner, doc) for seg, _path, doc in scan(self.job, self.ram_dir)
                if seg.src is not None and seg.rank == self.rank]

    async def steps(self) -> list[int]:
        return sorted({doc["step"] for _src, doc in self.replicas()})

    async def manifest(self, step: int) -> Manifest:
        for _src, doc in self.replicas():
            if doc["step"] == step:
                if doc.get("minor", 0):
                    return manifest_of_parts(self.holdings(step).parts, self.display(step))
                return parse_manifest(doc["extra"]["manifest"].encode(), where=self.display(step))
        raise CheckpointNotFoundError(f"{self.display(step)}: no replica of this step is held here")

    def opener(self, step: int) -> Callable[[str | None], Source]:
        def open_file(rel: str | None) -> Source:
            src = data_file_rank(rel)
            if src is None:
                raise CorruptCheckpointError(f"{self.display(step)}: chunk file {rel!r} is not a replica's data file")
            for owner, doc in self.replicas():
                if owner == src and doc["step"] == step:
                    path = self._name(src, doc["slot"], "bin")
                    return open_source(Target(display=path, path=path))
            raise CheckpointNotFoundError(f"{self.display(step)}: no replica of rank {src}'s snapshot is held here")

        return open_file

    def holdings(self, step: int) -> Holdings:
        """The replicas of ``step`` that this node's ranks hold, in RAM and under ``<local>/peer``."""
        held = segment_holdings(self.job, self.ram_dir, step, replicas=True)
        if self.local_root is not None:
            disk = directory_holdings(os.path.join(self.local_root, PEER_DIR), step, self.name)
            held.files += disk.files
            held.manifests += disk.manifests
            held.parts += disk.parts
        return held

    def node_steps(self) -> set[int]:
        steps = {doc["step"] for seg, _path, doc in scan(self.job, self.ram_dir) if seg.src is not None}
        if self.local_root is not None:
            steps |= committed_steps(os.path.join(self.local_root, PEER_DIR))
        return steps

    def display(self, step: int) -> str:
        return f"peer replicas in {self.ram_dir} (job {self.job}, rank {self.rank}, step {step})"

    # ------------------------------------------------------------------------------ removing

    async def remove(self, step: int) -> None:
        for src, doc in self.replicas():
            if doc["step"] == step:
                remove_file(self._name(src, doc["slot"], "json"))

    def disk_steps(self) -> set[int]:
        """The steps of the replicas kept on this node's disk (``<local>/peer``)."""
        return committed_steps(os.path.join(self.local_root, PEER_DIR)) if self.local_root is not None else set()

    def remove_from_disk(self, step: int) -> None:
        """Remove ``step``'s replicas from this node's disk (shared by its ranks: one of them calls it)."""
        if self.local_root is not None:
            where = os.path.join(self.local_root, PEER_DIR, step_dir(step))
            remove_file(os.path.join(where, MANIFEST))  # uncommitted first: never a half-removed step that looks whole
            shutil.rmtree(where, ignore_errors=True)

    def close(self) -> None:
        for seg in self._segments.values():
            seg.release()
        self._segments.clear()


def _wait(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()

