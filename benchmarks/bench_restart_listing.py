"""A restarted store's start and restore on one node, per rank: thread CPU and bytes of JSON parsed.

``python benchmarks/bench_restart_listing.py --world 4 --tensors 10000``: ``--world`` thread-ranks
(bench_ranks.py's threaded process group: every rank on one node, sharing /dev/shm and a local
directory) each save ``--saves`` steps of ``--tensors`` DTensors, close keeping their RAM segments,
forget every document this process parsed, then start a new store and restore (what a restarted
job does). Per rank: the start's and the restore's thread CPU, and the bytes of JSON text the rank
parsed doing both (json.loads, counted by thread). Issue 19: before, every rank parsed every RAM
document of its node and the local tier's manifest; the figures grew with the node's ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_ranks as B  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    from torch.distributed.tensor import Shard

    from ckptstore import CheckpointStore
    from ckptstore.tiers import ram

    world, tensors = args.world, args.tensors
    tmp = tempfile.mkdtemp(prefix="bench-restart-listing-")
    job = f"benchrestartlist-{os.getpid()}"
    rows, cols = 2 * world, 8
    parsed: dict[int, int] = {}
    real = json.loads

    def counted(text: Any, *a: Any, **k: Any) -> Any:
        rank = getattr(threading.current_thread(), "_bench_rank", None)
        if rank is not None:
            parsed[rank] = parsed.get(rank, 0) + len(text)
        return real(text, *a, **k)

    json.loads = counted  # type: ignore[assignment]
    results: dict[int, dict[str, Any]] = {}

    def rank_main(rank: int) -> None:
        mesh = B.mesh_of(world)
        _start, n = B.chunk_range(rows, world, rank)
        state = {f"layers.{i}.w": B.dtensor(B.fill(rank, i, (n, cols), torch.float32), mesh, Shard(0), (rows, cols))
                 for i in range(tensors)}
        local = os.path.join(tmp, "local")
        store = CheckpointStore(job, local=local, keep_local=2, ram_budget_bytes=None)
        for step in range(1, args.saves + 1):
            store.save(step, state).wait()
        store.close(keep_ram=True)
        dist.barrier()
        if rank == 0:
            ram._parsed_docs.clear()  # what a restarted process knows of the documents: nothing
            ram._checked_parts.clear()
        target = {k: B.dtensor(torch.zeros(n, cols), mesh, Shard(0), (rows, cols)) for k in state}
        dist.barrier()
        p0, c0 = parsed.get(rank, 0), time.thread_time()
        store = CheckpointStore(job, local=local, keep_local=2, ram_budget_bytes=None)
        c1 = time.thread_time()
        found = store.restore(target)
        c2, p1 = time.thread_time(), parsed.get(rank, 0)
        if found != args.saves or not all(torch.equal(target[k].to_local(), state[k].to_local()) for k in state):
            raise AssertionError(f"rank {rank}: the restore is not step {args.saves}, bitwise")
        results[rank] = {"start_cpu_s": round(c1 - c0, 3), "restore_cpu_s": round(c2 - c1, 3),
                         "json_parsed_bytes": p1 - p0}
        dist.barrier()
        store.close()

    try:
        B.WORLD.run(world, rank_main)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptstore-{job}-"):
                os.unlink(os.path.join("/dev/shm", name))
    print(json.dumps({"world": world, "tensors": tensors, "commit": B.commit_tag(),
                      "loadavg": [round(x, 2) for x in os.getloadavg()],
                      "ranks": [results[r] for r in range(world)]}))


if __name__ == "__main__":
    main()
