"""Silent data corruption: compare the checksums of tensors that data-parallel replicas must hold
identically. Pure functions over plain data; engine/store.py runs the two gathers.

Round one costs three short digests per rank in the per-step gather the store already does: one over
the checksums of the plain (replicated-everywhere) tensors, which every rank holds, and one over the
replicated DTensor boxes, compared among ranks that hold the same set of boxes (their box-set
signature). Only when some digests differ does round two gather every rank's per-box checksums and
name the boxes, the ranks and their hosts.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:32]


def boxes(replicated: dict[str, tuple], sums: dict[str, Any]) -> list[list[Any]]:
    """``[key, offsets, sizes, kind, checksum]`` of every replicated box this rank holds, sorted."""
    return sorted([k, list(v[0]), list(v[1]), v[2], sums[k]["checksum"]] for k, v in replicated.items() if k in sums)


def digest(held: list[list[Any]]) -> dict[str, str]:
    plain = [b for b in held if b[3] == "all"]
    rep = [b for b in held if b[3] != "all"]
    return {"all": _sha(plain), "set": _sha([b[:3] for b in rep]), "rep": _sha(rep)}


def suspicious(digests: list[dict[str, str]]) -> bool:
    """Whether round one saw replicas that disagree."""
    if len({d["all"] for d in digests}) > 1:
        return True
    by_set: dict[str, set[str]] = collections.defaultdict(set)
    for d in digests:
        by_set[d["set"]].add(d["rep"])
    return any(len(v) > 1 for v in by_set.values())


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
