"""GPU figures: what a save of device tensors blocks the trainer for, what a restore into device
tensors costs, and what checkpointing does to a training loop's step time -- ckptstore against the
pinned-memory floor, `.to("cpu")`, DCP's async_save with a pinned DefaultStager, and torch.save,
same state, same run. Writes <out>/cuda.json after every section.

Restores into the device tensors: from the RAM tier (`CheckpointStore.restore`) and a
`ckptstore.load(map_location="cuda")` against the pinned host-to-device floor, torch.load and
dcp.load; from the local tier with its files dropped from the page cache against one read of the
same files into page-locked memory; and a rank whose node lost its RAM copy fetching its bytes from
the other node's replica (two processes) against the floor of its own bytes.

Meant for a CUDA device; without one it runs on the CPU, which only shows that it works.

    python benchmarks/bench_cuda.py [--hidden 4096] [--blocks 4] [--repeats 3] [--peer-mib 1024] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

import ckptstore
from ckptstore.engine.store import CheckpointStore
from ckptstore.tiers.ram import RamTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_restore import drop_cached, remove_segments  # noqa: E402
from common import machine, pyplot  # noqa: E402 - shared by the benchmark scripts

PEER_WORLD = 2


def restore_from_local(flat: dict[str, torch.Tensor], items: list[tuple[str, torch.Tensor]], local: str, job: str,
                       ram_dir: str, repeats: int, cuda: bool) -> dict[str, Any]:
    """A step saved to the local tier alone (RAM segments removed), restored into ``flat``'s
    tensors with the files dropped from the page cache before each round; against a read of the
    same files into page-locked memory after the same drop."""
    want = {k: v.cpu().clone() for k, v in flat.items()}
    with CheckpointStore(job, local=local, keep_local=1, ram_dir=ram_dir) as saver:
        saver.save(1, flat).wait("local")
    remove_segments(job, ram_dir)
    files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(local) for f in fs if f.endswith(".bin"))
    size = sum(os.path.getsize(f) for f in files)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    view = memoryview(pinned.numpy()).cast("B")

    def raw_pinned() -> None:
        pos = 0
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                n = os.path.getsize(path)
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[pos + done : pos + min(n, done + (64 << 20))]], done)
                    if got <= 0:
                        raise OSError(f"{path}: short read")
                    done += got
                pos += n
            finally:
                os.close(fd)

    store = CheckpointStore(job, local=local, keep_local=1, ram_dir=ram_dir)
    try:
        def restore() -> None:
            assert store.restore(flat) == 1

        results: dict[str, list[float]] = {"raw_read_into_pinned_cold": [], "ckptstore_store_restore_from_local_cold": []}
        fns = {"raw_read_into_pinned_cold": raw_pinned, "ckptstore_store_restore_from_local_cold": restore}
        for r in range(repeats):
            for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
                drop_cached([local])
                _sync()
                t = time.perf_counter()
                fns[name]()
                _sync()
                results[name].append(time.perf_counter() - t)
                print(f"  {name:40s} {results[name][-1]:8.3f} s", flush=True)
        for k, v in flat.items():
            assert torch.equal(v.cpu(), want[k]), k
    finally:
        store.close()
        remove_segments(job, ram_dir)
    out = _summary(results, size)
    med = out["median_seconds"]
    out["ratios"] = {"store_restore_from_local_vs_raw_read":
                     med["ckptstore_store_restore_from_local_cold"] / med["raw_read_into_pinned_cold"]}
    return out


def _peer_rank(rank: int, init: str, root: str, mib: int, repeats: int, result: str) -> None:
    """One of two ranks on two simulated nodes (their own RAM directories): rank 0 keeps its RAM
    copy and a replica of rank 1's; rank 1's node lost both, so its restore fetches its boxes from
    rank 0, into device tensors. Rank 1 also times the host-to-device floor of its own bytes."""
    import datetime

    import torch.distributed as dist

    from ckptstore.checkpoint.sharded import GlobalBox

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=PEER_WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = max(1, (mib << 20) // 4 // 4096)
        g = torch.Generator().manual_seed(rank)
        local = torch.randn(rows, 4096, generator=g)
        mine = local.to(device)

        def state(t: torch.Tensor) -> dict:
            return {"w": GlobalBox(t, (rank * rows, 0), (PEER_WORLD * rows, 4096), torch.float32)}

        ram_dir = os.path.join(root, f"node{rank}")
        os.makedirs(ram_dir, exist_ok=True)
        job = "bench-cuda-peer"
        store = CheckpointStore(job, ram_dir=ram_dir, peer_replicas=1, node=rank)
        try:
            store.save(1, state(mine)).wait("peer")
        finally:
            store.close(keep_ram=True)  # the only copies: kept for the restores (the root goes after)
        dist.barrier()
        if rank == 1:
            remove_segments(job, ram_dir)  # this node is replaced: no RAM copy, no replica
        dist.barrier()
        pinned = local.pin_memory() if device == "cuda" else local.clone()
        times: dict[str, list[float]] = {"pinned_h2d_floor": [], "ckptstore_store_restore_from_peer": []}
        for _ in range(repeats):
            target = torch.zeros_like(mine)
            _sync()
            t = time.perf_counter()
            target.copy_(pinned, non_blocking=device == "cuda")
            _sync()
            times["pinned_h2d_floor"].append(time.perf_counter() - t)
            target.zero_()
            store = CheckpointStore(job, ram_dir=ram_dir, peer_replicas=1, node=rank)
            try:
                dist.barrier()
                _sync()
                t = time.perf_counter()
                assert store.restore(state(target)) == 1
                _sync()
                times["ckptstore_store_restore_from_peer"].append(time.perf_counter() - t)
            finally:
                store.close(keep_ram=True)
            assert torch.equal(target.cpu(), local)
        if rank == 1:
            with open(result, "w") as fh:
                json.dump({"times": times, "bytes": local.numel() * 4}, fh)
    finally:
        dist.destroy_process_group()


def restore_from_peer(work: str, mib: int, repeats: int, ram_dir: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="bench-cuda-peer-", dir=ram_dir)
    result = os.path.join(work, "peer.json")
    try:
        ctx = mp.get_context("spawn")
        init = f"file://{os.path.join(work, 'peer-init')}"
        procs = [ctx.Process(target=_peer_rank, args=(r, init, root, mib, repeats, result)) for r in range(PEER_WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError(f"peer ranks exited with {[p.exitcode for p in procs]}")
        with open(result) as fh:
            got = json.load(fh)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = _summary(got["times"], got["bytes"])
    med = out["median_seconds"]
    out["ratios"] = {"store_restore_from_peer_vs_h2d_floor":
                     med["ckptstore_store_restore_from_peer"] / med["pinned_h2d_floor"]}
    return out


def _build(hidden: int, blocks: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    _train_step(model, opt, torch.randn(256, hidden, device=device))
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    out = [(f"model/{k}", v) for k, v in state["model"].items()]
    for pid, s in state["optim"]["state"].items():
        out.extend((f"optim/{pid}/{k}", v) for k, v in s.items() if v.dim())
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fns: dict[str, Callable[[], Any]], repeats: int, after: Callable[[str], None] | None = None) -> dict:
    """Interleaved repeats (order reversed every other round), each after a synchronize."""
    results: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
            gc.collect()
            _sync()
            t = time.perf_counter()
            fns[name]()
            _sync()
            results[name].append(time.perf_counter() - t)
            if after is not None:
                after(name)
            print(f"  {name:32s} {results[name][-1]:8.3f} s", flush=True)
    return results


def _summary(results: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "seconds": results,
        "median_seconds": med,
        "GB_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
    }


def plot(doc: dict[str, Any], out: str) -> None:
    n = doc["bytes"]
    plt = pyplot()
    if plt is not None and "staging" in doc:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        med = doc["staging"]["median_seconds"]
        axes[0].barh(list(med), list(med.values()))
        axes[0].set_xlabel("seconds the trainer is blocked (median)")
        axes[0].set_title(f"save of {n / 2**30:.1f} GiB of device tensors")
        if "restore" in doc:
            rmed = dict(doc["restore"]["median_seconds"])
            rmed.update(doc.get("restore_local", {}).get("median_seconds", {}))
            rmed.update({f"{k} (peer rank's bytes)": v
                         for k, v in doc.get("restore_peer", {}).get("median_seconds", {}).items()})
            axes[1].barh(list(rmed), list(rmed.values()), color="tab:orange")
            axes[1].set_xlabel("seconds (median)")
            axes[1].set_title("restore into device tensors")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "cuda.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop-steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--ram-dir", default="/dev/shm")
    ap.add_argument("--peer-mib", type=int, default=1024, help="MiB per rank for the restore from a peer")
    ap.add_argument("--dir", default=None, help="local tier / file directory (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    ap.add_argument("--plot-only", metavar="JSON", help="redraw the plot from a cuda.json written earlier")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as fh:
            plot(json.load(fh), args.out)
        return
    warnings.filterwarnings("ignore")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    doc: dict[str, Any] = {"benchmark": "cuda", "machine": machine(), "args": vars(args)}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        doc["gpu"] = {"name": p.name, "memory_GiB": p.total_memory / 2**30, "cuda": torch.version.cuda}
    os.makedirs(args.out, exist_ok=True)

    def dump() -> None:
        with open(os.path.join(args.out, "cuda.json"), "w") as fh:
            json.dump(doc, fh, indent=2)

    model, opt = _build(args.hidden, args.blocks, device)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    items = _tensors(state)
    # Every variant saves the same flat dict of the same tensors (DCP's stager in some torch
    # versions cannot deep-copy an optimizer's param_groups; the bytes are what is compared).
    flat = dict(items)
    n = sum(t.numel() * t.element_size() for _, t in items)
    doc.update(bytes=n, GiB=n / 2**30, tensors=len(items))
    print(f"state: {n / 2**30:.2f} GiB in {len(items)} tensors on {device}", flush=True)
    dump()

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300))
    dist.init_process_group("gloo", rank=0, world_size=1)
    work = args.dir or tempfile.mkdtemp()
    os.makedirs(work, exist_ok=True)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    tier = RamTier(job, ram_dir=args.ram_dir, slots=1)
    # DCP's stager options differ in what works across torch versions: the first of these that
    # saves this state is the baseline, and the JSON says which it was.
    stager: Any = None
    dcp_config = None
    for name, opts in (
        ("pinned, async staging, non-blocking copies", dict(use_pinned_memory=cuda, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=cuda)),
        ("StagingOptions() defaults", {}),
        ("pinned, synchronous staging", dict(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                             use_non_blocking_copy=False)),
        ("no stager (async_save's own copy)", None),
    ):
        try:
            candidate = DefaultStager(StagingOptions(**opts)) if opts is not None else None
            probe = os.path.join(work, "dcp-probe")
            resp = dcp.async_save(flat, checkpoint_id=probe, async_stager=candidate) if candidate is not None else \
                dcp.async_save(flat, checkpoint_id=probe)
            getattr(resp, "upload_completion", resp).result()
            shutil.rmtree(probe, ignore_errors=True)
            if candidate is not None:  # a reused stager must work the second time too
                resp = dcp.async_save(flat, checkpoint_id=probe, async_stager=candidate)
                resp.upload_completion.result()
                shutil.rmtree(probe, ignore_errors=True)
            stager, dcp_config = candidate, name
            break
        except Exception as exc:
            doc.setdefault("dcp_stager_failures", {})[name] = f"{type(exc).__name__}: {exc}"
            print(f"DCP stager '{name}' failed: {type(exc).__name__}: {exc}", flush=True)
            shutil.rmtree(os.path.join(work, "dcp-probe"), ignore_errors=True)
    doc["dcp_stager"] = dcp_config
    print(f"DCP baseline: {dcp_config}", flush=True)
    store = CheckpointStore(job + "-store", local=os.path.join(work, "local"), keep_local=1, ram_dir=args.ram_dir)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for _, t in items]
    pageable = [torch.empty(t.shape, dtype=t.dtype) for _, t in items]
    counter = [0]
    handles: list[Any] = []
    dcp_dirs: list[str] = []
    to_local: list[float] = []

    def pinned_floor() -> None:
        for b, (_, t) in zip(pinned, items):
            b.copy_(t, non_blocking=cuda)

    def pageable_floor() -> None:
        for b, (_, t) in zip(pageable, items):
            b.copy_(t)

    def to_cpu() -> None:
        out = [t.to("cpu") for _, t in items]
        del out

    def to_cpu_non_blocking() -> None:
        out = [t.to("cpu", non_blocking=True) for _, t in items]
        _sync()  # the copies are only usable after this
        del out

    def dcp_async() -> None:
        counter[0] += 1
        d = os.path.join(work, f"dcp{counter[0]}")
        resp = _dcp_save(d)
        handles[:] = [resp]
        dcp_dirs.append(d)

    def _dcp_save(d: str) -> Any:
        """async_save; returns once the trainer may go on (staging done), with a future for the upload."""
        if stager is not None:
            resp = dcp.async_save(flat, checkpoint_id=d, async_stager=stager)
            resp.staging_completion.result()
            return resp.upload_completion
        resp = dcp.async_save(flat, checkpoint_id=d)
        return getattr(resp, "upload_completion", resp)

    def ram_stage() -> None:
        counter[0] += 1
        tier.stage(counter[0], items)

    def store_save() -> None:
        counter[0] += 1
        handles[:] = [store.save(counter[0], flat)]

    def torch_save() -> None:
        torch.save(flat, os.path.join(work, "t.pt"))

    def after(name: str) -> None:  # background work finishes untimed, so it never overlaps the next variant
        if name == "dcp_async_save":
            handles[0].result()
            for d in dcp_dirs[:-1]:
                shutil.rmtree(d, ignore_errors=True)
            del dcp_dirs[:-1]
        elif name == "ckptstore_store_save":
            t = time.perf_counter()
            handles[0].wait("local")
            to_local.append(time.perf_counter() - t + handles[0].staged_s)
            store._drain()

    fns: dict[str, Callable[[], Any]] = {
        "pinned_memcpy_floor": pinned_floor,
        "pageable_memcpy_floor": pageable_floor,
        "to_cpu": to_cpu,
        "to_cpu_non_blocking": to_cpu_non_blocking,
        "dcp_async_save": dcp_async,
        "ckptstore_ram_stage": ram_stage,
        "ckptstore_store_save": store_save,
        "torch_save": torch_save,
    }
    if dcp_config is None:
        del fns["dcp_async_save"]
    try:
        print("warm-up", flush=True)
        for name, fn in fns.items():  # twice: both of the store's slots get created and pinned
            for _ in range(1 if name in ("to_cpu", "torch_save") else 2):
                fn()
                after(name)
        print("staging (blocking time of a save)", flush=True)
        res = _timed(fns, args.repeats, after)
        st = doc["staging"] = _summary(res, n)
        st["ckptstore_save_to_local_committed_s"] = to_local
        med = st["median_seconds"]
        st["ratios"] = {
            "store_save_vs_pinned_floor": med["ckptstore_store_save"] / med["pinned_memcpy_floor"],
            "ram_stage_vs_pinned_floor": med["ckptstore_ram_stage"] / med["pinned_memcpy_floor"],
            "store_save_vs_dcp_async_save": med["ckptstore_store_save"] / med.get("dcp_async_save", float("nan")),
            "store_save_vs_to_cpu_non_blocking": med["ckptstore_store_save"] / med["to_cpu_non_blocking"],
            "store_save_vs_torch_save": med["ckptstore_store_save"] / med["torch_save"],
        }
        print(json.dumps(st["ratios"], indent=1), flush=True)
        dump()
    except Exception:
        doc["staging_error"] = traceback.format_exc()
        print(doc["staging_error"], flush=True)
        dump()

    # Restore into the device tensors in place (the store's newest committed step is in RAM and local).
    try:
        print("restore into device tensors", flush=True)
        last_dcp = dcp_dirs[-1] if dcp_dirs and os.path.exists(os.path.join(dcp_dirs[-1], ".metadata")) else None
        dropin = os.path.join(work, "c.ckpt")
        ckptstore.save(flat, dropin)

        def h2d_floor() -> None:
            for b, (_, t) in zip(pinned, items):
                t.copy_(b, non_blocking=cuda)

        def store_restore() -> None:
            assert store.restore(flat) is not None

        def dropin_load() -> None:
            ckptstore.load(dropin, map_location=device)

        def torch_load() -> None:
            torch.load(os.path.join(work, "t.pt"), map_location=device, weights_only=True)

        def dcp_load() -> None:
            dcp.load(flat, checkpoint_id=last_dcp)

        rfns: dict[str, Callable[[], Any]] = {
            "pinned_h2d_floor": h2d_floor,
            "ckptstore_store_restore_from_ram": store_restore,
            "ckptstore_load_map_location_cuda": dropin_load,
            "torch_load_map_location_cuda": torch_load,
        }
        if last_dcp:
            rfns["dcp_load"] = dcp_load
        for fn in rfns.values():
            fn()
        res = _timed(rfns, args.repeats)
        rs = doc["restore"] = _summary(res, n)
        med = rs["median_seconds"]
        rs["ratios"] = {
            "store_restore_vs_h2d_floor": med["ckptstore_store_restore_from_ram"] / med["pinned_h2d_floor"],
            "dropin_load_vs_h2d_floor": med["ckptstore_load_map_location_cuda"] / med["pinned_h2d_floor"],
            "torch_load_vs_store_restore": med["torch_load_map_location_cuda"] / med["ckptstore_store_restore_from_ram"],
        }
        if last_dcp:
            rs["ratios"]["dcp_load_vs_store_restore"] = med["dcp_load"] / med["ckptstore_store_restore_from_ram"]
        print(json.dumps(rs["ratios"], indent=1), flush=True)
        dump()
    except Exception:
        doc["restore_error"] = traceback.format_exc()
        print(doc["restore_error"], flush=True)
        dump()

    # Restore from the local tier with its files out of the page cache (no RAM copy left), against
    # one read of the same files into page-locked memory after the same drop.
    try:
        print("restore from the local tier, page cache dropped", flush=True)
        doc["restore_local"] = restore_from_local(flat, items, os.path.join(work, "disk"), job + "-disk",
                                                  args.ram_dir, args.repeats, cuda)
        print(json.dumps(doc["restore_local"]["ratios"], indent=1), flush=True)
        dump()
    except Exception:
        doc["restore_local_error"] = traceback.format_exc()
        print(doc["restore_local_error"], flush=True)
        dump()

    # Restore of a rank whose node lost its RAM copy, fetched from the other node's replica.
    try:
        print("restore from a peer's replica", flush=True)
        doc["restore_peer"] = restore_from_peer(work, args.peer_mib, args.repeats, args.ram_dir)
        print(json.dumps(doc["restore_peer"]["ratios"], indent=1), flush=True)
        dump()
    except Exception:
        doc["restore_peer_error"] = traceback.format_exc()
        print(doc["restore_peer_error"], flush=True)
        dump()

    # A training loop that checkpoints every `every` steps, against the same loop without.
    try:
        print("training loop", flush=True)
        x = torch.randn(args.tokens, args.hidden, device=device)
        loop: dict[str, Any] = {}
        pending: list[Any] = []

        def run(kind: str) -> tuple[float, list[float], list[float]]:
            blocked, waited = [], []
            for _ in range(3):
                _train_step(model, opt, x)
            _sync()
            t0 = time.perf_counter()
            for step in range(1, args.loop_steps + 1):
                _train_step(model, opt, x)
                if step % args.every == 0 and kind != "none":
                    t = time.perf_counter()
                    if kind == "ckptstore":
                        counter[0] += 1
                        h = store.save(counter[0], flat)
                        waited.append(h.waited_s)
                        print(f"    save: staged {h.staged_s:.3f} s, waited for a slot {h.waited_s:.3f} s", flush=True)
                    else:
                        if pending:  # DCP's recipe: one upload in flight at a time
                            pending[0].result()
                        counter[0] += 1
                        d = os.path.join(work, f"loop{counter[0]}")
                        pending[:] = [_dcp_save(d)]
                        dcp_dirs.append(d)
                    blocked.append(time.perf_counter() - t)
            _sync()
            total = time.perf_counter() - t0
            if kind == "ckptstore":
                store._drain()
            elif kind == "dcp" and pending:
                pending[0].result()
                for d in dcp_dirs[:-1]:
                    shutil.rmtree(d, ignore_errors=True)
                del dcp_dirs[:-1]
            return total, blocked, waited

        kinds = ["none", "ckptstore", "dcp"] if dcp_config is not None else ["none", "ckptstore"]
        per: dict[str, list[float]] = {k: [] for k in kinds}
        blocks: dict[str, list[float]] = {k: [] for k in kinds}
        waits: list[float] = []
        for r in range(2):
            for kind in kinds if r == 0 else list(reversed(kinds)):
                total, b, w = run(kind)
                per[kind].append(total / args.loop_steps)
                blocks[kind].extend(b)
                waits.extend(w)
                print(f"  {kind:10s} {total / args.loop_steps * 1e3:8.2f} ms/step, blocked {sum(b):.3f} s", flush=True)
        base = statistics.median(per["none"])
        saves = args.loop_steps // args.every
        loop.update(
            step_seconds=per,
            blocking_seconds_per_save=blocks,
            ckptstore_waited_for_slot_s=waits,
            saves_per_run=saves,
            every=args.every,
            tokens=args.tokens,
        )
        ks = kinds[1:]
        loop["overhead"] = {k: statistics.median(per[k]) / base - 1 for k in ks}
        loop["lost_per_save_s"] = {k: (statistics.median(per[k]) - base) * args.loop_steps / saves for k in ks}
        loop["median_blocking_per_save_s"] = {k: statistics.median(blocks[k]) for k in ks}
        doc["loop"] = loop
        print(json.dumps({k: loop[k] for k in ("overhead", "lost_per_save_s", "median_blocking_per_save_s")},
                         indent=1), flush=True)
        dump()
    except Exception:
        doc["loop_error"] = traceback.format_exc()
        print(doc["loop_error"], flush=True)
        dump()
    finally:
        store.close()
        if stager is not None:
            stager.close()
        tier.close(unlink=True)
        for f in os.listdir(args.ram_dir):
            if f.startswith(f"ckptstore-{job}-store-"):
                os.unlink(os.path.join(args.ram_dir, f))
        dist.destroy_process_group()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    plot(doc, args.out)
    dump()


if __name__ == "__main__":
    main()
