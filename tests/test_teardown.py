"""The caller's teardown stays safe (issue 18 item 8): after a save that failed at the call, a
trainer that tears its process group down at once, with or without ``close()``, must not destroy
a group under a collective of the store's background (a gloo group shut down under a transfer
aborts the process, or leaves the other ranks with a broken connection instead of the real
failure), and ``close()`` leaves no group of the store for the caller's destroy_process_group().
Every rank's exit code is checked (dist_workers.spawn), so a SIGABRT after the job counts.
"""

from __future__ import annotations

import os

import dist_workers
import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the failing save needs a file owned by another user "
                                                          "(chown), which only root can make")


@needs_root
@pytest.mark.parametrize("close", [True, False], ids=["close-then-destroy", "destroy-at-once"])
def test_a_failed_save_then_teardown_leaves_no_collective_in_flight(tmp_path, job, close):
    dist_workers.spawn(2, "collective_workers:teardown_after_failed_save_job", tmp_path, name=job,
                       root=str(tmp_path), close=close)


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 20 runs of two real processes
def test_teardown_after_failed_saves_repeated(tmp_path, job):
    for i in range(10):
        for close in (True, False):
            run = tmp_path / f"run{i}-{close}"
            run.mkdir()
            dist_workers.spawn(2, "collective_workers:teardown_after_failed_save_job", run, name=f"{job}-{i}",
                               root=str(run), close=close)
