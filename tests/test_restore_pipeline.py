"""The load pipeline into device tensors (read, verify, copy), run on the CPU: an engine whose
"device" copies are CPU copies carried out late, as a GPU's asynchronous copies are. A pipeline that
copied bytes before verifying them, reused a staging buffer before its copy had read it, or copied
a byte twice gives wrong tensors or a wrong count here. The same paths with CUDA are in
tests/test_cuda.py, which skips without a device."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
from conftest import tensor_bytes, wipe_ram

import ckptstore
from ckptstore import CheckpointStore, CorruptCheckpointError
from ckptstore.checkpoint import transfer
from ckptstore.checkpoint.sharded import GlobalBox
from ckptstore.tiers.ram import SegmentSource

MIB = 1 << 20


class LateEngine(transfer.CopyEngine):
    """Copies into CPU tensors, queued and carried out only when the pipeline waits for a token or
    finishes (a GPU's copy runs some time after it is queued). Counts every byte copied into each
    destination, and the staging buffers it handed out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        self.copies: list[tuple[int, int]] = []  # (destination address, bytes) of each copy carried out
        self.sources: list[int] = []  # address of each copy's source
        self.hosts: list[torch.Tensor] = []
        self.waits = 0
        self.began = 0

    def claims_device(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def host(self, nbytes: int) -> torch.Tensor:
        buf = torch.full((nbytes,), 0xEE, dtype=torch.uint8)  # a reused buffer's stale bytes stand out
        self.hosts.append(buf)
        return buf

    def begin(self, tensors: list[torch.Tensor]) -> None:
        self.began += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            self.queued.append((dst, src))

    def record(self) -> int:
        with self.lock:
            return len(self.queued)

    def _run(self, upto: int) -> None:
        with self.lock:
            while self.done < upto:
                dst, src = self.queued[self.done]
                dst.copy_(src)
                self.copies.append((dst.data_ptr(), dst.numel() * dst.element_size()))
                self.sources.append(src.data_ptr())
                self.done += 1

    def wait(self, token: int) -> None:
        self.waits += 1
        self._run(token)

    def finish(self) -> None:
        self._run(len(self.queued))

    def assert_each_byte_once(self, tensors: list[torch.Tensor]) -> None:
        spans = sorted(self.copies)
        for (a, n), (b, _m) in zip(spans, spans[1:]):
            assert a + n <= b, "a destination byte was copied twice"
        assert sum(n for _, n in spans) == sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of one 4 MiB block, and staging for two of them: a 12 MiB tensor then needs three
    pieces through two buffers, so a buffer is reused while copies are still queued."""
    monkeypatch.setattr(transfer, "PIECE_BYTES", 4 * MIB)
    monkeypatch.setattr(transfer, "STAGING_BYTES", 8 * MIB)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MIB, generator=g).view(-1, 1024),  # 12 MiB: three 4 MiB blocks
        "odd": torch.randn(1000, 777, generator=g),  # rows that straddle block boundaries
        "small": [torch.randn(100 + i, generator=g).to(torch.bfloat16) for i in range(40)],
        "mask": torch.rand(333, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (77,), generator=g),
    }


def _tensors(state: dict) -> list[torch.Tensor]:
    return [state["big"], state["odd"], *state["small"], state["mask"], state["scalar"], state["i64"]]


def _blank(state: dict, fill: int = 0x5A) -> dict:
    """Tensors like ``state``'s, every byte ``fill``: a byte never written keeps it."""
    def blank(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        tensor_bytes(out).fill_(fill)
        return out
    return {k: [blank(t) for t in v] if isinstance(v, list) else blank(v) for k, v in state.items()}


def _assert_equal(got: dict, want: dict) -> None:
    for a, b in zip(_tensors(got), _tensors(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(tensor_bytes(a), tensor_bytes(b))


def test_sharded_load_through_the_engine_is_bitwise_each_byte_copied_once(tmp_path, small_pieces):
    state = _state(1)
    ckptstore.save_sharded(state, str(tmp_path / "ck"))
    target = _blank(state)
    with transfer.use_engine(LateEngine()) as engine:
        ckptstore.load_sharded(target, str(tmp_path / "ck"))
    _assert_equal(target, state)
    engine.assert_each_byte_once(_tensors(target))
    assert engine.began == 1 and engine.done == len(engine.queued)
    # The pieces went through two staging buffers: each was handed out again only after the
    # copies reading it ran (else the bytes of the piece read into it next would have landed).
    assert len(engine.hosts) == 2 and engine.waits >= 1


def test_a_box_narrower_than_the_saved_rows_goes_through_the_engine(tmp_path, small_pieces):
    """Columns of a row-chunked tensor: not one span of the chunk, so verified whole, then copied
    as a strided box."""
    state = _state(2)
    ckptstore.save_sharded(state, str(tmp_path / "ck"))
    cols = torch.zeros(state["big"].shape[0], 300)
    box = GlobalBox(cols, (0, 500), tuple(state["big"].shape), torch.float32)
    with transfer.use_engine(LateEngine()) as engine:
        ckptstore.load_sharded({"big": box}, str(tmp_path / "ck"), strict=False)
    assert torch.equal(cols, state["big"][:, 500:800])
    engine.assert_each_byte_once([cols])


def test_a_damaged_piece_is_never_copied(tmp_path, small_pieces):
    state = _state(3)
    url = str(tmp_path / "ck")
    ckptstore.save_sharded(state, url)
    manifest = ckptstore.checkpoint.sharded.read_manifest(ckptstore.checkpoint.sharded.Directory(url, None))
    chunk = manifest.tensors["big"].chunks[0]
    path = os.path.join(url, chunk.file)
    with open(path, "r+b") as fh:  # one byte of the third 4 MiB block
        fh.seek(chunk.offset + 2 * 4 * MIB + 12345)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))
    target = _blank(state)
    with transfer.use_engine(LateEngine()) as engine, pytest.raises(CorruptCheckpointError) as err:
        ckptstore.load_sharded(target, url)
    assert err.value.key == "big" and chunk.file in err.value.location
    assert "checksum mismatch" in str(err.value)
    # The copies queued before the failure all ran before the load returned, and none of them
    # was of the damaged block: its destination bytes are as they were.
    assert engine.done == len(engine.queued)
    damaged = tensor_bytes(target["big"])[2 * 4 * MIB : 3 * 4 * MIB]
    assert bool((damaged == 0x5A).all())


def test_store_restore_copies_straight_from_the_ram_slot_and_falls_back_on_damage(job, tmp_path, caplog,
                                                                                small_pieces):
    state = _state(4)
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, state).wait("local")
        slot = next(iter(store.ram._slots.values()))
        lo, hi = slot.buffer.data_ptr(), slot.buffer.data_ptr() + slot.size
        target = _blank(state)
        with transfer.use_engine(LateEngine()) as engine:
            assert store.restore(target) == 1
        _assert_equal(target, state)
        engine.assert_each_byte_once(_tensors(target))
        # Every copy read the slot itself: no staging buffer, no second copy.
        assert engine.hosts == [] and all(lo <= p < hi for p in engine.sources)

        # A damaged byte in the slot: the restore fails over to the local tier, bitwise.
        tensor_bytes(slot.buffer)[slot.size // 3] ^= 0xFF
        target = _blank(state)
        with transfer.use_engine(LateEngine()) as engine, caplog.at_level(logging.INFO, "ckptstore"):
            assert store.restore(target) == 1
        _assert_equal(target, state)
        assert "checksum mismatch" in caplog.text
        assert any("restored step 1 from the local tier" in r.getMessage() for r in caplog.records), caplog.text


def test_restore_of_compressed_durable_chunks_through_the_engine(job, tmp_path):
    state = _state(5)
    with CheckpointStore(job, durable=str(tmp_path / "durable"), durable_every=1,
                         durable_compression="zstd") as store:
        store.save(1, state).wait("durable")
    wipe_ram(job)
    target = _blank(state)
    with CheckpointStore(job, durable=str(tmp_path / "durable")) as store, \
            transfer.use_engine(LateEngine()) as engine:
        assert store.restore(target) == 1
    _assert_equal(target, state)
    engine.assert_each_byte_once(_tensors(target))


def test_dropin_load_into_a_device_goes_through_the_engine(tmp_path):
    state = _state(6)
    path = str(tmp_path / "x.ckpt")
    ckptstore.save(state, path)
    with transfer.use_engine(LateEngine()) as engine:
        got = ckptstore.load(path, map_location="cpu")
    _assert_equal(got, state)
    engine.assert_each_byte_once(_tensors(got))
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))
    with transfer.use_engine(LateEngine()), pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckptstore.load(path)


def test_segment_memory_is_the_mapped_slot_of_the_same_file_only(job, tmp_path):
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, {"x": torch.arange(1000.0)}).wait("local")
        slot = next(iter(store.ram._slots.values()))
        source = SegmentSource(slot.path, slot.path)
        try:
            memory = source.memory()
            assert memory is not None and memory.data_ptr() == slot.buffer.data_ptr()
        finally:
            source.close()
        # The same name, another file (a segment replaced since): read, never the old mapping.
        with open(slot.path, "rb") as fh:
            data = fh.read()
        os.unlink(slot.path)
        with open(slot.path, "wb") as fh:
            fh.write(data)
        source = SegmentSource(slot.path, slot.path)
        try:
            assert source.memory() is None
        finally:
            source.close()
