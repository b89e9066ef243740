"""Pure peer-replica placement: which ranks keep copies of each rank's in-memory snapshot, so that
losing whole nodes does not lose a checkpoint.

Rank ``r`` on node ``n`` gets ``R`` holders (``R`` = the number of peer replicas), all on nodes other
than ``n`` and on pairwise distinct nodes. Losing any ``k <= R`` nodes therefore leaves every
snapshot readable: a lost rank's ``R`` holders sit on ``R`` distinct nodes other than its own, at
most ``k - 1`` of which are lost with it.

Balance. Write ``W`` for the world size, ``s`` for a node's rank count and ``load`` for how many
replicas a rank holds (``W * R`` in all). A node can hold at most ``W - s`` replicas: one of every
rank off the node. The plan first *saturates* the nodes too big to take their share (largest first,
while ``(R' + 1) * s > W'`` with ``R'`` and ``W'`` what is left after the nodes saturated before):
a saturated node holds a replica of every rank off it, spread over its ranks. With ``T`` saturated
nodes of ``S`` ranks, the other ``W - S`` ranks share the remaining ``W * (R - T) + S`` replicas.
Guaranteed, and tested exhaustively on small layouts:

* when no node has more than ``W / (R + 1)`` ranks (equal nodes always qualify, as ``R < nodes``),
  nothing saturates and **every rank holds exactly R replicas**;
* otherwise the ranks of unsaturated nodes hold ``floor(c)`` or ``ceil(c)`` replicas,
  ``c = (W * (R - T) + S) / (W - S)``, and the ranks of a saturated node hold ``floor`` or ``ceil``
  of ``(W - s) / s``, which is below ``c`` and is all that node can ever hold;
* the largest load, ``ceil(c)``, is the smallest possible: it equals the least ``M`` with
  ``sum(min(W - s, M * s) over nodes) >= W * R``, a lower bound for any placement.

So every rank of a node of ``s`` ranks holds between ``min(M - 1, (W - s) // s)`` and ``M``
replicas, and below ``M - 1`` only when its node already holds a replica of every rank off it.

Construction, O(W * R): the unsaturated ranks are laid on a circle of ``W' = W - S`` positions,
grouped by node. Offsets ``e_k = k * W' // (R' + 1)`` (``k = 0..R'``) are at least
``floor(W' / (R' + 1)) >= s`` apart around the circle for every unsaturated node, so positions
``p + e_k`` fall on distinct nodes. An unsaturated rank at ``p`` is held at ``p + e_1 .. p + e_R'``
(each offset is a permutation: every one of them holds exactly ``R'`` of these); the ``j``-th rank of
a saturated node is held, besides the other saturated nodes, at ``j + e_0 .. j + e_R'``, which
spreads those ``S * (R' + 1)`` replicas evenly because the ``e_k`` are maximally even on the circle.

Nothing here touches a process group: every rank passes the same node list and gets the same plan.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ckptstore.errors import InvalidArgumentError

_SHOWN = 16  # entries of a node list an error message shows before eliding the rest


def node_of_ranks(nodes: Sequence[Hashable]) -> list[int]:
    """Dense node indices from each rank's node identity (an int from the launcher, a hostname, ...),
    numbered in order of first appearance: rank 0's node is 0, the next new node 1, and so on."""
    index: dict[Hashable, int] = {}
    return [index.setdefault(node, len(index)) for node in nodes]


def _shorten(values: Sequence[object]) -> str:
    if len(values) <= _SHOWN:
        return repr(list(values))
    shown = ", ".join(repr(v) for v in values[:_SHOWN])
    return f"[{shown}, ... {len(values) - _SHOWN} more]"


def replica_holders(nodes: Sequence[int], replicas: int) -> list[list[int]]:
    """For each rank ``r`` (``nodes[r]`` is its node), the ranks that hold copies of its snapshot,
    ``replicas`` of them, sorted: never on ``r``'s node, pairwise on distinct nodes, and spread as
    evenly as the layout allows (see the module docstring for the bound). Node labels need not be
    dense; any relabeling of the nodes gives the same plan. Deterministic, O(world * replicas).

    Raises :class:`~ckptstore.errors.InvalidArgumentError` when ``replicas`` is negative or there
    are fewer than ``replicas + 1`` distinct nodes.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise InvalidArgumentError(f"peer_replicas must be a non-negative integer, got {replicas!r}")
    world = len(nodes)
    if replicas == 0:
        return [[] for _ in range(world)]
    dense = node_of_ranks(nodes)
    members: list[list[int]] = []
    for rank, node in enumerate(dense):
        if node == len(members):
            members.append([])
        members[node].append(rank)
    if len(members) < replicas + 1:
        raise InvalidArgumentError(
            f"peer_replicas={replicas} needs at least {replicas + 1} nodes, this job has {len(members)} "
            f"(node of each rank: {_shorten(nodes)}): each replica must live on a node other than its "
            f"source's and other replicas' nodes; lower peer_replicas or run on more nodes"
        )

    # Saturate the nodes too big to hold their share, largest first (ties: lower node index).
    left, room = replicas, world  # replicas per rank and ranks left once the saturated nodes are out
    saturated: list[int] = []
    for node in sorted(range(len(members)), key=lambda n: (-len(members[n]), n)):
        size = len(members[node])
        if (left + 1) * size <= room:
            break  # and so do all smaller nodes: (left + 1) / room only grows as nodes saturate
        saturated.append(node)
        left -= 1
        room -= size
    is_saturated = [False] * len(members)
    for node in saturated:
        is_saturated[node] = True

    holders: list[list[int]] = [[] for _ in range(world)]
    for node in saturated:
        ranks = members[node]
        i = 0
        for rank in range(world):
            if dense[rank] != node:
                holders[rank].append(ranks[i % len(ranks)])
                i += 1

    circle = [rank for node, ranks in enumerate(members) if not is_saturated[node] for rank in ranks]
    offsets = [k * room // (left + 1) for k in range(left + 1)]
    for p, rank in enumerate(circle):
        for e in offsets[1:]:
            holders[rank].append(circle[(p + e) % room])
    for j, rank in enumerate(rank for rank in range(world) if is_saturated[dense[rank]]):
        for e in offsets:
            holders[rank].append(circle[(j + e) % room])

    for h in holders:
        h.sort()
    return holders


def replicas_held(holders: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The source ranks whose snapshots ``rank`` holds a replica of (the inverse of
    :func:`replica_holders`), sorted."""
    return [source for source, hs in enumerate(holders) if rank in hs]
