"""Restoring across nodes: every rank serves the files its node holds, and fetches what it lacks.

The RAM and local tiers are per node, and a rank's load can need other ranks' data files (its
own shard was written by itself, but a replicated tensor was written once, by some rank, and a
resharded load reads from many). After a crash every file of a step usually still exists on some
node: in that node's RAM segments, its local directory, or a peer replica. So a restore runs, per
candidate step, as one collective round:

1. each rank lists what its node can serve for the step (the *inventory*: file name -> opener),
   and whether it has the step's manifest;
2. a rank with no manifest gets it from the lowest rank that has one;
3. each rank plans the chunks its state needs (the same planning a load does), asks an owner for
   each chunk of a file its node lacks, and the owners send the bytes (gloo point-to-point on the
   store's own group, in one order every rank derives from the gathered requests);
4. each rank loads, reading local files directly, fetched chunks from memory and anything nobody
   holds from the durable tier. Checksums are verified on every byte as in any load, so a corrupt
   copy is caught wherever it came from, and the next attempt excludes it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from ..checkpoint.sharded import MANIFEST, Decoder, _fill, _LoadCtx, _SavedRef
from ..collective import Group
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatVersionError
from ..format.manifest import Manifest, max_manifest_bytes, parse_manifest
from ..planning.sharding import intersect
from ..storage.targets import Source, Target, open_source
from ..tiers.ram import read_doc, usable_doc

log = logging.getLogger("ckptstore")
_SEG = re.compile(r"^ckptstore-(?P<job>.+)-r(?P<rank>\d{5})-(?:peer(?P<src>\d{5})-)?s(?P<slot>\d+)\.json$")


class Inventory:
    """What this rank's node holds of one step: data files by name, and a manifest if any."""

    def __init__(self) -> None:
        self.files: dict[str, list[tuple[str, Callable[[], Source]]]] = {}  # name -> [(where, opener)]
        self.manifest: bytes | None = None
        self.parsed: Manifest | None = None  # self.manifest, parsed once (10^5 entries take seconds)
        self.unsupported: UnsupportedFormatVersionError | None = None  # a copy only a newer reader reads

    def offer_manifest(self, body: bytes, where: str) -> None:
        """Keep the first copy of the step's manifest that validates (its own checksum included):
        a damaged copy is named and passed over, and the next copy (another tier) is used."""
        if self.manifest is not None:
            return
        try:
            parsed = parse_manifest(body, where=where)
        except UnsupportedFormatVersionError as exc:
            # Not damage: a newer writer's. If no copy is readable, upgrading is the answer.
            log.warning("ckptstore: ignoring a copy of a manifest: %s", exc)
            self.unsupported = exc
            return
        except CheckpointError as exc:
            log.warning("ckptstore: ignoring a damaged copy of a manifest: %s", exc)
            return
        self.manifest, self.parsed = body, parsed

    def add(self, name: str, where: str, opener: Callable[[], Source]) -> None:
        self.files.setdefault(name, []).append((where, opener))

    def names(self, excluded: set[str]) -> list[str]:
        return sorted(n for n, copies in self.files.items() if any(w not in excluded for w, _ in copies))

    def open(self, name: str, excluded: set[str]) -> tuple[str, Source] | None:
        for where, opener in self.files.get(name, []):
            if where not in excluded:
                return where, opener()
        return None


def node_inventory(job: str, ram_dir: str, local_root: str | None, step: int) -> Inventory:
    """RAM segments and peer replicas of ``job`` in ``ram_dir`` and the local step directory."""
    inv = Inventory()
    for m, path, doc in _job_docs(job, ram_dir):
        if doc.get("step") != step or "manifest" not in doc.get("extra", doc):
            continue
        seg = path[:-5] + ".bin"
        if not os.path.exists(seg) or os.path.islink(seg) or os.path.getsize(seg) != doc.get("size"):
            continue
        src = int(m.group("src") or m.group("rank"))
        inv.add(f"data/rank-{src:05d}.bin", seg, _opener(seg))
        manifest = doc.get("extra", doc)["manifest"]
        inv.offer_manifest(manifest.encode() if isinstance(manifest, str) else manifest, path)
    for step_dir in ([os.path.join(local_root, f"step-{step:012d}"), os.path.join(local_root, "peer", f"step-{step:012d}")]
                     if local_root is not None else []):
        if os.path.exists(os.path.join(step_dir, MANIFEST)):
            data = os.path.join(step_dir, "data")
            for name in sorted(os.listdir(data)) if os.path.isdir(data) else []:
                # Never a symbolic link: the writers make none, and one could point anywhere.
                if name.endswith(".bin") and not name.startswith(".") and not os.path.islink(os.path.join(data, name)):
                    path = os.path.join(data, name)
                    inv.add(f"data/{name}", path, _opener(path))
            manifest_path = os.path.join(step_dir, MANIFEST)
            if inv.manifest is None and not os.path.islink(manifest_path):
                if os.path.getsize(manifest_path) > max_manifest_bytes():
                    log.warning("ckptstore: %s is over the manifest size cap; not using it", manifest_path)
                    continue
                with open(manifest_path, "rb") as fh:
                    inv.offer_manifest(fh.read(), manifest_path)
    return inv


def _job_docs(job: str, ram_dir: str) -> list[tuple[re.Match[str], str, dict[str, Any]]]:
    """The readable RAM-tier manifests of ``job`` in ``ram_dir``: own slots and peer replicas."""
    try:
        names = sorted(os.listdir(ram_dir))
    except OSError:
        return []
    out = []
    for name in names:
        m = _SEG.match(name)
        if m is None or m.group("job") != job:
            continue
        path = os.path.join(ram_dir, name)
        try:
            doc = read_doc(path)
        except (OSError, CorruptCheckpointError):
            continue  # being rewritten, or damaged: not a usable copy
        if usable_doc(doc):
            out.append((m, path, doc))
    return out


def _opener(path: str) -> Callable[[], Source]:
    return lambda: open_source(Target(display=path, path=path))


def needed_chunks(state: Any, manifest: Manifest, display: str, rank: int, world: int) -> list[tuple[str, int, int]]:
    """The (file, offset, length) of every chunk a load of ``state`` will read (whole chunks).

    Runs the load's own planning walk; non-tensor leaves of ``state`` are already replaced by the
    saved values, as the load that follows does anyway.
    """
    saved = Decoder(lambda tag, node: _SavedRef(tag, node[tag]), display).decode(manifest.tree)
    ctx = _LoadCtx(manifest, plan_only=True)
    with torch.no_grad():
        _fill(state, saved, [], ctx, top=True)
    out: set[tuple[str, int, int]] = set()
    for target in ctx.targets:
        entry = manifest.tensors[target.key]
        for c in entry.chunks:
            if c.file is not None and (not c.sizes or intersect(target.box, (c.offsets, c.sizes)) is not None):
                out.add((c.file, c.offset, c.length))
    if int(manifest.meta.get("world_size", 1)) == world:
        for _wrapper, key, _path in ctx.per_rank:
            per = manifest.tensors.get(f"{key}#rank{rank:05d}")
            for c in per.chunks if per is not None else []:
                if c.file is not None:
                    out.add((c.file, c.offset, c.length))
    return sorted(out)


class FetchedSource(Source):
    """Chunks of one file received from other ranks, served from memory."""

    def __init__(self, display: str) -> None:
        self.display, self.size = display, 0
        self.ranges: list[tuple[int, torch.Tensor]] = []

    def add(self, offset: int, data: torch.Tensor) -> None:
        self.ranges.append((offset, data))
        self.size = max(self.size, offset + data.numel())

    def readinto(self, offset: int, out: memoryview) -> None:
        for start, data in self.ranges:
            if start <= offset and offset + len(out) <= start + data.numel():
                out[:] = data.numpy()[offset - start : offset - start + len(out)].tobytes()
                return
        raise CheckpointNotFoundError(f"{self.display}: bytes {offset}..{offset + len(out)} were not fetched")


def get_manifest(group: Group, inv: Inventory, where: str) -> Manifest | None:
    """The step's manifest on every rank: its own, or the lowest holder's. None when nobody has one."""
    has = group.all_gather(inv.manifest is not None) if group.world > 1 else [inv.manifest is not None]
    if not any(has):
        return None
    body = inv.manifest
    if group.world > 1 and not all(has):
        import torch.distributed as dist

        holder = has.index(True)
        box = [body if group.rank == holder else None]
        src = dist.get_global_rank(group.pg, holder) if group.pg is not None else holder
        dist.broadcast_object_list(box, src=src, group=group.pg)
        body = box[0]
    assert body is not None
    if body is inv.manifest and inv.parsed is not None:
        parsed, inv.parsed = inv.parsed, None  # handed out once: a load fills its tree in place
        return parsed
    return parse_manifest(body, where=where)


def exchange(group: Group, p2p: Group, inv: Inventory, wanted: list[tuple[str, int, int]], excluded: set[str],
             bad_owners: set[tuple[str, int]], display: str, *, attempt: int = 0,
             timeout_s: float = 60.0) -> tuple[dict[str, FetchedSource], set[tuple[str, int]]]:
    """Fetch the chunks of ``wanted`` whose file this node lacks from a rank whose node has it.

    Returns the fetched files and the (file, owner) pairs that did not arrive within ``timeout_s``
    (the caller retries with those owners excluded). Owners serve from threads of their own and
    every attempt uses its own message tag, so an owner stuck reading its disk holds up nobody:
    its late bytes land in the abandoned receive of the attempt they belong to. The bytes travel
    on ``p2p``, a group that carries nothing else: gloo's collectives number their messages with
    tags of the same space, so point-to-point messages still in flight on a collective group could
    be taken for a collective's."""
    import torch.distributed as dist

    mine = set(inv.names(excluded))
    remote = [w for w in wanted if w[0] not in mine]
    gathered = group.all_gather({"has": sorted(mine), "want": remote}) if group.world > 1 else [{"has": sorted(mine), "want": remote}]
    owners: dict[str, list[int]] = {}
    for r, g in enumerate(gathered):
        for name in g["has"]:
            owners.setdefault(name, []).append(r)
    plan: list[tuple[int, int, str, int, int]] = []  # (requester, owner, file, offset, length)
    for r, g in enumerate(gathered):
        for name, offset, length in g["want"]:
            candidates = [o for o in owners.get(name, []) if o != r]
            if r == group.rank:
                candidates = [o for o in candidates if (name, o) not in bad_owners]
            if candidates:  # else the load reads it from durable, or reports it missing
                plan.append((r, _pick(candidates, r), name, offset, length))
    plan = _agree_plan(group, plan)
    tag = attempt + 1
    fetched: dict[str, FetchedSource] = {}
    recvs: list[tuple[str, int, Any]] = []
    serve: list[tuple[int, str, int, int]] = []
    for requester, owner, name, offset, length in plan:
        if requester == group.rank:
            buf = torch.empty(length, dtype=torch.uint8)
            recvs.append((name, owner, dist.irecv(buf, group=p2p.pg, group_src=owner, tag=tag)))
            fetched.setdefault(name, FetchedSource(f"rank {owner}'s copy of {display}/{name}")).add(offset, buf)
        elif owner == group.rank:
            serve.append((requester, name, offset, length))
    if serve:
        import threading

        threading.Thread(target=_serve, args=(p2p, inv, excluded, serve, tag), daemon=True,
                         name="ckptstore-serve").start()
    # Wait in helper threads rather than wait(timeout): a gloo receive that times out closes the
    # connection to that peer, and the group with it. An abandoned receive stays posted under this
    # attempt's tag, and its thread ends when the late bytes land (or the group's timeout fires).
    slow: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout_s
    for name, owner, work in recvs:
        if work is None:
            continue
        waiter = _Waiter(work)
        if not waiter.done.wait(max(0.0, deadline - time.monotonic())):
            log.warning("ckptstore: rank %d did not send %s within %.0f s; trying another copy", owner, name, timeout_s)
            slow.add((name, owner))
        elif waiter.error is not None:
            raise waiter.error
    for name, _owner in slow:
        fetched.pop(name, None)
    return fetched, slow


class _Waiter:
    def __init__(self, work: Any) -> None:
        import threading

        self.done = threading.Event()
        self.error: Exception | None = None
        threading.Thread(target=self._run, args=(work,), daemon=True, name="ckptstore-recv").start()

    def _run(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        self.done.set()


def _serve(group: Group, inv: Inventory, excluded: set[str], serve: list[tuple[int, str, int, int]], tag: int) -> None:
    import torch.distributed as dist

    works = []
    try:
        for requester, name, offset, length in serve:
            opened = inv.open(name, excluded)
            if opened is None:
                log.error("ckptstore: asked for %s, which this node no longer holds", name)
                return
            source = opened[1]
            try:
                data = torch.frombuffer(bytearray(source.read(offset, length)), dtype=torch.uint8) if length else (
                    torch.empty(0, dtype=torch.uint8))
            finally:
                source.close()
            works.append((data, dist.isend(data, group=group.pg, group_dst=requester, tag=tag)))
        for _data, work in works:
            if work is not None:
                work.wait()
    except Exception as exc:  # noqa: BLE001 - a requester that gave up on us is not our failure
        log.warning("ckptstore: serving restore data failed: %s", exc)


def _pick(candidates: list[int], requester: int) -> int:
    # Spread requests over owners instead of sending them all to the lowest rank.
    return candidates[requester % len(candidates)]


def _agree_plan(group: Group, plan: list[tuple[int, int, str, int, int]]) -> list[tuple[int, int, str, int, int]]:
    """Each requester's own entries are authoritative (only it knows which owners it excludes)."""
    if group.world == 1:
        return plan
    mine = [p for p in plan if p[0] == group.rank]
    return sorted(p for lst in group.all_gather(mine) for p in lst)


def node_steps(job: str, ram_dir: str, local_root: str | None) -> set[int]:
    """Every step of ``job`` this node holds anything of (RAM segments, replicas, local steps)."""
    steps: set[int] = set()
    for _m, _path, doc in _job_docs(job, ram_dir):
        if isinstance(doc.get("step"), int):
            steps.add(doc["step"])
    for root in [local_root, os.path.join(local_root, "peer")] if local_root is not None else []:
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith("step-") and name[5:].isdigit() and os.path.exists(os.path.join(root, name, MANIFEST)):
                steps.add(int(name[5:]))
    return steps
