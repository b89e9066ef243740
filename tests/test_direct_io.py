"""Bulk writes through O_DIRECT (and the buffered fallback) keep every byte and end the file exactly
at the footer."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from conftest import assert_same

import ckptstore
from ckptstore.format import container
from ckptstore.storage import direct


def _odd_state() -> dict:
    g = torch.Generator().manual_seed(3)
    # Sizes that are not multiples of 4 KiB (padding after each chunk), one bigger than a bounce
    # buffer (several pieces, the last one short), empty and 0-d tensors in between.
    return {
        "a": torch.randn(1001, generator=g),
        "big": torch.randn((direct.BOUNCE_BYTES // 4) + 777, generator=g),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
        "b": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "c": torch.randn(33, 17, generator=g).to(torch.bfloat16),
    }


def _count_direct_writes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = direct.pwrite_direct

    def spy(fd, data, offset):
        calls.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(direct, "pwrite_direct", spy)
    return calls


def _filesystem_takes_o_direct(directory) -> bool:
    probe = os.path.join(directory, "probe")
    open(probe, "wb").close()
    fd = direct.open_direct(probe)
    if fd is None:
        return False
    try:
        direct.pwrite_direct(fd, memoryview(b"x"), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


@pytest.mark.parametrize("enabled", [True, False], ids=["direct", "buffered"])
def test_round_trip_is_bitwise_and_file_ends_at_footer(tmp_path, monkeypatch, enabled):
    monkeypatch.setattr(direct, "ENABLED", enabled)
    takes_direct = enabled and _filesystem_takes_o_direct(tmp_path)
    calls = _count_direct_writes(monkeypatch)
    state = _odd_state()
    path = tmp_path / "x.ckpt"
    ckptstore.save(state, path)
    assert_same(ckptstore.load(path), state)
    if takes_direct:
        # Every chunk byte went through O_DIRECT: the large chunk in pieces of its own length, the
        # small ones packed into one batch padded to 4 KiB (format.md 2.3).
        big = state["big"].numel() * 4
        small = sum(t.numel() * t.element_size() for k, t in state.items() if k != "big")
        assert sum(calls) - big == container.align_up(sum(container.align_up(n, 64) for n in (4004, 4, 4097, 1122)))
        assert small <= sum(calls) - big < small + 4096 + 3 * 64
    else:
        assert calls == []
    data = path.read_bytes()
    length = struct.unpack_from("<8sHHIQQ", data)[4]
    assert length == len(data), "the file must end exactly at the footer, with no block padding after it"
    assert data[-8:] == container.FOOTER_MAGIC
    assert sorted(os.listdir(tmp_path)) == ["x.ckpt"]


def test_overwrite_with_smaller_checkpoint_leaves_no_stale_tail(tmp_path):
    path = tmp_path / "x.ckpt"
    ckptstore.save({"w": torch.randn(1 << 20)}, path)
    small = {"w": torch.arange(10)}
    ckptstore.save(small, path)
    assert_same(ckptstore.load(path), small)
    assert os.path.getsize(path) < 16 << 10


@pytest.mark.parametrize("tail", [0, 100], ids=["whole-blocks", "unaligned-tail"])
def test_page_aligned_memory_goes_straight_to_disk_without_a_bounce_copy(tmp_path, monkeypatch, tail):
    import mmap

    from ckptstore.storage.targets import LocalSink

    size = 3 * direct.BOUNCE_BYTES + 5 * direct.ALIGN + tail
    buf = mmap.mmap(-1, size)  # page-aligned, like a RAM-tier slot
    payload = os.urandom(size)
    buf[:] = payload
    bounced: list[int] = []
    real_buffers = direct._buffers

    def spy_buffers():
        bounced.append(1)
        return real_buffers()

    monkeypatch.setattr(direct, "_buffers", spy_buffers)
    sink = LocalSink(str(tmp_path / "f.bin"), "f.bin")
    if sink.dfd is None:
        sink.abort()
        pytest.skip("this filesystem refuses O_DIRECT")
    sink.write_at(0, memoryview(buf))
    sink.skip_to(size)
    sink.commit(b"")
    assert (tmp_path / "f.bin").read_bytes() == payload
    assert len(bounced) == (1 if tail else 0)  # only an unaligned tail is copied
