"""Planning benchmark: the pure sharding arithmetic of save_sharded / load_sharded at job scale.

A synthetic model of ``--tensors`` 2-D tensors on a 1-D mesh of ``--ranks`` ranks: most are Shard(0)
(row counts chosen so that many split unevenly and some leave ranks empty), about ``--replicated``
of them (default 10%) are replicated on every rank. Phases, as checkpoint/sharded.py runs them:

- build: every rank's ItemMeta list (shard_box per tensor per rank). One rank builds only its own
  list; the total here is what all ranks do together, the per-rank figure is total / ranks;
- gather (estimate): the pickled size of one rank's list and its unpickle time, times ranks: what
  all_gather hands every rank before planning;
- assign_writers: once over all ranks' lists, as every rank does after the gather;
- index: the saved chunk boxes per tensor (what the manifest holds);
- load: one rank of a ``--load-ranks`` mesh resharding every tensor, with read_plan + row_span per
  target box: Shard(1) (every saved row-slab overlaps the target) and Shard(0) (mostly uneven against
  the saved cut); replicated tensors load whole.

No file, no process group, no tensor data. Prints a table and writes plan.json under --out.

    python benchmarks/bench_plan.py [--ranks 1000] [--tensors 10000] [--load-ranks 500] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import random
import resource
import sys
import time

import torch

import ckptstore
from ckptstore.planning.sharding import ItemMeta, assign_writers, read_plan, row_span, shard_box

# Row counts of the sharded tensors: transformer-like sizes, most not a multiple of 1000 or 500
# (uneven cuts), a few below the rank count (ranks with empty shards).
ROWS = [4096, 4096, 11008, 11008, 5120, 13824, 32000, 50257, 1024, 768, 3072, 8192, 2000, 1000, 997, 512]
COLS = [64, 128, 256, 512, 1024, 4096]


def make_model(tensors: int, replicated_frac: float, seed: int) -> list[tuple[str, tuple[int, int], list[tuple], int]]:
    """(key, global shape, save placements on the 1-D mesh, element size) per tensor."""
    rng = random.Random(seed)
    n_rep = round(tensors * replicated_frac)
    rep_at = set(rng.sample(range(tensors), n_rep))
    model = []
    for i in range(tensors):
        if i in rep_at:
            model.append((f"layers.{i}.norm", (rng.choice([1024, 4096, 8192]), 1), [("replicate",)], 4))
        else:
            model.append((f"layers.{i}.weight", (rng.choice(ROWS), rng.choice(COLS)), [("shard", 0)], 2))
    return model


def timed(fn, *args):
    gc.collect()
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def build_items(model, ranks: int) -> list[list[ItemMeta]]:
    mesh = (ranks,)
    out = []
    for r in range(ranks):
        c = (r,)
        metas = []
        for key, shape, placements, es in model:
            off, size = shard_box(shape, mesh, placements, c)
            metas.append(ItemMeta(key, off, size, size[0] * size[1] * es))
        out.append(metas)
    return out


def index_chunks(plan: list[list[ItemMeta]]) -> dict[str, list[tuple]]:
    chunks: dict[str, list[tuple]] = {}
    for items in plan:
        for it in items:
            chunks.setdefault(it.key, []).append((it.offsets, it.sizes))
    return chunks


def load_rank(model, chunks, load_ranks: int, rank: int, dim: int) -> dict[str, int]:
    """read_plan + row_span for every tensor of one rank of the new mesh; the sharded tensors are cut on
    ``dim`` across ``load_ranks``, the replicated ones load whole."""
    mesh = (load_ranks,)
    c = (rank,)
    new = [("shard", dim)]
    reads_total = scanned = rows = bytes_read = target_bytes = 0
    for key, shape, placements, es in model:
        target = shard_box(shape, mesh, new if placements[0][0] == "shard" else placements, c)
        boxes = chunks[key]
        reads, uncovered = read_plan(target, boxes)
        if uncovered:
            raise AssertionError(f"{key}: {uncovered} elements uncovered")
        scanned += len(boxes)
        reads_total += len(reads)
        target_bytes += target[1][0] * target[1][1] * es
        for rd in reads:
            n = row_span(rd.chunk_box, rd.overlap)[1]
            rows += n
            bytes_read += n * rd.chunk_box[1][1] * es  # whole chunk rows: the one contiguous range per read
    return {
        "targets": len(model),
        "chunks_scanned": scanned,
        "reads": reads_total,
        "rows_read": rows,
        "target_bytes": target_bytes,
        "bytes_read": bytes_read,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--replicated", type=float, default=0.1, help="fraction of tensors replicated on every rank")
    ap.add_argument("--load-ranks", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args()

    model = make_model(args.tensors, args.replicated, args.seed)
    n_rep = sum(1 for m in model if m[2][0][0] == "replicate")
    phases: dict[str, dict] = {}
    t_all = time.perf_counter()

    s, items = timed(build_items, model, args.ranks)
    n_items = sum(len(x) for x in items)
    phases["build"] = {"seconds": s, "seconds_per_rank": s / args.ranks, "items": n_items}
    print(f"build: {s:.2f} s", flush=True)

    blob = pickle.dumps(items[0], protocol=pickle.HIGHEST_PROTOCOL)
    s_loads, _ = timed(pickle.loads, blob)
    phases["gather_estimate"] = {
        "seconds": s_loads * args.ranks,
        "bytes_per_rank": len(blob),
        "bytes_gathered_per_rank": len(blob) * args.ranks,
        "note": "pickled size of rank 0's list and its unpickle time, times ranks (no process group run)",
    }

    s, plan = timed(assign_writers, items)
    written = sum(len(p) for p in plan)
    per_rank = [sum(it.nbytes for it in p) for p in plan]
    phases["assign_writers"] = {
        "seconds": s,
        "items_in": n_items,
        "boxes_written": written,
        "empty_boxes_written": sum(1 for p in plan for it in p if 0 in it.sizes),
        "max_rank_bytes": max(per_rank),
        "mean_rank_bytes": sum(per_rank) / len(per_rank),
    }
    print(f"assign_writers: {s:.2f} s", flush=True)
    del items
    gc.collect()

    s, chunks = timed(index_chunks, plan)
    phases["index"] = {"seconds": s, "chunks": written, "tensors": len(chunks)}

    rank = args.load_ranks // 2
    for name, dim in (("load_shard1", 1), ("load_shard0_uneven", 0)):
        s, counts = timed(load_rank, model, chunks, args.load_ranks, rank, dim)
        phases[name] = {"seconds": s, "load_ranks": args.load_ranks, "rank": rank, **counts}
        print(f"{name}: {s:.2f} s", flush=True)

    total = time.perf_counter() - t_all
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    report = {
        "benchmark": "plan",
        "ranks": args.ranks,
        "tensors": args.tensors,
        "sharded": args.tensors - n_rep,
        "replicated": n_rep,
        "seed": args.seed,
        "phases": phases,
        "total_seconds": total,
        "peak_rss_bytes": peak,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ckptstore": ckptstore.__version__,
            "platform": platform.platform(),
            "gc": "enabled (as in save_sharded)",
        },
        "argv": sys.argv[1:],
    }

    print()
    print(f"{args.ranks} ranks, {args.tensors} tensors ({args.tensors - n_rep} Shard(0), {n_rep} replicated)")
    print(f"{'phase':28s} {'seconds':>9s}  counts")
    p = phases
    rows = [
        ("build (all ranks)", p["build"]["seconds"], f"{p['build']['items']:,} ItemMeta"),
        ("build (per rank)", p["build"]["seconds_per_rank"], ""),
        (
            "gather decode (est.)",
            p["gather_estimate"]["seconds"],
            f"{p['gather_estimate']['bytes_gathered_per_rank'] / 2**20:,.0f} MiB pickled per rank",
        ),
        (
            "assign_writers",
            p["assign_writers"]["seconds"],
            f"{p['assign_writers']['boxes_written']:,} boxes written "
            f"({p['assign_writers']['empty_boxes_written']:,} empty)",
        ),
        ("index chunks", p["index"]["seconds"], f"{p['index']['chunks']:,} chunks"),
    ]
    for name in ("load_shard1", "load_shard0_uneven"):
        q = p[name]
        rows.append(
            (
                f"{name} (1 of {q['load_ranks']})",
                q["seconds"],
                f"{q['chunks_scanned']:,} chunks scanned, {q['reads']:,} reads, "
                f"{q['bytes_read'] / 2**20:,.0f} MiB read for {q['target_bytes'] / 2**20:,.0f} MiB held",
            )
        )
    for name, sec, note in rows:
        print(f"{name:28s} {sec:9.3f}  {note}")
    print(f"{'total':28s} {total:9.3f}  peak RSS {peak / 2**30:.2f} GiB")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "plan.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
