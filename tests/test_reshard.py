"""Offline resharding (`ckptstore reshard`): N even Shard(0) ranks, or one consolidated file."""

from __future__ import annotations

import json

import pytest
import torch

import ckptstore
from ckptstore.checkpoint.reshard import reshard
from ckptstore.cli import main


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {
            "w": torch.randn(1000, 300, generator=g),
            "emb": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 4),
        },
        "step": 17,
        "rng": ckptstore.PerRank(torch.get_rng_state()),
    }


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _zeros(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_reshard_to_n_even_ranks(tmp_path, ranks):
    state = _state()
    ckptstore.save_sharded(state, tmp_path / "src")
    report = reshard(str(tmp_path / "src"), str(tmp_path / "dst"), ranks)
    assert report["dropped_per_rank"] == ["rng"]
    manifest = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    assert manifest["meta"]["world_size"] == ranks
    # Each rank's file holds one contiguous region of rows: Shard(0) boxes in rank order.
    rows = 1000
    step = -(-rows // ranks)
    for c in manifest["tensors"]["model/w"]["chunks"]:
        r = int(c["file"].split("-")[1].split(".")[0])
        assert r * step <= c["offsets"][0] < (r + 1) * step
    target = _zeros(state)
    ckptstore.load_sharded(target, tmp_path / "dst")
    for k, v in state["model"].items():
        assert _bitwise(target["model"][k], v), k
    assert target["step"] == 17


def test_chunks_are_bounded_for_streaming(tmp_path):
    state = _state()
    ckptstore.save_sharded(state, tmp_path / "src")
    reshard(str(tmp_path / "src"), str(tmp_path / "dst"), 2, max_chunk_bytes=100_000, buffer_bytes=200_000)
    manifest = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    chunks = manifest["tensors"]["model/w"]["chunks"]
    assert max(c["length"] for c in chunks) <= 100_000
    assert len(chunks) >= 12  # 1.2 MB in chunks of at most 100 kB
    target = _zeros(state)
    ckptstore.load_sharded(target, tmp_path / "dst")
    assert _bitwise(target["model"]["w"], state["model"]["w"])


def test_consolidating_a_single_rank_checkpoint_keeps_its_per_rank_value(tmp_path):
    state = _state()
    ckptstore.save_sharded(state, tmp_path / "src")
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "one.ckpt"), "--ranks", "1"]) == 0
    loaded = ckptstore.load(tmp_path / "one.ckpt")
    assert torch.equal(loaded["rng"], state["rng"].value), "a single rank's value is kept in the consolidated file"
    for k, v in state["model"].items():
        assert _bitwise(loaded["model"][k], v), k
    assert loaded["step"] == 17


def test_consolidate_a_multi_rank_checkpoint(tmp_path):
    state = _state()
    ckptstore.save_sharded(state, tmp_path / "src")
    reshard(str(tmp_path / "src"), str(tmp_path / "four"), 4)
    assert main(["reshard", str(tmp_path / "four"), str(tmp_path / "one.ckpt"), "--ranks", "1"]) == 0
    loaded = ckptstore.load(tmp_path / "one.ckpt")
    for k, v in state["model"].items():
        assert _bitwise(loaded["model"][k], v), k


def test_existing_destination_is_refused_and_untouched(tmp_path, capsys):
    ckptstore.save_sharded(_state(), tmp_path / "src")
    (tmp_path / "one.ckpt").write_bytes(b"precious")
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "one.ckpt"), "--ranks", "1"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "one.ckpt").read_bytes() == b"precious"
    reshard(str(tmp_path / "src"), str(tmp_path / "dst"), 2)
    with pytest.raises(ckptstore.CheckpointError, match="already holds a checkpoint"):
        reshard(str(tmp_path / "src"), str(tmp_path / "dst"), 2)


def test_bad_rank_count(tmp_path):
    ckptstore.save_sharded(_state(), tmp_path / "src")
    with pytest.raises(ckptstore.InvalidArgumentError, match="at least 1"):
        reshard(str(tmp_path / "src"), str(tmp_path / "dst"), 0)
