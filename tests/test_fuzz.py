"""Property-based fuzzing of the manifest parser, the tagged-JSON tree and the single-file container.

The property everywhere: whatever the bytes, the outcome is a correct load or a
:class:`ckptstore.CheckpointError` (a subclass of it); never another exception type, never a hang
(each example runs under an alarm), never a huge allocation (the whole run is under an
address-space limit a little above what the process uses when it starts, so an attempt to
allocate what a crafted size claims fails with MemoryError/RuntimeError, which fails the test).

The default run is bounded (derandomized, a few hundred examples per property); ``-m slow`` runs
the same properties with many more random examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import xxhash
from conftest import assert_same, container_layout
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore import CheckpointError
from ckptstore.format import container
from ckptstore.format.manifest import Manifest, parse_manifest

FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=5000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PER_EXAMPLE_S = 120  # a hang, not a slow machine: examples take milliseconds (seconds on a loaded one)


def _sample() -> dict[str, Any]:
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "z": torch.zeros(3000, dtype=torch.int16),
        "t": (1, "two", 3.5, None, True),
        "nested": {"x": torch.tensor([1, -2], dtype=torch.int64), "b": b"\x00\xff", "f": float("nan")},
    }


def _container(compression: str | None = None) -> bytes:
    buf = io.BytesIO()
    ckptstore.save(_sample(), buf, compression=compression)
    return buf.getvalue()


CONTAINERS = {c: _container(c) for c in (None, "zstd", "shuffle+zstd")}


def _torch_file(zip_format: bool) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(24, dtype=torch.float32), "n": 3}, buf, _use_new_zipfile_serialization=zip_format)
    return buf.getvalue()


TORCH_FILES = {"zip": _torch_file(True), "legacy": _torch_file(False)}
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
MANIFEST = container_layout(CONTAINERS[None])["manifest"]
MANIFEST_BYTES = json.dumps(MANIFEST).encode()


# ------------------------------------------------------------------------------------ guards


@contextlib.contextmanager
def bounded(extra_bytes: int = 1 << 30) -> Iterator[None]:
    """Cap the address space at what is mapped now plus ``extra_bytes``, for the block's duration."""
    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    old = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra_bytes
    if old[1] != resource.RLIM_INFINITY:
        limit = min(limit, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


class Hang(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise Hang(f"one example ran over {PER_EXAMPLE_S} s")


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or ("refused", error); anything else propagates and fails the test."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_EXAMPLE_S)
    try:
        value = call()
        _event("loaded")
        return "ok", value
    except CheckpointError as exc:
        assert str(exc), "an error without a message"
        _event(f"refused: {type(exc).__name__}")
        return "refused", exc
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _event(what: str) -> None:
    # The outcome mix shows in --hypothesis-show-statistics (both outcomes must occur).
    if currently_in_test_context():
        event(what)


@pytest.fixture(autouse=True)
def _address_space_limit():
    with bounded():
        yield


# ------------------------------------------------------------------------------------ strategies

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from([0, -1, 1 << 60, (1 << 60) + 1, 1 << 64, 4096, "raw", "zstd", "float32", "../x", "/etc/passwd",
                     "data/rank-00000.bin", "xxh3_64:0000000000000000", "$tensor", "$view", "$pickle", "2.0", "1.1"]),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, prefix + (i,)))
    return out


MANIFEST_PATHS = _paths(MANIFEST)


@st.composite
def mutated_manifests(draw: Any) -> bytes:
    """A valid manifest with 1-3 of its values (anywhere: top level, entries, chunks, tree) replaced,
    deleted, or given an extra member; then re-serialized."""
    doc = json.loads(MANIFEST_BYTES)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(MANIFEST_PATHS[1:]))
        parent: Any = doc
        try:
            for p in path[:-1]:
                parent = parent[p]
            action = draw(st.sampled_from(["replace", "delete", "add"]))
            if action == "replace":
                parent[path[-1]] = draw(json_values)
            elif action == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(max_size=8))] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or retyped this path
    return json.dumps(doc).encode()


def _with_manifest(data: bytes, body: bytes) -> bytes:
    lay = container_layout(data)
    out = data[: lay["manifest_offset"]] + body + container.pack_footer(lay["manifest_offset"], body)
    return container.pack_header(len(out)) + out[container.HEADER.size :]


@st.composite
def damaged_containers(draw: Any) -> tuple[bytes, bytes]:
    """(original, damaged): byte flips, overwritten ranges, truncation, garbage appended or inserted."""
    original = CONTAINERS[draw(st.sampled_from(list(CONTAINERS)))]
    if draw(st.integers(0, 9)) == 0:
        # Now and then a torch.save file, or a container whose magic says it is one: ckptstore.load
        # hands those to torch.load, whose failures must come back as ckptstore errors too.
        original = draw(st.sampled_from([TORCH_FILES["zip"], TORCH_FILES["legacy"]]))
        if draw(st.booleans()):
            original = draw(st.sampled_from([b"PK\x03\x04", LEGACY_MAGIC])) + CONTAINERS[None][8:]
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "append", "insert", "footer", "header"]))
        n = len(data)
        if kind == "flip" and n:
            i = draw(st.integers(0, n - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif kind == "overwrite" and n:
            i = draw(st.integers(0, n - 1))
            chunk = draw(st.binary(min_size=1, max_size=64))
            data[i : i + len(chunk)] = chunk
        elif kind == "truncate":
            del data[draw(st.integers(0, n)) :]
        elif kind == "append":
            data += draw(st.binary(max_size=256))
        elif kind == "insert":
            i = draw(st.integers(0, n))
            data[i:i] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "footer" and n >= 32:
            # A footer of chosen numbers: the interesting values are near the real ones and huge.
            near = st.integers(0, n + 8192) | st.sampled_from([0, 1 << 63, (1 << 64) - 1, n - 32, max(0, n - 4096)])
            offset, length = draw(near), draw(near)
            digest = draw(st.integers(0, (1 << 64) - 1))
            data[n - 32 :] = struct.pack("<QQQ8s", offset, length, digest, container.FOOTER_MAGIC)
        elif kind == "header" and n >= 32:
            length = draw(st.integers(0, n + 100) | st.sampled_from([(1 << 64) - 1, 1 << 50]))
            major = draw(st.integers(0, 3))
            data[:32] = struct.pack("<8sHHIQQ", container.MAGIC, major, draw(st.integers(0, 5)), 0, length, 0)
    return original, bytes(data)


# ------------------------------------------------------------------------------------ properties


def _parse_bytes(data: bytes) -> None:
    kind, value = outcome(lambda: parse_manifest(data, where="<fuzz>"))
    assert kind == "refused" or isinstance(value, Manifest)


def _parse_mutated(body: bytes) -> None:
    kind, value = outcome(lambda: parse_manifest(body, where="<fuzz>"))
    assert kind == "refused" or isinstance(value, Manifest)
    # Through the whole single-file load as well: the tree decoder and the materializer.
    outcome(lambda: ckptstore.load(io.BytesIO(_with_manifest(CONTAINERS[None], body))))


def _load_damaged(pair: tuple[bytes, bytes]) -> None:
    original, damaged = pair
    kind, value = outcome(lambda: ckptstore.load(io.BytesIO(damaged)))
    if kind == "ok" and original.startswith(container.MAGIC) and damaged.startswith(container.MAGIC):
        # Damage only in bytes no reader depends on (padding, reserved fields): the same object.
        # (torch.save files carry no checksums: what torch.load makes of damaged ones is its own.)
        assert_same(value, ckptstore.load(io.BytesIO(original)))


@FAST
@given(st.binary(max_size=2048) | st.builds(lambda b: MANIFEST_BYTES[: len(b)], st.binary(max_size=len(MANIFEST_BYTES))))
def test_manifest_parser_on_garbage_and_prefixes(data):
    _parse_bytes(data)


@FAST
@given(mutated_manifests())
def test_manifest_parser_and_loader_on_mutated_manifests(body):
    _parse_mutated(body)


# torch.load warns about the pickle protocol of some damaged legacy files: its warning, not an error.
TORCH_PROTOCOL_WARNING = "ignore:Detected pickle protocol:UserWarning"


@pytest.mark.filterwarnings(TORCH_PROTOCOL_WARNING)
@FAST
@given(damaged_containers())
def test_single_file_container_damaged(pair):
    _load_damaged(pair)


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "ck"
    ckptstore.save_sharded({**_sample(), "rng": ckptstore.PerRank({"seed": 1})}, str(root))
    return root


def _load_sharded_with(root: Any, body: bytes, scratch: Any) -> None:
    if os.path.exists(scratch):
        shutil.rmtree(scratch)
    shutil.copytree(root, scratch)
    (scratch / "manifest.json").write_bytes(body)
    outcome(lambda: ckptstore.load_sharded({"w": None, "z": None, "nested": None, "t": None}, str(scratch), strict=False))
    outcome(lambda: ckptstore.load_sharded({"w": torch.zeros(4, 6), "z": torch.zeros(3000, dtype=torch.int16)},
                                           str(scratch), strict=False))


def _sharded_mutation(root: Any) -> Any:
    doc = json.loads((root / "manifest.json").read_bytes())
    paths = _paths(doc)[1:]

    @st.composite
    def mutated(draw: Any) -> bytes:
        d = json.loads(json.dumps(doc))
        for _ in range(draw(st.integers(1, 3))):
            path = draw(st.sampled_from(paths))
            parent: Any = d
            try:
                for p in path[:-1]:
                    parent = parent[p]
                parent[path[-1]] = draw(json_values)
            except (KeyError, IndexError, TypeError):
                continue
        return json.dumps(d).encode()

    return mutated()


def test_sharded_loader_on_mutated_manifests(sharded_root, tmp_path):
    @FAST
    @given(_sharded_mutation(sharded_root))
    def run(body):
        _load_sharded_with(sharded_root, body, tmp_path / "scratch")

    run()


def test_damaged_footer_and_header_are_refused_not_guessed():
    """A few deterministic spot checks of the property, so a regression names its input."""
    data = CONTAINERS[None]
    n = len(data)
    for offset, length in [(0, n - 32), (4096, 1 << 62), ((1 << 64) - 1, 33), (n, 0), (4096, n - 32 - 4096 + 1)]:
        damaged = data[:-32] + struct.pack("<QQQ8s", offset, length, 0, container.FOOTER_MAGIC)
        kind, _ = outcome(lambda d=damaged: ckptstore.load(io.BytesIO(d)))
        assert kind == "refused"
    body = b'{"format":"ckptstore","format_version":"1.1","kind":"file","tensors":{},"tree":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    kind, err = outcome(lambda: ckptstore.load(io.BytesIO(_with_manifest(data, body))))
    assert kind == "refused" and "not valid JSON" in str(err)
    assert xxhash.xxh3_64_intdigest(body)  # the footer checksum matched: the refusal is the parser's


@pytest.mark.slow
@SLOW
@given(mutated_manifests())
def test_slow_manifest_parser_and_loader_on_mutated_manifests(body):
    _parse_mutated(body)


@pytest.mark.slow
@pytest.mark.filterwarnings(TORCH_PROTOCOL_WARNING)
@SLOW
@given(damaged_containers())
def test_slow_single_file_container_damaged(pair):
    _load_damaged(pair)


@pytest.mark.slow
@SLOW
@given(st.binary(max_size=8192))
def test_slow_manifest_parser_on_garbage(data):
    _parse_bytes(data)


@pytest.mark.slow
def test_slow_sharded_loader_on_mutated_manifests(sharded_root, tmp_path):
    @SLOW
    @given(_sharded_mutation(sharded_root))
    def run(body):
        _load_sharded_with(sharded_root, body, tmp_path / "scratch")

    run()
