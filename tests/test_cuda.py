"""The CUDA paths: pinned RAM-tier slots, device-to-host copies on a side stream, restores into
device tensors. These run only where a GPU is present (CI machines have none; the device
benchmark script runs them first on a GPU machine, see benchmarks/bench_cuda.py)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from conftest import tensor_bytes, wipe_ram

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.checkpoint import transfer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(512, 384, device="cuda", generator=g)
    state = {
        "model": {
            "w": w,
            "w_t": torch.randn(384, 512, device="cuda", generator=g).t(),  # non-contiguous
            "bf16": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
            "fp16": torch.randn(33, 7, device="cuda", generator=g).half(),
            "i64": torch.randint(-(2**40), 2**40, (257,), device="cuda", generator=g),
            "mask": torch.rand(99, device="cuda", generator=g) > 0.5,
            "empty": torch.empty(0, 5, device="cuda"),
            "scalar": torch.tensor(3.5, device="cuda"),
            "cpu": torch.arange(10, dtype=torch.float64),  # a CPU tensor beside device ones
        },
        "step": seed,
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["model"]["fp8"] = torch.randn(64, device="cuda", generator=g).to(torch.float8_e4m3fn)
    return state


def _zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}


def _expected(state: dict) -> dict:
    return {"model": {k: v.detach().cpu().clone() for k, v in state["model"].items()}, "step": state["step"]}


def _assert_same(got: dict, want: dict, device: str, cpu_key_on: str = "cpu") -> None:
    assert got["step"] == want["step"]
    for k, w in want["model"].items():
        g = got["model"][k]
        assert g.device.type == (device if k != "cpu" else cpu_key_on), k
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(tensor_bytes(g.cpu()), tensor_bytes(w)), k


def test_snapshot_is_taken_when_save_returns_even_if_the_trainer_writes_right_after(job, tmp_path):
    state = _state(1)
    want = _expected(state)
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        handle = store.save(1, state)
        with torch.no_grad():  # the next optimizer step, queued at once on the trainer's stream
            for v in state["model"].values():
                if v.is_floating_point() and v.numel() and v.element_size() > 1:  # fp8 has no add kernel
                    v.add_(1.0)
                elif v.dtype == torch.int64:
                    v.add_(1)
        handle.wait("local")
        assert all(s.pinned for s in store.ram._slots.values())  # page-locked slots: asynchronous DMA
        target = _zeros_like(want)
        target["model"] = {k: v.to("cuda") if k != "cpu" else v for k, v in target["model"].items()}
        assert store.restore(target) == 1
    _assert_same(target, want, "cuda")


def test_save_waits_for_the_kernels_that_produce_the_tensors(job, tmp_path):
    """No synchronize before save: the side stream must wait for the work the trainer queued."""
    x = torch.randn(4096, 4096, device="cuda")
    w = torch.randn(4096, 4096, device="cuda") / 64
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        for _ in range(20):
            x = torch.tanh(x @ w)
        store.save(1, {"x": x}).wait("local")
        want = x.cpu()
        target = {"x": torch.zeros_like(x)}
        assert store.restore(target) == 1
    assert torch.equal(target["x"].cpu(), want)


def test_save_from_another_stream(job, tmp_path):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(10):
            x = torch.sin(x @ x.t() / 2048)
        with CheckpointStore(job, local=str(tmp_path / "local")) as store:
            store.save(1, {"x": x}).wait("local")
            want = x.cpu()
    wipe_ram(job)  # restore from the local tier this time
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        target = {"x": torch.empty_like(x)}
        assert store.restore(target) == 1
    assert torch.equal(target["x"].cpu(), want)


def test_restore_from_each_tier_into_device_tensors(job, tmp_path):
    state = _state(2)
    want = _expected(state)
    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local, durable=str(tmp_path / "durable"), durable_every=1) as store:
        store.save(2, state).wait("durable")
    for wipe in ("none", "ram", "ram+local"):
        if "ram" in wipe:
            wipe_ram(job)
        if "local" in wipe:
            shutil.rmtree(local)
        with CheckpointStore(job, local=local, durable=str(tmp_path / "durable")) as store:
            target = _zeros_like(want)
            target["model"] = {k: v.to("cuda") if k != "cpu" else v for k, v in target["model"].items()}
            assert store.restore(target) == 2, wipe
        _assert_same(target, want, "cuda")


def test_dropin_save_load_with_device_tensors(tmp_path):
    state = _state(3)
    want = _expected(state)
    path = os.path.join(tmp_path, "x.ckpt")
    ckptstore.save(state, path)
    _assert_same(ckptstore.load(path, map_location="cuda"), want, "cuda", cpu_key_on="cuda")
    _assert_same(ckptstore.load(path, map_location="cpu"), want, "cpu")
    _assert_same(ckptstore.load(path), want, "cuda")  # None: each tensor back on the device it was saved from


def test_sharded_save_load_with_device_tensors(tmp_path):
    state = _state(4)
    want = _expected(state)
    url = os.path.join(tmp_path, "sharded")
    ckptstore.save_sharded(state, url)
    target = _zeros_like(want)
    target["model"] = {k: v.to("cuda") if k != "cpu" else v for k, v in target["model"].items()}
    ckptstore.load_sharded(target, url)
    _assert_same(target, want, "cuda")


def test_train_state_restores_the_cuda_rng(job, tmp_path):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.manual_seed_all(123)
    ts = ckptstore.TrainState(model=model, optimizer=opt)
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, ts).wait("local")
    after = torch.randn(16, device="cuda")
    params = [p.detach().clone() for p in model.parameters()]
    torch.cuda.manual_seed_all(999)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        assert store.restore(ckptstore.TrainState(model=model, optimizer=opt)) == 1
    assert torch.equal(torch.randn(16, device="cuda"), after)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))


class _Recording(transfer.CudaEngine):
    """CUDA's engine, noting the host memory each copy reads."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[tuple[int, bool]] = []
        self.staged = 0

    def host(self, nbytes: int) -> torch.Tensor:
        self.staged += 1
        return super().host(nbytes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.sources.append((src.data_ptr(), src.is_pinned()))
        super().copy(dst, src)


def test_restore_from_ram_copies_straight_from_the_pinned_slot(job, tmp_path):
    state = _state(5)
    want = _expected(state)
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, state).wait("local")
        slot = next(iter(store.ram._slots.values()))
        assert slot.pinned
        lo, hi = slot.buffer.data_ptr(), slot.buffer.data_ptr() + slot.size
        target = _zeros_like(want)
        target["model"] = {k: v.to("cuda") if k != "cpu" else v for k, v in target["model"].items()}
        with transfer.use_engine(_Recording()) as engine:
            assert store.restore(target) == 1
    _assert_same(target, want, "cuda")
    assert engine.sources and engine.staged == 0
    assert all(lo <= p < hi and pinned for p, pinned in engine.sources)


def test_a_damaged_ram_slot_falls_back_to_local_into_device_tensors(job, tmp_path, caplog):
    state = _state(6)
    want = _expected(state)
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, state).wait("local")
        slot = next(iter(store.ram._slots.values()))
        tensor_bytes(slot.buffer)[slot.size // 2] ^= 0xFF
        target = _zeros_like(want)
        target["model"] = {k: v.to("cuda") if k != "cpu" else v for k, v in target["model"].items()}
        with caplog.at_level(logging.INFO, "ckptstore"):
            assert store.restore(target) == 1
    _assert_same(target, want, "cuda")
    assert "checksum mismatch" in caplog.text and "from the local tier" in caplog.text


def test_restore_waits_for_kernels_still_reading_the_tensors(job, tmp_path):
    """The copies run on a side stream: they must not overwrite a tensor that kernels queued
    before the restore still read."""
    x = torch.randn(4096, 4096, device="cuda")
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        store.save(1, {"x": torch.zeros_like(x)}).wait("local")
        before = x.clone()
        torch.cuda.synchronize()
        y = x
        for _ in range(30):  # queued, still running when restore starts
            y = torch.tanh(y @ x / 64)
        assert store.restore({"x": x}) == 1
        expected = before
        for _ in range(30):
            expected = torch.tanh(expected @ before / 64)
        assert torch.equal(y, expected)
        assert not x.any()
