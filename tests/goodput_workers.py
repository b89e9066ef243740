"""Worker functions for tests/test_goodput.py, run in real processes (gloo over a file store)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import ckptstore


def _state(rank: int, step: int, *, corrupt: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(step)
    w = torch.randn(64, 32, generator=g)  # plain: every rank holds it, one writes it
    d = distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Replicate()])
    s = distribute_tensor(torch.randn(12, 4, generator=g), mesh, [Shard(0)])
    v = torch.randn(8, 6, generator=g).t()  # not contiguous: staged (not hashed in place) by non-writers
    if corrupt and rank == 2:
        w[3, 5] += 1.0  # a bit flip's worth of difference on one replica
    if corrupt and rank == 1:
        d.to_local()[0, 0] += 1.0
        v[1, 2] += 1.0
    return {"w": w, "d": d, "s": s, "v": v, "rng": ckptstore.PerRank(torch.tensor([rank])), "step": step}


def goodput_job(rank: int, world: int, root: str, ram_dir: str, name: str) -> None:
    """should_save agrees on every rank although each rank measures other step times; sdc='warn'
    records replica mismatches in the manifest; sdc='raise' fails the run and restore skips the step."""
    out: dict = {}
    store = ckptstore.CheckpointStore(name, local=os.path.join(root, "warn"), ram_dir=ram_dir, interval="auto",
                                      mtbf=0.5, events=True, sdc="warn", keep_local=None,
                                      durable=os.path.join(root, "durable"), durable_every=1, peer_replicas=1, node=rank)
    decisions = []
    for step in range(40):
        time.sleep(0.002 * (rank + 1))  # every rank sees another step time; only rank 0's counts
        if store.should_save(step):
            decisions.append(step)
            store.save(step, _state(rank, step, corrupt=step == decisions[0] + 1)).wait("local")
    corrupt_step = decisions[1]
    handle = store.save(100, _state(rank, 100, corrupt=False))
    handle.wait("durable")
    handle.wait("peer")
    out["decisions"] = decisions
    out["corrupt_step"] = corrupt_step
    out["plan"] = store.plan
    store.close(keep_ram=True)  # the replicas it holds serve the restore from peers below
    # A replica on a peer holds only what its source wrote (the staged-only copies are cut off): restore
    # from peers alone, with this rank's own RAM and disk copies gone.
    for fname in os.listdir(ram_dir):
        if fname.startswith(f"ckptstore-{name}-r{rank:05d}-s"):
            os.unlink(os.path.join(ram_dir, fname))
    dist.barrier()
    fresh = ckptstore.CheckpointStore(name, ram_dir=ram_dir, peer_replicas=1, node=rank)
    state = _state(rank, 0, corrupt=False)
    out["peer_restored"] = fresh.restore(state)
    expect = _state(rank, 100, corrupt=False)
    out["peer_equal"] = all(torch.equal(state[k].to_local() if hasattr(state[k], "to_local") else state[k],
                                        expect[k].to_local() if hasattr(expect[k], "to_local") else expect[k])
                            for k in ("w", "d", "s", "v"))
    fresh.close()

    raising = ckptstore.CheckpointStore(name + "r", local=os.path.join(root, "raise"), ram_dir=ram_dir, sdc="raise")
    raising.save(1, _state(rank, 1, corrupt=False)).wait("local")
    raising.save(2, _state(rank, 2, corrupt=True)).wait("local")
    try:
        raising.save(3, _state(rank, 3, corrupt=False))
    except ckptstore.CheckpointError as exc:
        out["raised"] = str(exc)
    raising.close()
    again = ckptstore.CheckpointStore(name + "r", local=os.path.join(root, "raise"), ram_dir=ram_dir, sdc="raise")
    state = _state(rank, 0, corrupt=False)
    out["restored"] = again.restore(state)
    out["restored_step_value"] = state["step"]
    again.close()
    with open(os.path.join(root, f"out-{rank}.json"), "w") as fh:
        json.dump(out, fh)
