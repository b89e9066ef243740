"""What each rank receives through the store's collectives in a restart's restore, by call site.

Real processes over gloo on loopback, each rank its own simulated node (RAM directory under
/dev/shm, local directory), peer replicas, a durable ``file://`` tier holding ``--durable-steps``
older steps: the first run saves, keeps its RAM slots and exits; the restart builds a store and
restores the newest step bitwise. Counted on every rank with :func:`ckptstore.collective.counting`
and attributed to the ckptstore function that issued each collective (its file:line), separately
for the start (the constructor: ``Restorer.newest_held``) and ``restore``; with process CPU seconds
of each. Byte counts do not depend on the machine's load; CPU seconds do, a little.

    python benchmarks/bench_restore_exchanges.py --worlds 2 4 8 --out /tmp/restore_exchanges.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any

import torch

TENSORS = 64


def _state(rank: int, world: int, step: int, zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    out: dict[str, Any] = {}
    for i in range(int(os.environ.get("BENCH_TENSORS", TENSORS))):
        t = torch.randn(16, generator=g)
        out[f"rank{rank}.{i}"] = torch.zeros(16) if zeros else t + rank  # keys of this rank alone
    out["shared"] = torch.zeros(32) if zeros else torch.randn(32, generator=g)  # written once, loaded by all
    out["step"] = -1 if zeros else step
    return out


def _store(job: str, rank: int, root: str, durable: str, replicas: int) -> Any:
    import ckptstore

    ram_dir = os.path.join("/dev/shm", f"{job}-nodes", f"node{rank}")
    os.makedirs(ram_dir, exist_ok=True)
    return ckptstore.CheckpointStore(job, local=os.path.join(root, "local", f"node{rank}"), ram_dir=ram_dir,
                                     node=rank, peer_replicas=replicas, durable=durable, durable_every=1)


def _attribute() -> dict[str, list[int]]:
    """Wrap Group's collectives so each adds (bytes received, calls) to the ckptstore frame that
    called it (outside collective.py)."""
    from ckptstore import collective

    sites: dict[str, list[int]] = {}

    def site() -> str:
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename.endswith(("collective.py", "guard.py")):
            f = f.f_back
        if f is None:
            return "?"
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}"

    for name in ("gather_to_root", "broadcast", "from_senders", "all_gather", "all_to_all", "max_int64"):
        real = getattr(collective.Group, name)

        def wrapped(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            traffic = collective._traffic
            before = traffic.received if traffic is not None else 0
            out = _real(self, *args, **kwargs)
            if traffic is not None:
                entry = sites.setdefault(site(), [0, 0])
                entry[0] += traffic.received - before
                entry[1] += 1
            return out

        setattr(collective.Group, name, wrapped)
    return sites


def rank_main(rank: int, world: int, store_path: str, root: str, job: str, durable: str, durable_steps: int,
              replicas: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        from ckptstore.collective import counting

        newest = durable_steps + 1
        store = _store(job, rank, root, durable, replicas)
        for step in range(1, newest + 1):
            handle = store.save(step, _state(rank, world, step))
        handle.wait("local")
        if replicas:
            handle.wait("peer")
        store.close(keep_ram=True)
        dist.barrier()
        sites = _attribute()
        record: dict[str, Any] = {}
        for phase in ("start", "restore"):
            with counting() as traffic:
                c0 = time.process_time()
                if phase == "start":
                    store = _store(job, rank, root, durable, replicas)
                else:
                    target = _state(rank, world, 0, zeros=True)
                    found = store.restore(target)
                    want = _state(rank, world, newest)
                    assert found == newest, found
                    assert all(torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v
                               for k, v in want.items())
                record[phase] = {"cpu_s": time.process_time() - c0, "received": traffic.received,
                                 "calls": traffic.calls, "sites": {k: v[:] for k, v in sites.items()}}
                sites.clear()
        store.close()
        dist.barrier()
        dist.destroy_process_group()
        with open(os.path.join(out, f"r{rank}.json"), "w") as fh:
            json.dump(record, fh)
    except BaseException:
        with open(os.path.join(out, f"error-{rank}"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def run_world(world: int, durable_steps: int, replicas: int, tensors: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="restore-exchanges-")
    job = f"bre-{uuid.uuid4().hex[:8]}"
    root = os.path.join(tmp, "root")
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    durable = "file://" + os.path.join(tmp, "durable")
    os.environ["BENCH_TENSORS"] = str(tensors)  # the spawned ranks inherit it
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, os.path.join(tmp, "store"), root, job, durable,
                                                  durable_steps, replicas, out)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        errors = [_read(os.path.join(out, f)) for f in os.listdir(out) if f.startswith("error-")]
        if errors:
            raise RuntimeError("\n".join(errors))
        return [json.loads(_read(os.path.join(out, f"r{r}.json"))) for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(os.path.join("/dev/shm", f"{job}-nodes"), ignore_errors=True)
        for name in os.listdir("/dev/shm"):
            if job in name:
                os.unlink(os.path.join("/dev/shm", name))


def fit(points: list[tuple[int, float]]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--durable-steps", type=int, default=20)
    ap.add_argument("--replicas", type=int, default=1, help="peer_replicas of the store")
    ap.add_argument("--tensors", type=int, default=TENSORS, help="tensors of each rank's own")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results: dict[str, Any] = {"args": vars(args), "load": _read("/proc/loadavg").split()[:3], "worlds": {}}
    for world in args.worlds:
        ranks = run_world(world, args.durable_steps, args.replicas, args.tensors)
        results["worlds"][str(world)] = ranks
        for phase in ("start", "restore"):
            other = [r[phase] for r in ranks[1:]]
            print(f"world {world} {phase}: rank>0 received max {max(o['received'] for o in other)} B, "
                  f"calls {max(o['calls'] for o in other)}, cpu mean {sum(o['cpu_s'] for o in other) / len(other):.3f} s; "
                  f"rank 0 received {ranks[0][phase]['received']} B", flush=True)
            sites: dict[str, list[int]] = {}
            for o in other:
                for k, (b, c) in o["sites"].items():
                    e = sites.setdefault(k, [0, 0])
                    e[0], e[1] = max(e[0], b), max(e[1], c)
            for k, (b, c) in sorted(sites.items(), key=lambda kv: -kv[1][0]):
                print(f"    {k:60s} {b:8d} B in {c} calls")
    worlds = [int(w) for w in results["worlds"]]
    print("\n| world | phase | received, rank > 0 (max / median) | of it the restorer's | rank 0 | CPU per rank > 0 (mean) |")
    print("|---|---|---|---|---|---|")
    summary: dict[str, list[tuple[int, float]]] = {}
    for w in worlds:
        ranks = results["worlds"][str(w)]
        for phase in ("start", "restore"):
            other = [r[phase] for r in ranks[1:]]
            got = sorted(o["received"] for o in other)
            ours = max(sum(b for k, (b, _c) in o["sites"].items() if k.split(":")[0] in ("restore.py", "exchange.py"))
                       for o in other)
            cpu = sum(o["cpu_s"] for o in other) / len(other)
            print(f"| {w} | {phase} | {got[-1]} / {got[len(got) // 2]} B | {ours} B | {ranks[0][phase]['received']} B "
                  f"| {cpu:.3f} s |")
            summary.setdefault(f"{phase} max", []).append((w, got[-1]))
            summary.setdefault(f"{phase} restorer", []).append((w, ours))
    if len(worlds) > 1:
        for name, pts in summary.items():
            k = fit(pts)
            if k is not None:
                w0, b0 = pts[-1]
                print(f"{name}: exponent {k:.2f}; extrapolated to 4,096 ranks: {b0 * (4096 / w0) ** k:,.0f} B")
    results["summary"] = summary
    results["load_after"] = _read("/proc/loadavg").split()[:3]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
