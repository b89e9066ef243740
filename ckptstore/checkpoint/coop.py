"""Cooperative reads of a resharded load: each stored byte read from storage once across the job.

When a load's layout differs from the saved one, several ranks need bytes of one stored chunk: a
``Shard(1)`` rank needs a column slice of every saved row slab, an uneven ``Shard(0)`` rank the
rows of two neighbours' slabs, every rank the whole of a replicated tensor. Read rank by rank,
that is the whole checkpoint once per rank for ``Shard(1)`` (a column slice is not contiguous, so a
rank reads the rows whole) and once per rank for replicated tensors.

Here every rank learns the boxes every other rank loads (one all-gather, which is also the
agreement to take part), and all compute the same plan from them and the manifest: each chunk
that two or more ranks need is cut into *units* (the part of the chunk anyone needs, in bands of
rows small enough for the round budget), each unit has one *owner* among the ranks that need it
(the one needing most of it, then the one with the fewest bytes to read so far), the owner reads it
through the load's ordinary read path (checksums verified), and the slices go to the other ranks
in one ``all_to_all`` per round. Rounds are bounded so that on every rank what is read, sent and
received in one round stays within ``buffer_bytes``. Chunks only one rank needs are read by that
rank as before, after the rounds.

After each round's reads the ranks agree on the outcome (one all-reduced flag; the failures
themselves are gathered only when there is one): a unit that its owner could not read (a checksum
mismatch, a missing file) fails every rank that needed it with the owner's error (the same class,
message, location and key), so a restore moves to the next copy as it does when a rank finds the
damage itself; the ranks that needed none of it finish their load with their own reads.

Not taken when it cannot help or cannot run: a single rank, a process group whose backend carries
no CPU tensors (NCCL alone), or a load in which no chunk is needed by two ranks (reads already
disjoint). A rank that fails before reading (its state does not match the checkpoint) abstains, so
every rank reads as before and none waits in the exchange.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective import Group
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..format.dtypes import dtype_from_name, element_size
from ..format.manifest import Manifest
from ..planning.sharding import Box, intersect, volume

# Slices are packed back to back in a round's send buffer and viewed as their dtype on arrival: an
# offset divisible by every element size keeps such a view legal.
_ALIGN = 16


@dataclass
class ReadTarget:
    """A box of tensor ``key`` to fill into ``local`` (whose shape is the box's sizes)."""

    key: str
    path: list[Any]
    local: torch.Tensor
    box: Box


@dataclass(frozen=True)
class Unit:
    """A part of one stored chunk that its owner reads for several ranks: ``needers`` are
    (rank, index of the rank's target, the box of it inside this unit)."""

    key: str
    chunk: int
    box: Box
    owner: int
    needers: tuple[tuple[int, int, Box], ...]
    nbytes: int


@dataclass
class Plan:
    rounds: list[list[Unit]]
    shared: set[tuple[str, int]]  # (key, chunk index) of every chunk read by units
    read_bytes: list[int]  # bytes each rank reads as an owner
    peak_bytes: list[int]  # the most any round holds on each rank (read + sent + received)
    stats: dict[str, Any] = field(default_factory=dict)


Needs = list[tuple[str, Box]]


def _backend_carries_cpu(group: Group) -> bool:
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group.pg))
    except (RuntimeError, ValueError):
        return False
    return "gloo" in backend or backend == "threaded"


def usable(group: Group) -> bool:
    """Whether a load on ``group`` reads cooperatively (decided alike on every rank, without talking)."""
    return group.world > 1 and _backend_carries_cpu(group)


def abstain(group: Group) -> None:
    """This rank does not load (it failed before reading): meet the others' first collective, so
    that they read on their own instead of waiting for it."""
    if usable(group):
        group.all_gather(None)


def _bounding(boxes: list[Box]) -> Box:
    ndim = len(boxes[0][0])
    lo = tuple(min(b[0][d] for b in boxes) for d in range(ndim))
    hi = tuple(max(b[0][d] + b[1][d] for b in boxes) for d in range(ndim))
    return lo, tuple(h - low for low, h in zip(lo, hi))


def plan(manifest: Manifest, needs: list[Needs], buffer_bytes: int, where: str = "", *,
         share_whole: bool = True) -> Plan:
    """The same plan on every rank: units, owners and rounds, from every rank's target boxes.
    Without ``share_whole``, a chunk that every rank needing it needs whole is read by each of them
    (see :func:`read`)."""
    world = len(needs)
    by_key: dict[str, list[tuple[int, int, Box]]] = {}
    for r, mine in enumerate(needs):
        for i, (key, box) in enumerate(mine):
            by_key.setdefault(key, []).append((r, i, box))
    units: list[tuple[str, int, Box, list[tuple[int, int, Box]], int]] = []
    shared: set[tuple[str, int]] = set()
    for key in sorted(by_key):
        entry = manifest.tensors.get(key)
        if entry is None:
            continue
        es = element_size(dtype_from_name(entry.dtype, where=where))
        holders = by_key[key]
        for ci, c in enumerate(entry.chunks):
            cbox = (tuple(c.offsets), tuple(c.sizes))
            over = [(r, i, ov) for r, i, b in holders if (ov := intersect(b, cbox)) is not None]
            if len({r for r, _i, _ov in over}) < 2:
                continue
            if not share_whole and all((tuple(ov[0]), tuple(ov[1])) == cbox for _r, _i, ov in over):
                continue
            shared.add((key, ci))
            bbox = _bounding([ov for _r, _i, ov in over])
            if c.codec != "raw" or not c.sizes or bbox[1][0] <= 1:
                units.append((key, ci, bbox, over, volume(bbox) * es))
                continue
            # Bands of rows, so that a round of the largest unit (read once, and every needer's
            # slice packed to be sent) fits the budget; band edges fall on the chunk's checksum
            # blocks where a band spans several, so no block is read twice.
            row = es * math.prod(bbox[1][1:])
            sent = sum(es * math.prod(ov[1][1:]) for _r, _i, ov in over)
            rows = max(1, buffer_bytes // max(1, row + sent))
            chunk_row = es * math.prod(c.sizes[1:])
            if c.block_size and chunk_row:
                per_block = c.block_size // math.gcd(c.block_size, chunk_row)
                if rows >= per_block:
                    rows -= rows % per_block
            first, end = bbox[0][0], bbox[0][0] + bbox[1][0]
            start = first - (first - c.offsets[0]) % rows  # bands counted from the chunk's first row
            for lo in range(start, end, rows):
                band = ((max(lo, first),) + bbox[0][1:], (min(lo + rows, end) - max(lo, first),) + bbox[1][1:])
                sub = [(r, i, ov) for r, i, b in over if (ov := intersect(b, band)) is not None]
                if sub:
                    units.append((key, ci, band, sub, volume(band) * es))
    load = [0] * world
    planned: list[Unit] = []
    for key, ci, box, over, nbytes in units:
        need: dict[int, int] = {}
        for r, _i, ov in over:
            need[r] = need.get(r, 0) + volume(ov)
        owner = min(need, key=lambda r: (-need[r], load[r], r))
        load[owner] += nbytes
        planned.append(Unit(key, ci, box, owner, tuple(over), nbytes))
    rounds: list[list[Unit]] = []
    peak = [0] * world
    cost = [0] * world
    current: list[Unit] = []
    for u in planned:
        es = u.nbytes // max(1, volume(u.box))
        add: dict[int, int] = {u.owner: u.nbytes}
        for r, _i, ov in u.needers:
            if r != u.owner:
                n = _padded(volume(ov) * es)
                add[u.owner] += n
                add[r] = add.get(r, 0) + n
        if current and any(cost[r] + n > buffer_bytes for r, n in add.items()):
            rounds.append(current)
            peak = [max(p, c) for p, c in zip(peak, cost)]
            current, cost = [], [0] * world
        current.append(u)
        for r, n in add.items():
            cost[r] += n
    if current:
        rounds.append(current)
        peak = [max(p, c) for p, c in zip(peak, cost)]
    return Plan(rounds, shared, load, peak, {"units": len(planned), "rounds": len(rounds)})


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _region(t: torch.Tensor, box: Box, inner: Box) -> torch.Tensor:
    """The part of ``t`` (holding ``box``) that holds ``inner``."""
    for d in range(len(inner[0])):
        t = t.narrow(d, inner[0][d] - box[0][d], inner[1][d])
    return t


def _describe(exc: BaseException) -> dict[str, Any]:
    kind = ("corrupt" if isinstance(exc, CorruptCheckpointError) else "missing" if isinstance(exc, CheckpointNotFoundError)
            else "storage" if isinstance(exc, OSError) else "other")
    return {"kind": kind, "message": str(exc), "location": getattr(exc, "location", None),
            "key": getattr(exc, "key", None), "errno": getattr(exc, "errno", None)}


def _relayed(record: dict[str, Any], owner: int) -> CheckpointError:
    """The owner's failure, as every rank that needed its bytes raises it."""
    message = record["message"]
    if record["kind"] == "corrupt":
        return CorruptCheckpointError(message, location=record["location"], key=record["key"])
    if record["kind"] == "missing":
        return CheckpointNotFoundError(message)
    if record["kind"] == "storage":
        return StorageError(message, errno=record["errno"])
    return CheckpointError(f"rank {owner} failed reading bytes this rank needs: {message}")


def _failed_units(round_units: list[Unit], owner: int, record: dict[str, Any], manifest: Manifest) -> list[Unit]:
    """The units of ``owner`` the failure concerns: those of its tensor and file when it names
    them, else every unit it was to read in the round."""
    mine = [u for u in round_units if u.owner == owner]
    key, location = record.get("key"), record.get("location") or ""
    named = [u for u in mine if u.key == key and (manifest.tensors[u.key].chunks[u.chunk].file or "") in location]
    return named or mine


def read(group: Group, manifest: Manifest, targets: list[ReadTarget], buffer_bytes: int,
         read_direct: Callable[[list[ReadTarget]], None], where: str = "", *, share_whole: bool = True) -> Plan | None:
    """Fill ``targets`` (this rank's boxes) cooperatively; ``read_direct`` is the load's own read
    path (verified reads of the given boxes). Collective: every rank of ``group`` calls this or
    :func:`abstain`. Returns the plan, or None where each rank read on its own.

    ``share_whole=False`` (alike on every rank) leaves out chunks that every rank needing them needs
    whole, a replicated tensor or the same layout as saved: a store's restore from node tiers, where
    each node holds its own copy (or fetched it already) and reading it is a memory copy, which an
    exchange over the process group only slows down."""
    mine: Needs = [(t.key, (tuple(t.box[0]), tuple(t.box[1]))) for t in targets]
    answers = group.all_gather((manifest.planned, mine))
    if any(n is None for n in answers):
        read_direct(targets)  # a rank abstained: nobody exchanges
        return None
    # Every rank computes the plan from its own chunk table: the tables must agree on every chunk
    # a plan can share. Whole manifests do; so do tables planned from an index where each rank's
    # sharded chunks are its own part's (no other rank's box reaches into them, so no such chunk is
    # ever shared). A mix (some rank read other writers' parts: a resharded load from an index)
    # would give ranks different plans: each then reads its own boxes.
    kinds = {kind for kind, _needs in answers}
    if kinds not in ({""}, {"own"}):
        read_direct(targets)
        return None
    gathered = [needs for _kind, needs in answers]
    the_plan = plan(manifest, gathered, buffer_bytes, where, share_whole=share_whole)
    if not the_plan.rounds:
        read_direct(targets)  # reads are disjoint already
        return None
    me = group.rank
    for units in the_plan.rounds:
        failure = _round(group, manifest, units, targets, read_direct)
        if failure is not None:
            owner_errors, local = failure
            if local is not None:
                raise local
            for owner, record in sorted(owner_errors.items()):
                hit = _failed_units(units, owner, record, manifest)
                if any(r == me for u in hit for r, _i, _ov in u.needers):
                    raise _relayed(record, owner)
            # Nothing this rank needs was lost: it reads all of its boxes itself (an error path;
            # the rounds stop on every rank).
            read_direct(targets)
            return the_plan
    _read_solo(manifest, targets, the_plan.shared, read_direct)
    return the_plan


def _round(group: Group, manifest: Manifest, units: list[Unit], targets: list[ReadTarget],
           read_direct: Callable[[list[ReadTarget]], None]) -> tuple[dict[int, dict[str, Any]], BaseException | None] | None:
    """One round: read what this rank owns, agree that every read succeeded, exchange the slices.
    Returns None on success, else (failure of each failing owner, this rank's own error)."""
    me, world = group.rank, group.world
    owned = [u for u in units if u.owner == me]
    bufs: dict[int, torch.Tensor] = {}
    for n, u in enumerate(units):
        if u.owner == me:
            dtype = dtype_from_name(manifest.tensors[u.key].dtype, where=u.key)
            bufs[n] = torch.empty(u.box[1], dtype=dtype)
    local: BaseException | None = None
    try:
        if owned:
            read_direct([ReadTarget(u.key, [], bufs[n], u.box) for n, u in enumerate(units) if u.owner == me])
    except Exception as exc:  # noqa: BLE001 - every rank learns it below; none may be left waiting
        local = exc
    if group.max_int64([0 if local is None else 1])[0]:
        records = group.all_gather(None if local is None else _describe(local))
        return {r: rec for r, rec in enumerate(records) if rec is not None}, local
    send_sizes, recv_sizes = [0] * world, [0] * world
    for u in units:
        es = u.nbytes // max(1, volume(u.box))
        for r, _i, ov in u.needers:
            n = _padded(volume(ov) * es)
            if u.owner == me and r != me:
                send_sizes[r] += n
            elif r == me and u.owner != me:
                recv_sizes[u.owner] += n
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    pos = [sum(send_sizes[:r]) for r in range(world)]
    for n, u in enumerate(units):
        if u.owner != me:
            continue
        for r, i, ov in u.needers:
            part = _region(bufs[n], u.box, ov)
            if r == me:
                _region(targets[i].local, targets[i].box, ov).copy_(part)
                continue
            nb = part.numel() * part.element_size()
            send[pos[r]:pos[r] + nb].view(part.dtype).view(part.shape).copy_(part)
            pos[r] += _padded(nb)
    bufs.clear()
    group.all_to_all(recv, send, recv_sizes, send_sizes)  # every rank, even one with nothing to move
    at = [sum(recv_sizes[:r]) for r in range(world)]
    for u in units:
        if u.owner == me:
            continue
        for r, i, ov in u.needers:
            if r != me:
                continue
            t = targets[i]
            nb = volume(ov) * t.local.element_size()
            src = recv[at[u.owner]:at[u.owner] + nb].view(t.local.dtype).view(ov[1])
            _region(t.local, t.box, ov).copy_(src)
            at[u.owner] += _padded(nb)
    return None


def _read_solo(manifest: Manifest, targets: list[ReadTarget], shared: set[tuple[str, int]],
               read_direct: Callable[[list[ReadTarget]], None]) -> None:
    """Read what no unit brought: a target that touches no shared chunk whole (the ordinary path),
    else its part in each chunk only this rank needs."""
    todo: list[ReadTarget] = []
    for t in targets:
        chunks = manifest.tensors[t.key].chunks
        overlaps = [(ci, ov) for ci, c in enumerate(chunks)
                    if (ov := intersect(t.box, (tuple(c.offsets), tuple(c.sizes)))) is not None]
        if not any((t.key, ci) in shared for ci, _ov in overlaps):
            todo.append(t)
            continue
        for ci, ov in overlaps:
            if (t.key, ci) not in shared:
                todo.append(ReadTarget(t.key, t.path, _region(t.local, t.box, ov), ov))
    if todo:
        read_direct(todo)
