"""A training process that tests/test_resume.py starts, SIGKILLs and restarts (``python resume_worker.py CONFIG``).

It trains a small model with dropout (Linear-ReLU-Dropout-Linear, Adam, StepLR) on a synthetic
regression set through a shuffled ResumableLoader, saving a TrainState to a CheckpointStore every
``every`` steps. It first restores from the store (a restart continues after the restored step).
``CONFIG`` is a JSON file:

* ``job``, ``local``, ``durable``, ``durable_every``, ``storage_options``: the CheckpointStore;
* ``num_workers``: of the DataLoader; ``seed``: of the model init, the global RNGs and the sampler;
* ``total``: train up to this step; ``every``: save cadence;
* ``log``: per step one line ``<step> <loss as float.hex()>``, flushed at once (the save of a
  saving step is staged before its line appears); lines starting with ``#`` are markers;
* ``hold_at`` (optional): after the line of this step, (``wait_tier``: wait for that step's save
  to reach that tier and write ``# waited <tier> <step>``), write ``# hold <step>`` and sleep
  until the parent kills the process;
* ``restored``: JSON written right after the restore: the restored step, the tier (from the
  store's "restored step S from the T tier" log record) and every step counter of the state;
* ``final``: ``torch.save`` of the final model and optimizer state dicts, written before the
  store is closed.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ckptstore import CheckpointStore, ResumableLoader, ResumableSampler, TrainState

DATASET_LEN = 256
BATCH_SIZE = 8
BATCHES_PER_EPOCH = DATASET_LEN // BATCH_SIZE
FEATURES = 8
HOLD_S = 120.0  # a held process exits on its own if nobody kills it (the parent died)


class Regression(Dataset):
    """``y = x @ w + small noise``, all drawn once from a private generator: ``__getitem__`` is a
    pure lookup, so the data is the same in every process and in every DataLoader worker."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(20240607)
        self.x = torch.randn(DATASET_LEN, FEATURES, generator=g)
        w = torch.randn(FEATURES, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(DATASET_LEN, 1, generator=g)

    def __len__(self) -> int:
        return DATASET_LEN

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class RestoreRecorder(logging.Handler):
    """Catches the store's INFO record "restored step S from the T tier"."""

    PATTERN = re.compile(r"restored step (\d+) from the (\w+) tier")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.found: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = self.PATTERN.search(record.getMessage())
        if m:
            self.found.append((int(m.group(1)), m.group(2)))


def build(cfg: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, Any, ResumableLoader]:
    torch.manual_seed(cfg["seed"])
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
    sampler = ResumableSampler(DATASET_LEN, batch_size=BATCH_SIZE, seed=cfg["seed"])
    loader = ResumableLoader(Regression(), sampler, num_workers=cfg["num_workers"])
    return model, opt, sched, loader


def counters(step: int | None, found: list[tuple[int, str]], opt: torch.optim.Optimizer, sched: Any,
             loader: ResumableLoader, state: TrainState) -> dict[str, Any]:
    position = loader.state_dict()
    return {
        "step": step,
        "records": found,
        "optimizer_steps": sorted({float(s["step"]) for s in opt.state_dict()["state"].values()}),
        "scheduler_last_epoch": sched.last_epoch,
        "loader": position,
        "consumed_batches": position["epoch"] * BATCHES_PER_EPOCH + position["cursor"] // BATCH_SIZE,
        "extra": state.extra,
    }


def main(config_path: str) -> None:
    with open(config_path) as fh:
        cfg = json.load(fh)
    torch.set_num_threads(1)  # the same (single-threaded) kernels in every process
    model, opt, sched, loader = build(cfg)
    state = TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, extra={"tokens_seen": 0})

    recorder = RestoreRecorder()
    logger = logging.getLogger("ckptstore")
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    shown = logging.StreamHandler(sys.stderr)  # the store's warnings and errors, for the test's failure output
    shown.setLevel(logging.WARNING)
    logger.addHandler(shown)
    store = CheckpointStore(
        cfg["job"], local=cfg["local"], durable=cfg.get("durable"), durable_every=cfg.get("durable_every", 10),
        storage_options=cfg.get("storage_options"), timeout_s=60,
    )
    restored = store.restore(state)
    with open(cfg["restored"], "w") as fh:
        json.dump(counters(restored, recorder.found, opt, sched, loader, state), fh)

    total, every, hold_at = cfg["total"], cfg["every"], cfg.get("hold_at")
    step = restored or 0
    handle = None
    with open(cfg["log"], "a") as log:
        while step < total:
            for x, y in loader:  # one pass is the rest of the current epoch
                step += 1
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                state.extra["tokens_seen"] += x.shape[0]
                if step % every == 0:
                    handle = store.save(step, state)
                log.write(f"{step} {loss.item().hex()}\n")
                log.flush()
                if step == hold_at:
                    if cfg.get("wait_tier"):
                        assert handle is not None and handle.step == step, "hold_at must be a saving step"
                        handle.wait(cfg["wait_tier"], timeout=60)
                        log.write(f"# waited {cfg['wait_tier']} {step}\n")
                    log.write(f"# hold {step}\n")
                    log.flush()
                    time.sleep(HOLD_S)
                    raise SystemExit(f"held at step {step} for {HOLD_S} s and nobody killed this process")
                if step == total:
                    break
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": dict(state.extra)}, cfg["final"])
    store.close()


if __name__ == "__main__":
    main(sys.argv[1])
