"""Ranks of tests/test_dead_branch.py (run by dist_workers.run): a job whose newest step is committed
in RAM when its processes die, one rank's RAM copy of it then damaged, and the restarts that follow.

Rank r runs on node r: its own RAM directory (``<ram_root>/node<r>``) and local directory
(``<local_root>/node<r>``); the durable directory is shared. Each rank saves a tensor of its own
(``w<rank>``), so each step has one part per rank.
"""

from __future__ import annotations

import os

import torch
from dist_workers import _ckptstore_log

import ckptstore
from ckptstore import _faults


def _store(name: str, rank: int, ram_root: str, local_root: str | None, durable: str | None, *,
           replicas: int = 1, ram: str = "node") -> ckptstore.CheckpointStore:
    ram_dir = os.path.join(ram_root, f"{ram}{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    local = os.path.join(local_root, f"node{rank}") if local_root is not None else None
    return ckptstore.CheckpointStore(name, local=local, durable=durable, durable_every=1, keep_local=None,
                                     ram_dir=ram_dir, node=rank, peer_replicas=replicas)


def state(rank: int, step: int, run: int = 0) -> dict:
    """Rank ``rank``'s state at ``step`` in ``run``: a step saved again on the new branch differs."""
    return {f"w{rank}": torch.arange(16384, dtype=torch.float32) + (1000.0 * run + 10.0 * step + rank),
            "step": step, "run": run}


def _empty(rank: int) -> dict:
    return {f"w{rank}": torch.zeros(16384), "step": -1, "run": -1}


def _same(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


def crash_job(rank: int, world: int, name: str, ram_root: str, local_root: str, durable: str) -> None:
    """Step 5 on every tier; then step 10, and the process dies by SIGKILL right after step 10's
    RAM commit, before its local write, replication and promotion begin."""
    store = _store(name, rank, ram_root, local_root, durable)
    handle = store.save(5, state(rank, 5))
    for tier in ("local", "peer", "durable"):
        handle.wait(tier)
    store._drain()
    _faults.arm("ram.committed", "10")
    store.save(10, state(rank, 10)).wait("local")
    raise AssertionError("the crash point was never reached")


def restart_job(rank: int, world: int, name: str, ram_root: str, local_root: str, durable: str) -> None:
    """Step 10 cannot be restored (rank 1's only copy is damaged): the restore loads step 5; the job
    then recomputes and saves 8 and 10 (not refused), and restores the new step 10 bitwise."""
    records = _ckptstore_log()
    store = _store(name, rank, ram_root, local_root, durable)
    assert store.last_step == 10, store.last_step  # what the tiers held at the start
    got = _empty(rank)
    assert store.restore(got) == 5, records
    assert _same(got, state(rank, 5)), got
    for tier in (store.ram, store.local, store.peer):
        assert 10 not in tier.node_steps(), (tier.name, tier.node_steps())
    assert 10 not in store.durable.steps_sync()
    assert store.last_step == 5 and store.latest_step() == 5, (store.last_step, records)
    try:
        store.save(5, state(rank, 5, run=1))
    except ckptstore.InvalidArgumentError as exc:
        assert "step 5 is not after the last saved step 5" in str(exc), exc
    else:
        raise AssertionError("a save of the restored step was not refused")
    for step in (8, 10):
        handle = store.save(step, state(rank, step, run=1))
        for tier in ("local", "peer", "durable"):
            handle.wait(tier)
    again = _empty(rank)
    assert store.restore(again) == 10
    assert _same(again, state(rank, 10, run=1)), again
    assert any("step 10 could not be restored" in m and "dead branch" in m for m in records), records
    store.close(keep_ram=True)  # the next run restarts on these nodes, from their RAM too


def check_job(rank: int, world: int, name: str, ram_root: str, local_root: str, durable: str) -> None:
    """A later restart finds the new step 10 alone, whichever tier it reads: this node's RAM (and
    its peer replicas), the local tier alone, the durable tier alone. A save that does not advance
    past it is refused, as after any restore of the newest step."""
    for where in (dict(local_root=local_root, durable=durable),
                  dict(local_root=local_root, durable=None, replicas=0, ram="empty"),
                  dict(local_root=None, durable=durable, replicas=0, ram="empty")):
        store = _store(name, rank, ram_root, **where)  # type: ignore[arg-type]
        got = _empty(rank)
        assert store.restore(got) == 10, where
        assert _same(got, state(rank, 10, run=1)), (where, got)
        try:
            store.save(10, state(rank, 10, run=2))
        except ckptstore.InvalidArgumentError as exc:
            assert "step 10 is not after the last saved step 10" in str(exc), exc
        else:
            raise AssertionError("a save of the newest step was not refused")
        store.close(keep_ram=True)
