"""Every byte of a restore is verified, whichever reader thread copies it. A large tensor is cut
into read jobs of whole checksum blocks that the reader threads share; a byte damaged in any of
them, read from the RAM slot this process has mapped, from the segment as a restarted process
reads it, or through the device pipeline (a "device" copy that is a CPU copy), is caught before
the restore returns, and the restore falls back to the next copy, bit for bit. When no copy is
sound, the error names the tensor and every copy tried."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import tensor_bytes

from ckptstore import CheckpointStore, CorruptCheckpointError
from ckptstore.checkpoint import sharded, transfer
from ckptstore.engine import pipeline

BLOCK = 1 << 20  # checksum blocks of 1 MiB (4 MiB by default), to keep the state small
ROWS = 6 * BLOCK // 4096  # "big": 6 MiB in rows of 4 KiB, six checksum blocks


@pytest.fixture(autouse=True)
def jobs_of_two_blocks(monkeypatch):
    """Read jobs of two blocks: "big" is read as three jobs, which the reader threads share."""
    monkeypatch.setattr(sharded, "BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(pipeline, "BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(sharded, "JOB_BYTES", 2 * BLOCK)


def _state() -> dict:
    g = torch.Generator().manual_seed(22)
    return {"big": torch.randn(ROWS, 1024, generator=g), "small": torch.randn(100, generator=g)}


def _blank() -> dict:
    return {"big": torch.full((ROWS, 1024), 7.0), "small": torch.zeros(100)}


def _equal(got: dict, want: dict) -> bool:
    return all(torch.equal(tensor_bytes(got[k]), tensor_bytes(want[k])) for k in want)


class CpuEngine(transfer.CopyEngine):
    """The device pipeline with CPU tensors as its "device": copies run when queued."""

    def claims_device(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


def _ram_segment(job: str) -> tuple[str, int]:
    """The RAM copy's data file of step 1 and the offset of "big" in it."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptstore-{job}-") and name.endswith(".json"):
            with open(os.path.join("/dev/shm", name)) as fh:
                doc = json.load(fh)
            if doc.get("step") == 1:
                entry = next(e for e in doc["layout"] if e["nbytes"] == ROWS * 4096)
                return os.path.join("/dev/shm", name[:-5] + ".bin"), entry["offset"]
    raise AssertionError("no RAM copy of step 1")


def _local_file(local: str) -> tuple[str, int]:
    """The local copy's data file of step 1 and the offset of "big" in it."""
    step_dir = os.path.join(local, f"step-{1:012d}")
    with open(os.path.join(step_dir, "manifest.json")) as fh:
        chunk = next(c for c in json.load(fh)["tensors"]["big"]["chunks"])
    return os.path.join(step_dir, chunk["file"]), chunk["offset"]


def _names(text: str, path: str) -> bool:
    """Whether one line of ``text`` reports a checksum mismatch of "big" in the copy at ``path``."""
    return any("checksum mismatch for tensor 'big'" in line and path in line for line in text.splitlines())


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:  # in place, as a memory or disk error would: same inode, same segment
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x20]))


def test_a_large_tensor_is_copied_and_verified_by_several_jobs(job, tmp_path, monkeypatch):
    """Each job copies and hashes only its own blocks, and together they tile the tensor: a large
    tensor is no longer one thread's work while the other cores wait."""
    seen: list[tuple[int, int]] = []
    fill = transfer.fill_verified

    def spy(source, offset, out, checks, *, location, key, memory=None):  # type: ignore[no-untyped-def]
        if key == "big":
            seen.append((offset, out.numel()))
        fill(source, offset, out, checks, location=location, key=key, memory=memory)

    monkeypatch.setattr(transfer, "fill_verified", spy)
    state = _state()
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, state).wait("local")
        target = _blank()
        assert store.restore(target) == 1
    assert _equal(target, state)
    spans = sorted(seen)
    assert len(spans) == 3 and all(n == 2 * BLOCK for _, n in spans)
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


# A damaged byte in the first block (first job), in the middle job, and in the last block.
WHERE = {"first-block": 5, "middle-job": 2 * BLOCK + BLOCK + 4097, "last-block": 6 * BLOCK - 3}
PATHS = ("mapped", "restarted", "device")


@pytest.mark.parametrize("path", PATHS)
def test_a_damaged_block_anywhere_in_a_large_tensor_falls_back_to_the_next_copy(job, tmp_path, caplog, path):
    """One byte damaged at a time, in each job's blocks in turn (and mended before the next)."""
    state = _state()
    store = CheckpointStore(job, local=str(tmp_path / "local"))
    try:
        store.save(1, state).wait("local")
        segment, offset = _ram_segment(job)
        for where, at in WHERE.items():
            _flip(segment, offset + at)
            if path == "restarted":  # nothing of the segment mapped: read with pread, as after a restart
                store.close(keep_ram=True)
                store = CheckpointStore(job, local=str(tmp_path / "local"))
            target = _blank()
            caplog.clear()
            with caplog.at_level(logging.INFO, "ckptstore"):
                if path == "device":
                    with transfer.use_engine(CpuEngine()):
                        assert store.restore(target) == 1
                else:
                    assert store.restore(target) == 1
            assert _equal(target, state), where
            assert _names(caplog.text, segment), where
            assert any("restored step 1 from the local tier" in r.getMessage() for r in caplog.records), where
            _flip(segment, offset + at)  # mended: the next restore takes the RAM copy again
            target = _blank()
            caplog.clear()
            with caplog.at_level(logging.INFO, "ckptstore"):
                assert store.restore(target) == 1
            assert _equal(target, state) and "restored step 1 from the ram tier" in caplog.text, where
    finally:
        store.close()


def test_no_sound_copy_left_names_the_tensor_and_every_copy(job, tmp_path):
    state = _state()
    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local) as store:
        store.save(1, state).wait("local")
        segment, offset = _ram_segment(job)
        _flip(segment, offset + WHERE["middle-job"])
        path, at = _local_file(local)
        _flip(path, at + WHERE["last-block"])
        target = _blank()
        with pytest.raises(CorruptCheckpointError) as err:
            store.restore(target)
    message = str(err.value)
    assert _names(message, segment) and _names(message, path), message
