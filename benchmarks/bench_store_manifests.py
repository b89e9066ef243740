"""The store's local and durable manifests, and what the durable coordinator receives, by ranks and tensors.

Real processes on gloo over loopback (benchmarks/bench_ranks.py's threaded harness has no
point-to-point sends, which the durable commit now uses). Each rank of a world saves one step of
``--tensors`` Shard(0) DTensors (shape (2 x world, 8)) plus ``--plain`` replicated plain tensors
(4 x 8) through a CheckpointStore with a local tier and a durable tier (directories under
``--dir``, every save promoted), counting with ``ckptstore.collective.counting`` what each rank
receives through the durable group during the save (rank 0's is the coordinator's: every rank's
part summary; the padded size where a gather pads), and records both manifests' sizes. Runs
against whatever ``ckptstore`` is importable (``PYTHONPATH``), so the same script measures
before and after a change.

    python benchmarks/bench_store_manifests.py --worlds 2 4 --tensors 100 1000 --plain 0 --out /tmp/m.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any


def rank_main(rank: int, world: int, init: str, root: str, tensors: int, plain: int, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore import CheckpointStore
    from ckptstore.collective import counting

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    state: dict[str, Any] = {f"layers.{i}.w": distribute_tensor(torch.randn(2 * world, 8, generator=g), mesh, [Shard(0)])
                             for i in range(tensors)}
    state.update({f"plain.{i}": torch.randn(4, 8, generator=g) for i in range(plain)})
    job = f"benchmanifests-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    ram = os.path.join(root, f"ram-{rank}")
    os.makedirs(ram, exist_ok=True)
    try:
        with CheckpointStore(job, local=os.path.join(root, "local"), durable=os.path.join(root, "durable"),
                             durable_every=1, ram_dir=ram) as store:
            store.save(1, state).wait("durable")  # a first save: the structure's plans are made
            with counting() as traffic:
                c0 = time.process_time()
                store.save(2, state).wait("durable")
                cpu = time.process_time() - c0
            dist.barrier()
    finally:
        for name in os.listdir(ram):
            os.unlink(os.path.join(ram, name))
    step = "step-000000000002"
    doc = {"rank": rank, "durable_recv_bytes": traffic.by_role.get("durable", 0), "save_process_cpu_s": cpu}
    if rank == 0:
        for tier in ("local", "durable"):
            path = os.path.join(root, tier, step, "manifest.json")
            with open(path, "rb") as fh:
                body = fh.read()
            doc[f"{tier}_manifest_bytes"] = len(body)
            doc[f"{tier}_format"] = json.loads(body)["format_version"]
            doc[f"{tier}_index_bytes"] = (os.path.getsize(os.path.join(root, tier, step, "index.json"))
                                          if os.path.exists(os.path.join(root, tier, step, "index.json")) else 0)
    with open(out, "w") as fh:
        json.dump(doc, fh)
    dist.destroy_process_group()


def cell(world: int, tensors: int, plain: int, where: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="bench-manifests-", dir=where)
    try:
        init = os.path.join(root, "init")
        outs = [os.path.join(root, f"out-{r}.json") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--init", init,
                                   "--root", root, "--tensors", str(tensors), "--plain", str(plain), "--out", outs[r]])
                 for r in range(world)]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"ranks exited with {codes}")
        ranks = []
        for o in outs:
            with open(o) as fh:
                ranks.append(json.load(fh))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = ranks[0]
    return {"world": world, "tensors": tensors, "plain": plain,
            "committer_recv_bytes": first["durable_recv_bytes"],
            "committer_recv_bytes_per_other_rank": round(first["durable_recv_bytes"] / max(1, world - 1)),
            **{k: first[k] for k in first if k.endswith(("_manifest_bytes", "_format", "_index_bytes"))},
            "rank0_save_process_cpu_s": round(first["save_process_cpu_s"], 3),
            "loadavg": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--plain", type=int, nargs="+", default=[0], help="replicated plain tensors per rank")
    ap.add_argument("--dir", default="/dev/shm", help="where the tiers go (tmpfs: the disk stays out)")
    ap.add_argument("--out", default=None, help="write the cells as JSON here")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.init, args.root, args.tensors[0], args.plain[0], args.out)
        return 0
    cells = []
    for plain in args.plain:
        for world in args.worlds:
            for tensors in args.tensors:
                c = cell(world, tensors, plain, args.dir)
                print(json.dumps(c), flush=True)
                cells.append(c)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"argv": sys.argv[1:], "cells": cells}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
