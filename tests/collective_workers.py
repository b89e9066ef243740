"""Jobs of tests/test_collective.py, run on real processes by dist_workers.spawn."""

from __future__ import annotations

import os

import torch

import ckptstore
from ckptstore.collective import LAZY_GLOO
from ckptstore.errors import BackgroundError, CollectiveError


def one_rank_disk_fails_job(rank: int, world: int, name: str, root: str, ram_root: str) -> None:
    """Rank 1's local directory cannot take step 2 (a file holds its name): every rank learns of
    it as a StorageError that names rank 1, at wait() and again, once, at the next save. Then rank
    1's durable root cannot take step 4, and every rank learns of that the same way."""
    local = os.path.join(root, f"node{rank}")  # a directory per rank: each commits its own
    os.makedirs(local, exist_ok=True)
    if rank == 1:
        with open(os.path.join(local, "step-000000000002"), "w") as fh:
            fh.write("a file where the step directory must go")
    ram_dir = os.path.join(ram_root, f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    # The durable tier: rank 0's root takes every step; rank 1's is a root of its own whose step 4
    # cannot be written (a file holds its name), so only its put of step 4 fails there.
    durable = os.path.join(root, "durable" if rank == 0 else f"durable{rank}")
    if rank == 1:
        os.makedirs(durable, exist_ok=True)
        with open(os.path.join(durable, "step-000000000004"), "w") as fh:
            fh.write("a file where the step directory must go")
    store = ckptstore.CheckpointStore(name, local=local, ram_dir=ram_dir, durable=durable, durable_every=1)
    state = {"w": torch.full((1000,), float(rank))}
    store.save(1, state).wait("durable")
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
    handle = store.save(4, state)  # raised once: the store goes on
    handle.wait("local")
    # A promotion that fails on one rank fails on every rank, with the failing rank's class and
    # message, although success costs the other ranks only a flag (the parts go to rank 0 alone).
    try:
        handle.wait("durable")
    except ckptstore.StorageError as exc:
        assert isinstance(exc, CollectiveError) and sorted(exc.failures) == [1], exc.failures
        assert exc.failures[1].type == "ckptstore.errors.StorageError", exc.failures[1]
        assert "writing step 4 to the durable tier failed: rank 1 (" in str(exc), str(exc)
        assert os.path.join(root, "durable1", "step-000000000004") in exc.failures[1].message, exc.failures[1]
    else:
        raise AssertionError("the promotion of step 4 failed on rank 1: wait('durable') must raise on every rank")
    try:
        store.close()
    except ckptstore.StorageError as exc:
        assert isinstance(exc, BackgroundError) and str(exc).startswith("an earlier background save (step 4) failed"), exc
    else:
        raise AssertionError("close() must raise the failed promotion nothing raised yet")
    # Nothing of the failed promotion is committed, and rank 0 removed the files it wrote for it.
    assert not os.path.exists(os.path.join(root, "durable", "step-000000000004", "manifest.json"))
    assert os.path.exists(os.path.join(root, "durable", "step-000000000001", "manifest.json"))


def teardown_after_failed_save_job(rank: int, world: int, name: str, root: str, close: bool) -> None:
    """Rank 1's staging segment cannot be used (its name is taken by another user's file), so its
    save fails at the call; it then tears the process group down at once, as a trainer that gives
    up does (after close() or without it). Rank 0 must learn rank 1's own failure, not a broken
    connection, and no rank may die (dist_workers.spawn checks every exit code)."""
    import torch.distributed as dist

    ram_dir = os.path.join(root, f"ram{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    if rank == 1:
        taken = os.path.join(ram_dir, f"ckptstore-{name}-r00001-s0.bin")
        open(taken, "w").close()
        os.chown(taken, 65534, 65534)
    store = ckptstore.CheckpointStore(name, local=os.path.join(root, f"local{rank}"), ram_dir=ram_dir, timeout_s=60,
                                      durable_timeout_s=30)
    # Replicated tensors, each written by one rank: rank 0 stages and hashes the 64 MiB one, so its
    # side of the staging agreement comes late, while rank 1 (the 4 KiB one) has already failed.
    state = {"a": torch.full((16 << 20,), 1.0), "b": torch.full((1 << 10,), 2.0)}
    if rank == 1:
        try:
            store.save(1, state)
        except ckptstore.CheckpointError as exc:
            assert "belongs to user 65534" in str(exc), str(exc)
        else:
            raise AssertionError("rank 1's save must fail at the call")
    else:
        handle = store.save(1, state)
        try:
            handle.wait("ram")
        except ckptstore.CheckpointError as exc:
            assert "rank 1" in str(exc) and "belongs to user 65534" in str(exc), str(exc)
        else:
            raise AssertionError("rank 0 must learn of rank 1's failure")
    if close:
        try:
            store.close()
        except ckptstore.CheckpointError:
            pass  # the failure of step 1, raised once more
        from torch.distributed import distributed_c10d

        ours = [g for g in distributed_c10d._world.pg_map if g is not dist.group.WORLD]
        assert not ours, f"close() left {len(ours)} process groups of the store for the caller to shut down"
    dist.destroy_process_group()  # the caller's own teardown, right away (dist_workers.run sees it done)


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed since listed
    return count


def store_connections_job(rank: int, world: int, name: str, root: str, ram_dir: str, out: str) -> None:
    """A store's save and restore on every rank, with the sockets this process holds counted
    before the store and after its restore."""
    before = _sockets()
    state = {"w": torch.arange(8, dtype=torch.float32), "shared": torch.ones(4)}  # replicated: written once
    with ckptstore.CheckpointStore(name, local=os.path.join(root, "local"), ram_dir=ram_dir) as store:
        store.save(1, state).wait()
        target = {"w": torch.zeros(8), "shared": torch.zeros(4)}
        assert store.restore(target) == 1
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["shared"], state["shared"])
        after = _sockets()
    with open(os.path.join(out, f"sockets-{rank}"), "w") as fh:
        fh.write(f"{before} {after} {int(LAZY_GLOO in os.environ)}")
