"""What a rank receives through ckptstore's collectives in save_sharded and in a resharded
load_sharded, at several world sizes, in real processes over gloo (loopback).

Each rank saves 200 row-sharded tensors (2 rows of 8 float32 apiece) and 20 replicated ones, then
loads them with pairs of ranks cutting their two saved slabs anew (a rank shares a chunk with its
pair) and every replicated tensor whole: what a rank saves and loads is the same at every (even)
world size, so what it receives should be too. Counted with ``ckptstore.collective.counting``
(bytes as the transport carries them: an all-gather pads every rank's message to the largest).
The worker is tests/coop_workers.py ``control_plane_job``, the one tests/test_coop_read.py runs.

    python benchmarks/bench_coop_bytes.py --worlds 2 4 6 8 10

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
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
