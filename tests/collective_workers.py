"""Jobs of tests/test_collective.py, run on real processes by dist_workers.spawn."""

from __future__ import annotations

import os

import torch

import ckptstore
from ckptstore.errors import BackgroundError, CollectiveError


def one_rank_disk_fails_job(rank: int, world: int, name: str, root: str, ram_root: str) -> None:
    """Rank 1's local directory cannot take step 2 (a file holds its name): every rank learns of
    it as a StorageError that names rank 1, at wait() and again, once, at the next save."""
    local = os.path.join(root, f"node{rank}")  # a directory per rank: each commits its own
    os.makedirs(local, exist_ok=True)
    if rank == 1:
        with open(os.path.join(local, "step-000000000002"), "w") as fh:
            fh.write("a file where the step directory must go")
    ram_dir = os.path.join(ram_root, f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    store = ckptstore.CheckpointStore(name, local=local, ram_dir=ram_dir)
    state = {"w": torch.full((1000,), float(rank))}
    store.save(1, state).wait("local")
    handle = store.save(2, state)
    try:
        handle.wait("local")
    except ckptstore.StorageError as exc:
        assert isinstance(exc, CollectiveError), type(exc).__mro__
        assert sorted(exc.failures) == [1], exc.failures
        failure = exc.failures[1]
        assert failure.type == "ckptstore.errors.StorageError", failure
        assert os.path.join(root, "node1", "step-000000000002") in failure.message, failure.message
        assert "writing step 2 to the local tier failed: rank 1 (" in str(exc), str(exc)
    else:
        raise AssertionError("the write of step 2 failed on rank 1: wait('local') must raise on every rank")
    try:
        store.save(3, state)
    except ckptstore.StorageError as exc:
        assert isinstance(exc, BackgroundError) and isinstance(exc, CollectiveError), type(exc).__mro__
        assert str(exc).startswith("an earlier background save (step 2) failed: writing step 2"), str(exc)
        assert sorted(exc.failures) == [1]
    else:
        raise AssertionError("the failure of step 2 must reach the next save, as a StorageError")
    store.save(4, state).wait("local")  # raised once: the store goes on
    store.close()
