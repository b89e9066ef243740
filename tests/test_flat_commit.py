"""The fast lane commits by flags: each node copy of a step (a RAM slot's document, a replica's)
holds its own rank's part, the step's meta and its structure's header, never the whole manifest,
so what a rank receives per save does not grow with the number of ranks. A restore assembles the
manifest from the parts every node holds, in one gather per attempt: after a crash from RAM on
every rank, after a node loss from the surviving node's parts and replicas; a document written by
an older store (the whole manifest) still restores. Real processes over gloo, real /dev/shm
segments, real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil

import dist_workers
import flat_workers
import pytest
import torch
from conftest import assert_same, wipe_ram

from ckptstore import CheckpointStore


# Six processes, 7-9 s on the shared cores: the default run checks the same flatness in
# tests/test_control_plane.py (fast and peer groups at two and four ranks); this one also pins
# what each node copy holds.
@pytest.mark.slow
def test_a_steady_save_receives_the_same_bytes_at_two_and_four_ranks(tmp_path, job):
    """The RAM and local commits and the replication of a steady save (each rank its own node):
    every rank, at either size, receives the same few all-reduced flags through the fast and peer
    groups, never another rank's part; the local directories hold node parts, no manifest."""
    out = tmp_path / "traffic"
    out.mkdir()
    roots = {world: f"/dev/shm/{job}-{world}" for world in (2, 4)}
    try:
        for world in (2, 4):
            dist_workers.spawn(world, "flat_workers:traffic_job", tmp_path, name=f"{job}-{world}",
                               ram_root=roots[world], local_root=str(tmp_path / f"local-{world}"), out=str(out))
        got = {w: [json.loads((out / f"w{w}-r{r}.json").read_text()) for r in range(w)] for w in (2, 4)}
        for role in ("fast", "peer"):
            seen = {g.get(role) for w in (2, 4) for g in got[w]}
            assert len(seen) == 1 and seen.pop(), (role, got)
        for w in (2, 4):
            for r in range(w):
                flat_workers.assert_parts_only(os.path.join(roots[w], f"node{r}"), 3, w)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    for w in (2, 4):
        for r in range(w):
            step = tmp_path / f"local-{w}" / f"node{r}" / "step-000000000003"
            assert not (step / "manifest.json").exists()
            assert sorted(os.listdir(step / "node-parts")) == [f"rank-{r:05d}.json"]


def _crash(tmp_path, **args) -> None:
    dist_workers.crash_both(tmp_path, "flat_workers:crash_job", **args)


def test_a_crash_after_the_ram_commit_and_a_node_loss_restore_from_parts(tmp_path, job, ram_root):
    """Two ranks, each its own node. Step 2 is committed in RAM when both die by SIGKILL: the
    restart restores it bitwise from the RAM slots (each rank reads the other node's through the
    restore's transfers, reported as "peer"), its manifest assembled from the two nodes' documents. Node 0 is then lost: step 2's rank-0 part went with it (incomplete), and
    step 1 restores bitwise from node 1's own slot and its replica of rank 0's."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root)
    _crash(tmp_path, **args)
    dist_workers.spawn(2, "flat_workers:restart_job", tmp_path, expect=2, tiers="peer+ram", lost=[], **args)
    shutil.rmtree(os.path.join(ram_root, "node0"))
    shutil.rmtree(os.path.join(local_root, "node0"))
    dist_workers.spawn(2, "flat_workers:restart_job", tmp_path, expect=1, tiers="peer+ram", lost=[0], **args)


def test_a_ram_document_an_older_store_wrote_still_restores(tmp_path, job):
    """A RAM document with the whole manifest (minor version 0, what stores wrote before) is read
    as before: with the local tier gone, the restart restores from it, bitwise."""
    from ckptstore.tiers.base import manifest_of_parts
    from ckptstore.tiers.ram import doc_part, whole_manifest_doc

    g = torch.Generator().manual_seed(3)
    saved = {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g)}
    try:
        with CheckpointStore(job, local=tmp_path / "local") as store:
            store.save(4, saved).wait("local")
            store.close(keep_ram=True)
        docs = [p for p in (os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm"))
                if os.path.basename(p).startswith(f"ckptstore-{job}-") and p.endswith(".json")]
        assert len(docs) == 1, docs
        with open(docs[0]) as fh:
            doc = json.load(fh)
        assert doc["minor"] == 1 and "manifest" not in doc["extra"], doc
        old = whole_manifest_doc(doc, manifest_of_parts([doc_part(doc, docs[0])], docs[0]))
        assert "minor" not in old and "manifest" in old["extra"]
        with open(docs[0], "w") as fh:
            json.dump(old, fh)
        shutil.rmtree(tmp_path / "local")
        target = {k: torch.zeros_like(v) for k, v in saved.items()}
        with CheckpointStore(job, local=tmp_path / "local") as store:
            assert store.restore(target) == 4
        assert_same(target, saved, "step 4 from an old-format RAM document")
    finally:
        wipe_ram(job)


def test_a_local_step_committed_by_node_parts_alone_restores_its_frozen_file(tmp_path, job):
    """A node of a multi-node job commits a local step as its ranks' node parts, no manifest: a
    restore assembles the manifest from them and reads every file they name, the frozen region's
    file of its own included, bitwise. (One process here: the owner's manifest.json is removed to
    leave what such a node holds.)"""
    g = torch.Generator().manual_seed(5)
    saved = {"base": torch.arange(3000, dtype=torch.float32), "head": torch.randn(40, 8, generator=g)}
    local = tmp_path / "local"
    try:
        with CheckpointStore(job, local=local, frozen=lambda key: key == "base") as store:
            store.save(1, saved).wait("local")
        step = local / "step-000000000001"
        (step / "manifest.json").unlink()
        part = json.loads((step / "node-parts" / "rank-00000.json").read_text())
        files = {c["file"] for table in part["part"]["chunks"].values() for c in table}
        assert part["part"]["layout"] == "local" and any("frozen" in f for f in files), part
        target = {k: torch.zeros_like(v) for k, v in saved.items()}
        with CheckpointStore(job, local=local, frozen=lambda key: key == "base") as store:
            assert store.restore(target) == 1
        assert_same(target, saved, "step 1 from the local node part")
    finally:
        wipe_ram(job)
