"""A node lost right after a crash: the restart skips the steps whose part went with it (incomplete,
not damaged), restores the newest complete one or starts fresh, and drops the dead branch so the
job can save those step numbers again.

Real processes (two ranks on two simulated nodes, each with its RAM directory under /dev/shm and
its own local directory), a real SIGKILL (a crash point armed right after the newest step's RAM
commit, before its local write and replication begin), and a whole-node wipe (node 0's RAM
directory and local directory).
"""

from __future__ import annotations

import os
import shutil

import dist_workers
import pytest

_spawn = dist_workers.spawn


def _crash(tmp_path, **args) -> None:
    dist_workers.crash_both(tmp_path, "node_loss_workers:crash_job", **args)


def _lose_node(ram_root: str, local_root: str, node: int) -> None:
    shutil.rmtree(os.path.join(ram_root, f"node{node}"))
    local = os.path.join(local_root, f"node{node}")
    if os.path.exists(local):  # a job killed before its first local write has none
        shutil.rmtree(local)


def test_a_node_lost_before_its_part_got_out_leaves_a_job_that_starts_fresh(tmp_path, job, ram_root):
    """Step 2, the only step, is committed in RAM only when both ranks die; node 0 is then lost.
    Its part of step 2 is nowhere: the restart starts fresh (None) with a warning instead of raising,
    then saves step 2 again and restores that bitwise."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=0)
    _crash(tmp_path, steps=[2], **args)
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:restart_job", tmp_path, expect=None, dead=2, **args)


# The later restart in fresh processes runs with -m slow: the default run checks the new step 2 in
# the restarted store itself (its RAM, local and peer copies), which the dead half would shadow.
@pytest.mark.parametrize("later", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["same-run", "later-run"])
def test_a_rollback_past_a_half_lost_step_saves_that_step_again(tmp_path, job, ram_root, later):
    """The rollback: step 1 is complete (node 0's part also replicated to node 1), step 2 was in
    RAM only when node 0 was lost. The restart restores step 1 and drops node 1's half of step 2;
    ``save(2)`` then commits, and a later restart restores the new step 2, never the old half."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=1)
    _crash(tmp_path, steps=[1, 2], **args)
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:restart_job", tmp_path, expect=1, dead=2, **args)
    if later:
        _spawn(2, "node_loss_workers:check_job", tmp_path, step=2, **args)


def _drop_own_copies(ram_root: str, local_root: str, node: int, step: int) -> None:
    """What retention does to a node's own copies of an older step (its RAM slot reused, its local
    copy past ``keep_local``) while a peer replica of another rank's part of that step stays."""
    import json

    ram = os.path.join(ram_root, f"node{node}")
    for name in os.listdir(ram):
        if name.endswith(".json") and "-peer" not in name:
            with open(os.path.join(ram, name)) as f:
                if json.load(f).get("step") == step:
                    for suffix in (".json", ".bin"):
                        os.remove(os.path.join(ram, name[:-len(".json")] + suffix))
    shutil.rmtree(os.path.join(local_root, f"node{node}", f"step-{step:012d}"))


def test_a_step_a_lost_node_held_the_only_replica_of_is_incomplete(tmp_path, job, ram_root):
    """Node 1 holds step 2 only as node 0's replica (its own copies of step 2 already gone to
    retention, its part's replica on node 0), when node 0 is lost: node 1's part of step 2 is
    nowhere. The restart restores step 1, drops step 2 as incomplete (not "cannot be restored"),
    no longer counts it as saved, and saves step 2 again."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=1)
    _crash(tmp_path, steps=[1, 2, 3], **args)
    _drop_own_copies(ram_root, local_root, 1, 2)
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:restart_job", tmp_path, expect=1, dead=2, **args)


def test_the_newest_replicated_step_outlives_keep_local_so_a_node_loss_finds_it_whole(tmp_path, job, ram_root):
    """Every second save is replicated (step 2); step 3 is not, and with keep_local=1 the local tier
    would keep step 3 alone; step 4 dies in RAM. Node 0 is then lost, and with it node 1's part of
    steps 3 and 4 and its replica of step 2. Node 1 kept its own copy of step 2, the newest step
    replicated, beyond keep_local: the restart restores step 2 bitwise from node 1's local copy and
    node 0's replica, instead of starting fresh."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=1, keep_local=1, peer_every=2)
    _crash(tmp_path, steps=[1, 2, 3, 4], **args)
    assert sorted(os.listdir(os.path.join(local_root, "node1"))) == ["step-000000000002", "step-000000000003"]
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:restart_job", tmp_path, expect=2, dead=4, **args)


def test_replication_starts_at_the_ram_commit_not_after_the_local_write(tmp_path, job, ram_root):
    """A step's replica does not wait for its local write: with the local write failing, the step
    is still replicated and committed on the peers."""
    local_root = str(tmp_path / "local")
    _spawn(2, "node_loss_workers:local_fails_job", tmp_path, name=job, ram_root=ram_root, local_root=local_root,
           replicas=1)


@pytest.mark.parametrize("local_every", [1, 2])
def test_a_restarted_job_keeps_its_part_of_the_newest_replicated_step_for_a_later_node_loss(tmp_path, job, ram_root,
                                                                                             local_every):
    """Step 3 is replicated (peer_every=3), then the job crashes; the restarted run saves 4 and 5,
    which are not (its cadence counts on from step 3), and crashes too. Node 0 is then lost: step 3
    is the newest step whose every part survives (node 0's part as a replica on node 1), so node 1
    must still hold its own part of it, although keep_local=2 and two newer steps are local. A
    restarted process that forgot which step its peers hold let retention drop it: the job then
    started from scratch, a committed step lost. With local_every=2 step 3 is not due locally by
    its count, but a replicated step always goes there (its RAM slot is restaged two saves later)."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=1, peer_every=3, keep_local=2,
                local_every=local_every)
    dist_workers.crash_both(tmp_path, "node_loss_workers:saves_then_dies_job", steps=[1, 2, 3], **args)
    dist_workers.crash_both(tmp_path, "node_loss_workers:saves_then_dies_job", steps=[4, 5], restore=3, **args)
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:restores_job", tmp_path, expect=3, **args)


def test_a_lost_nodes_replica_loads_beside_a_survivors_local_copy_laid_out_otherwise(tmp_path, job, ram_root):
    """Steps 1 and 2 are on every tier (each rank's part also replicated to the other node) when the
    job dies. Each rank's local copy is laid out unlike its slot (its frozen tensor in a file of its
    own), and node 1's agent, finding both steps persisted and no store open, gives node 1's RAM
    slots back. Node 0 is then lost: node 0's part of step 2 is left only as a byte copy of its slot
    (the replica on node 1), node 1's only as its local copy, two layouts of the same save, each
    lacking one part. The restart restores step 2 from the two, bitwise; a restore that read one
    layout at a time found neither complete and lost the committed step (seen in the crash loop
    of tests/test_goodput_e2e.py, where node 1's local copy was the agent's, written beside a
    killed trainer's file)."""
    from ckptstore.engine.agent import NodeAgent

    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=1)
    dist_workers.crash_both(tmp_path, "node_loss_workers:saves_then_dies_job", steps=[1, 2], frozen=True, **args)
    agent = NodeAgent(job, local=os.path.join(local_root, "node1"), durable=None, ram_dir=os.path.join(ram_root, "node1"))
    agent.run_once()
    assert agent.release_persisted()[0] == 2  # node 1's own slots of steps 1 and 2; the replicas stay
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:frozen_restores_job", tmp_path, expect=2, **args)


def test_a_replaced_node_makes_its_first_saves_slot_while_it_restores(tmp_path, job, ram_root):
    """Node 0 is lost after step 2 reached every tier. Its replacement has no local file to size
    the first save's RAM slot by when its store starts (the surviving node does); once the restore
    read its data file of step 2 from node 1's replica, the slot is made ahead at that size, off
    the trainer's path. Before, the first save after every node loss mapped it while the trainer
    waited (1.0-1.6 s of the crash loop's checkpoint time)."""
    local_root = str(tmp_path / "local")
    args = dict(name=job, ram_root=ram_root, local_root=local_root, replicas=1)
    dist_workers.crash_both(tmp_path, "node_loss_workers:saves_then_dies_job", steps=[1, 2], **args)
    slot_bytes = os.path.getsize(os.path.join(local_root, "node1", "step-000000000002", "data", "rank-00001.bin"))
    _lose_node(ram_root, local_root, 0)
    _spawn(2, "node_loss_workers:replaced_node_slot_job", tmp_path, expect=2, slot_bytes=slot_bytes, **args)
