"""What a restart pays before the copy: the step's manifests parsed once per copy, RAM-tier
documents re-read only when their file changed. Real /dev/shm segments and local files; every
restore is checked bitwise."""

from __future__ import annotations

import os
import sys

import torch

from ckptstore import CheckpointStore
from ckptstore.engine import exchange
from ckptstore.tiers.ram import Slot


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 32, generator=g) for i in range(6)}


def _parses(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = exchange.parse_manifest

    def counted(data: bytes, *, where: str):
        seen.append(where)
        return real(data, where=where)

    monkeypatch.setattr(exchange, "parse_manifest", counted)
    return seen


def test_a_restart_parses_each_copy_of_the_manifest_once(job, tmp_path, monkeypatch):
    saved = _state(1)
    with CheckpointStore(job, local=tmp_path / "local") as store:
        store.save(3, saved).wait("local")
        store.close(keep_ram=True)
    seen = _parses(monkeypatch)
    # The start-up (where the job left off), the restore's choice of copy and the meta it reads
    # next all look at step 3: neither copy has a manifest to parse. The RAM slot's document holds
    # the rank's own part and the step's meta, and the local tier (format 2.0, read through the
    # rank's node part), whose layout ranks after it, is not inventoried while the RAM copy loads.
    with CheckpointStore(job, local=tmp_path / "local") as store:
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert store.restore(out) == 3
        assert not seen, seen
        assert store.restore(out) == 3
        assert not seen, seen
    for k, v in saved.items():
        assert torch.equal(out[k], v), k


def test_a_slot_reused_for_a_newer_step_is_read_again(job, tmp_path):
    """A RAM-tier document is kept parsed only while its file is the one parsed: a slot rewritten
    for a newer step (same name, new document) restores the newer step, never the older one."""
    states = {s: _state(s) for s in (1, 2, 3)}
    with CheckpointStore(job, local=tmp_path / "local", keep_local=1) as store:
        out = {k: torch.zeros_like(v) for k, v in states[1].items()}
        store.save(1, states[1]).wait("local")
        assert store.restore(out) == 1  # slot 0's document parsed and kept
        store.save(2, states[2]).wait("local")
        store.save(3, states[3]).wait("local")  # slot 0 again, its document replaced
        store.close(keep_ram=True)
    local = tmp_path / "local"
    for d in os.listdir(local):  # only the RAM slots are left to restore from
        if d.startswith("step-"):
            os.rename(local / d, tmp_path / d)
    with CheckpointStore(job, local=tmp_path / "local") as store:
        out = {k: torch.zeros_like(v) for k, v in states[1].items()}
        assert store.restore(out, step=3) == 3
        for k, v in states[3].items():
            assert torch.equal(out[k], v), k
        assert store.restore(out, step=2) == 2
        for k, v in states[2].items():
            assert torch.equal(out[k], v), k



def test_a_job_without_dtensors_saves_and_restores_without_importing_them(job, tmp_path, monkeypatch):
    """torch.distributed.tensor takes seconds to import (it pulls in sympy): a job that holds no
    DTensor must not pay that on its first save and restore after every restart. Here the module
    cannot be imported at all."""
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    with CheckpointStore(job, local=tmp_path / "local") as store:
        store.save(1, state).wait("local")
        out = {"w": torch.zeros(3, 4)}
        assert store.restore(out) == 1
    assert torch.equal(out["w"], state["w"])


def _mapped_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


def test_a_slot_has_its_pages_mapped_when_it_is_made(job):
    """A staging slot's pages are mapped with it, not faulted in one by one by the first save's
    copy (the trainer is blocked for that copy), nor again by a restarted process."""
    path = f"/dev/shm/ckptstore-{job}-probe.bin"
    size = 8 << 20
    slot = Slot(path, size)
    try:
        assert _mapped_rss(path) >= size
    finally:
        slot.release()
        os.unlink(path)
