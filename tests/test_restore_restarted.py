"""A restarted process restores from the RAM segments the previous process left in /dev/shm: a
process of its own, which has nothing of them mapped, reads them with ``pread`` and verifies every
piece before the restore returns. It gets the saved bytes; a byte damaged in any read job's
blocks is caught there, and the restore falls back to the local copy, bit for bit."""

from __future__ import annotations

import json

import pytest
import warm_python
from test_restore_verify import BLOCK, ROWS, WHERE, _ram_segment, _state

from ckptstore import CheckpointStore
from ckptstore.checkpoint import sharded
from ckptstore.engine import pipeline

# The restarted process: for each damage position given (none: one clean restore), damage the
# segment in place, restore through a store of its own, mend it. The segment is read, not mapped:
# every read of it is counted. Prints one JSON line per restore.
_RESTARTED = r"""
import json, logging, sys
import torch
from ckptstore import CheckpointStore
from ckptstore.checkpoint import sharded
from ckptstore.tiers import ram

job, local, segment, offset, block, rows, positions = sys.argv[1:8]
offset, block, rows, positions = int(offset), int(block), int(rows), json.loads(positions)
g = torch.Generator().manual_seed(22)  # the saved state, as test_restore_verify makes it
want = {"big": torch.randn(rows, 1024, generator=g), "small": torch.randn(100, generator=g)}

def flip(at):
    with open(segment, "r+b") as fh:  # in place: same inode, same segment
        fh.seek(offset + at)
        byte = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([byte[0] ^ 0x20]))

sharded.JOB_BYTES = 2 * block  # "big" is read as three jobs, each verifying its own blocks
read = {"bytes": 0}
readinto = ram.SegmentSource.readinto
def counted(self, at, out):
    read["bytes"] += len(out)
    return readinto(self, at, out)
ram.SegmentSource.readinto = counted
messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("ckptstore").addHandler(Keep())
logging.getLogger("ckptstore").setLevel(logging.INFO)
for at in positions or [None]:
    if at is not None:
        flip(at)
    read["bytes"] = 0
    messages.clear()
    target = {"big": torch.full((rows, 1024), 7.0), "small": torch.zeros(100)}
    store = CheckpointStore(job, local=local)
    try:
        step = store.restore(target)
    finally:
        store.close(keep_ram=True)
    if at is not None:
        flip(at)
    equal = all(torch.equal(target[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    print(json.dumps({"at": at, "step": step, "equal": equal, "pread_bytes": read["bytes"],
                      "messages": messages}), flush=True)
"""


@pytest.fixture
def saved(job, tmp_path, monkeypatch):
    """Step 1 saved by this process (checksum blocks of 1 MiB) in RAM and the local tier; this
    process's store closed, its segments left for the next process, as a crash leaves them."""
    monkeypatch.setattr(sharded, "BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(pipeline, "BLOCK_SIZE", BLOCK)
    local = str(tmp_path / "local")
    store = CheckpointStore(job, local=local)
    try:
        store.save(1, _state()).wait("local")
    finally:
        store.close(keep_ram=True)
    segment, offset = _ram_segment(job)
    return job, local, segment, offset


def _restarted(saved: tuple, positions: list[int]) -> list[dict]:
    job, local, segment, offset = saved
    out = warm_python.run(["-c", _RESTARTED, job, local, segment, str(offset), str(BLOCK), str(ROWS),
                           json.dumps(positions)],
                          timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_a_restarted_process_restores_the_previous_ones_segment_bit_for_bit(saved):
    (got,) = _restarted(saved, [])
    assert got["step"] == 1 and got["equal"], got
    assert any("restored step 1 from the ram tier" in m for m in got["messages"]), got["messages"]
    # Every byte of the tensors came out of the segment by a read of it: nothing of it was mapped.
    assert got["pread_bytes"] >= sum(t.numel() * t.element_size() for t in _state().values()), got


def test_a_damaged_byte_in_any_job_of_a_restarted_process_falls_back_to_the_local_copy(saved):
    _job, _local, segment, _offset = saved
    runs = _restarted(saved, list(WHERE.values()))
    assert [r["at"] for r in runs] == list(WHERE.values())
    for where, got in zip(WHERE, runs):
        assert got["step"] == 1 and got["equal"], (where, got)
        assert got["pread_bytes"] > 0, (where, got)  # the damaged copy was read, not mapped
        assert any("checksum mismatch for tensor 'big'" in m and segment in m for m in got["messages"]), (where, got)
        assert any("restored step 1 from the local tier" in m for m in got["messages"]), (where, got["messages"])
