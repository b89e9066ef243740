"""Async saves: what blocks the training loop, and when the snapshot is safe on each tier.

Same state, same run, interleaved rounds: RAM-tier staging (reused shared-memory slots) and
CheckpointStore.save against the memcpy floor, torch.distributed.checkpoint.async_save with a
reused DefaultStager on its thread and on its process executor, and torch.save; then the time
from the call until the snapshot is committed on the local disk (all of them) and in the durable
tier (a store promoting every save to S3 on a local moto server in its own process).

    python benchmarks/bench_staging.py [--layers 24] [--repeats 5] [--no-durable] [--out docs/benchmarks]
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
from common import JOB_PREFIX, make_state, report  # noqa: E402 - shared by the benchmark scripts


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
    ap.add_argument("--dir", default=None, help="parent of the local tiers (a real disk, not tmpfs)")
    ap.add_argument("--no-durable", action="store_true", help="skip the store with a durable tier (moto S3)")
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
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300))
    dist.init_process_group("gloo", rank=0, world_size=1)
    work = tempfile.mkdtemp(dir=args.dir)
    job = f"{JOB_PREFIX}-{uuid.uuid4().hex[:8]}"
    tier = RamTier(job, ram_dir=args.ram_dir, slots=2)

    def stager() -> DefaultStager:
        return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                            use_non_blocking_copy=False))

    stagers = {"thread": stager(), "process": stager()}
    s3 = None
    if not args.no_durable:
        from ckptstore._local_s3 import start_local_s3

        s3 = start_local_s3(own_process=True)  # its own process, as a remote object store would be
    store = CheckpointStore(job + "-store", local=os.path.join(work, "local"), keep_local=1, ram_dir=args.ram_dir)
    durable_store = None
    if s3 is not None:
        durable_store = CheckpointStore(job + "-durable", local=os.path.join(work, "local-d"), keep_local=1,
                                        durable=s3.url(f"{job}/durable"), storage_options=s3.storage_options,
                                        durable_every=1, keep_durable=1, ram_dir=args.ram_dir)
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
    floor_bufs = [torch.empty_like(t) for _, t in items]
    counter = [0]
    stores = [st for st in (store, frozen_store, durable_store) if st is not None]

    # Each variant returns {figure: seconds}: "" is what blocks the training loop; ":to_local" and
    # ":to_durable" when the snapshot is durable on the local disk and in the object store.
    def floor() -> dict[str, float]:
        t = time.perf_counter()
        for b, (_, src) in zip(floor_bufs, items):
            b.copy_(src)
        return {"": time.perf_counter() - t}

    def ram() -> dict[str, float]:
        counter[0] += 1
        t = time.perf_counter()
        tier.stage(counter[0], items)
        return {"": time.perf_counter() - t}

    def store_save(st, to_local: bool = True, to_durable: bool = False) -> dict[str, float]:
        counter[0] += 1
        t = time.perf_counter()
        handle = st.save(counter[0], state)
        out = {"": time.perf_counter() - t}
        if to_local:
            handle.wait("local")
            out[":to_local"] = time.perf_counter() - t
        if to_durable:
            handle.wait("durable")
            out[":to_durable"] = time.perf_counter() - t
        # Not timed: retention runs in the background; let it finish so it does not overlap the
        # next measurement.
        for other in stores:
            other._drain()
        return out

    def frozen_save() -> dict[str, float]:
        with torch.no_grad():
            for key in trained:
                by_key[key].add_(0.0)  # a training step touched them: version moves
        return store_save(frozen_store, to_local=False)

    def dcp_async(kind: str) -> dict[str, float]:
        counter[0] += 1
        path = os.path.join(work, f"a{counter[0]}")
        t = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=path, async_stager=stagers[kind],
                              async_checkpointer_type=AsyncCheckpointerType(kind))
        resp.staging_completion.result()
        blocking = time.perf_counter() - t
        resp.upload_completion.result()
        done = time.perf_counter() - t
        shutil.rmtree(path, ignore_errors=True)
        return {"": blocking, ":to_local": done}

    def torch_save() -> dict[str, float]:
        path = os.path.join(work, "t.pt")
        t = time.perf_counter()
        torch.save(state, path)
        unsynced = time.perf_counter() - t
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"": unsynced, ":to_local": time.perf_counter() - t}

    fns = {
        "memcpy_floor": floor,
        "ckptstore_ram_stage": ram,
        "ckptstore_store_save": lambda: store_save(store),
        "ckptstore_store_save_90pct_frozen": frozen_save,
        "dcp_async_thread": lambda: dcp_async("thread"),
        "dcp_async_process": lambda: dcp_async("process"),
        "torch_save": torch_save,
    }
    if durable_store is not None:
        fns["ckptstore_store_save_durable"] = lambda: store_save(durable_store, to_durable=True)
    results: dict[str, list[float]] = {}
    for fn in fns.values():  # warm-up: first touches of slots, buffers, the stagers and DCP's process
        fn()
        fn()
    try:
        for r in range(args.repeats):
            names = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in names:
                gc.collect()
                for figure, seconds in fns[name]().items():
                    results.setdefault(name + figure, []).append(seconds)
    finally:
        for st in stores:
            st.close()
        for f in os.listdir(args.ram_dir):
            if f.startswith(f"ckptstore-{job}-"):
                os.unlink(os.path.join(args.ram_dir, f))
        for st_ in stagers.values():
            st_.close()
        if s3 is not None:
            s3.stop()
        tier.close(unlink=True)
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    ratios = {
        "ram_stage_vs_memcpy_floor": med["ckptstore_ram_stage"] / med["memcpy_floor"],
        "store_save_vs_memcpy_floor": med["ckptstore_store_save"] / med["memcpy_floor"],
        "store_save_vs_dcp_thread": med["ckptstore_store_save"] / med["dcp_async_thread"],
        "store_save_vs_dcp_process": med["ckptstore_store_save"] / med["dcp_async_process"],
        "store_save_vs_torch_save": med["ckptstore_store_save"] / med["torch_save"],
        "store_save_90pct_frozen_vs_memcpy_floor": med["ckptstore_store_save_90pct_frozen"] / med["memcpy_floor"],
        "store_to_local_vs_dcp_thread_to_local": med["ckptstore_store_save:to_local"] / med["dcp_async_thread:to_local"],
        "store_to_local_vs_torch_save_fsync": med["ckptstore_store_save:to_local"] / med["torch_save:to_local"],
    }
    report("staging", n, args.repeats, results, ratios, args.out,
           note="blocking-time ratios: lower is better; ':to_local'/':to_durable' are seconds from the call until "
                "the snapshot is durable there (torch_save:to_local includes an fsync, its blocking figure not)")


if __name__ == "__main__":
    main()
