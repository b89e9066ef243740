"""Peer replicas: replication throughput against a raw gloo exchange of the same bytes between the
same two processes, and a restart after a node loss restored from the peers against the same
restore from the durable tier (S3 through s3fs, on a local moto server), in the same run.

Two simulated nodes of one rank each (world 2, real processes, gloo over loopback); each node has a
RAM directory of its own under /dev/shm/<job>-bench/ and no local tier. Every rank holds a Shard(0)
slice of a few fp32 DTensors (``--mib`` MiB per rank).

1. Replication. ``CheckpointStore(peer_replicas=1, node=rank)``: after two warm-up saves (staging
   and replica segments are allocated on first use), each round times one save on both ranks:
   ``save()`` to ``wait("peer")`` (staging, checksums, RAM commit, replication) and, within it,
   ``wait("ram")`` to ``wait("peer")``: the replication alone (send this rank's staged bytes to
   the other node while receiving the other's, verify the received bytes against their chunk
   checksums, commit the replica in RAM). The baseline is a raw ``isend``/``irecv`` of a
   preallocated uint8 tensor of the same size in both directions at once, on a fresh gloo group
   between the same processes. The two alternate in order round by round.
2. Restore after a node loss (``--restore-mib`` MiB per rank). One step is saved with
   peer_replicas=1, then node 1's RAM directory is wiped; another job saves the step to the durable
   tier (durable_every=1), then both nodes' RAM directories are wiped. The ranks are restarted (new
   processes) and each round times ``store.restore(state)`` of both jobs, alternating in order: from
   the surviving node's RAM and its replica of node 1 (node 1 fetches its shard from node 0), and
   from durable alone. Every restore is checked bitwise and by the tier it reports.

Times are the slowest rank's, taken between barriers.

    python benchmarks/bench_peer.py [--mib 256] [--repeats 5] [--restore-mib 128] [--restore-repeats 3] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptstore
from ckptstore.bench import peer_rounds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import pyplot, report  # noqa: E402 - shared by the benchmark scripts

WORLD = 2
TENSORS = 4  # per state; each rank's shard of each is mib / TENSORS MiB
TIMEOUT_S = 240


# ---------------------------------------------------------------------------- in the ranks


def _state(mesh, rank: int, mib: int, *, zeros: bool) -> dict:
    """``TENSORS`` DTensors of shape (WORLD * rows, 4096) fp32 in Shard(0): ``mib`` MiB on each rank."""
    from torch.distributed.tensor import DTensor, Shard

    rows = mib * 2**20 // TENSORS // (4096 * 4)
    state = {}
    for i in range(TENSORS):
        local = torch.empty(rows, 4096)
        if zeros:
            local.zero_()
        else:
            local.uniform_(generator=torch.Generator().manual_seed(1000 * rank + i))
        state[f"t{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(WORLD * rows, 4096),
                                            stride=(4096, 1))
    return state


def _node_dir(root: str, what: str, rank: int) -> str:
    path = os.path.join(root, what, f"node{rank}")  # one simulated node per rank
    os.makedirs(path, exist_ok=True)
    return path


def _slowest(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _replicate_phase(rank: int, job: str, root: str, mib: int, repeats: int, restore_mib: int, s3_url: str,
                     storage_options: dict, result: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    state = _state(mesh, rank, mib, zeros=False)
    ram_dir = _node_dir(root, "repl", rank)
    store = ckptstore.CheckpointStore(f"{job}-repl", ram_dir=ram_dir, local=None, durable=None, peer_replicas=1,
                                      node=rank, timeout_s=TIMEOUT_S)
    # The timed rounds are shared with `ckptstore bench --peer` (ckptstore/bench.py).
    times, nbytes, _ = peer_rounds(store, state, rank, ram_dir, f"{job}-repl", repeats)
    payload = sum(t.to_local().nbytes for t in state.values())
    assert payload <= nbytes <= payload + (1 << 20), (payload, nbytes)
    store.close()
    del state

    # The steps restored after the node loss: one job with peer replicas, one in durable only.
    state = _state(mesh, rank, restore_mib, zeros=False)
    with ckptstore.CheckpointStore(f"{job}-lost", ram_dir=_node_dir(root, "lost", rank), peer_replicas=1, node=rank,
                                   timeout_s=TIMEOUT_S) as store:
        store.save(1, state).wait("peer")
    with ckptstore.CheckpointStore(f"{job}-durable", ram_dir=_node_dir(root, "durable", rank), peer_replicas=1,
                                   node=rank, durable=s3_url, storage_options=storage_options, durable_every=1,
                                   timeout_s=TIMEOUT_S) as store:
        t0 = time.perf_counter()
        store.save(1, state).wait("durable")
        (promote_s,) = _slowest(time.perf_counter() - t0)
    restore_bytes = sum(t.to_local().nbytes for t in state.values())
    if rank == 0:
        with open(result, "w") as fh:
            json.dump({"bytes": nbytes, "times": times, "restore_bytes": restore_bytes, "save_to_durable_s": promote_s}, fh)


def _restore_phase(rank: int, job: str, root: str, restore_mib: int, repeats: int, s3_url: str, storage_options: dict,
                   result: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ckptstore").addHandler(Keep())
    logging.getLogger("ckptstore").setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (WORLD,))
    expected = _state(mesh, rank, restore_mib, zeros=False)
    target = _state(mesh, rank, restore_mib, zeros=True)
    cases = {
        "restore_from_peers": (dict(ram_dir=_node_dir(root, "lost", rank)), f"{job}-lost", "peer+ram"),
        "restore_from_durable": (dict(ram_dir=_node_dir(root, "durable", rank), durable=s3_url,
                                      storage_options=storage_options), f"{job}-durable", "durable"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            kwargs, store_job, tier = cases[name]
            for t in target.values():
                t.to_local().zero_()
            records.clear()
            store = ckptstore.CheckpointStore(store_job, peer_replicas=1, node=rank, timeout_s=TIMEOUT_S, **kwargs)
            dist.barrier()
            t0 = time.perf_counter()
            got = store.restore(target)
            (dt,) = _slowest(time.perf_counter() - t0)
            store.close()
            times[name].append(dt)
            assert got == 1, (name, got, records)
            assert any(f"restored step 1 from the {tier} tier" in m for m in records), (name, records)
            for k, t in target.items():
                assert torch.equal(t.to_local(), expected[k].to_local()), (name, k)
    if rank == 0:
        with open(result, "w") as fh:
            json.dump({"times": times}, fh)


def _run(rank: int, store_path: str, phase: str, args: dict, result_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        try:
            globals()[phase](rank, **args)
        finally:
            dist.destroy_process_group()
        open(os.path.join(result_dir, f"ok-{rank}"), "w").close()
    except BaseException:
        with open(os.path.join(result_dir, f"error-{rank}"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


# ---------------------------------------------------------------------------- the driver


def _spawn(work: str, phase: str, **args) -> None:
    """Run ``phase`` in WORLD fresh processes; raise with their tracebacks if any failed or hung."""
    tag = f"{phase}-{uuid.uuid4().hex[:6]}"
    results = os.path.join(work, f"results-{tag}")
    os.makedirs(results)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run, args=(r, os.path.join(work, f"store-{tag}"), phase, args, results))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 2 * TIMEOUT_S
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {}
    for name in sorted(os.listdir(results)):
        if name.startswith("error-"):
            with open(os.path.join(results, name)) as fh:
                errors[name] = fh.read()
    if hung or errors or sorted(os.listdir(results)) != [f"ok-{r}" for r in range(WORLD)]:
        raise RuntimeError(f"{phase}: hung ranks {hung}; " + "\n".join(f"{k}:\n{v}" for k, v in errors.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB per rank for the replication rounds")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--restore-mib", type=int, default=128, help="MiB per rank for the restores")
    ap.add_argument("--restore-repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from ckptstore._local_s3 import start_local_s3

    job = f"benchpeer-{uuid.uuid4().hex[:8]}"
    root = f"/dev/shm/{job}-bench"
    work = tempfile.mkdtemp(prefix=f"{job}-")
    s3 = None
    try:
        s3 = start_local_s3(own_process=True)
        common = dict(job=job, root=root, s3_url=s3.url(f"{job}/durable"), storage_options=s3.storage_options)
        saved = os.path.join(work, "replicate.json")
        _spawn(work, "_replicate_phase", mib=args.mib, repeats=args.repeats, restore_mib=args.restore_mib,
               result=saved, **common)
        with open(saved) as fh:
            first = json.load(fh)
        shutil.rmtree(os.path.join(root, "repl"))  # done with: frees its segments
        # Node 1 is lost with its RAM (there is no local tier); the durable-only job loses both nodes' RAM.
        shutil.rmtree(os.path.join(root, "lost", "node1"))
        shutil.rmtree(os.path.join(root, "durable"))
        restored = os.path.join(work, "restore.json")
        _spawn(work, "_restore_phase", restore_mib=args.restore_mib, repeats=args.restore_repeats, result=restored,
               **common)
        with open(restored) as fh:
            second = json.load(fh)
    finally:
        if s3 is not None:
            s3.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        for path in glob.glob(f"/dev/shm/ckptstore-{job}-*"):
            os.unlink(path)

    times, rtimes = first["times"], second["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    rmed = {k: statistics.median(v) for k, v in rtimes.items()}
    rbytes = first["restore_bytes"]
    # Throughput ratios: higher is better (replication target: >= 0.9 of raw; restore: > 1).
    ratios = {
        "replication_vs_raw": med["raw_gloo_exchange"] / med["replication"],
        "save_to_peer_vs_raw": med["raw_gloo_exchange"] / med["save_to_peer"],
        "restore_peers_speedup_vs_durable": rmed["restore_from_durable"] / rmed["restore_from_peers"],
    }
    restore = {
        "bytes": rbytes,
        "GiB": rbytes / 2**30,
        "repeats": args.restore_repeats,
        "seconds": rtimes,
        "median_seconds": rmed,
        "GB_per_s": {k: rbytes / v / 1e9 for k, v in rmed.items()},
        "save_to_durable_s": first["save_to_durable_s"],
    }
    doc = report(
        "peer", first["bytes"], args.repeats, times, ratios, args.out, restore=restore, world=WORLD,
        bytes_are="per rank; in the exchange and the replication each rank sends that many and receives as many",
        setup="2 simulated nodes x 1 rank, gloo over loopback, no local tier; restore: node 1 lost, or durable only",
    )
    print(f"  restore after a node loss: {rbytes / 2**30:.2f} GiB per rank, medians of {args.restore_repeats}")
    for k, v in rmed.items():
        print(f"    {k:22s} {v:8.3f} s [{min(rtimes[k]):.3f}-{max(rtimes[k]):.3f}] {rbytes / v / 1e9:7.2f} GB/s")
    _plot(doc, os.path.join(args.out, "peer.png"))


def _plot(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    series = [("raw_gloo_exchange", "raw gloo\nisend/irecv"), ("replication", "replication\n(RAM commit → peer)"),
              ("save_to_peer", "save() →\nwait('peer')")]
    gbps = [doc["GB_per_s"][k] for k, _ in series]
    left.bar(range(len(series)), gbps, color=["tab:gray", "tab:blue", "tab:cyan"])
    left.set_ylim(0, max(gbps) * 1.15)
    left.set_xticks(range(len(series)), [label for _, label in series])
    left.set_ylabel("GB/s per rank (higher is better)")
    left.set_title(f"replication, {doc['GiB']:.2f} GiB per rank, ratio {doc['ratios']['replication_vs_raw']:.2f}x raw")
    for x, v in enumerate(gbps):
        left.text(x, v, f"{v:.2f}", ha="center", va="bottom")
    r = doc["restore"]
    kinds = [("restore_from_peers", "from peers\n(node 1 lost)"), ("restore_from_durable", "from durable\n(S3, moto)")]
    meds = [r["median_seconds"][k] for k, _ in kinds]
    right.bar(range(len(kinds)), meds, color=["tab:blue", "tab:orange"])
    for x, (k, _) in enumerate(kinds):
        right.plot([x] * len(r["seconds"][k]), r["seconds"][k], "k.", ms=5)
        right.text(x, meds[x], f"{meds[x]:.2f} s", ha="center", va="bottom")
    right.set_ylim(0, max(max(v) for v in r["seconds"].values()) * 1.15)
    right.set_xticks(range(len(kinds)), [label for _, label in kinds])
    right.set_ylabel("seconds (lower is better)")
    right.set_title(f"restore, {r['GiB']:.2f} GiB per rank, "
                    f"{doc['ratios']['restore_peers_speedup_vs_durable']:.2f}x faster from peers")
    fig.suptitle(f"Peer replicas: 2 simulated nodes x 1 rank, gloo on loopback, {doc['machine']['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
