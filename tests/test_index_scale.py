"""A rank loading the layout it saved reads what indexes the step and its own part file, never the
whole world's chunk table: a 2.0 manifest (steps the node agent committed for a dead trainer,
``save_sharded`` checkpoints on one rank and on several real gloo processes, replicated tensors
included), or a 1.x manifest's index.json (checkpoints written before 2.0), while a resharded load
still reads every stored byte once and bitwise; a 1.x checkpoint without an index loads through its
manifest, and a damaged index falls back to it with a warning."""

from __future__ import annotations

import json
import logging
import signal

import torch
import warm_python
from dist_workers import spawn

from ckptstore import CheckpointStore, load_sharded, save_sharded
from ckptstore.checkpoint.sharded import Directory
from ckptstore.engine.agent import NodeAgent
from ckptstore.names import INDEX, MANIFEST, step_dir


class _Reads:
    """The small files (manifest, index, parts) this process reads, by name."""

    def __init__(self, monkeypatch) -> None:
        self.names: list[str] = []
        real = Directory.read_small

        def counted(directory, rel):
            self.names.append(rel)
            return real(directory, rel)

        monkeypatch.setattr(Directory, "read_small", counted)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(16, 8, generator=g) for i in range(5)} | {"n": torch.tensor(seed)}


_TRAINER = """
import sys, torch
from ckptstore import CheckpointStore
from ckptstore._faults import arm
job, durable, ram = sys.argv[1:4]
g = torch.Generator().manual_seed(1)
state = {f"w{i}": torch.randn(16, 8, generator=g) for i in range(5)} | {"n": torch.tensor(1)}
arm("ram.committed")  # killed right after the RAM commit, before the durable tier got a byte
with CheckpointStore(job, durable=durable, durable_every=1, ram_dir=ram) as store:
    store.save(1, state)
"""


def test_a_step_the_agent_promoted_restores_through_its_index(tmp_path, job, monkeypatch, caplog):
    """A trainer SIGKILLed after its RAM commit leaves step 1 to the node agent, which commits it in
    the durable tier as the store's coordinator does (format 2.0: the manifest names the part files
    and is the index): a restore elsewhere reads the manifest and the part, and gets the saved bytes."""
    ram, durable = tmp_path / "ram", tmp_path / "durable"
    ram.mkdir()
    out = warm_python.run(["-c", _TRAINER, job, str(durable), str(ram)])
    assert out.returncode == -signal.SIGKILL, out.stderr
    done = NodeAgent(job, local=None, durable=str(durable), ram_dir=str(ram)).run_once()
    assert done.durable == [1], done
    assert json.loads((durable / step_dir(1) / MANIFEST).read_bytes())["format_version"] == "2.0"
    assert not (durable / step_dir(1) / INDEX).exists()
    reads = _Reads(monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = {k: torch.zeros_like(v) for k, v in _state(1).items()}
    with caplog.at_level(logging.WARNING, logger="ckptstore"), \
            CheckpointStore(job, durable=str(durable), ram_dir=str(elsewhere)) as store:
        assert store.restore(target) == 1
    for k, v in _state(1).items():
        assert torch.equal(target[k], v), k
    assert set(reads.names) == {INDEX, MANIFEST, "parts/rank-00000.json"}, reads.names  # index.json: looked for
    assert "index" not in caplog.text


def test_save_sharded_commits_a_manifest_that_is_its_own_index(tmp_path, monkeypatch, caplog):
    """One rank: save_sharded commits format 2.0, and a load reads the manifest and its own part
    file (index.json is only looked for). A 1.x checkpoint (as save_sharded wrote before 2.0)
    still loads: through its index alone; without an index (written before indexes existed)
    through its manifest, silently; with a damaged one through its manifest, with a warning.
    Replacing a 1.x checkpoint removes its index. Every load bitwise."""
    from v1_writer import downgrade

    url = tmp_path / "ckpt"
    save_sharded(_state(3), str(url))
    assert json.loads((url / MANIFEST).read_bytes())["format_version"] == "2.0"
    assert not (url / INDEX).exists()
    part = "parts/rank-00000.json"
    for case in ("2.0", "1.x", "1.x-absent", "1.x-damaged"):
        if case == "1.x":
            downgrade(url, index=True)
        elif case == "1.x-absent":
            body = (url / INDEX).read_bytes()
            (url / INDEX).unlink()
        elif case == "1.x-damaged":
            (url / INDEX).write_bytes(body[:-30] + b"x" * 30)
        reads = _Reads(monkeypatch)
        caplog.clear()
        target = {k: torch.zeros_like(v) for k, v in _state(3).items()}
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            load_sharded(target, str(url))
        for k, v in _state(3).items():
            assert torch.equal(target[k], v), (case, k)
        if case == "2.0":
            assert set(reads.names) == {INDEX, MANIFEST, part}, reads.names
        elif case == "1.x":
            assert set(reads.names) == {INDEX}, reads.names  # one writer: every chunk is in the index
        else:
            assert MANIFEST in reads.names, (case, reads.names)
        assert ("cannot plan the load" in caplog.text) == (case == "1.x-damaged"), (case, caplog.text)
    # Replacing the checkpoint removes the old index, which described the old manifest.
    save_sharded(_state(4), str(url), overwrite=True)
    assert not (url / INDEX).exists()
    reads = _Reads(monkeypatch)
    target = {k: torch.zeros_like(v) for k, v in _state(4).items()}
    load_sharded(target, str(url))
    assert set(reads.names) == {INDEX, MANIFEST, part}, reads.names
    assert all(torch.equal(target[k], v) for k, v in _state(4).items())


def sharded_index_job(rank: int, world: int, url: str) -> None:
    """Each rank saves a Shard(0) slice of every tensor with save_sharded; loaded at the layout it
    saved, each rank reads the manifest (its header: format 2.0) and its own part only; loaded into
    Shard(1), every rank reads the same (its share of the part files; the cooperative read hands
    each tensor's chunks through its coordinator), and both loads are bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    full = {f"w{i}": torch.randn(4 * world + 1, 6, generator=g) for i in range(4)}
    save_sharded({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()} | {"b": full["w0"][0]}, url)
    reads: list[str] = []
    real = Directory.read_small

    def counted(directory, rel):
        reads.append(rel)
        return real(directory, rel)

    Directory.read_small = counted  # type: ignore[method-assign]
    try:
        for placement in (Shard(0), Shard(1)):
            reads.clear()
            target = {k: distribute_tensor(torch.zeros_like(v), mesh, [placement]) for k, v in full.items()}
            target["b"] = torch.zeros(6)
            load_sharded(target, url)
            for k, v in full.items():
                assert torch.equal(target[k].full_tensor(), v), (placement, k)
            assert torch.equal(target["b"], full["w0"][0])
            # Resharded too, a rank reads only its share of the part files (writer w: rank w % world),
            # here its own: the coordinators hand the chunks on (session 11).
            assert set(reads) == {INDEX, MANIFEST, f"parts/rank-{rank:05d}.json"}, (placement, reads)
    finally:
        Directory.read_small = real  # type: ignore[method-assign]


def test_save_sharded_ranks_load_their_own_index_and_reshard_bitwise(tmp_path):
    spawn(2, "test_index_scale:sharded_index_job", tmp_path, url=str(tmp_path / "ckpt"))
