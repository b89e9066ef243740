"""Ranks of tests/test_restore_flat.py (run by dist_workers.run): saves whose node copies hold each
rank's own part, and restarts that restore them, counting what each rank receives.

Rank r runs on node r: its own RAM directory (``<ram_root>/node<r>``) and local directory
(``<local_root>/node<r>``). The state mixes what a restore finds in its own part (DTensor shards,
a per-rank value, the plain tensors this rank wrote) with what it does not: the plain tensors
other ranks of its structure wrote, and with two structures (pipeline stages), a key both hold
that the other structure writes.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from dist_workers import _ckptstore_log

import ckptstore
from ckptstore import PerRank

DTENSORS = 160  # enough that a part (a few hundred chunk entries) outweighs everything else received


def _store(name: str, rank: int, ram_root: str, local_root: str, **kw: Any) -> ckptstore.CheckpointStore:
    ram_dir = os.path.join(ram_root, f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    return ckptstore.CheckpointStore(name, local=os.path.join(local_root, f"node{rank}"), ram_dir=ram_dir, node=rank,
                                     **kw)


def _state(rank: int, world: int, step: int, stages: int, *, zeros: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    stage = rank * stages // world

    def full(seed: int, *shape: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + seed)
        return torch.zeros(*shape) if zeros else torch.randn(*shape, generator=g)

    state: dict[str, Any] = {}
    for i in range(DTENSORS):  # every rank writes its own shard of each
        state[f"dt{i}"] = distribute_tensor(full(i, 2 * world, 3), mesh, [Shard(0)])
    for i in range(6):  # each written by one rank of the stage, loaded whole by all of it
        state[f"stage{stage}.w{i}"] = full(500 + 10 * stage + i, 5, 4)
    state["shared"] = full(900, 7)  # every stage holds it; one stage writes it
    state["rng"] = PerRank(torch.full((3,), -1.0) if zeros else torch.tensor([rank, step, 7.0]))
    state["step"] = -1 if zeros else step
    return state


def _equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor

    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k]
        if isinstance(v, DTensor):
            g, v = g.to_local(), v.to_local()
        if isinstance(v, PerRank):
            g, v = g.value, v.value
        if isinstance(v, torch.Tensor):
            assert g.dtype == v.dtype and torch.equal(g, v) and g.view(torch.uint8).equal(v.view(torch.uint8)), k
        else:
            assert g == v, (k, g, v)


def save_job(rank: int, world: int, name: str, ram_root: str, local_root: str, stages: int, **kw: Any) -> None:
    """Steps 1 and 2 in RAM and in the local tier; the RAM slots are kept for the restart."""
    store = _store(name, rank, ram_root, local_root, **kw)
    for step in (1, 2):
        store.save(step, _state(rank, world, step, stages)).wait("local")
    store.close(keep_ram=True)


def own_part_bytes(ram_dir: str, rank: int, step: int) -> int:
    """The size of this rank's own part (its chunk table) in its RAM document of ``step``."""
    for path in glob.glob(os.path.join(ram_dir, "*.json")):
        with open(path) as fh:
            doc = json.load(fh)
        if doc.get("step") == step and doc.get("src") is None and doc["extra"]["part"]["rank"] == rank:
            return len(json.dumps(doc["extra"]["part"], separators=(",", ":")))
    raise AssertionError(f"no RAM document of rank {rank}'s step {step} in {ram_dir}")


def restore_job(rank: int, world: int, name: str, ram_root: str, local_root: str, stages: int, expect: int,
                tiers: str, out: str, **kw: Any) -> None:
    """Restore ``expect`` bitwise from exactly ``tiers``, counting what this rank receives through
    the store's groups during the restore; writes the count and its own part's size to ``out``."""
    from ckptstore.collective import counting

    records = _ckptstore_log()
    part = own_part_bytes(os.path.join(ram_root, f"node{rank}"), rank, expect) if tiers.endswith("ram") else 0
    store = _store(name, rank, ram_root, local_root, **kw)
    target = _state(rank, world, expect, stages, zeros=True)
    with counting() as traffic:
        found = store.restore(target)
    assert found == expect, found
    _equal(target, _state(rank, world, expect, stages))
    said = [m for m in records if "restored step" in m]
    assert any(f"restored step {expect} from the {tiers} tier" in m for m in said), said
    with open(os.path.join(out, f"w{world}-s{stages}-{tiers}-r{rank}.json"), "w") as fh:
        json.dump({"received": traffic.received, "by_role": traffic.by_role, "part": part}, fh)
    store.close(keep_ram=True)


def damaged_restore_job(rank: int, world: int, name: str, ram_root: str, local_root: str, stages: int,
                        expect: int, out: str) -> None:
    """Restore after rank 1's own part of step 2 was damaged on its node: the step falls back as
    it always did (``expect``), every rank bitwise, and the log says why."""
    records = _ckptstore_log()
    store = _store(name, rank, ram_root, local_root)
    target = _state(rank, world, expect, stages, zeros=True)
    assert store.restore(target) == expect
    _equal(target, _state(rank, world, expect, stages))
    with open(os.path.join(out, f"damaged-r{rank}.json"), "w") as fh:
        json.dump(records, fh)
    store.close(keep_ram=True)
