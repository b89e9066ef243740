"""Silent data corruption: compare the checksums of tensors that data-parallel replicas must hold
identically. Pure functions over plain data; engine/replicas.py runs the exchanges.

Round one costs each rank one short message per replica group it belongs to: the ranks holding a
replicated box form a group (every rank of a structure for its plain tensors, a DTensor's ranks along
its replicated mesh dimensions), each rank sends a digest of its checksums of the group's boxes to the
next rank of the group and compares it with the previous rank's, and one flag in an all-reduce the
save makes anyway says whether any neighbours differed. Around a ring every neighbour agreeing means
every replica agrees, so the cost does not grow with the number of ranks. Only a disagreement costs
round two, which gathers every rank's per-box checksums and names the boxes, ranks and hosts.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any


def boxes(replicated: dict[str, tuple], sums: dict[str, Any]) -> list[list[Any]]:
    """``[key, offsets, sizes, kind, checksum]`` of every replicated box this rank holds, sorted;
    ``replicated`` maps each box's slot entry name to (key, offsets, sizes, kind, group), ``sums``
    each entry name to its checksums."""
    return sorted([v[0], list(v[1]), list(v[2]), v[3], sums[name]["checksum"]]
                  for name, v in replicated.items() if name in sums)


def _int64(value: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).digest()[:8], "little",
                          signed=True)


def group_digests(held: list[list[Any]], groups: dict[str, tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """A digest (int64) of this rank's boxes of each replica group of two ranks or more, from
    :func:`boxes` and each key's group (the ranks that hold its box)."""
    by_group: dict[tuple[int, ...], list[list[Any]]] = collections.defaultdict(list)
    for box in held:
        by_group[groups[box[0]]].append(box)
    return {g: _int64(b) for g, b in by_group.items() if len(g) > 1}


def ring(digests: dict[tuple[int, ...], int], rank: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Round one's messages: what ``rank`` sends the next rank of each of its groups, and what it
    expects from the previous one (its own digest; a neighbour holding other bytes sends another).
    Each message lists ``[group id, digest]`` pairs in group-id order, the order in which the
    neighbour lists the same groups, so a pair of ranks sharing several groups swaps one message."""
    send: dict[int, list[int]] = collections.defaultdict(list)
    expect: dict[int, list[int]] = collections.defaultdict(list)
    for gid, group in sorted((_int64(list(g)), g) for g in digests):
        at, n = group.index(rank), len(group)
        send[group[(at + 1) % n]] += [gid, digests[group]]
        expect[group[(at - 1) % n]] += [gid, digests[group]]
    return dict(send), dict(expect)


def mismatches(held_by_rank: list[list[list[Any]]], hosts: list[str]) -> list[dict[str, Any]]:
    """Every box whose replicas hold different bytes: its copies (checksum, ranks, hosts) and the
    suspects (the ranks whose copy fewer replicas share; all of them on a tie)."""
    copies: dict[tuple, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for rank, held in enumerate(held_by_rank):
        for key, offsets, sizes, _kind, checksum in held:
            copies[(key, tuple(offsets), tuple(sizes))][checksum].append(rank)
    out = []
    for (key, offsets, sizes), by_sum in sorted(copies.items()):
        if len(by_sum) < 2:
            continue
        most = max(len(r) for r in by_sum.values())
        tie = all(len(r) == most for r in by_sum.values())
        suspects = sorted(r for rs in by_sum.values() if tie or len(rs) < most for r in rs)
        out.append({
            "key": key, "offsets": list(offsets), "sizes": list(sizes),
            "copies": [{"checksum": c, "ranks": rs, "hosts": sorted({hosts[r] for r in rs})}
                       for c, rs in sorted(by_sum.items(), key=lambda kv: (-len(kv[1]), kv[1]))],
            "suspects": suspects, "suspect_hosts": sorted({hosts[r] for r in suspects}),
        })
    return out


def describe(step: int, found: list[dict[str, Any]]) -> str:
    lines = []
    for m in found:
        copies = "; ".join(f"rank{'s' if len(c['ranks']) > 1 else ''} {', '.join(map(str, c['ranks']))} "
                           f"({', '.join(c['hosts'])}) hold{'' if len(c['ranks']) > 1 else 's'} {c['checksum']}"
                           for c in m["copies"])
        lines.append(f"tensor {m['key']!r} box offsets={m['offsets']} sizes={m['sizes']}: {copies}; suspect rank(s) "
                     f"{', '.join(map(str, m['suspects']))} on {', '.join(m['suspect_hosts'])}")
    return (f"silent data corruption suspected at step {step}: replicas that must be identical differ: "
            + " | ".join(lines) + ". Check those hosts (ECC/Xid errors, a deterministic replay on other hardware)")
