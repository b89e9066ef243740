"""ckptstore.lightning: a real Lightning Trainer.fit on CPU, checkpointing through a CheckpointStore,
resumes to bitwise the same parameters and optimizer state as an uninterrupted run."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import assert_tensor_identical, wipe_ram

import ckptstore
from ckptstore._adapters import MissingDependencyError, require

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptstore.lightning import TieredCheckpointIO  # noqa: E402

# Lightning's own notices (no logger, few workers, deprecations inside its pytree helpers).
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)}


def _data():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _trainer(epochs: int, root, io=None):
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_epochs=1, save_top_k=-1, save_last=True)
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(root), plugins=[io] if io else None,
                     callbacks=[ckpt])


def test_trainer_fit_resumes_bitwise_through_the_store(tmp_path, job):
    torch.manual_seed(0)
    straight = Net()
    t = _trainer(4, tmp_path / "straight")
    t.fit(straight, _data())
    expected_opt = t.optimizers[0].state_dict()

    torch.manual_seed(0)
    first = Net()
    local = tmp_path / "local"
    io = TieredCheckpointIO(lambda: ckptstore.CheckpointStore(job, local=local))
    _trainer(2, tmp_path / "run", io).fit(first, _data())
    assert io._store is None  # teardown closed the store it built, after every tier committed
    pointer = json.loads((tmp_path / "run" / "ckpts" / "last.ckpt").read_bytes())
    assert pointer["job"] == job and pointer["step"] == 3  # two saves per epoch: top-k and last
    assert sorted(os.listdir(local)) == ["step-000000000001", "step-000000000002", "step-000000000003"]

    # A new process on a new node: nothing in RAM, the local directory and the pointers are left.
    wipe_ram(job)
    torch.manual_seed(1)  # a different init, overwritten by the resume
    resumed = Net()
    io = TieredCheckpointIO(lambda: ckptstore.CheckpointStore(job, local=local))
    t = _trainer(4, tmp_path / "run", io)
    t.fit(resumed, _data(), ckpt_path="last")
    for (k, v), (k2, v2) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert k == k2
        assert_tensor_identical(v2, v, k)
    got_opt = t.optimizers[0].state_dict()
    for p, s in expected_opt["state"].items():
        for k, v in s.items():
            assert_tensor_identical(got_opt["state"][p][k], v, f"optimizer state {p}.{k}")
    assert got_opt["param_groups"][0]["lr"] == expected_opt["param_groups"][0]["lr"]


def test_pointer_errors_and_plain_checkpoint_files(tmp_path, job):
    with ckptstore.CheckpointStore(job, local=tmp_path / "local") as store:
        io = TieredCheckpointIO(store)
        io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "epoch": 1}, tmp_path / "a.ckpt")
        assert_tensor_identical(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.arange(4.0), "w")
        # A regular file loads through ckptstore.load, torch.save files included.
        torch.save({"w": torch.ones(2)}, tmp_path / "plain.ckpt")
        assert_tensor_identical(io.load_checkpoint(tmp_path / "plain.ckpt")["w"], torch.ones(2), "w")
        with pytest.raises(ckptstore.CheckpointError, match="does not exist"):
            io.load_checkpoint(tmp_path / "missing.ckpt")
        other = json.loads((tmp_path / "a.ckpt").read_bytes())
        other["job"] = "another-job"
        (tmp_path / "b.ckpt").write_text(json.dumps(other))
        with pytest.raises(ckptstore.CheckpointError, match="build the store with job='another-job'"):
            io.load_checkpoint(tmp_path / "b.ckpt")
        io.remove_checkpoint(tmp_path / "a.ckpt")
        assert not (tmp_path / "a.ckpt").exists()
        io.teardown()  # a store passed in stays open: its owner closes it
        store.save(store.last_step + 1, {"x": torch.zeros(1)})
    with pytest.raises(ckptstore.InvalidArgumentError, match="needs a CheckpointStore"):
        TieredCheckpointIO("/tmp/ckpt")  # type: ignore[arg-type]


def test_a_missing_framework_names_the_extra_to_install():
    with pytest.raises(MissingDependencyError, match=r"pip install 'ckptstore\[lightning\]'") as info:
        require("no_such_framework_xyz", "lightning", "ckptstore.lightning")
    assert isinstance(info.value, ImportError) and isinstance(info.value, ckptstore.CheckpointError)
