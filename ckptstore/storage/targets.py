"""Resolve what users pass as ``f`` (path, PathLike, file object, fsspec URL) to byte sinks and sources.

Writes never destroy what was there before a failure: a local file is written under a temporary
name, fsynced, renamed over the destination and the directory fsynced; an object store upload is
only committed (multipart completed) after the last byte, and discarded on failure; other fsspec
filesystems get a temporary key that is moved into place.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import io
import os
import secrets
import stat
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar, Union

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .._faults import crashpoint
from ..errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    NotACheckpointError,
    StorageError,
    UnknownProtocolError,
    also,
)
from ..format import container
from . import direct, s3
from .base import (
    READ_ATTEMPTS,
    ShortRead,
    Sink,
    Source,
    Target,
    WriteTuning,
    already_exists,
    body_cut_errors,
    scatter,
    storage_error,
    transport_errors,
)

T = TypeVar("T")

FileLike = Union[str, "os.PathLike[str]", IO[bytes]]

# Reads larger than this are cut into pieces so several threads can fill one big tensor.
READ_PIECE = 32 << 20


def _install_hint(protocol: str) -> str:
    from fsspec.registry import known_implementations

    known = known_implementations.get(protocol)
    if known and known.get("err"):
        return str(known["err"])
    return "check the URL's spelling, or install the fsspec implementation that provides it"


def resolve(f: Any, storage_options: dict[str, Any] | None = None) -> Target:
    if isinstance(f, (str, os.PathLike)):
        s = os.fspath(f)
        if not isinstance(s, str):
            raise InvalidArgumentError(f"paths must be str, not {type(s).__name__}")
        if "\x00" in s:
            raise InvalidArgumentError(f"path {s!r} contains a NUL byte, which no file name can hold")
        if "://" not in s:
            if storage_options:
                raise InvalidArgumentError("storage_options only apply to fsspec URLs, not to local paths")
            return Target(display=s, path=os.path.abspath(s))
        protocol = s.split("://", 1)[0]
        if protocol in ("s3", "s3a"):

            storage_options = s3.with_retry_defaults(storage_options)
        try:
            fs, fspath = fsspec.core.url_to_fs(s, **(storage_options or {}))
        except ImportError as exc:
            raise UnknownProtocolError(f"cannot open {s!r}: {exc}. {_install_hint(protocol)}") from None
        except ValueError as exc:
            if "Protocol not known" in str(exc):
                raise UnknownProtocolError(
                    f"cannot open {s!r}: fsspec knows no protocol {protocol!r}. {_install_hint(protocol)}"
                ) from None
            raise
        if isinstance(fs, LocalFileSystem):
            return Target(display=s, path=os.path.abspath(fspath))

        s3.single_retry_layer(fs)
        return Target(display=s, fs=fs, fspath=fspath)
    if hasattr(f, "write") or hasattr(f, "read"):
        if storage_options:
            raise InvalidArgumentError("storage_options only apply to fsspec URLs, not to file objects")
        name = getattr(f, "name", None)
        return Target(display=f"<{type(f).__name__}{' ' + repr(name) if isinstance(name, str) else ''}>", fileobj=f)
    # torch.save/torch.load raise AttributeError here (they reach for f.write / f.seek).
    raise also(InvalidArgumentError, AttributeError)(
        f"f must be a path, an os.PathLike, a binary file object or an fsspec URL, not {type(f).__name__}"
    )


def stream_seekable(f: Any) -> bool:
    """Whether a caller's file object can seek: its ``seekable()``, or for an object without one
    (torch.load needs only read/seek/tell), whether seeking to where it is works."""
    probe = getattr(f, "seekable", None)
    if probe is not None:
        return bool(probe())
    try:
        f.seek(f.tell())
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        return False
    return True


class LocalSink(Sink):
    """``chunk_bytes`` caps the size of one bulk write call and ``concurrency`` how many run at once
    (tuning from ``ckptstore bench``); None keeps the engine's pieces and all its I/O threads."""

    def __init__(self, path: str, display: str, exclusive: bool = False, *, chunk_bytes: int | None = None,
                 concurrency: int | None = None) -> None:
        self.path, self.display = path, display
        # exclusive: commit by link(), which never replaces: CheckpointExistsError if the name is taken.
        self.exclusive = exclusive
        self.chunk_bytes = chunk_bytes
        self._slots = threading.BoundedSemaphore(concurrency) if concurrency else None
        directory, base = os.path.split(path)
        self.tmp = os.path.join(directory, f".{base}.ckptstore-tmp-{os.getpid()}-{secrets.token_hex(4)}")
        if os.path.isdir(path):
            raise storage_error(IsADirectoryError(errno.EISDIR, "is a directory"), "write", display)
        try:
            # Owner-only, like everything ckptstore creates: checkpoints can hold private data.
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise storage_error(exc, "write", display, previous_kept=os.path.exists(path)) from None
        # Bulk data goes through O_DIRECT where the filesystem allows it (see direct.py); small
        # and unaligned writes (header, manifest, footer) through the ordinary descriptor.
        self._dfd = direct.open_direct(self.tmp)
        self.dfd = self._dfd  # set to None, not closed, if writes turn out to be refused
        self.pos = 0

    positional = True

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._pwrite(view, self.pos)
        self.pos += len(view)

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Bulk write of a chunk (or a piece of one) that starts on a 4 KiB boundary and owns the
        padding up to the next boundary."""
        view = memoryview(data).cast("B")
        step = self.chunk_bytes
        if step and len(view) > step and offset % direct.ALIGN == 0:
            # Tuned chunk sizes are multiples of the alignment, so every piece stays aligned.
            for p in range(0, len(view), step):
                self._write_at(offset + p, view[p : p + step])
            return
        self._write_at(offset, view)

    def _write_at(self, offset: int, view: memoryview) -> None:
        if self._slots is None:
            self._write_piece(offset, view)
            return
        with self._slots:
            self._write_piece(offset, view)

    def _write_piece(self, offset: int, view: memoryview) -> None:
        dfd = self.dfd
        if dfd is not None and offset % direct.ALIGN == 0:
            try:
                direct.pwrite_direct(dfd, view, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise storage_error(exc, "write", self.display, previous_kept=os.path.exists(self.path)) from None
                self.dfd = None  # this filesystem takes O_DIRECT opens but not writes: stay buffered
        self._pwrite(view, offset)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        try:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view = view[n:]
                offset += n
        except OSError as exc:
            raise storage_error(exc, "write", self.display, previous_kept=os.path.exists(self.path)) from None

    def skip_to(self, offset: int) -> None:
        self.pos = offset  # the gap reads back as zeros (padding), and a later write extends the file

    def tell(self) -> int:
        return self.pos

    def commit(self, header: bytes) -> None:
        try:
            os.pwrite(self.fd, header, 0)
            os.ftruncate(self.fd, self.pos)  # direct writes pad to a block: the file ends at the footer
            crashpoint("file.written", self.path)
            # An fsync error means the data may be lost: it is reported, never retried into success.
            os.fsync(self.fd)
            crashpoint("file.fsynced", self.path)
            os.close(self.fd)
            self.fd = -1
            self._close_direct()
            if self.exclusive:
                _link_or_replace_absent(self.tmp, self.path)
            else:
                os.replace(self.tmp, self.path)
        except FileExistsError:
            self.abort()
            raise already_exists(self.display) from None
        except OSError as exc:
            self.abort()
            raise storage_error(exc, "write", self.display, previous_kept=os.path.exists(self.path)) from None
        crashpoint("file.renamed", self.path)
        fsync_dir(os.path.dirname(self.path))

    def _close_direct(self) -> None:
        dfd, self._dfd, self.dfd = self._dfd, None, None
        if dfd is not None:
            with contextlib.suppress(OSError):
                os.close(dfd)

    def abort(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        self._close_direct()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _link_or_replace_absent(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path`` unless ``path`` exists (FileExistsError): atomically by link(), or
    where there are no hard links (FAT, some FUSE and SMB mounts) by a check before the rename."""
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        if os.path.exists(path):
            raise FileExistsError(errno.EEXIST, "exists", path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def makedirs_private(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, except that every directory it creates is 0700 (owner
    only; os.makedirs applies its mode to the last one alone), and is fsynced into its parent: a
    file fsynced into a directory whose own entry was never made durable is lost with it on a power
    failure. Existing directories are left as they are: their modes are the user's choice."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
            created.append(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
        except OSError as exc:
            raise storage_error(exc, "create the directory", d) from None
    for d in created:
        fsync_dir(os.path.dirname(d))


# What a filesystem answers when it cannot fsync a directory at all: EINVAL and ENOTSUP/EOPNOTSUPP
# (POSIX: "fildes refers to a file on which this operation is impossible"; some FUSE, network and
# virtual filesystems), EBADF (filesystems that refuse fsync on a descriptor opened read-only,
# which a directory's always is). The rename is then as durable as that filesystem makes it and
# nothing more can be done; every other error (EIO above all) means entries written there may be
# lost, and is reported.
DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


def fsync_dir(directory: str) -> None:
    """Make the entries created, renamed or linked in ``directory`` durable; a StorageError if the
    filesystem reports that it could not."""
    where = directory or "."
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _dir_fsync_error(where, exc) from None
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in DIR_FSYNC_UNSUPPORTED:
            raise _dir_fsync_error(where, exc) from None
    finally:
        os.close(fd)


def _dir_fsync_error(directory: str, exc: OSError) -> StorageError:
    return StorageError(
        f"cannot fsync the directory {directory}: {exc.strerror or exc}. Files just written, renamed or linked "
        "there may not survive a power loss or a crash of the machine, so the write is reported as failed; "
        "check the device (dmesg, the storage's health) and save again, or choose another directory",
        errno=exc.errno,
    )


class FileObjectSink(Sink):
    def __init__(self, f: Any, display: str) -> None:
        self.f, self.display = f, display
        self.seekable = stream_seekable(f)
        self.start = f.tell() if self.seekable else 0
        self.pos = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = self.f.write(view)
                if n is None:
                    n = len(view)
                view = view[n:]
                self.pos += n
        except OSError as exc:  # includes io.UnsupportedOperation for a stream opened read-only
            if isinstance(exc, io.UnsupportedOperation):
                raise also(StorageError, type(exc))(
                    f"cannot write {self.display}: it is not open for writing; open it with mode 'wb'") from None
            err = storage_error(exc, "write", self.display)
            # Also of the stream's own class (io.UnsupportedOperation, BrokenPipeError), which torch.save lets through.
            raise also(StorageError, type(exc))(str(err), errno=err.errno) from None

    def tell(self) -> int:
        return self.pos

    def commit(self, header: bytes) -> None:
        if self.seekable:
            end = self.f.tell()
            self.f.seek(self.start)
            self.f.write(header)
            self.f.seek(end)
        flush = getattr(self.f, "flush", None)
        if flush is not None:
            flush()

    def abort(self) -> None:
        pass  # a caller's stream cannot be rolled back; what was written stays invalid (no footer)


class FsspecSink(Sink):
    def __init__(self, fs: Any, path: str, display: str, exclusive: bool = False) -> None:
        self.fs, self.path, self.display, self.exclusive = fs, path, display, exclusive
        # Async filesystems (s3fs, gcsfs, adlfs) write through buffered files that upload on commit
        # and can be discarded; others get a temporary key moved into place afterwards.
        self.transactional = bool(getattr(fs, "async_impl", False))
        self.tmp = None if self.transactional else f"{path}.ckptstore-tmp-{secrets.token_hex(4)}"
        try:
            if self.transactional:
                self.f = fs.open(path, "wb", autocommit=False)
            else:
                self.f = fs.open(self.tmp, "wb")
        except transport_errors() as exc:
            raise storage_error(exc, "write", display) from None
        self.pos = 0

    def write(self, data: bytes | memoryview) -> None:
        try:
            self.f.write(data)
        except transport_errors() as exc:
            raise storage_error(exc, "write", self.display, previous_kept=True) from None
        self.pos += len(memoryview(data).cast("B"))

    def tell(self) -> int:
        return self.pos

    def commit(self, header: bytes) -> None:
        # Object stores cannot patch the header in place: its length field stays 0, meaning
        # "the container ends where the object ends".
        try:
            if self.exclusive:
                self.fs.invalidate_cache(self.path)
                if self.fs.exists(self.path):  # check-then-write: these stores have no conditional create
                    raise FileExistsError(self.path)
            if self.transactional:
                # close() uploads the last part without completing the upload (autocommit=False);
                # commit() completes it: only then does the object appear, whole.
                self.f.close()
                self.f.commit()
            else:
                self.f.close()
                self.fs.mv(self.tmp, self.path)
        except FileExistsError:
            self.abort()
            raise already_exists(self.display) from None
        except transport_errors() as exc:
            self.abort()
            raise storage_error(exc, "write", self.display, previous_kept=True) from None

    def abort(self) -> None:
        try:
            if self.transactional:
                self.f.discard()  # aborts the multipart upload
                self.f.closed = True  # or fsspec's __del__ would flush, and start a new upload
            else:
                self.f.close()
                self.fs.rm(self.tmp)
        except Exception:  # noqa: BLE001 - cleanup must not mask the original error
            pass


def write_bytes(target: Target, data: bytes, *, exclusive: bool = False) -> None:
    """Write a small object (a manifest, a part file) atomically, like any other sink."""
    sink = open_sink(target, exclusive=exclusive)
    try:
        sink.write(data)
        sink.commit(b"")
    except BaseException:
        sink.abort()
        raise


def open_sink(target: Target, tuning: WriteTuning | None = None, *, exclusive: bool = False) -> Sink:
    """``exclusive``: the commit fails with CheckpointExistsError, and replaces nothing, if something
    is at the destination already: atomically on local disks (link) and S3 (If-None-Match), by a
    check just before committing on other fsspec stores."""
    if target.path is not None:
        if tuning is not None:
            return LocalSink(target.path, target.display, exclusive, chunk_bytes=tuning.local_chunk_bytes,
                             concurrency=tuning.local_concurrency)
        return LocalSink(target.path, target.display, exclusive)
    if target.fileobj is not None:
        if exclusive:
            raise InvalidArgumentError(f"{target.display}: an exclusive create needs a path or URL, not a file object")
        return FileObjectSink(target.fileobj, target.display)
    assert target.fspath is not None

    if s3.is_s3(target.fs):
        upload = s3.upload_settings(tuning)
        if upload is not None:
            return s3.S3Sink(target.fs, target.fspath, target.display, upload, exclusive=exclusive)
    return FsspecSink(target.fs, target.fspath, target.display, exclusive)


def _is_a_directory(display: str) -> CheckpointNotFoundError:
    # Also IsADirectoryError, which torch.load (through open()) raises for a directory.
    err = also(CheckpointNotFoundError, IsADirectoryError)(
        f"{display} is a directory; ckptstore.load reads a single checkpoint file")
    err.errno = errno.EISDIR
    return err


_IOV_MAX = 1024  # Linux UIO_MAXIOV: preadv takes at most this many buffers per call


class LocalSource(Source):
    parallel = True

    def __init__(self, path: str, display: str) -> None:
        self.display = display
        self.local_path = path
        try:
            # O_NONBLOCK: opening a FIFO planted where a checkpoint file belongs must not hang.
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {display}: the file does not exist") from None
        except IsADirectoryError:
            raise _is_a_directory(display) from None
        except OSError as exc:
            raise storage_error(exc, "read", display) from None
        st = os.fstat(self.fd)
        if stat.S_ISDIR(st.st_mode):
            # Linux opens directories read-only without complaint; the error would come at read time.
            os.close(self.fd)
            self.fd = -1
            raise _is_a_directory(display)
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            self.fd = -1
            raise NotACheckpointError(
                f"{display} is not a regular file (a FIFO, socket or device); checkpoints are read from files"
            )
        os.set_blocking(self.fd, True)
        self.size = st.st_size

    def readinto(self, offset: int, out: memoryview) -> None:
        done = 0
        total = len(out)
        while done < total:
            try:
                n = os.preadv(self.fd, [out[done:]], offset + done)
            except OSError as exc:
                raise storage_error(exc, "read", self.display) from None
            if n == 0:
                raise ShortRead(offset, total, done)
            done += n

    def readv_into(self, offset: int, bufs: list[memoryview]) -> None:
        # preadv scatters one read over the buffers (at most IOV_MAX of them per call); a short
        # read finishes buffer by buffer, where readinto reports a truncated file.
        for i in range(0, len(bufs), _IOV_MAX):
            batch = bufs[i : i + _IOV_MAX]
            want = sum(len(b) for b in batch)
            try:
                n = os.preadv(self.fd, batch, offset)
            except OSError as exc:
                raise storage_error(exc, "read", self.display) from None
            if n < want:
                pos, left = offset, n  # left: bytes delivered from pos on
                for b in batch:
                    if left >= len(b):
                        left -= len(b)
                    else:
                        self.readinto(pos + left, b[left:])
                        left = 0
                    pos += len(b)
            offset += want

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _check_readable(f: Any, display: str) -> None:
    readable = getattr(f, "readable", None)
    if not hasattr(f, "read") or (readable is not None and not readable()):
        # torch.load lets the stream's io.UnsupportedOperation through.
        raise also(InvalidArgumentError, io.UnsupportedOperation)(
            f"{display} is not open for reading; open the file with mode 'rb'")


class FileObjectSource(Source):
    """A caller's seekable file object; the container starts where the object stands."""

    def __init__(self, f: Any, display: str) -> None:
        self.f, self.display = f, display
        _check_readable(f, display)
        self.start = f.tell()
        self.size = f.seek(0, io.SEEK_END) - self.start
        f.seek(self.start)
        self.lock = threading.Lock()

    def readinto(self, offset: int, out: memoryview) -> None:
        with self.lock:
            self.f.seek(self.start + offset)
            done = 0
            while done < len(out):
                if hasattr(self.f, "readinto"):
                    n = self.f.readinto(out[done:])
                else:
                    chunk = self.f.read(len(out) - done)
                    n = len(chunk)
                    out[done : done + n] = chunk
                if not n:
                    raise ShortRead(offset, len(out), done)
                done += n

    def finish(self, end: int) -> None:
        # Leave the stream just past the container, so several checkpoints can share one stream.
        self.f.seek(self.start + end)

    def rewind(self) -> None:
        self.f.seek(self.start)


class StreamSource(Source):
    """An unseekable stream (a pipe, a socket, an HTTP body), read once, front to back, into memory.

    The manifest comes last in the container, so nothing can be placed before the whole container
    has arrived; holding it costs its size in memory until the load returns. A container whose
    header carries its length (a seekable writer's) is read exactly, leaving the stream at the next
    one; otherwise (torch.save bytes, or a container written to a stream) up to the end of the stream.
    """

    PIECE = 16 << 20

    def __init__(self, f: Any, display: str) -> None:
        self.f, self.display = f, display
        _check_readable(f, display)
        # The bytes as the stream gave them, piece by piece: joining them into one buffer would
        # copy everything once more (and growing one buffer, again on every reallocation).
        self.pieces: list[bytes | bytearray] = []
        self.starts: list[int] = []
        self.size = 0
        head = self._read(container.HEADER.size)
        length = container.stated_length(head)
        if length:
            self._read(length - len(head))
        else:
            self._read(None)

    def _add(self, piece: bytes | bytearray) -> None:
        self.starts.append(self.size)
        self.pieces.append(piece)
        self.size += len(piece)

    def _read(self, n: int | None) -> bytes:
        """Keep the next ``n`` bytes of the stream (None: up to its end; fewer where it ends first),
        in pieces of at most PIECE bytes: a length stated by a damaged or hostile header sizes no
        buffer, the bytes that arrive do. Returns the first piece."""
        reader = getattr(self.f, "readinto", None)
        first = b""
        try:
            while n is None or n > 0:
                want = self.PIECE if n is None else min(self.PIECE, n)
                piece: bytes | bytearray
                if reader is not None:
                    piece = bytearray(want)
                    view, done = memoryview(piece), 0
                    while done < want:
                        got = reader(view[done:]) or 0
                        if not got:
                            break
                        done += got
                    del view
                    if done < want:
                        del piece[done:]
                else:
                    parts: list[bytes] = []
                    done = 0
                    while done < want:  # a short read is no end of stream (raw sockets give what came)
                        chunk = self.f.read(want - done)
                        if not chunk:
                            break
                        parts.append(chunk)
                        done += len(chunk)
                    piece = parts[0] if len(parts) == 1 else b"".join(parts)
                if piece:
                    self._add(piece)
                    first = first or bytes(piece[:64])
                if n is not None:
                    n -= len(piece)
                if len(piece) < want:
                    break  # the end of the stream
        except OSError as exc:
            raise storage_error(exc, "read", self.display) from None
        return first

    def readinto(self, offset: int, out: memoryview) -> None:
        if offset < 0 or offset + len(out) > self.size:
            raise ShortRead(offset, len(out), max(0, self.size - offset))
        i = bisect.bisect_right(self.starts, offset) - 1
        done = 0
        while done < len(out):
            piece, at = self.pieces[i], offset + done - self.starts[i]
            n = min(len(piece) - at, len(out) - done)
            out[done : done + n] = memoryview(piece)[at : at + n]
            done += n
            i += 1

    def joined(self) -> bytes:
        """Everything read, as one bytes object (for torch.load of torch.save bytes)."""
        return b"".join(self.pieces)

    def close(self) -> None:
        self.pieces, self.starts = [], []


class FsspecSource(Source):
    def __init__(self, fs: Any, path: str, display: str) -> None:
        self.fs, self.path, self.display = fs, path, display
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {display}: the object does not exist") from None
        except transport_errors() as exc:
            raise storage_error(exc, "read", display) from None
        if info.get("type") == "directory":
            raise _is_a_directory(display)
        self.size = int(info["size"])
        self.parallel = bool(getattr(fs, "async_impl", False))

    def _attempts(self, read: Callable[[], T]) -> T:
        """``read``, again when a response body was cut short (up to READ_ATTEMPTS times); any other
        transport failure is a StorageError at once."""
        for attempt in range(READ_ATTEMPTS):
            try:
                return read()
            except body_cut_errors() as exc:
                if attempt == READ_ATTEMPTS - 1:
                    raise storage_error(exc, "read", self.display) from None
            except transport_errors() as exc:
                raise storage_error(exc, "read", self.display) from None
        raise AssertionError("unreachable")

    def readinto(self, offset: int, out: memoryview) -> None:
        if not s3.is_s3(self.fs) or not len(out):
            out[:] = self.read(offset, len(out))
            return
        if offset + len(out) > self.size:
            raise ShortRead(offset, len(out), max(0, self.size - offset))
        got = self._attempts(lambda: s3.read_into(self.fs, self.path, offset, out))
        if got != len(out):
            raise ShortRead(offset, len(out), got)

    def read(self, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        if offset + length > self.size:
            raise ShortRead(offset, length, max(0, self.size - offset))
        data = self._attempts(lambda: self.fs.cat_file(self.path, start=offset, end=offset + length))
        if len(data) != length:
            raise ShortRead(offset, length, len(data))
        return bytes(data)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        if not self.parallel or len(ranges) <= 1:
            return super().read_many(ranges)
        for o, n in ranges:
            if o + n > self.size:
                raise ShortRead(o, n, max(0, self.size - o))
        try:
            # One batched call: s3fs issues the ranged GETs concurrently on its own event loop.
            out = self.fs.cat_ranges([self.path] * len(ranges), [o for o, _ in ranges], [o + n for o, n in ranges])
        except transport_errors() as exc:
            raise storage_error(exc, "read", self.display) from None
        for i, ((o, n), data) in enumerate(zip(ranges, out)):
            if isinstance(data, body_cut_errors()):
                out[i] = data = self.read(o, n)  # asked again, a bounded number of times
            if isinstance(data, Exception):
                raise storage_error(data, "read", self.display)
            if len(data) != n:
                raise ShortRead(o, n, len(data))
        return [bytes(d) for d in out]


def open_source(target: Target) -> Source:
    if target.path is not None:
        return LocalSource(target.path, target.display)
    if target.fileobj is not None:
        if stream_seekable(target.fileobj):
            return FileObjectSource(target.fileobj, target.display)
        return StreamSource(target.fileobj, target.display)
    assert target.fspath is not None
    return FsspecSource(target.fs, target.fspath, target.display)



# The storage layer's interfaces (storage/base.py) are re-exported: callers resolve and open
# through this module, and name what they get from it.
__all__ = [
    "READ_ATTEMPTS",
    "READ_PIECE",
    "FileLike",
    "FileObjectSink",
    "FileObjectSource",
    "FsspecSink",
    "FsspecSource",
    "LocalSink",
    "LocalSource",
    "ShortRead",
    "Sink",
    "Source",
    "StreamSource",
    "Target",
    "WriteTuning",
    "already_exists",
    "body_cut_errors",
    "fsync_dir",
    "makedirs_private",
    "open_sink",
    "open_source",
    "resolve",
    "scatter",
    "storage_error",
    "stream_seekable",
    "transport_errors",
    "write_bytes",
]
