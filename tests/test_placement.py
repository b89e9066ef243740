"""The pure peer-replica placement (ckptstore.planning.placement), checked as properties.

Exhaustive over small layouts (world up to 12, up to 4 nodes, every split of the ranks into nodes,
contiguous and interleaved), replicas 1..nodes-1: distinct holder nodes, never the source's node,
the exact count, the documented balance bound (including that the largest load is the least any
placement can have, cross-checked by brute force on tiny layouts), determinism, relabeling
invariance, the inverse, and node losses.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from ckptstore.errors import CheckpointError, InvalidArgumentError
from ckptstore.planning.placement import node_of_ranks, replica_holders, replicas_held

# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def compositions(total: int, parts: int):
    """Ordered splits of ``total`` ranks into ``parts`` non-empty nodes."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def contiguous(sizes) -> list[int]:
    return [node for node, s in enumerate(sizes) for _ in range(s)]


def interleaved(sizes) -> list[int]:
    """Ranks dealt round-robin over the nodes that still have room (node labels as the launcher
    might number them: 10, 20, ...)."""
    left = list(sizes)
    out = []
    while any(left):
        for node, n in enumerate(left):
            if n:
                out.append(10 * (node + 1))
                left[node] -= 1
    return out


def small_layouts():
    for world in range(1, 13):
        for parts in range(1, min(4, world) + 1):
            for sizes in compositions(world, parts):
                yield sizes, contiguous(sizes)
                if parts > 1:
                    yield sizes, interleaved(sizes)


SMALL = list(small_layouts())
CASES = [(sizes, nodes, r) for sizes, nodes in SMALL for r in range(1, len(sizes))]


def optimum(sizes, replicas: int) -> int:
    """The least largest load any placement can have: a node of s ranks holds at most world - s
    replicas (one of every rank off it) and at most M * s when no rank holds more than M."""
    world = sum(sizes)
    m = 0
    while sum(min(world - s, m * s) for s in sizes) < world * replicas:
        m += 1
    return m


def check_plan(nodes, replicas, holders) -> None:
    """Every property the module docstring promises, for one plan."""
    world = len(nodes)
    sizes = Counter(nodes)
    assert len(holders) == world
    for r, hs in enumerate(holders):
        assert hs == sorted(hs)
        assert len(hs) == replicas, (r, hs)
        assert all(0 <= h < world for h in hs)
        held_on = [nodes[h] for h in hs]
        assert nodes[r] not in held_on, (r, hs)
        assert len(set(held_on)) == replicas, (r, hs)
    load = Counter(h for hs in holders for h in hs)
    loads = [load[r] for r in range(world)]
    assert sum(loads) == world * replicas
    best = optimum(list(sizes.values()), replicas)
    assert max(loads) == best
    node_total = Counter()
    for r in range(world):
        node_total[nodes[r]] += loads[r]
    for node, s in sizes.items():
        mine = [loads[r] for r in range(world) if nodes[r] == node]
        assert max(mine) - min(mine) <= 1  # spread evenly inside a node
        assert node_total[node] <= world - s
        floor_ = min(best - 1, (world - s) // s)
        assert min(mine) >= floor_, (node, mine, best)
        if min(mine) < best - 1:  # only a saturated node falls below best - 1
            assert node_total[node] == world - s
    if max(sizes.values()) * (replicas + 1) <= world:
        assert loads == [replicas] * world
    unsaturated = [loads[r] for r in range(world) if node_total[nodes[r]] < world - sizes[nodes[r]]]
    if unsaturated:
        assert max(unsaturated) - min(unsaturated) <= 1


# --------------------------------------------------------------------------------------------
# node_of_ranks
# --------------------------------------------------------------------------------------------


def test_node_of_ranks_hostnames():
    hosts = ["gpu-b", "gpu-b", "gpu-a", "gpu-c", "gpu-a", "gpu-b"]
    assert node_of_ranks(hosts) == [0, 0, 1, 2, 1, 0]


def test_node_of_ranks_ints():
    assert node_of_ranks([7, 7, 3, 3, 0, 7]) == [0, 0, 1, 1, 2, 0]
    assert node_of_ranks([0, 1, 2, 3]) == [0, 1, 2, 3]
    assert node_of_ranks([5]) == [0]
    assert node_of_ranks([]) == []


def test_node_of_ranks_mixed_hashables():
    assert node_of_ranks([("h", 0), ("h", 1), ("h", 0)]) == [0, 1, 0]


# --------------------------------------------------------------------------------------------
# replica_holders: properties
# --------------------------------------------------------------------------------------------


def test_small_layouts_are_many():
    assert len(CASES) > 2000
    assert any(1 in sizes for sizes, _, _ in CASES)  # nodes of one rank are covered
    assert any(len(set(sizes)) > 1 for sizes, _, _ in CASES)


def test_every_property_on_every_small_layout():
    for _, nodes, replicas in CASES:
        holders = replica_holders(nodes, replicas)
        check_plan(nodes, replicas, holders)


def test_even_nodes_hold_exactly_replicas():
    for n_nodes in range(2, 9):
        for per_node in range(1, 9):
            nodes = contiguous([per_node] * n_nodes)
            for replicas in range(1, n_nodes):
                holders = replica_holders(nodes, replicas)
                check_plan(nodes, replicas, holders)
                assert Counter(h for hs in holders for h in hs) == {r: replicas for r in range(len(nodes))}


def test_uneven_example_from_the_brief():
    # Nodes of 3, 1 and 2 ranks.
    nodes = [0, 0, 0, 1, 2, 2]
    one = replica_holders(nodes, 1)
    check_plan(nodes, 1, one)
    assert Counter(h for hs in one for h in hs) == {r: 1 for r in range(6)}  # 3 * 2 <= 6: exact
    two = replica_holders(nodes, 2)
    check_plan(nodes, 2, two)
    # With 3 nodes and 2 replicas each rank sends to both other nodes: the loads are forced.
    assert [len(replicas_held(two, r)) for r in range(6)] == [1, 1, 1, 5, 2, 2]


def test_deterministic_and_relabeling_invariant():
    rng = random.Random(0)
    for sizes, nodes, replicas in CASES[::7]:
        first = replica_holders(nodes, replicas)
        assert replica_holders(list(nodes), replicas) == first
        labels = rng.sample(range(1000), len(sizes))
        relabel = {old: labels[i] for i, old in enumerate(dict.fromkeys(nodes))}
        assert replica_holders([relabel[n] for n in nodes], replicas) == first
        assert replica_holders(node_of_ranks([f"host-{relabel[n]}" for n in nodes]), replicas) == first


def test_largest_load_is_optimal_by_brute_force():
    """On tiny layouts, enumerate every valid placement and compare the least largest load."""
    for sizes, nodes, replicas in CASES:
        world = len(nodes)
        if world > 5 or len(sizes) < 2:
            continue
        options = []
        for r in range(world):
            foreign = [h for h in range(world) if nodes[h] != nodes[r]]
            options.append(
                [c for c in itertools.combinations(foreign, replicas) if len({nodes[h] for h in c}) == replicas]
            )
        best = math.inf
        for choice in itertools.product(*options):
            load = Counter(h for c in choice for h in c)
            best = min(best, max(load.values()))
        holders = replica_holders(nodes, replicas)
        assert max(Counter(h for hs in holders for h in hs).values()) == best == optimum(sizes, replicas)


def test_larger_random_layouts():
    rng = random.Random(1234)
    for _ in range(300):
        n_nodes = rng.randint(2, 24)
        sizes = [rng.choice([1, 1, 2, 4, 8, 8, 8, rng.randint(1, 40)]) for _ in range(n_nodes)]
        nodes = contiguous(sizes)
        rng.shuffle(nodes)
        replicas = rng.randint(1, min(n_nodes - 1, 6))
        check_plan(nodes, replicas, replica_holders(nodes, replicas))


def test_large_even_job_is_fast_and_exact():
    nodes = contiguous([8] * 1024)  # 8192 ranks
    holders = replica_holders(nodes, 3)
    check_plan(nodes, 3, holders)


# --------------------------------------------------------------------------------------------
# replicas_held
# --------------------------------------------------------------------------------------------


def test_replicas_held_is_the_inverse():
    for _, nodes, replicas in CASES[::3]:
        holders = replica_holders(nodes, replicas)
        held = [replicas_held(holders, r) for r in range(len(nodes))]
        for r, sources in enumerate(held):
            assert sources == sorted(sources)
            assert all(r in holders[src] for src in sources)
        pairs = {(src, h) for src, hs in enumerate(holders) for h in hs}
        assert pairs == {(src, r) for r, sources in enumerate(held) for src in sources}


def test_replicas_held_of_nothing():
    assert replicas_held([[], []], 0) == []
    assert replicas_held([[1], [0]], 1) == [0]


# --------------------------------------------------------------------------------------------
# Node losses
# --------------------------------------------------------------------------------------------


def test_single_node_loss_keeps_a_replica_of_every_lost_rank():
    for _, nodes, replicas in CASES:
        holders = replica_holders(nodes, replicas)
        for lost in set(nodes):
            for r in range(len(nodes)):
                if nodes[r] == lost:
                    assert any(nodes[h] != lost for h in holders[r]), (nodes, replicas, lost, r)


def test_losing_up_to_replicas_nodes_loses_nothing():
    for _, nodes, replicas in CASES:
        holders = replica_holders(nodes, replicas)
        for k in range(1, replicas + 1):
            for lost in itertools.combinations(sorted(set(nodes)), k):
                gone = set(lost)
                for r in range(len(nodes)):
                    if nodes[r] in gone:
                        assert any(nodes[h] not in gone for h in holders[r]), (nodes, replicas, lost, r)


# --------------------------------------------------------------------------------------------
# Edge cases and errors
# --------------------------------------------------------------------------------------------


def test_zero_replicas():
    assert replica_holders([0, 0, 1], 0) == [[], [], []]
    assert replica_holders([0, 0, 0], 0) == [[], [], []]  # one node is fine without replicas
    assert replica_holders([], 0) == []


def test_too_few_nodes():
    with pytest.raises(InvalidArgumentError) as info:
        replica_holders([0, 0, 1, 1], 2)
    message = str(info.value)
    assert "peer_replicas=2 needs at least 3 nodes, this job has 2" in message
    assert "[0, 0, 1, 1]" in message
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)
    with pytest.raises(InvalidArgumentError, match="peer_replicas=1 needs at least 2 nodes, this job has 1"):
        replica_holders([3, 3, 3], 1)
    with pytest.raises(InvalidArgumentError, match="this job has 0"):
        replica_holders([], 1)


def test_too_few_nodes_message_shortens_long_lists():
    nodes = [0] * 500 + [1] * 500
    with pytest.raises(InvalidArgumentError) as info:
        replica_holders(nodes, 2)
    message = str(info.value)
    assert "... 984 more]" in message
    assert len(message) < 400


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2", None])
def test_bad_replicas(bad):
    with pytest.raises(InvalidArgumentError, match="non-negative integer"):
        replica_holders([0, 1, 2], bad)
