"""Lightning with tiered asynchronous checkpoints: Trainer.fit checkpoints every epoch through
ckptstore.lightning.TieredCheckpointIO (each save returns once staged in RAM), the run "crashes"
after 2 of 4 epochs, and a new Trainer resumes from the store (ckpt_path="last") and ends with
bitwise the same weights as a run that never stopped.

    python examples/lightning_resume.py     # CPU, a few seconds; needs pip install 'ckptstore[lightning]'
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import ckptstore
from ckptstore.lightning import TieredCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=16)


def fit(epochs: int, root: str, plugins=None, ckpt_path=None, seed: int = 0) -> Regressor:
    torch.manual_seed(seed)
    model = Regressor()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, plugins=plugins,
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_last=True)])
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model


def main() -> int:
    warnings.filterwarnings("ignore", module=r"lightning(\.|$)")  # its notes about this tiny CPU run
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    job = f"example-pl-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as root:
        try:
            straight = fit(4, os.path.join(root, "straight"))

            def store() -> ckptstore.CheckpointStore:
                return ckptstore.CheckpointStore(job, local=os.path.join(root, "local"))

            fit(2, os.path.join(root, "run"), plugins=[TieredCheckpointIO(store)])  # "crashes" after epoch 2
            print("local tier:", sorted(os.listdir(os.path.join(root, "local"))))
            resumed = fit(4, os.path.join(root, "run"), plugins=[TieredCheckpointIO(store)], ckpt_path="last", seed=1)
            same = all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
            print(f"resumed run vs uninterrupted run: {'bitwise equal' if same else 'MISMATCH'}")
            return 0 if same else 1
        finally:
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"ckptstore-{job}-"):
                    os.unlink(os.path.join("/dev/shm", name))


if __name__ == "__main__":
    sys.exit(main())
