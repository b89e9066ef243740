"""What a restore that falls back past a newer step costs, and whether the job can go on: one
process, a store with RAM (its own tmpfs directory), local and durable (a directory) tiers, a state
of ``--mib`` MiB in ``--tensors`` tensors. Steps 5 and 10 are saved on every tier, every copy of step
10 is then damaged (a byte flipped in each data file and RAM segment), and a new store restores
(step 5) and saves step 10 again. Figures per round: the restore's CPU seconds (this process, all
threads) and wall seconds, the bytes the tiers hold of step 10 before and after the restore, and
whether the save of step 10 was accepted; then the same for a restart that restores the newest
step (nothing to drop), which must cost what it did.

    python benchmarks/bench_dead_branch.py [--mib 64] [--tensors 64] [--rounds 3] [--dir DIR]

Before and after a change, in one run: PYTHONPATH=<other tree> on a second run. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid

import torch

import ckptstore
from ckptstore.tiers.segments import inventory


def _state(mib: int, tensors: int, step: int, run: int = 0) -> dict:
    n = mib * (1 << 20) // 4 // tensors
    return {f"t{i}": torch.full((n,), float(1000 * run + step + i)) for i in range(tensors)}


def _flip(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))


def _step_bytes(root: str, step: int) -> int:
    where = os.path.join(root, f"step-{step:012d}")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(where) for f in fs)


def _round(base: str, mib: int, tensors: int) -> dict:
    job = f"bench-dead-{uuid.uuid4().hex[:8]}"
    ram = f"/dev/shm/{job}-ram"
    os.makedirs(ram)
    local, durable = os.path.join(base, job, "local"), os.path.join(base, job, "durable")
    opts = dict(local=local, durable=durable, durable_every=1, keep_local=None, ram_dir=ram)
    out: dict = {}
    try:
        with ckptstore.CheckpointStore(job, **opts) as store:
            for step in (5, 10):
                store.save(step, _state(mib, tensors, step)).wait("durable")
            store.close(keep_ram=True)
        for r in inventory(ram, job, owners=False):
            if r.step == 10:
                for p in r.paths:
                    if not p.endswith(".json"):
                        _flip(p)
        for root in (local, durable):
            data = os.path.join(root, "step-000000000010", "data")
            for name in os.listdir(data):
                _flip(os.path.join(data, name))
        out["step10_bytes_before"] = _step_bytes(local, 10) + _step_bytes(durable, 10)
        with ckptstore.CheckpointStore(job, **opts) as store:
            target = _state(mib, tensors, 0, run=-1)
            c0, w0 = time.process_time(), time.perf_counter()
            out["restored"] = store.restore(target)
            out["fallback_cpu_s"] = round(time.process_time() - c0, 4)
            out["fallback_wall_s"] = round(time.perf_counter() - w0, 4)
            out["step10_bytes_after"] = _step_bytes(local, 10) + _step_bytes(durable, 10)
            aside = os.path.join(local, "damaged")
            out["set_aside_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(aside) for f in fs)
            try:
                store.save(10, _state(mib, tensors, 10, run=1)).wait("durable")
                out["save_10"] = "accepted"
            except ckptstore.InvalidArgumentError as exc:
                out["save_10"] = f"refused: {str(exc)[:60]}"
            store.close(keep_ram=True)
        with ckptstore.CheckpointStore(job, **opts) as store:
            target = _state(mib, tensors, 0, run=-1)
            c0, w0 = time.process_time(), time.perf_counter()
            out["newest_restored"] = store.restore(target)
            out["newest_cpu_s"] = round(time.process_time() - c0, 4)
            out["newest_wall_s"] = round(time.perf_counter() - w0, 4)
            out["newest_is_new_10"] = bool(torch.equal(target["t0"], _state(mib, tensors, 10, run=1)["t0"]))
            store.close()
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(os.path.join(base, job), ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-dead-", dir=args.dir)
    try:
        rounds = [_round(base, args.mib, args.tensors) for _ in range(args.rounds)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k.endswith("_s")}
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(json.dumps({"ckptstore": ckptstore.__file__, "loadavg": load,
                      "rounds": rounds, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
