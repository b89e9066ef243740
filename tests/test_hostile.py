"""Hostile and bad input: every load path refuses it before any write and before any large
allocation, with a ckptstore error that says what, where and what to do.

The cases are data (``CASES``): each builds a damaged or crafted checkpoint and returns the call
that must refuse it. ``test_refused`` runs each in this process and checks the error and that the
checkpoint's files are untouched; ``test_refused_under_a_memory_limit`` runs all of them again in
a child process whose address space is capped a little above what it uses after start-up, so any
attempt to allocate what a crafted size claims fails the test (claims are 4 GiB to petabytes).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import container_layout, rewrite_manifest
from v1_writer import downgrade

import ckptstore
from ckptstore import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
    UnsupportedFormatVersionError,
)
from ckptstore.cli import main as cli_main
from ckptstore.format import container

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
HUGE = 1 << 50  # a petabyte: no machine can allocate it, so an attempt would fail with MemoryError/RuntimeError
MARKER_ENV = "CKPTSTORE_TEST_PWNED"
BEYOND = 1 << 24  # an offset past every other chunk of the small test files (no byte-range overlap)


class Evil:
    """Unpickling this runs code: it creates the file named by $CKPTSTORE_TEST_PWNED."""

    def __reduce__(self):
        return (open, (os.environ.get(MARKER_ENV, "/nonexistent/pwned"), "w"))


def _state() -> dict[str, Any]:
    return {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(4, 8, dtype=torch.float64), "step": 3}


# ------------------------------------------------------------------------------------ builders


def _single(tmp: str) -> str:
    path = os.path.join(tmp, "model.ckpt")
    ckptstore.save(_state(), path)
    return path


def _edit_single(tmp: str, edit: Callable[[dict], Any]) -> str:
    path = _single(tmp)
    with open(path, "rb") as fh:
        data = fh.read()

    def apply(doc: dict) -> dict:
        out = edit(doc)
        return out if isinstance(out, dict) else doc

    with open(path, "wb") as fh:
        fh.write(rewrite_manifest(data, apply))
    return path


def _replace_single_manifest(tmp: str, body: bytes) -> str:
    """The container with its manifest bytes replaced by ``body`` (footer and header kept consistent)."""
    path = _single(tmp)
    with open(path, "rb") as fh:
        data = fh.read()
    lay = container_layout(data)
    out = data[: lay["manifest_offset"]] + body + container.pack_footer(lay["manifest_offset"], body)
    with open(path, "wb") as fh:
        fh.write(container.pack_header(len(out)) + out[container.HEADER.size :])
    return path


def _sharded(tmp: str) -> str:
    root = os.path.join(tmp, "ck")
    ckptstore.save_sharded({**_state(), "rng": ckptstore.PerRank({"seed": 5})}, root)
    # A 1.x manifest listing every chunk, without an index, as save_sharded wrote before format 2.0
    # and indexes: these cases test the refusals of that manifest (the index's and format 2.0's own
    # are tested below); old checkpoints must keep being read, and refused, as they were.
    downgrade(pathlib.Path(root), index=False)
    return root


def _sharded2(tmp: str) -> str:
    root = os.path.join(tmp, "ck")
    ckptstore.save_sharded({**_state(), "rng": ckptstore.PerRank({"seed": 5})}, root)
    return root


def _edit_sharded2(tmp: str, edit: Callable[[dict], Any]) -> str:
    """A format 2.0 checkpoint whose rank-0 part file was forged by ``edit`` and whose manifest was
    made to agree with it (the part's size and checksum and the manifest's own checksum
    recomputed): the damage is not caught by a checksum, so every other refusal must hold.
    ``edit`` sees the same shape of document as a 1.x manifest's (``tensors.<key>.chunks``), the
    chunks being the part file's and the rest the manifest's."""
    from ckptstore.format.checksum import checksum

    root = _sharded2(tmp)
    path = os.path.join(root, "manifest.json")
    with open(path, "rb") as fh:
        doc = json.loads(fh.read())
    assert doc["format_version"] == "2.0"
    part_rel = doc["parts"][0][0]
    part_path = os.path.join(root, part_rel)
    with open(part_path, "rb") as fh:
        part = json.loads(fh.read())
    inline = {key for key, entry in doc["tensors"].items() if "chunks" in entry}
    for key, entry in doc["tensors"].items():
        entry["chunks"] = part["chunks"].setdefault(key, [])
    edit(doc)
    for key, entry in doc["tensors"].items():
        # Where the manifest lists a tensor's chunks too (one rank wrote it whole), the forger
        # changes both copies alike.
        part["chunks"][key] = entry["chunks"] if key in inline else entry.pop("chunks")
    part["chunks"] = {k: v for k, v in part["chunks"].items() if v}
    body = json.dumps(part, separators=(",", ":")).encode()
    with open(part_path, "wb") as fh:
        fh.write(body)
    doc["parts"][0] = [part_rel, len(body), checksum(body)]
    doc.pop("checksum")
    _write_parted(path, doc)
    return root


def _write_parted(path: str, doc: dict) -> None:
    """A format 2.0 manifest ``doc`` with its own checksum (required there) recomputed: a forgery."""
    from ckptstore.format.checksum import checksum

    body = json.dumps(doc, separators=(",", ":")).encode()
    with open(path, "wb") as fh:
        fh.write(body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}')


def _edit_sharded(tmp: str, edit: Callable[[dict], Any]) -> str:
    root = _sharded(tmp)
    path = os.path.join(root, "manifest.json")
    with open(path, "rb") as fh:
        doc = json.loads(fh.read())
    edit(doc)
    # A hostile manifest leaves out the optional checksum member (format.md 10.3): what is tested
    # here is every other refusal, which must hold without it.
    doc.pop("checksum", None)
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return root


def _chunk(doc: dict, key: str = "a") -> dict:
    return doc["tensors"][key]["chunks"][0]


def _load_single(path: str) -> Callable[[], Any]:
    return lambda: ckptstore.load(path)


def _load_sharded_fresh(root: str) -> Callable[[], Any]:
    # Into a state with empty slots: the load allocates every tensor, sized by the manifest.
    return lambda: ckptstore.load_sharded({"a": None, "b": None, "step": None}, root, strict=False)


def _load_sharded_into(root: str) -> Callable[[], Any]:
    return lambda: ckptstore.load_sharded({"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64)}, root,
                                          strict=False)


def _sparse(path: str, size: int, tail: bytes = b"") -> None:
    """A file of ``size`` bytes that costs no disk: a hole, then ``tail``."""
    with open(path, "wb") as fh:
        fh.truncate(size - len(tail))
        fh.seek(size - len(tail))
        fh.write(tail)


def _pickle_bytes() -> bytes:
    return pickle.dumps(Evil(), protocol=4)


# ------------------------------------------------------------------------------------ the cases


@dataclass
class Case:
    name: str
    kind: str  # the kind of bad input (the report's table groups by it)
    build: Callable[[str], Callable[[], Any]]  # tmp dir -> the call that must be refused
    error: type[BaseException]
    words: tuple[str, ...]  # all must appear in the message


def _single_huge_manifest(tmp: str) -> Callable[[], Any]:
    # A 2 GiB sparse file whose footer claims a 2 GiB manifest: over the cap, refused unread.
    path = os.path.join(tmp, "big.ckpt")
    size = 2 << 30
    footer = struct.pack("<QQQ8s", container.DATA_START, size - container.DATA_START - 32, 0, container.FOOTER_MAGIC)
    _sparse(path, size, footer)
    with open(path, "r+b") as fh:
        fh.write(container.pack_header(size))
    return _load_single(path)


def _sharded_huge_manifest(tmp: str) -> Callable[[], Any]:
    root = _sharded(tmp)
    _sparse(os.path.join(root, "manifest.json"), 2 << 30, b"}")
    return _load_sharded_fresh(root)


def _safetensors_huge_header(tmp: str) -> Callable[[], Any]:
    from ckptstore.convert import convert

    src = os.path.join(tmp, "model.safetensors")
    with open(src, "wb") as fh:
        fh.write(struct.pack("<Q", 1 << 62) + b'{"__metadata__":{}}')
    return lambda: convert(src, os.path.join(tmp, "out.ckpt"), "ckptstore")


def _fifo_data(tmp: str) -> Callable[[], Any]:
    # A FIFO where a data file belongs: opening it for reading would block until a writer came.
    root = _sharded(tmp)
    data = os.path.join(root, "data", "rank-00000.bin")
    os.unlink(data)
    os.mkfifo(data)
    return _load_sharded_into(root)


def _symlinked_data(tmp: str, sharded: Callable[[str], str] = _sharded) -> Callable[[], Any]:
    root = sharded(tmp)
    data = os.path.join(root, "data", "rank-00000.bin")
    outside = os.path.join(tmp, "outside.bin")
    os.replace(data, outside)  # the very bytes, so only the link's target is wrong
    os.symlink(outside, data)
    return _load_sharded_into(root)


def _symlinked_manifest(tmp: str) -> Callable[[], Any]:
    root = _sharded(tmp)
    path = os.path.join(root, "manifest.json")
    outside = os.path.join(tmp, "outside.json")
    os.replace(path, outside)
    os.symlink(outside, path)
    return _load_sharded_into(root)


def _duplicate_json(tmp: str, sharded: bool) -> Callable[[], Any]:
    if sharded:
        root = _sharded(tmp)
        path = os.path.join(root, "manifest.json")
        with open(path, "rb") as fh:
            text = fh.read().decode()
    else:
        path = _single(tmp)
        with open(path, "rb") as fh:
            data = fh.read()
        lay = container_layout(data)
        text = data[lay["manifest_offset"] : lay["manifest_offset"] + lay["manifest_length"]].decode()
    # A second "a" ahead of the honest one, of another dtype: a reader keeping the first member
    # sees another tensor than one keeping the last (as Python's json does).
    other = json.loads(text)["tensors"]["a"]
    other["dtype"] = "int32"
    text = re.sub(r'"tensors":\s*\{', '"tensors":{"a":' + json.dumps(other) + ",", text, count=1)
    text = re.sub(r',"checksum":"xxh3_64:[0-9a-f]{16}"\}$', "}", text)  # hostile files omit the optional member
    if sharded:
        with open(path, "w") as fh:
            fh.write(text)
        return _load_sharded_fresh(root)
    return _load_single(_replace_single_manifest(tmp, text.encode()))


def _sharded_pickle_manifest(tmp: str) -> Callable[[], Any]:
    root = _sharded(tmp)
    with open(os.path.join(root, "manifest.json"), "wb") as fh:
        fh.write(_pickle_bytes())
    return _load_sharded_fresh(root)


def _sharded_pickle_shard(tmp: str) -> Callable[[], Any]:
    root = _sharded(tmp)
    path = os.path.join(root, "data", "rank-00000.bin")
    size = os.path.getsize(path)
    payload = _pickle_bytes()
    with open(path, "wb") as fh:
        fh.write(payload + bytes(size - len(payload)))
    return _load_sharded_into(root)


def _sharded_pickle_node(tmp: str) -> Callable[[], Any]:
    root = _edit_sharded(tmp, lambda d: d["tree"].update(a={"$pickle": "a"}))
    return _load_sharded_fresh(root)


def _single_pickle_file(tmp: str, how: str) -> Callable[[], Any]:
    path = os.path.join(tmp, "model.ckpt")
    if how == "plain":
        with open(path, "wb") as fh:
            fh.write(_pickle_bytes())
    else:
        torch.save({"w": torch.ones(2), "x": Evil()}, path, _use_new_zipfile_serialization=how == "zip")
    return _load_single(path)


def _sharded_absurd(tmp: str, codec: str, edit_sharded: Callable[..., str] = _edit_sharded) -> Callable[[], Any]:
    def edit(d: dict) -> None:
        e = d["tensors"]["a"]
        e["shape"] = [HUGE // 4]
        c = e["chunks"][0]
        c.update(sizes=[HUGE // 4], block_size=None, block_checksums=None, offset=BEYOND)
        if codec == "raw":
            c["length"] = HUGE
        else:
            c["codec"] = "zstd"

    return _load_sharded_fresh(edit_sharded(tmp, edit))


def _sharded_offset_past_end(tmp: str, fresh: bool, edit_sharded: Callable[..., str] = _edit_sharded) -> Callable[[], Any]:
    root = edit_sharded(tmp, lambda d: _chunk(d).update(offset=HUGE))
    return _load_sharded_fresh(root) if fresh else _load_sharded_into(root)


def _sharded_moderate_claim(tmp: str, edit_sharded: Callable[..., str] = _edit_sharded) -> Callable[[], Any]:
    # 4 GiB claimed by a raw chunk in a data file of a few KiB: allocatable on many machines, so
    # only the extent check (before the allocation) stops it; the memory-limited run proves it.
    def edit(d: dict) -> None:
        e = d["tensors"]["a"]
        e["shape"] = [1 << 30]
        e["chunks"][0].update(sizes=[1 << 30], length=4 << 30, block_size=None, block_checksums=None, offset=BEYOND)

    return _load_sharded_fresh(edit_sharded(tmp, edit))


def _single_moderate_zstd(tmp: str) -> Callable[[], Any]:
    def edit(d: dict) -> None:
        e = d["tensors"]["a"]
        e["shape"] = [1 << 30]
        e["chunks"][0].update(sizes=[1 << 30], codec="zstd")  # 4 GiB from 4000 stored bytes

    return _load_single(_edit_single(tmp, edit))


def _overlapping_bytes(tmp: str, sharded: bool, edit_sharded: Callable[..., str] = _edit_sharded) -> Callable[[], Any]:
    def edit(d: dict) -> None:
        # "b" claims the first 256 bytes of "a"'s bytes (its own length, so every other rule holds).
        _chunk(d, "b")["offset"] = _chunk(d, "a")["offset"]
        if sharded:
            _chunk(d, "b")["file"] = _chunk(d, "a")["file"]

    if sharded:
        return _load_sharded_fresh(edit_sharded(tmp, edit))
    return _load_single(_edit_single(tmp, edit))


def _overlapping_boxes(tmp: str) -> Callable[[], Any]:
    def edit(d: dict) -> None:
        c = _chunk(d)
        d["tensors"]["a"]["chunks"] = [dict(c, sizes=[500], length=2000), dict(c, offsets=[400], sizes=[500], length=2000)]

    return _load_single(_edit_single(tmp, edit))


def _deep_tree(tmp: str, depth: int) -> Callable[[], Any]:
    path = _single(tmp)
    with open(path, "rb") as fh:
        data = fh.read()
    lay = container_layout(data)
    doc = lay["manifest"]
    doc["tree"]["a"] = "DEEP"
    text = json.dumps(doc).replace('"DEEP"', "[" * depth + "1" + "]" * depth)  # json.dumps itself would recurse
    return _load_single(_replace_single_manifest(tmp, text.encode()))


def _store_restore(tmp: str, tamper: Callable[[str, str, str], None], empty: bool = False) -> Callable[[], Any]:
    """A store whose step 1 is in RAM and local, then ``tamper(job, ram_dir, local)``; returns restore."""
    import uuid

    job = f"hostile-{uuid.uuid4().hex[:10]}"
    ram_dir = os.path.join(tmp, "shm")
    os.mkdir(ram_dir)
    local = os.path.join(tmp, "local")
    with ckptstore.CheckpointStore(job, local=local, ram_dir=ram_dir) as store:
        store.save(1, _state()).wait("local")
    tamper(job, ram_dir, local)

    def restore() -> Any:
        # Empty slots make the restore allocate each tensor at the size its manifest claims.
        state = {"a": None, "b": None, "step": 0} if empty else {
            "a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64), "step": 0}
        with ckptstore.CheckpointStore(job, local=local, ram_dir=ram_dir) as store:
            return store.restore(state)

    return restore


def _ram_docs(ram_dir: str) -> list[str]:
    return sorted(os.path.join(ram_dir, n) for n in os.listdir(ram_dir) if n.endswith(".json"))


def _tamper_everywhere(edit: Callable[[dict], None]) -> Callable[[str, str, str], None]:
    """Apply ``edit`` to the step's manifest in every copy (RAM documents and the local tier)."""

    def tamper(job: str, ram_dir: str, local: str) -> None:
        for path in _ram_docs(ram_dir):
            with open(path) as fh:
                doc = json.load(fh)
            manifest = json.loads(doc["extra"]["manifest"])
            edit(manifest)
            manifest.pop("checksum", None)  # a hostile manifest omits the optional member
            doc["extra"]["manifest"] = json.dumps(manifest)
            with open(path, "w") as fh:
                json.dump(doc, fh)
        step = os.path.join(local, "step-000000000001")
        path = os.path.join(step, "manifest.json")
        with open(path) as fh:
            manifest = json.load(fh)
        if manifest["format_version"].startswith("2."):
            # Format 2.0 (the local tier's since session 9): a restore reads each rank's chunk
            # table and header from its node part, and the manifest must carry its checksum,
            # which a hostile writer computes like anyone: every copy is edited and resealed.
            _tamper_node_parts(step, edit)
            manifest.pop("checksum")
            edit(manifest)
            body = json.dumps(manifest, separators=(",", ":")).encode()
            from ckptstore.format.checksum import checksum

            with open(path, "wb") as fh:
                fh.write(body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}')
            return
        edit(manifest)
        manifest.pop("checksum", None)
        with open(path, "w") as fh:
            json.dump(manifest, fh)

    return tamper


def _tamper_node_parts(step: str, edit: Callable[[dict], None]) -> None:
    """Apply ``edit`` (written for a manifest that lists chunks) to each node part of ``step``,
    through a manifest-shaped view of the part's chunks and its header's tensor table."""
    where = os.path.join(step, "node-parts")
    for name in os.listdir(where):
        with open(os.path.join(where, name)) as fh:
            doc = json.load(fh)
        part, header = doc["part"], doc["header"]
        view = {"tensors": {k: {"dtype": v[0], "shape": list(v[1]), "chunks": part["chunks"].get(k, [])}
                            for k, v in header["tensors"].items()}}
        edit(view)
        for k, e in view["tensors"].items():
            header["tensors"][k] = [e["dtype"], e["shape"]]
            if k in part["chunks"]:
                part["chunks"][k] = e["chunks"]
        with open(os.path.join(where, name), "w") as fh:
            json.dump(doc, fh)


def _symlink_local_data(job: str, ram_dir: str, local: str) -> None:
    for path in _ram_docs(ram_dir):
        os.unlink(path)  # no RAM copy: the local tier is the only one
    data = os.path.join(local, "step-000000000001", "data", "rank-00000.bin")
    outside = os.path.join(os.path.dirname(local), "outside.bin")
    os.replace(data, outside)
    os.symlink(outside, data)


CASES = [
    # --- names that try to escape the root
    Case("sharded-chunk-file-dotdot", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded(t, lambda d: _chunk(d).update(file="../outside.bin"))), CorruptCheckpointError,
        ("../outside.bin", "not a safe relative path")),
    Case("sharded-chunk-file-nested-dotdot", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded(t, lambda d: _chunk(d).update(file="data/../../x.bin"))), CorruptCheckpointError,
        ("not a safe relative path",)),
    Case("sharded-chunk-file-absolute", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded(t, lambda d: _chunk(d).update(file="/etc/passwd"))), CorruptCheckpointError,
        ("/etc/passwd", "not a safe relative path")),
    Case("sharded-chunk-file-nul", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded(t, lambda d: _chunk(d).update(file="data/rank-00000.bin\x00.txt"))), CorruptCheckpointError,
        ("not a safe relative path",)),
    Case("sharded-chunk-file-backslash", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded(t, lambda d: _chunk(d).update(file="..\\..\\x.bin"))), CorruptCheckpointError,
        ("not a safe relative path",)),
    Case("single-chunk-names-outside-file", "escape the root", lambda t: _load_single(
        _edit_single(t, lambda d: _chunk(d).update(file="../outside.bin"))), CorruptCheckpointError,
        ("not a safe relative path",)),
    Case("single-chunk-names-a-file", "escape the root", lambda t: _load_single(
        _edit_single(t, lambda d: _chunk(d).update(file="data/rank-00000.bin"))), CorruptCheckpointError,
        ("outside the data region",)),
    Case("sharded-data-symlink-outside", "escape the root", _symlinked_data, CorruptCheckpointError,
         ("outside the checkpoint directory", "symbolic link")),
    Case("sharded-manifest-symlink-outside", "escape the root", _symlinked_manifest, CorruptCheckpointError,
         ("outside the checkpoint directory",)),
    Case("path-with-nul", "escape the root", lambda t: (lambda: ckptstore.load(os.path.join(t, "a\x00b"))),
         InvalidArgumentError, ("NUL",)),
    Case("restore-local-data-symlink-outside", "escape the root", lambda t: _store_restore(t, _symlink_local_data),
         CorruptCheckpointError, ("rank-00000.bin",)),
    Case("sharded-data-is-a-fifo", "escape the root", lambda t: _fifo_data(t), NotACheckpointError,
         ("not a regular file",)),
    Case("single-path-is-a-fifo", "escape the root", lambda t: (os.mkfifo(os.path.join(t, "m.ckpt")),
         _load_single(os.path.join(t, "m.ckpt")))[1], NotACheckpointError, ("not a regular file",)),
    Case("single-path-is-a-device", "escape the root", lambda t: _load_single("/dev/zero"), NotACheckpointError,
         ("not a regular file",)),
    # --- offsets
    Case("single-negative-offset", "bad offsets", lambda t: _load_single(
        _edit_single(t, lambda d: _chunk(d).update(offset=-4096))), CorruptCheckpointError, ("offset",)),
    Case("sharded-negative-offset", "bad offsets", lambda t: _load_sharded_fresh(
        _edit_sharded(t, lambda d: _chunk(d).update(offset=-1))), CorruptCheckpointError, ("offset",)),
    Case("single-offset-past-end", "bad offsets", lambda t: _load_single(
        _edit_single(t, lambda d: _chunk(d).update(offset=HUGE))), CorruptCheckpointError, ("outside the data region",)),
    Case("sharded-offset-past-end-fresh", "bad offsets", lambda t: _sharded_offset_past_end(t, True),
         CorruptCheckpointError, ("rank-00000.bin is truncated", "'a'")),
    Case("sharded-offset-past-end-into", "bad offsets", lambda t: _sharded_offset_past_end(t, False),
         CorruptCheckpointError, ("rank-00000.bin is truncated", "'a'")),
    Case("single-overlapping-bytes", "bad offsets", lambda t: _overlapping_bytes(t, False), CorruptCheckpointError,
         ("overlapping bytes",)),
    Case("sharded-overlapping-bytes", "bad offsets", lambda t: _overlapping_bytes(t, True), CorruptCheckpointError,
         ("overlapping bytes",)),
    Case("single-overlapping-boxes", "bad offsets", _overlapping_boxes, CorruptCheckpointError, ("overlap",)),
    Case("restore-offset-past-end", "bad offsets", lambda t: _store_restore(
        t, _tamper_everywhere(lambda d: _chunk(d).update(offset=HUGE))), CorruptCheckpointError, ("truncated",)),
    # --- absurd shapes
    Case("single-shape-overflow", "absurd shapes", lambda t: _load_single(_edit_single(
        t, lambda d: d["tensors"]["a"].update(shape=[1 << 40, 1 << 40]))), CorruptCheckpointError, ("absurdly large",)),
    Case("single-shape-huge-raw", "absurd shapes", lambda t: _load_single(_edit_single(t, lambda d: (
        d["tensors"]["a"].update(shape=[HUGE // 4]), _chunk(d).update(sizes=[HUGE // 4], length=HUGE, offset=BEYOND)))),
         CorruptCheckpointError, ("outside the data region",)),
    Case("single-shape-huge-zstd", "absurd shapes", _single_moderate_zstd, CorruptCheckpointError, ("cannot decode",)),
    Case("sharded-shape-huge-raw", "absurd shapes", lambda t: _sharded_absurd(t, "raw"), CorruptCheckpointError,
         ("is truncated",)),
    Case("sharded-shape-huge-zstd", "absurd shapes", lambda t: _sharded_absurd(t, "zstd"), CorruptCheckpointError,
         ("cannot decode",)),
    Case("sharded-4gib-claim", "absurd shapes", _sharded_moderate_claim, CorruptCheckpointError, ("is truncated",)),
    Case("single-negative-dim", "absurd shapes", lambda t: _load_single(_edit_single(
        t, lambda d: d["tensors"]["a"].update(shape=[-1000]))), CorruptCheckpointError, ("non-negative",)),
    Case("single-65-dims", "absurd shapes", lambda t: _load_single(_edit_single(
        t, lambda d: d["tensors"]["a"].update(shape=[1] * 65))), CorruptCheckpointError, ("shape",)),
    Case("restore-shape-huge", "absurd shapes", lambda t: _store_restore(t, _tamper_everywhere(lambda d: (
        d["tensors"]["a"].update(shape=[HUGE // 4]),
        _chunk(d).update(sizes=[HUGE // 4], length=HUGE, block_size=None, block_checksums=None, offset=BEYOND))),
        empty=True),
        CorruptCheckpointError, ("is truncated", "'a'")),
    # --- duplicate keys
    Case("single-duplicate-key", "duplicate keys", lambda t: _duplicate_json(t, False), CorruptCheckpointError,
         ("duplicate member name 'a'",)),
    Case("sharded-duplicate-key", "duplicate keys", lambda t: _duplicate_json(t, True), CorruptCheckpointError,
         ("duplicate member name 'a'",)),
    # --- oversized manifests
    Case("single-2gib-manifest", "oversized manifest", _single_huge_manifest, CorruptCheckpointError,
         ("cap", "CKPTSTORE_MAX_MANIFEST_BYTES")),
    Case("sharded-2gib-manifest", "oversized manifest", _sharded_huge_manifest, CorruptCheckpointError,
         ("manifest.json", "cap")),
    Case("convert-safetensors-header-claims-4eib", "oversized manifest", lambda t: _safetensors_huge_header(t),
         NotACheckpointError, ("not a checkpoint convert can read",)),
    # --- format versions
    Case("single-major-99", "unknown format version", lambda t: _load_single(_edit_single(
        t, lambda d: d.update(format_version="99.0"))), UnsupportedFormatVersionError, ("99.0", "Upgrade ckptstore")),
    Case("sharded-major-3", "unknown format version", lambda t: _load_sharded_fresh(_edit_sharded(
        t, lambda d: d.update(format_version="3.0"))), UnsupportedFormatVersionError, ("3.0", "Upgrade ckptstore")),
    Case("single-version-not-a-string", "unknown format version", lambda t: _load_single(_edit_single(
        t, lambda d: d.update(format_version=1.1))), CorruptCheckpointError, ("format_version",)),
    Case("sharded-version-garbage", "unknown format version", lambda t: _load_sharded_fresh(_edit_sharded(
        t, lambda d: d.update(format_version="1.x"))), CorruptCheckpointError, ("format_version",)),
    Case("restore-major-5", "unknown format version", lambda t: _store_restore(
        t, _tamper_everywhere(lambda d: d.update(format_version="5.0"))), UnsupportedFormatVersionError, ("5.0",)),
    # --- pickles where a manifest or a shard should be (Evil would create a marker file)
    Case("single-pickle-as-manifest", "pickle payload", lambda t: _load_single(
        _replace_single_manifest(t, _pickle_bytes())), CorruptCheckpointError, ("not valid JSON",)),
    Case("single-plain-pickle-file", "pickle payload", lambda t: _single_pickle_file(t, "plain"), NotACheckpointError,
         ("not a checkpoint",)),
    Case("single-torch-zip-with-pickle", "pickle payload", lambda t: _single_pickle_file(t, "zip"),
         PickleNotAllowedError, ("weights_only",)),
    Case("single-torch-legacy-with-pickle", "pickle payload", lambda t: _single_pickle_file(t, "legacy"),
         PickleNotAllowedError, ("weights_only",)),
    Case("sharded-pickle-as-manifest", "pickle payload", _sharded_pickle_manifest, CorruptCheckpointError,
         ("manifest.json", "not valid JSON")),
    Case("sharded-pickle-as-shard", "pickle payload", _sharded_pickle_shard, CorruptCheckpointError, ("checksum",)),
    Case("sharded-pickle-node", "pickle payload", _sharded_pickle_node, CheckpointError, ("$pickle",)),
    # --- malformed trees
    Case("single-tree-too-deep-for-json", "malformed tree", lambda t: _deep_tree(t, 100_000), CorruptCheckpointError,
         ("not valid JSON",)),
    Case("single-bad-device", "malformed tree", lambda t: _load_single(_edit_single(
        t, lambda d: d["tree"]["a"].update(device="warp-drive:9"))), CorruptCheckpointError, ("not a device",)),
    Case("single-int-requires-grad", "malformed tree", lambda t: _load_single(_edit_single(
        t, lambda d: d["tree"].update(step={"$tensor": d["tree"]["a"]["$tensor"], "requires_grad": True}) or
        d["tensors"]["a"].update(dtype="int32"))), CorruptCheckpointError, ("gradients",)),
]


def _forged_part(tmp: str) -> Callable[[], Any]:
    # A part changed after the commit (a's chunk claims another checksum) with the manifest left
    # as it was: what the manifest names it by no longer matches, and that alone refuses it.
    root = _sharded2(tmp)
    path = os.path.join(root, "parts", "rank-00000.json")
    with open(path, "rb") as fh:
        part = json.loads(fh.read())
    part["chunks"]["a"][0]["checksum"] = part["chunks"]["b"][0]["checksum"]
    with open(path, "wb") as fh:
        fh.write(json.dumps(part, separators=(",", ":")).encode())
    return _load_sharded_into(root)


def _part_replaced(tmp: str, data: bytes | None) -> Callable[[], Any]:
    root = _sharded2(tmp)
    path = os.path.join(root, "parts", "rank-00000.json")
    os.unlink(path)
    if data is not None:
        with open(path, "wb") as fh:
            fh.write(data)
    return _load_sharded_into(root)


def _parted_header(tmp: str, edit: Callable[[dict], Any]) -> str:
    root = _sharded2(tmp)
    path = os.path.join(root, "manifest.json")
    with open(path, "rb") as fh:
        doc = json.loads(fh.read())
    doc.pop("checksum")
    edit(doc)
    _write_parted(path, doc)
    return root


# The forgeries above in save_sharded's own format, 2.0: the chunks are in the part file, which
# the forger made agree with the manifest's size and checksum of it (and the manifest with its
# own checksum); and what only a 2.0 checkpoint can suffer: a part that does not match the
# manifest, a missing one, a pickle where a part should be.
CASES += [
    Case("sharded2-chunk-file-dotdot", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded2(t, lambda d: _chunk(d).update(file="../outside.bin"))), CorruptCheckpointError,
        ("../outside.bin", "not a safe relative path")),
    Case("sharded2-chunk-file-absolute", "escape the root", lambda t: _load_sharded_into(
        _edit_sharded2(t, lambda d: _chunk(d).update(file="/etc/passwd"))), CorruptCheckpointError,
        ("/etc/passwd", "not a safe relative path")),
    Case("sharded2-chunk-file-nul", "escape the root", lambda t: _load_sharded_fresh(
        _edit_sharded2(t, lambda d: _chunk(d).update(file="data/rank-00000.bin\x00.txt"))), CorruptCheckpointError,
        ("not a safe relative path",)),
    Case("sharded2-data-symlink-outside", "escape the root", lambda t: _symlinked_data(t, _sharded2),
         CorruptCheckpointError, ("outside the checkpoint directory", "symbolic link")),
    Case("sharded2-negative-offset", "bad offsets", lambda t: _load_sharded_fresh(
        _edit_sharded2(t, lambda d: _chunk(d).update(offset=-1))), CorruptCheckpointError, ("offset",)),
    Case("sharded2-offset-past-end-fresh", "bad offsets", lambda t: _sharded_offset_past_end(t, True, _edit_sharded2),
         CorruptCheckpointError, ("rank-00000.bin is truncated", "'a'")),
    Case("sharded2-offset-past-end-into", "bad offsets", lambda t: _sharded_offset_past_end(t, False, _edit_sharded2),
         CorruptCheckpointError, ("rank-00000.bin is truncated", "'a'")),
    Case("sharded2-overlapping-bytes", "bad offsets", lambda t: _overlapping_bytes(t, True, _edit_sharded2),
         CorruptCheckpointError, ("overlapping bytes",)),
    Case("sharded2-shape-huge-raw", "absurd shapes", lambda t: _sharded_absurd(t, "raw", _edit_sharded2),
         CorruptCheckpointError, ("is truncated",)),
    Case("sharded2-4gib-claim", "absurd shapes", lambda t: _sharded_moderate_claim(t, _edit_sharded2),
         CorruptCheckpointError, ("is truncated",)),
    Case("sharded2-major-3", "unknown format version", lambda t: _load_sharded_fresh(_parted_header(
        t, lambda d: d.update(format_version="3.0"))), UnsupportedFormatVersionError, ("3.0", "Upgrade ckptstore")),
    Case("sharded2-pickle-node", "pickle payload", lambda t: _load_sharded_fresh(_parted_header(
        t, lambda d: d["tree"].update(a={"$pickle": "a"}))), CheckpointError, ("$pickle",)),
    Case("sharded2-pickle-as-part", "pickle payload", lambda t: _part_replaced(t, _pickle_bytes()),
         CorruptCheckpointError, ("parts/rank-00000.json", "does not match")),
    Case("sharded2-part-not-the-manifests", "damaged part", _forged_part, CorruptCheckpointError,
         ("parts/rank-00000.json", "does not match")),
    Case("sharded2-part-missing", "damaged part", lambda t: _part_replaced(t, None), CorruptCheckpointError,
         ("parts/rank-00000.json", "missing")),
]


def _snapshot(tmp: str) -> dict[str, tuple[int, int]]:
    """Every file under ``tmp`` with its size and mtime (symlinks not followed)."""
    out = {}
    for dirpath, _dirs, files in os.walk(tmp):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


def run_case(case: Case, tmp: str) -> BaseException:
    """Build ``case`` under ``tmp``, run its call, return the error; asserts it is the right one and
    that nothing was written and no pickle ran."""
    marker = os.path.join(tmp, "PWNED")
    os.environ[MARKER_ENV] = marker
    call = case.build(tmp)
    before = _snapshot(tmp)
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - inspected below
        err = exc
    else:
        raise AssertionError(f"{case.name}: the call succeeded")
    assert isinstance(err, case.error) and isinstance(err, CheckpointError), (
        f"{case.name}: {type(err).__name__}: {err}"
    )
    msg = str(err)
    for word in case.words:
        assert word in msg, f"{case.name}: {word!r} not in {msg!r}"
    after = _snapshot(tmp)
    if case.name.startswith("restore-"):
        # A store may write its own RAM staging state; the checkpoint's files stay as they were.
        before = {k: v for k, v in before.items() if "/shm/" not in k}
        after = {k: v for k, v in after.items() if "/shm/" not in k}
    assert after == before, f"{case.name}: files changed: {set(after.items()) ^ set(before.items())}"
    assert not os.path.exists(marker), f"{case.name}: a pickle ran"
    return err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused(case, tmp_path):
    run_case(case, str(tmp_path))


def test_refused_under_a_memory_limit(tmp_path):
    """All cases in one child process whose address space may grow by 768 MiB at most."""
    code = f"""
import os, resource, sys
sys.path.insert(0, {TESTS_DIR!r})
import test_hostile as t
import ckptstore, torch
ckptstore.load  # import everything before the limit
from ckptstore.engine import exchange, store  # noqa
with open("/proc/self/statm") as fh:
    vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
limit = vm + (768 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for i, case in enumerate(t.CASES):
    d = os.path.join({str(tmp_path)!r}, str(i))
    os.mkdir(d)
    t.run_case(case, d)
print("ran", len(t.CASES))
"""
    # Few malloc arenas: each thread's own would reserve 64 MiB of address space, not memory.
    env = dict(os.environ, MALLOC_ARENA_MAX="2")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ran {len(CASES)}" in result.stdout


def test_cases_are_valid_checkpoints_before_they_are_damaged(tmp_path):
    """The builders start from sound checkpoints: a case fails because of its damage alone."""
    assert torch.equal(ckptstore.load(_single(str(tmp_path)))["a"], _state()["a"])
    state = {"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64)}
    ckptstore.load_sharded(state, _sharded(str(tmp_path / "s")), strict=False)
    assert torch.equal(state["a"], _state()["a"])
    # The format 2.0 forgeries start from a sound checkpoint too, and a forger's rewrite that
    # changes nothing (the part and manifest re-encoded, their checksums recomputed) loads.
    for i, build in enumerate((_sharded2, lambda t: _edit_sharded2(t, lambda d: None),
                               lambda t: _parted_header(t, lambda d: None))):
        tmp = tmp_path / f"v2-{i}"
        tmp.mkdir()
        state = {"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64)}
        ckptstore.load_sharded(state, build(str(tmp)), strict=False)
        assert torch.equal(state["a"], _state()["a"]) and torch.equal(state["b"], _state()["b"])


def test_a_tree_just_deep_enough_for_json_is_refused_or_loaded(tmp_path):
    # Deep enough that json parses it but a recursive walk might not: a clear error or the object.
    for depth in (200, 900, 2000):
        d = tmp_path / str(depth)
        d.mkdir()
        try:
            loaded = _deep_tree(str(d), depth)()
        except CorruptCheckpointError as exc:
            assert "nested too deeply" in str(exc) or "not valid JSON" in str(exc)
        else:
            node = loaded["a"]
            for _ in range(depth):
                node = node[0]
            assert node == 1


def test_part_files_are_never_read(tmp_path):
    """Part files are informative: a pickle or garbage there changes nothing a load reads."""
    root = _sharded(str(tmp_path))
    with open(os.path.join(root, "parts", "rank-00000.json"), "wb") as fh:
        fh.write(_pickle_bytes())
    state = {"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64)}
    ckptstore.load_sharded(state, root, strict=False)
    assert torch.equal(state["a"], _state()["a"])


def test_manifest_cap_is_configurable(tmp_path, monkeypatch):
    path = _single(str(tmp_path))
    monkeypatch.setenv("CKPTSTORE_MAX_MANIFEST_BYTES", "100")
    with pytest.raises(CorruptCheckpointError, match="over the 100-byte cap"):
        ckptstore.load(path)
    monkeypatch.setenv("CKPTSTORE_MAX_MANIFEST_BYTES", str(1 << 20))
    assert torch.equal(ckptstore.load(path)["a"], _state()["a"])


# ------------------------------------------------------------------------------------ RAM tier documents


def _ram_tampered_restore_falls_back(tmp_path, tamper: Callable[[str], None], caplog, tier: str = "local") -> None:
    """A RAM document that is damaged or hostile is skipped; restore reads the local tier."""
    import uuid

    job = f"hostile-{uuid.uuid4().hex[:10]}"
    ram_dir, local = str(tmp_path / "shm"), str(tmp_path / "local")
    os.mkdir(ram_dir)
    store = ckptstore.CheckpointStore(job, local=local, ram_dir=ram_dir)
    store.save(1, _state()).wait("local")
    store.close(keep_ram=True)  # the restart below finds the RAM copy, which the tampering reaches
    docs = _ram_docs(ram_dir)
    assert docs
    for path in docs:
        tamper(path)
    target = {"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64), "step": 0}
    import logging

    with caplog.at_level(logging.INFO, logger="ckptstore"), ckptstore.CheckpointStore(
        job, local=local, ram_dir=ram_dir
    ) as store:
        assert store.restore(target) == 1
    assert f"restored step 1 from the {tier} tier" in caplog.text  # "local": the RAM copy was not used
    assert torch.equal(target["a"], _state()["a"]) and target["step"] == 3
    assert not os.path.exists(tmp_path / "PWNED")


def _write(path: str, data: bytes) -> None:
    os.unlink(path)
    with open(path, "wb") as fh:
        fh.write(data)


@pytest.mark.parametrize(
    "how",
    ["pickle", "not-an-object", "wrong-types", "symlink", "oversized", "escaping-slot", "segment-symlink",
     "unknown-ram-format", "segment-pickle"],
)
def test_hostile_ram_document_is_skipped(tmp_path, how, caplog):
    os.environ[MARKER_ENV] = str(tmp_path / "PWNED")
    outside = tmp_path / "outside.json"

    def tamper(path: str) -> None:
        with open(path) as fh:
            doc = json.load(fh)
        if how == "pickle":
            _write(path, _pickle_bytes())
        elif how == "not-an-object":
            _write(path, b"[1, 2, 3]")
        elif how == "wrong-types":
            _write(path, json.dumps({**doc, "step": "1", "size": [1], "extra": "manifest"}).encode())
        elif how == "symlink":
            outside.write_text(json.dumps(doc))
            os.unlink(path)
            os.symlink(outside, path)
        elif how == "oversized":
            os.unlink(path)
            _sparse(path, 2 << 30, b"}")
        elif how == "escaping-slot":
            _write(path, json.dumps({**doc, "slot": "0/../../../outside"}).encode())
        elif how == "unknown-ram-format":
            _write(path, json.dumps({**doc, "format": "ckptstore-ram/9"}).encode())
        elif how == "segment-pickle":
            with open(path[:-5] + ".bin", "r+b") as fh:  # the shard's bytes, not its document
                fh.write(_pickle_bytes())
        elif how == "segment-symlink":
            segment = path[:-5] + ".bin"
            moved = str(tmp_path / os.path.basename(segment))
            os.replace(segment, moved)  # the same bytes, reached through a link
            os.symlink(moved, segment)

    # A slot number that is a path is never used as one: segments are named by the document's own
    # file name, so that copy stays usable.
    _ram_tampered_restore_falls_back(tmp_path, tamper, caplog, "ram" if how == "escaping-slot" else "local")


def test_planted_symlink_in_ram_dir_is_never_written_through(tmp_path, job):
    """/dev/shm is writable by every user: a link planted under our segment's name must not
    redirect the staged bytes (or the slot's document) to wherever it points."""
    from ckptstore.tiers.ram import RamTier

    ram_dir = tmp_path / "shm"
    ram_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    segment = ram_dir / f"ckptstore-{job}-r00000-s0.bin"
    os.symlink(victim, segment)
    tier = RamTier(job, ram_dir=str(ram_dir))
    with pytest.raises(CheckpointError, match="symbolic link"):
        tier.stage(1, [("w", torch.ones(1000))])
    assert victim.read_bytes() == b"precious"
    segment.unlink()
    document = ram_dir / f"ckptstore-{job}-r00000-s0.json.tmp-{os.getpid()}"
    os.symlink(victim, document)
    tier = RamTier(job, ram_dir=str(ram_dir))
    staged = tier.stage(1, [("w", torch.ones(1000))])
    with pytest.raises(CheckpointError, match="symbolic link"):
        tier.commit_staged(staged, tier.checksums(staged))
    assert victim.read_bytes() == b"precious"
    tier.close(unlink=True)


def test_ram_tier_read_refuses_a_layout_outside_its_segment(tmp_path, job):
    from ckptstore.tiers.ram import RamTier

    tier = RamTier(job, ram_dir=str(tmp_path))
    staged = tier.stage(1, [("w", torch.ones(1000))])
    tier.commit_staged(staged, tier.checksums(staged))
    path = os.path.join(str(tmp_path), f"ckptstore-{job}-r00000-s0.json")
    with open(path) as fh:
        doc = json.load(fh)
    import hashlib

    for layout in ([{**doc["layout"][0], "offset": HUGE}], [{**doc["layout"][0], "shape": [HUGE]}]):
        bad = dict(doc, layout=layout)
        text = json.dumps([(e["key"], e["dtype"], e["shape"], e["offset"]) for e in layout])
        bad["signature"] = hashlib.sha256(text.encode()).hexdigest()[:32]  # a crafted, consistent signature
        with pytest.raises(CorruptCheckpointError, match="malformed layout"):
            tier.read(bad)
    assert torch.equal(tier.read(doc)["w"], torch.ones(1000))


# ------------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize(
    "damage",
    [
        ("dotdot", lambda d: _chunk(d).update(file="../outside.bin")),
        ("offset-past-end", lambda d: _chunk(d).update(offset=HUGE)),
        ("duplicate-tensor-in-bytes", lambda d: _chunk(d, "b").update(offset=_chunk(d, "a")["offset"],
                                                                       file=_chunk(d, "a")["file"])),
        ("major-9", lambda d: d.update(format_version="9.0")),
    ],
    ids=lambda p: p[0],
)
@pytest.mark.parametrize("command", ["inspect", "verify", "reshard", "reshard1", "convert"])
def test_cli_refuses_with_a_message(tmp_path, capsys, command, damage):
    root = _edit_sharded(str(tmp_path), damage[1])
    dst = str(tmp_path / "out")
    argv = {
        "inspect": ["inspect", root],
        "verify": ["verify", root],
        "reshard": ["reshard", root, dst, "--ranks", "2"],
        "reshard1": ["reshard", root, dst, "--ranks", "1"],
        "convert": ["convert", root, dst, "--to", "safetensors"],
    }[command]
    rc = cli_main(argv)
    out, err = capsys.readouterr()
    if command == "verify" and damage[0] == "offset-past-end":
        # The manifest is well-formed; verify reports the chunk as damaged.
        assert rc == 1 and "truncated" in out
    elif command == "inspect" and damage[0] == "offset-past-end":
        assert rc == 0  # inspect shows the manifest and reads no data
    else:
        assert rc == 2, err
        assert f"ckptstore {argv[0]}: error:" in err and "Traceback" not in err
    assert not os.path.exists(dst), "a refused source must not leave a destination behind"


def test_cli_storage_options_are_not_echoed(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--storage-options", '{"secret": "hunter2-do-not-print",', "inspect", "x"])
    err = capsys.readouterr().err
    assert "hunter2" not in err and "not valid JSON" in err


# ------------------------------------------------------------------------------------ file modes


def _modes(root: str) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            out[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_created_files_and_directories_are_owner_only(tmp_path, job, umask):
    """Whatever the umask: files 0600, directories 0700, shared-memory segments 0600."""
    old = os.umask(umask)
    try:
        os.chmod(tmp_path, 0o755)  # what we did not create keeps its mode
        ckptstore.save(_state(), str(tmp_path / "model.ckpt"))
        ckptstore.save(_state(), str(tmp_path / "model.ckpt"))  # replacing an existing file
        ckptstore.save_sharded(_state(), str(tmp_path / "a" / "b" / "sharded"))
        ram_dir = tmp_path / "shm"
        os.mkdir(ram_dir, 0o755)
        store = ckptstore.CheckpointStore(job, local=str(tmp_path / "x" / "local"), ram_dir=str(ram_dir))
        store.save(1, _state()).wait("local")
        store.save(2, _state()).wait("local")
        store.close(keep_ram=True)  # the segments' modes are checked below
        from ckptstore.checkpoint.reshard import reshard

        reshard(str(tmp_path / "a" / "b" / "sharded"), str(tmp_path / "r" / "resharded"), 2)
    finally:
        os.umask(old)
    modes = _modes(str(tmp_path))
    assert modes.pop(str(ram_dir)) == 0o755
    assert len(modes) > 20
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o700 if os.path.isdir(p) else 0o600)}
    assert not wrong
    segments = [n for n in os.listdir(ram_dir) if n.endswith(".bin")]
    assert segments and all(stat.S_IMODE(os.stat(ram_dir / n).st_mode) == 0o600 for n in segments)


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_peer_replica_segments_are_owner_only(tmp_path, job, umask):
    from ckptstore.tiers.peer import PeerTier

    old = os.umask(umask)
    try:
        tier = PeerTier(job, rank=0, ram_dir=str(tmp_path))
        slot, buf = tier.replica_buffer(1, 8192)
        buf.fill_(7)
        tier.commit_replica(1, slot, 5, 8192, b"{}")
    finally:
        os.umask(old)
    names = sorted(os.listdir(tmp_path))
    assert any(n.endswith(".bin") for n in names) and any(n.endswith(".json") for n in names)
    assert {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in names} == {n: 0o600 for n in names}
    tier.close()


# ------------------------------------------------------------------------------------ credentials

ACCESS_KEY = "AKIACKPTSTORE7Q3ZLEAK"
SECRET_KEY = "ckptstore-secret-DO-NOT-LEAK-4f9d1c"


def test_credentials_never_stored_logged_or_raised(moto_s3_server, request, tmp_path, job, caplog, capsys):
    """Save and restore through S3 with distinctive credentials in storage_options, provoke errors,
    then look for them in every stored object, every local file, the logs and every error text.
    On moto, which accepts any credentials: a real server accepts only the ones it knows."""
    import logging
    import traceback

    from conftest import s3_keys, s3_object_bytes, s3_view

    s3 = s3_view(moto_s3_server, request)

    opts = dict(s3["storage_options"], key=ACCESS_KEY, secret=SECRET_KEY)
    base = f"s3://{s3['bucket']}/{s3['prefix']}"
    caplog.set_level(logging.INFO)  # every logger at INFO and above ...
    caplog.set_level(logging.DEBUG, logger="ckptstore")  # ... and everything ckptstore logs
    texts: list[str] = []

    def refused(call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - every error text is searched
            texts.append(str(exc) + repr(exc) + "".join(traceback.format_exception(exc)))
        else:
            raise AssertionError("the call was expected to fail")

    state = _state()
    ckptstore.save(state, f"{base}/single.ckpt", storage_options=opts)
    assert torch.equal(ckptstore.load(f"{base}/single.ckpt", storage_options=opts)["a"], state["a"])
    ckptstore.save_sharded(state, f"{base}/sharded", storage_options=opts)
    target = {"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64)}
    ckptstore.load_sharded(target, f"{base}/sharded", storage_options=opts, strict=False)
    assert torch.equal(target["a"], state["a"])
    local = str(tmp_path / "local")
    with ckptstore.CheckpointStore(job, local=local, durable=f"{base}/durable", durable_every=1,
                                   storage_options=opts) as store:
        for step in (1, 2):
            store.save(step, state).wait("durable")
    from conftest import wipe_ram

    wipe_ram(job)
    shutil_rmtree(local)
    restored = {"a": torch.zeros(1000), "b": torch.zeros(4, 8, dtype=torch.float64), "step": 0}
    with ckptstore.CheckpointStore(job, local=local, durable=f"{base}/durable", storage_options=opts) as store:
        assert store.restore(restored) == 2  # from durable: nothing else is left
    assert torch.equal(restored["a"], state["a"])

    # Errors, with the credentials in play: missing objects, damaged ones, refused writes.
    refused(lambda: ckptstore.load(f"{base}/missing.ckpt", storage_options=opts))
    refused(lambda: ckptstore.load_sharded({}, f"{base}/missing-dir", storage_options=opts))
    refused(lambda: ckptstore.save_sharded(state, f"{base}/sharded", storage_options=opts))  # already committed
    s3["client"].put_object(Bucket=s3["bucket"], Key=f"{s3['prefix']}/bad.ckpt",
                            Body=container.MAGIC + b"\x01\x00" + bytes(5000))
    refused(lambda: ckptstore.load(f"{base}/bad.ckpt", storage_options=opts))
    for name in ("manifest.json", "index.json"):  # a damaged index alone would send the load to the manifest
        s3["client"].put_object(Bucket=s3["bucket"], Key=f"{s3['prefix']}/sharded/{name}", Body=b'{"a":1,"a":2}')
    refused(lambda: ckptstore.load_sharded({}, f"{base}/sharded", storage_options=opts))
    wrong = dict(opts, client_kwargs={**opts["client_kwargs"], "endpoint_url": "http://127.0.0.1:9"},
                 config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    refused(lambda: ckptstore.load(f"{base}/single.ckpt", storage_options=wrong))  # nothing listens there
    for argv in (["inspect", f"{base}/missing.ckpt"], ["verify", f"{base}/sharded"]):
        assert cli_main(["--storage-options", json.dumps(opts), *argv]) == 2
    out, err = capsys.readouterr()
    texts.append(out + err)

    stored = [s3_object_bytes(s3, key) for key in s3_keys(s3, s3["prefix"])]
    assert len(stored) >= 8
    for dirpath, _dirs, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                stored.append(fh.read())
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptstore-{job}-"):
            with open(os.path.join("/dev/shm", name), "rb") as fh:
                stored.append(fh.read())
    assert len(texts) == 7
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert not any(secret.encode() in blob for blob in stored), f"{secret} in a stored object"
        assert secret not in caplog.text, f"{secret} in a log line"
        assert not any(secret in text for text in texts), f"{secret} in an error text"
    assert caplog.records, "nothing was logged: the log check would be vacuous"


def shutil_rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path)


def test_missing_data_file_is_corruption_for_fresh_slots_too(tmp_path):
    root = _sharded(str(tmp_path))
    os.unlink(os.path.join(root, "data", "rank-00000.bin"))
    for load in (_load_sharded_fresh(root), _load_sharded_into(root)):
        with pytest.raises(CorruptCheckpointError, match=r"rank-00000.bin is missing, but the manifest keeps tensor"):
            load()


# ------------------------------------------------------------------------------------ the index

_INDEX_EDITS: dict[str, Callable[[dict], Any]] = {
    "chunk-file-dotdot": lambda d: d["tensors"]["a"]["chunks"][0].update(file="../outside.bin"),
    "chunk-file-absolute": lambda d: d["tensors"]["a"]["chunks"][0].update(file="/etc/passwd"),
    "negative-offset": lambda d: d["tensors"]["a"]["chunks"][0].update(offset=-8),
    "offset-past-end": lambda d: d["tensors"]["a"]["chunks"][0].update(offset=1 << 40),
    "shape-huge": lambda d: (d["tensors"]["a"].update(shape=[1 << 40]), d["tensors"]["a"]["chunks"][0].update(sizes=[1 << 40])),
    "overlapping-bytes": lambda d: d["tensors"]["b"]["chunks"][0].update(offset=0),
    "part-file-dotdot": lambda d: d["parts"].update({"0": ["../part.json", "xxh3_64:0000000000000000"]}),
}


@pytest.mark.parametrize("name", sorted(_INDEX_EDITS))
@pytest.mark.parametrize("fresh", [False, True], ids=["into", "fresh"])
def test_a_forged_index_is_refused_or_passed_over_for_the_manifest(name, fresh, tmp_path, caplog):
    """An index whose own checksum was recomputed over hostile values (so it parses): the load either
    refuses with a CorruptCheckpointError or, where the index's checks catch it, warns and reads the
    sound manifest, bitwise. Never another error, never bytes from outside the checkpoint."""
    from ckptstore.format.checksum import checksum

    state = _state()
    root = str(tmp_path / "ck")
    ckptstore.save_sharded(state, root)
    downgrade(pathlib.Path(root), index=True)  # an index lives beside a 1.x manifest only
    path = os.path.join(root, "index.json")
    with open(path, "rb") as fh:
        doc = json.loads(fh.read())
    doc.pop("checksum")
    _INDEX_EDITS[name](doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    with open(path, "wb") as fh:
        fh.write(body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}')
    target: dict[str, Any] = ({"a": None, "b": None} if fresh else
                              {"a": torch.zeros_like(state["a"]), "b": torch.zeros_like(state["b"])})
    try:
        ckptstore.load_sharded(target, root, strict=False)
    except ckptstore.CheckpointError as exc:
        assert isinstance(exc, CorruptCheckpointError), repr(exc)
        assert root in str(exc)
        return
    assert "from its index" in caplog.text and "reading its manifest" in caplog.text
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])


# ------------------------------------------------------------------------- the format 2.0 manifest

def _missing_part(root: str, doc: dict) -> None:
    os.unlink(os.path.join(root, doc["parts"][0][0]))


_PARTED_EDITS: dict[str, Callable[[str, dict], Any]] = {
    "part-file-dotdot": lambda r, d: d["parts"][0].__setitem__(0, "parts/../../outside.json"),
    "part-file-absolute": lambda r, d: d["parts"][0].__setitem__(0, "/etc/passwd"),
    "part-size-mismatch": lambda r, d: d["parts"][0].__setitem__(1, d["parts"][0][1] + 1),
    "part-checksum-mismatch": lambda r, d: d["parts"][0].__setitem__(2, "xxh3_64:0000000000000000"),
    "part-missing": _missing_part,
    "fewer-parts-than-world": lambda r, d: d["meta"].update(world_size=2),
    "part-named-twice": lambda r, d: (d["parts"].append(d["parts"][0]), d["meta"].update(world_size=2)),
    "tensor-dropped": lambda r, d: d["tensors"].pop("b"),
    "writer-out-of-range": lambda r, d: d["tensors"]["a"].update(writer=5),
    "shape-shrunk": lambda r, d: d["tensors"]["a"].update(shape=[999]),
    "dtype-changed": lambda r, d: d["tensors"]["a"].update(dtype="float64"),
}


@pytest.fixture(scope="module", params=["store", "save_sharded"])
def parted_step(tmp_path_factory, request):
    """A format 2.0 checkpoint (its manifest names its part files): a store's durable step, and
    what save_sharded commits."""
    import uuid

    from conftest import wipe_ram

    tmp = tmp_path_factory.mktemp("parted")
    if request.param == "save_sharded":
        ckptstore.save_sharded(_state(), str(tmp / "ck"))
        return tmp / "ck"
    job = f"hostile-{uuid.uuid4().hex[:10]}"
    ram = tmp / "shm"
    ram.mkdir()
    try:
        with ckptstore.CheckpointStore(job, durable=str(tmp / "durable"), durable_every=1, ram_dir=str(ram)) as store:
            store.save(1, _state()).wait("durable")
    finally:
        wipe_ram(job)
    return tmp / "durable" / "step-000000000001"


@pytest.mark.parametrize("name", sorted(_PARTED_EDITS))
def test_a_forged_parted_manifest_is_refused(name, parted_step, tmp_path):
    """A format 2.0 manifest whose own checksum was recomputed over hostile values (so it parses),
    or whose part file is gone: every load refuses it with a CorruptCheckpointError naming the
    checkpoint, never another error, never a tensor filled from outside it or from the wrong part."""
    from ckptstore.format.checksum import checksum

    root = str(tmp_path / "ck")
    shutil.copytree(parted_step, root)
    path = os.path.join(root, "manifest.json")
    with open(path, "rb") as fh:
        doc = json.loads(fh.read())
    assert doc["format_version"] == "2.0"
    doc.pop("checksum")
    _PARTED_EDITS[name](root, doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    with open(path, "wb") as fh:
        fh.write(body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}')
    state = _state()
    for fresh in (False, True):
        target: dict[str, Any] = ({"a": None, "b": None, "step": 0} if fresh else
                                  {"a": torch.zeros_like(state["a"]), "b": torch.zeros_like(state["b"]), "step": 0})
        with pytest.raises(CorruptCheckpointError) as err:
            ckptstore.load_sharded(target, root, strict=False)
        assert root in str(err.value), err.value
        if not fresh:
            assert not target["a"].any() and not target["b"].any()  # nothing was filled
    assert cli_main(["verify", root]) != 0
