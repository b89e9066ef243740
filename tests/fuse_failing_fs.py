"""A FUSE filesystem that passes everything through to a backing directory, except that fsync of
chosen files and directories fails with EIO, as a failing disk's would: the kernel sends the
FUSE_FSYNC / FUSE_FSYNCDIR request here and returns our EIO to the caller's fsync(2), so the
caller sees a real device error (no Python function of the caller is replaced).

Run by tests/test_fsync_errors.py with Debian's python3-fusepy (libfuse 2), under the system
interpreter: ``python3 fuse_failing_fs.py BACKING MOUNTPOINT CONTROL LOG``. CONTROL is a JSON file
read at every fsync: ``{"fsync": [paths], "fsyncdir": [paths]}``, paths relative to the mount
("/local/step-000000000002/data/rank-00000.bin"), each matched exactly or as a prefix ending in
"*". Every refused fsync is appended to LOG, one line each, so a test can count retries.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import fusepy


def _matches(path: str, patterns: list[str]) -> bool:
    return any(path == p or (p.endswith("*") and path.startswith(p[:-1])) for p in patterns)


class FailingFsync(fusepy.Operations):
    def __init__(self, backing: str, control: str, log: str) -> None:
        self.backing, self.control, self.log = backing, control, log

    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _refuse(self, kind: str, path: str) -> None:
        try:
            with open(self.control) as fh:
                rules = json.load(fh)
        except (OSError, ValueError):
            return
        if _matches(path, rules.get(kind) or []):
            with open(self.log, "a") as fh:
                fh.write(f"{kind} {path}\n")
            raise fusepy.FuseOSError(errno.EIO)

    # ---------------------------------------------------------------- the failing part

    def fsync(self, path, datasync, fh):
        self._refuse("fsync", path)
        os.fsync(fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        self._refuse("fsyncdir", path)
        fd = os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0

    # ---------------------------------------------------------------- passthrough

    def access(self, path, mode):
        if not os.access(self._full(path), mode):
            raise fusepy.FuseOSError(errno.EACCES)

    def chmod(self, path, mode):
        return os.chmod(self._full(path), mode)

    def chown(self, path, uid, gid):
        return os.chown(self._full(path), uid, gid)

    def getattr(self, path, fh=None):
        st = os.lstat(self._full(path))
        return {key: getattr(st, key) for key in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                                  "st_nlink", "st_size", "st_uid", "st_blocks")}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._full(path))]

    def readlink(self, path):
        return os.readlink(self._full(path))

    def mknod(self, path, mode, dev):
        return os.mknod(self._full(path), mode, dev)

    def rmdir(self, path):
        return os.rmdir(self._full(path))

    def mkdir(self, path, mode):
        return os.mkdir(self._full(path), mode)

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        return {key: getattr(st, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                  "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def unlink(self, path):
        return os.unlink(self._full(path))

    def symlink(self, name, target):
        return os.symlink(target, self._full(name))

    def rename(self, old, new):
        return os.rename(self._full(old), self._full(new))

    def link(self, target, name):
        # fusepy: link(target, source) makes ``target`` a new name of ``source``.
        return os.link(self._full(name), self._full(target))

    def utimens(self, path, times=None):
        return os.utime(self._full(path), times)

    def open(self, path, flags):
        # The backing file is opened without O_DIRECT: FUSE hands us unaligned pieces.
        return os.open(self._full(path), flags & ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_TRUNC))

    def create(self, path, mode, fi=None):
        return os.open(self._full(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)

    def read(self, path, length, offset, fh):
        return os.pread(fh, length, offset)

    def write(self, path, buf, offset, fh):
        return os.pwrite(fh, buf, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        return os.close(fh)


if __name__ == "__main__":
    backing, mountpoint, control, log = sys.argv[1:5]
    fusepy.FUSE(FailingFsync(backing, control, log), mountpoint, foreground=True, nothreads=False)
