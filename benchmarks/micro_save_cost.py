"""A steady save's two per-tensor costs on the trainer's thread, timed alone at 10,000 tensors.

- the fingerprint of a state (``planning.flatten.fingerprint``) and its comparison with the last
  save's key, for DTensors (a one-rank gloo mesh in this process) and plain tensors: best of 15;
- ``RamTier.stage`` of a reused layout with sources vouched for (the pipeline's ``plain``), the
  gather of small sources against a memmove each, interleaved in one process: medians.

Thread CPU, so the figures hold up better than wall time on shared cores; run it from each tree to
compare (``PYTHONPATH=<tree> python benchmarks/micro_save_cost.py``; a tree without the gather
times the memmove twice).

    python benchmarks/micro_save_cost.py [--tensors 10000]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile
import time
import uuid

import torch
import torch.distributed as dist


def best(fn, rounds: int = 15) -> float:
    out = float("inf")
    for _ in range(rounds):
        c = time.thread_time()
        fn()
        out = min(out, time.thread_time() - c)
    return out


def fingerprints(n: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptstore.planning.flatten import fingerprint

    init = os.path.join(tempfile.mkdtemp(), "init")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        states = {
            "dtensor": {f"l.{i}.w": DTensor.from_local(torch.full((2, 8), float(i)), mesh, [Shard(0)], run_check=False)
                        for i in range(n)},
            "plain": {f"l.{i}.w": torch.full((2, 8), float(i)) for i in range(n)},
        }
        for name, state in states.items():
            key = fingerprint(state, None, DTensor)[1]  # type: ignore[index]
            s = best(lambda state=state, key=key: fingerprint(state, None, DTensor)[1] == key)  # type: ignore[index]
            print(f"fingerprint + comparison, {n} {name}: {s * 1e3:.2f} ms")
    finally:
        dist.destroy_process_group()


def staging(n: int) -> None:
    from ckptstore.tiers import ram

    items = [(f"l.{i}.w", torch.full((2, 8), float(i))) for i in range(n)]
    job = f"microsave-{uuid.uuid4().hex[:8]}"
    tier = ram.RamTier(job, 0, ram_dir="/dev/shm")
    layout = ram.Layout.of(items)
    has_gather = hasattr(ram, "_GATHER_MAX")
    times: dict[str, list[float]] = {"gather": [], "memmove": []}
    try:
        for step in range(1, 41):
            mode = "gather" if step % 2 else "memmove"
            if has_gather:
                ram._GATHER_MAX = 1024 if mode == "gather" else 0  # type: ignore[attr-defined]
            c = time.thread_time()
            tier.stage(step, items, layout=layout, plain=True)
            times[mode].append(time.thread_time() - c)
            tier._by_step.pop(step, None)
    finally:
        tier.close(unlink=True)
        for path in glob.glob(f"/dev/shm/*{job}*"):
            os.unlink(path)
    for mode, values in times.items():
        print(f"RamTier.stage, {n} tensors of 64 B, {mode if has_gather else 'memmove'}: "
              f"median {statistics.median(values[4:]) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    fingerprints(args.tensors)
    staging(args.tensors)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
