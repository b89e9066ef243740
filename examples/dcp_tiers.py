"""torch.distributed.checkpoint on ckptstore's tiers: two ranks save an FSDP-style sharded model
with dcp.save and dcp.async_save (each returns once the shards are in RAM; the local and durable
tiers follow in the background), then one process loads the newest step with dcp.load, DCP's
planner resharding it, and checks it bitwise.

    python examples/dcp_tiers.py            # CPU, gloo, about 10 s
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckptstore


def model_state(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(256, 64, generator=g) * scale, "head": torch.randn(64, 10, generator=g) * scale,
            "bias": torch.randn(10, generator=g) * scale}


def rank_main(rank: int, world: int, init: str, job: str, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    store = ckptstore.CheckpointStore(job, local=os.path.join(root, "local"), durable=os.path.join(root, "durable"),
                                      durable_every=2)
    for step, scale in ((10, 1.0), (20, 2.0)):
        # Shard every matrix over the ranks (as FSDP2 does); the bias stays a replicated tensor.
        sd = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() == 2 else v
                        for k, v in model_state(scale).items()},
              "step": step}
        if step == 10:
            writer = ckptstore.dcp.Writer(store)
            dcp.save(sd, storage_writer=writer, checkpoint_id=step)
            if rank == 0:
                print(f"dcp.save returned once in RAM: {writer.handle}")
        else:
            dcp.async_save(sd, storage_writer=ckptstore.dcp.Writer(store), checkpoint_id=step).result()
    store.close()  # drains the background pipeline and promotes the last step to the durable tier
    dist.destroy_process_group()


def main() -> int:
    job = f"example-dcp-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as root:
        try:
            mp.spawn(rank_main, args=(2, os.path.join(root, "init"), job, root), nprocs=2)
            print("durable tier:", sorted(os.listdir(os.path.join(root, "durable"))))
            # One process, no process group: the newest step, resharded from 2 shards into full tensors.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                with ckptstore.CheckpointStore(job, local=os.path.join(root, "local"),
                                               durable=os.path.join(root, "durable")) as store:
                    sd = {"model": {k: torch.zeros_like(v) for k, v in model_state(1.0).items()}, "step": 0}
                    reader = ckptstore.dcp.Reader(store)
                    dcp.load(sd, storage_reader=reader)
            expected = model_state(2.0)
            ok = reader.step == 20 and sd["step"] == 20 and all(torch.equal(sd["model"][k], v) for k, v in expected.items())
            print(f"loaded step {reader.step} into one process: {'bitwise equal' if ok else 'MISMATCH'}")
            return 0 if ok else 1
        finally:
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"ckptstore-{job}-"):
                    os.unlink(os.path.join("/dev/shm", name))


if __name__ == "__main__":
    sys.exit(main())
