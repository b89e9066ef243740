"""Small files for the asynchronous pipeline: part files, manifests, RAM-tier documents, listings,
links and removals, as coroutines.

On local disks they go through aiofiles, which runs each file operation in the event loop's
executor, so a slow disk never stalls the loop and the pipeline needs no thread wrappers of its
own. fsspec filesystems (S3, memory://) are reached through their synchronous API in a thread
(fsspec runs s3fs on its own I/O loop, which gives the same concurrency without tying our loop to
it). Bulk data never comes here: sinks (targets.py) write it from threads of their own, with
O_DIRECT where the filesystem allows.

Every write is atomic: the bytes go to a temporary name, are fsynced, and appear under their name
by rename (or, for an exclusive create, by link, which never replaces: of two writers exactly one
wins). :func:`create` is the commit point of a step on every tier.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil

import aiofiles
import aiofiles.os

from .._aio import run_sync
from .._faults import crashpoint
from ..errors import InvalidArgumentError, StorageError
from ..names import local_temporary
from . import s3
from .base import Target, already_exists, storage_error, transport_errors
from .targets import fsync_dir, makedirs_private, write_bytes

_fsync = aiofiles.os.wrap(os.fsync)
_fsync_dir = aiofiles.os.wrap(fsync_dir)


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` for files in a directory other users can write (/dev/shm): never through a
    symbolic link planted under our name (the bytes would go wherever it points), and created
    owner-only. The error names the link when there is one."""
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    except OSError as exc:
        link = " (it is a symbolic link, which ckptstore never follows there; remove it)" if os.path.islink(path) else ""
        raise StorageError(f"cannot open {path}: {exc.strerror or exc}{link}", errno=exc.errno) from None


async def write(target: Target, data: bytes | list[bytes], *, exclusive: bool = False, tmp: str | None = None,
                durable: bool = True) -> None:
    """Write ``data`` (bytes, or pieces to write one after the other: a large document need not be
    joined into one more copy first) to ``target`` atomically (exclusive: only where nothing is yet, else
    CheckpointExistsError). ``tmp``: the temporary name to write first, for files in a directory
    other users can write (/dev/shm): it is opened without following links, so a link planted
    under that name fails the write instead of redirecting it. ``durable=False`` skips the fsyncs
    (tmpfs, whose contents a power loss takes anyway)."""
    if target.path is None:
        await asyncio.to_thread(_remote_write, target, data if isinstance(data, bytes) else b"".join(data), exclusive)
        return
    await _local_write(target, data, exclusive=exclusive, tmp=tmp, durable=durable, commit_point=False)


async def create(target: Target, data: bytes) -> None:
    """Create ``target`` holding ``data`` only if nothing is there yet, atomically: the commit
    point of a step. Of writers racing for one name exactly one succeeds; the others get
    CheckpointExistsError and the winner's bytes stay. Atomic on local disks (a hard link never
    replaces) and on S3 (a PUT with If-None-Match); other fsspec stores have no conditional create,
    so there it is check-then-write."""
    if target.fileobj is not None:
        raise InvalidArgumentError(f"{target.display}: an exclusive create needs a path or URL, not a file object")
    if target.path is None:
        await asyncio.to_thread(_remote_create, target, data)
        return
    await _local_write(target, data, exclusive=True, tmp=None, durable=True, commit_point=True)


async def _local_write(target: Target, data: bytes | list[bytes], *, exclusive: bool, tmp: str | None, durable: bool,
                       commit_point: bool) -> None:
    """The bytes go to a temporary name and are fsynced before their name appears, by link
    (exclusive) or rename. A commit point (a manifest) names one crash point, between its link and
    the removal of the temporary name; other files name theirs around the write and the rename."""
    assert target.path is not None
    path = target.path
    private, tmp = tmp is not None, tmp or local_temporary(path)
    try:
        await _write_tmp(tmp, data, private, crashpoints=None if commit_point else path, durable=durable)
        if exclusive:
            await _link_into_place(tmp, path)
        else:
            await aiofiles.os.replace(tmp, path)
        if commit_point:
            crashpoint("manifest.linked", path)
    except FileExistsError:
        raise already_exists(target.display) from None
    except OSError as exc:
        raise storage_error(exc, "write", target.display, previous_kept=os.path.exists(path)) from None
    finally:
        await _unlink_quietly(tmp)
    if not commit_point:
        crashpoint("file.renamed", path)
    if durable:
        await _fsync_dir(os.path.dirname(path))


def write_small_exclusive(target: Target, data: bytes) -> None:
    """:func:`create`, for synchronous callers."""
    run_sync(create(target, data))


async def exists(target: Target) -> bool:
    if target.path is not None:
        return await aiofiles.os.path.exists(target.path)
    return bool(await asyncio.to_thread(target.fs.exists, target.fspath))


async def listdir(target: Target) -> list[str]:
    """The names in a directory (or under a key prefix), always listed afresh; [] when missing."""
    if target.path is not None:
        try:
            return await aiofiles.os.listdir(target.path)
        except (FileNotFoundError, NotADirectoryError):
            return []
    return await asyncio.to_thread(_remote_listdir, target)


async def remove(target: Target) -> None:
    """Remove one file or object; a missing one is not an error."""
    if target.path is not None:
        await _unlink_quietly(target.path)
        return
    await asyncio.to_thread(_remote_remove, target)


async def remove_tree(target: Target) -> None:
    if target.path is not None:
        await asyncio.to_thread(shutil.rmtree, target.path, True)
        return
    if s3.is_s3(target.fs):
        assert target.fspath is not None
        await asyncio.to_thread(s3.remove_tree, target.fs, target.fspath, target.display)
        return
    try:
        await asyncio.to_thread(target.fs.rm, target.fspath, recursive=True)
    except FileNotFoundError:
        pass


async def makedirs(target: Target, *subdirs: str) -> None:
    """Create a directory and its ``subdirs`` (owner-only where they are new)."""
    if target.path is not None:
        for sub in subdirs or ("",):
            await asyncio.to_thread(makedirs_private, os.path.join(target.path, sub))
        return
    await asyncio.to_thread(target.fs.makedirs, target.fspath, exist_ok=True)


async def copy(src: Target, dst: Target) -> None:
    """``dst`` becomes a copy of ``src`` without moving its bytes through this process where the
    storage can: a hard link on a local disk, a server-side copy in an object store."""
    if src.path is not None and dst.path is not None:
        await aiofiles.os.link(src.path, dst.path)
        await _fsync_dir(os.path.dirname(dst.path))  # the new name is part of the step being committed
        return
    await asyncio.to_thread(src.fs.copy, src.fspath, dst.fspath)


# ------------------------------------------------------------------------------------- internals


async def _write_tmp(tmp: str, data: bytes | list[bytes], private: bool, crashpoints: str | None = None,
                     durable: bool = True) -> None:
    def opener(path: str, flags: int) -> int:
        if private:
            fd = open_nofollow(path, flags)
            os.fchmod(fd, 0o600)  # a file left under that name keeps no wider access
            return fd
        return os.open(path, flags | os.O_EXCL | os.O_CLOEXEC, 0o600)  # a random temporary name is ours alone

    async with aiofiles.open(tmp, "wb", opener=opener) as fh:
        if isinstance(data, bytes):
            await fh.write(data)
        else:
            await fh.writelines(data)
        await fh.flush()
        if crashpoints:
            crashpoint("file.written", crashpoints)
        if durable:
            await _fsync(fh.fileno())  # on disk before the name can appear
        if crashpoints:
            crashpoint("file.fsynced", crashpoints)


async def _link_into_place(tmp: str, path: str) -> None:
    """``tmp`` appears at ``path`` unless something is there (FileExistsError): atomically by link,
    or where there are no hard links (FAT, some FUSE and SMB mounts) by an O_EXCL create."""
    try:
        await aiofiles.os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # O_EXCL is just as exclusive as link, but a crash mid-write leaves a short file there.
        async with aiofiles.open(tmp, "rb") as src:
            data = await src.read()
        await _write_excl_in_place(path, data)


async def _write_excl_in_place(path: str, data: bytes) -> None:
    async with aiofiles.open(path, "xb", opener=lambda p, f: os.open(p, f | os.O_CLOEXEC, 0o600)) as fh:
        await fh.write(data)
        await fh.flush()
        await _fsync(fh.fileno())


async def _unlink_quietly(path: str) -> None:
    try:
        await aiofiles.os.unlink(path)
    except FileNotFoundError:
        pass


def _remote_write(target: Target, data: bytes, exclusive: bool) -> None:
    write_bytes(target, data, exclusive=exclusive)


def _remote_create(target: Target, data: bytes) -> None:
    fs, path = target.fs, target.fspath
    assert path is not None
    try:
        if s3.is_s3(fs):
            s3.put_if_absent(fs, path, data)
            return
        fs.invalidate_cache(path)  # a cached listing must not hide a file another process wrote
        taken = fs.exists(path)
    except FileExistsError:
        raise already_exists(target.display) from None
    except OSError as exc:
        raise storage_error(exc, "write", target.display, previous_kept=True) from None
    if taken:
        raise already_exists(target.display)
    write_bytes(target, data)


def _remote_listdir(target: Target) -> list[str]:
    # Listings are cached per filesystem object, and other processes add and remove steps.
    target.fs.invalidate_cache()
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in target.fs.ls(target.fspath, detail=False)]
    except FileNotFoundError:
        return []
    except transport_errors() as exc:
        raise storage_error(exc, "list", target.display) from None


def _remote_remove(target: Target) -> None:
    try:
        if target.fs.exists(target.fspath):
            target.fs.rm(target.fspath)
    except FileNotFoundError:
        pass
