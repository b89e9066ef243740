"""A RAM-tier snapshot persisted as a step directory loads back bitwise, with the checksums that
were computed from the staged copy."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

import ckptstore
from ckptstore.checkpoint.materialize import encode_value
from ckptstore.checkpoint.sharded import BLOCK_SIZE, build_manifest, collect
from ckptstore.cli import main
from ckptstore.tiers.directory import DirectoryTier
from ckptstore.tiers.ram import RamTier


@pytest.fixture
def tier():
    job = f"test-{uuid.uuid4().hex[:12]}"
    t = RamTier(job, ram_dir="/dev/shm")
    yield t
    t.close(unlink=True)


def _state():
    g = torch.Generator().manual_seed(11)
    return {
        "model": {"w": torch.randn(2000, 1000, generator=g), "b": torch.randn(5, generator=g), "s": torch.tensor(1.5)},
        "empty": torch.empty(0, 4),
        "step": 7,
        "rng": ckptstore.PerRank(torch.get_rng_state()),
    }


def _stage_and_persist(tier, state, root, step=7):
    """What the store's pipeline does for one rank: stage, checksum, put, commit with a manifest."""
    local = collect(state, 0, encode_value)
    items = [(key, t) for (key, _o, _s), t in local.items.items()]
    staged = tier.stage(step, items)
    tier.checksums(staged, block_size=BLOCK_SIZE)
    snap = tier.snapshot(staged, 1, {})
    directory = DirectoryTier("local", str(root))
    part = directory.put_sync(snap)
    manifest = build_manifest(local.tree, local.tensors, [part], 1)
    directory.commit_sync(step, manifest)
    return manifest


def test_persisted_snapshot_loads_back_bitwise(tier, tmp_path):
    state = _state()
    _stage_and_persist(tier, state, tmp_path)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "empty": torch.empty(0, 4),
              "step": 0, "rng": ckptstore.PerRank(None)}
    ckptstore.load_sharded(target, tmp_path / "step-000000000007")
    for k, v in state["model"].items():
        got = target["model"][k]
        assert got.shape == v.shape and torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    assert target["step"] == 7 and torch.equal(target["rng"].value, state["rng"].value)
    assert main(["verify", str(tmp_path / "step-000000000007")]) == 0


def test_staged_checksums_match_what_save_sharded_writes(tier, tmp_path):
    state = _state()
    persisted = _stage_and_persist(tier, state, tmp_path / "a")
    ckptstore.save_sharded(state, tmp_path / "b")
    direct = json.loads((tmp_path / "b" / "manifest.json").read_text())
    for key in ("model/w", "model/b", "model/s"):
        a, b = persisted.tensors[key].chunks[0], direct["tensors"][key]["chunks"][0]
        assert a.checksum == b["checksum"] and list(a.block_checksums or []) == b.get("block_checksums", [])


def test_a_step_is_never_rewritten(tier, tmp_path):
    _stage_and_persist(tier, _state(), tmp_path)
    step_dir = tmp_path / "step-000000000007"
    before = (step_dir / "manifest.json").read_bytes()
    with pytest.raises(ckptstore.CheckpointError, match="never rewritten"):
        _stage_and_persist(tier, _state(), tmp_path, step=7)
    assert (step_dir / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(step_dir)) == ["data", "manifest.json", "parts"]
