"""s3:// through s3fs against a local moto server (see the s3_server fixture in conftest.py)."""

from __future__ import annotations

import errno

import pytest
import s3fs
import torch
from conftest import assert_same, container_layout, s3_keys, s3_object_bytes, s3_pending_uploads
from torch import nn

import ckptstore
from ckptstore import CheckpointError, CheckpointNotFoundError, StorageError, UnsupportedObjectError


def _training_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


def test_model_and_optimizer_round_trip(s3):
    key = f"{s3['prefix']}/state.ckpt"
    url = f"s3://{s3['bucket']}/{key}"
    obj = _training_state()
    ckptstore.save(obj, url, storage_options=s3["storage_options"])
    assert s3_keys(s3, s3["prefix"]) == [key], "exactly one object, no temporary keys"
    assert s3_pending_uploads(s3, s3["prefix"]) == []

    loaded = ckptstore.load(url, storage_options=s3["storage_options"])
    assert_same(loaded, obj)
    assert loaded["model"]._metadata == obj["model"]._metadata
    assert list(loaded["optim"]["state"]) == [0, 1, 2, 3, 4, 5]


def test_compressed_round_trip(s3):
    url = f"s3://{s3['bucket']}/{s3['prefix']}/c.ckpt"
    obj = {"w": torch.randn(300, 300), "i": torch.arange(1000)}
    ckptstore.save(obj, url, compression="shuffle+zstd", storage_options=s3["storage_options"])
    assert_same(ckptstore.load(url, storage_options=s3["storage_options"]), obj)


def test_object_larger_than_the_upload_block_size_round_trips(s3):
    # s3fs uploads in parts of `default_block_size` bytes; 5 MiB (the S3 minimum part size) makes a
    # 12 MiB checkpoint take the multipart path without moving 50+ MiB through moto.
    opts = dict(s3["storage_options"], default_block_size=5 << 20)
    key = f"{s3['prefix']}/big.ckpt"
    url = f"s3://{s3['bucket']}/{key}"
    gen = torch.Generator().manual_seed(7)
    obj = {
        "big": torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=gen),
        "tail": torch.randn(1000, generator=gen),
        "meta": {"note": "the manifest comes last, after the multipart boundary"},
    }
    ckptstore.save(obj, url, storage_options=opts)
    assert s3_keys(s3, s3["prefix"]) == [key]
    assert s3_pending_uploads(s3, s3["prefix"]) == []

    stored = s3_object_bytes(s3, key)
    layout = container_layout(stored)  # header, footer and manifest are all in the object
    assert layout["length"] == len(stored)
    assert len(stored) > 12 << 20
    assert_same(ckptstore.load(url, storage_options=opts), obj)


def test_failed_save_leaves_existing_object_unchanged(s3):
    key = f"{s3['prefix']}/keep.ckpt"
    url = f"s3://{s3['bucket']}/{key}"
    old = {"w": torch.arange(10.0)}
    ckptstore.save(old, url, storage_options=s3["storage_options"])
    before = s3_object_bytes(s3, key)

    with pytest.raises(UnsupportedObjectError) as info:
        ckptstore.save({"w": torch.zeros(3), "bad": object()}, url, storage_options=s3["storage_options"])
    assert "obj['bad']" in str(info.value)
    assert s3_object_bytes(s3, key) == before
    assert s3_keys(s3, s3["prefix"]) == [key]
    assert_same(ckptstore.load(url, storage_options=s3["storage_options"]), old)


@pytest.mark.parametrize("failing_part", [1, 2, 3], ids=["first-part", "second-part", "last-part-on-commit"])
def test_error_in_the_middle_of_an_upload_leaves_existing_object_unchanged(s3, monkeypatch, failing_part):
    opts = dict(s3["storage_options"], default_block_size=5 << 20)
    key = f"{s3['prefix']}/keep.ckpt"
    url = f"s3://{s3['bucket']}/{key}"
    old = {"w": torch.arange(10.0)}
    ckptstore.save(old, url, storage_options=opts)
    before = s3_object_bytes(s3, key)

    # Simulate the network failing while parts are being uploaded (5 MiB parts: three of them):
    # part `failing_part` raises as s3fs does for a failed request, the others go through.
    real_call = s3fs.S3FileSystem._call_s3
    failed = []

    async def flaky(self, method, *args, **kwargs):
        if method == "upload_part" and kwargs.get("PartNumber") == failing_part:
            failed.append(failing_part)
            raise OSError(errno.EIO, "injected upload failure")
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(5 << 20))
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", flaky)
    new = {"a": torch.ones(6 << 20, dtype=torch.uint8), "b": torch.zeros(6 << 20, dtype=torch.uint8)}
    with pytest.raises(StorageError) as info:
        ckptstore.save(new, url, storage_options=opts)
    assert failed == [failing_part]
    assert url in str(info.value)
    assert info.value.errno == errno.EIO
    monkeypatch.undo()

    assert s3_object_bytes(s3, key) == before
    assert s3_keys(s3, s3["prefix"]) == [key]
    assert s3_pending_uploads(s3, s3["prefix"]) == [], "the aborted multipart upload must be discarded"
    assert_same(ckptstore.load(url, storage_options=opts), old)


def test_save_to_missing_bucket_fails_cleanly(s3):
    url = f"s3://no-such-bucket-{s3['prefix'].lower()[:30]}/x.ckpt"
    with pytest.raises(CheckpointError) as info:
        ckptstore.save({"w": torch.ones(3)}, url, storage_options=s3["storage_options"])
    assert isinstance(info.value, StorageError)
    assert url in str(info.value)


def test_missing_key(s3):
    url = f"s3://{s3['bucket']}/{s3['prefix']}/absent.ckpt"
    with pytest.raises(CheckpointNotFoundError) as info:
        ckptstore.load(url, storage_options=s3["storage_options"])
    assert isinstance(info.value, FileNotFoundError)
    assert url in str(info.value)
