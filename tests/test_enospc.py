"""A full disk under the local tier: a real ENOSPC from a small tmpfs mounted for the test (where
mounting is allowed: root with CAP_SYS_ADMIN), else from a wrapper that fails every write under
the tier's directory with ENOSPC. The save fails with a clear error, the earlier steps are intact,
the failed step leaves nothing behind, and once space returns the pipeline serves later saves.
An fsync error is reported, never retried into a false success."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import wipe_ram

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.storage import direct


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(3, generator=g)}, "step": step}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(1024, 1024), "b": torch.zeros(3)}, "step": -1}


def _same(got: dict, step: int) -> bool:
    want = _state(step)
    return got["step"] == step and all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])


class Disk:
    """The local tier's disk: ``fill()`` leaves no room, ``free()`` gives the room back."""

    def __init__(self, root: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.mode = root, mode
        self.full = False
        self.ballast = root / "ballast"
        if mode == "wrapper":
            real_pwrite, real_direct, real_write = os.pwrite, direct.pwrite_direct, os.write

            def refuse(fd: int) -> None:
                if self.full and os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            def pwrite(fd: int, data, offset: int) -> int:
                refuse(fd)
                return real_pwrite(fd, data, offset)

            def pwrite_direct(fd: int, data, offset: int) -> None:
                refuse(fd)
                real_direct(fd, data, offset)

            def write(fd: int, data) -> int:
                refuse(fd)
                return real_write(fd, data)

            monkeypatch.setattr(os, "pwrite", pwrite)
            monkeypatch.setattr(os, "write", write)
            monkeypatch.setattr(direct, "pwrite_direct", pwrite_direct)

    def fill(self) -> None:
        self.full = True
        if self.mode == "tmpfs":
            with open(self.ballast, "wb") as fh:
                block = b"\0" * (1 << 20)
                try:
                    while True:
                        fh.write(block)
                        fh.flush()
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
            # Buffered leftovers were dropped with the error: what is on disk is what counts.

    def free(self) -> None:
        self.full = False
        if self.ballast.exists():
            self.ballast.unlink()


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture(params=["tmpfs", "wrapper"])
def disk(request, tmp_path, monkeypatch) -> Iterator[Disk]:
    root = tmp_path / "disk"
    root.mkdir()
    if request.param == "tmpfs" and not _mount_tmpfs(root, "24m"):
        pytest.skip("mounting a tmpfs is not permitted here; the 'wrapper' variant covers ENOSPC")
    try:
        yield Disk(root, request.param, monkeypatch)
    finally:
        if request.param == "tmpfs":
            subprocess.run(["umount", "-l", str(root)], capture_output=True)


def test_a_full_disk_fails_the_save_clearly_keeps_earlier_steps_and_recovers(job, disk):
    local = disk.root / "local"
    store = CheckpointStore(job, local=str(local), keep_local=2)
    try:
        for step in (1, 2):
            store.save(step, _state(step)).wait("local")
        disk.fill()
        handle = store.save(3, _state(3))
        handle.wait("ram")  # the snapshot itself is safe in RAM
        with pytest.raises(ckptstore.CheckpointError, match=r"no space left on the device; free space") as err:
            handle.wait("local")
        assert "step-000000000003" in str(err.value)
        # The earlier steps are intact and the failed one left no file (its empty directories go
        # with the start-up sweep), no temporary file anywhere.
        assert not [f for _t, _d, fs in os.walk(local / "step-000000000003") for f in fs]
        assert not [f for _t, _d, fs in os.walk(local) for f in fs if "ckptstore-tmp" in f]
        for step in (1, 2):
            got = _empty()
            ckptstore.load_sharded(got, str(local / f"step-{step:012d}"))
            assert _same(got, step)
        # The failure is reported once more, to the training loop, at the next save...
        with pytest.raises(ckptstore.CheckpointError, match=r"earlier background save \(step 3\) failed"):
            store.save(4, _state(4))
        # ...and once space returns, the pipeline serves the saves that follow.
        disk.free()
        store.save(5, _state(5)).wait("local")
        store.save(6, _state(6)).wait("local")
    finally:
        store.close()
    wipe_ram(job)
    with CheckpointStore(job, local=str(local)) as again:
        assert sorted(os.listdir(local)) == ["step-000000000005", "step-000000000006"]
        target = _empty()
        assert again.restore(target) == 6 and _same(target, 6)


def test_an_fsync_error_fails_the_save_and_is_not_retried(job, tmp_path, monkeypatch):
    local = tmp_path / "local"
    calls: list[str] = []
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "step-000000000002" in path and "rank-00000.bin" in path:
            calls.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    with CheckpointStore(job, local=str(local)) as store:
        store.save(1, _state(1)).wait("local")
        monkeypatch.setattr(os, "fsync", failing_fsync)
        handle = store.save(2, _state(2))
        with pytest.raises(ckptstore.CheckpointError, match=r"Input/output error"):
            handle.wait("local")
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert len(calls) == 1  # reported at once: a second fsync could "succeed" on lost pages
        assert not [f for _t, _d, fs in os.walk(local / "step-000000000002") for f in fs]
        with pytest.raises(ckptstore.CheckpointError, match=r"earlier background save \(step 2\) failed"):
            store.save(3, _state(3))
        store.save(4, _state(4)).wait("local")
        assert store.local.steps_sync() == [1, 4]
