"""The fast lane's control plane: what names a save of a step on every node.

The ranks agree on a save id when they commit a step in RAM, and every rank's RAM document of
that save records it. The node agent names a snapshot by it (the parts it writes are tagged with
that name, and it refuses to persist a mix of two saves), so it needs no chunk table of the whole
world to tell one save from another. Documents written before the save id existed are still named
by their chunk table, and still persisted.

A local copy laid out otherwise than the slot (frozen tensors in a file of their own) restores
bitwise on every rank: the layout a restore groups copies by is the local tier's own there.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import dist_workers
import pytest
import torch
from conftest import assert_same, wipe_ram

from ckptstore import CheckpointStore, load_sharded
from ckptstore.engine.agent import NodeAgent, snapshot_id
from ckptstore.format.manifest import parse_manifest
from ckptstore.names import step_dir
from ckptstore.tiers.base import manifest_of_parts
from ckptstore.tiers.directory import committed_steps
from ckptstore.tiers.ram import doc_part, whole_manifest_doc


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "n": torch.tensor(step)}


@pytest.fixture
def node(tmp_path, job):
    """One node: a RAM directory of its own in /dev/shm and a local directory, saved steps 1 and 2."""
    ram = Path("/dev/shm") / f"ckptstore-lane-{job}"
    ram.mkdir(mode=0o700)
    local = tmp_path / "local"
    store = CheckpointStore(job, local=str(local), ram_dir=str(ram), durable_every=100)
    for step in (1, 2):
        store.save(step, _state(step)).wait("local")
    store.close(keep_ram=True)  # the segments stay, as a trainer killed after its commits leaves them
    try:
        yield {"ram": ram, "local": local, "job": job}
    finally:
        shutil.rmtree(ram, ignore_errors=True)


def _docs(ram: Path) -> dict[int, Path]:
    return {json.loads(p.read_text())["step"]: p for p in ram.glob("*.json")}


def _orphan(doc_path: Path, **changes: object) -> dict:
    """The document as a trainer that died left it (its owner gone), with ``changes`` applied."""
    doc = json.loads(doc_path.read_text())
    doc["owner"] = {**doc["owner"], "start": doc["owner"]["start"] - 1}  # another process under its pid
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    doc_path.write_text(json.dumps(doc))
    return doc


def _persist_again(n: dict, step: int) -> list[int]:
    """Take ``step`` out of the local tier and let the node's agent persist it from RAM again."""
    shutil.rmtree(n["local"] / step_dir(step))
    shutil.rmtree(n["local"] / step_dir(2), ignore_errors=True)  # a newer local step would make it stale
    out = NodeAgent(n["job"], local=str(n["local"]), durable=None, ram_dir=str(n["ram"])).run_once()
    assert out.failed == []
    return out.local


def test_every_save_names_itself_and_the_agent_tags_its_parts_with_that_name(node):
    docs = {step: json.loads(p.read_text()) for step, p in _docs(node["ram"]).items()}
    ids = {step: doc.get("save_id") for step, doc in docs.items()}
    assert all(isinstance(i, str) and len(i) == 16 for i in ids.values()) and ids[1] != ids[2], ids
    _orphan(_docs(node["ram"])[1])
    assert _persist_again(node, 1) == [1]
    part = json.loads((node["local"] / step_dir(1) / "parts" / "rank-00000.json").read_text())
    name = snapshot_id(docs[1], lambda: pytest.fail("a document with a save id is named without its manifest"))
    assert part["snapshot"] == name
    loaded = _state(0)
    load_sharded(loaded, str(node["local"] / step_dir(1)))
    assert_same(loaded, _state(1), "step 1 as the agent persisted it")


def _whole(doc: dict) -> dict:
    """``doc`` as a store before parts-only documents wrote it: the whole manifest (one rank: its
    own part makes it)."""
    return whole_manifest_doc(doc, manifest_of_parts([doc_part(doc, "x")], "x"))


def test_a_document_written_before_save_ids_is_still_persisted(node):
    """An older store's document (no save id, the whole manifest) is named by its chunk table, as before."""
    path = _docs(node["ram"])[1]
    path.write_text(json.dumps(_whole(json.loads(path.read_text()))))
    doc = _orphan(path, save_id=None)
    assert _persist_again(node, 1) == [1]
    part = json.loads((node["local"] / step_dir(1) / "parts" / "rank-00000.json").read_text())
    assert part["snapshot"] == snapshot_id(doc, lambda: parse_manifest(doc["extra"]["manifest"].encode(), where="x"))
    assert committed_steps(str(node["local"])) == {1}
    loaded = _state(0)
    load_sharded(loaded, str(node["local"] / step_dir(1)))
    assert_same(loaded, _state(1), "step 1 from an old-format document")


def test_two_saves_of_one_step_with_the_same_chunk_table_are_told_apart(node):
    """A rerun that saves the same step with the same bytes writes the same chunk table: only the
    save id tells the two saves apart, so an agent never tags parts of one with the other's name."""
    doc = json.loads(_docs(node["ram"])[1].read_text())
    manifest = manifest_of_parts([doc_part(doc, "x")], "x")
    rerun = {**doc, "save_id": f"{(int(doc['save_id'], 16) + 1) % (1 << 63):016x}"}
    assert snapshot_id(doc, lambda: manifest) != snapshot_id(rerun, lambda: manifest)
    old = {k: v for k, v in doc.items() if k != "save_id"}
    assert snapshot_id(old, lambda: manifest) == snapshot_id(dict(old), lambda: manifest)


@pytest.mark.slow  # two processes, a save and a restore each: 25-40 s on the shared cores
def test_frozen_tensors_lay_local_files_out_apart_and_every_rank_still_restores_bitwise(tmp_path):
    """Two gloo ranks, each its own node: a local copy that is not laid out as the slot (what a
    change to how the local tier is committed must keep right) reads back bitwise from the local
    tiers alone."""
    name = f"test-lane-frozen-{uuid.uuid4().hex[:10]}"
    try:
        dist_workers.spawn(2, "store_frozen_local_job", tmp_path, name=name, root=str(tmp_path))
    finally:
        wipe_ram(name)
