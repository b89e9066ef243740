"""Peak extra host memory per rank of a resharded load_sharded through the ranks' exchange, against
its ``buffer_bytes`` budget: what a rank holds at once, and what stays resident, should stay within
the budget plus a fixed overhead.

``--ranks`` processes over gloo (loopback) save 16 tensors of 4096 x 2048 float32 (512 MiB in all)
as ``Shard(0)`` DTensors, then, in fresh processes per budget, allocate and touch their
destinations and load the checkpoint into ``Shard(1)`` DTensors (column slices of the saved row
slabs: every rank needs a slice of every slab, so every stored byte goes through the exchange) and
into ``Replicate()`` DTensors (every rank loads every tensor whole: each slab read by one rank and
sent to the others). Each rank resets its peak
resident set size (``/proc/self/clear_refs``) once its destinations are touched and reads it back
after the load: what the load itself held at its fullest. The same for DCP's ``load`` of the same
state into the same destinations, saved by DCP. The largest rank is reported.

    python benchmarks/bench_load_memory_ranks.py [--ranks 4] [--budgets-mib 16 64 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import spawn_ranks  # noqa: E402 - shared by the benchmark scripts

ROWS, COLS, TENSORS = 4096, 2048, 16


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":")) * 1024


def _rank(rank: int, world: int, init: str, task: str, path: str, budget: int, layout: str, out: str) -> None:
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        import ckptstore
        import ckptstore.checkpoint.sharded  # noqa: F401 - imported now, not counted as the load's memory

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        if task.startswith("save"):
            g = torch.Generator().manual_seed(0)
            state = {f"t{i}": distribute_tensor(torch.randn(ROWS, COLS, generator=g), mesh, [Shard(0)])
                     for i in range(TENSORS)}
            if task == "save-ckptstore":
                ckptstore.save_sharded(state, path)
            else:
                dcp.save(state, checkpoint_id=path)
            dist.barrier()
            dist.destroy_process_group()
            return
        from torch.distributed.tensor import Replicate
        placements = [Shard(1)] if layout == "shard1" else [Replicate()]
        state = {f"t{i}": distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements) for i in range(TENSORS)}
        for t in state.values():
            t.to_local().fill_(1.0)
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # the peak resident set size starts again from here
        base = _status("VmRSS")
        if task == "load-ckptstore":
            ckptstore.load_sharded(state, path, buffer_bytes=budget)
        else:
            dcp.load(state, checkpoint_id=path)
        peak = _status("VmHWM")
        g = torch.Generator().manual_seed(0)
        for i in range(TENSORS):  # the load is checked, not only measured
            full = torch.randn(ROWS, COLS, generator=g)
            assert torch.equal(state[f"t{i}"].full_tensor(), full), (task, layout, i)
        with open(os.path.join(out, f"{task}-{layout}-{budget}-{rank}.json"), "w") as fh:
            json.dump({"extra_peak_bytes": peak - base, "local_bytes": sum(t.to_local().nbytes for t in state.values())},
                      fh)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _spawn(world: int, task: str, path: str, budget: int, layout: str, out: str) -> list[dict[str, Any]]:
    spawn_ranks(world, _rank, task, path, budget, layout, out, what=f"{task}, {layout}, budget {budget}")
    if task.startswith("save"):
        return []
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"{task}-{layout}-{budget}-{r}.json")) as fh:
            ranks.append(json.load(fh))
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--budgets-mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ckptstore-bench-loadmem-")
    mib = 1 << 20
    rows: list[dict[str, Any]] = []
    try:
        for kind in ("ckptstore", "dcp"):
            _spawn(args.ranks, f"save-{kind}", os.path.join(work, kind), 0, "", work)
        for layout in ("shard1", "replicate"):
            for budget in [b * mib for b in args.budgets_mib]:
                got = _spawn(args.ranks, "load-ckptstore", os.path.join(work, "ckptstore"), budget, layout, work)
                rows.append({"load": "ckptstore", "layout": layout, "budget_bytes": budget,
                             "extra_peak_bytes": max(g["extra_peak_bytes"] for g in got),
                             "local_bytes": max(g["local_bytes"] for g in got)})
            got = _spawn(args.ranks, "load-dcp", os.path.join(work, "dcp"), 0, layout, work)
            rows.append({"load": "dcp", "layout": layout, "budget_bytes": None,
                         "extra_peak_bytes": max(g["extra_peak_bytes"] for g in got),
                         "local_bytes": max(g["local_bytes"] for g in got)})
            for row in rows[-len(args.budgets_mib) - 1:]:
                budget = f"budget {row['budget_bytes'] / mib:5.0f} MiB" if row["budget_bytes"] else "(dcp)           "
                print(f"{row['layout']:7s} {row['load']:10s} {budget}: peak extra RSS on the fullest rank "
                      f"{row['extra_peak_bytes'] / mib:7.1f} MiB (its destinations {row['local_bytes'] / mib:.0f} MiB)",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"benchmark": "load_memory_ranks", "ranks": args.ranks, "checkpoint_bytes": ROWS * COLS * 4 * TENSORS,
              "rows": rows, "load_at_end": os.getloadavg()[0]}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    print(json.dumps({"load_at_end": result["load_at_end"]}), file=sys.stderr)


if __name__ == "__main__":
    main()
