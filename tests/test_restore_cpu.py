"""What a restore costs per rank grows with the rank's own tensors, once each: the state is walked
once per load (the planning walk is the load's), and each DTensor layout's boxes are worked out
once per walk, not once per tensor. Real /dev/shm segments and local files, a one-rank gloo group;
every restore is checked bitwise."""

from __future__ import annotations

import torch

from ckptstore import CheckpointStore
from ckptstore.checkpoint import sharded

TENSORS = 200


def _state(mesh, step: int, *, zeros: bool = False) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    out = {}
    for i in range(TENSORS):
        full = torch.zeros(4, 3) if zeros else torch.randn(4, 3, generator=g)
        out[f"dt{i}"] = distribute_tensor(full, mesh, [Shard(0) if i % 2 else Replicate()])
    return out


def test_a_restore_works_out_each_dtensor_layout_once_not_per_tensor(job, tmp_path, mesh, monkeypatch):
    """200 DTensors of two layouts, restored after a restart from RAM and then from the local tier:
    each restore asks for a layout's boxes a few times, not once per tensor per walk (it walked the
    state twice, 400 calls, and three times at two ranks: 0.6 ms a tensor at 10,000 tensors)."""
    saved = _state(mesh, 2)
    with CheckpointStore(job, local=tmp_path / "local") as store:
        store.save(2, saved).wait("local")
        store.close(keep_ram=True)
    calls = [0]
    real = sharded.shard_boxes

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(sharded, "shard_boxes", counted)
    for keep_ram in (True, False):
        with CheckpointStore(job, local=tmp_path / "local") as store:
            target = _state(mesh, 2, zeros=True)
            calls[0] = 0
            assert store.restore(target) == 2
            assert calls[0] <= 4, calls[0]
            for k, v in saved.items():
                assert torch.equal(target[k].to_local(), v.to_local()), k
            store.close(keep_ram=keep_ram)
