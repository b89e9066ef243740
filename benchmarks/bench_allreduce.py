"""The latency of one agreement flag against the number of ranks: gloo's all-reduce (a ring) and
:meth:`ckptstore.collective.Group.max_int64`'s recursive doubling, on the same processes.

A steady save issues 8 all-reduces of a few int64s (the vote, the lanes' flags: docs/benchmarks.md
"Scale: per-save exchanges"); a restore and a close a few more. Their bytes do not grow with the
world, but a ring's message steps do: 2 x (ranks - 1) one after the other. This script measures,
per world size, the wall time of one flag each way (rank 0's median over ``--blocks`` blocks of
``--ops`` flags, the two ways alternating block by block) and its process CPU (gloo's threads
included), and extrapolates to 1,024-16,384 ranks from the cost of one message step where every
rank has a core of its own and the step counts (2(n-1) against log2(p), plus 2 where the world
is not a power of two).

Real processes over gloo on loopback. On a machine with fewer cores than ranks every step waits
for the scheduler as well as the socket: those worlds show correctness and the scheduler, not a
network; the step counts are exact (tests/test_collective_doubling.py counts what each rank
receives).

    python benchmarks/bench_allreduce.py [--worlds 2 4 8 16 32] [--ops 50] [--blocks 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ring_steps(n: int) -> int:
    return 2 * (n - 1)


def doubling_steps(n: int) -> int:
    p = 1 << (n.bit_length() - 1)
    return int(math.log2(p)) + (2 if p < n else 0)


def _rank(rank: int, world: int, init: str, ops: int, blocks: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from ckptstore.collective import Group

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = Group(None)
    values = [rank, -rank, 7, rank % 3]
    expect = [world - 1, 0, 7, min(2, world - 1)]

    def ring() -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def doubling() -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        group._doubling_max(t)
        return [int(v) for v in t.tolist()]

    times: dict[str, list[float]] = {"ring": [], "doubling": [], "ring_cpu": [], "doubling_cpu": []}
    for fn in (ring, doubling):  # warm both: the first messages open gloo's pairs
        for _ in range(3):
            got = fn()
            if got != expect:
                raise AssertionError(f"{fn.__name__} at {world} ranks: {got} != {expect}")
    for block in range(blocks):
        for fn in (ring, doubling) if block % 2 == 0 else (doubling, ring):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(ops):
                fn()
            times[fn.__name__].append((time.perf_counter() - t0) / ops)
            times[f"{fn.__name__}_cpu"].append((time.process_time() - c0) / ops)  # gloo's threads too
    dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(times, fh)
    dist.destroy_process_group()


def measure(world: int, ops: int, blocks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(world, f"file://{os.path.join(tmp, 'rdv')}", ops, blocks, out),
                           nprocs=world, start_method="spawn")
        with open(out) as fh:
            times = json.load(fh)
    return {"world": world, "ring_steps": ring_steps(world), "doubling_steps": doubling_steps(world),
            **{f"{k}_s": statistics.median(v) for k, v in times.items()},
            **{f"{k}_all_s": v for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--ops", type=int, default=50, help="flags per timed block")
    ap.add_argument("--blocks", type=int, default=5, help="timed blocks per way (alternating)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "allreduce.json"))
    args = ap.parse_args(argv)
    cells = []
    for world in args.worlds:
        cell = measure(world, args.ops, args.blocks)
        cells.append(cell)
        print(f"{world:>5} ranks: ring {cell['ring_s'] * 1e6:9.0f} us ({cell['ring_steps']} steps, "
              f"CPU {cell['ring_cpu_s'] * 1e6:.0f} us)   doubling {cell['doubling_s'] * 1e6:9.0f} us "
              f"({cell['doubling_steps']} steps, CPU {cell['doubling_cpu_s'] * 1e6:.0f} us)", flush=True)
    doc: dict[str, Any] = {"cells": cells, "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
                           "argv": sys.argv[1:], "torch": torch.__version__}
    # Only worlds with a core per rank say what a message step costs: beyond them every step also
    # waits for the scheduler (every rank must run, in turn, on the few cores), which a job with a
    # core per rank does not.
    quiet = [c for c in cells if c["world"] <= (os.cpu_count() or 1)] or cells[:1]
    fits = {}
    for way, steps in (("ring", ring_steps), ("doubling", doubling_steps)):
        per_step = statistics.median(c[f"{way}_s"] / steps(c["world"]) for c in quiet)
        cpu_step = statistics.median(c[f"{way}_cpu_s"] / steps(c["world"]) for c in quiet)
        fits[way] = {"per_step_s": per_step, "cpu_per_step_s": cpu_step, "from_worlds": [c["world"] for c in quiet],
                     "at": {n: per_step * steps(n) for n in (1024, 4096, 16384)}}
    doc["fits"] = fits
    print(f"per message step at {fits['ring']['from_worlds']} ranks (a core each), extrapolated by the step "
          "counts; per flag, and x8 flags per steady save:")
    for way, f in fits.items():
        at = "  ".join(f"{n}: {t * 1e3:.2f} ms (x8 {8 * t * 1e3:.1f})" for n, t in f["at"].items())
        print(f"  {way:9} {f['per_step_s'] * 1e6:.0f} us a step (CPU {f['cpu_per_step_s'] * 1e6:.0f} us);  {at}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
