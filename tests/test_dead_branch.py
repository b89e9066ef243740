"""A restore that falls back past a step the store counted as saved starts a new branch of history:
the job saves the step numbers after the restored one again, and the old copies of those steps (the
dead branch) are never restored, nor mixed with the new ones, from any tier.

Real parts: stores with a RAM tier in /dev/shm, a local directory and a durable one (real files,
fsync), damaged by flipping bytes of the files a tier holds; and two real processes on gloo over
loopback, each on a simulated node of its own, killed by a real SIGKILL right after the newest
step's RAM commit (as a crash-loop run was when its restore fell back past a step committed in RAM).
"""

from __future__ import annotations

import os
import shutil

import dist_workers
import pytest
import torch
from conftest import assert_same

from ckptstore import CheckpointStore, InvalidArgumentError
from ckptstore.tiers.segments import inventory


def _state(step: int, run: int = 0) -> dict:
    """The state at ``step`` in ``run``: a step saved again on the new branch has other bytes."""
    return {"w": torch.arange(16384, dtype=torch.float32) + (1000.0 * run + step), "step": step, "run": run}


def _blank() -> dict:
    return {"w": torch.zeros(16384), "step": -1, "run": -1}


def _flip(path: str) -> None:
    """Flip one byte in the middle of ``path``: inside the tensor's bytes, so its checksum fails."""
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())


def _damage_step(root: str, step: int) -> None:
    data = os.path.join(root, f"step-{step:012d}", "data")
    names = [n for n in os.listdir(data) if n.endswith(".bin")]
    assert names, data
    for name in names:
        _flip(os.path.join(data, name))


def _damage_ram(ram_dir: str, job: str, step: int) -> None:
    records = [r for r in inventory(ram_dir, job, owners=False) if r.step == step]
    assert records, f"no RAM segment holds step {step}"
    for r in records:
        for path in r.paths:
            if not path.endswith(".json"):
                _flip(path)


def _committed(root: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root)
                  if n.startswith("step-") and os.path.exists(os.path.join(root, n, "manifest.json")))


def test_a_restore_past_a_damaged_step_lets_the_job_save_that_step_again(job, tmp_path):
    """Steps 5 and 10 are committed in RAM, local and durable; every copy of step 10 is then
    damaged. The restart restores step 5, drops the dead step 10 from every tier (its damaged local
    copy moved aside for inspection, not deleted; a restart before
    the new save finds step 5 and nothing newer), and counts on from step 5: ``save(5)`` is refused,
    ``save(10)`` commits. Every later restart restores the new step 10 bit for bit, from RAM, from
    the local tier and from the durable tier alike, never the old one."""
    ram_dir = f"/dev/shm/{job}-single"
    os.makedirs(ram_dir)
    try:
        local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
        opts = dict(local=local, durable=durable, durable_every=1, keep_local=None, ram_dir=ram_dir)
        with CheckpointStore(job, **opts) as store:
            for step in (5, 10):
                store.save(step, _state(step)).wait("durable")
            store.close(keep_ram=True)
        _damage_ram(ram_dir, job, 10)
        _damage_step(local, 10)
        _damage_step(durable, 10)

        with CheckpointStore(job, **opts) as store:
            assert store.last_step == 10  # what the tiers hold, before the restore looked at it
            state = _blank()
            assert store.restore(state) == 5
            assert_same(state, _state(5))
            assert store.last_step == 5
            assert store.latest_step() == 5
            store.close(keep_ram=True)  # dies before its next save: the dead branch is gone already
        assert _committed(local) == [5] and _committed(durable) == [5]
        # The damaged local copy is evidence: moved aside whole, where no store reads it.
        (aside,) = os.listdir(os.path.join(local, "damaged"))
        assert aside.startswith("step-000000000010.")
        assert os.path.exists(os.path.join(local, "damaged", aside, "manifest.json"))
        assert all(r.step != 10 for r in inventory(ram_dir, job, owners=False))

        with CheckpointStore(job, **opts) as store:
            assert store.last_step == 5
            state = _blank()
            assert store.restore(state) == 5
            with pytest.raises(InvalidArgumentError, match="step 5 is not after the last saved step 5"):
                store.save(5, _state(5, run=1))
            store.save(10, _state(10, run=1)).wait("durable")
            store.close(keep_ram=True)

        # From RAM (the restart on this node), from the local tier alone, from the durable tier alone.
        for where in (opts, dict(opts, ram_dir=str(tmp_path)), dict(opts, ram_dir=str(tmp_path), local=None)):
            with CheckpointStore(job, **where) as store:
                state = _blank()
                assert store.restore(state) == 10, where
                assert_same(state, _state(10, run=1))
                with pytest.raises(InvalidArgumentError, match="step 10 is not after the last saved step 10"):
                    store.save(10, _state(10, run=2))
                store.close(keep_ram=True)
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)


def test_the_same_process_promotes_the_new_branch_after_restoring_past_a_dead_one(job, tmp_path):
    """A store that saved and promoted steps 5, 10 and 15 restores, in the same process, past
    damaged copies of 10 and 15: the new branch's steps 10 and 15 are promoted like any other (the
    durable lane's record of the newest step queued before the restore must not make them look
    overtaken by the dead branch's numbers), and a store on the durable tier alone restores them."""
    ram_dir = f"/dev/shm/{job}-same"
    os.makedirs(ram_dir)
    try:
        local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
        opts = dict(local=local, durable=durable, durable_every=1, keep_local=None, ram_dir=ram_dir)
        with CheckpointStore(job, **opts) as store:
            for step in (5, 10, 15):
                store.save(step, _state(step)).wait("durable")
            for step in (10, 15):
                _damage_ram(ram_dir, job, step)
                _damage_step(local, step)
                _damage_step(durable, step)
            state = _blank()
            assert store.restore(state) == 5
            assert_same(state, _state(5))
            assert _committed(durable) == [5]
            for step in (10, 15):
                store.save(step, _state(step, run=1)).wait("durable", timeout=60)
            assert _committed(durable) == [5, 10, 15]
            store.close()
        with CheckpointStore(job, **dict(opts, local=None, ram_dir=str(tmp_path))) as store:
            state = _blank()
            assert store.restore(state, step=10) == 10
            assert_same(state, _state(10, run=1))
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)


def test_an_export_that_falls_back_past_a_damaged_step_removes_nothing(job, tmp_path):
    """An export reads a step; it is not the training job resuming. ``hf.export_step`` of the
    newest sound step (step 5, every copy of step 10 damaged) leaves step 10 where it is in every
    tier and the store's numbering as it was: only the training job's own restore declares it a
    dead branch."""
    pytest.importorskip("safetensors")
    from ckptstore import hf

    ram_dir = f"/dev/shm/{job}-export"
    os.makedirs(ram_dir)
    try:
        local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
        opts = dict(local=local, durable=durable, durable_every=1, keep_local=None, ram_dir=ram_dir)
        with CheckpointStore(job, **opts) as store:
            for step in (5, 10):
                store.save(step, {"model": {"w": _state(step)["w"]}}).wait("durable")
            store.close(keep_ram=True)
        _damage_ram(ram_dir, job, 10)
        _damage_step(local, 10)
        _damage_step(durable, 10)
        with CheckpointStore(job, **opts) as store:
            assert hf.export_step(store, tmp_path / "export") == 5
            assert_same(hf.import_safetensors(tmp_path / "export"), {"w": _state(5)["w"]})
            assert store.last_step == 10
            with pytest.raises(InvalidArgumentError, match="step 10 is not after the last saved step 10"):
                store.save(10, {"model": {"w": _state(10, run=1)["w"]}})
            store.close(keep_ram=True)
        assert _committed(local) == [5, 10] and _committed(durable) == [5, 10]
        assert not os.path.exists(os.path.join(local, "damaged"))
        assert any(r.step == 10 for r in inventory(ram_dir, job, owners=False))
        with CheckpointStore(job, **opts) as store, pytest.raises(InvalidArgumentError, match="resume must be True or False"):
            store.restore({"model": {"w": torch.zeros(16384)}}, resume="no")
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)


def test_a_restore_past_an_unreadable_durable_step_replaces_it_there(job, tmp_path):
    """Step 10 is held by the durable tier alone (the node's copies are gone), and its data file
    cannot be read there (a directory stands in its place). The restart restores step 5 from the
    node and removes the durable step 10 (only a damaged local copy is kept aside), so the new
    branch's step 10 reaches the durable tier (a second manifest of a step is refused there) and is
    the one a restore from it returns."""
    ram_dir = f"/dev/shm/{job}-single"
    os.makedirs(ram_dir)
    try:
        local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
        opts = dict(local=local, durable=durable, durable_every=1, keep_local=None, ram_dir=ram_dir)
        with CheckpointStore(job, **opts) as store:
            for step in (5, 10):
                store.save(step, _state(step)).wait("durable")
            store.close()
        shutil.rmtree(os.path.join(local, f"step-{10:012d}"))
        data = os.path.join(durable, f"step-{10:012d}", "data")
        for name in os.listdir(data):
            os.remove(os.path.join(data, name))
            os.mkdir(os.path.join(data, name))  # opening it fails: EISDIR
        with CheckpointStore(job, **opts) as store:
            state = _blank()
            assert store.restore(state) == 5
            assert_same(state, _state(5))
            assert _committed(durable) == [5] and not os.path.exists(os.path.join(local, "damaged"))
            store.save(10, _state(10, run=1)).wait("durable")
            store.close()
        assert _committed(durable) == [5, 10]
        with CheckpointStore(job, **dict(opts, local=None, ram_dir=str(tmp_path))) as store:
            state = _blank()
            assert store.restore(state) == 10
            assert_same(state, _state(10, run=1))
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)


def test_two_ranks_restore_past_a_step_one_rank_holds_damaged_then_save_it_again(tmp_path, job, ram_root):
    """What a crash-loop run met: step 10 committed in RAM on both nodes when both ranks die
    (SIGKILL), before its local write, replication and promotion; rank 1's RAM copy of it is then
    damaged. The restart restores step 5 (from the nodes), and the job's saves of 8 and 10 are not
    refused ("not after the last saved step 10" stopped that run). A later restart restores the new
    step 10 bitwise from RAM, from the local tier and from the durable tier."""
    args = dict(name=job, ram_root=ram_root, local_root=str(tmp_path / "local"), durable=str(tmp_path / "durable"))
    dist_workers.crash_both(tmp_path, "dead_branch_workers:crash_job", **args)
    _damage_ram(os.path.join(ram_root, "node1"), job, 10)
    dist_workers.spawn(2, "dead_branch_workers:restart_job", tmp_path, **args)
    assert _committed(args["durable"]) == [5, 8, 10]
    dist_workers.spawn(2, "dead_branch_workers:check_job", tmp_path, **args)
