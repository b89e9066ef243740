"""Scale: how the drop-in and async figures grow with the state's size and with its number of tensors.

For each state (a flat dict of fp32 tensors, every byte written before the first timed round),
interleaved rounds time, same process, same run:

- ``ckptstore.save`` against ``torch.save`` followed by an fsync (both durable when they return);
- ``ckptstore.load`` against ``torch.load`` (warm: repeated in one process, file in the page cache);
- ``CheckpointStore.save``'s blocking time against the memcpy floor (``copy_`` into preallocated
  buffers); the store persists in the background and is drained (untimed) before the next variant.

Sizes sweep the total bytes at 10 tensors (``--sizes-mib``); counts sweep the number of tensors at a
fixed total (``--counts`` at ``--count-total-mib``). A size whose buffers would not fit in 3/4 of the
memory available now is skipped and says so in the JSON (state + one loaded copy); the memcpy floor and
the store (+ floor buffers + one RAM slot) are left out, with a note, where only those do not fit.

    python benchmarks/bench_scale.py [--sizes-mib 64 256 1024 4096] [--counts 10 1000 10000 100000]
                                     [--count-total-mib 64] [--repeats 3] [--dir DIR] [--out docs/benchmarks]

``--blocking`` measures only ``CheckpointStore.save``'s blocking time at ``--counts`` tensors of
``--count-total-mib`` in all, each round a fresh save of the same structure (the steady state of a
training loop): a store with the RAM tier alone and one with a local tier too, against two floors
of the same bytes in the same run, ``copy_`` per tensor into preallocated buffers (the floor the
table above uses) and one ``copy_`` of a single flat buffer (what a memcpy of those bytes costs).
It writes ``save_blocking.{json,png}`` (``--name`` for another name).

``--kinds`` adds states of other kinds at the same counts (``--kind-counts``, default ``--counts``),
in a one-rank gloo job of this process: ``dtensor``, the same tensors as DTensors ``Shard(0)`` on a
one-rank mesh, and ``train``, a ``TrainState`` of a model whose parameters are those DTensors (its
``state_dict()``, the model's state dict as torch's ``get_model_state_dict`` gives it, is part of what
``save`` blocks for, and is timed alone as ``state_dict``; its RNG states are per-rank values). The
floors copy the local tensors.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

import ckptstore
from ckptstore.engine.store import CheckpointStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JOB_PREFIX, machine, prime_page_cache, pyplot  # noqa: E402 - shared by the benchmark scripts

VARIANTS = ("torch_save_fsync", "ckptstore_save", "torch_load", "ckptstore_load", "memcpy_floor", "store_save_blocking")


def _available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _state(total: int, count: int) -> dict[str, torch.Tensor]:
    per = max(1, total // count // 4)
    return {f"layer{i:06d}.weight": torch.full((per,), float(i % 251), dtype=torch.float32) for i in range(count)}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def measure(total: int, count: int, repeats: int, work: str, ram_dir: str, with_async: bool = True) -> dict[str, Any]:
    state = _state(total, count)
    nbytes = sum(t.numel() * 4 for t in state.values())
    floor = {k: torch.empty_like(v) for k, v in state.items()} if with_async else {}
    tpath, cpath = os.path.join(work, "t.pt"), os.path.join(work, "c.ckpt")
    job = f"{JOB_PREFIX}-scale-{uuid.uuid4().hex[:8]}"
    # One slot: the store is drained between rounds, so a second one would only hold memory.
    store = CheckpointStore(job, local=os.path.join(work, "local"), keep_local=1, ram_dir=ram_dir,
                            ram_budget_bytes=nbytes + (count + 1) * 4096 + (1 << 20)) if with_async else None
    step = [0]

    def torch_save() -> None:
        torch.save(state, tpath)
        _fsync(tpath)

    def store_save() -> float:
        step[0] += 1
        t = time.perf_counter()
        assert store is not None
        handle = store.save(step[0], state)
        blocking = time.perf_counter() - t
        handle.wait("local")
        store._drain()
        return blocking

    def floor_copy() -> None:
        for k, v in state.items():
            floor[k].copy_(v)

    fns = {
        "torch_save_fsync": torch_save,
        "ckptstore_save": lambda: ckptstore.save(state, cpath),
        "torch_load": lambda: torch.load(tpath, weights_only=True),
        "ckptstore_load": lambda: ckptstore.load(cpath),
    }
    if with_async:
        fns.update(memcpy_floor=floor_copy, store_save_blocking=store_save)
    # The loads are warm, for both: ckptstore.save writes with O_DIRECT, which leaves its file out of
    # the page cache, so without this a load right after a save read from disk (torch's file stays
    # cached), which made earlier runs compare a cold ckptstore load with a warm torch one.
    primed = {"torch_load": tpath, "ckptstore_load": cpath}
    times: dict[str, list[float]] = {k: [] for k in fns}
    try:
        for fn in fns.values():  # warm-up: files exist for the loads, slots and buffers touched
            fn()
        loaded = ckptstore.load(cpath)
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), "ckptstore round trip differs"
        del loaded
        for r in range(repeats):
            names = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in names:
                gc.collect()
                if name in primed:
                    prime_page_cache(primed[name])
                t = time.perf_counter()
                out = fns[name]()
                elapsed = time.perf_counter() - t
                times[name].append(out if isinstance(out, float) else elapsed)
                del out
    finally:
        if store is not None:
            store.close()
        for f in os.listdir(ram_dir):
            if f.startswith(f"ckptstore-{job}-"):
                os.unlink(os.path.join(ram_dir, f))
        for p in (tpath, cpath):
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(os.path.join(work, "local"), ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {"save_speedup_vs_torch": med["torch_save_fsync"] / med["ckptstore_save"],
              "load_speedup_vs_torch": med["torch_load"] / med["ckptstore_load"]}
    if with_async:
        ratios["store_blocking_vs_memcpy_floor"] = med["store_save_blocking"] / med["memcpy_floor"]
    return {
        "bytes": nbytes,
        "tensors": count,
        "repeats": repeats,
        "seconds": times,
        "median_seconds": med,
        "GB_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratios": ratios,
        **({} if with_async else {"note": "memcpy floor and store variants skipped: not enough free memory for them"}),
    }


BLOCKING = ("memcpy_floor", "flat_memcpy", "store_ram", "store_ram_local")


def _kind_state(kind: str, total: int, count: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The state to save, and the plain tensors holding its bytes (what the floors copy)."""
    plain = _state(total, count)
    if kind == "plain":
        return plain, plain
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dts = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in plain.items()}
    local = {k: v.to_local() for k, v in dts.items()}
    if kind == "dtensor":
        return dts, local
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(torch.nn.Parameter(v, requires_grad=False) for v in dts.values())
    state = ckptstore.TrainState(model=model)
    return state, {k: p.to_local() for k, p in state.state_dict()["model"].items()}


def measure_blocking(total: int, count: int, repeats: int, work: str, ram_dir: str,
                     kind: str = "plain") -> dict[str, Any]:
    """Blocking time of CheckpointStore.save (RAM only, RAM + local) against the memcpy floors."""
    state, tensors = _kind_state(kind, total, count)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    floor = {k: torch.empty_like(v) for k, v in tensors.items()}
    flat_src, flat_dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    jobs = {name: f"{JOB_PREFIX}-block-{uuid.uuid4().hex[:8]}" for name in ("store_ram", "store_ram_local")}
    # The default two slots, both touched by the warm-up: a budget of many slots would time
    # first-touch page faults of a fresh slot at every round instead of the steady state.
    stores = {
        "store_ram": CheckpointStore(jobs["store_ram"], ram_dir=ram_dir),
        "store_ram_local": CheckpointStore(jobs["store_ram_local"], local=os.path.join(work, "local-block"),
                                           keep_local=1, ram_dir=ram_dir),
    }
    step = [0]

    def store_save(store: CheckpointStore) -> float:
        step[0] += 1
        t = time.perf_counter()
        handle = store.save(step[0], state)
        blocking = time.perf_counter() - t
        handle.wait("ram")
        store._drain()  # persisting is not timed, and must not share the cores with the next round
        return blocking

    def floor_copy() -> None:
        for k, v in tensors.items():
            floor[k].copy_(v)

    fns: dict[str, Any] = {
        "memcpy_floor": floor_copy,
        "flat_memcpy": lambda: flat_dst.copy_(flat_src),
        "store_ram": lambda: store_save(stores["store_ram"]),
        "store_ram_local": lambda: store_save(stores["store_ram_local"]),
    }
    if kind == "train":
        fns["state_dict"] = state.state_dict
    order = tuple(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    try:
        for _ in range(2):  # warm-up: buffers touched, both slots of each store made and used once
            for fn in fns.values():
                fn()
        for r in range(repeats):
            for name in (order if r % 2 == 0 else tuple(reversed(order))):
                gc.collect()
                t = time.perf_counter()
                out = fns[name]()
                times[name].append(out if isinstance(out, float) else time.perf_counter() - t)
    finally:
        for store in stores.values():
            store.close(keep_ram=True)
        for f in os.listdir(ram_dir):
            if any(f.startswith(f"ckptstore-{job}-") for job in jobs.values()):
                os.unlink(os.path.join(ram_dir, f))
        shutil.rmtree(os.path.join(work, "local-block"), ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "kind": kind, "bytes": nbytes, "tensors": count, "repeats": repeats, "seconds": times, "median_seconds": med,
        "us_per_tensor": {k: v / count * 1e6 for k, v in med.items()},
        "ratios": {f"{s}_vs_{f}": med[s] / med[f] for s in ("store_ram", "store_ram_local")
                   for f in ("memcpy_floor", "flat_memcpy")},
    }


def _write_blocking(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import json

    doc = {"benchmark": "save_blocking", "repeats": args.repeats, "by_count": rows,
           "note": "blocking time of CheckpointStore.save on a state of the same structure as the last save; "
                   "memcpy_floor: copy_ per tensor into preallocated buffers; flat_memcpy: one copy_ of the same bytes",
           "machine": machine()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(doc, fh, indent=2)


def blocking_main(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="ckptstore-bench-block-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        print(f"save blocking: medians of {args.repeats} interleaved rounds (seconds [min-max])")
        for kind in args.kinds:
            if kind != "plain" and not dist.is_initialized():
                init = os.path.join(work, "pg-init")
                dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
            for count in args.counts if kind == "plain" else args.kind_counts or args.counts:
                rows.append(measure_blocking(args.count_total_mib << 20, count, args.repeats, work, args.ram_dir, kind))
                _print(f"{kind}: {args.count_total_mib} MiB in {count} tensors", rows[-1], BLOCKING + ("state_dict",))
                _write_blocking(args, rows)  # row by row: a long run stopped midway keeps what it measured
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in args.kinds:
        mine = [r for r in rows if r["kind"] == kind]
        xs = [r["tensors"] for r in mine]
        for v in BLOCKING if kind == "plain" else ("store_ram", "store_ram_local"):
            ax.plot(xs, [r["median_seconds"][v] for r in mine], marker="o", label=f"{kind} {v}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"number of tensors ({args.count_total_mib} MiB in all)")
    ax.set_ylabel("median seconds blocked (lower is better)")
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"CheckpointStore.save blocking, medians of {args.repeats}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{args.name}.png"), dpi=110)
    plt.close(fig)


def _print(tag: str, row: dict[str, Any], variants: tuple[str, ...] = VARIANTS) -> None:
    med, sec = row["median_seconds"], row["seconds"]
    cells = "  ".join(f"{k} {med[k]:.3f} [{min(sec[k]):.3f}-{max(sec[k]):.3f}]" for k in variants if k in med)
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items())
    print(f"  {tag}: {cells}\n    {ratios}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--counts", type=int, nargs="+", default=[10, 1000, 10000, 100000])
    ap.add_argument("--count-total-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--many", type=int, default=10000, help="counts above this get --many-repeats rounds")
    ap.add_argument("--many-repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the files go (a real disk, default: a temp dir)")
    ap.add_argument("--ram-dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    ap.add_argument("--blocking", action="store_true", help="only CheckpointStore.save's blocking time (see above)")
    ap.add_argument("--kinds", nargs="+", default=["plain"], choices=["plain", "dtensor", "train"],
                    help="with --blocking: the kinds of state (see above)")
    ap.add_argument("--kind-counts", type=int, nargs="+", default=None,
                    help="with --blocking: the counts of the kinds other than plain (default: --counts)")
    ap.add_argument("--name", default="save_blocking", help="with --blocking: the name of the JSON and PNG files")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.blocking:
        blocking_main(args)
        return
    work = tempfile.mkdtemp(prefix="ckptstore-bench-scale-", dir=args.dir)
    by_size: list[dict[str, Any]] = []
    by_count: list[dict[str, Any]] = []
    try:
        print(f"scale: medians of {args.repeats} interleaved rounds (seconds [min-max])")
        for mib in args.sizes_mib:
            # state + loaded copy for the drop-in figures; + floor buffers + a RAM slot for the async ones
            avail = _available() * 3 // 4
            if 2 * (mib << 20) > avail:
                by_size.append({"bytes": mib << 20, "tensors": 10, "skipped": f"needs ~{2 * mib} MiB, more than "
                                f"3/4 of the {_available() >> 20} MiB available"})
                print(f"  {mib} MiB: skipped ({by_size[-1]['skipped']})")
                continue
            by_size.append(measure(mib << 20, 10, args.repeats, work, args.ram_dir, with_async=4 * (mib << 20) <= avail))
            _print(f"{mib} MiB in 10 tensors", by_size[-1])
        for count in args.counts:
            # Per-tensor costs dominate there: a few seconds to a minute per call, so fewer rounds.
            repeats = args.repeats if count <= args.many else args.many_repeats
            by_count.append(measure(args.count_total_mib << 20, count, repeats, work, args.ram_dir))
            _print(f"{args.count_total_mib} MiB in {count} tensors", by_count[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"benchmark": "scale", "repeats": args.repeats, "by_size": by_size, "by_count": by_count,
           "note": "torch_save_fsync and ckptstore_save are durable when they return; loads are warm (page cache, "
                   "repeated in one process); store_save_blocking is what CheckpointStore.save blocks for",
           "machine": machine()}
    import json

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scale.json"), "w") as fh:
        json.dump(doc, fh, indent=2)
    plot(doc, os.path.join(args.out, "scale.png"))


def plot(doc: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, xkey, xlabel in ((axes[0], "by_size", "bytes", "state size (MiB), 10 tensors"),
                                  (axes[1], "by_count", "tensors", "number of tensors (fixed total)")):
        rows = [r for r in doc[key] if "skipped" not in r]
        if not rows:
            continue
        xs = [r[xkey] / 2**20 if xkey == "bytes" else r[xkey] for r in rows]
        for v in VARIANTS:
            pts = [(x, r["median_seconds"][v]) for x, r in zip(xs, rows) if v in r["median_seconds"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("median seconds (lower is better)")
        ax.grid(True, which="both", lw=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Scale, medians of {doc['repeats']}, {doc['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
