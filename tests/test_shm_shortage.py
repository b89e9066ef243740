"""A RAM tier whose shared memory is too small (Docker's default /dev/shm is 64 MiB): a real
8 MiB tmpfs mounted for the test as ram_dir, and a 32 MiB state. The first save of it fails with
a StorageError naming the size, the directory and the remedies, instead of a SIGBUS that kills
the trainer (exit 135 before the reservation); the step committed before is intact; and with
``ram_fallback="private"`` the same job saves and restores from the local tier bit for bit.

Each phase runs in a process of its own (forked from the warm forkserver of tests/warm_python.py),
so a bus error shows as that process's death instead of killing pytest. Where mounting is not permitted, the error path still runs against a ram_dir
whose reservations are refused (a file-size limit on the worker makes posix_fallocate fail).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import warm_python

import ckptstore

SMALL_SHM = 8 << 20

# One phase of the job: ``phase`` and the paths come in argv; prints one JSON line of findings.
WORKER = textwrap.dedent(r'''
    import json, os, resource, signal, sys
    import torch
    import ckptstore
    from ckptstore import CheckpointStore

    phase, job, ram_dir, local = sys.argv[1:5]

    def small(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(256, 1024, generator=g), "step": step}  # 1 MiB: fits the tmpfs

    def big(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(8, 1024, 1024, generator=g), "step": step}  # 32 MiB: does not

    def empty(like):
        return {"w": torch.zeros_like(like["w"]), "step": -1}

    def same(a, b):
        return a["step"] == b["step"] and torch.equal(a["w"].view(torch.uint8), b["w"].view(torch.uint8))

    out = {}
    if phase == "limited":
        # No tmpfs could be mounted: a file-size limit makes the segment's reservation fail instead.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
        store = CheckpointStore(job, ram_dir=ram_dir, durable=None, local=None)
        try:
            store.save(1, big(1))
        except ckptstore.StorageError as exc:
            out["error"], out["errno"] = str(exc), exc.errno
        store.close()
    elif phase == "shortage":
        store = CheckpointStore(job, local=local, ram_dir=ram_dir, keep_local=None)
        store.save(1, small(1)).wait("local")
        try:
            store.save(2, big(2))
        except ckptstore.StorageError as exc:
            out["error"], out["errno"] = str(exc), exc.errno
        # Still alive, and the committed step is whole: in RAM and on disk.
        got = empty(small(1))
        out["restored"] = store.restore(got)
        out["restored_same"] = same(got, small(1))
        out["shm_files"] = sorted(os.listdir(ram_dir))
        store.close()
    elif phase == "fallback":
        store = CheckpointStore(job, local=local, ram_dir=ram_dir, keep_local=None, ram_fallback="private")
        out["resumed"] = store.restore(empty(small(1)))
        store.save(2, big(2)).wait("local")
        store.save(3, big(3)).wait("local")
        out["shm_files"] = sorted(os.listdir(ram_dir))
        store.close()
    elif phase == "restore":
        store = CheckpointStore(job, local=local, ram_dir=ram_dir, keep_local=None)
        got = empty(big(3))
        out["restored"] = store.restore(got)
        out["restored_same"] = same(got, big(3))
        store.close()
    print("RESULT " + json.dumps(out), flush=True)
''')


def _run(tmp_path: Path, *args: str) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = warm_python.run([str(script), *args], timeout=300)
    assert r.returncode != -signal.SIGBUS, f"the worker died of SIGBUS (the reservation is missing):\n{r.stderr[-3000:]}"
    assert r.returncode == 0, f"phase {args[0]} exited {r.returncode}:\n{r.stderr[-3000:]}"
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _mount_tmpfs(path: Path, size: int) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_shm(tmp_path) -> Iterator[Path]:
    path = tmp_path / "shm"
    path.mkdir()
    if not _mount_tmpfs(path, SMALL_SHM):
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN, which this run lacks; "
                    "test_a_refused_reservation_is_a_storage_error_too covers the error path")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _assert_clear(error: str, ram_dir: Path) -> None:
    assert f"{32 << 20} bytes" in error and "32.0 MiB" in error, error
    assert str(ram_dir) in error, error
    for remedy in ("--shm-size", "ram_dir=", "ram_budget_bytes=", "ram_fallback='private'"):
        assert remedy in error, (remedy, error)


def test_a_small_shm_fails_the_save_clearly_and_the_private_fallback_saves_and_restores(tmp_path, job, small_shm):
    local = tmp_path / "local"
    first = _run(tmp_path, "shortage", job, str(small_shm), str(local))
    _assert_clear(first["error"], small_shm)
    assert first["errno"] == 28  # ENOSPC
    assert "free there" in first["error"]
    # Nothing committed is lost: step 1 restores bit for bit, and the failed segment is gone.
    assert first["restored"] == 1 and first["restored_same"], first
    assert not [f for f in first["shm_files"] if f.endswith("-s1.bin")], first["shm_files"]
    assert sorted(os.listdir(local)) == ["step-000000000001"]

    second = _run(tmp_path, "fallback", job, str(small_shm), str(local))
    assert second["resumed"] == 1
    # Private staging: no segment of the big state, no RAM document of steps 2 and 3 in ram_dir.
    assert all(os.path.getsize(small_shm / f) < SMALL_SHM for f in second["shm_files"] if f.endswith(".bin"))
    docs = [json.loads((small_shm / f).read_text()) for f in second["shm_files"] if f.endswith(".json")]
    assert {d["step"] for d in docs} <= {1}, docs
    assert sorted(os.listdir(local)) == ["step-000000000001", "step-000000000002", "step-000000000003"]

    third = _run(tmp_path, "restore", job, str(small_shm), str(local))
    assert third["restored"] == 3 and third["restored_same"], third


def test_a_refused_reservation_is_a_storage_error_too(tmp_path, job):
    ram_dir = tmp_path / "ram"
    ram_dir.mkdir()
    found = _run(tmp_path, "limited", job, str(ram_dir), "-")
    _assert_clear(found["error"], ram_dir)
    assert "posix_fallocate" in found["error"], found["error"]
    assert not os.listdir(ram_dir), "a segment that could not be reserved is removed"


def test_ram_fallback_is_checked_with_the_other_options(tmp_path, job):
    with pytest.raises(ckptstore.InvalidArgumentError, match=r"ram_fallback must be None .* or 'private'"):
        ckptstore.CheckpointStore(job, local=str(tmp_path), ram_fallback="disk")
    with pytest.raises(ckptstore.InvalidArgumentError, match=r"ram_fallback='private' .* pass local= or durable="):
        ckptstore.CheckpointStore(job, ram_fallback="private")
