"""local_every: the local tier takes every local_every-th snapshot and every promoted one; the count
travels in each step's manifest (meta.cadence.local), so a restarted store counts on from its
newest step; close writes the last snapshot locally when it reached no disk."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same

from ckptstore import CheckpointStore, InvalidArgumentError
from ckptstore.tiers.directory import committed_steps


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(17, generator=g)}


def test_the_local_tier_takes_every_kth_save_and_counts_on_after_a_restart(tmp_path, job):
    local = str(tmp_path / "local")
    store = CheckpointStore(job, local=local, keep_local=None, local_every=3)
    handles = {step: store.save(step, _state(step)) for step in range(1, 8)}
    for step, handle in handles.items():
        handle.wait("ram")
        handle.wait("local")  # for a step the local tier does not take: its RAM commit
        assert (handle._futures["local"] is not None) == (step % 3 == 0), step
        assert handle.done("local") and handle.done("ram")
    store._drain()
    assert committed_steps(local) == {3, 6}
    store.close(keep_ram=True)
    # Step 7, the last, was not due: close wrote it, so the node's disk holds the newest step.
    assert committed_steps(local) == {3, 6, 7}

    again = CheckpointStore(job, local=local, keep_local=None, local_every=3)
    target = _state(0)
    assert again.restore(target) == 7
    assert_same(target, _state(7))
    # The count follows the saves (meta.cadence.local of step 7: the first after step 6's copy),
    # not this process: 8 is the second, 9 the third and due; a count from zero would write 10.
    for step in (8, 9, 10):
        again.save(step, _state(step)).wait("local")
    again._drain()
    assert committed_steps(local) == {3, 6, 7, 9}
    again.close()
    assert committed_steps(local) == {3, 6, 7, 9, 10}
    fresh = CheckpointStore(job + "x", local=local)  # another job name: no RAM of its own to restore from
    target = _state(0)
    assert fresh.restore(target, step=10) == 10
    assert_same(target, _state(10))
    fresh.close()


def test_a_promoted_step_goes_to_the_local_tier_whatever_its_count(tmp_path, job):
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    store = CheckpointStore(job, local=local, durable=durable, durable_every=2, keep_local=None, local_every=5)
    for step in range(1, 6):
        store.save(step, _state(step)).wait("durable")
    store._drain()
    # 2 and 4 promoted (their promotion reads the local files); each restarts the count.
    assert committed_steps(local) == {2, 4}
    store.close()
    assert committed_steps(local) == {2, 4, 5} and committed_steps(durable) == {2, 4, 5}  # the last, on close


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_local_every_must_be_a_positive_int(tmp_path, job, bad):
    with pytest.raises(InvalidArgumentError, match=f"local_every must be a positive int .*not {bad!r}"):
        CheckpointStore(job, local=str(tmp_path / "local"), local_every=bad)
    assert not (tmp_path / "local").exists()
