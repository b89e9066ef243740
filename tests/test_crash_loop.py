"""The crash loop: a job killed again and again (real SIGKILLs of real processes) still reaches the
durable tier on its cadence, never saves a committed step again, and never checkpoints a frozen
tensor stale."""

from __future__ import annotations

import json
import os
import shutil
import signal
import textwrap

import pytest
import torch
import warm_python
from conftest import wipe_ram

import ckptstore
from ckptstore import CheckpointStore, InvalidArgumentError

# One run of the job: open the store, optionally restore, save `saves` steps after the restored one
# (waiting for each to reach the local tier), let what the store started finish, then die by SIGKILL
# as a failing node would kill it. Prints the steps it saved and restored, as JSON, first.
_RUN = textwrap.dedent("""
    import json, os, signal, sys, torch, ckptstore
    job, local, durable, every, saves, restore = sys.argv[1:7]
    store = ckptstore.CheckpointStore(job, local=local, durable=durable, durable_every=int(every), keep_local=2)
    state = {"w": torch.zeros(1000), "step": -1}
    start = (store.restore(state) if restore == "1" else None)
    first = (start if start is not None else store.last_step or 0) + 1
    for step in range(first, first + int(saves)):
        state = {"w": torch.full((1000,), float(step)), "step": step}
        store.save(step, state).wait("local")
    store._drain()
    print(json.dumps({"restored": start, "saved": list(range(first, first + int(saves)))}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _run(job: str, local: str, durable: str, every: int, saves: int, restore: bool) -> dict:
    proc = warm_python.run(["-c", _RUN, job, local, durable, str(every), str(saves), "1" if restore else "0"],
                           timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _durable_steps(durable: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(durable) if os.path.exists(os.path.join(durable, n, "manifest.json")))


# Counting on from the manifest's cadence without a restore runs with -m slow (the default run keeps
# the restoring case, which counts on too and adds the promotion of the restored step).
@pytest.mark.parametrize("restore", [pytest.param(False, marks=pytest.mark.slow), True], ids=["counting-on", "restoring"])
def test_a_job_killed_every_three_saves_still_reaches_the_durable_tier(job, tmp_path, restore):
    """Five runs of three saves each, every run SIGKILLed, durable_every=4: a per-process count never
    reached 4. Counting on from the newest step's manifest promotes every fourth save across runs,
    with or without a restore: a restored step that was not due in the durable tier is not uploaded
    again at the restart (only one whose promotion the dead process owed is)."""
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    runs = [_run(job, local, durable, every=4, saves=3, restore=restore) for _ in range(5)]
    saved = [s for r in runs for s in r["saved"]]
    assert saved == list(range(1, 16)), runs  # steps only grew, across every restart
    if restore:
        assert [r["restored"] for r in runs] == [None, 3, 6, 9, 12]
    # The same cadence either way: no restored step was due there (none of 3, 6, 9, 12 is a 4th save).
    assert _durable_steps(durable) == [4, 8, 12]
    wipe_ram(job)
    newest = max(_durable_steps(durable))
    shutil.rmtree(local)  # the node is gone: the durable tier alone restores
    with CheckpointStore(job, durable=durable) as store:
        target = {"w": torch.zeros(1000), "step": -1}
        assert store.restore(target) == newest
        assert target["step"] == newest and torch.equal(target["w"], torch.full((1000,), float(newest)))


@pytest.mark.parametrize("due", [True, False], ids=["due", "not-due"])
def test_a_restored_step_the_durable_tier_lacks_is_promoted_from_the_local_files_when_it_was_due(job, tmp_path, due):
    """Step 2 was due in the durable tier (durable_every=2) and its upload never finished (removed
    here): the restore promotes it, from the local files. A step that was not due (durable_every=100;
    close() uploaded it as the last) is left to the cadence: no upload at the restart."""
    every = 2 if due else 100
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    frozen = torch.randn(100_000)  # 400 KB: the local tier keeps it in a file of its own
    with CheckpointStore(job, local=local, durable=durable, durable_every=every,
                         frozen=lambda k: k.startswith("frozen")) as store:
        for step in (1, 2):
            store.save(step, {"frozen": frozen, "w": torch.full((10,), float(step))}).wait("local")
    # Step 2 reached the durable tier; remove it, as a process killed during its upload leaves it.
    shutil.rmtree(os.path.join(durable, "step-000000000002"))
    wipe_ram(job)
    with CheckpointStore(job, local=local, durable=durable, durable_every=every) as store:
        target = {"frozen": torch.zeros(100_000), "w": torch.zeros(10)}
        assert store.restore(target) == 2
    if not due:
        assert _durable_steps(durable) == []
        return
    assert _durable_steps(durable) == [2]
    got = {"frozen": torch.zeros(100_000), "w": torch.zeros(10)}
    ckptstore.load_sharded(got, os.path.join(durable, "step-000000000002"))
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["w"], torch.full((10,), 2.0))


def test_a_restored_step_another_writer_makes_durable_meanwhile_does_not_fail_the_job(job, tmp_path, monkeypatch):
    """The node agent (or any other writer) commits the restored step in the durable tier while the
    restore's own promotion of it runs: the commit protocol keeps one copy, and the job goes on
    saving; the next save and close() raise nothing, and the durable copy restores bitwise."""
    from ckptstore.tiers.directory import DirectoryTier

    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    with CheckpointStore(job, local=local, durable=durable, durable_every=2) as store:  # step 2 is due there
        for step in (1, 2):
            store.save(step, {"w": torch.full((10,), float(step))}).wait("local")
    step_2 = os.path.join(durable, "step-000000000002")
    other = str(tmp_path / "other-writer")
    shutil.copytree(step_2, other)
    shutil.rmtree(step_2)
    wipe_ram(job)
    put = DirectoryTier.put

    async def another_writer_first(self, snap):
        if self.name == "durable" and snap.step == 2 and not os.path.exists(step_2):
            shutil.copytree(other, step_2)  # its manifest included: the step is committed
        return await put(self, snap)

    monkeypatch.setattr(DirectoryTier, "put", another_writer_first)
    with CheckpointStore(job, local=local, durable=durable, durable_every=2) as store:
        assert store.restore({"w": torch.zeros(10)}) == 2
        store.save(3, {"w": torch.full((10,), 3.0)}).wait("local")
    assert _durable_steps(durable) == [2, 3]
    got = {"w": torch.zeros(10)}
    ckptstore.load_sharded(got, step_2)
    assert torch.equal(got["w"], torch.full((10,), 2.0))


def test_local_retention_keeps_the_newest_step_owed_to_a_failing_durable_tier(job, tmp_path):
    """keep_local=1, durable_every=2: while the durable tier fails, the local tier keeps the newest
    step that was due there besides its newest one; the next promotion that succeeds releases it."""
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")

    def save(store, step):
        try:
            return store.save(step, {"w": torch.full((10,), float(step))})
        except ckptstore.StorageError:  # the failed promotion of an earlier step, reported once
            return store.save(step, {"w": torch.full((10,), float(step))})

    with CheckpointStore(job, local=local, durable=durable, durable_every=2, keep_local=1) as store:
        save(store, 1).wait("local")
        save(store, 2).wait("durable")
        os.rename(durable, durable + ".away")
        open(durable, "w").close()  # the durable URL now names a file: every write there fails
        for step in (3, 4, 5):
            handle = save(store, step)
            handle.wait("local")
            if step == 4:
                with pytest.raises(ckptstore.StorageError):
                    handle.wait("durable")
        assert _durable_steps(local) == [4, 5]  # 3 went by keep_local=1; 4 is owed to the durable tier
        os.remove(durable)
        os.rename(durable + ".away", durable)
        save(store, 6).wait("durable")  # a promotion succeeds: 4 is no longer owed
        save(store, 7).wait("local")
    # After close (retention runs after a step's local commit resolves): 6 went by keep_local=1.
    assert _durable_steps(local) == [7]
    assert _durable_steps(durable) == [2, 6, 7]  # close promoted the last step


def test_a_committed_step_is_refused_at_the_call_in_a_new_process(job, tmp_path):
    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local) as store:
        store.save(5, {"w": torch.ones(3)}).wait("local")
    wipe_ram(job)
    with CheckpointStore(job, local=local) as store:
        assert store.last_step == 5  # what the tiers hold, known before any restore
        for step in (5, 4):
            with pytest.raises(ckptstore.InvalidArgumentError, match=f"step {step} is not after the last saved step 5"):
                store.save(step, {"w": torch.zeros(3)})
        store.save(6, {"w": torch.zeros(3)}).wait("local")
    with CheckpointStore(job, local=local) as store:
        target = {"w": torch.zeros(3)}
        assert store.restore(target, step=5) == 5 and torch.equal(target["w"], torch.ones(3))  # untouched


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_save_of_a_committed_step_in_a_new_process_is_refused_at_the_call(job, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptstore.dcp

    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local) as store:
        dcp.save({"w": torch.ones(4)}, storage_writer=ckptstore.dcp.Writer(store), checkpoint_id=7)
    wipe_ram(job)
    with CheckpointStore(job, local=local) as store:
        # DCP wraps a writer's error in its own CheckpointException, per rank; ours is inside.
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.zeros(4)}, storage_writer=ckptstore.dcp.Writer(store), checkpoint_id=7)
        ((exc, _trace),) = info.value.failures.values()
        assert isinstance(exc, InvalidArgumentError)
        assert "step 7 is not after the last saved step 7" in str(exc)
        target = {"w": torch.zeros(4)}
        dcp.load(target, storage_reader=ckptstore.dcp.Reader(store, step=7))
        assert torch.equal(target["w"], torch.ones(4))


# ------------------------------------------------------------------------------ frozen tensors


def _frozen_run(job: str, tmp_path, change) -> list[tuple[int, torch.Tensor]]:
    """Twenty saves with two slots and an even refresh interval; ``change(weight, step)`` changes the
    frozen weight behind the version counter's back (through .data) before each save. Returns
    what each step restores, and the weight it held at that save."""
    weight = torch.zeros(50_000)  # 200 KB: large enough to be reused between saves
    state = {"base": weight, "head": torch.zeros(4)}
    out = []
    with CheckpointStore(job, local=str(tmp_path / "l"), keep_local=None, frozen=lambda k: k == "base",
                         refresh_every=10) as store:
        for step in range(1, 21):
            change(weight, step)
            state["head"].add_(1)
            store.save(step, state).wait("local")
            out.append((step, weight.clone()))
    wipe_ram(job)
    with CheckpointStore(job, local=str(tmp_path / "l")) as store:
        restored = []
        for step, held in out:
            target = {"base": torch.zeros(50_000), "head": torch.zeros(4)}
            assert store.restore(target, step=step) == step
            restored.append((step, held, target["base"]))
    return restored


def test_a_frozen_tensor_changed_behind_the_store_is_never_checkpointed_stale(job, tmp_path):
    """Two slots and refresh_every=10: every refresh used to land on slot 1, so slot 0 kept step 1's
    bytes for odd steps through step 39, and their checksums verified. A sample of the elements
    taken afresh at every save sees the change."""
    restored = _frozen_run(job, tmp_path, lambda w, step: w.data.fill_(float(step)))
    for step, held, got in restored:
        assert torch.equal(got, held), f"step {step} restored stale frozen bytes"


def test_a_change_the_sample_misses_is_caught_by_each_slots_own_refresh(job, tmp_path):
    """One element changed per save: a sample of 16 positions misses it most of the time, and each
    slot is refreshed at its tenth use, so no step is more than 20 saves stale and both slots are
    refreshed (slot 0 at save 19, slot 1 at save 20)."""
    restored = _frozen_run(job, tmp_path, lambda w, step: w.data.__setitem__(123, float(step)))
    fresh = {step for step, held, got in restored if torch.equal(got, held)}
    assert {1, 19, 20} <= fresh, sorted(fresh)
