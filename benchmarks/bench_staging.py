"""Blocking time of a save: RAM-tier staging (reused shared-memory slots) against the memcpy floor,
torch.distributed.checkpoint.async_save with a reused DefaultStager, and torch.save, same state,
same run (the first brick of issue 4's targets: at most 1.25x the floor, no slower than DCP's
reused stager).

    python benchmarks/bench_staging.py [--layers 24] [--repeats 5] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings

import torch

from ckptstore.engine.store import CheckpointStore
from ckptstore.tiers.ram import RamTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_state, report  # noqa: E402 - shared by the benchmark scripts


def _tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    out = [(f"model/{k}", v) for k, v in state["model"].items()]
    for pid, s in state["optim"]["state"].items():
        out.extend((f"optim/{pid}/{k}", v) for k, v in s.items() if v.dim())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ram-dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    state = make_state(args.layers)
    items = _tensors(state)
    n = sum(t.numel() * t.element_size() for _, t in items)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300))
    dist.init_process_group("gloo", rank=0, world_size=1)
    work = tempfile.mkdtemp()
    job = f"bench-{uuid.uuid4().hex[:8]}"
    tier = RamTier(job, ram_dir=args.ram_dir, slots=2)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=False))
    store = CheckpointStore(job + "-store", local=os.path.join(work, "local"), keep_local=1, ram_dir=args.ram_dir)
    # Fine-tuning: the tensors of the last ~10% of the bytes are trained, the rest is frozen.
    trained: set[str] = set()
    acc = 0
    for key, t in reversed(items):
        if acc >= n * 0.1:
            break
        trained.add(key)
        acc += t.numel() * t.element_size()
    frozen_store = CheckpointStore(job + "-frozen", local=os.path.join(work, "local-frozen"), keep_local=1,
                                   ram_dir=args.ram_dir, frozen=lambda k: k not in trained, refresh_every=1000)
    by_key = dict(items)
    last_handle: list = []
    floor_bufs = [torch.empty_like(t) for _, t in items]
    counter = [0]

    def floor() -> None:
        for b, (_, t) in zip(floor_bufs, items):
            b.copy_(t)

    def ram() -> None:
        counter[0] += 1
        tier.stage(counter[0], items)

    def dcp_async() -> None:
        counter[0] += 1
        resp = dcp.async_save(state, checkpoint_id=os.path.join(work, f"a{counter[0]}"), async_stager=stager)
        resp.staging_completion.result()
        resp.upload_completion.result()  # not timed below: only staging blocks the trainer

    def store_save() -> None:
        counter[0] += 1
        last_handle[:] = [store.save(counter[0], state)]

    def frozen_save() -> None:
        counter[0] += 1
        last_handle[:] = [frozen_store.save(counter[0], state)]

    def torch_save() -> None:
        torch.save(state, os.path.join(work, "t.pt"))

    fns = {
        "memcpy_floor": floor,
        "ckptstore_ram_stage": ram,
        "ckptstore_store_save": store_save,
        "ckptstore_store_save_90pct_frozen": frozen_save,
        "dcp_async_staging_reused": dcp_async,
        "torch_save": torch_save,
    }
    results: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: first touches of slots, buffers and the stager
        fn()
        fn()
    try:
        for r in range(args.repeats):
            names = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in names:
                gc.collect()
                if name == "dcp_async_staging_reused":
                    counter[0] += 1
                    t = time.perf_counter()
                    resp = dcp.async_save(state, checkpoint_id=os.path.join(work, f"a{counter[0]}"), async_stager=stager)
                    resp.staging_completion.result()
                    results[name].append(time.perf_counter() - t)
                    resp.upload_completion.result()
                    shutil.rmtree(os.path.join(work, f"a{counter[0]}"), ignore_errors=True)
                else:
                    if name == "ckptstore_store_save_90pct_frozen":
                        with torch.no_grad():
                            for key in trained:
                                by_key[key].add_(0.0)  # a training step touched them: version moves
                    t = time.perf_counter()
                    fns[name]()
                    results[name].append(time.perf_counter() - t)
                    if name in ("ckptstore_store_save", "ckptstore_store_save_90pct_frozen"):
                        # Not timed: persisting (and retention) run in the background; let them finish
                        # so they do not overlap the next measurement.
                        last_handle[0].wait("local")
                        store._drain()
                        frozen_store._drain()

    finally:
        store.close()
        frozen_store.close()
        for f in os.listdir(args.ram_dir):
            if f.startswith((f"ckptstore-{job}-store-", f"ckptstore-{job}-frozen-")):
                os.unlink(os.path.join(args.ram_dir, f))
        stager.close()
        tier.close(unlink=True)
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    report(
        "staging",
        n,
        args.repeats,
        results,
        {
            "ram_stage_vs_memcpy_floor": med["ckptstore_ram_stage"] / med["memcpy_floor"],
            "ram_stage_vs_dcp_reused_stager": med["ckptstore_ram_stage"] / med["dcp_async_staging_reused"],
            "ram_stage_vs_torch_save": med["ckptstore_ram_stage"] / med["torch_save"],
            "store_save_vs_memcpy_floor": med["ckptstore_store_save"] / med["memcpy_floor"],
            "store_save_vs_dcp_reused_stager": med["ckptstore_store_save"] / med["dcp_async_staging_reused"],
            "store_save_90pct_frozen_vs_memcpy_floor": med["ckptstore_store_save_90pct_frozen"] / med["memcpy_floor"],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
