"""A CheckpointStore's local and durable tiers commit format 2.0 as save_sharded does: a tensor one
rank wrote whole (a replicated one) lists its chunks in the manifest's entry, so every rank, on
two real gloo processes, restores it reading no part file but its own, from the local directory
and from the durable tier on a real S3 server (SeaweedFS, or moto where it cannot run). What the
durable coordinator receives per rank stays the same as the sharded tensors grow, and grows once
per replicated tensor, never per rank; local steps left by 1.x writers still restore."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import torch
from conftest import s3_object_bytes, wipe_ram
from dist_workers import spawn

from ckptstore import CheckpointStore, load_sharded
from ckptstore.checkpoint.sharded import Directory
from ckptstore.names import INDEX, MANIFEST, step_dir


def _full(sharded: int, plain: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {f"s{i}": torch.randn(8, 3, generator=g) for i in range(sharded)}
    # Replicated: every rank holds the same bytes, and one rank writes each of them whole.
    return out | {f"p{i}": torch.randn(5, 2, generator=g) for i in range(plain)}


def _state(full: dict[str, torch.Tensor], *, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    out: dict[str, Any] = {}
    for k, v in full.items():
        base = torch.zeros_like(v) if zeros else v.clone()
        out[k] = distribute_tensor(base, mesh, [Shard(0)]) if k.startswith("s") else base
    return out


def _check(target: dict[str, Any], full: dict[str, torch.Tensor], what: str) -> None:
    for k, v in full.items():
        got = target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k]
        assert torch.equal(got, v), (what, k)


class _Reads:
    """The small files (manifest, index, part files) this process reads through a Directory."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.real = Directory.read_small

    def __enter__(self) -> _Reads:
        real, names = self.real, self.names

        def counted(directory: Directory, rel: str) -> bytes:
            names.append(rel)
            return real(directory, rel)

        Directory.read_small = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        Directory.read_small = self.real  # type: ignore[method-assign]


def replicated_job(rank: int, world: int, name: str, root: str, durable: str, storage_options: dict[str, Any]) -> None:
    """Save a state of Shard(0) and replicated tensors to the local and durable tiers; then each
    rank loads it from each copy and reads only its own part file (load_sharded on the local step,
    the store's restore from the durable tier alone), and restores it from the local tier, bitwise."""
    full = _full(2, 4)
    local = os.path.join(root, "local")
    ram = os.path.join(root, f"ram-{rank}")
    os.makedirs(ram, exist_ok=True)
    with CheckpointStore(name, local=local, durable=durable, durable_every=1, ram_dir=ram,
                         storage_options=storage_options) as store:
        store.save(1, _state(full, zeros=False)).wait("durable")
    wipe_ram(name)
    own = f"parts/rank-{rank:05d}.json"
    step = os.path.join(local, step_dir(1))
    with open(os.path.join(step, MANIFEST), "rb") as fh:
        doc = json.loads(fh.read())
    assert doc["format_version"] == "2.0" and not os.path.exists(os.path.join(step, INDEX)), doc["format_version"]
    # Both ranks wrote some of the replicated tensors: each loads at least one the other wrote.
    assert {doc["tensors"][f"p{i}"]["writer"] for i in range(4)} == {0, 1}, doc["tensors"]
    with _Reads() as reads:
        target = _state(full, zeros=True)
        load_sharded(target, step)
    _check(target, full, "load_sharded of the local step")
    assert set(reads.names) == {INDEX, MANIFEST, own}, reads.names  # index.json: only looked for

    # The durable copy alone (no local tier, a RAM directory of its own): planned from its manifest.
    alone = os.path.join(root, f"alone-{rank}")
    os.makedirs(alone, exist_ok=True)
    with _Reads() as reads, CheckpointStore(name, durable=durable, ram_dir=alone,
                                            storage_options=storage_options) as store:
        target = _state(full, zeros=True)
        assert store.restore(target) == 1
    _check(target, full, "restore from the durable tier")
    assert set(reads.names) <= {INDEX, MANIFEST, own} and own in reads.names, reads.names

    # The local copy, read through its node parts: no part file of another rank either.
    fresh = os.path.join(root, f"fresh-{rank}")
    os.makedirs(fresh, exist_ok=True)
    with _Reads() as reads, CheckpointStore(name, local=local, ram_dir=fresh) as store:
        target = _state(full, zeros=True)
        assert store.restore(target) == 1
    _check(target, full, "restore from the local tier")
    assert not [n for n in reads.names if n.startswith("parts/") and n != own], reads.names


def test_a_replicated_tensor_restores_from_its_writers_entry_in_every_tier(tmp_path, s3_server):
    name = f"test-sp-{uuid.uuid4().hex[:8]}"
    prefix = f"sp-{uuid.uuid4().hex[:8]}"
    try:
        spawn(2, "test_store_parted:replicated_job", tmp_path, name=name, root=str(tmp_path),
              durable=f"s3://{s3_server['bucket']}/{prefix}", storage_options=s3_server["storage_options"])
    finally:
        wipe_ram(name)
    doc = json.loads(s3_object_bytes(s3_server, f"{prefix}/{step_dir(1)}/{MANIFEST}"))
    assert doc["format_version"] == "2.0"
    for i in range(4):  # the writer's own chunks, listed where the restore reads them
        entry = doc["tensors"][f"p{i}"]
        assert entry["writer"] in (0, 1) and [c["sizes"] for c in entry["chunks"]] == [[5, 2]], entry
    assert all("chunks" not in doc["tensors"][f"s{i}"] for i in range(2))


def received_job(rank: int, world: int, name: str, root: str, out: str) -> None:
    """Save states of growing size to a durable directory; rank 0 records what its durable group
    received during each save (the coordinator's summaries), by state."""
    from ckptstore.collective import counting

    got: dict[str, int] = {}
    for sharded, plain in ((4, 2), (64, 2), (4, 64)):
        full = _full(sharded, plain)
        job = f"{name}-{sharded}-{plain}"
        ram = os.path.join(root, f"ram-{job}-{rank}")
        os.makedirs(ram, exist_ok=True)
        durable = os.path.join(root, f"durable-{sharded}-{plain}")
        try:
            with CheckpointStore(job, durable=durable, durable_every=1, ram_dir=ram) as store:
                with counting() as traffic:
                    store.save(1, _state(full, zeros=False)).wait("durable")
                got[f"{sharded}x{plain}"] = traffic.by_role.get("durable", 0)
        finally:
            wipe_ram(job)
        if rank == 0:
            with open(os.path.join(durable, step_dir(1), MANIFEST), "rb") as fh:
                doc = json.loads(fh.read())
            got[f"{sharded}x{plain}-listed"] = sum("chunks" in e for e in doc["tensors"].values())
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(got, fh)


def test_the_coordinator_receives_a_summary_per_rank_that_does_not_grow_with_ranks_x_tensors(tmp_path):
    """Rank 0's own summary holds the origin of every Shard(0) tensor and its structure's header
    (tree, tensor table): neither may travel, nor pad what the other ranks send. So 60 more
    sharded tensors change nothing the coordinator receives but a few bytes of numbers; 62 more
    replicated ones add each tensor's chunk once (from whichever rank wrote it), and the manifest
    lists each of them."""
    out = tmp_path / "received.json"
    name = f"test-rcv-{uuid.uuid4().hex[:8]}"
    spawn(2, "test_store_parted:received_job", tmp_path, name=name, root=str(tmp_path), out=str(out))
    got = json.loads(out.read_text())
    base, more_sharded, more_plain = got["4x2"], got["64x2"], got["4x64"]
    assert abs(more_sharded - base) <= 64, got
    # One rank of two wrote about half of the 62 more replicated tensors: at most one chunk each
    # (~200 B pickled, key included), never one per rank per tensor.
    assert 0 < more_plain - base <= 62 * 300, got
    assert got["4x2-listed"] == 2 and got["4x64-listed"] == 64, got


def test_local_steps_of_1x_writers_still_restore(tmp_path, job):
    """A local step rewritten as a 1.x writer left it (a manifest listing every chunk, with or
    without the node parts a store of that time wrote beside it) restores bitwise from the local
    tier, as the 2.0 step it was does."""
    import shutil

    from v1_writer import downgrade

    full = _full(0, 3)
    local = tmp_path / "local"
    ram = tmp_path / "ram"
    ram.mkdir()
    with CheckpointStore(job, local=str(local), ram_dir=str(ram)) as store:
        store.save(1, {k: v.clone() for k, v in full.items()}).wait("local")
    step = local / step_dir(1)
    assert json.loads((step / MANIFEST).read_bytes())["format_version"] == "2.0"
    for case in ("2.0", "1.x", "1.x-no-node-parts"):
        if case == "1.x":
            downgrade(step, index=False)
            assert json.loads((step / MANIFEST).read_bytes())["format_version"].startswith("1.")
        elif case == "1.x-no-node-parts":
            shutil.rmtree(step / "node-parts")
        fresh = tmp_path / f"ram-{case}"
        fresh.mkdir()
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        with CheckpointStore(job, local=str(local), ram_dir=str(fresh)) as store:
            assert store.restore(target) == 1, case
        _check(target, full, case)
