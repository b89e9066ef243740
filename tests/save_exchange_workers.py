"""Rank bodies for tests/test_save_exchanges.py (real processes over gloo, spawned by
dist_workers.spawn): what each rank receives through the store's collectives per steady save, at
a restored step's promotion and at close."""

from __future__ import annotations

import json
import os
import shutil

import torch

import ckptstore
from ckptstore.collective import counting


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # alike on every rank: each key written by one rank
    state = {f"w{i}": torch.randn(4, 3, generator=g) for i in range(40)}
    state[f"own{rank}"] = torch.randn(7, generator=torch.Generator().manual_seed(step * 10 + rank))
    return state


def exchanges_job(rank: int, world: int, name: str, root: str, out: str) -> None:
    """Steps 1-4 saved (every rank its own node: a local directory of its own, one peer replica;
    every second step promoted), steps 3 and 4 counted as steady saves; then step 3, which the
    durable tier lacks, promoted as after a restore, and the store closed, each counted apart.
    Writes ``out/w<world>-r<rank>.json``: bytes and collectives by group for each phase."""
    local = os.path.join(root, f"local-{world}-{rank}")
    durable = os.path.join(root, f"durable-{world}")
    store = ckptstore.CheckpointStore(name, local=local, durable=durable, durable_every=2, keep_local=10,
                                      peer_replicas=1, node=rank)
    got: dict[str, dict[str, dict[str, float]]] = {}
    saved = {}
    for step in (1, 2, 3, 4):
        state = _state(rank, step)
        saved[step] = {k: v.clone() for k, v in state.items()}
        if step >= 3:
            with counting() as traffic:
                handle = store.save(step, state)
                for tier in ("local", "peer", "durable"):
                    handle.wait(tier)
            for role, n in traffic.by_role.items():
                got.setdefault("steady", {}).setdefault(role, {"bytes": 0, "calls": 0})
                got["steady"][role]["bytes"] += n / 2
                got["steady"][role]["calls"] += traffic.calls_by_role[role] / 2
        else:
            store.save(step, state).wait("durable" if step == 2 else "local")
    assert not os.path.exists(os.path.join(durable, "step-000000000003"))
    with counting() as traffic:
        promoted = store._pipeline.promote_restored(3, {"cadence": {"durable": 1, "peer": 0}})
    got["promote"] = {r: {"bytes": n, "calls": traffic.calls_by_role[r]} for r, n in traffic.by_role.items()}
    assert promoted is not None, rank  # every rank holds its part of step 3 on its node
    assert promoted.result(timeout=120) == 3
    # Step 1 as if rank 1's node had been replaced: no rank promotes it (each learns from the one
    # flag that some rank lacks its part), and the durable tier is left as it was.
    if rank == 1:
        shutil.rmtree(os.path.join(local, "step-000000000001"))
    assert 1 not in store.ram.steps_sync()  # steps 3 and 4 took the slots
    assert store._pipeline.promote_restored(1, {"cadence": {"durable": 1, "peer": 0}}) is None, rank
    with counting() as traffic:
        store.close()
    got["close"] = {r: {"bytes": n, "calls": traffic.calls_by_role[r]} for r, n in traffic.by_role.items()}
    assert not os.path.exists(os.path.join(durable, "step-000000000001"))  # closed: nothing still on its way
    with open(os.path.join(out, f"w{world}-r{rank}.json"), "w") as fh:
        json.dump(got, fh)
    # What was promoted and closed restores bitwise (the durable copy of step 3 included: a fresh
    # store on a durable tier alone).
    fresh = ckptstore.CheckpointStore(name, durable=durable)
    try:
        for step in (3, 4):
            target = {k: torch.zeros_like(v) for k, v in saved[step].items()}
            assert fresh.restore(target, step=step) == step
            for k, v in saved[step].items():
                assert torch.equal(target[k], v), (rank, step, k)
    finally:
        fresh.close()


def _replicated_state(rank: int, world: int, step: int, *, corrupt: str = "") -> dict[str, object]:
    """Plain tensors every rank holds alike, a DTensor replicated over the first dimension of a
    (2, world / 2) mesh (HSDP-like: pairs of ranks hold each box) and a plain tensor of each rank's
    own, which gives every rank a structure of its own (as the TP columns of an FSDP x TP job have):
    the plain tensors are compared across structures. And a DTensor replicated over the first mesh
    dimension and strided over the second (FSDP2 over TP's `_StridedShard`), which leaves a rank
    of four two separate boxes of one key. ``corrupt``: the last rank holds other bytes in one plain
    tensor ("plain"), in its box of the DTensor ("dtensor") or in its last box of the strided one
    ("strided")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(step)
    state: dict[str, object] = {f"w{i}": torch.randn(4, 3, generator=g) for i in range(40)}
    state["h"] = distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Replicate(), Shard(0)])
    state[f"own{rank}"] = torch.randn(7, generator=torch.Generator().manual_seed(step * 10 + rank))
    # _StridedShard(0, split_factor=2) over the second dimension: this rank's cut of each half of the rows.
    full = torch.randn(8, 3, generator=g)
    cut, at = 4 // (world // 2), mesh.get_coordinate()[1]
    local = torch.cat([full[half + at * cut: half + (at + 1) * cut] for half in (0, 4)])
    state["x"] = DTensor.from_local(local, mesh, [Replicate(), _StridedShard(0, split_factor=2)], run_check=False,
                                    shape=full.shape, stride=full.stride())
    if corrupt == "plain" and rank == world - 1:
        state["w3"][1, 2] += 1.0  # type: ignore[index]
    if corrupt == "dtensor" and rank == world - 1:
        state["h"].to_local()[0, 0] += 1.0  # type: ignore[attr-defined]
    if corrupt == "strided" and rank == world - 1:
        state["x"].to_local()[-1, 0] += 1.0  # type: ignore[attr-defined]
    return state


def replica_check_job(rank: int, world: int, name: str, root: str, out: str) -> None:
    """``sdc="warn"`` on one node's local directory: steps 1-4 saved with every replica alike (3 and
    4 counted as steady saves), step 5 with the last rank's copy of a plain tensor changed, step 6
    with its box of the DTensor changed, step 7 its last box of the strided DTensor. Writes ``out/sdc-w<world>-r<rank>.json``: bytes and
    collectives by group of the steady saves, and the bytes of the neighbours' swap apart."""
    from ckptstore import collective

    swapped = [0]
    real = collective.Group.swap_int64

    def counted(self, send, recv):  # type: ignore[no-untyped-def]
        swapped[0] += 8 * sum(recv.values())
        return real(self, send, recv)

    collective.Group.swap_int64 = counted  # type: ignore[method-assign]
    store = ckptstore.CheckpointStore(name, local=os.path.join(root, f"sdc-local-{world}"), keep_local=10, sdc="warn")
    got: dict[str, dict[str, float]] = {}
    for step in (1, 2, 3, 4, 5, 6, 7):
        state = _replicated_state(rank, world, step, corrupt={5: "plain", 6: "dtensor", 7: "strided"}.get(step, ""))
        if step in (3, 4):
            swapped[0] = 0
            with counting() as traffic:
                store.save(step, state).wait("local")
            for role, n in traffic.by_role.items():
                got.setdefault(role, {"bytes": 0, "calls": 0})
                got[role]["bytes"] += n / 2
                got[role]["calls"] += traffic.calls_by_role[role] / 2
            got.setdefault("swap", {"bytes": 0, "calls": 0})["bytes"] += swapped[0] / 2
        else:
            store.save(step, state).wait("local")
    store.close()
    with open(os.path.join(out, f"sdc-w{world}-r{rank}.json"), "w") as fh:
        json.dump(got, fh)


def _reused_state(rank: int, world: int, step: int, *, corrupt: str = "", blank: bool = False) -> dict[str, object]:
    """Replicas of every kind the check stages or hashes: contiguous plain tensors (hashed in
    place by the ranks that do not write them), a transposed one (staged to be compared), a
    replicated DTensor and a sharded one, and a per-rank value that grows at step 4 (within the room
    the slot keeps for it) and at step 6 (past it). ``corrupt``:
    the last rank's copy of one replica differs ("transposed", "plain" or "dtensor"). ``blank``:
    zeros of the same structure, to restore into."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(step)
    state: dict[str, object] = {f"w{i}": torch.randn(4, 3, generator=g) for i in range(20)}
    state["t"] = torch.randn(6, 5, generator=g).t()
    state["h"] = distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Replicate()])
    state["s"] = distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Shard(0)])
    state["rng"] = ckptstore.PerRank(torch.arange(3 if step < 4 else 9 if step < 6 else 5000) + 100 * rank + step)
    if blank:
        for v in state.values():
            if isinstance(v, torch.Tensor):
                (v.to_local() if hasattr(v, "to_local") else v).zero_()  # type: ignore[operator]
        state["rng"] = ckptstore.PerRank(None)
    elif rank == world - 1 and corrupt:
        target = {"transposed": state["t"], "plain": state["w3"], "dtensor": state["h"].to_local()}[corrupt]  # type: ignore[attr-defined]
        target[1, 2] += 1.0  # type: ignore[index]
    return state


def replica_check_reuse_job(rank: int, world: int, name: str, root: str, out: str) -> None:
    """``sdc="warn"`` with the plan reused from the second save on: steps 1-7 of one structure
    (the per-rank value longer at steps 4 and 6), the last rank's copy of one replica changed at
    steps 3, 5 and 6; then steps 4 and 7 restored bitwise in a new store. Writes ``out/reuse-w<world>-r<rank>.json``:
    whether each save reused the plan."""
    from ckptstore.engine import pipeline

    reused: list[bool] = []
    real = pipeline.Pipeline._reuse

    def counted(self, job, found):  # type: ignore[no-untyped-def]
        got = real(self, job, found)
        reused.append(got is not None)
        return got

    pipeline.Pipeline._reuse = counted  # type: ignore[method-assign]
    local = os.path.join(root, f"reuse-local-{world}")
    with ckptstore.CheckpointStore(name, local=local, keep_local=10, sdc="warn") as store:
        for step in range(1, 8):
            corrupt = {3: "transposed", 5: "plain", 6: "dtensor"}.get(step, "")
            store.save(step, _reused_state(rank, world, step, corrupt=corrupt)).wait("local")
    with ckptstore.CheckpointStore(name + "-again", local=local, keep_local=10, sdc="warn") as fresh:
        for step in (4, 7):
            got = _reused_state(rank, world, step, blank=True)
            assert fresh.restore(got, step=step) == step
            want = _reused_state(rank, world, step)
            for k, v in want.items():
                if isinstance(v, ckptstore.PerRank):
                    assert torch.equal(got[k].value, v.value), (rank, step, k)  # type: ignore[attr-defined]
                else:
                    a = got[k].to_local() if hasattr(got[k], "to_local") else got[k]  # type: ignore[attr-defined]
                    b = v.to_local() if hasattr(v, "to_local") else v  # type: ignore[attr-defined]
                    assert torch.equal(a, b), (rank, step, k)
    with open(os.path.join(out, f"reuse-w{world}-r{rank}.json"), "w") as fh:
        json.dump({"reused": reused}, fh)


def replica_check_replan_job(rank: int, world: int, name: str, root: str, out: str) -> None:
    """``sdc="warn"``, three ranks holding "x" and "y" alike; the last rank drops "x" from step 3
    on, so at step 3 the others take their reused plan and then plan again after the vote. Saves
    are not waited for, rank 0's round one of step 2 is held back 2 s and rank 1 reaches step 3
    1.5 s late: step 2 is still being compared while step 3 is planned. Writes
    ``out/replan-r<rank>.json``: the replica groups each step's round one saw, and its mismatches."""
    import time

    from ckptstore.engine import pipeline, replicas

    jobs: dict[int, object] = {}
    seen: dict[int, dict[str, list[int]]] = {}
    collect, neighbours = pipeline.Pipeline._collect, replicas.ReplicaCheck.neighbours

    def remembered(self, job, state):  # type: ignore[no-untyped-def]
        jobs[job.step] = job
        return collect(self, job, state)

    def held_back(self, group, job):  # type: ignore[no-untyped-def]
        if rank == 0 and job.step == 2:
            time.sleep(2.0)
        seen[job.step] = {v[0]: list(v[4]) for v in job.replicated.values()}
        return neighbours(self, group, job)

    pipeline.Pipeline._collect = remembered  # type: ignore[method-assign]
    replicas.ReplicaCheck.neighbours = held_back  # type: ignore[method-assign]
    with ckptstore.CheckpointStore(name, local=os.path.join(root, f"replan-{rank}"), sdc="warn") as store:
        for step in (1, 2, 3, 4):
            if rank == 1 and step == 3:
                time.sleep(1.5)
            g = torch.Generator().manual_seed(step)
            state = {"x": torch.randn(64, generator=g), "y": torch.randn(64, generator=g)}
            if rank == world - 1 and step >= 3:
                del state["x"]
            store.save(step, state)
    with open(os.path.join(out, f"replan-r{rank}.json"), "w") as fh:
        json.dump({"seen": seen, "sdc": {s: j.sdc for s, j in jobs.items()}}, fh)  # type: ignore[attr-defined]
