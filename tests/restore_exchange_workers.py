"""Ranks of tests/test_restore_exchanges.py (run by dist_workers.run): a job whose every rank is a
node of its own (RAM directory and local directory), with peer replicas and a durable tier, saves
a few steps; restarts restore the newest one, counting what each rank receives, or lose a rank
mid-restore.

The state holds DTensor shards and one plain tensor every rank loads and rank 0 wrote, so every
other rank's restore fetches rank 0's file from rank 0's node, at any world size.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import torch

import ckptstore

TENSORS = 2
STEPS = (1, 2, 3)


def _store(name: str, rank: int, root: str, ram_root: str, **kw: Any) -> ckptstore.CheckpointStore:
    ram_dir = os.path.join(ram_root, f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    return ckptstore.CheckpointStore(name, local=os.path.join(root, "local", f"node{rank}"), ram_dir=ram_dir, node=rank,
                                     durable="file://" + os.path.join(root, "durable"),
                                     durable_every=1, **kw)


def _state(rank: int, world: int, step: int, *, zeros: bool = False) -> dict[str, Any]:
    """Every rank's structure alike (so the plain tensor goes to rank 0, the first its writers are
    spread over): DTensor shards each rank writes, and one plain tensor every rank loads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def full(seed: int, *shape: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + seed)
        return torch.zeros(*shape) if zeros else torch.randn(*shape, generator=g)

    state: dict[str, Any] = {f"dt{i}": distribute_tensor(full(i, 2 * world, 4), mesh, [Shard(0)])
                             for i in range(TENSORS)}
    state["shared"] = full(100, 32)
    state["step"] = -1 if zeros else step
    return state


def _equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor

    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k]
        if isinstance(v, DTensor):
            g, v = g.to_local(), v.to_local()
        if isinstance(v, torch.Tensor):
            assert g.dtype == v.dtype and g.view(torch.uint8).equal(v.view(torch.uint8)), k
        else:
            assert g == v, (k, g, v)


def save_job(rank: int, world: int, name: str, root: str, ram_root: str) -> None:
    store = _store(name, rank, root, ram_root)
    for step in STEPS:
        handle = store.save(step, _state(rank, world, step))
    handle.wait("local")
    handle.wait("durable")
    store.close(keep_ram=True)


def restore_job(rank: int, world: int, name: str, root: str, ram_root: str, out: str) -> None:
    """Restore the newest step bitwise; write what this rank received during the restore and the
    newest step held (``latest_step``, as a restarted job asks before it numbers its saves)."""
    from ckptstore.collective import counting

    store = _store(name, rank, root, ram_root)
    target = _state(rank, world, 0, zeros=True)
    # The start's listing of the durable tier, taken now if the constructor went on without it
    # (rank 0 lists in the background): otherwise the restore would take it, on some runs only.
    store.latest_step()
    with counting() as traffic:
        found = store.restore(target)
        latest = store.latest_step()
    assert found == STEPS[-1] and latest == STEPS[-1], (found, latest)
    _equal(target, _state(rank, world, STEPS[-1]))
    with open(os.path.join(out, f"w{world}-r{rank}.json"), "w") as fh:
        json.dump({"received": traffic.received, "by_role": traffic.by_role, "calls": traffic.calls}, fh)
    store.close(keep_ram=True)


def dies_mid_restore_job(rank: int, world: int, name: str, root: str, ram_root: str, out: str) -> None:
    """The last rank is killed (SIGKILL) when its restore has chosen the step and is about to
    arrange the exchange of its files; every other rank must get a ckptstore error that names the
    step and the phase, chained from gloo's, and leave every checkpoint as it was."""
    from ckptstore.engine import restore

    store = _store(name, rank, root, ram_root, timeout_s=30.0)
    if rank == world - 1:
        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        restore.exchange = die  # type: ignore[assignment]
    target = _state(rank, world, 0, zeros=True)
    try:
        store.restore(target)
    except Exception as exc:  # noqa: BLE001 - what the caller gets is what this test checks
        record = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                  "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None}
    else:
        record = {"type": None}
    with open(os.path.join(out, f"dies-r{rank}.json"), "w") as fh:
        json.dump(record, fh)
    # The store's groups are broken with the dead rank: leave without the collective close.
    os._exit(0)
