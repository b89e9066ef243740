"""Worker functions for tests/test_collective_doubling.py, run in real processes on gloo."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import ckptstore.collective as collective
from ckptstore.collective import Group


def _expected(vectors: list[list[int]]) -> list[int]:
    return [max(col) for col in zip(*vectors)]


def _vector(rank: int, call: int) -> list[int]:
    # Negatives, int64 extremes and a maximum held by a different rank in each position and call.
    return [rank * 7 + call, -rank - call, (2**62 if rank == call % 3 else -(2**62)), (rank * 5 + call) % 4, -(2**63)]


def maxima(rank: int, world: int, doubling_from: int, out_dir: str) -> None:
    """Several flags in a row on the default group and on a subgroup of all ranks but 0 (whose
    ranks are not the global ones), a plain all-reduce between them on the same group: every rank
    gets the maximum of every rank's vector, and what it received is counted."""
    collective.DOUBLING_FROM = doubling_from
    groups = [(Group(None), list(range(world)))]
    sub_ranks = list(range(1, world))
    sub = dist.new_group(sub_ranks)  # collective: every rank creates it
    if rank in sub_ranks:
        groups.append((Group(sub), sub_ranks))
    lines = []
    for gi, (group, members) in enumerate(groups):
        for call in range(4):
            with collective.counting() as traffic:
                got = group.max_int64(_vector(rank, call))
            want = _expected([_vector(r, call) for r in members])
            assert got == want, f"group {gi} call {call} on rank {rank}: {got} != {want}"
            lines.append(f"{gi} {call} {traffic.received}")
            t = torch.tensor([rank], dtype=torch.int64)
            dist.all_reduce(t, group=group.pg)  # a ring collective between flags, on the same group
            assert int(t) == sum(members)
    with open(os.path.join(out_dir, f"received-{rank}"), "w") as fh:
        fh.write("\n".join(lines))


def dead_peer(rank: int, world: int, out_dir: str) -> None:
    """The last rank leaves without taking part: every other rank's flag raises, none hangs."""
    collective.DOUBLING_FROM = 2
    pg = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=10))
    group = Group(pg)
    group.max_int64([rank])  # every pair that is used below is open before the peer leaves
    if rank == world - 1:
        dist.destroy_process_group()  # its sockets close, as a killed rank's do
        return
    try:
        group.max_int64([rank])
    except RuntimeError as exc:
        with open(os.path.join(out_dir, f"raised-{rank}"), "w") as fh:
            fh.write(str(exc))
        return
    raise AssertionError(f"rank {rank}: max_int64 returned with a dead peer")


def swaps(rank: int, world: int, out_dir: str) -> None:
    """Group.swap_int64 and group_ranks on a subgroup of all ranks but 0 (group ranks are not the
    global ones): each member sends its neighbours in a ring of the subgroup, twice with a flag in
    between on the same group, and gets exactly what the previous member sent it."""
    sub_ranks = list(range(1, world))
    sub = dist.new_group(sub_ranks)  # collective: every rank creates it
    if rank not in sub_ranks:
        return
    group = Group(sub)
    assert group.group_ranks(sub_ranks) == tuple(range(len(sub_ranks))), group.group_ranks(sub_ranks)
    n, me = group.world, group.rank
    for call in range(2):
        got = group.swap_int64({(me + 1) % n: [me, call, -me]}, {(me - 1) % n: 3})
        prev = (me - 1) % n
        assert got == {prev: [prev, call, -prev]}, (rank, call, got)
        group.max_int64([me])
    with open(os.path.join(out_dir, f"swapped-{rank}"), "w") as fh:
        fh.write("ok")
