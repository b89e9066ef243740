"""Cooperative reads of a resharded load: each stored byte read from storage once across the job.

When a load's layout differs from the saved one, several ranks need bytes of one stored chunk: a
``Shard(1)`` rank needs a column slice of every saved row slab, an uneven ``Shard(0)`` rank the
rows of two neighbours' slabs, every rank the whole of a replicated tensor. Read rank by rank,
that is the whole checkpoint once per rank for ``Shard(1)`` (a column slice is not contiguous, so a
rank reads the rows whole) and once per rank for replicated tensors.

No rank learns what every other rank loads: what a rank receives grows with what it loads, not
with the world. Each tensor has a *coordinator* (a hash of its key over the ranks), and the plan
is made in four exchanges, each an ``all_to_all`` of sizes and bytes (:meth:`Group.send_bytes`), so
a rank receives only what is addressed to it:

1. every rank sends the boxes it loads of each tensor to the tensor's coordinator;
2. the coordinator cuts each chunk that two or more ranks need into *units* (the part of the chunk
   anyone needs, in bands of rows small enough for the budget), gives each unit one *owner* among
   the ranks that need it (the one needing most of it, then the one it gave the fewest bytes to
   read so far, then a rotation by the key's hash, so that small tensors do not all go to one
   rank), and tells each owner its units with every rank that needs a part, and each other rank
   which owner brings what it needs;
3. each rank tells the owners it receives from how many owners it receives from;
4. each owner puts its units into rounds (below) and tells each rank the round of each unit it
   brings it.

Then, round by round, the owners read their units through the load's ordinary read path
(checksums verified) and the slices travel in one ``all_to_all`` per round; all ranks follow one
order of units (key, chunk, band), so what a rank sends another in a round is what that rank
expects. Rounds are bounded without a global view: in each round an owner reads and sends at most
half of ``buffer_bytes``, and sends a rank that receives from ``k`` owners at most half of
``buffer_bytes`` over ``k``, so that what any rank reads, sends and receives in one round stays
within ``buffer_bytes`` (a single band larger than its share is sent alone). Chunks only one rank
needs are read by that rank as before, after the rounds.

After each round's reads the ranks agree on the outcome (one all-reduced flag, which also says
whether any rank has rounds left): a unit that its owner could not read (a checksum mismatch, a
missing file) fails every rank that needed it with the owner's error (the same class, message,
location and key), sent only to those ranks, so a restore moves to the next copy as it does when a
rank finds the damage itself; the ranks that needed none of it finish their load with their own
reads. Nothing exchanged is pickled: boxes and failures travel as JSON.

Not taken when it cannot help or cannot run: a single rank, a process group whose backend carries
no CPU tensors (NCCL alone), or a mix of whole manifests and tables planned from an index (the
coordinator cuts units from its own table). A rank that fails before reading (its state does not
match the checkpoint) abstains, so every rank reads as before and none waits in the exchange.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..collective import Group
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..format.dtypes import dtype_from_name, element_size
from ..format.manifest import Chunk, Manifest, TensorEntry
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
    (rank, index of the rank's target, the box of it inside this unit): every rank that needs a
    part, on the owner and in a whole plan; on another rank, that rank's own entries alone."""

    key: str
    chunk: int  # the chunk's index in the table of the rank holding this Unit (-1: not in it)
    box: Box
    owner: int
    needers: tuple[tuple[int, int, Box], ...]
    nbytes: int
    origin: tuple[int, ...] = ()  # the chunk's offsets
    # The unit's place in the one order every rank follows: (its coordinator, its number there).
    order: tuple[int, int] = (0, 0)


@dataclass
class Plan:
    """A whole plan (:func:`plan`), or one rank's part of it (:func:`read`): there ``rounds`` holds
    the units the rank reads or receives, and ``read_bytes`` and ``peak_bytes`` are zero but for
    the rank's own entry."""

    rounds: list[list[Unit]]
    shared: set[tuple[str, int]]  # (key, chunk index) of every chunk read by units
    read_bytes: list[int]  # bytes each rank reads as an owner
    peak_bytes: list[int]  # the most any round holds on each rank (read + sent + received)
    stats: dict[str, Any] = field(default_factory=dict)


Needs = list[tuple[str, Box]]


@dataclass
class Spread(Manifest):
    """A rank's table for a resharded load planned from an index (checkpoint/index.py), whose
    chunks of sharded tensors travel instead of being read by every rank that needs them: this
    rank read the part files assigned to it (``routed``: their chunks as stored, by entry key), and
    in the cooperative read sends them to each tensor's coordinator, which sends each rank that
    loads a box of the tensor the chunks overlapping its boxes (``adopt`` puts them in the table
    and checks they cover the boxes). ``sharded``: the keys whose chunks travel (the others' are
    in the table); ``parse``: stored chunks of a key as Chunk objects, validated; ``complete``:
    this rank reads its tensors' writers' parts itself instead (where no exchange runs)."""

    routed: dict[str, list[Any]] = field(default_factory=dict, repr=False, compare=False)
    sharded: set[str] = field(default_factory=set, repr=False, compare=False)
    parse: Callable[[str, list[Any]], list[Chunk]] | None = field(default=None, repr=False, compare=False)
    adopt: Callable[[dict[str, Any], list[tuple[str, Box]]], None] | None = field(default=None, repr=False,
                                                                                 compare=False)
    complete: Callable[[], None] | None = field(default=None, repr=False, compare=False)


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



# The first collective of a load, on a rank that reads and on one that abstains alike: (abstains,
# holds a whole manifest, holds a table planned from its own part, holds another kind of table,
# holds a Spread table whose chunks travel through the coordinators).
def _opening(abstains: bool, planned: str = "") -> list[int]:
    return [int(abstains), int(not abstains and planned == ""), int(not abstains and planned == "own"),
            int(not abstains and planned not in ("", "own", "spread")), int(not abstains and planned == "spread")]


def abstain(group: Group) -> None:
    """This rank does not load (it failed before reading): meet the others' first collective, so
    that they read on their own instead of waiting for it."""
    if usable(group):
        group.max_int64(_opening(True))


def coordinator(key: str, world: int) -> int:
    """The rank that plans the units of tensor ``key`` (the same on every rank, without talking)."""
    return zlib.crc32(key.encode()) % world


def _bounding(boxes: list[Box]) -> Box:
    ndim = len(boxes[0][0])
    lo = tuple(min(b[0][d] for b in boxes) for d in range(ndim))
    hi = tuple(max(b[0][d] + b[1][d] for b in boxes) for d in range(ndim))
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _meeting(boxes: list[Box], chunks: list[Box]) -> list[list[int]]:
    """For each chunk, the indices (ascending) of the boxes whose first dimension overlaps its
    own, and maybe a few more (a box that reaches past the start of an earlier chunk): one sweep
    over both sorted by their first row, where testing each chunk against each box would cost a
    coordinator ranks x ranks tests per tensor, 16 million at 4,096 ranks for a layout change in
    which each chunk meets one or two loaders' boxes."""
    out: list[list[int]] = [[] for _ in chunks]
    by_start = sorted(range(len(boxes)), key=lambda j: boxes[j][0][0])
    ending: list[tuple[int, int]] = []  # (end, box) of the boxes started before some chunk ended
    alive: set[int] = set()
    taken = 0
    for ci in sorted(range(len(chunks)), key=lambda c: chunks[c][0][0]):
        lo, hi = chunks[ci][0][0], chunks[ci][0][0] + chunks[ci][1][0]
        while taken < len(by_start) and boxes[by_start[taken]][0][0] < hi:
            j = by_start[taken]
            heapq.heappush(ending, (boxes[j][0][0] + boxes[j][1][0], j))
            alive.add(j)
            taken += 1
        while ending and ending[0][0] <= lo:  # ended before this chunk, so before every later one
            alive.discard(heapq.heappop(ending)[1])
        out[ci] = sorted(alive)
    return out


def units(manifest: Manifest, holders_by_key: dict[str, list[tuple[int, int, Box]]], world: int,
          buffer_bytes: int, where: str = "", *, share_whole: bool = True, me: int = 0) -> list[Unit]:
    """The units and owners of the chunks that two or more ranks need, of the tensors in
    ``holders_by_key`` (key -> (rank, target index, box) of every rank loading a box of it): what
    coordinator ``me`` decides for its tensors. Without ``share_whole``, a chunk that every rank
    needing it needs whole is read by each of them (see :func:`read`)."""
    half = max(1, buffer_bytes // 2)
    load: dict[int, int] = {}
    out: list[Unit] = []
    for key in sorted(holders_by_key):
        entry = manifest.tensors.get(key)
        if entry is None:
            continue
        es = element_size(dtype_from_name(entry.dtype, where=where))
        holders = holders_by_key[key]
        turn = zlib.crc32(key.encode())
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        near = (_meeting([b for _r, _i, b in holders], boxes) if holders and boxes and holders[0][2][0] and boxes[0][0]
                else [range(len(holders))] * len(boxes))
        for ci, c in enumerate(entry.chunks):
            cbox = boxes[ci]
            over = [(r, i, ov) for r, i, b in (holders[j] for j in near[ci]) if (ov := intersect(b, cbox)) is not None]
            if len({r for r, _i, _ov in over}) < 2:
                continue
            if not share_whole and all((tuple(ov[0]), tuple(ov[1])) == cbox for _r, _i, ov in over):
                continue
            bbox = _bounding([ov for _r, _i, ov in over])
            cut: list[tuple[Box, list[tuple[int, int, Box]]]] = []
            if c.codec != "raw" or not c.sizes or bbox[1][0] <= 1:
                cut.append((bbox, over))
            else:
                # Bands of rows, so that a unit (read once, and every needer's slice packed to be
                # sent) fits an owner's half of the budget; band edges fall on the chunk's checksum
                # blocks where a band spans several, so no block is read twice.
                row = es * math.prod(bbox[1][1:])
                sent = sum(es * math.prod(ov[1][1:]) for _r, _i, ov in over)
                rows = max(1, half // max(1, row + sent))
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
                        cut.append((band, sub))
            for box, sub in cut:
                need: dict[int, int] = {}
                for r, _i, ov in sub:
                    need[r] = need.get(r, 0) + volume(ov)
                # The coordinator sees only its own tensors' units: the rotation spreads the ties of
                # tensors planned by different coordinators over the ranks instead of onto the lowest.
                owner = min(need, key=lambda r: (-need[r], load.get(r, 0), (r - turn) % world))
                nbytes = volume(box) * es
                load[owner] = load.get(owner, 0) + nbytes
                out.append(Unit(key, ci, box, owner, tuple(sub), nbytes, cbox[0], (me, len(out))))
    return out


def _slices(u: Unit, me: int) -> dict[int, int]:
    """The bytes owner ``me`` sends each other rank for unit ``u`` (padded, as packed)."""
    es = u.nbytes // max(1, volume(u.box))
    out: dict[int, int] = {}
    for r, _i, ov in u.needers:
        if r != me:
            out[r] = out.get(r, 0) + _padded(volume(ov) * es)
    return out


def schedule(owned: list[Unit], me: int, caps: dict[int, int], buffer_bytes: int) -> list[int]:
    """The round of each of owner ``me``'s units (in the common order): a round reads and sends at
    most half of ``buffer_bytes``, and sends rank ``r`` at most ``caps[r]``, except that a round
    takes its first unit whatever its size."""
    half = max(1, buffer_bytes // 2)
    out: list[int] = []
    t, cost = 0, 0
    per: dict[int, int] = {}
    for u in owned:
        add = _slices(u, me)
        own = u.nbytes + sum(add.values())
        if out and (cost + own > half or any(per.get(r, 0) + n > caps.get(r, half) for r, n in add.items())):
            t, cost, per = t + 1, 0, {}
        out.append(t)
        cost += own
        for r, n in add.items():
            per[r] = per.get(r, 0) + n
    return out


def caps_of(owners_of: dict[int, int], buffer_bytes: int) -> dict[int, int]:
    """What one owner may send rank ``r`` in a round, from the number of owners ``r`` receives from."""
    half = max(1, buffer_bytes // 2)
    return {r: max(1, half // max(1, k)) for r, k in owners_of.items()}


def plan(manifest: Manifest, needs: list[Needs], buffer_bytes: int, where: str = "", *,
         share_whole: bool = True) -> Plan:
    """The plan of all ranks at once, from every rank's target boxes, as :func:`read` makes it
    across the ranks (each coordinator the units of its tensors, each owner its rounds): for tests
    and planning benchmarks, where one process plays every rank."""
    world = len(needs)
    by_coordinator: list[dict[str, list[tuple[int, int, Box]]]] = [{} for _ in range(world)]
    for r, mine in enumerate(needs):
        for i, (key, box) in enumerate(mine):
            by_coordinator[coordinator(key, world)].setdefault(key, []).append((r, i, box))
    planned = [u for c, held in enumerate(by_coordinator)
               for u in units(manifest, held, world, buffer_bytes, where, share_whole=share_whole, me=c)]
    owners: dict[int, set[int]] = {}
    for u in planned:
        for r, _i, _ov in u.needers:
            if r != u.owner:
                owners.setdefault(r, set()).add(u.owner)
    caps = caps_of({r: len(o) for r, o in owners.items()}, buffer_bytes)
    by_owner: dict[int, list[Unit]] = {}
    for u in planned:
        by_owner.setdefault(u.owner, []).append(u)
    when: dict[int, int] = {}
    for o, owned in by_owner.items():
        for u, t in zip(owned, schedule(owned, o, caps, buffer_bytes)):
            when[id(u)] = t
    rounds: list[list[Unit]] = [[] for _ in range(max(when.values(), default=-1) + 1)]
    read_bytes = [0] * world
    cost: dict[tuple[int, int], int] = {}
    for u in planned:
        t = when[id(u)]
        rounds[t].append(u)
        read_bytes[u.owner] += u.nbytes
        add = _slices(u, u.owner)
        cost[(t, u.owner)] = cost.get((t, u.owner), 0) + u.nbytes + sum(add.values())
        for r, n in add.items():
            cost[(t, r)] = cost.get((t, r), 0) + n
    peak = [0] * world
    for (_t, r), n in cost.items():
        peak[r] = max(peak[r], n)
    shared = {(u.key, u.chunk) for u in planned}
    return Plan(rounds, shared, read_bytes, peak, {"units": len(planned), "rounds": len(rounds)})


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
    errno = getattr(exc, "errno", None)
    location, key = getattr(exc, "location", None), getattr(exc, "key", None)
    return {"kind": kind, "message": str(exc), "location": location if isinstance(location, str) else None,
            "key": key if isinstance(key, str) else None, "errno": errno if isinstance(errno, int) else None}


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
    named = [u for u in mine if u.key == key and u.chunk >= 0
             and (manifest.tensors[u.key].chunks[u.chunk].file or "") in location]
    return named or mine


def _box(lo: Any, sizes: Any) -> Box:
    return tuple(int(v) for v in lo), tuple(int(v) for v in sizes)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def read(group: Group, manifest: Manifest, targets: list[ReadTarget], buffer_bytes: int,
         read_direct: Callable[..., None], where: str = "", *, share_whole: bool = True) -> Plan | None:
    """Fill ``targets`` (this rank's boxes) cooperatively; ``read_direct(targets, staging=None)`` is
    the load's own read path (verified reads of the given boxes; ``staging(nbytes)``, when given,
    hands out the memory it stages in). Collective: every rank of ``group`` calls this or
    :func:`abstain`. Returns this rank's part of the plan, or None where each rank read on its own.

    ``share_whole=False`` (alike on every rank) leaves out chunks that every rank needing them needs
    whole, a replicated tensor or the same layout as saved: a store's restore from node tiers, where
    each node holds its own copy (or fetched it already) and reading it is a memory copy, which an
    exchange over the process group only slows down."""
    me, world = group.rank, group.world
    spread = manifest if isinstance(manifest, Spread) and manifest.planned == "spread" else None
    opening = group.max_int64(_opening(False, manifest.planned))
    # A coordinator cuts units from its own table: the tables must agree on every chunk a unit can
    # come from. Whole manifests do; so do tables planned from an index where each rank's sharded
    # chunks are its own part's (no other rank's box reaches into them, so no such chunk is ever
    # shared), and Spread tables, whose coordinators get every chunk of their tensors from the
    # ranks that read the part files. A mix, or tables of the writers' parts, read each rank's
    # boxes on its own (a Spread rank first reads its tensors' writers' parts itself).
    if (opening[0] or opening[3] or (opening[1] and opening[2])
            or (opening[4] and (opening[1] or opening[2] or not spread))):
        if spread is not None and spread.complete is not None:
            spread.complete()
        read_direct(targets)
        return None

    # 1. The boxes this rank loads, to each tensor's coordinator (with a Spread table, also the
    # chunks of the part files this rank read, each to its tensor's coordinator).
    asks: dict[int, dict[str, list[Any]]] = {}
    for i, target in enumerate(targets):
        asks.setdefault(coordinator(target.key, world), {}).setdefault(target.key, []).append(
            [i, list(target.box[0]), list(target.box[1])])
    if spread is None:
        got = group.send_bytes({c: _json(v) for c, v in asks.items()})
    else:
        routed: dict[int, dict[str, list[Any]]] = {}
        for key, raws in spread.routed.items():
            routed.setdefault(coordinator(key, world), {})[key] = raws
        spread.routed = {}
        got = group.send_bytes({c: _json([asks.get(c, {}), routed.get(c, {})]) for c in set(asks) | set(routed)})
        routed.clear()

    # 2. Units of this rank's tensors, to their owners and needers.
    holders: dict[str, list[tuple[int, int, Box]]] = {}
    stored: dict[str, list[Any]] = {}  # Spread: the chunks of this rank's tensors, as stored
    for r in sorted(got):
        doc = json.loads(got[r])
        if spread is not None:
            doc, theirs = doc
            for key, raws in theirs.items():
                stored.setdefault(key, []).extend(raws)
        for key, entries in doc.items():
            holders.setdefault(key, []).extend((r, int(i), _box(lo, sz)) for i, lo, sz in entries)
    table = manifest
    tell: dict[int, list[Any]] = {}
    if spread is not None:
        table = _coordinated(spread, holders, stored, tell, where)
        stored.clear()
    try:
        planned = units(table, holders, world, buffer_bytes, where, share_whole=share_whole, me=me)
    except CheckpointError:
        # The table names a dtype it cannot read: nothing is shared of these tensors (each needer
        # reads its own boxes, and meets the error there itself).
        planned = []
    # The owner learns the whole unit; another rank its own entries, the owner and the chunk (the
    # tensor is its target's, and the bytes its target's element size).
    for u in planned:
        everyone = [[r, i, list(ov[0]), list(ov[1])] for r, i, ov in u.needers]
        tell.setdefault(u.owner, []).append([u.order[1], u.key, list(u.origin), list(u.box[0]), list(u.box[1]),
                                             everyone])
        for r in dict.fromkeys(r for r, _i, _ov in u.needers if r != u.owner):
            tell.setdefault(r, []).append([u.order[1], u.owner, list(u.origin),
                                           [e[1:] for e in everyone if e[0] == r]])
    got = group.send_bytes({r: _json(v) for r, v in tell.items()})
    index: dict[str, dict[tuple[int, ...], int]] = {}

    def chunk_of(key: str, origin: Any) -> tuple[int, tuple[int, ...]]:
        chunks = index.get(key)
        if chunks is None:
            entry = manifest.tensors.get(key)
            chunks = index[key] = {tuple(c.offsets): ci for ci, c in enumerate(entry.chunks)} if entry else {}
        at = tuple(int(v) for v in origin)
        return chunks.get(at, -1), at

    local: BaseException | None = None
    records = {c: json.loads(got[c]) for c in sorted(got)}
    if spread is not None:
        # The chunks of this rank's boxes of sharded tensors, from their coordinators, into its table.
        found = {record[0]: record[1:] for c in records for record in records[c] if len(record) == 3}
        try:
            if spread.adopt is not None:
                spread.adopt(found, [(t.key, t.box) for t in targets])
        except Exception as exc:  # noqa: BLE001 - every rank learns it in the first round; none may be left waiting
            local = exc
    mine: list[Unit] = []
    for c in records:
        for record in records[c]:
            if len(record) == 3:
                continue
            if len(record) == 6:  # a unit this rank owns
                n, key, origin, lo, sz, entries = record
                box = _box(lo, sz)
                es = element_size(dtype_from_name(manifest.tensors[key].dtype, where=where))
                ci, at = chunk_of(key, origin)
                mine.append(Unit(key, ci, box, me, tuple((int(r), int(i), _box(olo, osz)) for r, i, olo, osz in entries),
                                 volume(box) * es, at, (c, int(n))))
            else:
                n, owner, origin, entries = record
                needs = tuple((me, int(i), _box(olo, osz)) for i, olo, osz in entries)
                key = targets[needs[0][1]].key
                box = _bounding([ov for _r, _i, ov in needs])
                ci, at = chunk_of(key, origin)
                mine.append(Unit(key, ci, box, int(owner), needs, volume(box) * targets[needs[0][1]].local.element_size(),
                                 at, (c, int(n))))
    mine.sort(key=lambda u: u.order)
    owned = [u for u in mine if u.owner == me]
    incoming = [u for u in mine if u.owner != me]

    # 3. How many owners this rank receives from, to each of them: each keeps its share of the budget.
    senders = sorted({u.owner for u in incoming})
    got = group.send_bytes({o: _json(len(senders)) for o in senders})
    caps = caps_of({r: int(json.loads(v)) for r, v in got.items()}, buffer_bytes)

    # 4. The round of each unit, from its owner to the ranks it brings bytes to.
    rounds_owned = schedule(owned, me, caps, buffer_bytes)
    told: dict[int, list[int]] = {}
    for u, t in zip(owned, rounds_owned):
        for r in dict.fromkeys(r for r, _i, _ov in u.needers if r != me):
            told.setdefault(r, []).append(t)
    got = group.send_bytes({r: _json(v) for r, v in told.items()})
    rounds_in: list[int] = []
    from_owner = {o: [int(t) for t in json.loads(v)] for o, v in got.items()}
    # Grouped in one pass: a rank of a Shard(0) -> Shard(1) load receives a unit of every tensor
    # from every other rank, so a pass over its units per sender would be O(ranks^2 x tensors).
    by_owner: dict[int, list[Unit]] = {o: [] for o in senders}
    for u in incoming:
        by_owner[u.owner].append(u)
    for o in senders:
        theirs = by_owner[o]
        when = from_owner.get(o, [])
        if len(when) != len(theirs):
            if local is None:
                local = CheckpointError(f"{where}: rank {o} scheduled {len(when)} units for this rank, which "
                                        f"expects {len(theirs)} (ranks planned from different tables)")
            when = [0] * len(theirs)
        rounds_in.extend(when)
    incoming = [u for o in senders for u in by_owner[o]]
    the_plan = _local_plan(me, world, owned, rounds_owned, incoming, rounds_in)

    last = max(rounds_owned + rounds_in, default=-1)
    arena = _Arena()
    t = 0
    while True:
        now = [u for u, r in zip(owned, rounds_owned) if r == t]
        bufs: dict[int, torch.Tensor] = {}
        arena.reset()
        if local is None and now:
            try:
                for n, u in enumerate(now):
                    bufs[n] = arena.take(u.box[1], dtype_from_name(manifest.tensors[u.key].dtype, where=u.key))
                # The reads stage in the same buffer, behind the units; the sends and receives
                # reuse that room once they are done.
                mark = arena.mark()
                read_direct([ReadTarget(u.key, [], bufs[n], u.box) for n, u in enumerate(now)],
                            staging=lambda nbytes: arena.take((nbytes,), torch.uint8))
                arena.rewind(mark)
            except Exception as exc:  # noqa: BLE001 - every rank learns it below; none may be left waiting
                local = exc
        failed, active = group.max_int64([int(local is not None), int(t <= last)])
        if failed:
            bufs.clear()
            arena.release()
            _fail(group, manifest, now, local)
            read_direct(targets)  # nothing this rank needs was lost: it reads all of its boxes itself
            return the_plan
        if not active:
            break
        _exchange(group, [(u, bufs[n]) for n, u in enumerate(now)],
                  [u for u, r in zip(incoming, rounds_in) if r == t], targets, arena)
        bufs.clear()
        t += 1
    arena.release()
    _read_solo(manifest, targets, the_plan.shared, read_direct)
    return the_plan


def _coordinated(spread: Spread, holders: dict[str, list[tuple[int, int, Box]]], stored: dict[str, list[Any]],
                 tell: dict[int, list[Any]], where: str) -> Manifest:
    """A coordinator's table of its tensors, from the chunks the part files' readers sent it (the
    sharded ones) and its own table (the others'); and, added to ``tell``, to each rank loading
    boxes of a sharded tensor, ``[key, chunks as stored that overlap its boxes, None]``, or
    ``[key, None, error]`` where the chunks do not parse (every such rank raises it)."""
    tensors: dict[str, TensorEntry] = {}
    for key in sorted(holders):
        entry = spread.tensors.get(key)
        if entry is None:
            continue
        if key not in spread.sharded:
            tensors[key] = entry
            continue
        raws = stored.get(key, [])
        needers = sorted({r for r, _i, _b in holders[key]})
        try:
            assert spread.parse is not None
            chunks = spread.parse(key, raws)
        except CheckpointError as exc:
            for r in needers:
                tell.setdefault(r, []).append([key, None, str(exc)])
            continue
        order = sorted(range(len(chunks)), key=lambda j: chunks[j].offsets)
        chunks, raws = [chunks[j] for j in order], [raws[j] for j in order]
        tensors[key] = TensorEntry(entry.dtype, entry.shape, chunks)
        rows = [r for r, _i, _b in holders[key]]
        sent: dict[int, set[int]] = {r: set() for r in needers}
        for j, h in zip(*_overlaps(chunks, [b for _r, _i, b in holders[key]], len(entry.shape))):
            sent[rows[h]].add(j)
        for r in needers:
            tell.setdefault(r, []).append([key, [raws[j] for j in sorted(sent[r])], None])
    return Manifest(kind="sharded", tensors=tensors, tree=None, meta=spread.meta)


def _overlaps(chunks: list[Chunk], boxes: list[Box], ndim: int) -> tuple[list[int], list[int]]:
    """The (chunk, box) index pairs that overlap, for all pairs at once (numpy: a coordinator
    tests every chunk of a tensor against every box loaded of it)."""
    if not chunks or not boxes:
        return [], []
    clo = np.asarray([c.offsets for c in chunks], dtype=np.int64).reshape(len(chunks), ndim)
    chi = clo + np.asarray([c.sizes for c in chunks], dtype=np.int64).reshape(len(chunks), ndim)
    blo = np.asarray([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    bhi = blo + np.asarray([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    hit = np.ones((len(chunks), len(boxes)), dtype=bool)
    for d in range(ndim):
        hit &= (np.minimum(chi[:, d:d + 1], bhi[None, :, d]) > np.maximum(clo[:, d:d + 1], blo[None, :, d]))
    js, hs = np.nonzero(hit)
    return js.tolist(), hs.tolist()


def _local_plan(me: int, world: int, owned: list[Unit], rounds_owned: list[int], incoming: list[Unit],
                rounds_in: list[int]) -> Plan:
    """This rank's part of the plan: its units by round, what it reads, and its fullest round."""
    count = max(rounds_owned + rounds_in, default=-1) + 1
    rounds: list[list[Unit]] = [[] for _ in range(count)]
    cost = [0] * count
    for u, t in zip(owned, rounds_owned):
        rounds[t].append(u)
        cost[t] += u.nbytes + sum(_slices(u, me).values())
    for u, t in zip(incoming, rounds_in):
        rounds[t].append(u)
        es = u.nbytes // max(1, volume(u.box))
        cost[t] += sum(_padded(volume(ov) * es) for r, _i, ov in u.needers if r == me)
    for units_t in rounds:
        units_t.sort(key=lambda u: u.order)
    read_bytes, peak = [0] * world, [0] * world
    read_bytes[me] = sum(u.nbytes for u in owned)
    peak[me] = max(cost, default=0)
    shared = {(u.key, u.chunk) for u in owned + incoming if u.chunk >= 0}
    return Plan(rounds, shared, read_bytes, peak, {"units": len(owned) + len(incoming), "rounds": count})


def _fail(group: Group, manifest: Manifest, now: list[Unit], local: BaseException | None) -> None:
    """A round failed somewhere: each owner that failed tells the ranks that needed its lost units
    (only those), and raises its own error; a rank told raises the owner's error; others return."""
    me = group.rank
    messages: dict[int, bytes] = {}
    if local is not None:
        record = _describe(local)
        hit = {r for u in _failed_units(now, me, record, manifest) for r, _i, _ov in u.needers if r != me}
        messages = {r: _json(record) for r in hit}
    got = group.send_bytes(messages)
    if local is not None:
        raise local
    for owner in sorted(got):
        raise _relayed(json.loads(got[owner]), owner)


class _Arena:
    """One buffer a load's rounds carve their reads, sends and receives from, grown to the fullest
    round: fresh tensors per round would come from the C heap once glibc's mmap threshold has risen
    to their size, and stay resident after the load (2-3x ``buffer_bytes`` measured; docs/benchmarks.md,
    "Peak memory per rank of a resharded load through the exchange")."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._at = 0
        self._need = 0
        self._fresh = True

    def reset(self) -> None:
        """The previous round's views are no longer used: the next take starts from the front, in a
        buffer grown to the fullest round so far (grown then, so a round that takes nothing
        allocates nothing)."""
        self._at = 0
        self._fresh = True

    def release(self) -> None:
        """Done with the rounds: what the load reads afterwards stages in memory of its own."""
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._need = 0
        self.reset()

    def mark(self) -> int:
        return self._at

    def rewind(self, mark: int) -> None:
        """Give back what was taken since ``mark`` (its views are no longer used)."""
        self._at = mark

    def take(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        if self._fresh:
            self._fresh = False
            if self._need > self._buf.numel():
                self._buf = torch.empty(0, dtype=torch.uint8)  # freed before its successor is made
                self._buf = torch.empty(self._need, dtype=torch.uint8)
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:
            return torch.empty(tuple(shape), dtype=dtype)
        start = _padded(self._at)
        self._at = start + nbytes
        self._need = max(self._need, self._at)
        if self._at > self._buf.numel():  # this round outgrew the buffer: on its own this time
            return torch.empty(tuple(shape), dtype=dtype)
        return self._buf[start:start + nbytes].view(dtype).view(tuple(shape))


def _exchange(group: Group, read: list[tuple[Unit, torch.Tensor]], incoming: list[Unit],
              targets: list[ReadTarget], arena: _Arena) -> None:
    """One round's slices: each owner's read units to the ranks needing them (its own part copied
    in place), packed for each rank in the common order of units, in one all_to_all; the send and
    receive buffers come from the round's ``arena``."""
    me, world = group.rank, group.world
    send_sizes, recv_sizes = [0] * world, [0] * world
    for u, _buf in read:
        for r, n in _slices(u, me).items():
            send_sizes[r] += n
    for u in incoming:
        es = u.nbytes // max(1, volume(u.box))
        recv_sizes[u.owner] += sum(_padded(volume(ov) * es) for _r, _i, ov in u.needers)
    send = arena.take((sum(send_sizes),), torch.uint8)
    recv = arena.take((sum(recv_sizes),), torch.uint8)
    pos = [0, *itertools.accumulate(send_sizes)][:world]  # O(ranks), not a sum per rank
    for u, buf in read:
        for r, i, ov in u.needers:
            part = _region(buf, u.box, ov)
            if r == me:
                _region(targets[i].local, targets[i].box, ov).copy_(part)
                continue
            nb = part.numel() * part.element_size()
            send[pos[r]:pos[r] + nb].view(part.dtype).view(part.shape).copy_(part)
            pos[r] += _padded(nb)
    read.clear()
    group.all_to_all(recv, send, recv_sizes, send_sizes)  # every rank, even one with nothing to move
    at = [0, *itertools.accumulate(recv_sizes)][:world]
    for u in incoming:
        for _r, i, ov in u.needers:
            t = targets[i]
            nb = volume(ov) * t.local.element_size()
            src = recv[at[u.owner]:at[u.owner] + nb].view(t.local.dtype).view(ov[1])
            _region(t.local, t.box, ov).copy_(src)
            at[u.owner] += _padded(nb)


def _read_solo(manifest: Manifest, targets: list[ReadTarget], shared: set[tuple[str, int]],
               read_direct: Callable[..., None]) -> None:
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
