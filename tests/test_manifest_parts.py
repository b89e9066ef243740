"""Format 2.0: a store's durable manifest names each rank's part file (its size and checksum)
instead of listing every chunk, so its size and its committer's cost grow with ranks plus tensors.
A step written so by two gloo ranks loads bitwise through load_sharded and the store's restore, in
its layout and resharded (each on one of the two storages, the other way round on the other), on a
local directory and on a real S3 server; an old (1.x) step still
loads; the CLI reads the new one; a damaged or missing part is refused, naming the part file."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import s3_object_bytes, wipe_ram

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.errors import CorruptCheckpointError, UnsupportedFormatVersionError
from ckptstore.names import INDEX, MANIFEST

STEP = "step-000000000001"


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(9, 4, generator=g),  # uneven over 2 ranks
        "v": torch.randn(6, 5, generator=g).to(torch.bfloat16),
        "plain": torch.randn(5, generator=g),  # replicated: one rank writes it whole
        "n": torch.tensor(3),
    }


def _state(mesh: Any, dim: int, *, zeros: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}
    for k, v in _full().items():
        base = torch.zeros_like(v) if zeros else v.clone()
        out[k] = distribute_tensor(base, mesh, [Shard(dim)]) if k in ("w", "v") else base
    return out


def _check(target: dict[str, Any], what: str) -> None:
    for k, v in _full().items():
        got = target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k]
        assert torch.equal(got, v), (what, k)


def parted_job(rank: int, world: int, name: str, root: str, s3_url: str, storage_options: dict[str, Any]) -> None:
    """Each rank saves a Shard(0) state to the durable tier (a local directory, then S3) and loads
    the committed step with load_sharded, and, its RAM copy gone, through the store's restore: one
    of the two in the layout it saved, the other resharded (Shard(1)), the other way round on the
    other storage."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for label, durable, opts, dims in (("file", os.path.join(root, "durable"), None, (0, 1)),
                                       ("s3", s3_url, storage_options, (1, 0))):
        ram = os.path.join(root, f"ram-{label}-{rank}")
        os.makedirs(ram, exist_ok=True)
        job = f"{name}-{label}"
        with CheckpointStore(job, durable=durable, durable_every=1, ram_dir=ram, storage_options=opts) as store:
            store.save(1, _state(mesh, 0, zeros=False)).wait("durable")
        target = _state(mesh, dims[0], zeros=True)
        ckptstore.load_sharded(target, f"{durable}/{STEP}", storage_options=opts)
        _check(target, f"{label} load_sharded Shard({dims[0]})")
        for f in os.listdir(ram):
            os.unlink(os.path.join(ram, f))
        target = _state(mesh, dims[1], zeros=True)
        with CheckpointStore(job, durable=durable, ram_dir=ram, storage_options=opts) as store:
            assert store.restore(target) == 1
        _check(target, f"{label} restore Shard({dims[1]})")


@pytest.fixture(scope="module")
def parted(s3_server, tmp_path_factory):
    """One run of :func:`parted_job` on 2 ranks; yields the local durable root and the S3 step's key."""
    import dist_workers

    tmp = tmp_path_factory.mktemp("parted")
    name = f"test-parts-{uuid.uuid4().hex[:8]}"
    prefix = f"parts-{uuid.uuid4().hex[:8]}"
    try:
        dist_workers.spawn(2, "test_manifest_parts:parted_job", tmp, name=name, root=str(tmp),
                           s3_url=f"s3://{s3_server['bucket']}/{prefix}",
                           storage_options=s3_server["storage_options"])
    finally:
        wipe_ram(f"{name}-file")
        wipe_ram(f"{name}-s3")
    yield tmp / "durable" / STEP, f"{prefix}/{STEP}/{MANIFEST}"


def _assert_parted(body: bytes, world: int = 2) -> dict[str, Any]:
    doc = json.loads(body)
    assert doc["format_version"] == "2.0" and doc["kind"] == "sharded"
    assert [p[0] for p in doc["parts"]] == [f"parts/rank-{r:05d}.json" for r in range(world)] or len(doc["parts"]) == world
    # Only a tensor one rank wrote whole lists its chunks (its writer's), so that a rank loading
    # it reads no other part; the chunks of every other tensor stay in the part files.
    assert all("writer" in e for e in doc["tensors"].values() if "chunks" in e)
    assert "chunks" in doc["tensors"]["plain"] and "chunks" not in doc["tensors"]["w"]
    return doc


def test_two_ranks_commit_a_parted_manifest_that_loads_bitwise_everywhere(parted, s3_server):
    """The durable manifest (format 2.0) lists only the chunks of the tensor one rank wrote whole and names both ranks' parts; both copies
    (local directory, SeaweedFS) loaded bitwise on both ranks (parted_job)."""
    step_dir, s3_key = parted
    doc = _assert_parted((step_dir / MANIFEST).read_bytes())
    assert not (step_dir / INDEX).exists()  # the manifest is its own index
    assert doc["tensors"]["plain"]["writer"] in (0, 1) and "writer" not in doc["tensors"]["w"]
    # The layout digest the coordinator composed from the ranks' digests names the chunk table as
    # a reader of the whole table names it (copies of a step are grouped by it on restore).
    from ckptstore.checkpoint.sharded import Directory, read_manifest
    from ckptstore.format.manifest import layout_digest

    assert doc["layout"] == layout_digest(read_manifest(Directory(str(step_dir), None)))
    _assert_parted(s3_object_bytes(s3_server, s3_key))


def _copy(step_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "step"
    shutil.copytree(step_dir, dst)
    return dst


def _load_whole(step: Path) -> dict[str, Any]:
    target: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _full().items()}
    ckptstore.load_sharded(target, str(step))
    return target


def test_an_old_format_step_still_loads_and_an_old_reader_refuses_the_new_one(parted, tmp_path, monkeypatch):
    """The same step rewritten by the 1.x writer (with and without its index) loads bitwise into
    another world size, as the 2.0 one does; a reader of major 1 refuses 2.0 with 'upgrade'."""
    from v1_writer import downgrade

    from ckptstore.format import manifest as fm

    step = _copy(parted[0], tmp_path)
    _check(_load_whole(step), "2.0")
    with monkeypatch.context() as m:
        m.setattr(fm, "READ_MAJOR", 1)
        with pytest.raises(UnsupportedFormatVersionError, match="Upgrade ckptstore"):
            _load_whole(step)
    for index in (True, False):
        body = downgrade(step, index=index)
        assert json.loads(body)["format_version"] == "1.1"
        assert (step / INDEX).exists() == index
        _check(_load_whole(step), f"1.1 index={index}")
        if index:
            (step / INDEX).unlink()


def test_the_cli_inspects_and_verifies_a_parted_step(parted, tmp_path, capsys):
    from ckptstore.cli import main

    step = _copy(parted[0], tmp_path)
    _assert_parted((step / MANIFEST).read_bytes())
    assert main(["inspect", str(step)]) == 0
    out = capsys.readouterr().out
    assert "w" in out and "plain" in out
    assert main(["verify", str(step)]) == 0


@pytest.mark.parametrize("damage", ["byte", "missing"])
def test_a_damaged_or_missing_part_file_is_refused_naming_it(parted, tmp_path, capsys, damage):
    """load_sharded and the CLI's verify refuse the step with a CorruptCheckpointError naming the
    part file; no tensor is filled from it."""
    from ckptstore.cli import main

    step = _copy(parted[0], tmp_path)
    _assert_parted((step / MANIFEST).read_bytes())
    part = step / "parts" / "rank-00001.json"
    if damage == "byte":
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0x01
        part.write_bytes(bytes(data))
    else:
        part.unlink()
    with pytest.raises(CorruptCheckpointError, match="parts/rank-00001.json"):
        _load_whole(step)
    assert main(["verify", str(step)]) != 0
    assert "rank-00001.json" in capsys.readouterr().err


def _reseal(step: Path, edit: Any) -> None:
    from ckptstore.format.checksum import checksum

    doc = json.loads((step / MANIFEST).read_bytes())
    doc.pop("checksum")
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    (step / MANIFEST).write_bytes(body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}')


def _other_writer(doc: dict[str, Any]) -> None:
    doc["tensors"]["plain"]["writer"] = 1 - doc["tensors"]["plain"]["writer"]


@pytest.mark.parametrize("edit", [
    _other_writer,
    lambda d: d["parts"].pop(),  # fewer parts than world_size
    lambda d: (d["parts"].pop(), d["meta"].update(world_size=1)),  # a world of one: rank 1's chunks unread
    lambda d: d["parts"].reverse(),  # each rank's slot names the other's part
], ids=["wrong-writer", "fewer-parts", "world-shrunk", "parts-swapped"])
def test_a_forged_two_rank_manifest_is_refused(parted, tmp_path, edit):
    """Hostile edits that need two ranks' parts: a tensor's writer moved to the rank that did not
    write it, a part left out (with or without the world size shrunk), the parts' order swapped."""
    step = _copy(parted[0], tmp_path)
    _reseal(step, edit)
    with pytest.raises(CorruptCheckpointError, match=str(step)):
        _load_whole(step)
