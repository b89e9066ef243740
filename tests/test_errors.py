"""Every failure mode raises the documented ckptstore error, says what and where, and loses no data."""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import struct
import subprocess
import sys
import uuid

import fsspec
import pytest
import torch
from conftest import assert_same, container_layout, directory_entries, rewrite_manifest

import ckptstore
from ckptstore import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    StorageError,
    UnknownProtocolError,
    UnsupportedFormatVersionError,
    UnsupportedObjectError,
)
from ckptstore.format import container

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def sample():
    return {
        "model": {"layer.weight": torch.randn(64, 64), "bias": torch.randn(64)},
        "step": 10,
        "ids": torch.arange(100),
    }


@pytest.fixture
def saved(tmp_path):
    """A valid checkpoint on disk: (path, object, bytes)."""
    path = tmp_path / "model.ckpt"
    obj = sample()
    ckptstore.save(obj, path)
    return path, obj, path.read_bytes()


# --------------------------------------------------------------------------------------------
# Nothing there / not a checkpoint
# --------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointNotFoundError) as info:
        ckptstore.load(path)
    err = info.value
    assert isinstance(err, FileNotFoundError) and isinstance(err, CheckpointError)
    assert err.errno == errno.ENOENT
    assert str(path) in str(err)
    assert "does not exist" in str(err)
    with pytest.raises(FileNotFoundError):  # handlers written for torch.load keep working
        ckptstore.load(str(path))
    assert directory_entries(tmp_path) == []


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_missing_url(scheme, tmp_path):
    url = f"file://{tmp_path}/nope.ckpt" if scheme == "file" else f"memory://ckptstore-tests/{uuid.uuid4().hex}/x"
    with pytest.raises(CheckpointNotFoundError) as info:
        ckptstore.load(url)
    assert url in str(info.value)


def test_text_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(NotACheckpointError) as info:
        ckptstore.load(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)
    assert "not a checkpoint" in str(info.value)
    assert path.read_text() == "hello, this is not a checkpoint\n"


def test_empty_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    with pytest.raises(NotACheckpointError) as info:
        ckptstore.load(path)
    assert str(path) in str(info.value)
    assert "empty" in str(info.value)
    with pytest.raises(NotACheckpointError):
        ckptstore.load(io.BytesIO())


def test_short_prefix_of_the_magic_is_not_a_checkpoint():
    with pytest.raises(NotACheckpointError):
        ckptstore.load(io.BytesIO(container.MAGIC[:5]))


@pytest.mark.parametrize("position", range(8))
def test_damaged_header_magic_is_reported_as_not_a_checkpoint(position):
    # Every single-byte change of the 8-byte magic, every possible XOR mask: the file must be
    # refused with a ckptstore error. In particular a first byte turned into 0x80 (a pickle
    # PROTO opcode) must not hand a damaged ckptstore file to torch.load.
    buf = io.BytesIO()
    ckptstore.save({"w": torch.arange(4.0)}, buf)
    data = buf.getvalue()
    for mask in range(1, 256):
        damaged = bytearray(data)
        damaged[position] ^= mask
        with pytest.raises((NotACheckpointError, CorruptCheckpointError)):
            ckptstore.load(io.BytesIO(bytes(damaged)))


# --------------------------------------------------------------------------------------------
# Truncation and damage
# --------------------------------------------------------------------------------------------


def _cut_points(data: bytes) -> dict[str, int]:
    lay = container_layout(data)
    first_chunk = min(off for _, off, _ in lay["chunks"])
    return {
        "inside_header": 20,
        "header_padding": 100,
        "data_start": container.DATA_START,
        "inside_data": first_chunk + 3,
        "inside_manifest": lay["manifest_offset"] + lay["manifest_length"] // 2,
        "manifest_start": lay["manifest_offset"],
        "inside_footer": lay["footer_offset"] + 10,
        "last_byte_missing": lay["length"] - 1,
    }


@pytest.mark.parametrize(
    "where",
    [
        "inside_header",
        "header_padding",
        "data_start",
        "inside_data",
        "inside_manifest",
        "manifest_start",
        "inside_footer",
        "last_byte_missing",
    ],
)
def test_truncated_file(where, saved):
    path, _, data = saved
    cut = _cut_points(data)[where]
    path.write_bytes(data[:cut])
    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(path)
    err = info.value
    assert str(path) in str(err)
    assert err.location == str(path)
    assert "truncated" in str(err)
    # Same through a stream.
    with pytest.raises(CorruptCheckpointError):
        ckptstore.load(io.BytesIO(data[:cut]))


@pytest.mark.parametrize("where", ["inside_data", "inside_manifest", "inside_footer"])
def test_truncated_object_without_length_in_header(where):
    # Object stores cannot patch the header, so its length field stays 0; truncation is then
    # detected from the footer alone.
    fs = fsspec.filesystem("memory")
    url = f"memory://ckptstore-tests/{uuid.uuid4().hex}/c.ckpt"
    try:
        ckptstore.save(sample(), url)
        data = fs.cat_file(url)
        assert container.HEADER.unpack_from(data)[4] == 0
        cut = _cut_points(data)[where]
        fs.pipe_file(url, data[:cut])
        with pytest.raises(CorruptCheckpointError) as info:
            ckptstore.load(url)
        assert url in str(info.value)
        assert info.value.location == url
    finally:
        fs.rm(url)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("key", ["model/layer.weight", "model/bias", "ids"])
def test_flipped_byte_in_tensor_data_names_the_tensor(key, compression, tmp_path):
    path = tmp_path / "model.ckpt"
    ckptstore.save(sample(), path, compression=compression)
    data = bytearray(path.read_bytes())
    chunks = [(k, off, n) for k, off, n in container_layout(bytes(data))["chunks"] if k == key]
    assert chunks, f"manifest has no key {key!r}: {container_layout(bytes(data))['manifest']['tensors'].keys()}"
    _, off, n = chunks[0]
    data[off + n // 2] ^= 0x01
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(path)
    err = info.value
    assert err.key == key
    assert err.location == str(path)
    assert str(path) in str(err) and repr(key) in str(err)
    assert "checksum" in str(err)
    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(io.BytesIO(bytes(data)))
    assert info.value.key == key


def test_flipped_byte_in_manifest(saved):
    path, _, data = saved
    lay = container_layout(data)
    damaged = bytearray(data)
    damaged[lay["manifest_offset"] + 7] ^= 0x20
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(path)
    assert str(path) in str(info.value)
    assert "manifest" in str(info.value)


def test_manifest_pointing_outside_the_data_region(saved):
    path, _, data = saved

    def edit(doc):
        doc["tensors"]["ids"]["chunks"][0]["offset"] = 10
        return doc

    path.write_bytes(rewrite_manifest(data, edit))
    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(path)
    assert info.value.key == "ids"
    assert str(path) in str(info.value)


def test_unknown_tree_tag_is_corrupt_and_mentions_newer_writer(saved):
    path, _, data = saved

    def edit(doc):
        doc["tree"]["step"] = {"$from_the_future": 1}
        return doc

    path.write_bytes(rewrite_manifest(data, edit))
    with pytest.raises(CorruptCheckpointError) as info:
        ckptstore.load(path)
    assert "$from_the_future" in str(info.value)
    assert "newer" in str(info.value)


# --------------------------------------------------------------------------------------------
# Format versions
# --------------------------------------------------------------------------------------------


def test_manifest_of_newer_major_version(saved):
    path, _, data = saved
    path.write_bytes(rewrite_manifest(data, lambda doc: {**doc, "format_version": "3.0"}))
    with pytest.raises(UnsupportedFormatVersionError) as info:
        ckptstore.load(path)
    msg = str(info.value)
    assert isinstance(info.value, CheckpointError)
    assert str(path) in msg and "3.0" in msg and "Upgrade ckptstore" in msg


def test_manifest_of_newer_minor_version_still_loads(saved):
    path, obj, data = saved
    path.write_bytes(rewrite_manifest(data, lambda doc: {**doc, "format_version": "1.99"}))
    assert_same(ckptstore.load(path), obj)


def test_header_of_newer_major_version(saved):
    path, _, data = saved
    damaged = bytearray(data)
    struct.pack_into("<H", damaged, 8, 2)
    path.write_bytes(bytes(damaged))
    with pytest.raises(UnsupportedFormatVersionError) as info:
        ckptstore.load(path)
    msg = str(info.value)
    assert str(path) in msg and "format 2." in msg and "Upgrade ckptstore" in msg


# --------------------------------------------------------------------------------------------
# Protocols and arguments
# --------------------------------------------------------------------------------------------


def test_unknown_protocol():
    with pytest.raises(UnknownProtocolError) as info:
        ckptstore.load("nosuchproto://bucket/x.ckpt")
    assert isinstance(info.value, ValueError)
    assert "nosuchproto" in str(info.value)
    with pytest.raises(UnknownProtocolError):
        ckptstore.save({"a": 1}, "nosuchproto://bucket/x.ckpt")


def _uninstalled_protocol() -> tuple[str, str]:
    for protocol, package in [("gs", "gcsfs"), ("abfs", "adlfs"), ("oci", "ocifs"), ("dropbox", "dropboxdrivefs")]:
        if importlib.util.find_spec(package) is None:
            return protocol, package
    raise AssertionError("every candidate fsspec implementation is installed; add another candidate")


def test_known_protocol_without_its_package_gives_install_hint():
    protocol, package = _uninstalled_protocol()
    url = f"{protocol}://bucket/x.ckpt"
    for call in (lambda: ckptstore.load(url), lambda: ckptstore.save({"a": torch.ones(1)}, url)):
        with pytest.raises(UnknownProtocolError) as info:
            call()
        assert package in str(info.value)
        assert url in str(info.value)


@pytest.mark.parametrize("bad", [123, 4.5, None, b"/tmp/x"])
def test_invalid_f(bad):
    with pytest.raises(InvalidArgumentError):
        ckptstore.save({"a": 1}, bad)
    with pytest.raises(InvalidArgumentError):
        ckptstore.load(bad)


def test_storage_options_on_local_path_is_invalid(tmp_path):
    with pytest.raises(InvalidArgumentError) as info:
        ckptstore.save({"a": 1}, tmp_path / "x", storage_options={"anon": True})
    assert "storage_options" in str(info.value)
    assert directory_entries(tmp_path) == []


@pytest.mark.parametrize("bad", [5, object(), lambda storage, loc: "not a storage"])
def test_invalid_map_location(bad, saved):
    path, _, _ = saved
    with pytest.raises(InvalidArgumentError) as info:
        ckptstore.load(path, map_location=bad)
    assert "map_location" in str(info.value)


def test_reference_cycle_is_refused(tmp_path):
    a: list = [1]
    a.append({"back": a})
    with pytest.raises(UnsupportedObjectError) as info:
        ckptstore.save(a, tmp_path / "c.ckpt")
    assert "obj[1]['back']" in str(info.value)
    assert "itself" in str(info.value)
    assert directory_entries(tmp_path) == []


def test_sparse_and_meta_tensors_are_refused_by_name(tmp_path):
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(UnsupportedObjectError) as info:
        ckptstore.save({"s": sparse}, tmp_path / "c.ckpt")
    assert "obj['s']" in str(info.value) and "sparse" in str(info.value) and "allow_pickle" in str(info.value)
    with pytest.raises(UnsupportedObjectError) as info:
        ckptstore.save({"m": [torch.empty(3, device="meta")]}, tmp_path / "c.ckpt")
    assert "obj['m'][0]" in str(info.value) and "meta" in str(info.value)
    assert directory_entries(tmp_path) == []

    ckptstore.save({"s": sparse}, tmp_path / "c.ckpt", allow_pickle=True)
    loaded = ckptstore.load(tmp_path / "c.ckpt", weights_only=False)
    assert torch.equal(loaded["s"].to_dense(), torch.eye(3))


# --------------------------------------------------------------------------------------------
# Destinations that cannot be written
# --------------------------------------------------------------------------------------------


def test_missing_destination_directory(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "c.ckpt"
    with pytest.raises(StorageError) as info:
        ckptstore.save({"a": torch.ones(2)}, path)
    err = info.value
    assert isinstance(err, OSError)
    assert err.errno == errno.ENOENT
    assert str(path) in str(err) and "does not exist" in str(err)
    assert directory_entries(tmp_path) == []


def test_directory_as_path(tmp_path):
    directory = tmp_path / "ckpts"
    directory.mkdir()
    with pytest.raises(StorageError) as info:
        ckptstore.save({"a": torch.ones(2)}, directory)
    assert info.value.errno == errno.EISDIR
    assert str(directory) in str(info.value) and "directory" in str(info.value)
    assert directory_entries(tmp_path) == ["ckpts"]
    assert directory_entries(directory) == []

    with pytest.raises(CheckpointNotFoundError) as info:
        ckptstore.load(directory)
    assert str(directory) in str(info.value) and "directory" in str(info.value)


# The two scenarios below need a small (or read-only) filesystem. They run in this process when
# the tests may mount (root, as in CI); otherwise in a child process inside a user+mount
# namespace (`unshare -rm`), where an unprivileged user may mount a tmpfs of its own.


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def scenario_disk_full(directory: str) -> None:
    path = os.path.join(directory, "model.ckpt")
    old = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    ckptstore.save(old, path)
    before = _read(path)

    too_big = {"w": torch.randn(512 * 1024), "step": 2}  # 2 MiB on a 1 MiB filesystem
    with pytest.raises(StorageError) as info:
        ckptstore.save(too_big, path)
    err = info.value
    assert err.errno == errno.ENOSPC, err.errno
    msg = str(err)
    assert path in msg and "no space left" in msg and "untouched" in msg, msg
    assert sorted(os.listdir(directory)) == ["model.ckpt"], os.listdir(directory)
    assert _read(path) == before
    assert_same(ckptstore.load(path), old)


def scenario_read_only(directory: str) -> None:
    path = os.path.join(directory, "model.ckpt")
    old = {"w": torch.arange(10, dtype=torch.float32)}
    ckptstore.save(old, path)
    before = _read(path)
    _mount("-o", "remount,ro", directory)  # chmod would not stop root

    with pytest.raises(StorageError) as info:
        ckptstore.save({"w": torch.zeros(10)}, path)
    err = info.value
    assert err.errno == errno.EROFS, err.errno
    assert path in str(err) and "read-only" in str(err), str(err)
    assert sorted(os.listdir(directory)) == ["model.ckpt"]
    assert _read(path) == before
    assert_same(ckptstore.load(path), old)


_PERMISSION_WORDS = ("permission denied", "operation not permitted", "only root", "must be superuser")


def run_on_small_tmpfs(scenario, tmp_path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if result.returncode == 0:
        try:
            scenario(str(mnt))
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
        return
    if not any(w in result.stderr.lower() for w in _PERMISSION_WORDS) and os.geteuid() == 0:
        pytest.fail(f"mounting a tmpfs failed: {result.stderr}")
    run_in_user_namespace(scenario, str(mnt))


def run_in_user_namespace(scenario, mnt: str) -> None:
    code = (
        f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_errors; test_errors.{scenario.__name__}({mnt!r})"
    )
    cmd = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3"',
        "sh",
        mnt,
        sys.executable,
        code,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (
        f"scenario {scenario.__name__} failed in a user namespace:\n{result.stdout}{result.stderr}"
    )


def test_full_destination_keeps_the_previous_checkpoint(tmp_path):
    run_on_small_tmpfs(scenario_disk_full, tmp_path)


def test_read_only_destination_keeps_the_previous_checkpoint(tmp_path):
    run_on_small_tmpfs(scenario_read_only, tmp_path)
