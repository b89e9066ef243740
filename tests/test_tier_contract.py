"""The contract every tier keeps (ckptstore/tiers/base.py), run against each implementation:
the RAM tier on /dev/shm, and DirectoryTier on a local directory (raw and zstd), on S3 (moto)
and on memory://. Snapshots are built the way the store's pipeline builds them: staged in a
RamTier, checksummed with BLOCK_SIZE, handed to the tier, committed with the global manifest."""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest
import torch
from conftest import assert_tensor_identical

from ckptstore import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, PerRank
from ckptstore.checkpoint.materialize import decode_value, encode_value
from ckptstore.checkpoint.sharded import (
    BLOCK_SIZE,
    Directory,
    Group,
    build_manifest,
    collect,
    my_writes,
    data_file,
    load_manifest,
    part_file,
)
from ckptstore.format.container import align_up
from ckptstore.storage.targets import Target
from ckptstore.tiers.directory import DirectoryTier, step_name
from ckptstore.tiers.ram import RamTier

SHM = "/dev/shm"
DIRECTORIES = ["local", "local-zstd", "s3", "memory"]
ALL = ["ram", *DIRECTORIES]


@dataclass
class Env:
    kind: str
    tier: Any  # the tier under test
    source: RamTier  # where snapshots are staged (the tier itself for "ram")
    root: str | None = None
    options: dict[str, Any] | None = None
    codec: str | None = None

    def another(self) -> DirectoryTier:
        """A second tier on the same root (another process, or a restarted one)."""
        return DirectoryTier("durable", self.root, storage_options=self.options, codec=self.codec)


@pytest.fixture
def env(request, tmp_path):
    kind = request.param
    job = f"contract-{uuid.uuid4().hex[:12]}"
    source = RamTier(job, ram_dir=SHM, slots=3)
    if kind == "ram":
        e = Env(kind, source, source)
    else:
        root, options = str(tmp_path / "tier"), None
        if kind == "s3":
            s3 = request.getfixturevalue("s3")
            root, options = f"s3://{s3['bucket']}/{s3['prefix']}/tier", s3["storage_options"]
        elif kind == "memory":
            root = f"memory://contract-{uuid.uuid4().hex}/tier"
        e = Env(kind, None, source, root, options, "zstd" if kind == "local-zstd" else None)
        e.tier = e.another()
    try:
        yield e
    finally:
        source.close(unlink=True)
        for name in os.listdir(SHM):
            if name.startswith(f"ckptstore-{job}-"):
                os.unlink(os.path.join(SHM, name))
        if kind == "memory":
            try:
                fsspec.filesystem("memory").rm(e.root.split("/tier")[0], recursive=True)
            except FileNotFoundError:
                pass


def all_tiers(fn):
    return pytest.mark.parametrize("env", ALL, indirect=True)(fn)


def directory_tiers(fn):
    return pytest.mark.parametrize("env", DIRECTORIES, indirect=True)(fn)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1_250_000, generator=g),  # 5 MB: two 4 MiB checksum blocks
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(seed + 0.5),
        "empty": torch.empty(0, 3),
        "step": seed,
        "rng": PerRank({"seed": seed, "offsets": [seed, 2 * seed]}),
    }


def _zeroed(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else PerRank(None) if isinstance(v, PerRank)
            else type(v)() if isinstance(v, int) else {kk: torch.zeros_like(vv) for kk, vv in v.items()}
            for k, v in state.items()}


def _assert_loaded_equal(got: dict[str, Any], want: dict[str, Any], where: str = "state") -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_loaded_equal(got[k], v, f"{where}[{k!r}]")
        elif isinstance(v, torch.Tensor):
            assert_tensor_identical(got[k], v, f"{where}[{k!r}]")
        elif isinstance(v, PerRank):
            assert got[k].value == v.value, f"{where}[{k!r}]"
        else:
            assert type(got[k]) is type(v) and got[k] == v, f"{where}[{k!r}]"


def _load(tier: Any, step: int, like: dict[str, Any]) -> dict[str, Any]:
    state = _zeroed(like)
    load_manifest(state, tier.manifest_sync(step), tier.display(step), tier.opener(step), group=Group.solo(),
                  strict=True, per_rank="error", buffer_bytes=1 << 20, decode_per_rank=decode_value)
    return state


@dataclass
class Saved:
    part: dict[str, Any]
    slot: int
    local: Any  # what collect made of the state (tree and tensor table)


def _save(env: Env, step: int, state: Any, *, commit: bool = True, use_async: bool = False,
          frozen: str | None = None) -> Saved:
    """The store's pipeline for one rank: stage (frozen keys first), checksum, put, commit."""
    local = collect(state, 0, encode_value)
    mine = my_writes(local, 1, 0)
    is_frozen = [bool(frozen) and m.key.startswith(frozen) for m in mine]
    ordered = [m for m, f in zip(mine, is_frozen) if f] + [m for m, f in zip(mine, is_frozen) if not f]
    # As the store does: the slot is cut where the frozen entries end, so that entry starts a page.
    staged = env.source.stage(step, [(m.key, local.items[(m.key, m.offsets, m.sizes)]) for m in ordered],
                              breaks=frozenset({sum(is_frozen)}))
    env.source.checksums(staged, BLOCK_SIZE)
    frozen_end = 0
    if any(is_frozen):
        last = staged.layout.entries[sum(is_frozen) - 1]
        frozen_end = align_up(last.offset + last.nbytes)
    snap = env.source.snapshot(staged, world=1, boxes={}, frozen_end=frozen_end)
    part = asyncio.run(env.tier.put(snap)) if use_async else env.tier.put_sync(snap)
    if commit:
        manifest = build_manifest(local.tree, local.tensors, [part], 1)
        manifest.meta.update(step=step, job="contract")
        if use_async:
            asyncio.run(env.tier.commit(step, manifest))
        else:
            env.tier.commit_sync(step, manifest)
    return Saved(part, staged.slot, local)


def _step_dir(env: Env, step: int) -> Directory:
    return Directory(f"{env.root}/{step_name(step)}", env.options)


def _stored_byte(env: Env, step: int, key: str, slot: int) -> tuple[Target, int]:
    """Where the middle byte of ``key``'s stored chunk of ``step`` lives."""
    chunk = env.tier.manifest_sync(step).tensors[key].chunks[0]
    if env.kind == "ram":
        path = f"{SHM}/ckptstore-{env.source.job}-r00000-s{slot}.bin"
        target = Target(display=path, path=path)
    else:
        target = _step_dir(env, step).target(chunk.file)
    return target, chunk.offset + chunk.length // 2


def _flip(target: Target, at: int) -> None:
    if target.path is not None:
        with open(target.path, "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x5A]))
    else:
        data = bytearray(target.fs.cat_file(target.fspath))
        data[at] ^= 0x5A
        target.fs.pipe_file(target.fspath, bytes(data))


def _size(target: Target) -> int:
    return os.path.getsize(target.path) if target.path is not None else int(target.fs.size(target.fspath))


# ------------------------------------------------------------------------------------ contract


@all_tiers
def test_committed_step_is_listed_and_loads_back_bitwise(env):
    state = _state(3)
    _save(env, 3, state, use_async=True)
    assert asyncio.run(env.tier.steps()) == [3] == env.tier.steps_sync()
    manifest = asyncio.run(env.tier.manifest(3))
    assert manifest.kind == "sharded" and manifest.meta["world_size"] == 1
    assert {"big", "bf16", "i64", "scalar", "empty"} <= set(manifest.tensors)
    assert manifest.tensors["empty"].chunks == []
    if env.codec is None:
        assert len(manifest.tensors["big"].chunks[0].block_checksums or ()) == 2, "block checksums are kept"
    _assert_loaded_equal(_load(env.tier, 3, state), state)


@pytest.mark.parametrize("env", ALL, indirect=True)
def test_uncommitted_step_is_invisible_and_swept(env):
    kept = _state(1)
    _save(env, 1, kept)
    _save(env, 2, _state(2), commit=False)
    assert env.tier.steps_sync() == [1]
    with pytest.raises(CheckpointNotFoundError):
        env.tier.manifest_sync(2)
    if env.kind != "ram":
        assert _step_dir(env, 2).exists(part_file(0)) and _step_dir(env, 2).exists(data_file(0))
        assert env.tier.sweep_sync() == [2]
        assert not _step_dir(env, 2).exists(part_file(0)) and not _step_dir(env, 2).exists(data_file(0))
        assert env.tier.sweep_sync() == []
    assert env.tier.steps_sync() == [1]
    _assert_loaded_equal(_load(env.tier, 1, kept), kept)


@pytest.mark.parametrize("env", ALL, indirect=True)
def test_steps_are_listed_oldest_first_and_remove_deletes_exactly_one(env):
    states = {step: _state(step) for step in (2, 10, 7)}  # committed out of order
    for step, state in states.items():
        _save(env, step, state)
    assert env.tier.steps_sync() == [2, 7, 10]
    asyncio.run(env.tier.remove(10))
    env.tier.remove_sync(2)
    assert env.tier.steps_sync() == [7]
    for gone in (2, 10):
        with pytest.raises(CheckpointNotFoundError):
            env.tier.manifest_sync(gone)
    _assert_loaded_equal(_load(env.tier, 7, states[7]), states[7])
    _save(env, 11, states[10])
    assert env.tier.steps_sync() == [7, 11]
    _assert_loaded_equal(_load(env.tier, 11, states[10]), states[10])
    _assert_loaded_equal(_load(env.tier, 7, states[7]), states[7])


@all_tiers
@pytest.mark.parametrize("key", ["big", "i64", "rng#rank00000"], ids=["block-checksummed", "whole-chunk", "per-rank"])
def test_damaged_bytes_raise_corrupt_never_wrong_data(env, key):
    state = _state(5)
    slot = _save(env, 5, state).slot
    target, at = _stored_byte(env, 5, key, slot)
    _flip(target, at)
    with pytest.raises(CorruptCheckpointError):
        _load(env.tier, 5, state)
    _flip(target, at)  # undone: the same step loads again, so the error came from that byte
    _assert_loaded_equal(_load(env.tier, 5, state), state)


@all_tiers
def test_unknown_step_raises_not_found(env):
    with pytest.raises(CheckpointNotFoundError):
        env.tier.manifest_sync(1)
    assert env.tier.steps_sync() == []
    _save(env, 4, _state(4))
    for unknown in (3, 5, 40):
        with pytest.raises(CheckpointNotFoundError):
            env.tier.manifest_sync(unknown)
    with pytest.raises(CheckpointNotFoundError):
        asyncio.run(env.tier.manifest(5))


@directory_tiers
def test_a_step_is_committed_once_and_never_rewritten(env):
    state = _state(6)
    saved = _save(env, 6, state)
    first = env.tier.manifest_sync(6).to_json_bytes()
    other = env.another()  # a second writer on the same root
    second = build_manifest(saved.local.tree, saved.local.tensors, [saved.part], 1)
    second.meta["job"] = "the second writer"
    with pytest.raises(CheckpointError, match="already exists"):
        other.commit_sync(6, second)
    with pytest.raises(CheckpointError, match="already exists"):
        env.tier.commit_sync(6, second)
    assert env.tier.manifest_sync(6).to_json_bytes() == first == other.manifest_sync(6).to_json_bytes()
    with pytest.raises(CheckpointError, match="never rewritten"):
        _save(env, 6, _state(60), commit=False)
    assert env.tier.manifest_sync(6).to_json_bytes() == first
    _assert_loaded_equal(_load(env.tier, 6, state), state)


def _frozen_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100)
    frozen = {"emb": torch.randn(300_000, generator=g), "head": torch.randn(100, 3, generator=g).to(torch.bfloat16)}
    g.manual_seed(seed)
    return {"frozen": frozen, "w": torch.randn(20_000, generator=g), "n": torch.tensor(seed)}


def _extent(part: dict[str, Any], frozen: bool) -> int:
    return sum(c["length"] for k, cs in part["chunks"].items() if k.startswith("frozen/") == frozen for c in cs)


def _frozen_file(part: dict[str, Any]) -> str:
    (name,) = {c["file"] for k, cs in part["chunks"].items() if k.startswith("frozen/") for c in cs}
    assert "-frozen-" in name and name.startswith("data/")
    return name


@directory_tiers
def test_unchanged_frozen_region_is_reused_not_rewritten(env):
    s1, s2 = _frozen_state(1), _frozen_state(2)
    p1 = _save(env, 1, s1, frozen="frozen/").part
    p2 = _save(env, 2, s2, frozen="frozen/").part
    assert p1["written_bytes"] == p1["bytes"] == _extent(p1, True) + _extent(p1, False)
    assert _frozen_file(p2) == _frozen_file(p1)
    assert _extent(p2, True) > 0
    assert p2["written_bytes"] == _extent(p2, False), "only the non-frozen bytes are written"
    assert p2["bytes"] == p2["written_bytes"] + _extent(p2, True)
    if env.kind.startswith("local"):
        a, b = (_step_dir(env, s).target(_frozen_file(p1)).path for s in (1, 2))
        assert os.stat(a).st_ino == os.stat(b).st_ino, "the frozen file is a hard link"
    env.tier.remove_sync(1)  # retention deletes the step that first wrote the frozen file
    assert env.tier.steps_sync() == [2]
    _assert_loaded_equal(_load(env.tier, 2, s2), s2)

    s3 = _frozen_state(3)
    s3["frozen"]["emb"][17] += 1  # the frozen region changed: a new file, written in full
    p3 = _save(env, 3, s3, frozen="frozen/").part
    assert _frozen_file(p3) != _frozen_file(p2)
    assert p3["written_bytes"] == p3["bytes"] == _extent(p3, True) + _extent(p3, False)
    _assert_loaded_equal(_load(env.tier, 3, s3), s3)
    _assert_loaded_equal(_load(env.tier, 2, s2), s2)  # step 3 left step 2's frozen file alone


@pytest.mark.parametrize("env", ["local-zstd"], indirect=True)
def test_zstd_tier_stores_compressed_chunks(env):
    state = {"zeros": torch.zeros(2_000_000), "noise": torch.randn(1000), "empty": torch.empty(0)}
    part = _save(env, 8, state).part
    raw = state["zeros"].numel() * 4 + 4000
    assert _size(_step_dir(env, 8).target(data_file(0))) < raw // 100
    assert part["written_bytes"] < raw // 100
    manifest = env.tier.manifest_sync(8)
    chunks = [c for e in manifest.tensors.values() for c in e.chunks]
    assert chunks and {c.codec for c in chunks} == {"zstd"}
    _assert_loaded_equal(_load(env.tier, 8, state), state)
