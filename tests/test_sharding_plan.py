"""The pure sharding planner (ckptstore.planning.sharding), checked against torch's own arithmetic.

No process group, no files: DTensor's layout arithmetic is called with a stand-in mesh (it only asks
the mesh for its shape and this rank's coordinate), and torch.chunk on real tensors gives the data each
box must select. Layouts, writer assignment and read plans are then checked as properties.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard

from ckptstore.planning.sharding import (
    ItemMeta,
    assign_writers,
    chunk_range,
    intersect,
    read_plan,
    row_span,
    shard_box,
    volume,
)

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


class FakeMesh:
    """What compute_local_shape_and_global_offset reads from a DeviceMesh: its shape and this
    rank's coordinate (no process group needed)."""

    def __init__(self, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.ndim = len(shape)
        self._coordinate = list(coordinate)

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def _sym_get_coordinate(self, index: int) -> int:
        return self._coordinate[index]

    def get_coordinate(self) -> list[int]:
        return list(self._coordinate)

    def size(self, mesh_dim: int | None = None) -> int:
        return math.prod(self.shape) if mesh_dim is None else self.shape[mesh_dim]


def ck(placements) -> list[tuple]:
    """torch placement objects -> ckptstore's tuples (what checkpoint/sharded.py's _placements does)."""
    out = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(("shard", p.dim))
        elif isinstance(p, Replicate):
            out.append(("replicate",))
        else:  # pragma: no cover - the strategies only make these two
            raise AssertionError(p)
    return out


def coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def slices(box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box))


def global_tensor(shape) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)


def chunk_reference(t: torch.Tensor, mesh_shape, placements, coordinate) -> torch.Tensor:
    """The local tensor DTensor's Shard gives a rank (torch.chunk, in mesh-dim order, missing pieces empty)."""
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            pieces = torch.chunk(t, mesh_shape[mesh_dim], dim=p.dim)
            c = coordinate[mesh_dim]
            t = pieces[c] if c < len(pieces) else t.narrow(p.dim, t.shape[p.dim], 0)
    return t


def replication(mesh_shape, placements) -> int:
    return math.prod(n for n, p in zip(mesh_shape, placements) if p[0] == "replicate")


def items_for(tensors, mesh_shape) -> list[list[ItemMeta]]:
    """Every rank's ItemMeta list (in rank order = row-major mesh coordinates), as save_sharded builds it.
    ``tensors``: (key, shape, ck placements, element size)."""
    out: list[list[ItemMeta]] = []
    for c in coords(mesh_shape):
        metas = []
        for key, shape, placements, es in tensors:
            off, size = shard_box(shape, mesh_shape, placements, c)
            metas.append(ItemMeta(key, off, size, math.prod(size) * es))
        out.append(metas)
    return out


def check_written_once(items_by_rank, plan) -> None:
    """Every distinct (key, offsets, sizes) box is in the plan exactly once, on a rank holding it;
    a box held by one rank only stays with that rank."""
    assert len(plan) == len(items_by_rank)
    holders: dict[tuple, set[int]] = {}
    for r, items in enumerate(items_by_rank):
        for it in items:
            holders.setdefault((it.key, it.offsets, it.sizes), set()).add(r)
    written = Counter()
    for r, items in enumerate(plan):
        for it in items:
            k = (it.key, it.offsets, it.sizes)
            written[k] += 1
            assert k in holders, f"rank {r} writes {k}, which nobody holds"
            assert r in holders[k], f"rank {r} writes {k} but only ranks {sorted(holders[k])} hold it"
            if len(holders[k]) == 1:
                assert holders[k] == {r}
    assert set(written) == set(holders), f"never written: {sorted(set(holders) - set(written))[:5]}"
    twice = [k for k, n in written.items() if n != 1]
    assert not twice, f"written more than once: {twice[:5]}"


def loads(plan) -> list[int]:
    return [sum(it.nbytes for it in items) for items in plan]


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


@st.composite
def layouts(draw, max_ndim: int = 3, max_dim: int = 9, max_mesh_ndim: int = 3, max_world: int = 24):
    """(global shape, mesh shape, torch placements): any tensor rank (0-d included), sizes 0..max_dim,
    1-3 mesh dims, each Shard(any dim) or Replicate, several mesh dims on one tensor dim allowed."""
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.lists(st.integers(0, max_dim), min_size=ndim, max_size=ndim)))
    mesh: list[int] = []
    for _ in range(draw(st.integers(1, max_mesh_ndim))):
        mesh.append(draw(st.integers(1, max(1, max_world // math.prod(mesh)))))
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    placements = [draw(st.sampled_from(choices)) for _ in mesh]
    return shape, tuple(mesh), placements


@st.composite
def sub_boxes(draw, shape):
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        hi = draw(st.integers(lo, n))
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


# --------------------------------------------------------------------------------------------
# chunk_range / shard_box against torch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", list(range(0, 23)) + [100, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7, 8, 16, 1000])
def test_chunk_range_is_torch_chunk_and_dtensor_shard(size, parts):
    pieces = torch.chunk(torch.arange(size), parts)
    assert len(pieces) <= parts
    start_expected = 0
    for index in range(parts):
        length_expected = len(pieces[index]) if index < len(pieces) else 0
        start, length = chunk_range(size, parts, index)
        assert length == length_expected, (size, parts, index)
        if length:
            assert start == start_expected == int(pieces[index][0]), (size, parts, index)
        # DTensor's own per-dim arithmetic, empty pieces included (offset = size for trailing empties)
        assert (length, start) == tuple(Shard.local_shard_size_and_offset(size, parts, index)), (size, parts, index)
        start_expected += length
    assert start_expected == size


LAYOUTS = [
    # 1-D mesh
    ((16,), (4,), [Shard(0)]),
    ((10,), (4,), [Shard(0)]),  # uneven: 3, 3, 3, 1
    ((9,), (4,), [Shard(0)]),  # uneven: 3, 3, 3, 0
    ((5,), (4,), [Shard(0)]),  # 2, 2, 1, 0: an empty trailing shard
    ((3,), (8,), [Shard(0)]),  # more shards than elements
    ((0,), (3,), [Shard(0)]),  # empty tensor
    ((0, 4), (3,), [Shard(1)]),
    ((6, 7), (4,), [Shard(1)]),
    ((6, 7), (3,), [Replicate()]),
    ((), (4,), [Replicate()]),  # 0-d
    ((), (2, 3), [Replicate(), Replicate()]),
    ((2, 3, 5), (4,), [Shard(2)]),
    # 2-D mesh
    ((8, 6), (2, 3), [Shard(0), Shard(1)]),
    ((7, 5), (2, 3), [Shard(1), Shard(0)]),
    ((8, 6), (2, 2), [Shard(0), Replicate()]),
    ((8, 6), (2, 2), [Replicate(), Shard(1)]),
    ((2, 5), (2, 2), [Shard(1), Shard(1)]),  # the example in torch's docstring
    ((8,), (2, 8), [Shard(0), Shard(0)]),  # second cut leaves empty pieces inside the first
    ((16,), (2, 4), [Shard(0), Shard(0)]),
    ((13, 3), (3, 2), [Shard(0), Shard(0)]),
    ((7, 3), (3, 2), [Shard(0), Shard(0)]),
    ((5, 5), (4, 4), [Shard(0), Shard(1)]),
    ((1, 1), (3, 3), [Shard(0), Shard(1)]),
    # 3-D mesh
    ((12, 10, 3), (2, 2, 3), [Shard(0), Shard(1), Shard(0)]),
    ((11, 10), (2, 3, 2), [Shard(0), Replicate(), Shard(0)]),
    ((9, 4), (2, 2, 2), [Shard(0), Shard(0), Shard(0)]),
]


def _assert_agrees_with_torch(shape, mesh_shape, placements) -> None:
    g = global_tensor(shape)
    for c in coords(mesh_shape):
        box = shard_box(shape, mesh_shape, ck(placements), c)
        local_shape, global_offset = compute_local_shape_and_global_offset(shape, FakeMesh(mesh_shape, c), placements)
        assert box[1] == tuple(local_shape), (shape, mesh_shape, placements, c, box, local_shape)
        if volume(box):
            assert box[0] == tuple(global_offset), (shape, mesh_shape, placements, c, box, global_offset)
        else:
            # An empty box selects nothing; its offsets carry no data. torch reports the global dim size
            # for an empty shard, shard_box the end of the enclosing piece (they differ when a second
            # mesh dim cuts an already cut dim): only ask that the offsets stay within the tensor.
            assert all(0 <= o <= n for o, n in zip(box[0], shape)), (shape, mesh_shape, placements, c, box)
        # the data this box selects is what DTensor (torch.chunk) puts on this rank
        expected = chunk_reference(g, mesh_shape, placements, c)
        assert torch.equal(g[slices(box)], expected), (shape, mesh_shape, placements, c, box)


@pytest.mark.parametrize("shape,mesh_shape,placements", LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
def test_shard_box_agrees_with_dtensor(shape, mesh_shape, placements):
    _assert_agrees_with_torch(shape, mesh_shape, placements)


@SETTINGS
@given(layouts())
def test_shard_box_agrees_with_dtensor_random(layout):
    _assert_agrees_with_torch(*layout)


def test_fake_mesh_is_what_torch_reads():
    """Guard for the stand-in: torch's own docstring example gives the documented table with it."""
    table = {0: ((2, 2), (0, 0)), 1: ((2, 1), (0, 2)), 2: ((2, 1), (0, 3)), 3: ((2, 1), (0, 4))}
    for rank, c in enumerate(coords((2, 2))):
        got = compute_local_shape_and_global_offset((2, 5), FakeMesh((2, 2), c), [Shard(1), Shard(1)])
        assert tuple(map(tuple, got)) == table[rank]


def test_shard_box_rejects_unknown_placement():
    with pytest.raises(ValueError, match="unsupported placement"):
        shard_box((4,), (2,), [("partial", "sum")], (0,))


@SETTINGS
@given(layouts())
def test_boxes_tile_the_tensor(layout):
    """Over all mesh coordinates every element is held exactly R times (R = product of the replicated
    mesh dims); distinct non-empty boxes are disjoint, each held R times, and their volumes sum to numel."""
    shape, mesh_shape, tplacements = layout
    placements = ck(tplacements)
    r = replication(mesh_shape, placements)
    count = torch.zeros(shape, dtype=torch.int64)
    held = Counter()
    for c in coords(mesh_shape):
        box = shard_box(shape, mesh_shape, placements, c)
        assert len(box[0]) == len(box[1]) == len(shape)
        for o, s, n in zip(box[0], box[1], shape):
            assert o >= 0 and s >= 0 and o + s <= n, (layout, c, box)
        count[slices(box)] += 1
        if volume(box):
            held[box] += 1
    assert bool((count == r).all()), (layout, count)
    assert set(held.values()) <= {r}
    distinct = list(held)
    for a, b in itertools.combinations(distinct, 2):
        assert intersect(a, b) is None, (layout, a, b)
    assert sum(volume(b) for b in distinct) == math.prod(shape)


# --------------------------------------------------------------------------------------------
# assign_writers
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(layouts(max_mesh_ndim=2, max_world=12), min_size=1, max_size=5), st.data())
def test_assign_writers_writes_every_box_once(layout_list, data):
    # one mesh for the whole state (as on a real job); each tensor draws its own shape and placements
    mesh_shape = layout_list[0][1]
    tensors = []
    for i, (shape, _, _) in enumerate(layout_list):
        choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
        tp = [data.draw(st.sampled_from(choices)) for _ in mesh_shape]
        tensors.append((f"t{i}", shape, ck(tp), data.draw(st.sampled_from([1, 2, 4]))))
    items = items_for(tensors, mesh_shape)
    plan = assign_writers(items)
    check_written_once(items, plan)
    # the written boxes still tile each tensor exactly once
    for key, shape, _, _ in tensors:
        count = torch.zeros(shape, dtype=torch.int64)
        for it in itertools.chain.from_iterable(plan):
            if it.key == key:
                count[slices((it.offsets, it.sizes))] += 1
        assert bool((count == 1).all()), (key, shape)


def test_assign_writers_spreads_equal_replicated_tensors():
    items = items_for([(f"w{i}", (32, 32), [("replicate",)], 4) for i in range(8)], (4,))
    plan = assign_writers(items)
    check_written_once(items, plan)
    assert [len(p) for p in plan] == [2, 2, 2, 2]
    assert loads(plan) == [2 * 32 * 32 * 4] * 4


def test_assign_writers_fills_around_sharded_load():
    # rank 0 already writes a large unique shard: the replicated tensors go to the others first
    items = [[ItemMeta("big", (0,), (100,), 100)], [], [], []]
    for i in range(6):
        for r in range(4):
            items[r].append(ItemMeta(f"rep{i}", (0,), (10,), 10))
    plan = assign_writers(items)
    check_written_once(items, plan)
    assert [it.key for it in plan[0]] == ["big"]
    assert sorted(loads(plan)) == [20, 20, 20, 100]


def test_assign_writers_2d_mesh_replicated_rows():
    # mesh (2, 4), Shard(0) then Replicate: each half of each tensor is held by 4 ranks; 8 equal tensors
    # -> 16 distinct boxes over 8 ranks, 2 each
    items = items_for([(f"w{i}", (16, 8), [("shard", 0), ("replicate",)], 2) for i in range(8)], (2, 4))
    plan = assign_writers(items)
    check_written_once(items, plan)
    assert [len(p) for p in plan] == [2] * 8
    assert len(set(loads(plan))) == 1


@SETTINGS
@given(
    st.integers(1, 8),
    st.lists(st.integers(0, 1000), min_size=0, max_size=30),
    st.lists(st.integers(0, 1000), min_size=0, max_size=16),
)
def test_assign_writers_replicated_within_one_item_of_optimal(world, replicated, unique):
    """Fully replicated boxes on top of unique ones: the most loaded rank writes at most
    max(largest unique load, total / world + largest replicated box), which is within one item of optimal."""
    items: list[list[ItemMeta]] = [[] for _ in range(world)]
    pre = [0] * world
    for i, nb in enumerate(unique):
        r = i % world
        items[r].append(ItemMeta(f"u{i}", (0,), (nb,), nb))
        pre[r] += nb
    for i, nb in enumerate(replicated):
        for r in range(world):
            items[r].append(ItemMeta(f"r{i}", (0,), (nb,), nb))
    plan = assign_writers(items)
    if world == 1:
        assert len(plan[0]) == len(unique) + len(replicated)
        return
    check_written_once(items, plan)
    total = sum(unique) + sum(replicated)
    assert max(loads(plan)) <= max(max(pre), total / world + max(replicated, default=0))


@SETTINGS
@given(st.integers(2, 3), st.lists(st.tuples(st.integers(1, 10), st.integers(1, 7)), min_size=1, max_size=5))
def test_assign_writers_partial_replication_small_cases_near_optimal(world, spec):
    """Boxes held by arbitrary subsets of ranks (2-D meshes make such subsets): brute-force optimum,
    greedy within one (largest shared) item of it."""
    items: list[list[ItemMeta]] = [[] for _ in range(world)]
    for i, (nb, mask) in enumerate(spec):
        hs = [r for r in range(world) if mask >> r & 1] or [0]
        for r in hs:
            items[r].append(ItemMeta(f"t{i}", (0,), (nb,), nb))
    plan = assign_writers(items)
    check_written_once(items, plan)
    holders: dict[str, list[int]] = {}
    nbytes: dict[str, int] = {}
    for r, its in enumerate(items):
        for it in its:
            holders.setdefault(it.key, []).append(r)
            nbytes[it.key] = it.nbytes
    keys = list(holders)
    best = min(
        max(sum(nbytes[k] for k, r in zip(keys, choice) if r == rank) for rank in range(world))
        for choice in itertools.product(*(holders[k] for k in keys))
    )
    shared = [nbytes[k] for k in keys if len(holders[k]) > 1]
    assert max(loads(plan)) <= best + max(shared, default=0)


def test_assign_writers_deterministic():
    rng = random.Random(7)
    tensors = []
    for i in range(40):
        shape = (rng.randint(0, 40), rng.randint(1, 5))
        placements = rng.choice(
            [[("shard", 0), ("replicate",)], [("replicate",), ("replicate",)], [("shard", 1), ("shard", 0)]]
        )
        tensors.append((f"layer.{i}.w", shape, placements, rng.choice([2, 4])))
    items = items_for(tensors, (2, 3))
    plan = assign_writers(items)
    check_written_once(items, plan)
    # same input, fresh equal objects (new tuples, new ItemMetas, tuple containers): same plan
    assert assign_writers(items) == plan
    assert assign_writers(copy.deepcopy(items)) == plan
    assert assign_writers(tuple(tuple(x) for x in items)) == plan
    rebuilt = [
        [ItemMeta(str(it.key), tuple(list(it.offsets)), tuple(list(it.sizes)), it.nbytes) for it in x] for x in items
    ]
    assert assign_writers(rebuilt) == plan

    # the order each rank lists its items in does not change who writes what
    def owner(p):
        return {(it.key, it.offsets, it.sizes): r for r, its in enumerate(p) for it in its}

    for seed in range(5):
        shuffled = [list(x) for x in items]
        for x in random.Random(seed).sample(shuffled, len(shuffled)):
            random.Random(seed).shuffle(x)
        assert owner(assign_writers(shuffled)) == owner(plan)


def test_assign_writers_edge_cases():
    assert assign_writers([]) == []
    assert assign_writers([[], [], []]) == [[], [], []]
    zero_d = [[ItemMeta("s", (), (), 8)] for _ in range(3)]
    plan = assign_writers(zero_d)
    check_written_once(zero_d, plan)


# --------------------------------------------------------------------------------------------
# intersect / read_plan / row_span
# --------------------------------------------------------------------------------------------


def test_intersect_cases():
    assert intersect(((0, 0), (4, 4)), ((2, 2), (4, 4))) == ((2, 2), (2, 2))
    assert intersect(((0,), (4,)), ((4,), (4,))) is None  # touching, not overlapping
    assert intersect(((0,), (4,)), ((1,), (2,))) == ((1,), (2,))  # contained
    assert intersect(((0, 0), (4, 4)), ((0, 4), (4, 1))) is None
    assert intersect(((0,), (4,)), ((2,), (0,))) is None  # empty box
    assert intersect(((), ()), ((), ())) == ((), ())  # 0-d
    assert volume(((), ())) == 1
    assert volume(((1, 2), (3, 0))) == 0


def _assemble(g: torch.Tensor, target, reads) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``target`` the way the loader does: per read, only the chunk rows row_span names, taken as
    one contiguous range of the C-ordered chunk."""
    out = torch.full(target[1], -1, dtype=g.dtype)
    hits = torch.zeros(target[1], dtype=torch.int64)
    for r in reads:
        cbox, ov = r.chunk_box, r.overlap
        assert intersect(cbox, ov) == ov and intersect(target, ov) == ov
        chunk = g[slices(cbox)].contiguous().reshape(-1)
        first, count = row_span(cbox, ov)
        if not cbox[0]:
            assert (first, count) == (0, 1)
            out[()] = chunk[0]
            hits[()] += 1
            continue
        row = math.prod(cbox[1][1:])
        rows = chunk[first * row : (first + count) * row].reshape((count,) + cbox[1][1:])
        local = (slice(0, ov[1][0]),) + tuple(
            slice(o - co, o - co + s) for o, co, s in zip(ov[0][1:], cbox[0][1:], ov[1][1:])
        )
        dest = tuple(slice(o - to, o - to + s) for o, to, s in zip(ov[0], target[0], ov[1]))
        out[dest] = rows[local]
        hits[dest] += 1
    return out, hits


@SETTINGS
@given(layouts(max_ndim=3, max_dim=8), st.data())
def test_read_plan_covers_target_exactly(layout, data):
    shape, mesh_shape, tplacements = layout
    g = global_tensor(shape)
    saved = sorted({shard_box(shape, mesh_shape, ck(tplacements), c) for c in coords(mesh_shape)})
    data.draw(st.randoms(use_true_random=False)).shuffle(saved)
    target = data.draw(sub_boxes(shape))
    reads, uncovered = read_plan(target, saved)
    assert uncovered == 0
    assert [saved[r.chunk] for r in reads] == [r.chunk_box for r in reads]
    assert all(volume(r.overlap) for r in reads)
    # every chunk that overlaps is read (for non-empty targets)
    expected = {i for i, b in enumerate(saved) if intersect(target, b) is not None}
    assert {r.chunk for r in reads} == expected
    out, hits = _assemble(g, target, reads)
    if volume(target):
        assert sum(volume(r.overlap) for r in reads) == volume(target)
        assert bool((hits == 1).all())
        assert torch.equal(out, g[slices(target)])


@SETTINGS
@given(layouts(max_ndim=3, max_dim=8), st.data())
def test_read_plan_counts_uncovered(layout, data):
    shape, mesh_shape, tplacements = layout
    saved = sorted({shard_box(shape, mesh_shape, ck(tplacements), c) for c in coords(mesh_shape)})
    kept = [b for b in saved if data.draw(st.booleans())]
    target = data.draw(sub_boxes(shape))
    reads, uncovered = read_plan(target, kept)
    hits = torch.zeros(shape, dtype=torch.int64)
    for b in kept:
        hits[slices(b)] += 1
    missing = int((hits[slices(target)] == 0).sum())
    assert uncovered == missing
    assert uncovered + sum(volume(r.overlap) for r in reads) == volume(target)


@SETTINGS
@given(layouts(max_ndim=3, max_dim=8), layouts(max_ndim=3, max_dim=8), st.data())
def test_reshard_save_then_load_plan(saved_layout, load_layout, data):
    """Save with one layout (boxes from assign_writers, empty ones included), load every rank of another
    mesh/placement for the same global shape: each target is filled exactly, from the saved data."""
    shape, mesh_a, pa = saved_layout
    _, mesh_b, _ = load_layout
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
    pb = [data.draw(st.sampled_from(choices)) for _ in mesh_b]
    g = global_tensor(shape)
    items = items_for([("w", shape, ck(pa), 8)], mesh_a)
    plan = assign_writers(items)
    check_written_once(items, plan)
    chunks = [(it.offsets, it.sizes) for its in plan for it in its]
    for c in coords(mesh_b):
        target = shard_box(shape, mesh_b, ck(pb), c)
        reads, uncovered = read_plan(target, chunks)
        assert uncovered == 0
        out, hits = _assemble(g, target, reads)
        if volume(target):
            assert bool((hits == 1).all())
            assert torch.equal(out, g[slices(target)])


def test_read_plan_edge_cases():
    # empty target: nothing to read, nothing uncovered, whatever the chunks
    assert read_plan(((0, 3), (5, 0)), [((0, 0), (5, 5))]) == ([], 0)
    assert read_plan(((0,), (0,)), []) == ([], 0)
    # 0-d
    reads, uncovered = read_plan(((), ()), [((), ())])
    assert uncovered == 0 and len(reads) == 1 and reads[0].overlap == ((), ())
    assert read_plan(((), ()), []) == ([], 1)
    # a hole in the middle
    reads, uncovered = read_plan(((0,), (10,)), [((0,), (3,)), ((7,), (3,))])
    assert uncovered == 4 and [r.chunk for r in reads] == [0, 1]
    # no chunks at all
    assert read_plan(((1, 1), (2, 3)), []) == ([], 6)


@SETTINGS
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_row_span_is_the_minimal_row_range(chunk_sizes, data):
    """For a C-ordered chunk, the rows row_span names hold every overlap element, and its first and last
    row hold some (no wasted rows at either end)."""
    chunk_sizes = tuple(chunk_sizes)
    chunk_offsets = tuple(data.draw(st.integers(0, 5)) for _ in chunk_sizes)
    cbox = (chunk_offsets, chunk_sizes)
    local = data.draw(sub_boxes(chunk_sizes))
    if not volume(local):
        return
    overlap = (tuple(o + co for o, co in zip(local[0], chunk_offsets)), local[1])
    first, count = row_span(cbox, overlap)
    row = math.prod(chunk_sizes[1:])
    flat = torch.arange(math.prod(chunk_sizes)).reshape(chunk_sizes)[slices(local)].reshape(-1)
    rows = flat // row
    assert int(rows.min()) == first
    assert int(rows.max()) == first + count - 1
    assert first >= 0 and first + count <= chunk_sizes[0]


def test_row_span_cases():
    assert row_span(((), ()), ((), ())) == (0, 1)  # 0-d: the one element
    assert row_span(((10,), (5,)), ((12,), (2,))) == (2, 2)
    assert row_span(((4, 0), (4, 8)), ((5, 3), (2, 4))) == (1, 2)
    assert row_span(((0, 0, 0), (3, 4, 5)), ((0, 1, 1), (3, 1, 1))) == (0, 3)


# --------------------------------------------------------------------------------------------
# Scale (correctness only; timing lives in benchmarks/bench_plan.py)
# --------------------------------------------------------------------------------------------


def test_plan_1000_ranks():
    world = 1000
    rng = random.Random(1000)
    tensors = []
    for i in range(200):
        rows = rng.choice([4096, 1000, 2048, 3000, 10007, 999, 500, 1, 0, rng.randint(1, 5000)])
        tensors.append((f"layers.{i}.weight", (rows, rng.choice([1, 8, 16])), [("shard", 0)], 2))
    for i in range(20):
        tensors.append((f"norms.{i}.weight", (rng.randint(1, 64),), [("replicate",)], 4))
    items = items_for(tensors, (world,))
    plan = assign_writers(items)
    assert len(plan) == world

    # exactly once, by a holder: a sharded box's holder is the rank whose coordinate produced it
    seen: dict[tuple, int] = {}
    for r, its in enumerate(plan):
        for it in its:
            k = (it.key, it.offsets, it.sizes)
            assert k not in seen, f"{k} written by ranks {seen[k]} and {r}"
            seen[k] = r
    distinct = {(it.key, it.offsets, it.sizes) for its in items for it in its}
    assert set(seen) == distinct
    for r, its in enumerate(items):
        for it in its:
            if it.sizes and it.sizes[0] and it.key.startswith("layers."):
                assert seen[(it.key, it.offsets, it.sizes)] == r  # unique shard stays with its holder
    # every tensor is covered exactly: the written row ranges of each key tile [0, rows)
    spans: dict[str, list[tuple[int, int]]] = {}
    for its in plan:
        for it in its:
            if volume((it.offsets, it.sizes)) or not it.sizes:
                spans.setdefault(it.key, []).append(
                    (it.offsets[0] if it.offsets else 0, it.sizes[0] if it.sizes else 1)
                )
    for key, shape, _, _ in tensors:
        if math.prod(shape) == 0:
            assert key not in spans
            continue
        pos = 0
        for o, s in sorted(spans[key]):
            assert o == pos, (key, o, pos)
            pos += s
        assert pos == shape[0], key
    # the replicated norms (and the zero-byte empty shards) only ever fill in around the sharded load
    pre = [sum(it.nbytes for it in its if it.key.startswith("layers.") and it.sizes[0]) for its in items]
    shared = [it.nbytes for it in items[0] if it.key.startswith("norms.")]
    assert max(loads(plan)) <= max(max(pre), (sum(pre) + sum(shared)) / world + max(shared))


# ------------------------------------------------------------------------------------------------
# The local rule save_sharded uses: every rank decides alone, and each box is still written once.
# ------------------------------------------------------------------------------------------------


def _local_rule_writers(shape, mesh_shape, placements, key="t", tensors=None):
    """Simulate every rank's own decision (checkpoint/sharded.py my_writes) for DTensors on one mesh:
    each rank spreads the boxes it holds over their replicas, and writes those that fall to its index.
    Returns ({box: [writing ranks]}, bytes written per rank)."""
    from ckptstore.planning.sharding import spread

    tensors = tensors or [(key, shape)]
    writers: dict = {}
    load = []
    for rank, coord in enumerate(itertools.product(*[range(n) for n in mesh_shape])):
        count, index = 1, 0
        for d, p in enumerate(placements):
            if p[0] == "replicate":
                count *= mesh_shape[d]
                index = index * mesh_shape[d] + coord[d]
        metas = []
        for k, sh in tensors:
            box = shard_box(sh, mesh_shape, placements, coord)
            if volume(box):
                metas.append(ItemMeta(k, box[0], box[1], volume(box) * 4))
        chosen = [m for m, w in zip(metas, spread(metas, count)) if w == index]
        for m in metas:
            writers.setdefault((m.key, (m.offsets, m.sizes)), [])
        for m in chosen:
            writers[(m.key, (m.offsets, m.sizes))].append(rank)
        load.append(sum(m.nbytes for m in chosen))
    return {box: ranks for (k, box), ranks in writers.items() if k == key} if len(tensors) == 1 else writers, load


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((16, 8), (4,), [("shard", 0)]),
        ((16, 8), (2, 2), [("replicate",), ("shard", 0)]),
        ((16, 8), (2, 2), [("shard", 1), ("replicate",)]),
        ((7, 5), (3, 2), [("replicate",), ("replicate",)]),
        ((10,), (2, 3), [("shard", 0), ("replicate",)]),
        ((3, 3), (4, 2), [("shard", 0), ("shard", 1)]),
    ],
)
def test_local_rule_writes_every_nonempty_box_exactly_once(shape, mesh_shape, placements):
    writers, _ = _local_rule_writers(shape, mesh_shape, placements)
    assert writers, "some box must exist"
    assert all(len(ranks) == 1 for ranks in writers.values()), writers
    assert sum(volume(box) for box in writers) == math.prod(shape)


def test_hsdp_replicas_share_the_writes():
    """HSDP (Replicate over 2 groups, Shard(0) over 2): every shard written once, and both replicas
    of each shard write about half of the bytes (not all on one replica, as a per-box hash could)."""
    tensors = [(f"w{i}", (8, 4 + i)) for i in range(12)]
    writers, load = _local_rule_writers(None, (2, 2), [("replicate",), ("shard", 0)], tensors=tensors)
    assert all(len(r) == 1 for r in writers.values()), writers
    assert max(load) <= 1.2 * min(load), load


def test_spread_balances_plain_tensors_and_agrees_everywhere():
    from ckptstore.planning.sharding import spread

    items = [ItemMeta(f"p{i}", (0,), (n,), n) for i, n in enumerate([8, 8, 8, 8, 4, 4, 2, 2])]
    writers = spread(items, 4)
    loads = [sum(it.nbytes for it, w in zip(items, writers) if w == r) for r in range(4)]
    assert sorted(loads) == [10, 10, 12, 12]
    assert spread(list(items), 4) == writers  # deterministic: every rank computes the same


# --------------------------------------------------------------------------------------------
# _StridedShard (FSDP2 over TP): shard_boxes against torch's own split
# --------------------------------------------------------------------------------------------


def torch_local(t: torch.Tensor, mesh_shape, placements, coordinate) -> torch.Tensor:
    """The local tensor torch's placements give a rank, split left to right with their own _split_tensor."""
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        pieces, _ = p._split_tensor(t, mesh_shape[mesh_dim], with_padding=False)
        c = coordinate[mesh_dim]
        t = pieces[c] if c < len(pieces) else t.narrow(p.dim, t.shape[p.dim], 0)
    return t


def ck_strided(placements) -> list[tuple]:
    from torch.distributed.tensor.placement_types import _StridedShard

    return [("strided", p.dim, p.split_factor) if isinstance(p, _StridedShard) else ck([p])[0] for p in placements]


def assemble(g: torch.Tensor, boxes) -> torch.Tensor:
    sizes = [0] * g.dim()
    for local, _glob in boxes:
        for d in range(g.dim()):
            sizes[d] = max(sizes[d], local[0][d] + local[1][d])
    out = torch.full(sizes, -1, dtype=g.dtype)
    for local, glob in boxes:
        out[slices(local)] = g[slices(glob)]
    return out


STRIDED = [
    # torchtitan's FSDP2 over TP: fully_shard over dp of a Colwise (Shard(0)) weight on a (dp, tp) mesh
    ((8, 8), (2, 2), "S0,s0/2"),
    ((16, 4), (2, 4), "S0,s0/4"),
    ((12, 6), (3, 2), "S0,s0/2"),
    # Rowwise (Shard(1)) under FSDP's Shard(0): no strided placement, boxes from both dims
    ((8, 8), (2, 2), "R1,S0"),
    # strided over a dim the later placement does not cut: several runs per rank
    ((8, 6), (2, 2), "s0/2,S1"),
    ((12, 3), (2, 3), "s0/3,R"),
    ((24,), (2, 2, 3), "s0/6,S0,S0"),
    # HSDP over TP: (replicate, shard, tp)
    ((8, 4), (2, 2, 2), "R,s0/2,S0"),
]


def _parse(spec: str):
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec.split(","):
        if p == "R":
            out.append(Replicate())
        elif p.startswith("R") or p.startswith("S"):  # the mesh dims are given in order, the letter says the kind
            out.append(Shard(int(p[1:])))
        else:
            dim, sf = p[1:].split("/")
            out.append(_StridedShard(int(dim), split_factor=int(sf)))
    return out


@pytest.mark.parametrize("shape,mesh_shape,spec", STRIDED, ids=[s for *_, s in STRIDED])
def test_shard_boxes_agree_with_torch_strided_split(shape, mesh_shape, spec):
    from ckptstore.planning.sharding import shard_boxes

    placements = _parse(spec)
    g = global_tensor(shape)
    held = torch.zeros(shape, dtype=torch.int64)
    for c in coords(mesh_shape):
        boxes = shard_boxes(shape, mesh_shape, ck_strided(placements), c)
        expected = torch_local(g, mesh_shape, placements, c)
        got = assemble(g, boxes)
        assert torch.equal(got, expected), (spec, c, boxes)
        for _local, glob in boxes:
            held[slices(glob)] += 1
    replicas = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
    assert bool((held == replicas).all()), spec


def test_fsdp_over_tp_gives_one_contiguous_box_per_rank():
    """The table of torch's _StridedShard docstring: rank (0, 1) holds rows 4-5 of 8."""
    from ckptstore.planning.sharding import shard_boxes

    rows = {c: shard_boxes((8, 8), (2, 2), [("strided", 0, 2), ("shard", 0)], c) for c in coords((2, 2))}
    assert {c: [b[1][0][0] for b in boxes] for c, boxes in rows.items()} == {(0, 0): [0], (0, 1): [4], (1, 0): [2], (1, 1): [6]}
    assert all(len(boxes) == 1 and boxes[0][1][1] == (2, 8) for boxes in rows.values())


def test_a_strided_dim_left_uncut_gives_several_boxes():
    from ckptstore.planning.sharding import shard_boxes

    boxes = shard_boxes((8, 6), (2, 2), [("strided", 0, 2), ("shard", 1)], (1, 0))
    assert [b[1] for b in boxes] == [((2, 0), (2, 3)), ((6, 0), (2, 3))]
    assert [b[0] for b in boxes] == [((0, 0), (2, 3)), ((2, 0), (2, 3))]
    with pytest.raises(ValueError, match="several boxes"):
        shard_box((8, 6), (2, 2), [("strided", 0, 2), ("shard", 1)], (1, 0))


@SETTINGS
@given(layouts())
def test_shard_boxes_equal_shard_box_without_strided(layout):
    from ckptstore.planning.sharding import shard_boxes

    shape, mesh_shape, tplacements = layout
    for c in coords(mesh_shape):
        boxes = shard_boxes(shape, mesh_shape, ck(tplacements), c)
        assert len(boxes) == 1
        if volume(boxes[0][1]):
            assert boxes[0][1] == shard_box(shape, mesh_shape, ck(tplacements), c)
