"""The RAM tier: reusable shared-memory staging slots in real /dev/shm segments."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import warm_python

import ckptstore
from ckptstore.tiers.ram import RamTier

SHM = "/dev/shm"


def _items(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model/w", torch.randn(300, 200, generator=g)),
        ("model/b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(seed)),
        ("empty", torch.empty(0, 3)),
        ("ids", torch.randint(0, 2**40, (33,), generator=g)),
    ]


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_stage_commit_read_round_trip_and_slots_are_reused(job):
    tier = RamTier(job, ram_dir=SHM, slots=2)
    ptrs = []
    for step in range(4):
        items = _items(step)
        staged = tier.stage(step, items)
        ptrs.append(tier._slots[staged.slot].buffer.data_ptr())
        tier.commit_staged(staged, tier.checksums(staged))
    assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3], "the same two slots are reused, not reallocated"
    docs = tier.committed()
    assert [d["step"] for d in docs] == [3, 2]
    got = tier.read(docs[0])
    for key, t in _items(3):
        assert _bitwise(got[key], t), key
    tier.close(unlink=True)


def test_segments_are_owner_only(job):
    tier = RamTier(job, ram_dir=SHM)
    staged = tier.stage(1, _items())
    tier.commit_staged(staged, tier.checksums(staged))
    for ext in ("bin", "json"):
        mode = os.stat(os.path.join(SHM, f"ckptstore-{job}-r00000-s0.{ext}")).st_mode
        assert stat.S_IMODE(mode) == 0o600, ext
    tier.close(unlink=True)


def test_a_restarted_process_restores_from_ram(job):
    code = f"""
import os, torch
from ckptstore.tiers.ram import RamTier
g = torch.Generator().manual_seed(5)
tier = RamTier({job!r}, ram_dir={SHM!r})
staged = tier.stage(42, [("w", torch.randn(1000, 100, generator=g))])
tier.commit_staged(staged, tier.checksums(staged))
os._exit(9)  # a crash: no cleanup, no close
"""
    assert warm_python.run(["-c", code]).returncode == 9  # a process of its own, forked warm
    tier = RamTier(job, ram_dir=SHM)
    docs = tier.committed()
    assert [d["step"] for d in docs] == [42]
    g = torch.Generator().manual_seed(5)
    assert _bitwise(tier.read(docs[0])["w"], torch.randn(1000, 100, generator=g))
    tier.close(unlink=True)


def test_an_uncommitted_restage_hides_the_slot(job):
    tier = RamTier(job, ram_dir=SHM, slots=1)
    staged = tier.stage(1, _items(1))
    tier.commit_staged(staged, tier.checksums(staged))
    tier.stage(2, _items(2))  # crash before commit: the old manifest must not describe new bytes
    assert tier.committed() == []
    tier.close(unlink=True)


def test_other_jobs_and_stale_segments_are_refused(job):
    tier = RamTier(job, ram_dir=SHM)
    staged = tier.stage(1, _items())
    tier.commit_staged(staged, tier.checksums(staged))
    assert RamTier(job + "-other", ram_dir=SHM).committed() == []
    assert RamTier(job, rank=1, ram_dir=SHM).committed() == []
    os.truncate(os.path.join(SHM, f"ckptstore-{job}-r00000-s0.bin"), 4096)  # a segment of another generation
    assert RamTier(job, ram_dir=SHM).committed() == []
    tier.close(unlink=True)


def test_damaged_segment_is_detected(job):
    tier = RamTier(job, ram_dir=SHM)
    staged = tier.stage(1, _items())
    tier.commit_staged(staged, tier.checksums(staged))
    path = os.path.join(SHM, f"ckptstore-{job}-r00000-s0.bin")
    with open(path, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))
    fresh = RamTier(job, ram_dir=SHM)
    with pytest.raises(ckptstore.CorruptCheckpointError, match="checksum mismatch for 'model/w'"):
        fresh.read(fresh.committed()[0])
    tier.close(unlink=True)


def test_bad_job_name_and_ram_dir():
    with pytest.raises(ckptstore.InvalidArgumentError, match="job"):
        RamTier("../escape", ram_dir=SHM)
    with pytest.raises(ckptstore.InvalidArgumentError, match="not a directory"):
        RamTier("ok", ram_dir="/nonexistent-dir")


def test_frozen_tensors_are_not_recopied_while_their_version_is_unchanged(job):
    tier = RamTier(job, ram_dir=SHM, slots=1)
    frozen, trained = torch.randn(500, 100), torch.randn(10)
    items = [("frozen", frozen), ("trained", trained)]
    first = tier.stage(1, items, may_skip=frozenset({"frozen"}))
    assert first.reused == () and first.copied_bytes == frozen.nbytes + trained.nbytes
    trained.add_(1.0)  # an in-place update bumps the version counter
    second = tier.stage(2, items, may_skip=frozenset({"frozen"}))
    assert second.reused == ("frozen",) and second.copied_bytes == trained.nbytes
    tier.commit_staged(second, tier.checksums(second))
    got = tier.read(tier.committed()[0])
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["trained"], trained)
    frozen.add_(1.0)  # a visible update of a "frozen" tensor is still captured
    third = tier.stage(3, items, may_skip=frozenset({"frozen"}))
    assert third.reused == ()
    tier.close(unlink=True)


def test_the_data_hazard_is_why_skipping_is_opt_in(job):
    """Writes through .data (or numpy views) do not bump the version counter, so the counter alone
    would keep a skipped tensor's old bytes. Opted-in tensors under 64 KiB are copied anyway
    (as cheap as checking); larger ones are skipped only while a sample of their elements, drawn
    afresh at each save, still equals the slot's copy: a tensor changed wholesale is copied. (A
    change the sample misses waits for the slot's refresh: tests/test_crash_loop.py.)"""
    tier = RamTier(job, ram_dir=SHM, slots=1)
    small, big = torch.zeros(1000), torch.zeros(100_000)
    items = [("small", small), ("big", big)]
    everything = frozenset({"small", "big"})
    first = tier.stage(1, items, may_skip=everything)
    tier.commit_staged(first, tier.checksums(first))
    unchanged = tier.stage(2, items, may_skip=everything)
    assert unchanged.reused == ("big",), "an unchanged large frozen tensor is not copied again"
    tier.commit_staged(unchanged, tier.checksums(unchanged))
    version = big._version
    small.data.add_(5.0)
    big.data.add_(5.0)
    assert big._version == version, "the hazard: .data writes leave the version counter alone"
    caught = tier.stage(3, items, may_skip=everything)
    assert caught.reused == (), "the sample sees the change: copied"
    tier.commit_staged(caught, tier.checksums(caught))
    got = tier.read(tier.committed()[0])
    assert torch.equal(got["small"], torch.full((1000,), 5.0)) and torch.equal(got["big"], torch.full((100_000,), 5.0))
    tier.close(unlink=True)


def _mapped_kib(address: int) -> int:
    """The resident size (KiB) of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            rss = next(entry for entry in lines[i + 1:] if entry.startswith("Rss:"))
            return int(rss.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
@pytest.mark.parametrize("how", ["madvise", "a read of each page (a kernel without MADV_POPULATE_WRITE)"])
def test_a_segment_is_mapped_whole_when_it_is_opened_and_keeps_its_bytes(job, monkeypatch, how):
    """Every page of a segment is in the mapping as soon as it is opened, so the first save into
    it takes no page faults; the mapping no longer comes from mmap(MAP_POPULATE), which held the
    GIL through the call (seconds for a replaced node's first slots, with the training thread
    stopped), and a segment a restarted process maps again keeps what the dead one committed."""
    import ctypes

    from ckptstore.tiers import ram

    if how != "madvise":
        monkeypatch.setattr(ram, "_madvise", None)
    else:
        import mmap

        probe = mmap.mmap(-1, mmap.PAGESIZE)
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
            if ram._madvise is None or ram._madvise(address, mmap.PAGESIZE, ram._MADV_POPULATE_WRITE) != 0:
                pytest.skip("this kernel refuses MADV_POPULATE_WRITE: the other case covers it")
        finally:
            probe.close()
    path = os.path.join(SHM, f"ckptstore-{job}-r00000-s0.bin")
    size = 16 << 20
    first, _ = ram._map_segment(path, size)
    pattern = torch.arange(size // 8, dtype=torch.int64)
    torch.frombuffer(first, dtype=torch.int64).copy_(pattern)
    first.close()
    again, _ = ram._map_segment(path, size)  # a restarted process's mapping of the same segment
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(again))
        assert _mapped_kib(address) == size // 1024
        assert torch.equal(torch.frombuffer(again, dtype=torch.int64), pattern)
    finally:
        again.close()
        os.unlink(path)
