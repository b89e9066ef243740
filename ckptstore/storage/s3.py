"""S3-specific durable writes through s3fs: conditional create, and multipart upload with parts in flight.

s3fs's buffered file uploads the parts of a large object one after another; :class:`S3Sink` keeps
up to ``max_in_flight`` part uploads running at once on s3fs's event loop, so a checkpoint moves at
several connections' bandwidth while holding a bounded number of part buffers. Nothing here imports
s3fs: the filesystem object passed in brings it, so s3fs stays an optional dependency.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from .targets import Sink, storage_error

# S3 refuses parts below 5 MiB (except the last one); 8 MiB parts keep the request count low
# without holding much memory: max_in_flight parts uploading plus the one being filled.
MIN_PART_SIZE = 5 << 20
MAX_PART_SIZE = 5 << 30
PART_SIZE = 8 << 20
MAX_IN_FLIGHT = 4
# An upload has at most 10,000 parts: the part size doubles every this many parts, so 8 MiB parts
# reach S3's 5 TiB object limit (and buffers grow only for objects beyond 1000 parts).
_PARTS_PER_SIZE = 1000


@dataclass(frozen=True)
class S3Upload:
    """How :class:`S3Sink` uploads: part size in bytes, and how many part uploads may run at once."""

    part_size: int = PART_SIZE
    max_in_flight: int = MAX_IN_FLIGHT

    def __post_init__(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise InvalidArgumentError(f"S3 part sizes must lie between 5 MiB and 5 GiB, not {self.part_size} bytes")
        if self.max_in_flight < 1:
            raise InvalidArgumentError(f"at least one part upload must be allowed in flight, not {self.max_in_flight}")


def upload_settings(tuning: Any = None) -> S3Upload | None:
    """The concurrent upload used for s3:// sinks, or None for s3fs's own (sequential) file upload.

    On by default with 4 parts of 8 MiB in flight; the environment can tune it, read at every open
    so a process can change it: ``CKPTSTORE_S3_UPLOAD_CONCURRENCY`` (parts in flight; 0 falls back
    to s3fs's file) and ``CKPTSTORE_S3_PART_SIZE`` (bytes). A store's ``tuning`` (a
    :class:`~ckptstore.storage.targets.WriteTuning`) names settings explicitly, so they win over
    the environment.
    """
    part = getattr(tuning, "s3_part_bytes", None)
    concurrency = getattr(tuning, "s3_concurrency", None)
    if part is not None or concurrency is not None:
        base = upload_settings() or S3Upload()
        return S3Upload(part_size=part or base.part_size, max_in_flight=concurrency or base.max_in_flight)
    try:
        in_flight = int(os.environ.get("CKPTSTORE_S3_UPLOAD_CONCURRENCY", "") or MAX_IN_FLIGHT)
        part_size = int(os.environ.get("CKPTSTORE_S3_PART_SIZE", "") or PART_SIZE)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"CKPTSTORE_S3_UPLOAD_CONCURRENCY / CKPTSTORE_S3_PART_SIZE must be integers: {exc}"
        ) from None
    return S3Upload(part_size=part_size, max_in_flight=in_flight) if in_flight > 0 else None


def is_s3(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols and hasattr(fs, "_call_s3")


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs exception (s3fs keeps botocore's ClientError as the cause)."""
    cause: BaseException | None = exc
    while cause is not None:
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
        cause = cause.__cause__
    return None


def put_if_absent(fs: Any, path: str, data: bytes) -> None:
    """Create the object with ``data`` unless one exists; FileExistsError if one does.

    The PUT carries ``If-None-Match: *``, which AWS S3 (since 2024-08) evaluates atomically: of
    racing writers exactly one gets 200, the others 412 PreconditionFailed. moto 5 honours it too
    (its check is not under a lock, though no race through it has been seen in tests). The HEAD
    before it is for S3-compatible stores that ignore the header: there the write is
    check-then-write (not race-free), but at least an object that exists is not overwritten.
    """
    fs.invalidate_cache(path)
    if fs.exists(path):
        raise FileExistsError(path)
    bucket, key, _ = fs.split_path(path)
    for attempt in range(4):
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            break
        except OSError as exc:
            code = _error_code(exc)
            if isinstance(exc, FileExistsError) or code == "PreconditionFailed":
                raise FileExistsError(path) from None
            # AWS answers 409 while another conditional write to the key is in progress; retrying
            # gets the final answer (412 if that writer won, success if it failed).
            if code == "ConditionalRequestConflict" and attempt < 3:
                time.sleep(0.05 * 2**attempt)
                continue
            raise
    fs.invalidate_cache(path)


class S3Sink(Sink):
    """Sequential sink for one S3 object: full parts are uploaded concurrently while writing continues.

    Nothing is visible at the key until :meth:`commit` completes the multipart upload (or, for an
    object smaller than one part, does a single PUT); :meth:`abort` and every failure abort the
    multipart upload, so no parts are left billed and unreferenced.
    """

    def __init__(self, fs: Any, path: str, display: str, upload: S3Upload | None = None) -> None:
        self.fs, self.path, self.display = fs, path, display
        self.upload = upload or S3Upload()
        self.bucket, self.key, _ = fs.split_path(path)
        self.buf = bytearray(self.upload.part_size)
        self.fill = 0  # bytes of ``buf`` written so far
        self.pos = 0
        self.upload_id: str | None = None
        self.checksum_algorithm: str | None = None
        self.in_flight: collections.deque[tuple[int, concurrent.futures.Future[Any]]] = collections.deque()
        self.parts: list[dict[str, Any]] = []

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            size = len(self.buf)
            take = min(len(view), size - self.fill)
            self.buf[self.fill : self.fill + take] = view[:take]
            self.fill += take
            self.pos += take
            view = view[take:]
            if self.fill == size:
                self._send()
                parts = len(self.parts) + len(self.in_flight)
                size = min(self.upload.part_size << (parts // _PARTS_PER_SIZE), MAX_PART_SIZE)
                if size != len(self.buf):
                    self.buf = bytearray(size)

    def tell(self) -> int:
        return self.pos

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        except OSError as exc:
            raise storage_error(exc, "write", self.display, previous_kept=True) from None

    def _send(self) -> None:
        """Start uploading the filled part of ``buf`` as the next part (after creating the upload)."""
        if self.upload_id is None:
            mpu = self._call("create_multipart_upload")
            self.upload_id = mpu["UploadId"]
            # With a checksum algorithm on the upload (s3_additional_kwargs), S3 wants each part's
            # checksum again in the completion request.
            self.checksum_algorithm = mpu.get("ChecksumAlgorithm")
        while len(self.in_flight) >= self.upload.max_in_flight:
            self._finish_oldest()
        number = len(self.parts) + len(self.in_flight) + 1
        # A bytes copy, so ``buf`` can be refilled at once; aiohttp also refuses large bytearrays
        # (a ResourceWarning) but streams bytes bodies.
        body = bytes(memoryview(self.buf)[: self.fill])
        self.fill = 0
        coro = self.fs._call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=body
        )
        # Runs on s3fs's own event loop thread: no thread per part, and the loop overlaps the requests.
        self.in_flight.append((number, asyncio.run_coroutine_threadsafe(coro, self.fs.loop)))

    def _finish_oldest(self) -> None:
        number, future = self.in_flight.popleft()
        try:
            out = future.result()
        except OSError as exc:
            raise storage_error(exc, "write", self.display, previous_kept=True) from None
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if self.checksum_algorithm and f"Checksum{self.checksum_algorithm}" in out:
            part[f"Checksum{self.checksum_algorithm}"] = out[f"Checksum{self.checksum_algorithm}"]
        self.parts.append(part)

    def commit(self, header: bytes) -> None:
        # As with FsspecSink, the header cannot be patched into an object: its length field stays
        # 0, meaning "the container ends where the object ends".
        try:
            if self.upload_id is None:
                self._call("put_object", Body=bytes(memoryview(self.buf)[: self.fill]))
            else:
                if self.fill:
                    self._send()
                while self.in_flight:
                    self._finish_oldest()
                self._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": self.parts})
                self.upload_id = None
        except BaseException:
            self.abort()
            raise
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        # Wait for the parts still uploading rather than cancel them: a part that reaches the
        # server after the abort could otherwise leave the upload (and its storage) behind.
        futures = [f for _, f in self.in_flight]
        self.in_flight.clear()
        concurrent.futures.wait(futures)
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is not None:
            with contextlib.suppress(Exception):  # cleanup must not mask the original error
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)
