"""What every storage module shares: resolved locations, the sink and source interfaces, and the
errors a failed transfer turns into (each with what, where and what to do)."""

from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointExistsError, StorageError


@dataclass(frozen=True)
class Target:
    """A resolved location: exactly one of ``path`` (local), ``fs``+``fspath`` or ``fileobj`` is set."""

    display: str
    path: str | None = None
    fs: Any = None
    fspath: str | None = None
    fileobj: Any = None


_TRANSPORT: tuple[type[BaseException], ...] | None = None


def transport_errors() -> tuple[type[BaseException], ...]:
    """What a failed request to a remote filesystem raises: OSError, and the HTTP stack's own errors
    that fsspec implementations let through (botocore's connection errors, aiohttp's)."""
    global _TRANSPORT
    if _TRANSPORT is None:
        found: list[type[BaseException]] = [OSError]
        with contextlib.suppress(ImportError):
            from botocore.exceptions import BotoCoreError

            found.append(BotoCoreError)
        with contextlib.suppress(ImportError):
            from aiohttp import ClientError

            found.append(ClientError)
        _TRANSPORT = tuple(found)
    return _TRANSPORT


_CUT: tuple[type[BaseException], ...] | None = None
# A response whose body is cut off after it began (a reset mid-transfer) is invisible to botocore's
# retries, which end when the response headers arrive: the reader asks again, this many times in all.
READ_ATTEMPTS = 3


def body_cut_errors() -> tuple[type[BaseException], ...]:
    global _CUT
    if _CUT is None:
        found: list[type[BaseException]] = []
        with contextlib.suppress(ImportError):
            from aiohttp import ClientPayloadError

            found.append(ClientPayloadError)
        with contextlib.suppress(ImportError):
            from botocore.exceptions import IncompleteReadError, ResponseStreamingError

            found += [IncompleteReadError, ResponseStreamingError]
        _CUT = tuple(found)
    return _CUT


def storage_error(exc: BaseException, action: str, where: str, *, previous_kept: bool = False) -> StorageError:
    code = getattr(exc, "errno", None)
    tail = " The previous file at that path is untouched." if previous_kept else ""
    if code == errno.ENOSPC or code == errno.EDQUOT:
        hint = "no space left on the device; free space or choose another destination."
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = "the destination is read-only or not writable by this user; choose another destination."
    elif code == errno.ENOENT:
        hint = "its directory does not exist; create it first."
    elif code == errno.EISDIR:
        hint = "that path is a directory; give a file name."
    else:
        hint = f"{getattr(exc, 'strerror', None) or exc}."
    return StorageError(f"cannot {action} {where}: {hint}{tail}", errno=code)


class Sink:
    """Sequential writer with commit/abort; offsets are relative to where the container starts.

    A sink with ``positional = True`` also accepts :meth:`write_at` from several threads at once
    and :meth:`skip_to`, so independent regions can be written in parallel.
    """

    positional = False

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def skip_to(self, offset: int) -> None:
        raise NotImplementedError

    def write(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def tell(self) -> int:
        raise NotImplementedError

    def commit(self, header: bytes) -> None:
        """Make the written bytes visible at the destination; ``header`` replaces the first bytes if possible."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


def already_exists(display: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{display} already exists: another writer committed this step first; the existing file is untouched. "
        "Load that checkpoint, or write this one under a new step.",
        location=display,
    )


_already_exists = already_exists


@dataclass(frozen=True)
class WriteTuning:
    """Tuned bulk-write settings (``CheckpointStore(tuning=...)``, measured by ``ckptstore bench``).

    ``local_chunk_bytes``/``local_concurrency``: size of one write call and writes at once to a
    local file; ``s3_part_bytes``/``s3_concurrency``: multipart part size and parts in flight to
    S3. None leaves a setting at its default (for S3: the environment, then 4 parts of 8 MiB).
    """

    local_chunk_bytes: int | None = None
    local_concurrency: int | None = None
    s3_part_bytes: int | None = None
    s3_concurrency: int | None = None


def scatter(data: bytes | memoryview, bufs: list[memoryview]) -> None:
    """Copy ``data`` into ``bufs`` in order, each taking the next len(buf) bytes."""
    pos = 0
    for b in bufs:
        b[:] = data[pos : pos + len(b)]
        pos += len(b)


class Source:
    """Random-access reader over one container; ``start`` is where the container begins."""

    display: str
    size: int  # bytes available from the container start to the end of the file
    parallel: bool = False
    local_path: str | None = None

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            # Before allocating: a damaged or crafted length must not become a huge buffer.
            raise ShortRead(offset, length, max(0, self.size - offset))
        buf = bytearray(length)
        self.readinto(offset, memoryview(buf))
        return bytes(buf)

    def readinto(self, offset: int, out: memoryview) -> None:
        raise NotImplementedError

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        return [self.read(o, n) for o, n in ranges]

    def readv_into(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` in order from the consecutive bytes at ``offset`` (one read of their total)."""
        scatter(self.read(offset, sum(len(b) for b in bufs)), bufs)

    def memory(self) -> Any:
        """This source's bytes as a 1-D uint8 CPU tensor (byte 0 at index 0) when they already lie in
        this process's memory, else None. A reader then copies from it directly, and to a device
        straight from it (a RAM-tier slot is page-locked where CUDA is present), instead of reading
        through a buffer of its own."""
        return None

    def close(self) -> None:
        pass

    def finish(self, end: int) -> None:
        """Called after a successful load; ``end`` is the container's end offset."""


class ShortRead(Exception):
    def __init__(self, offset: int, wanted: int, got: int) -> None:
        super().__init__(f"wanted {wanted} bytes at offset {offset}, the file ends after {got}")
        self.offset, self.wanted, self.got = offset, wanted, got
