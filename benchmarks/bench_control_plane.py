"""The per-save control plane of a CheckpointStore against the number of ranks: metadata bytes each
rank receives through the store's collectives, and the time spent in them, per save of an
unchanged structure (after the first save of it).

Real processes over gloo on this machine, ``--tensors`` tiny fp32 tensors per rank, each rank
holding keys of its own (as pipeline stages do, so the world's tensor count grows with the ranks);
each rank has a local directory of its own (a node each) and the durable tier (a local directory)
takes every save. After a first save, ``--saves`` saves are counted, each waited for in the durable
tier. Counting wraps the store's Group methods from outside (the pickled size of what each
collective hands a rank, a gloo object all-gather padding every message to the largest; twice
the tensor for a ring all-reduce, the tensor once a step for the flags' recursive doubling), so
the same script measures any commit of ckptstore:

    python benchmarks/bench_control_plane.py [--worlds 2 4 8] [--tensors 10000] [--saves 3] [--replicas 1]
        [--sdc] [--inventory] [--out FILE]

Reported per world size: bytes received per save by rank 0 (the durable tier's coordinator) and
the largest of the other ranks, split by group (trainer: the vote; fast: staging, RAM and local
commits; durable: the promotion), the vote's time and the time inside the fast and durable
lanes' collectives (the slowest rank's median), the thread CPU spent inside the collectives and
the process CPU of a save and its wait, per rank. ``--replicas`` adds the peer lane (each rank a
node); ``--sdc`` turns the replica check on, with every tensor replicated on every rank (data
parallel: each rank writes its share and hashes all); ``--inventory`` prints every collective a steady save issues, by group and call site (an
agreement by its own words), with its calls and bytes per save.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import pickle
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import spawn_ranks  # noqa: E402 - shared by the benchmark scripts

_WHAT: contextvars.ContextVar[str] = contextvars.ContextVar("what", default="")


def _site() -> str:
    """Where in ckptstore a collective was issued, for the inventory: the agreement's own words when
    it runs in a thread of an agreement (``concur_async`` and the like hand their collectives to
    ``asyncio.to_thread``, which carries this context but not the caller's frames), else the first
    frame outside collective.py and this script."""
    if _WHAT.get():
        return _WHAT.get()
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "ckptstore" in name and not name.endswith(("collective.py", "bench_control_plane.py")):
            return f"{os.path.basename(name)}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _rank(rank: int, world: int, init: str, root: str, tensors: int, saves: int, out: str,
          replicas: int = 0, sdc: bool = False) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import ckptstore
        import ckptstore.collective as collective
        import ckptstore.engine.pipeline as pipeline

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        job = f"bench-cp-{os.path.basename(root)}"
        # node=rank: each rank a node of its own, so replicas (when asked for) go to other ranks.
        extra: dict[str, Any] = {"peer_replicas": replicas, "node": rank} if replicas else {}
        if sdc:
            extra["sdc"] = "warn"
        store = ckptstore.CheckpointStore(job, local=os.path.join(root, f"local-{rank}"),
                                          durable=os.path.join(root, "durable"), durable_every=1, keep_local=1,
                                          keep_durable=1, timeout_s=1800, **extra)
        groups = store._groups
        roles = {id(getattr(groups, r)): r for r in ("trainer", "fast", "durable", "peer", "transfer")}
        counted: dict[str, list[float]] = {}  # role -> [bytes, seconds, thread CPU seconds]
        sites: dict[str, list[float]] = {}  # "role method site" -> [calls, bytes]
        on = [False]

        def size(obj: Any) -> int:
            return len(pickle.dumps(obj))

        def wrap(name: str, received: Any) -> None:
            real = getattr(collective.Group, name, None)
            if real is None:
                return

            def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                result = real(self, *args, **kwargs)
                if on[0] and self.world > 1:
                    c1 = time.thread_time()
                    role = roles.get(id(self), "other")
                    entry = counted.setdefault(role, [0.0, 0.0, 0.0])
                    nbytes = received(self, args, result)
                    entry[0] += nbytes
                    entry[1] += time.perf_counter() - t0
                    entry[2] += c1 - c0
                    site = sites.setdefault(f"{role} {name} {_site()}", [0, 0])
                    site[0] += 1
                    site[1] += nbytes
                return result

            setattr(collective.Group, name, counting)

        def gathered(self: Any, args: Any, out: Any) -> int:
            return 8 * (self.world - 1) + (self.world - 1) * max(map(size, out)) if out else 0

        wrap("all_gather", gathered)
        wrap("gather_to_root", gathered)
        wrap("broadcast", lambda self, args, out: 0 if self.rank == 0 else 8 + size(out))
        wrap("from_senders", lambda self, args, out: sum(8 + size(v) for r, v in out.items() if r != 0))
        def flags(self: Any, args: Any, out: Any) -> int:
            # What the agreement flags hand this rank: gloo's ring all-reduce about twice the
            # tensor; recursive doubling (from DOUBLING_FROM ranks on gloo) the tensor once a step.
            n, elements = self.world, len(args[0])
            if n < getattr(collective, "DOUBLING_FROM", n + 1) or not self._gloo():
                return 16 * elements
            p = 1 << (n.bit_length() - 1)
            steps = 1 if self.rank >= p else p.bit_length() - 1 + int(self.rank + p < n)
            return 8 * elements * steps

        wrap("max_int64", flags)
        wrap("swap_int64", lambda self, args, out: 8 * sum(args[1].values()))  # the replica check's neighbours
        vote_s: list[float] = []
        real_vote = pipeline.Pipeline._vote

        def timed_vote(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_vote(self, *args, **kwargs)
            finally:
                if on[0]:
                    vote_s.append(time.perf_counter() - t0)

        pipeline.Pipeline._vote = timed_vote

        def labelled(name: str) -> None:
            real = getattr(pipeline, name, None)
            if real is None:
                return

            async def agreement(group: Any, what: str, *args: Any, **kwargs: Any) -> Any:
                token = _WHAT.set(f"{name}({re.sub(r'step [0-9]+', 'step N', what)})")
                try:
                    return await real(group, what, *args, **kwargs)
                finally:
                    _WHAT.reset(token)

            setattr(pipeline, name, agreement)

        for name in ("concur_async", "concur_max_async", "agree_async"):
            labelled(name)
        g = torch.Generator().manual_seed(rank)
        state = {f"stage{rank}.t{i}": torch.randn(16, generator=g) for i in range(tensors)}
        if sdc:  # data parallel: every tensor replicated on every rank, compared at every save
            same = torch.Generator().manual_seed(0)
            state = {f"replicated.t{i}": torch.randn(16, generator=same) for i in range(tensors)}
        store.save(1, state).wait("durable")
        per_save = []
        for step in range(2, 2 + saves):
            counted.clear()
            on[0] = True
            t0, p0 = time.perf_counter(), time.process_time()
            handle = store.save(step, state)
            blocked = time.perf_counter() - t0
            handle.wait("durable")
            handle.wait("peer")
            wall, cpu = time.perf_counter() - t0, time.process_time() - p0
            on[0] = False
            per_save.append({"counted": {k: list(v) for k, v in counted.items()}, "wall_s": wall, "cpu_s": cpu,
                             "blocking_s": blocked})
        store.close()
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as fh:
            json.dump({"saves": per_save, "vote_s": vote_s,
                       "sites": {k: [v[0] / saves, v[1] / saves] for k, v in sorted(sites.items())}}, fh)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def run(world: int, tensors: int, saves: int, replicas: int = 0, sdc: bool = False) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="ckptstore-bench-cp-")
    out = os.path.join(root, "out")
    os.makedirs(out)
    try:
        spawn_ranks(world, _rank, root, tensors, saves, out, replicas, sdc)
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"rank-{r}.json")) as fh:
                ranks.append(json.load(fh))
    finally:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptstore-bench-cp-{os.path.basename(root)}-"):
                os.unlink(os.path.join("/dev/shm", name))
        shutil.rmtree(root, ignore_errors=True)

    def median_bytes(r: int, role: str | None = None) -> float:
        return statistics.median(sum(v[0] for k, v in s["counted"].items() if role in (None, k))
                                 for s in ranks[r]["saves"])

    def slowest_s(role: str) -> float:
        return max(statistics.median(s["counted"].get(role, [0, 0])[1] for s in rk["saves"]) for rk in ranks)

    result: dict[str, Any] = {"world": world, "tensors_per_rank": tensors, "replicas": replicas, "sdc": sdc}
    for role in (None, "trainer", "fast", "durable", "peer"):
        name = role or "all"
        result[f"coordinator_{name}_bytes"] = median_bytes(0, role)
        result[f"others_{name}_bytes"] = max(median_bytes(r, role) for r in range(1, world))
    result["vote_s"] = max(statistics.median(rk["vote_s"]) for rk in ranks)
    result["fast_collectives_s"] = slowest_s("fast")
    result["durable_collectives_s"] = slowest_s("durable")
    # What save() blocked the training loop for (the slowest rank's median): with --sdc it
    # includes hashing in place the replicas this rank does not write.
    result["save_blocking_s"] = max(statistics.median(s.get("blocking_s", 0.0) for s in rk["saves"]) for rk in ranks)
    result["save_to_durable_s"] = max(statistics.median(s["wall_s"] for s in rk["saves"]) for rk in ranks)
    # CPU this process spent inside the store's collectives per steady save (pickling, the
    # transport's copies), and the process's whole CPU over the save and its wait (every thread).
    result["collectives_cpu_s"] = [statistics.median(sum(v[2] for v in s["counted"].values()) for s in rk["saves"])
                                   for rk in ranks]
    result["process_cpu_s"] = [statistics.median(s.get("cpu_s", 0.0) for s in rk["saves"]) for rk in ranks]
    # Per call site, per steady save: calls and bytes received, on rank 0 and on the other ranks (largest).
    result["sites"] = {"coordinator": ranks[0]["sites"],
                       "others": {k: max(rk["sites"].get(k, [0, 0]) for rk in ranks[1:])
                                  for k in sorted({k for rk in ranks[1:] for k in rk["sites"]})}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=0, help="peer replicas per rank (each rank a node)")
    parser.add_argument("--sdc", action="store_true",
                        help="the replica check on (sdc='warn'), every tensor replicated on every rank")
    parser.add_argument("--inventory", action="store_true", help="print each call site's calls and bytes per save")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    rows = []
    load = os.getloadavg()[0]
    for world in args.worlds:
        row = run(world, args.tensors, args.saves, args.replicas, args.sdc)
        rows.append(row)
        mib = 1 << 20
        print(f"world {world}: received per save, rank 0 {row['coordinator_all_bytes'] / mib:.3f} MiB "
              f"(vote {row['coordinator_trainer_bytes']:.0f} B, fast {row['coordinator_fast_bytes'] / mib:.3f} MiB, "
              f"durable {row['coordinator_durable_bytes'] / mib:.3f} MiB); other ranks at most "
              f"{row['others_all_bytes'] / mib:.3f} MiB (vote {row['others_trainer_bytes']:.0f} B, "
              f"fast {row['others_fast_bytes'] / mib:.3f} MiB, durable {row['others_durable_bytes']:.0f} B); "
              f"save() blocking {row['save_blocking_s'] * 1e3:.1f} ms, vote {row['vote_s'] * 1e3:.2f} ms, fast-lane collectives {row['fast_collectives_s']:.3f} s, "
              f"durable-lane collectives {row['durable_collectives_s']:.3f} s, save to durable "
              f"{row['save_to_durable_s']:.2f} s; CPU in collectives per rank "
              f"{[round(c * 1e3, 2) for c in row['collectives_cpu_s']]} ms, process CPU per save "
              f"{[round(c, 3) for c in row['process_cpu_s']]} s", flush=True)
        if args.inventory:
            for who, table in row["sites"].items():
                for site, (calls, nbytes) in table.items():
                    print(f"  {who:11s} {site:70s} {calls:5.1f} calls {nbytes:12,.0f} B", flush=True)
    result = {"rows": rows, "load_at_start": load, "load_at_end": os.getloadavg()[0], "cpus": os.cpu_count()}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    print(f"load average {load:.2f} at the start, {result['load_at_end']:.2f} at the end", file=sys.stderr)


if __name__ == "__main__":
    main()
