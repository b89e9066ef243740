"""The index beside a sharded manifest: a rank plans its load from the index and the part files it
needs, never the whole world's chunk table, and loads bitwise what the manifest would have loaded;
a step without a sound index is read through its manifest."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import wipe_ram

from ckptstore import CheckpointStore
from ckptstore.checkpoint import sharded
from ckptstore.checkpoint.index import build_index, plan_from_index
from ckptstore.checkpoint.sharded import Directory, GlobalBox, build_manifest, chunks_needed, load_manifest
from ckptstore.collective import Group
from ckptstore.format.checksum import checksum
from ckptstore.format.manifest import layout_digest, parse_manifest
from ckptstore.names import INDEX, MANIFEST

WORLD, ROWS, COLS, TENSORS = 16, 40, 6, 5


def _rows(rank: int, world: int) -> tuple[int, int]:
    per = -(-ROWS // world)
    start = min(rank * per, ROWS)
    return start, min(per, ROWS - start)


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """A checkpoint of WORLD ranks, each writing a Shard(0) slab of TENSORS tensors, and one tensor
    written whole by rank 3 (replicated, deduplicated): real data files, parts, manifest, index."""
    root = tmp_path_factory.mktemp("index")
    os.makedirs(root / "data")
    os.makedirs(root / "parts")
    g = torch.Generator().manual_seed(7)
    full = {f"w{i}": torch.randint(0, 256, (ROWS, COLS), dtype=torch.uint8, generator=g) for i in range(TENSORS)}
    full["bias"] = torch.randint(0, 256, (COLS,), dtype=torch.uint8, generator=g)
    parts = []
    for r in range(WORLD):
        start, n = _rows(r, WORLD)
        chunks, blob = {}, b""
        pieces = [(k, full[k][start:start + n], [start, 0]) for k in full if k != "bias"]
        if r == 3:
            pieces.append(("bias", full["bias"], [0]))
        for key, piece, offsets in pieces:
            data = piece.contiguous().numpy().tobytes()
            chunks[key] = [{"offsets": offsets, "sizes": list(piece.shape), "file": f"data/rank-{r:05d}.bin",
                            "offset": len(blob), "length": len(data), "codec": "raw", "checksum": checksum(data),
                            "block_size": None, "block_checksums": None}]
            blob += data
        (root / f"data/rank-{r:05d}.bin").write_bytes(blob)
        body = json.dumps({"rank": r, "chunks": chunks}).encode()
        (root / f"parts/rank-{r:05d}.json").write_bytes(body)
        parts.append({"rank": r, "host": "h", "pid": 1, "bytes": len(blob), "timings": {}, "chunks": chunks,
                      "part_file": f"parts/rank-{r:05d}.json", "part_checksum": checksum(body)})
    tree = {k: {"$tensor": k} for k in full}
    table = {k: ("uint8", tuple(v.shape)) for k, v in full.items()}
    manifest = build_manifest(tree, table, parts, WORLD)
    body = manifest.to_json_bytes()
    (root / MANIFEST).write_bytes(body)
    index = build_index(manifest, parts, layout_digest(manifest))
    assert index is not None
    (root / INDEX).write_bytes(index)
    return root, full


class _Counting:
    def __init__(self, root) -> None:
        self.directory, self.read = Directory(str(root), None), {}

    def __call__(self, rel: str) -> bytes:
        data = self.directory.read_small(rel)
        self.read[rel] = self.read.get(rel, 0) + len(data)
        return data


def _target(full, start: int, n: int, cols: tuple[int, int] = (0, COLS)):
    state = {k: GlobalBox(torch.zeros(n, cols[1] - cols[0], dtype=torch.uint8), (start, cols[0]), (ROWS, COLS),
                          torch.uint8) for k in full if k != "bias"}
    state["bias"] = torch.zeros(COLS, dtype=torch.uint8)
    return state


def _load(root, manifest, state) -> None:
    load_manifest(state, manifest, str(root), Directory(str(root), None).open, group=Group.solo(), strict=True,
                  per_rank="error", buffer_bytes=1 << 20, decode_per_rank=lambda b, w: b)


@pytest.mark.parametrize("how", ["saved layout", "uneven rows", "columns"])
def test_a_rank_plans_its_load_from_the_index_and_the_parts_it_needs(synthesized, how):
    root, full = synthesized
    rank = 5
    if how == "saved layout":
        start, n = _rows(rank, WORLD)
        state, cols = _target(full, start, n), (0, COLS)
    elif how == "uneven rows":
        start, n = _rows(rank, WORLD - 4)  # as a world of four ranks less cuts the rows
        state, cols = _target(full, start, n), (0, COLS)
    else:
        start, n, cols = 0, ROWS, (2, 4)
        state = _target(full, start, n, cols)
    read = _Counting(root)
    planned = plan_from_index(read, state, rank, WORLD, str(root))
    assert planned is not None
    manifest_bytes = os.path.getsize(root / MANIFEST)
    # At the layout it saved, the index and its own part; resharded, the parts of the tensors'
    # writers (the index says who they are, not what they hold). Never the manifest.
    writers = {rank} if how == "saved layout" else set(range(WORLD))
    assert set(read.read) == {INDEX} | {f"parts/rank-{r:05d}.json" for r in writers}, read.read
    if how == "saved layout":
        assert sum(read.read.values()) < manifest_bytes / 4, (read.read, manifest_bytes)
    # The same reads as the whole manifest plans, and the same bytes.
    whole = sharded.read_manifest(Directory(str(root), None))
    assert chunks_needed(_target(full, start, n, cols), planned, str(root), rank, WORLD) == chunks_needed(
        _target(full, start, n, cols), whole, str(root), rank, WORLD)
    _load(root, planned, state)
    for k, v in full.items():
        got = state[k] if k == "bias" else state[k].tensor
        want = v if k == "bias" else v[start:start + n, cols[0]:cols[1]]
        assert torch.equal(got, want), k


def test_a_damaged_part_or_index_is_refused_never_half_read(synthesized, tmp_path):
    root, full = synthesized
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    part = copy / "parts/rank-00005.json"
    part.write_bytes(part.read_bytes().replace(b'"rank"', b'"rank" '))
    start, n = _rows(5, WORLD)
    with pytest.raises(Exception, match="does not match the index's checksum"):
        plan_from_index(_Counting(copy), _target(full, start, n), 5, WORLD, str(copy))
    index = copy / INDEX
    index.write_bytes(index.read_bytes().replace(b'"w0"', b'"w9"', 1))
    with pytest.raises(Exception, match="does not match its own checksum"):
        plan_from_index(_Counting(copy), _target(full, start, n), 5, WORLD, str(copy))


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(8, 4, generator=g) for i in range(6)} | {"n": torch.tensor(step)}


@pytest.mark.parametrize("index", ["sound", "absent", "damaged", "parted"])
def test_a_restore_from_the_durable_tier_plans_from_its_index(job, tmp_path, monkeypatch, caplog, index):
    """The durable copy restores bitwise through its index without reading its whole chunk table: a
    format 2.0 manifest is itself the index ("parted"); a 1.x step (the old writer's) restores
    through its index.json ("sound"), and one written before indexes existed (none) or whose index
    is damaged restores through its manifest."""
    from v1_writer import downgrade

    durable = tmp_path / "durable"
    with CheckpointStore(job, durable=str(durable), durable_every=1) as store:
        store.save(1, _state(1)).wait("durable")
    step_dir = durable / "step-000000000001"
    if index != "parted":
        manifest = parse_manifest(downgrade(step_dir), where="m")
        # The index names the committed chunk table as every copy read back is named (copies of a
        # step are grouped by it on restore).
        assert json.loads((step_dir / INDEX).read_bytes())["layout"] == layout_digest(manifest)
    if index == "absent":
        (step_dir / INDEX).unlink()
    elif index == "damaged":
        (step_dir / INDEX).write_bytes((step_dir / INDEX).read_bytes()[:-30] + b"x" * 30)
    wipe_ram(job)
    reads: list[str] = []
    real = Directory.read_small

    def counted(self, rel):
        reads.append(rel)
        return real(self, rel)

    monkeypatch.setattr(Directory, "read_small", counted)
    with caplog.at_level(logging.WARNING, logger="ckptstore"), CheckpointStore(job, durable=str(durable)) as store:
        target = {k: torch.zeros_like(v) for k, v in _state(1).items()}
        assert store.restore(target) == 1
    for k, v in _state(1).items():
        assert torch.equal(target[k], v), k
    if index == "sound":
        assert MANIFEST not in reads, reads
        assert INDEX in reads
    else:
        assert MANIFEST in reads
    assert ("cannot read the index" in caplog.text) == (index == "damaged")


def dtensor_restore_job(rank: int, world: int, name: str, root: str) -> None:
    """Each rank saves a Shard(0) slice of every tensor to the durable tier; after its RAM copy is
    gone, it restores bitwise through the index, reading the index and its own part file only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    full = {f"w{i}": torch.randn(4 * world + 1, 3, generator=g) for i in range(4)}
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()} | {"bias": full["w0"][0].clone()}
    ram = os.path.join(root, f"ram-{rank}")
    os.makedirs(ram, exist_ok=True)
    with CheckpointStore(name, durable=os.path.join(root, "durable"), durable_every=1, ram_dir=ram) as store:
        store.save(1, state).wait("durable")
    for f in os.listdir(ram):
        os.unlink(os.path.join(ram, f))
    reads: list[str] = []
    real = Directory.read_small

    def counted(self, rel):
        reads.append(rel)
        return real(self, rel)

    Directory.read_small = counted  # type: ignore[method-assign]
    try:
        target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
        target["bias"] = torch.zeros(3)
        with CheckpointStore(name, durable=os.path.join(root, "durable"), ram_dir=ram) as store:
            assert store.restore(target) == 1
    finally:
        Directory.read_small = real  # type: ignore[method-assign]
    for k, v in full.items():
        assert torch.equal(target[k].full_tensor(), v), k
    assert torch.equal(target["bias"], full["w0"][0])
    # Its format 2.0 manifest is the index (index.json is looked for first: a 1.x step has one); the
    # plain tensor's one writer's part is read too when that writer is another rank.
    own = f"parts/rank-{rank:05d}.json"
    assert {INDEX, MANIFEST, own} <= set(reads) <= {INDEX, MANIFEST, own, f"parts/rank-{1 - rank:05d}.json"}, reads


@pytest.mark.slow
def test_ranks_restore_dtensors_from_the_durable_tier_reading_their_own_index(tmp_path):
    import dist_workers

    name = f"test-index-{tmp_path.name}"
    try:
        dist_workers.spawn(2, "test_manifest_index:dtensor_restore_job", tmp_path, name=name, root=str(tmp_path))
    finally:
        wipe_ram(name)
