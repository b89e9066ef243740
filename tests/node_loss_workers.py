"""Ranks of tests/test_node_loss.py (run by dist_workers.run): a job whose newest step is committed
in RAM only when its processes die, and the restarts that follow the loss of a node.

Rank r runs on node r: its own RAM directory (``<ram_root>/node<r>``) and local directory
(``<local_root>/node<r>``), so a node is lost by removing both. Each rank saves a tensor of its own
(``w<rank>``), so each step has one part per rank, written only by that rank's node.
"""

from __future__ import annotations

import os

import torch
from dist_workers import _ckptstore_log

import ckptstore
from ckptstore import _faults


def _store(name: str, rank: int, ram_root: str, local_root: str, replicas: int, **kw) -> ckptstore.CheckpointStore:
    ram_dir = os.path.join(ram_root, f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    kw.setdefault("keep_local", 3)
    return ckptstore.CheckpointStore(name, local=os.path.join(local_root, f"node{rank}"), ram_dir=ram_dir, node=rank,
                                     peer_replicas=replicas, **kw)


def _state(rank: int, step: int, run: int = 0) -> dict:
    """Rank ``rank``'s state at ``step`` in ``run`` (a step saved again after a rollback differs)."""
    return {f"w{rank}": torch.arange(4096, dtype=torch.float32) + (1000.0 * run + 10.0 * step + rank),
            "step": step, "run": run}


def _empty(rank: int) -> dict:
    return {f"w{rank}": torch.zeros(4096), "step": -1, "run": -1}


def _same(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


def crash_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int,
              steps: list[int], **kw) -> None:
    """Save ``steps`` (each older one on every node tier), then the last one: the process dies by
    SIGKILL right after its RAM commit, before its local write and its replication begin."""
    store = _store(name, rank, ram_root, local_root, replicas, **kw)
    for step in steps[:-1]:
        handle = store.save(step, _state(rank, step))
        handle.wait("local")
        if replicas:
            handle.wait("peer")
    store._drain()
    _faults.arm("ram.committed", str(steps[-1]))
    store.save(steps[-1], _state(rank, steps[-1])).wait("local")
    raise AssertionError("the crash point was never reached")


def restart_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int,
                expect: int | None, dead: int, **kw) -> None:
    """Restore after the loss of node 0: ``expect`` (None: a fresh start), never the incomplete
    ``dead`` step; then save ``dead`` again and restore it bitwise."""
    records = _ckptstore_log()
    store = _store(name, rank, ram_root, local_root, replicas, **kw)
    state = _empty(rank)
    got = store.restore(state)
    assert got == expect, (got, records)
    if expect is not None:
        assert _same(state, _state(rank, expect)), state
    # The dead branch is gone from every node tier, and no longer counts as saved.
    for tier in (store.ram, store.local, store.peer):
        assert dead not in tier.node_steps(), (tier.name, tier.node_steps())
    assert store.last_step == expect, store.last_step
    assert store.latest_step() == expect
    handle = store.save(dead, _state(rank, dead, run=1))
    handle.wait("local")
    if replicas:
        handle.wait("peer")
    again = _empty(rank)
    assert store.restore(again) == dead
    assert _same(again, _state(rank, dead, run=1)), again
    assert any(f"step {dead} is incomplete" in m for m in records), records
    if expect is None:
        assert any("starting fresh" in m for m in records), records
    store.close(keep_ram=True)  # the next run restarts on these nodes, from their RAM too


def check_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int, step: int) -> None:
    """A later restart finds only the new copy of ``step``, in every tier."""
    store = _store(name, rank, ram_root, local_root, replicas)
    state = _empty(rank)
    assert store.restore(state) == step
    assert _same(state, _state(rank, step, run=1)), state
    store.close()


def local_fails_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int) -> None:
    """Step 2's local write fails on every rank (a file stands where its directory goes); its
    replication, which starts at the RAM commit beside the local write, still commits."""
    store = _store(name, rank, ram_root, local_root, replicas)
    store.save(1, _state(rank, 1)).wait("local")
    with open(os.path.join(local_root, f"node{rank}", "step-000000000002"), "w"):
        pass
    handle = store.save(2, _state(rank, 2))
    handle.wait("peer")
    assert 2 in store.peer.node_steps(), store.peer.node_steps()
    try:
        handle.wait("local")
    except ckptstore.CheckpointError as exc:
        assert "step-000000000002" in str(exc), exc
    else:
        raise AssertionError("the local write of step 2 did not fail")
    try:
        store.close()
    except ckptstore.CheckpointError:
        pass  # step 2's local failure, raised once more by close


def saves_then_dies_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int,
                        steps: list[int], restore: int | None = None, frozen: bool = False, **kw) -> None:
    """Restore ``restore`` (when given), save ``steps``, each on every tier it goes to, then die by
    SIGKILL with nothing in flight: a crash between two saves. ``frozen``: a frozen tensor among
    the state (:func:`_frozen_state`)."""
    import signal

    store = _frozen_store(name, rank, ram_root, local_root, replicas) if frozen else _store(
        name, rank, ram_root, local_root, replicas, **kw)
    make = _frozen_state if frozen else _state
    if restore is not None:
        state = _empty(rank)
        assert store.restore(state) == restore
        assert _same(state, _state(rank, restore)), state
    for step in steps:
        handle = store.save(step, make(rank, step))
        handle.wait("local")
        handle.wait("peer")
    store._drain()
    os.kill(os.getpid(), signal.SIGKILL)


def restores_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int,
                 expect: int | None, **kw) -> None:
    store = _store(name, rank, ram_root, local_root, replicas, **kw)
    state = _empty(rank)
    assert store.restore(state) == expect
    if expect is not None:
        assert _same(state, _state(rank, expect)), state
    store.close()


def _frozen_store(name: str, rank: int, ram_root: str, local_root: str, replicas: int) -> ckptstore.CheckpointStore:
    return _store(name, rank, ram_root, local_root, replicas, frozen=lambda key: key.startswith("frozen"))


def _frozen_state(rank: int, step: int) -> dict:
    """A state with a frozen tensor of 128 KiB, which the local tier keeps in a file of its own: a
    rank's local copy is then laid out unlike its slot (and unlike the slot's peer replicas)."""
    return {f"frozen{rank}": torch.full((32768,), float(rank + 1)), **_state(rank, step)}


def frozen_restores_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int,
                        expect: int) -> None:
    records = _ckptstore_log()
    store = _frozen_store(name, rank, ram_root, local_root, replicas)
    state = {f"frozen{rank}": torch.zeros(32768), **_empty(rank)}
    got = store.restore(state)
    assert got == expect, (got, records)
    assert _same(state, _frozen_state(rank, expect)), state
    assert any(f"restored step {expect} from the local+peer tier" in m for m in records), records
    store.close()


def replaced_node_slot_job(rank: int, world: int, name: str, ram_root: str, local_root: str, replicas: int,
                           expect: int, slot_bytes: int) -> None:
    """After node 0's loss: restore ``expect``; the next save's slot is then made ahead at the size
    of the slot the step was staged in (``slot_bytes``), on the replaced node too, which had no local
    file to say it when its store started; the save stages into that slot."""
    store = _store(name, rank, ram_root, local_root, replicas)
    state = _empty(rank)
    assert store.restore(state) == expect
    assert _same(state, _state(rank, expect)), state
    ram = store.ram
    index = ram.next_slot
    ahead = ram._preparing.get(index)
    assert ahead is not None, f"rank {rank}: no slot is being made for the next save"
    slot = ahead.result(timeout=60)
    assert slot is not None and slot.size == slot_bytes, (rank, slot and slot.size, slot_bytes)
    handle = store.save(expect + 1, _state(rank, expect + 1))
    handle.wait("local")
    assert ram._slots[index] is slot  # staged into the slot made ahead, not one mapped by the save
    store.close()
