"""Hugging Face with a CheckpointStore: a transformers Trainer snapshots into the store's tiers
through ckptstore.hf.CheckpointCallback (no checkpoint-N directories written by the Trainer), the
run resumes from the store through the Trainer's own resume_from_checkpoint and matches an
uninterrupted run bitwise, and the final weights are exported as safetensors shards with an index
that from_pretrained loads.

    python examples/hf_trainer.py           # CPU, a tiny config-built Llama, no downloads;
                                            # needs pip install 'ckptstore[hf]'
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
import warnings

import torch

import ckptstore
import ckptstore.hf

transformers = ckptstore._adapters.require("transformers", "hf", "examples/hf_trainer.py")


def config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def train(out: str, *, callbacks=(), resume: str | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config())
    args = transformers.TrainingArguments(output_dir=out, max_steps=8, per_device_train_batch_size=8,
                                          save_strategy="no", report_to=[], use_cpu=True, seed=0,
                                          logging_strategy="no", disable_tqdm=True, learning_rate=3e-3)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks)).train(
        resume_from_checkpoint=resume)
    return model


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    job = f"example-hf-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as root:
        try:
            straight = train(os.path.join(root, "straight"))
            local = os.path.join(root, "local")
            with ckptstore.CheckpointStore(job, local=local) as store:
                train(os.path.join(root, "run"), callbacks=[ckptstore.hf.CheckpointCallback(store, every=4)])
            print("local tier:", sorted(os.listdir(local)))

            # A new process after a crash at step 6: resume from the snapshot of step 4.
            with ckptstore.CheckpointStore(job, local=local) as store:
                ckptstore.hf.write_trainer_checkpoint(store, os.path.join(root, "resume"), step=4)
                resumed = train(os.path.join(root, "resumed"), resume=os.path.join(root, "resume"), seed=1)
                same = all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(),
                                                              resumed.state_dict().values()))
                print(f"resumed run vs uninterrupted run: {'bitwise equal' if same else 'MISMATCH'}")
                # The newest step as sharded safetensors + index, loaded back by from_pretrained.
                export = os.path.join(root, "export")
                ckptstore.hf.export_step(store, export, max_shard_size="100KB")
            config().save_pretrained(export)
            print("exported:", sorted(os.listdir(export)))
            loaded = transformers.LlamaForCausalLM.from_pretrained(export)
            exported = all(torch.equal(loaded.state_dict()[k], v) for k, v in straight.state_dict().items())
            print(f"from_pretrained of the export: {'bitwise equal' if exported else 'MISMATCH'}")
            return 0 if same and exported else 1
        finally:
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"ckptstore-{job}-"):
                    os.unlink(os.path.join("/dev/shm", name))


if __name__ == "__main__":
    sys.exit(main())
