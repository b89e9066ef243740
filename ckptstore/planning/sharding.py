"""Pure sharding arithmetic: which box of a global tensor a rank holds, who writes each saved box,
and which saved chunks a rank must read to fill the box it holds now.

Boxes are ``(offsets, sizes)`` tuples in global element coordinates. Nothing here touches a file,
a process group or a tensor's data, so layouts of any size are planned and tested in memory.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, ...], tuple[int, ...]]
# A placement per mesh dimension: ("shard", tensor_dim), ("strided", tensor_dim, split_factor) or
# ("replicate",) (partial sums are refused before planning: a checkpoint holds reduced values).
Placement = tuple
# Along one tensor dimension, the global index runs a rank holds, in the order of its local tensor:
# (global start, length) each.
Runs = list[tuple[int, int]]


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk semantics, as DTensor's Shard uses them: ceil-sized pieces, the last ones short or empty."""
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, min(start + step, size) - start


def shard_box(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int]
) -> Box:
    """The box of ``global_shape`` held by the rank at ``coordinate`` of a device mesh.

    Mesh dimensions apply in order: a tensor dimension sharded on mesh dims 0 and 1 is first cut
    across mesh dim 0, then each piece is cut again across mesh dim 1 (DTensor's convention).
    """
    if any(p[0] == "strided" for p in placements):
        boxes = shard_boxes(global_shape, mesh_shape, placements, coordinate)
        if len(boxes) != 1:
            raise ValueError("this layout gives the rank several boxes; use shard_boxes")
        return boxes[0][1]
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if placement[0] == "shard":
            d = placement[1]
            start, length = chunk_range(sizes[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
            offsets[d] += start
            sizes[d] = length
        elif placement[0] != "replicate":
            raise ValueError(f"unsupported placement {placement!r}")
    return tuple(offsets), tuple(sizes)


def _take(runs: Runs, start: int, length: int) -> Runs:
    """Local positions [start, start + length) of a dimension held as ``runs``."""
    out: Runs = []
    pos = 0
    for g, n in runs:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if hi > lo:
            out.append((g + lo - pos, hi - lo))
        pos += n
    if not out:  # an empty piece still has a place: the end of what precedes it
        pos, anchor = 0, runs[0][0] if runs else 0
        for g, n in runs:
            if pos + n <= start:
                anchor = g + n
            pos += n
        out.append((anchor, 0))
    return out


def _merge_runs(runs: Runs) -> Runs:
    out: Runs = []
    for g, n in runs:
        if out and out[-1][0] + out[-1][1] == g and n:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n or not out:
            out.append((g, n))
    return out


def dim_runs(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int]
) -> list[Runs]:
    """Per tensor dimension, the global index runs the rank at ``coordinate`` holds, in local order.

    Placements apply left to right, each to what the ones before it left (DTensor's convention).
    ``("strided", d, sf)`` is torch's ``_StridedShard``: the piece held so far is first cut into
    ``sf`` parts (the cuts a later placement will make, as if sharding ran right to left, as FSDP2
    over TP does), each part is cut across this mesh dim, and the rank holds its cut of every part,
    concatenated. That can leave a rank several separate runs along one dimension.
    """
    runs: list[Runs] = [[(0, n)] for n in global_shape]
    for mesh_dim, placement in enumerate(placements):
        kind = placement[0]
        if kind == "replicate":
            continue
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        d = placement[1]
        total = sum(length for _, length in runs[d])
        if kind == "shard":
            start, length = chunk_range(total, n, c)
            runs[d] = _take(runs[d], start, length)
        elif kind == "strided":
            split = placement[2]
            picked: Runs = []
            for j in range(split):
                p_start, p_len = chunk_range(total, split, j)
                s, length = chunk_range(p_len, n, c)
                if length:
                    picked.extend(_take(runs[d], p_start + s, length))
            runs[d] = picked or _take(runs[d], total, 0)
        else:
            raise ValueError(f"unsupported placement {placement!r}")
        runs[d] = _merge_runs(runs[d])
    return runs


def shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int]
) -> list[tuple[Box, Box]]:
    """Every box of ``global_shape`` the rank at ``coordinate`` holds, as (box within the rank's
    local tensor, box of the global tensor) pairs: one pair unless a strided placement leaves
    several separate runs along some dimension (then the product of the runs of every dimension)."""
    per_dim = dim_runs(global_shape, mesh_shape, placements, coordinate)
    if all(len(r) == 1 for r in per_dim):
        return [(((0,) * len(per_dim), tuple(r[0][1] for r in per_dim)), (tuple(r[0][0] for r in per_dim),
                                                                          tuple(r[0][1] for r in per_dim)))]
    locals_: list[list[tuple[int, int, int]]] = []
    for r in per_dim:
        pos, spans = 0, []
        for g, n in r:
            spans.append((pos, g, n))
            pos += n
        locals_.append(spans)
    out = []
    for combo in itertools.product(*locals_):
        out.append(
            ((tuple(c[0] for c in combo), tuple(c[2] for c in combo)), (tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
        )
    return out


def intersect(a: Box, b: Box) -> Box | None:
    offsets, sizes = [], []
    for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(oa, ob), min(oa + sa, ob + sb)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def volume(box: Box) -> int:
    return math.prod(box[1])


@dataclass(frozen=True)
class ItemMeta:
    """One box of one tensor that a rank holds and could write."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int


def assign_writers(items_by_rank: Sequence[Sequence[ItemMeta]]) -> list[list[ItemMeta]]:
    """Decide which rank writes each distinct box, given every rank's boxes: every box exactly once,
    and replicated boxes (held by several ranks) spread so that the bytes each rank writes stay
    balanced. Deterministic.

    This needs every rank's box list, which costs O(ranks x tensors) to gather; save_sharded instead
    decides locally with :func:`spread` (over a box's replicas, or the ranks of one structure). This global version is the
    reference the tests hold the local rule to, and an offline tool for re-planning a layout.
    """
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    first: dict[tuple[str, tuple[int, ...], tuple[int, ...]], ItemMeta] = {}
    for rank, items in enumerate(items_by_rank):
        for item in items:
            k = (item.key, item.offsets, item.sizes)
            ranks = holders.get(k)
            if ranks is None:
                holders[k] = [rank]
                first[k] = item
            else:
                ranks.append(rank)
    load = [0] * len(items_by_rank)
    plan: list[list[ItemMeta]] = [[] for _ in items_by_rank]
    shared = []
    for k, ranks in holders.items():
        if len(ranks) == 1:
            item = first[k]
            plan[ranks[0]].append(item)
            load[ranks[0]] += item.nbytes
        else:
            shared.append(k)
    # Largest first onto the least-loaded holder: the classic greedy bound for balanced bins.
    shared.sort(key=lambda k: (-first[k].nbytes, k))
    for k in shared:
        item = first[k]
        rank = min(holders[k], key=lambda r: (load[r], r))
        plan[rank].append(item)
        load[rank] += item.nbytes
    return plan


def replica_writer(key: str, offsets: Sequence[int], replicas: int) -> int:
    """Which of ``replicas`` identical copies of a box writes it: a stable hash of the box, so every
    holder reaches the same answer without any communication. save_sharded used it for DTensor boxes
    replicated over some mesh dimensions; with few tensors a hash can put every box on one replica, so
    replicas now :func:`spread` the list they all hold. Kept for the tests of the earlier rule."""
    return zlib.crc32(f"{key}|{','.join(map(str, offsets))}".encode()) % replicas


def spread(items: Sequence[ItemMeta], world: int) -> list[int]:
    """Writers for boxes that every rank holds (plain tensors): largest first onto the least-loaded
    rank. Every rank holds the same list, so every rank computes the same assignment locally."""
    heap = [(0, r) for r in range(world)]
    writers = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].nbytes, items[i].key, items[i].offsets)):
        load, rank = heapq.heappop(heap)
        writers[i] = rank
        heapq.heappush(heap, (load + items[i].nbytes, rank))
    return writers


@dataclass(frozen=True)
class Read:
    """Fill ``overlap`` of the target from saved chunk number ``chunk`` (which covers ``chunk_box``)."""

    chunk: int
    chunk_box: Box
    overlap: Box


def read_plan(target: Box, chunk_boxes: Sequence[Box]) -> tuple[list[Read], int]:
    """Saved chunks that overlap ``target``, and how many target elements they leave uncovered
    (non-zero means the checkpoint cannot fill the target)."""
    reads = []
    covered = 0
    for i, box in enumerate(chunk_boxes):
        o = intersect(target, box)
        if o is not None:
            reads.append(Read(i, box, o))
            covered += volume(o)
    return reads, volume(target) - covered if all(target[1]) else 0


def row_span(chunk_box: Box, overlap: Box) -> tuple[int, int]:
    """The rows (dim-0 indices, local to the chunk) of a C-ordered chunk that contain ``overlap``:
    the one contiguous byte range a reader needs."""
    if not chunk_box[0]:
        return 0, 1
    start = overlap[0][0] - chunk_box[0][0]
    return start, overlap[1][0]
