"""Restoring across nodes: every rank serves the files its node holds, and fetches what it lacks.

The RAM and local tiers are per node, and a rank's load can need other ranks' data files (its
own shard was written by itself, but a replicated tensor was written once, by some rank, and a
resharded load reads from many). After a crash every file of a step usually still exists on some
node: in that node's RAM segments, its local directory, or a peer replica. So a restore runs, per
candidate step, as one collective round:

1. each rank asks its node-local tiers what its node holds of the step (the *inventory*: file
   name -> copies, each with its tier and an opener), and whether it has the step's manifest;
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
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..collective import Group
from ..errors import CheckpointError, CheckpointNotFoundError, UnsupportedFormatVersionError
from ..format.manifest import Manifest, parse_manifest
from ..storage.targets import Source
from ..tiers.base import Held, Tier

log = logging.getLogger("ckptstore")


class Inventory:
    """What this rank's node holds of one step: data files by name, and a manifest if any."""

    def __init__(self) -> None:
        self.files: dict[str, list[Held]] = {}
        self.manifest: bytes | None = None
        self.parsed: Manifest | None = None  # self.manifest, parsed once (10^5 entries take seconds)
        self.unsupported: UnsupportedFormatVersionError | None = None  # a copy only a newer reader reads

    @classmethod
    def of(cls, tiers: Sequence[Tier], step: int) -> Inventory:
        """What the node-local ``tiers`` hold of ``step`` on this node, in the order given (the first
        readable manifest copy is kept, and files are opened in that order of preference)."""
        inv = cls()
        for tier in tiers:
            held = tier.holdings(step)
            for copy in held.files:
                inv.files.setdefault(copy.file, []).append(copy)
            for body, where in held.manifests:
                inv.offer_manifest(body, where)
        return inv

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

    def names(self, excluded: set[str]) -> list[str]:
        return sorted(n for n, copies in self.files.items() if any(c.where not in excluded for c in copies))

    def open(self, name: str, excluded: set[str]) -> tuple[Held, Source] | None:
        for copy in self.files.get(name, []):
            if copy.where not in excluded:
                return copy, copy.open()
        return None


class FetchedSource(Source):
    """Chunks of one file received from rank ``owner``, served from memory."""

    def __init__(self, owner: int, display: str) -> None:
        self.owner, self.display, self.size = owner, display, 0
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
        dist.broadcast_object_list(box, src=group.global_rank(holder), group=group.pg)
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
            assert p2p.pg is not None  # a plan names other ranks only in a group
            recvs.append((name, owner, p2p.pg.recv([buf], owner, tag)))
            fetched.setdefault(name, FetchedSource(owner, f"rank {owner}'s copy of {display}/{name}")).add(offset, buf)
        elif owner == group.rank:
            serve.append((requester, name, offset, length))
    if serve:
        _start(threading.Thread(target=_serve, args=(p2p, inv, excluded, serve, tag), daemon=True,
                                name="ckptstore-serve"))
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


# Transfer threads that may outlive the restore that started them (a send still draining, a
# receive abandoned for a slow peer): each is inside a point-to-point operation on the store's
# transfer group until it ends, so the store waits for them before it releases its groups.
_transfers: set[threading.Thread] = set()
_transfers_lock = threading.Lock()


def _start(thread: threading.Thread) -> None:
    with _transfers_lock:
        _transfers.difference_update([t for t in _transfers if not t.is_alive()])
        _transfers.add(thread)
    thread.start()


def transfers_ended(timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for every transfer thread to end; whether they all did."""
    deadline = time.monotonic() + timeout_s
    with _transfers_lock:
        threads = list(_transfers)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


class _Waiter:
    def __init__(self, work: Any) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None
        _start(threading.Thread(target=self._run, args=(work,), daemon=True, name="ckptstore-recv"))

    def _run(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        self.done.set()


def _serve(group: Group, inv: Inventory, excluded: set[str], serve: list[tuple[int, str, int, int]], tag: int) -> None:
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
            assert group.pg is not None
            works.append((data, group.pg.send([data], requester, tag)))
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
