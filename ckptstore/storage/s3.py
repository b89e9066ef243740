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
import contextvars
import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .._faults import crashpoint
from ..errors import InvalidArgumentError, StorageError
from .base import Sink, storage_error, transport_errors

T = TypeVar("T")

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


# One retry layer for S3 requests: botocore's "standard" mode (throttling such as 503 SlowDown,
# 5xx, connection errors; exponential backoff with jitter, at most 20 s per wait), with this many
# attempts per request. s3fs would wrap its own loop of 5 attempts around botocore's (25 requests
# and ~40 s for one PUT under a steady SlowDown), so its loop is set to a single attempt.
RETRY_ATTEMPTS = 5


def with_retry_defaults(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` for s3fs with botocore's standard retry mode and RETRY_ATTEMPTS attempts,
    unless the caller configured botocore's retries already (``config_kwargs={"retries": ...}``)."""
    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"mode": "standard", "total_max_attempts": RETRY_ATTEMPTS})
    options["config_kwargs"] = config
    return options


def single_retry_layer(fs: Any) -> None:
    """Leave retrying to botocore: s3fs's own loop makes one attempt (a class attribute in s3fs,
    not a constructor option)."""
    if is_s3(fs) and getattr(fs, "retries", 1) != 1:
        fs.retries = 1


# The deadline of the work running in this context (a durable promotion): monotonic time and what
# for. S3 requests are cut when it passes, so a promotion cannot outlive it by more than the one
# metadata request (HEAD, LIST) in flight, itself bounded by the retry attempts and timeouts. A
# context variable: the pipeline's coroutines set it, and the threads they hand blocking calls to
# (asyncio.to_thread) run in a copy of their context.
_deadline: contextvars.ContextVar[tuple[float, str] | None] = contextvars.ContextVar("ckptstore_deadline", default=None)


@contextlib.contextmanager
def deadline(at: float | None, what: str) -> Iterator[None]:
    token = _deadline.set(None if at is None else (at, what))
    try:
        yield
    finally:
        _deadline.reset(token)


def run_with_deadline(at: float | None, what: str, fn: Callable[..., T], *args: Any) -> T:
    with deadline(at, what):
        return fn(*args)


def current_deadline() -> tuple[float, str] | None:
    return _deadline.get()


def _past_deadline(limit: tuple[float, str], display: str) -> StorageError:
    return StorageError(
        f"cannot write {display}: {limit[1]} passed before the object store answered (it is slow or "
        "unreachable); nothing was committed there and the previous objects are untouched",
        errno=errno.ETIMEDOUT,
    )


def _result(future: concurrent.futures.Future[T], limit: tuple[float, str] | None, display: str) -> T:
    """The future's result, or StorageError(ETIMEDOUT) once ``limit`` passes (the request is cancelled)."""
    if limit is None:
        return future.result()
    try:
        return future.result(timeout=max(0.0, limit[0] - time.monotonic()))
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise _past_deadline(limit, display) from None


def call(fs: Any, display: str, method: str, **kwargs: Any) -> Any:
    """``fs.call_s3`` that honours this thread's deadline."""
    limit = current_deadline()
    if limit is None:
        return fs.call_s3(method, **kwargs)
    if time.monotonic() >= limit[0]:
        raise _past_deadline(limit, display)
    return _result(asyncio.run_coroutine_threadsafe(fs._call_s3(method, **kwargs), fs.loop), limit, display)


def remove_tree(fs: Any, path: str, display: str = "") -> None:
    """Delete every object under ``path`` ("bucket/prefix"), then the directory entries a server
    with a real namespace keeps for them: SeaweedFS's filer lists an emptied prefix as a common
    prefix until its "key/" entry is deleted, deepest first, so a removed step would go on listing
    (and a sweep would find it again at every start). On AWS those DELETEs are no-ops."""
    dirs = {path.rstrip("/")}
    try:
        for root, _subdirs, _files in fs.walk(path):
            dirs.add(root.rstrip("/"))
    except FileNotFoundError:
        pass
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    for d in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
        bucket, _, key = d.partition("/")
        if key:
            call(fs, display or d, "delete_object", Bucket=bucket, Key=key + "/")
    fs.invalidate_cache(path)


def is_s3(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols and hasattr(fs, "_call_s3")


def _response(exc: BaseException) -> dict[str, Any] | None:
    """The S3 response behind an s3fs exception (s3fs keeps botocore's ClientError as the cause)."""
    cause: BaseException | None = exc
    while cause is not None:
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return response
        cause = cause.__cause__
    return None


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs exception."""
    response = _response(exc)
    return None if response is None else response.get("Error", {}).get("Code")


def precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's 412 to a conditional request: the write lost to an object
    already there. s3fs turns a 412 into FileExistsError only when the error names the
    If-None-Match condition (AWS does); SeaweedFS's, and any 412 without a body (botocore then
    calls its code "412"), arrive as OSError(EINVAL), which s3fs also raises for every 400 (a bad
    digest, an invalid argument). So the answer is read from the response itself: its status, or
    its code when the response carries no status."""
    response = _response(exc)
    if response is None:
        return isinstance(exc, FileExistsError)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status is not None:
        return bool(status == 412)
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")


def _holds(fs: Any, path: str, data: bytes) -> bool:
    """Whether the object at ``path`` holds exactly ``data``. A conditional PUT whose first answer
    was lost is retried by botocore and then refused (412) because of its own first attempt; the
    write did succeed, and the same bytes from another writer would be just as good."""
    try:
        fs.invalidate_cache(path)
        return bool(fs.cat_file(path) == data)
    except Exception:  # noqa: BLE001 - unreadable: not known to be ours
        return False


def put_if_absent(fs: Any, path: str, data: bytes, display: str = "") -> None:
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
            call(fs, display or path, "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            break
        except StorageError:
            raise
        except OSError as exc:
            if precondition_failed(exc):
                if _holds(fs, path, data):
                    break
                raise FileExistsError(path) from None
            # AWS answers 409 while another conditional write to the key is in progress; retrying
            # gets the final answer (412 if that writer won, success if it failed).
            if _error_code(exc) == "ConditionalRequestConflict" and attempt < 3:
                time.sleep(0.05 * 2**attempt)
                continue
            raise
    fs.invalidate_cache(path)


# Bytes taken from a response body at a time: small enough to stay in warm, reused memory.
_READ_PIECE = 1 << 20


async def _get_into(fs: Any, path: str, offset: int, out: memoryview) -> int:
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + len(out) - 1}",
                             **extra)
    body = resp["Body"]
    done = 0
    try:
        while done < len(out):
            piece = await body.read(min(_READ_PIECE, len(out) - done))
            if not piece:
                break
            out[done : done + len(piece)] = piece
            done += len(piece)
    finally:
        body.close()
    return done


def read_into(fs: Any, path: str, offset: int, out: memoryview) -> int:
    """One ranged GET of ``len(out)`` bytes at ``offset``, streamed into ``out``; returns the bytes
    received (fewer when the object ends first). s3fs's ``cat_file`` gathers the body into a new
    bytes object, which the caller then copies: for the 16-64 MiB chunks of a restore that is a
    fresh allocation (its pages faulted in) and a second copy per request, which made a restore
    from SeaweedFS spend 2.5x the CPU of a raw boto3 ranged GET into the same memory."""
    from fsspec.asyn import sync

    return int(sync(fs.loop, _get_into, fs, path, offset, out))


def pending_uploads(fs: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """The multipart uploads started under ``prefix`` and neither completed nor aborted."""
    out: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        out.extend(page.get("Uploads", []))
        if not page.get("IsTruncated"):
            return out
        kwargs.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])


class S3Sink(Sink):
    """Sequential sink for one S3 object: full parts are uploaded concurrently while writing continues.

    Nothing is visible at the key until :meth:`commit` completes the multipart upload (or, for an
    object smaller than one part, does a single PUT); :meth:`abort` and every failure abort the
    multipart upload, so no parts are left billed and unreferenced.
    """

    def __init__(self, fs: Any, path: str, display: str, upload: S3Upload | None = None, *,
                 exclusive: bool = False) -> None:
        self.fs, self.path, self.display = fs, path, display
        # exclusive: the final PUT or completion carries If-None-Match: *, so it never replaces an object.
        self.exclusive = exclusive
        self.retried_create = False
        self.upload = upload or S3Upload()
        self.bucket, self.key, _ = fs.split_path(path)
        self.buf = bytearray(self.upload.part_size)
        self.fill = 0  # bytes of ``buf`` written so far
        self.pos = 0
        self.upload_id: str | None = None
        self.checksum_algorithm: str | None = None
        self.in_flight: collections.deque[tuple[int, concurrent.futures.Future[Any]]] = collections.deque()
        self.parts: list[dict[str, Any]] = []
        self.deadline = current_deadline()  # taken here: its part uploads run on s3fs's loop, outside this context

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            size = len(self.buf)
            if self.fill == 0 and len(view) >= size:
                # A whole part in the caller's bytes: one copy into the request body, not two.
                body: bytes | None = bytes(view[:size])
                take = size
            else:
                take = min(len(view), size - self.fill)
                self.buf[self.fill : self.fill + take] = view[:take]
                self.fill += take
                body = None
            self.pos += take
            view = view[take:]
            if body is not None or self.fill == size:
                self._send(body)
                parts = len(self.parts) + len(self.in_flight)
                size = min(self.upload.part_size << (parts // _PARTS_PER_SIZE), MAX_PART_SIZE)
                if size != len(self.buf):
                    self.buf = bytearray(size)

    def tell(self) -> int:
        return self.pos

    def _call(self, method: str, **kwargs: Any) -> Any:
        with deadline(*self.deadline) if self.deadline else contextlib.nullcontext():
            try:
                return call(self.fs, self.display, method, Bucket=self.bucket, Key=self.key, **kwargs)
            except StorageError:
                raise
            except transport_errors() as exc:
                if precondition_failed(exc):
                    raise FileExistsError(self.display) from None  # an exclusive write lost
                raise storage_error(exc, "write", self.display, previous_kept=True) from None

    def _send(self, body: bytes | None = None) -> None:
        """Start uploading ``body``, or else the filled part of ``buf``, as the next part (after
        creating the upload)."""
        if self.upload_id is None:
            mpu = self._call("create_multipart_upload")
            self.upload_id = mpu["UploadId"]
            # A create retried after its response was lost leaves an upload we never heard of.
            self.retried_create = bool(mpu.get("ResponseMetadata", {}).get("RetryAttempts"))
            # With a checksum algorithm on the upload (s3_additional_kwargs), S3 wants each part's
            # checksum again in the completion request.
            self.checksum_algorithm = mpu.get("ChecksumAlgorithm")
        while len(self.in_flight) >= self.upload.max_in_flight:
            self._finish_oldest()
        number = len(self.parts) + len(self.in_flight) + 1
        if body is None:
            # A bytes copy, so ``buf`` can be refilled at once; aiohttp also refuses large
            # bytearrays (a ResourceWarning) but streams bytes bodies.
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
            out = _result(future, self.deadline, self.display)
        except StorageError:
            raise
        except transport_errors() as exc:
            raise storage_error(exc, "write", self.display, previous_kept=True) from None
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if self.checksum_algorithm and f"Checksum{self.checksum_algorithm}" in out:
            part[f"Checksum{self.checksum_algorithm}"] = out[f"Checksum{self.checksum_algorithm}"]
        self.parts.append(part)
        crashpoint("s3.part_uploaded", self.path)

    def commit(self, header: bytes) -> None:
        # As with FsspecSink, the header cannot be patched into an object: its length field stays
        # 0, meaning "the container ends where the object ends".
        condition = {"IfNoneMatch": "*"} if self.exclusive else {}
        try:
            if self.exclusive:
                # For stores that ignore the header: at least an existing object is not replaced.
                self.fs.invalidate_cache(self.path)
                if self.fs.exists(self.path):
                    raise FileExistsError(self.path)
            if self.upload_id is None:
                body = bytes(memoryview(self.buf)[: self.fill])
                try:
                    self._call("put_object", Body=body, **condition)
                except FileExistsError:
                    if not _holds(self.fs, self.path, body):
                        raise
            else:
                if self.fill:
                    self._send()
                while self.in_flight:
                    self._finish_oldest()
                crashpoint("s3.before_complete", self.path)
                self._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": self.parts},
                           **condition)
                self.upload_id = None
        except BaseException as exc:
            self.abort()
            if isinstance(exc, FileExistsError) or precondition_failed(exc):
                from .base import already_exists

                raise already_exists(self.display) from None
            raise
        finally:
            self._abort_orphans()
        self.fs.invalidate_cache(self.path)

    def _abort_orphans(self) -> None:
        """Abort the uploads of this key that a retried create left behind (its first response was
        lost, so S3 holds an upload whose id we never learned). Only after a retried create: the
        one case where an upload of ours can exist without our knowing its id."""
        if not self.retried_create:
            return
        self.retried_create = False
        with contextlib.suppress(Exception):  # cleanup must not mask the outcome
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=self.key)
            for upload in listed.get("Uploads", []):
                if upload.get("Key") == self.key and upload.get("UploadId") != self.upload_id:
                    self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                    UploadId=upload["UploadId"])

    def abort(self) -> None:
        # Wait for the parts still uploading rather than cancel them: a part that reaches the
        # server after the abort could otherwise leave the upload (and its storage) behind. Past
        # the deadline they are cancelled instead, and the abort is sent twice (S3's advice for
        # parts that were in flight: the second one catches a part that landed after the first).
        futures = [f for _, f in self.in_flight]
        self.in_flight.clear()
        late = self.deadline is not None and time.monotonic() >= self.deadline[0]
        if late:
            for f in futures:
                f.cancel()
        concurrent.futures.wait(futures)
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is not None:
            for _ in range(2 if late else 1):
                with contextlib.suppress(Exception):  # cleanup must not mask the original error
                    self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)
