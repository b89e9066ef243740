"""fsync errors from a real filesystem: the local tier lives on a FUSE mount (tests/fuse_failing_fs.py)
whose fsync of chosen files and directories fails with EIO in the kernel's answer to fsync(2),
as a failing device's would. Nothing in the process under test is replaced.

A directory whose fsync fails fails the save with a StorageError naming the directory, at once;
a new step directory is fsynced into its parent (an EIO there fails the save too, which it could
not while new directories were never fsynced); a data file's fsync error is reported once, never
retried into a false success. Every time the earlier steps stay intact and later saves work.

Needs root, /dev/fuse and Debian's python3-fusepy (libfuse 2; installed here by apt-get when
missing and apt-get is there); where any is lacking the tests skip and say which.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import wipe_ram

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.storage.targets import DIR_FSYNC_UNSUPPORTED

SERVER = Path(__file__).with_name("fuse_failing_fs.py")
SYSTEM_PYTHON = "/usr/bin/python3"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "step": step}


def _same(got: dict, step: int) -> bool:
    want = _state(step)
    return got["step"] == step and torch.equal(got["w"].view(torch.uint8), want["w"].view(torch.uint8))


def _empty() -> dict:
    return {"w": torch.zeros(256, 1024), "step": -1}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _fusepy_ready() -> str | None:
    """None when the FUSE server can run here, else why not (after trying to install what lacks)."""
    if os.geteuid() != 0:
        return "mounting a FUSE filesystem without fusermount needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"{SYSTEM_PYTHON} (the interpreter Debian's python3-fusepy installs into) is missing"
    check = [SYSTEM_PYTHON, "-c", "import fusepy"]
    if subprocess.run(check, env=_env(), capture_output=True).returncode == 0:
        return None
    if shutil.which("apt-get") is None:
        return "python3-fusepy is not installed and there is no apt-get to install it"
    r = subprocess.run(["apt-get", "install", "-y", "-q", "python3-fusepy"], capture_output=True, text=True,
                       env={**_env(), "DEBIAN_FRONTEND": "noninteractive"}, timeout=600)
    if r.returncode != 0 or subprocess.run(check, env=_env(), capture_output=True).returncode != 0:
        return f"python3-fusepy could not be installed: {(r.stderr or r.stdout)[-500:]}"
    return None


class FailingFs:
    """The mounted filesystem: ``refuse(fsync=[...], fsyncdir=[...])`` arms it, ``hits()`` lists
    the fsyncs it refused."""

    def __init__(self, root: Path) -> None:
        self.mount = root / "mnt"
        self.control, self.log = root / "control.json", root / "refused.log"
        self.refuse()

    def refuse(self, *, fsync: list[str] = (), fsyncdir: list[str] = ()) -> None:
        self.control.write_text(json.dumps({"fsync": list(fsync), "fsyncdir": list(fsyncdir)}))

    def hits(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def failing_fs(tmp_path) -> Iterator[FailingFs]:
    why = _fusepy_ready()
    if why is not None:
        pytest.skip(f"no FUSE filesystem with failing fsync here: {why}")
    backing = tmp_path / "backing"
    backing.mkdir()
    fs = FailingFs(tmp_path)
    fs.mount.mkdir()
    output = tmp_path / "server.log"
    with open(output, "wb") as out:
        server = subprocess.Popen([SYSTEM_PYTHON, str(SERVER), str(backing), str(fs.mount), str(fs.control),
                                   str(fs.log)], env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(fs.mount):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                server.wait()
                pytest.skip(f"the FUSE server did not mount: {output.read_text()[-500:]}")
            time.sleep(0.05)
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs.mount)], capture_output=True)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _check_old_steps_and_recover(store: CheckpointStore, local: Path, failed: int, fs: FailingFs) -> None:
    got = _empty()
    ckptstore.load_sharded(got, str(local / "step-000000000001"))
    assert _same(got, 1)
    assert not (local / f"step-{failed:012d}" / "manifest.json").exists()
    with pytest.raises(ckptstore.CheckpointError, match=rf"earlier background save \(step {failed}\) failed"):
        store.save(failed + 1, _state(failed + 1))
    fs.refuse()
    store.save(failed + 2, _state(failed + 2)).wait("local")
    assert store.local.steps_sync() == [1, failed + 2]


def test_a_directory_fsync_error_fails_the_save_and_names_the_directory(job, failing_fs):
    local = failing_fs.mount / "local"
    with CheckpointStore(job, local=str(local), keep_local=None) as store:
        store.save(1, _state(1)).wait("local")
        failing_fs.refuse(fsyncdir=["/local/step-000000000002*"])
        handle = store.save(2, _state(2))
        handle.wait("ram")
        with pytest.raises(ckptstore.StorageError, match=r"cannot fsync the directory .*step-000000000002.*"
                                                         r"Input/output error.*check the device") as err:
            handle.wait("local")
        assert err.value.errno == 5
        assert len(failing_fs.hits()) == 1, failing_fs.hits()  # reported at once, nothing retried
        _check_old_steps_and_recover(store, local, 2, failing_fs)
    wipe_ram(job)


def test_a_new_directory_is_fsynced_into_its_parent(job, failing_fs):
    local = failing_fs.mount / "local"
    with CheckpointStore(job, local=str(local), keep_local=None) as store:
        store.save(1, _state(1)).wait("local")
        # Only the parent of the new step directory refuses: the step directory's entry itself
        # is what must reach the disk before anything in it counts.
        failing_fs.refuse(fsyncdir=["/local"])
        handle = store.save(2, _state(2))
        with pytest.raises(ckptstore.StorageError, match=r"cannot fsync the directory .*/local: Input/output error"):
            handle.wait("local")
        assert failing_fs.hits() == ["fsyncdir /local"]
        _check_old_steps_and_recover(store, local, 2, failing_fs)
    wipe_ram(job)


def test_a_data_file_fsync_error_is_reported_once_and_never_retried(job, failing_fs):
    local = failing_fs.mount / "local"
    with CheckpointStore(job, local=str(local), keep_local=None) as store:
        store.save(1, _state(1)).wait("local")
        failing_fs.refuse(fsync=["/local/step-000000000002/data/*"])
        handle = store.save(2, _state(2))
        with pytest.raises(ckptstore.StorageError, match=r"Input/output error"):
            handle.wait("local")
        hits = failing_fs.hits()
        assert len(hits) == 1 and hits[0].startswith("fsync /local/step-000000000002/data/"), hits
        _check_old_steps_and_recover(store, local, 2, failing_fs)
    wipe_ram(job)


def test_filesystems_that_cannot_fsync_a_directory_are_accepted():
    # EINVAL / ENOTSUP: the operation does not exist there; EBADF: refused on a read-only
    # descriptor, which a directory's always is. EIO, ENOSPC and the rest are reported.
    assert {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF} == DIR_FSYNC_UNSUPPORTED
