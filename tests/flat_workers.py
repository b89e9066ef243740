"""Ranks of tests/test_flat_commit.py (run by dist_workers.run): saves whose node copies hold each
rank's own part, not the whole manifest, and the restores that assemble the manifest from them.

Rank r runs on node r: its own RAM directory (``<ram_root>/node<r>``) and local directory
(``<local_root>/node<r>``), so a node is lost by removing both.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from dist_workers import _ckptstore_log

import ckptstore
from ckptstore import _faults


def _store(name: str, rank: int, ram_root: str, local_root: str | None, **kw: Any) -> ckptstore.CheckpointStore:
    ram_dir = os.path.join(ram_root, f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    local = os.path.join(local_root, f"node{rank}") if local_root is not None else None
    return ckptstore.CheckpointStore(name, local=local, ram_dir=ram_dir, node=rank, **kw)


def _state(rank: int, step: int) -> dict[str, Any]:
    """Tensors every rank holds alike (each written by one rank) and one of the rank's own."""
    g = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {f"w{i}": torch.randn(8, 3, generator=g) for i in range(12)}
    state[f"own{rank}"] = torch.arange(2048, dtype=torch.float32) + 10.0 * step + rank
    state["step"] = step
    return state


def _empty(rank: int) -> dict[str, Any]:
    return {**{f"w{i}": torch.zeros(8, 3) for i in range(12)}, f"own{rank}": torch.zeros(2048), "step": -1}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


def _docs(ram_dir: str, step: int) -> list[dict[str, Any]]:
    out = []
    for path in glob.glob(os.path.join(ram_dir, "*.json")):
        with open(path) as fh:
            doc = json.load(fh)
        if doc.get("step") == step:
            out.append(doc)
    return out


def assert_parts_only(ram_dir: str, step: int, world: int) -> None:
    """Every document of ``step`` on this node (own slots and replicas) holds one rank's part
    (minor version 1), never the whole manifest, and names the world's size in its meta."""
    docs = _docs(ram_dir, step)
    assert docs, f"no document of step {step} in {ram_dir}"
    for doc in docs:
        assert doc.get("minor") == 1 and "manifest" not in doc["extra"], doc
        assert doc["extra"]["meta"]["world_size"] == world and doc["extra"]["meta"]["step"] == step, doc
        assert doc["extra"]["part"]["rank"] == doc.get("src", doc["rank"]), doc


def traffic_job(rank: int, world: int, name: str, ram_root: str, local_root: str | None, out: str) -> None:
    """Bytes each rank receives per steady save through each of the store's groups, to ``out``;
    every save replicated to the next node's rank (the peer lane counted too)."""
    from ckptstore.collective import counting

    store = _store(name, rank, ram_root, local_root, peer_replicas=1)
    steady = (2, 3)
    traffic = None
    for step in (1, *steady):
        if step == steady[0]:
            traffic = counting()
            counts = traffic.__enter__()
        handle = store.save(step, _state(rank, step))
        handle.wait("local")
        handle.wait("peer")
    assert traffic is not None
    traffic.__exit__(None, None, None)
    with open(os.path.join(out, f"w{world}-r{rank}.json"), "w") as fh:
        json.dump({role: n / len(steady) for role, n in counts.by_role.items()}, fh)
    store.close(keep_ram=True)  # the test reads the documents


def crash_job(rank: int, world: int, name: str, ram_root: str, local_root: str) -> None:
    """Step 1 on every node tier and replicated; step 2 committed in RAM, then the process dies by
    SIGKILL before its local write and its replication begin."""
    store = _store(name, rank, ram_root, local_root, peer_replicas=1)
    handle = store.save(1, _state(rank, 1))
    handle.wait("local")
    handle.wait("peer")
    store._drain()
    _faults.arm("ram.committed", "2")
    store.save(2, _state(rank, 2)).wait("local")
    raise AssertionError("the crash point was never reached")


def restart_job(rank: int, world: int, name: str, ram_root: str, local_root: str, expect: int, tiers: str,
                lost: list[int]) -> None:
    """Restore ``expect`` bitwise on every rank, from exactly ``tiers``, with the copies of it on
    the nodes not ``lost`` holding parts only."""
    records = _ckptstore_log()
    if rank not in lost:
        assert_parts_only(os.path.join(ram_root, f"node{rank}"), expect, world)
    store = _store(name, rank, ram_root, local_root, peer_replicas=1)
    state = _empty(rank)
    assert store.restore(state) == expect
    assert _same(state, _state(rank, expect)), state
    assert any(f"restored step {expect} from the {tiers} tier" in m for m in records), records
    store.close(keep_ram=True)  # the next run restarts on these nodes, from their RAM too
