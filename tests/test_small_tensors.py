"""States of many small tensors: packed writes, grouped reads, and the paused garbage collector.

The layout rules tested here are docs/format.md section 2.3; the speed they buy is measured in
benchmarks/bench_scale.py, never here.
"""

from __future__ import annotations

import gc
import io

import pytest
import torch
from conftest import assert_tensor_identical, container_layout

import ckptstore
from ckptstore import CorruptCheckpointError
from ckptstore.checkpoint.single_file import BATCH_BYTES, SMALL_ALIGN, SMALL_BYTES

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.complex128, torch.bool, torch.int8, torch.uint8, torch.int64]


def mixed_state(n: int = 600) -> dict[str, torch.Tensor]:
    """Small tensors of odd byte lengths and every element size, with large and empty ones between."""
    g = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        numel = 1 + (i * 37) % 900
        if dtype == torch.bool:
            t = torch.randint(0, 2, (numel,), generator=g).bool()
        elif dtype.is_floating_point or dtype.is_complex:
            t = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
        else:
            t = torch.randint(-100 if dtype.is_signed else 0, 100, (numel,), generator=g, dtype=dtype)
        state[f"small.{i}"] = t
        if i % 97 == 0:
            state[f"big.{i}"] = torch.randn(SMALL_BYTES // 4 + 3, generator=g)  # just over the packing bound
        if i % 131 == 0:
            state[f"empty.{i}"] = torch.empty(0, 5)
    state["strided"] = torch.randn(40, 30, generator=g)[:, ::3]  # small, not contiguous: copied while packed
    return state


def chunk_table(path) -> dict[str, tuple[int, int]]:
    lay = container_layout(path.read_bytes())
    return {key: (off, length) for key, off, length in lay["chunks"]}


def test_small_tensors_are_packed_and_round_trip_bitwise(tmp_path):
    state = mixed_state()
    path = tmp_path / "many.ckpt"
    ckptstore.save(state, path)
    for mmap in (False, True):
        loaded = ckptstore.load(path, mmap=mmap)
        assert loaded.keys() == state.keys()
        for key, t in state.items():
            assert_tensor_identical(loaded[key], t, key)

    chunks = chunk_table(path)
    spans = sorted((off, off + length) for off, length in chunks.values() if length)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "chunks overlap"
    for key, (off, length) in chunks.items():
        if length >= SMALL_BYTES:
            assert off % 4096 == 0, key
        elif length:
            assert off % SMALL_ALIGN == 0, key
    # Packing is what keeps the file near the data's size: with 4 KiB per small tensor it would be
    # over 2.4 MB for these 600.
    data = sum(length for _, length in chunks.values())
    small = sum(1 for _, length in chunks.values() if 0 < length < SMALL_BYTES)
    big = sum(1 for _, length in chunks.values() if length >= SMALL_BYTES)
    size = path.stat().st_size
    assert size < data + small * SMALL_ALIGN + (big + 2 + data // BATCH_BYTES) * 4096 + 200_000, size


def test_packed_batches_split_at_batch_bytes(tmp_path):
    # 210 tensors of 40,004 bytes (8 MiB): packed 40,064 bytes apart, in at least three batches,
    # each starting 4 KiB-aligned.
    state = {f"t{i}": torch.full((10_001,), float(i)) for i in range(210)}
    path = tmp_path / "batches.ckpt"
    ckptstore.save(state, path)
    offsets = sorted(off for off, _ in chunk_table(path).values())
    spacing = -(-40_004 // SMALL_ALIGN) * SMALL_ALIGN
    starts = [b for a, b in zip(offsets, offsets[1:]) if b - a != spacing]
    assert len(starts) >= 2 and all(s % 4096 == 0 for s in starts), starts
    assert len(offsets) - len(starts) - 1 >= 200  # the rest sit back to back
    loaded = ckptstore.load(path)
    for key, t in state.items():
        assert torch.equal(loaded[key], t), key


def test_in_order_writes_and_reads_agree_with_packed_ones(tmp_path):
    state = mixed_state(200)
    # A stream cannot take positioned writes: every chunk 4 KiB-aligned, written in order.
    stream = io.BytesIO()
    ckptstore.save(state, stream)
    streamed = stream.getvalue()
    assert all(off % 4096 == 0 for _, off, _ in container_layout(streamed)["chunks"])
    path = tmp_path / "packed.ckpt"
    ckptstore.save(state, path)
    # Each layout read both ways: grouped reads over a path, in-order reads over a file object.
    (tmp_path / "streamed.ckpt").write_bytes(streamed)
    for name in ("streamed.ckpt", "packed.ckpt"):
        for loaded in (ckptstore.load(tmp_path / name), ckptstore.load(io.BytesIO((tmp_path / name).read_bytes()))):
            for key, t in state.items():
                assert_tensor_identical(loaded[key], t, f"{name}: {key}")


def test_a_damaged_small_tensor_in_a_group_is_named(tmp_path):
    state = mixed_state(100)
    path = tmp_path / "damaged.ckpt"
    ckptstore.save(state, path)
    off, length = chunk_table(path)["small.50"]
    data = bytearray(path.read_bytes())
    data[off + length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(path)
    assert info.value.key == "small.50"
    assert "checksum" in str(info.value)


def test_many_small_tensors_through_the_sharded_path(tmp_path):
    state = mixed_state(300)
    ckptstore.save_sharded(state, tmp_path / "sharded")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    # A staging budget below one batch: each batch of small reads still gets one slot.
    ckptstore.load_sharded(target, tmp_path / "sharded", buffer_bytes=4096)
    for key, t in state.items():
        assert_tensor_identical(target[key], t, key)


def _spy_gc(monkeypatch, module, name) -> list[bool]:
    """Record gc.isenabled() each time ``module.name`` runs (inside the public call)."""
    seen: list[bool] = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_the_collector_is_paused_inside_calls_and_restored_after(tmp_path, monkeypatch):
    from ckptstore.api import dropin

    saving = _spy_gc(monkeypatch, dropin, "write_container")
    loading = _spy_gc(monkeypatch, dropin, "load_container")
    state = {f"t{i}": torch.tensor([float(i)]) for i in range(2_000)}
    path = tmp_path / "gc.ckpt"
    assert gc.isenabled()
    ckptstore.save(state, path)
    assert saving == [False] and gc.isenabled()
    loaded = ckptstore.load(path)
    assert loading == [False] and gc.isenabled()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())

    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.load(tmp_path / "missing.ckpt")
    assert gc.isenabled(), "an error must not leave the collector off"

    gc.disable()
    try:
        ckptstore.save(state, path)
        assert saving[-1] is False
        assert not gc.isenabled(), "a caller's own gc.disable() is kept"
    finally:
        gc.enable()


def test_paused_calls_nest_across_threads():
    import threading

    from ckptstore._gc import paused

    inner_done, release = threading.Event(), threading.Event()

    def other():
        with paused():
            inner_done.set()
            release.wait(10)

    with paused():
        worker = threading.Thread(target=other)
        worker.start()
        assert inner_done.wait(10)
    # The first pause ended while the other thread's still runs: the collector stays off.
    assert not gc.isenabled()
    release.set()
    worker.join(10)
    assert gc.isenabled()


def test_store_save_and_restore_pause_the_collector(tmp_path, monkeypatch, job):
    from ckptstore.engine import restore as store_module

    state = {f"t{i}": torch.tensor([float(i)]) for i in range(2_000)}
    with ckptstore.CheckpointStore(job, local=str(tmp_path / "local")) as store:
        staging = _spy_gc(monkeypatch, store.ram, "stage")
        store.save(1, state).wait("local")
        assert staging == [False]
        restoring = _spy_gc(monkeypatch, store_module, "load_manifest")
        target = {k: torch.zeros(1) for k in state}
        assert store.restore(target) == 1
        assert restoring and not any(restoring)
        assert gc.isenabled()
    for key, t in state.items():
        assert torch.equal(target[key], t), key


def test_ram_layout_packs_small_entries_and_aligns_at_breaks():
    from ckptstore.tiers.ram import Layout

    items = [(f"s{i}", torch.zeros(10 + i)) for i in range(5)] + [("big", torch.zeros(SMALL_BYTES // 4))]
    items += [("after", torch.zeros(3)), ("cut", torch.zeros(3))]
    layout = Layout.of(items, frozenset({7}))
    offsets = {e.key: e.offset for e in layout.entries}
    assert [offsets[f"s{i}"] for i in range(5)] == [0, 64, 128, 192, 256]  # 40 to 56 bytes each, 64 apart
    assert offsets["big"] % 4096 == 0 and offsets["big"] == 4096
    assert offsets["after"] == 4096 + SMALL_BYTES  # right after the big entry, 64-aligned
    assert offsets["cut"] % 4096 == 0 and offsets["cut"] > offsets["after"]
    assert layout.total % 4096 == 0
    # 1,000 tensors of 40 bytes fit in 64 KiB of slot, not the 4 MB that 4 KiB apiece would take.
    assert Layout.of([(f"k{i}", torch.zeros(10)) for i in range(1000)]).total == 65536


def test_store_with_small_frozen_and_trained_tensors_restores_bitwise_from_local(tmp_path, job):
    from conftest import wipe_ram

    state = {"base": {str(i): torch.full((7 + i % 5,), float(i)) for i in range(300)},
             "head": {str(i): torch.zeros(3 + i % 4) for i in range(300)}}
    with ckptstore.CheckpointStore(job, local=str(tmp_path / "local"), frozen=lambda k: k.startswith("base/")) as store:
        for step in range(1, 4):
            for i, t in state["head"].items():
                t.add_(step * (int(i) + 1))
            store.save(step, state).wait("local")
    # The frozen entries end on a page of their own, so their file is the same (one inode) in every step.
    frozen_files = [p for p in (tmp_path / "local").glob("step-*/data/*frozen*")]
    assert len(frozen_files) == 3 and len({p.stat().st_ino for p in frozen_files}) == 1, frozen_files
    wipe_ram(job)
    target = {part: {k: torch.zeros_like(v) for k, v in d.items()} for part, d in state.items()}
    with ckptstore.CheckpointStore(job, local=str(tmp_path / "local")) as store:
        assert store.restore(target) == 3
    for part, d in state.items():
        for key, t in d.items():
            assert_tensor_identical(target[part][key], t, f"{part}/{key}")


def test_scatter_reads_fill_every_buffer_across_iov_max_and_short_reads(tmp_path, monkeypatch):
    import os

    from ckptstore.storage import targets

    data = bytes(range(256)) * 40  # 10,240 bytes
    path = tmp_path / "blob"
    path.write_bytes(data)
    source = targets.LocalSource(str(path), str(path))
    try:
        # 3,000 buffers of 3 bytes: three preadv calls of at most IOV_MAX buffers each.
        bufs = [memoryview(bytearray(3)) for _ in range(3000)]
        source.readv_into(100, bufs)
        assert b"".join(bytes(b) for b in bufs) == data[100:9100]

        # A short preadv (the kernel may return fewer bytes) is finished buffer by buffer.
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: real(fd, [bufs[0][:1]], offset))
        bufs = [memoryview(bytearray(5)) for _ in range(10)]
        source.readv_into(7, bufs)
        assert b"".join(bytes(b) for b in bufs) == data[7:57]
        monkeypatch.setattr(os, "preadv", real)

        # Past the end of the file: a short read, never a silently zero-filled buffer.
        with pytest.raises(targets.ShortRead):
            source.readv_into(10_200, [memoryview(bytearray(30)), memoryview(bytearray(30))])
    finally:
        source.close()
