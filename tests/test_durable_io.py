"""Durable-tier I/O: exclusive create of small files, and the concurrent multipart S3 upload (S3Sink).

S3 tests run against the local moto server of conftest.py (fixture ``s3``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import uuid

import pytest
import s3fs
import torch
from conftest import assert_same, s3_keys, s3_object_bytes, s3_pending_uploads

import ckptstore
from ckptstore import CheckpointError, CheckpointExistsError, InvalidArgumentError, StorageError
from ckptstore.storage import s3 as s3mod
from ckptstore.storage.small import write_small_exclusive
from ckptstore.storage.targets import FsspecSink, open_sink, resolve

TAKEN = "already exists: another writer committed this step first"


def _race(target_for, writers: int = 8) -> tuple[list[int], list[BaseException]]:
    """Run ``writers`` threads that all try to create the same file at once; return winners and errors."""
    barrier = threading.Barrier(writers)
    winners: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def attempt(i: int) -> None:
        target = target_for()
        barrier.wait()
        try:
            write_small_exclusive(target, b"writer %d" % i)
        except BaseException as exc:  # noqa: BLE001 - collected and checked by the test
            with lock:
                errors.append(exc)
        else:
            with lock:
                winners.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return winners, errors


def _assert_lost(errors: list[BaseException], display: str, count: int) -> None:
    assert len(errors) == count, errors
    for exc in errors:
        assert type(exc) is CheckpointExistsError, repr(exc)
        assert str(exc).startswith(f"{display} {TAKEN}"), str(exc)


# ------------------------------------------------------------------------ exclusive create, local


def test_local_exclusive_create_has_exactly_one_winner(tmp_path):
    path = str(tmp_path / "COMMITTED")
    winners, errors = _race(lambda: resolve(path))
    assert len(winners) == 1
    _assert_lost(errors, path, 7)
    with open(path, "rb") as f:
        assert f.read() == b"writer %d" % winners[0]
    assert os.listdir(tmp_path) == ["COMMITTED"], "no temporary files left behind"


def test_local_exclusive_create_leaves_existing_file_untouched(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_bytes(b"first")
    with pytest.raises(CheckpointError) as info:
        write_small_exclusive(resolve(str(path)), b"second")
    assert str(path) in str(info.value) and TAKEN in str(info.value)
    assert path.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_local_exclusive_create_without_hard_links(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = str(tmp_path / "m")
    write_small_exclusive(resolve(path), b"one")
    with pytest.raises(CheckpointError, match=TAKEN):
        write_small_exclusive(resolve(path), b"two")
    with open(path, "rb") as f:
        assert f.read() == b"one"
    assert os.listdir(tmp_path) == ["m"]


def test_local_exclusive_create_in_missing_directory(tmp_path):
    with pytest.raises(StorageError) as info:
        write_small_exclusive(resolve(str(tmp_path / "nope" / "m")), b"x")
    assert info.value.errno == errno.ENOENT


def test_exclusive_create_refuses_file_objects():
    import io

    with pytest.raises(InvalidArgumentError):
        write_small_exclusive(resolve(io.BytesIO()), b"x")


# ------------------------------------------------------------------------ exclusive create, fsspec


def test_memory_exclusive_create_falls_back_to_check_then_write():
    # memory:// has no conditional create: sequential writers are still refused (not race-free).
    url = f"memory://ckptstore-test-{uuid.uuid4().hex}/COMMITTED"
    write_small_exclusive(resolve(url), b"one")
    with pytest.raises(CheckpointError) as info:
        write_small_exclusive(resolve(url), b"two")
    assert str(info.value).startswith(f"{url} {TAKEN}")
    fs, path = resolve(url).fs, resolve(url).fspath
    assert fs.cat_file(path) == b"one"
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path], "no temporary keys left behind"


def test_s3_exclusive_create_has_exactly_one_winner(s3):
    key = f"{s3['prefix']}/COMMITTED"
    url = f"s3://{s3['bucket']}/{key}"
    # Each writer has its own filesystem instance, as separate processes would.
    winners, errors = _race(lambda: resolve(url, s3["storage_options"]))
    assert len(winners) == 1
    _assert_lost(errors, url, 7)
    assert s3_object_bytes(s3, key) == b"writer %d" % winners[0]
    assert s3_keys(s3, s3["prefix"]) == [key]


def test_s3_conditional_put_refuses_what_the_existence_check_missed(s3, monkeypatch):
    # Make the HEAD before the PUT see nothing, as a racing writer would: the If-None-Match PUT
    # itself must then be refused by the server (412), leaving the object as it was.
    key = f"{s3['prefix']}/COMMITTED"
    url = f"s3://{s3['bucket']}/{key}"
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=b"first")
    target = resolve(url, s3["storage_options"])
    monkeypatch.setattr(target.fs, "exists", lambda path, **kw: False)
    with pytest.raises(CheckpointError) as info:
        write_small_exclusive(target, b"second")
    assert str(info.value).startswith(f"{url} {TAKEN}")
    assert s3_object_bytes(s3, key) == b"first"


def test_s3_exclusive_create_to_missing_bucket(s3):
    url = f"s3://no-such-bucket-{s3['prefix'].lower()[:30]}/COMMITTED"
    with pytest.raises(StorageError) as info:
        write_small_exclusive(resolve(url, s3["storage_options"]), b"x")
    assert url in str(info.value)


# ------------------------------------------------------------------------ concurrent multipart upload


@pytest.fixture
def parallel_upload(monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_UPLOAD_CONCURRENCY", "4")
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(8 << 20))


class _Spy:
    """Wraps an S3FileSystem's calls: records them, delays part uploads (so they overlap) and can fail one."""

    def __init__(self, fs, fail_part: int | None = None) -> None:
        self.real = fs._call_s3
        self.calls: list[str] = []
        self.running = self.most_running = 0
        self.fail_part = fail_part
        self.fs = fs

    async def __call__(self, method, *args, **kwargs):
        self.calls.append(method)
        if method != "upload_part":
            return await self.real(method, *args, **kwargs)
        self.running += 1  # only touched on s3fs's event loop thread: no lock needed
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(0.05)
            if kwargs["PartNumber"] == self.fail_part:
                raise OSError(errno.EIO, "injected upload failure")
            return await self.real(method, *args, **kwargs)
        finally:
            self.running -= 1

    def install(self, monkeypatch) -> None:
        from fsspec.asyn import sync

        monkeypatch.setattr(self.fs, "_call_s3", self)
        monkeypatch.setattr(self.fs, "call_s3", lambda method, *a, **kw: sync(self.fs.loop, self, method, *a, **kw))


def test_open_sink_uses_the_concurrent_upload_unless_turned_off(s3, monkeypatch):
    target = resolve(f"s3://{s3['bucket']}/{s3['prefix']}/x", s3["storage_options"])
    monkeypatch.delenv("CKPTSTORE_S3_UPLOAD_CONCURRENCY", raising=False)
    sink = open_sink(target)
    assert isinstance(sink, s3mod.S3Sink) and sink.upload == s3mod.S3Upload(part_size=8 << 20, max_in_flight=4)
    sink.abort()
    monkeypatch.setenv("CKPTSTORE_S3_UPLOAD_CONCURRENCY", "0")
    sink = open_sink(target)
    assert isinstance(sink, FsspecSink)
    sink.abort()
    monkeypatch.setenv("CKPTSTORE_S3_UPLOAD_CONCURRENCY", "3")
    sink = open_sink(target)
    assert isinstance(sink, s3mod.S3Sink)
    assert sink.upload == s3mod.S3Upload(part_size=8 << 20, max_in_flight=3)
    sink.abort()
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(1 << 20))
    with pytest.raises(InvalidArgumentError, match="5 MiB"):
        open_sink(target)


def test_large_object_round_trips_with_bounded_parts_in_flight(s3, parallel_upload, monkeypatch):
    key = f"{s3['prefix']}/big.bin"
    target = resolve(f"s3://{s3['bucket']}/{key}", s3["storage_options"])
    spy = _Spy(target.fs)
    spy.install(monkeypatch)
    payload = os.urandom(40 << 20)
    sink = open_sink(target)
    assert isinstance(sink, s3mod.S3Sink)
    # Odd write sizes, so writes straddle part boundaries.
    view = memoryview(payload)
    step = (3 << 20) + 12345
    for offset in range(0, len(payload), step):
        sink.write(view[offset : offset + step])
    assert sink.tell() == len(payload)
    assert s3_keys(s3, key) == [], "nothing is visible before commit"
    sink.commit(b"")

    assert s3_object_bytes(s3, key) == payload
    assert s3_keys(s3, s3["prefix"]) == [key]
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    assert spy.calls.count("upload_part") == 5  # 8 MiB parts: 4 full + 1 partial
    assert spy.calls.count("create_multipart_upload") == 1
    assert 2 <= spy.most_running <= 4, spy.most_running


@pytest.mark.parametrize("size", [0, 1000, (8 << 20) - 1])
def test_object_smaller_than_a_part_is_one_put(s3, parallel_upload, monkeypatch, size):
    key = f"{s3['prefix']}/small.bin"
    target = resolve(f"s3://{s3['bucket']}/{key}", s3["storage_options"])
    spy = _Spy(target.fs)
    spy.install(monkeypatch)
    payload = os.urandom(size)
    sink = open_sink(target)
    sink.write(payload)
    sink.commit(b"")
    assert spy.calls == ["put_object"]
    assert s3_object_bytes(s3, key) == payload


def test_exactly_one_part_uses_multipart(s3, parallel_upload, monkeypatch):
    key = f"{s3['prefix']}/one.bin"
    target = resolve(f"s3://{s3['bucket']}/{key}", s3["storage_options"])
    payload = os.urandom(8 << 20)
    sink = open_sink(target)
    sink.write(payload)
    sink.commit(b"")
    assert s3_object_bytes(s3, key) == payload
    assert s3_pending_uploads(s3, s3["prefix"]) == []


@pytest.mark.parametrize("fail_part", [1, 3, 5], ids=["first", "middle", "last-on-commit"])
def test_failed_part_aborts_the_upload(s3, parallel_upload, monkeypatch, fail_part):
    key = f"{s3['prefix']}/big.bin"
    url = f"s3://{s3['bucket']}/{key}"
    target = resolve(url, s3["storage_options"])
    spy = _Spy(target.fs, fail_part=fail_part)
    spy.install(monkeypatch)
    sink = open_sink(target)
    with pytest.raises(StorageError) as info:
        try:
            sink.write(os.urandom(36 << 20))
            sink.commit(b"")
        except BaseException:
            sink.abort()  # what every caller of open_sink does
            raise
    assert info.value.errno == errno.EIO
    assert url in str(info.value)
    assert "abort_multipart_upload" in spy.calls
    assert s3_pending_uploads(s3, s3["prefix"]) == [], "the multipart upload must be aborted"
    assert s3_keys(s3, s3["prefix"]) == [], "no object at the final key"


def test_abort_after_parts_were_uploaded_leaves_nothing(s3, parallel_upload):
    key = f"{s3['prefix']}/big.bin"
    sink = open_sink(resolve(f"s3://{s3['bucket']}/{key}", s3["storage_options"]))
    sink.write(os.urandom(20 << 20))  # two parts sent, the third still buffered
    assert s3_pending_uploads(s3, s3["prefix"]) == [key]
    sink.abort()
    sink.abort()  # idempotent, as callers may abort twice after a failed commit
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    assert s3_keys(s3, s3["prefix"]) == []


def test_save_and_load_through_the_concurrent_upload(s3, parallel_upload, monkeypatch):
    key = f"{s3['prefix']}/state.ckpt"
    url = f"s3://{s3['bucket']}/{key}"
    gen = torch.Generator().manual_seed(3)
    old = {"w": torch.arange(10.0)}
    ckptstore.save(old, url, storage_options=s3["storage_options"])
    before = s3_object_bytes(s3, key)

    obj = {"big": torch.randint(0, 256, (20 << 20,), dtype=torch.uint8, generator=gen), "x": torch.randn(100)}
    # A failure in the middle leaves the previous checkpoint as it was.
    real = s3fs.S3FileSystem._call_s3

    async def flaky(self, method, *args, **kwargs):
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            raise OSError(errno.EIO, "injected upload failure")
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", flaky)
    with pytest.raises(StorageError):
        ckptstore.save(obj, url, storage_options=s3["storage_options"])
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", real)
    assert s3_object_bytes(s3, key) == before
    assert s3_pending_uploads(s3, s3["prefix"]) == []

    ckptstore.save(obj, url, storage_options=s3["storage_options"])
    assert s3_keys(s3, s3["prefix"]) == [key]
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    assert_same(ckptstore.load(url, storage_options=s3["storage_options"]), obj)
