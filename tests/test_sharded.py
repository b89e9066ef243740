"""save_sharded / load_sharded in one process: commit rule, partial loads, corruption, S3."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptstore


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(3000, 1000, generator=g), "b": torch.randn(7, generator=g)},
        "step": 12,
        "name": "run-1",
        "rng": ckptstore.PerRank(torch.get_rng_state()),
        "extra": {"tokens": 2**40, "lr": (1e-3, 0.9)},
    }


def _zeros_like(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
        "name": "",
        "rng": ckptstore.PerRank(None),
        "extra": {"tokens": 0, "lr": (0.0, 0.0)},
    }


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_round_trip_in_place(tmp_path):
    state = _state()
    ckptstore.save_sharded(state, tmp_path / "c")
    target = _zeros_like(state)
    w_storage = target["model"]["w"].data_ptr()
    ckptstore.load_sharded(target, tmp_path / "c")
    assert target["model"]["w"].data_ptr() == w_storage, "tensors are filled in their existing storage"
    for k in state["model"]:
        assert _bitwise(target["model"][k], state["model"][k])
    assert target["step"] == 12 and target["name"] == "run-1"
    assert target["extra"] == {"tokens": 2**40, "lr": (1e-3, 0.9)}
    assert torch.equal(target["rng"].value, state["rng"].value)


def test_layout_on_disk_and_manifest_written_last(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    root = tmp_path / "c"
    assert sorted(os.listdir(root)) == ["data", "manifest.json", "parts"]  # a 2.0 manifest is its own index
    assert os.listdir(root / "data") == ["rank-00000.bin"]
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["kind"] == "sharded" and manifest["meta"]["world_size"] == 1
    assert manifest["format_version"] == "2.0" and manifest["tensors"]["model/w"]["writer"] == 0
    assert [p[0] for p in manifest["parts"]] == ["parts/rank-00000.json"]
    w = json.loads((root / "parts" / "rank-00000.json").read_text())["chunks"]["model/w"][0]
    assert w["file"] == "data/rank-00000.bin" and len(w["block_checksums"]) == 3  # 12 MB in 4 MiB blocks
    assert os.path.getmtime(root / "manifest.json") >= os.path.getmtime(root / "data" / "rank-00000.bin")


def test_a_directory_without_manifest_is_not_a_checkpoint(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    os.unlink(tmp_path / "c" / "manifest.json")
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="never committed"):
        ckptstore.load_sharded(_zeros_like(_state()), tmp_path / "c")
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="manifest.json does not exist"):
        ckptstore.load_sharded({}, tmp_path / "nothing")


def test_existing_checkpoint_needs_overwrite(tmp_path):
    first = _state()
    ckptstore.save_sharded(first, tmp_path / "c")
    second = _state()
    second["step"] = 13
    with pytest.raises(ckptstore.CheckpointError, match="overwrite=True"):
        ckptstore.save_sharded(second, tmp_path / "c")
    target = _zeros_like(first)
    ckptstore.load_sharded(target, tmp_path / "c")
    assert target["step"] == 12, "the refused save left the old checkpoint intact"
    ckptstore.save_sharded(second, tmp_path / "c", overwrite=True)
    ckptstore.load_sharded(target, tmp_path / "c")
    assert target["step"] == 13


def test_partial_load_reads_only_what_is_asked(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    os.unlink(tmp_path / "c" / "data" / "rank-00000.bin")  # any tensor read would now fail
    target = {"step": 0, "extra": {"tokens": 0}}
    ckptstore.load_sharded(target, tmp_path / "c")
    assert target == {"step": 12, "extra": {"tokens": 2**40}}


def test_missing_keys_are_listed_unless_strict_false(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    target = {"model": {"w": torch.zeros(3000, 1000), "nope": torch.zeros(2)}, "also_missing": 1}
    with pytest.raises(ckptstore.CheckpointError, match=r"lacks 2 key\(s\).*\['model'\]\['nope'\].*\['also_missing'\]"):
        ckptstore.load_sharded(target, tmp_path / "c")
    ckptstore.load_sharded(target, tmp_path / "c", strict=False)
    assert _bitwise(target["model"]["w"], _state()["model"]["w"])
    assert torch.equal(target["model"]["nope"], torch.zeros(2)) and target["also_missing"] == 1


def test_shape_or_dtype_mismatch_is_a_clear_error(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    with pytest.raises(ckptstore.CheckpointError, match=r"holds float32 \[7\] but the state dict has float64 \[7\]"):
        ckptstore.load_sharded({"model": {"b": torch.zeros(7, dtype=torch.float64)}}, tmp_path / "c")


def test_a_stale_index_of_an_uncommitted_checkpoint_is_removed(tmp_path):
    # An overwrite of a 1.x checkpoint that crashed between removing its manifest and its index
    # leaves the index; a new save there keeps the old data files (it names its own beside them),
    # so a reader that trusted the index would load the old values, every checksum matching.
    from v1_writer import downgrade

    root = tmp_path / "c"
    ckptstore.save_sharded({"w": torch.zeros(64)}, root)
    downgrade(root, index=True)
    (root / "manifest.json").unlink()
    ckptstore.save_sharded({"w": torch.ones(64)}, root)
    target = {"w": torch.full((64,), 5.0)}
    ckptstore.load_sharded(target, root)
    assert torch.equal(target["w"], torch.ones(64))  # not the zeros the stale index names
    assert not (root / "index.json").exists()


def test_flipped_byte_names_the_rank_file_and_the_key(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    chunk = manifest["tensors"]["model/w"]["chunks"][0]
    path = tmp_path / "c" / "data" / "rank-00000.bin"
    data = bytearray(path.read_bytes())
    data[chunk["offset"] + 9_000_000] ^= 0x10  # inside the third 4 MiB block
    path.write_bytes(bytes(data))
    with pytest.raises(ckptstore.CorruptCheckpointError, match=r"data/rank-00000.bin") as info:
        ckptstore.load_sharded({"model": {"w": torch.zeros(3000, 1000)}}, tmp_path / "c")
    assert info.value.key == "model/w"
    # Other tensors in the same file are unaffected and still load.
    target = {"model": {"b": torch.zeros(7)}}
    ckptstore.load_sharded(target, tmp_path / "c")
    assert _bitwise(target["model"]["b"], _state()["model"]["b"])


def test_truncated_or_missing_data_file_is_corruption(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "c")
    path = tmp_path / "c" / "data" / "rank-00000.bin"
    with open(path, "r+b") as fh:
        fh.truncate(5_000_000)
    with pytest.raises(ckptstore.CorruptCheckpointError, match=r"rank-00000.bin is truncated .*'model/w'"):
        ckptstore.load_sharded({"model": {"w": torch.zeros(3000, 1000)}}, tmp_path / "c")
    os.unlink(path)
    with pytest.raises(ckptstore.CorruptCheckpointError, match=r"rank-00000.bin is missing.*'model/w'"):
        ckptstore.load_sharded({"model": {"w": torch.zeros(3000, 1000)}}, tmp_path / "c")


def test_load_into_empty_slots_allocates(tmp_path):
    state = _state()
    ckptstore.save_sharded(state, tmp_path / "c")
    target = {"model": {"w": None, "b": None}}
    ckptstore.load_sharded(target, tmp_path / "c")
    assert _bitwise(target["model"]["w"], state["model"]["w"])


def test_round_trip_through_s3(s3):
    url = f"s3://{s3['bucket']}/{s3['prefix']}/sharded"
    state = _state()
    ckptstore.save_sharded(state, url, storage_options=s3["storage_options"])
    target = _zeros_like(state)
    ckptstore.load_sharded(target, url, storage_options=s3["storage_options"], buffer_bytes=2 << 20)
    for k in state["model"]:
        assert _bitwise(target["model"][k], state["model"][k])
    assert target["step"] == 12 and torch.equal(target["rng"].value, state["rng"].value)


def test_the_same_tensor_twice_loads_as_one_tensor_into_empty_slots(tmp_path):
    shared = torch.arange(6.0)
    ckptstore.save_sharded({"a": shared, "b": shared}, tmp_path / "c")
    target = {"a": None, "b": None}
    ckptstore.load_sharded(target, tmp_path / "c")
    assert target["a"] is target["b"] and torch.equal(target["a"], shared)


def test_a_whole_subtree_loads_where_the_caller_has_none(tmp_path):
    # A fresh optimizer has no state yet: the saved subtree (tensors, tuples, nested dicts) replaces
    # the caller's None instead of leaking internal references.
    saved = {"opt": {"state": {0: {"exp_avg": torch.arange(4.0), "step": torch.tensor(3.0)}}, "pair": (1, torch.ones(2))},
             "w": torch.randn(3)}
    ckptstore.save_sharded(saved, tmp_path / "c")
    target = {"opt": None, "w": torch.zeros(3)}
    ckptstore.load_sharded(target, tmp_path / "c")
    assert torch.equal(target["opt"]["state"][0]["exp_avg"], torch.arange(4.0))
    assert torch.equal(target["opt"]["state"][0]["step"], torch.tensor(3.0))
    assert target["opt"]["pair"][0] == 1 and torch.equal(target["opt"]["pair"][1], torch.ones(2))
    assert torch.equal(target["w"], saved["w"])
