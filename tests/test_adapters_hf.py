"""ckptstore.hf: safetensors shards + index that from_pretrained loads bitwise, and a Trainer that
checkpoints through a CheckpointStore and resumes (through the Trainer's own resume) exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import assert_tensor_identical

import ckptstore
from ckptstore import hf

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=True)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config())


def test_sharded_export_loads_bitwise_through_from_pretrained_and_back(tmp_path):
    model = _model()
    sd = model.state_dict()
    out = tmp_path / "out"
    files = hf.export_safetensors(sd, out, max_shard_size="8KB")
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and files[-1] == "model.safetensors.index.json"
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    for f in shards:  # no shard is over the limit unless it holds a single tensor
        assert os.path.getsize(out / f) < 8_000 + 4096 or sum(v == f for v in index["weight_map"].values()) == 1

    _config().save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    for k, v in sd.items():
        assert_tensor_identical(loaded.state_dict()[k], v, k)
    back = hf.import_safetensors(out)
    assert list(back) == list(index["weight_map"])
    for k, v in sd.items():
        assert_tensor_identical(back[k], v, k)

    one = tmp_path / "one"
    assert hf.export_safetensors(sd, one) == ["model.safetensors"]  # fits one shard: no index, like save_pretrained
    for k, v in hf.import_safetensors(one).items():
        assert_tensor_identical(v, sd[k], k)


def test_existing_weights_are_kept_unless_overwrite_and_damage_is_named(tmp_path):
    sd = {"a": torch.arange(3000.0), "b": torch.ones(3000), "c": torch.zeros(10, dtype=torch.int64)}
    out = tmp_path / "out"
    hf.export_safetensors(sd, out, max_shard_size=12_000)
    before = sorted(os.listdir(out))
    with pytest.raises(ckptstore.InvalidArgumentError, match="pass overwrite=True"):
        hf.export_safetensors(sd, out)
    assert sorted(os.listdir(out)) == before
    hf.export_safetensors(sd, out, overwrite=True)  # now one file: the old shards and index go
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    hf.export_safetensors(sd, out, max_shard_size="12kB", overwrite=True)
    os.unlink(out / "model-00002-of-00003.safetensors")
    with pytest.raises(ckptstore.CorruptCheckpointError, match="model-00002-of-00003.safetensors is missing"):
        hf.import_safetensors(out)
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="no safetensors weights there"):
        hf.import_safetensors(tmp_path)
    with pytest.raises(ckptstore.UnsupportedObjectError, match="pass a flat state dict of tensors"):
        hf.export_safetensors({"a": 1}, tmp_path / "x")  # type: ignore[dict-item]
    with pytest.raises(ckptstore.InvalidArgumentError, match="'5 parsecs'"):
        hf.parse_size("5 parsecs")
    assert hf.parse_size("2GiB") == 2 * 2**30 and hf.parse_size("5GB") == 5 * 10**9


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _train(steps: int, out, *, callbacks=(), resume=None, seed: int = 0):
    model = _model(seed)
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
                                          save_strategy="no", report_to=[], use_cpu=True, seed=0,
                                          logging_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=list(callbacks)).train(
        resume_from_checkpoint=resume)
    return model


def test_trainer_checkpoints_through_the_store_and_resumes_exactly(tmp_path, job):
    pytest.importorskip("accelerate")
    straight = _train(6, tmp_path / "a")
    with ckptstore.CheckpointStore(job, local=tmp_path / "local") as store:
        _train(6, tmp_path / "b", callbacks=[hf.CheckpointCallback(store, every=3)])
    assert sorted(os.listdir(tmp_path / "local")) == ["step-000000000003", "step-000000000006"]
    from conftest import wipe_ram

    wipe_ram(job)  # resume on another node: from the local tier
    with ckptstore.CheckpointStore(job, local=tmp_path / "local") as store:
        assert hf.write_trainer_checkpoint(store, tmp_path / "resume", step=3) == 3
        assert hf.export_step(store, tmp_path / "final") == 6
    resumed = _train(6, tmp_path / "c", resume=str(tmp_path / "resume"), seed=1)
    for k, v in straight.state_dict().items():
        assert_tensor_identical(resumed.state_dict()[k], v, k)
    for k, v in hf.import_safetensors(tmp_path / "final").items():
        assert_tensor_identical(v, straight.state_dict()[k], k)
    with pytest.raises(ckptstore.InvalidArgumentError, match="every must be a positive int"):
        hf.CheckpointCallback(store, every=0)


def test_views_of_one_storage_export_as_separate_tensors(tmp_path):
    fused = torch.arange(12.0).reshape(6, 2)
    sd = {"q": fused[:2], "k": fused[2:4], "v": fused[4:], "t": fused.t()}
    hf.export_safetensors(sd, tmp_path)
    back = hf.import_safetensors(tmp_path)
    for k, v in sd.items():
        assert_tensor_identical(back[k], v.contiguous(), k)
