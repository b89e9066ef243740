"""Sharded save/load: ckptstore.save_sharded/load_sharded against torch.distributed.checkpoint (sync)
with 1, 2 and 4 ranks, the same DTensor state, in the same run.

Each rank holds a Shard(0) slice of every tensor of the reference state (24 Linear(2048, 2048)
layers plus Adam's two moments, ~1.13 GiB in all, built shard by shard so no rank materialises the
whole model). Per world size and round, both libraries save to fresh directories, then both load
into zeroed DTensors after the page cache is dropped (both then read from disk; ckptstore's O_DIRECT
writes would otherwise leave nothing cached while DCP's buffered writes leave everything cached).
A reshard load (saved by N ranks, loaded as Shard(1)) is timed for ckptstore and DCP as well.
Times are taken on rank 0 between barriers. Loaded tensors are checked bitwise.

    python benchmarks/bench_sharded.py [--worlds 1 2 4] [--repeats 3] [--layers 24] [--out docs/benchmarks]

``--layout 2d`` saves FSDP2 over TP instead (a (dp, tp) mesh of the world's ranks, every tensor
``[_StridedShard(0, tp), Shard(0)]``, as fully_shard over a Colwise weight leaves it), and
``--layout pp`` two pipeline stages (each half of the layers on half of the ranks, ``Shard(0)`` over
its own dp sub-mesh: ranks hold different keys). Both load into the same layout, and as the reshard
into ``Shard(1)`` over a 1-D mesh of all ranks (every rank asks for every key). The planning time
reported is ckptstore's per-rank ``plan_s`` (collect, agree, decide the writes), from the manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import ckptstore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, pyplot  # noqa: E402 - shared by the benchmark scripts


def _shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for i in range(layers):
        for kind in ("w", "m", "v"):  # weight, Adam exp_avg, exp_avg_sq
            out[f"layer{i}.{kind}"] = (2048, 2048)
            out[f"layer{i}.{kind}_bias"] = (2048,)
    return out


def _values(i: int, shape, offsets, sizes, zeros: bool) -> torch.Tensor:
    if zeros:
        return torch.zeros(sizes)
    full_rows = torch.Generator().manual_seed(i)
    # Values depend on the global index only, so any layout can be checked against any other.
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)
    return base[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone() * (1.0 + i) + float(
        torch.rand((), generator=full_rows)
    )


def _local_state(shapes, mesh, rank: int, world: int, placement_dim: int, zeros: bool):
    from torch.distributed.tensor import DTensor, Shard

    from ckptstore.planning.sharding import shard_box

    state = {}
    for i, (name, shape) in enumerate(shapes.items()):
        dim = placement_dim if len(shape) > placement_dim else 0
        offsets, sizes = shard_box(shape, (world,), [("shard", dim)], (rank,))
        local = _values(i, shape, offsets, sizes, zeros)
        state[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=_stride(shape))
    return state


def _layout_state(layout: str, shapes, mesh, rank: int, world: int, zeros: bool):
    """The saved layout: FSDP2 over TP ('2d') or two pipeline stages over dp sub-meshes ('pp')."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptstore.planning.sharding import shard_boxes

    state = {}
    half = world // 2
    coordinate = mesh.get_coordinate()
    names = list(shapes)
    for i, (name, shape) in enumerate(shapes.items()):
        if layout == "2d":
            spec = [("strided", 0, half), ("shard", 0)]
            placements = [_StridedShard(0, split_factor=half), Shard(0)]
            (_, (offsets, sizes)), = shard_boxes(shape, (2, half), spec, coordinate)
            sub = mesh
        else:
            stage = i * 2 // len(names)
            if stage != coordinate[0]:
                continue  # another stage's key
            sub = mesh["dp"]
            placements = [Shard(0)]
            (_, (offsets, sizes)), = shard_boxes(shape, (half,), [("shard", 0)], (coordinate[1],))
        state[name] = DTensor.from_local(_values(i, shape, offsets, sizes, zeros), sub, placements, run_check=False,
                                         shape=shape, stride=_stride(shape))
    return state


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _drop_caches(rank: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
    dist.barrier()


def _worker(rank: int, world: int, store: str, workdir: str, layers: int, repeats: int, result: str,
            layout: str = "1d") -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    shapes = _shapes(layers)
    if layout == "1d":
        saved = lambda zeros: _local_state(shapes, mesh, rank, world, 0, zeros=zeros)  # noqa: E731
    else:
        names = ("dp", "tp") if layout == "2d" else ("pp", "dp")
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
        saved = lambda zeros: _layout_state(layout, shapes, mesh2, rank, world, zeros=zeros)  # noqa: E731
    state = saved(False)
    times: dict[str, list[float]] = {k: [] for k in ("ckptstore_save", "dcp_save", "ckptstore_load", "dcp_load",
                                                    "ckptstore_reshard_load", "dcp_reshard_load", "ckptstore_plan")}

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    for r in range(repeats):
        cdir, ddir = os.path.join(workdir, f"c{r}"), os.path.join(workdir, f"d{r}")
        order = [
            ("ckptstore", lambda c=cdir: ckptstore.save_sharded(state, c)),
            ("dcp", lambda d=ddir: dcp.save(state, checkpoint_id=d)),
        ]
        for lib, fn in order if r % 2 == 0 else order[::-1]:
            times[f"{lib}_save"].append(timed(fn))
        with open(os.path.join(cdir, "manifest.json")) as fh:
            plans = [x["timings"]["plan_s"] for x in json.load(fh)["meta"]["ranks"]]
        times["ckptstore_plan"].append(statistics.median(plans))
        for suffix, dim in (("load", 0), ("reshard_load", 1)):
            loads = []
            for lib in ("ckptstore", "dcp"):
                target = (saved(True) if suffix == "load" else _local_state(shapes, mesh, rank, world, dim, zeros=True))
                fn = (lambda t=target, c=cdir: ckptstore.load_sharded(t, c)) if lib == "ckptstore" else (
                    lambda t=target, d=ddir: dcp.load(t, checkpoint_id=d))
                loads.append((lib, fn, target))
            for lib, fn, target in loads if r % 2 == 0 else loads[::-1]:
                _drop_caches(rank)
                times[f"{lib}_{suffix}"].append(timed(fn))
                expected = saved(False) if suffix == "load" else _local_state(shapes, mesh, rank, world, dim, zeros=False)
                for name in expected:
                    assert torch.equal(target[name].to_local(), expected[name].to_local()), (lib, suffix, name)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(cdir, ignore_errors=True)
            shutil.rmtree(ddir, ignore_errors=True)
    if rank == 0:
        with open(result, "w") as fh:
            json.dump(times, fh)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layout", choices=["1d", "2d", "pp"], default="1d",
                    help="the saved layout: Shard(0) over all ranks, FSDP2 over TP, or two pipeline stages")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    nbytes = sum(int(torch.tensor(s).prod()) * 4 for s in _shapes(args.layers).values())
    if args.layout != "1d" and any(w < 2 or w % 2 for w in args.worlds):
        ap.error(f"--layout {args.layout} needs even world sizes of 2 or more")
    report: dict = {"benchmark": "sharded", "layout": args.layout, "bytes": nbytes, "GiB": nbytes / 2**30,
                    "repeats": args.repeats, "worlds": {}}
    for world in args.worlds:
        work = tempfile.mkdtemp(dir=args.dir)
        try:
            result = os.path.join(work, "result.json")
            mp.start_processes(
                _worker, args=(world, os.path.join(work, "store"), work, args.layers, args.repeats, result, args.layout),
                nprocs=world, start_method="spawn",
            )
            with open(result) as fh:
                times = json.load(fh)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        plan = times.pop("ckptstore_plan")
        med = {k: statistics.median(v) for k, v in times.items()}
        entry = {
            "seconds": times,
            "median_seconds": med,
            "ckptstore_plan_s": statistics.median(plan),
            "load_average": os.getloadavg(),
            "GB_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
            "ratios": {
                "save_speedup_vs_dcp": med["dcp_save"] / med["ckptstore_save"],
                "load_speedup_vs_dcp": med["dcp_load"] / med["ckptstore_load"],
                "reshard_load_speedup_vs_dcp": med["dcp_reshard_load"] / med["ckptstore_reshard_load"],
            },
        }
        report["worlds"][str(world)] = entry
        print(f"world size {world}: {nbytes / 2**30:.2f} GiB")
        for k, v in med.items():
            print(f"  {k:24s} {v:7.3f} s  [{min(times[k]):.3f}-{max(times[k]):.3f}]  {nbytes / v / 1e9:6.2f} GB/s")
        for k, v in entry["ratios"].items():
            print(f"  {k:30s} {v:5.2f}x")
        print(f"  ckptstore plan (median rank)   {entry['ckptstore_plan_s'] * 1e3:.1f} ms; load average {entry['load_average']}")
        # Written after every world size, so a later one that fails (4 ranks on a small machine can
        # run out of memory) leaves the finished ones behind.
        report["machine"] = machine()
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.layout == "1d" else f"-{args.layout}"
        with open(os.path.join(args.out, f"sharded{suffix}.json"), "w") as fh:
            json.dump(report, fh, indent=2)
    _plot(report, os.path.join(args.out, f"sharded{suffix}.png"))


def _plot(report: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    worlds = list(report["worlds"])
    ops = [("save", "save"), ("load", "load"), ("reshard_load", "load as Shard(1)")]
    fig, axes = plt.subplots(1, len(ops), figsize=(10, 3.6), sharey=True)
    for ax, (op, title) in zip(axes, ops):
        xs = range(len(worlds))
        ax.bar([x - 0.2 for x in xs], [report["worlds"][w]["GB_per_s"][f"dcp_{op}"] for w in worlds], 0.4, label="torch DCP")
        ax.bar([x + 0.2 for x in xs], [report["worlds"][w]["GB_per_s"][f"ckptstore_{op}"] for w in worlds], 0.4, label="ckptstore")
        ax.set_xticks(list(xs), [f"{w} rank{'s' if w != '1' else ''}" for w in worlds])
        ax.set_title(title)
    axes[0].set_ylabel("GB/s (higher is better)")
    axes[0].legend()
    fig.suptitle(f"Sharded checkpoints, {report['GiB']:.2f} GiB, {report['machine']['cpus']} CPUs, page cache dropped before loads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
