"""What a rank receives through ckptstore's collectives in save_sharded and in a resharded
load_sharded, at several world sizes, in real processes over gloo (loopback).

Each rank saves 200 row-sharded tensors (2 rows of 8 float32 apiece) and 20 replicated ones, then
loads them with pairs of ranks cutting their two saved slabs anew (a rank shares a chunk with its
pair) and every replicated tensor whole: what a rank saves and loads is the same at every (even)
world size, so what it receives should be too. Counted with ``ckptstore.collective.counting``
(bytes as the transport carries them: an all-gather pads every rank's message to the largest).
The worker is tests/coop_workers.py ``control_plane_job``, the one tests/test_coop_read.py runs.

    python benchmarks/bench_coop_bytes.py --worlds 2 4 6 8 10
    python benchmarks/bench_coop_bytes.py --plan --worlds 2 4 8 --tensors 1000

(``--plan``: what each rank of a resharded load reads through the Directory to plan it, manifest,
index and part files, and the CPU of its load_plan and of its whole load, largest over the ranks.)

(Even worlds of at most 10: tests/dist_workers.py `spawn` compares its result files in name order,
which puts ok-10 before ok-2.)

Prints, per world, the bytes rank 0 (the save's coordinator) and the other ranks (the largest)
receive, and the exponent in world size fitted over the worlds given (least squares, log-log),
with each figure extrapolated to 4,096 ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def fit(worlds: list[int], values: list[float]) -> tuple[float, float]:
    """(exponent, value at 4,096 ranks) of a power law through the points."""
    xs, ys = [math.log(w) for w in worlds], [math.log(max(v, 1)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0
    return k, math.exp(my + k * (math.log(4096) - mx))


def plan_main(worlds: list[int], tensors: int) -> None:
    """--plan: what each rank of a resharded load reads to plan it (coop_workers.plan_bytes_job)."""
    from dist_workers import spawn

    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as d:
            tmp = pathlib.Path(d)
            out = tmp / "plan"
            out.mkdir()
            spawn(world, "coop_workers:plan_bytes_job", tmp, url=str(tmp / "ckpt"), out=str(out), tensors=tensors)
            got = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
        row = {"world": world, "read_max": max(g["read"] for g in got), "parts_max": max(g["parts"] for g in got),
               "plan_cpu_max": max(g["plan_cpu"] for g in got), "load_cpu_max": max(g["load_cpu"] for g in got)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(rows) > 1:
        ws = [r["world"] for r in rows]
        for name in ("read_max", "parts_max", "plan_cpu_max", "load_cpu_max"):
            k, at = fit(ws, [r[name] * (1e6 if "cpu" in name else 1) for r in rows])
            at = at / 1e6 if "cpu" in name else at
            print(f"{name}: exponent {k:.2f} in ranks; at 4,096 ranks x {tensors} tensors: {at:.4g}"
                  f" (x {10000 / tensors:.0f} for 10,000 tensors, linear in tensors: {at * 10000 / tensors:.4g})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--plan", action="store_true", help="per-rank planning reads and CPU of a resharded load")
    ap.add_argument("--tensors", type=int, default=1000, help="with --plan: row-sharded tensors")
    args = ap.parse_args()
    if args.plan:
        plan_main(args.worlds, args.tensors)
        return
    from dist_workers import spawn

    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as d:
            tmp = pathlib.Path(d)
            out = tmp / "traffic"
            out.mkdir()
            spawn(world, "coop_workers:control_plane_job", tmp, url=str(tmp / "ckpt"), out=str(out))
            got = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
        row = {"world": world, "save_rank0": got[0]["save"], "save_others": max(g["save"] for g in got[1:]),
               "load_max": max(g["load"] for g in got), "load_rank0": got[0]["load"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    worlds = [r["world"] for r in rows]
    print(f"{'figure':<14}" + "".join(f"{w:>10}" for w in worlds) + f"{'exponent':>10}{'at 4096':>14}")
    for name in ("save_rank0", "save_others", "load_rank0", "load_max"):
        values = [r[name] for r in rows]
        k, at = fit(worlds, values) if len(rows) > 1 else (0.0, values[0])
        print(f"{name:<14}" + "".join(f"{v:>10}" for v in values) + f"{k:>10.2f}{at:>14,.0f}")


if __name__ == "__main__":
    main()
