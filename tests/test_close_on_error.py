"""Leaving ``with CheckpointStore`` on an exception on one rank: the rank gets out at once (no
agreement with ranks that may never close), and the caller's exception is the one raised."""

from __future__ import annotations

import os
import shutil
import tempfile

from dist_workers import spawn


def test_an_exception_on_one_rank_leaves_its_store_without_waiting_for_the_others(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ram_root = tempfile.mkdtemp(prefix="ckptstore-test-close-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        spawn(2, "close_workers:raise_inside", tmp_path, root=str(tmp_path / "job"), ram_root=ram_root,
              out_dir=str(out))
    finally:
        shutil.rmtree(ram_root, ignore_errors=True)
    assert (out / "rank1-out").read_text() == "ValueError: injected failure on rank 1"
    # Before: rank 1 waited in close()'s agreement until rank 0 reached its own close (up to
    # timeout_s in a job whose other ranks never close), so rank 0 never saw it leave.
    assert (out / "rank0-saw").read_text() == "rank 1 out first"
